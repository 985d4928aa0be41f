"""Outputs are all-or-nothing (issue 14, "disk full / read-only output dir"): a full disk mid-write or a read-only
directory gives an error naming the path and the fix, leaves no half-written file and keeps the previous good one.

The full disk is a monkeypatched `open` in `dspark.files` whose writes raise ENOSPC after a byte budget; the
read-only directory is real (chmod for ordinary users; root ignores modes, so for root a read-only tmpfs is
mounted when the container allows it, else the test is skipped).
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch

from dspark import files
from dspark.files import OutputError, atomic_output, atomic_write_text, check_writable_dir


class _FillingDisk:
    """A file whose writes succeed until `budget` bytes, then write what fits and raise ENOSPC."""

    def __init__(self, handle, budget: int):
        self._handle, self._left = handle, budget

    def write(self, data):
        if len(data) > self._left:
            self._handle.write(data[: self._left])
            self._left = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self._left -= len(data)
        return self._handle.write(data)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()


@pytest.fixture
def full_disk(monkeypatch):
    """After this many bytes of any output file, the disk is full."""

    def install(budget: int):
        real_open = open
        monkeypatch.setattr(files, "open", lambda *a, **k: _FillingDisk(real_open(*a, **k), budget), raising=False)

    return install


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".write-probe"))


def test_atomic_write_replaces_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "sub" / "report.md"
    atomic_write_text(path, "first\n")
    atomic_write_text(path, "second\n")
    assert path.read_text() == "second\n" and _leftovers(path.parent) == []
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # an ordinary file, not mkstemp's 0600


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("budget", [0, 5, 1000])
def test_disk_full_midway_keeps_the_previous_report(budget, tmp_path, full_disk):
    path = atomic_write_text(tmp_path / "main.md", "the previous good report\n")
    full_disk(budget)
    with pytest.raises(OutputError) as err:
        atomic_write_text(path, "x" * 5000)
    message = str(err.value)
    assert str(path) in message and "No space left" in message and "free disk space" in message
    assert err.value.errno == errno.ENOSPC
    assert path.read_text() == "the previous good report\n" and _leftovers(tmp_path) == []


def test_disk_full_while_saving_a_checkpoint_keeps_the_previous_one(tmp_path, full_disk):
    """torch.save streams into the handle: ENOSPC after 10 kB of a ~400 kB payload."""
    path = tmp_path / "drafter.pt"
    with atomic_output(path) as handle:
        torch.save({"w": torch.zeros(3)}, handle)
    full_disk(10_000)
    with pytest.raises(OutputError, match="drafter.pt"):
        with atomic_output(path) as handle:
            torch.save({"w": torch.randn(100_000)}, handle)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.zeros(3)) and _leftovers(tmp_path) == []


def test_an_error_inside_the_writer_removes_the_temp_file(tmp_path):
    path = atomic_write_text(tmp_path / "a.json", "{}")
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(path, mode="w") as handle:
            handle.write("{half")
            raise KeyboardInterrupt
    assert path.read_text() == "{}" and _leftovers(tmp_path) == []


def test_a_figure_is_written_whole_or_not_at_all(tmp_path, full_disk):
    from matplotlib.figure import Figure

    from dspark.plotting import save_figure

    fig = Figure()
    fig.add_subplot().plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "plot.png")
    good = path.read_bytes()
    assert good[:8] == b"\x89PNG\r\n\x1a\n"
    full_disk(100)
    with pytest.raises(OutputError, match="plot.png"):
        save_figure(fig, path)
    assert path.read_bytes() == good and _leftovers(tmp_path) == []


@pytest.fixture
def read_only_dir(tmp_path):
    """A real directory the process cannot write to, holding one good file (`good.md`)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        (folder / "good.md").write_text("good\n")
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "dspark-test", str(folder)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        pytest.skip("running as root, which ignores directory modes, and no tmpfs can be mounted here")
    try:
        (folder / "good.md").write_text("good\n")
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True, capture_output=True)
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


def test_a_read_only_directory_is_named_and_its_files_survive(read_only_dir):
    with pytest.raises(OutputError) as err:
        atomic_write_text(read_only_dir / "good.md", "new\n", key="paths.reports")
    assert str(read_only_dir / "good.md") in str(err.value) and "paths.reports" in str(err.value)
    assert "read-only" in str(err.value)
    assert (read_only_dir / "good.md").read_text() == "good\n"
    message = check_writable_dir(read_only_dir, key="paths.root")
    assert message is not None and message.startswith(f"paths.root={read_only_dir} is not writable")
    assert check_writable_dir(read_only_dir / "new" / "deeper", key="paths.root") is not None


def test_a_missing_directory_under_a_writable_parent_passes_and_nothing_is_created(tmp_path):
    assert check_writable_dir(tmp_path / "a" / "b", key="paths.root") is None
    assert not (tmp_path / "a").exists() and _leftovers(tmp_path) == []  # probed in the parent, then removed
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert check_writable_dir(tmp_path / "a" / "b", key="paths.root") is None
    assert _leftovers(tmp_path / "a" / "b") == []


# ---- Lightning's last.ckpt before resuming ----


def _checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    real = folder / "epoch=3-step=12.ckpt"
    torch.save({"state_dict": {"w": torch.arange(50_000, dtype=torch.float32)}, "epoch": 3}, real)
    (folder / "last.ckpt").symlink_to(real.name)
    return folder / "last.ckpt"


def test_a_whole_checkpoint_is_resumed(tmp_path, caplog):
    from dspark.stages.train import resumable_checkpoint

    last = _checkpoint(tmp_path / "checkpoints")
    with caplog.at_level("INFO", logger="dspark"):
        assert resumable_checkpoint(last) == last
    assert "resuming training from" in caplog.text


@pytest.mark.parametrize("damage", ["cut", "bit-flip", "dangling"])
def test_a_damaged_checkpoint_is_set_aside_and_training_starts_over(damage, tmp_path, caplog):
    from dspark.stages.train import resumable_checkpoint

    last = _checkpoint(tmp_path / "checkpoints")
    real = last.resolve()
    data = bytearray(real.read_bytes())
    if damage == "cut":
        real.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "bit-flip":  # inside the tensor's bytes: the zip still opens, its CRC does not match
        data[len(data) // 2] ^= 0x10
        real.write_bytes(bytes(data))
    else:
        real.unlink()
    with caplog.at_level("WARNING", logger="dspark"):
        assert resumable_checkpoint(last) is None
    assert not last.exists() and not last.is_symlink()  # Lightning relinks it at the next save
    if damage != "dangling":
        assert "is damaged" in caplog.text and (real.parent / (real.name + ".damaged")).exists()
    else:
        assert "missing checkpoint" in caplog.text


def test_disk_full_when_exporting_the_drafter_fails_cleanly_and_the_rerun_exports(
    tmp_path, monkeypatch, capsys, caplog, one_thread
):
    """The run fails naming drafter.pt and the fix, leaves no drafter.pt or temp file, keeps last.ckpt; the rerun
    resumes from it and exports."""
    from dspark.cli import main

    real_open = open

    def open_filling_drafter(path, *args, **kwargs):
        handle = real_open(path, *args, **kwargs)
        return _FillingDisk(handle, 2000) if ".drafter.pt." in str(path) else handle

    monkeypatch.setattr(files, "open", open_filling_drafter, raising=False)
    argv = ["stage=train", "budget=smoke", f"paths.root={tmp_path}", "optim.epochs=1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert f"could not write {run_dir / 'drafter.pt'}" in err and "No space left" in err, err
    assert not (run_dir / "drafter.pt").exists() and _leftovers(run_dir) == []
    assert (run_dir / "checkpoints" / "last.ckpt").exists()

    monkeypatch.setattr(files, "open", real_open, raising=False)
    with caplog.at_level("INFO", logger="dspark"):
        assert main(argv) == 0
    assert "resuming training from" in caplog.text
    from dspark.drafters.checkpoint import read_checkpoint

    assert read_checkpoint(run_dir / "drafter.pt")["state_dict"]
