"""Checkpoints inside an epoch: the train loader's position travels with Lightning's checkpoint, a run killed
mid-epoch resumes at the next batch, and the resumed run ends with the very drafter an uninterrupted one trains."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from torch.utils.data import Dataset

import dspark.training.steps as steps
from dspark.cli import main
from dspark.config import ConfigError, resolve_config
from dspark.data.datamodule import EpochSampler, ResumableLoader
from dspark.drafters.checkpoint import read_checkpoint
from dspark.sweeps.identity import hashable_config
from dspark.training.checkpointing import checkpoint_interval


class _Counted(Dataset):
    """Items are their (position, epoch); counts the loads."""

    def __init__(self, n: int) -> None:
        self.n, self.loads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, item):
        self.loads += 1
        return torch.tensor(item)


def _loader(dataset: _Counted, *, epoch: int = 0) -> ResumableLoader:
    sampler = EpochSampler(len(dataset), seed=3)
    sampler.set_epoch(epoch)
    return ResumableLoader(dataset, batch_size=3, sampler=sampler)


@pytest.mark.parametrize("epoch", [0, 2])
def test_a_loader_restored_from_its_state_yields_the_rest_of_the_epoch_without_loading_the_skipped(epoch):
    whole = [b.tolist() for b in _loader(_Counted(20), epoch=epoch)]
    assert len(whole) == 7 and all(row[1] == epoch for batch in whole for row in batch)

    first = _loader(_Counted(20), epoch=epoch)
    iterator = iter(first)
    taken = [next(iterator).tolist() for _ in range(4)]
    state = first.state_dict()
    assert state == {"batches": 4} and taken == whole[:4]

    dataset = _Counted(20)
    resumed = _loader(dataset, epoch=0)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(epoch)  # as Lightning does after loading the state, before the first batch
    rest = [b.tolist() for b in resumed]
    assert rest == whole[4:]
    assert dataset.loads == 20 - 12  # the 4 skipped batches were never loaded
    assert resumed.state_dict() == {"batches": 7}
    assert [b.tolist() for b in resumed] == whole  # the skip is spent: the next epoch starts at its start


def test_a_loader_state_from_other_data_is_refused():
    with pytest.raises(ValueError, match="other data"):
        _loader(_Counted(5)).load_state_dict({"batches": 3})


def test_checkpoint_interval_config_is_checked_and_left_out_of_sweep_hashes():
    assert checkpoint_interval(0) is None and checkpoint_interval(2.5) == 150.0
    with pytest.raises(ValueError, match="checkpoint_every_min"):
        checkpoint_interval(-1)
    with pytest.raises(ConfigError, match="trainer.checkpoint_every_min"):
        resolve_config(["budget=smoke", "trainer.checkpoint_every_min=-1"])
    a = resolve_config(["budget=smoke"])
    b = resolve_config(["budget=smoke", "trainer.checkpoint_every_min=0.5"])
    assert hashable_config(a) == hashable_config(b)  # how a run is kept, not what it is


def _interrupting_loss(monkeypatch, *, after: int) -> None:
    """The training loss raises KeyboardInterrupt (as Ctrl-C would, inside fit) on its training call number
    `after`+1 (validation calls, without gradients, are not counted)."""
    real, calls = steps.compute_dspark_loss, {"n": 0}

    def loss(*args, **kwargs):
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] > after:
                raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(steps, "compute_dspark_loss", loss)


def _last(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def test_a_run_killed_mid_epoch_resumes_there_and_trains_the_same_drafter(tmp_path, monkeypatch, one_thread, capsys):
    # two epochs of one-sequence batches; a checkpoint after every batch (any positive interval has passed). The
    # kill falls in the second epoch, so the resumed loader must also replay that epoch's order and anchors
    argv = [
        "stage=train",
        "budget=smoke",
        f"paths.root={tmp_path}",
        "optim.epochs=2",
        "data.batch_size=1",
        "trainer.checkpoint_every_min=1e-9",
    ]
    assert main(argv) == 0
    run_dir = next((tmp_path / "runs").iterdir())
    whole = read_checkpoint(run_dir / "drafter.pt")["state_dict"]
    total = _last(run_dir)["global_step"]
    per_epoch = total // 2
    assert per_epoch >= 6
    shutil.rmtree(run_dir)  # the data caches stay: the second run trains on the same sequences

    killed_at = per_epoch + 3
    with monkeypatch.context() as patch:
        _interrupting_loss(patch, after=killed_at)  # killed in the step after `killed_at` checkpointed ones
        assert main(argv) == 130
    last = _last(run_dir)
    assert last["global_step"] == killed_at and last["epoch"] == 1
    assert last["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"batches": 3}]
    assert not (run_dir / "drafter.pt").exists()

    capsys.readouterr()
    assert main(argv) == 0  # resumes with the 4th batch of the second epoch
    # its progress bar names the epoch and counts from the batches done to the epoch's length (Lightning skips the
    # epoch-start hook that sets both for a resumed epoch: the bar read `Training: 4/?`)
    bar = capsys.readouterr().out
    assert re.search(rf"Epoch 1: +\d+%\|[^|]*\| 3/{per_epoch} ", bar) and f" {per_epoch}/{per_epoch} " in bar, bar[
        -500:
    ]
    assert not [n for n in re.findall(r"(\d+)/\?", bar) if int(n) > 0], bar[-500:]  # no batch count without a total
    resumed = read_checkpoint(run_dir / "drafter.pt")["state_dict"]
    assert _last(run_dir)["global_step"] == total
    assert resumed.keys() == whole.keys()
    differ = [k for k in whole if not torch.equal(whole[k], resumed[k])]
    assert not differ, f"the resumed drafter differs from the uninterrupted one in {differ[:5]}"
