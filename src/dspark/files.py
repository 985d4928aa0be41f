"""All-or-nothing output files, and the errors a full disk or a read-only directory gives.

Every result file (drafter.pt, reports, plots, run records) is written to a temporary file in the same directory
and `os.replace`d over the destination, so a crash, a full disk or a kill mid-write leaves either the previous
good file or none, never a half-written one that a later run would load. A failed write raises `OutputError`
naming the path and the fix, and removes its temporary file.

Nothing of anyone else's is overwritten: an output location is claimed (`claim_output_dir`, `check_output_file`)
before any work, and refused with `ForeignOutputError` when it holds what we did not write (the section below).
"""

from __future__ import annotations

import errno
import json
import os
import re
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
FULL = (errno.ENOSPC, errno.EDQUOT)


class OutputError(OSError):
    """Writing an output failed; `str()` names the path, the cause and what to do."""


def describe_write_failure(path: Path, err: OSError, *, key: str = "paths.root") -> str:
    """One line: which file, why, the fix, and that nothing was replaced."""
    reason = err.strerror or str(err)
    if err.errno in FULL:
        fix = f"free disk space there or point {key} at another disk"
    elif err.errno in READ_ONLY:
        fix = f"the directory is read-only: make it writable or point {key} at a writable directory"
    else:
        fix = f"check the directory, or point {key} elsewhere"
    return f"could not write {path} ({reason}); {fix}. Nothing was replaced: a previous {Path(path).name} is unchanged."


@contextmanager
def atomic_output(path: str | Path, *, mode: str = "wb", key: str = "paths.root") -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on success it replaces `path` (fsynced, then
    `os.replace`, atomic on POSIX); on any error it is removed, and an error caused by an OSError (ENOSPC,
    EROFS, ...) becomes `OutputError`; others propagate unchanged.

    `mode` is "wb" or "w" (text, UTF-8). `key` is the config key the fix names.
    """
    with _replacing(Path(path), key=key) as tmp:
        with open(tmp, mode.replace("w", "x"), **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())


@contextmanager
def atomic_path(path: str | Path, *, key: str = "paths.root") -> Iterator[Path]:
    """`atomic_output` for a writer that takes a file name (safetensors' `save_file`): yields the temporary path
    beside `path`, which replaces `path` when the block succeeds and is removed when it fails."""
    with _replacing(Path(path), key=key) as tmp:
        yield tmp
        with open(tmp, "rb") as handle:  # the writer closed it: sync what it wrote before the rename
            os.fsync(handle.fileno())


@contextmanager
def _replacing(path: Path, *, key: str) -> Iterator[Path]:
    """The all-or-nothing frame both writers share: a unique temporary path beside `path` that replaces it when the
    block succeeds; on failure it is removed and an OSError cause becomes `OutputError` (`_failure`)."""
    tmp = _temporary(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        os.replace(tmp, path)
    except BaseException as err:
        failure = _failure(err, tmp=tmp, path=path, key=key)
        if failure is None:
            raise
        raise failure from err


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")  # unique: writers may race


def _failure(err: BaseException, *, tmp: Path, path: Path, key: str) -> OutputError | None:
    """Remove the temporary file; the `OutputError` that replaces `err` when an OSError caused it, else None
    (`err` propagates unchanged)."""
    _remove(tmp)
    cause = _os_error_in(err)
    if cause is None or isinstance(err, OutputError):
        return None
    return OutputError(cause.errno, describe_write_failure(path, cause, key=key))


def atomic_write_text(path: str | Path, text: str, *, key: str = "paths.root") -> Path:
    """Write `text` (UTF-8) to `path` all-or-nothing; returns `path`."""
    with atomic_output(path, mode="w", key=key) as handle:
        handle.write(text)
    return Path(path)


def atomic_write_bytes(path: str | Path, data: bytes, *, key: str = "paths.root") -> Path:
    with atomic_output(path, mode="wb", key=key) as handle:
        handle.write(data)
    return Path(path)


def _os_error_in(err: BaseException) -> OSError | None:
    """The OSError behind `err`: itself, or one it was raised from or while handling (torch.save's zip writer
    turns a failed write into `RuntimeError: ... unexpected pos`), or the OS error number a library names in its
    message (safetensors' writer raises `SafetensorError: ... (os error 28)`)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError) and err.errno is not None:
            return err
        if found := _OS_ERROR_IN_MESSAGE.search(str(err)):
            code = int(found.group(1))
            return OSError(code, os.strerror(code))
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


_OS_ERROR_IN_MESSAGE = re.compile(r"\(os error (\d+)\)")


def _remove(path: Path) -> None:
    """Best effort: on a read-only file system even a missing file's unlink fails (EROFS, not ENOENT)."""
    try:
        path.unlink()
    except OSError:
        pass


def check_writable_dir(path: str | Path, *, key: str) -> str | None:
    """None when `path` takes a new file (a missing `path`: when its nearest existing parent does, so it can be
    made; nothing is created), else a message naming `key`, the path and the fix. Preflight calls it so a read-only
    or full output directory stops the run before any work."""
    path = Path(path).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), path)  # where creating `path` would start
    probe = existing / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        if not existing.is_dir():  # a file where a directory of the path must go: it can never be made
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
        with open(probe, "xb") as handle:
            handle.write(b"probe")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        where = path if path.is_dir() else next((p for p in path.parents if p.is_dir()), path)
        return (
            f"{key}={path} is not writable ({err.strerror or err}, at {where}); make it writable, free space "
            f"there, or set {key} to a writable directory."
        )
    finally:
        _remove(probe)
    return None


# ---- ownership: a run writes only where nothing of anyone else's can be overwritten ----
#
# Every output location a user can point somewhere (paths.root, paths.reports, export.out_dir, a benchmark's
# --output, the files of results/) is either new, empty, or holds our own earlier output; anything else is refused
# before any work, with the location, a few of the names found there and the fix. A directory is ours when it holds
# OUTPUT_MARKER (written when it is claimed), or, for output written before markers existed, when every entry in it
# is one the location's `ours` predicate recognises. A single file is overwritten only when `ours` recognises it.

OUTPUT_MARKER = ".dspark-output.json"
WRITER = "dspark-lab"
#: The first bytes of the markdown our writers emit: a sweep report, an evaluation report, results/INDEX.md, and
#: results/ front matter (its first field is always `question`).
MARKDOWN_OPENINGS = ("# Sweep `", "# Evaluation — ", "# Results — ", "---\nquestion: ")
SHOWN_ENTRIES = 4  # names a refusal lists before "and N more"


class ForeignOutputError(ValueError):
    """An output location holds something we did not write; `str()` names it, what is there and the fix."""


def _never(path: Path) -> bool:
    return False


def read_marker(folder: str | Path) -> dict | None:
    """The marker of a directory we claimed (`{"written_by": WRITER, "kinds": [...]}`), or None."""
    try:
        data = json.loads((Path(folder) / OUTPUT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("written_by") == WRITER else None


def _transient(name: str) -> bool:
    """Our own temporaries: `check_writable_dir`'s probe and `atomic_output`'s file before its rename."""
    return name.startswith(".write-probe-") or (name.startswith(".") and name.endswith(".tmp"))


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN_ENTRIES])
    return shown + (f" and {len(names) - SHOWN_ENTRIES} more" if len(names) > SHOWN_ENTRIES else "")


def output_dir_error(path: str | Path, *, key: str, ours: Callable[[Path], bool] = _never) -> str | None:
    """None when the directory `path` may take our output: it does not exist, is empty, holds our marker, or holds
    only entries `ours` recognises (our output from before markers); else the refusal, naming `key`, the directory,
    a few of the entries that are not ours, and the fix. Reads only."""
    path = Path(path).expanduser()
    if not path.exists():
        return None
    if not path.is_dir():
        return f"{key}={path} is a file, not a directory; nothing was written. Set {key} to a new or empty directory."
    if read_marker(path) is not None:
        return None
    try:
        names = sorted(os.listdir(path))
    except OSError as err:
        return f"{key}={path} cannot be listed ({err.strerror or err}); set {key} to a directory of your own."
    foreign = [name for name in names if not _transient(name) and not ours(path / name)]
    if not foreign:
        return None
    return (
        f"{key}={path} is not empty and holds no output of ours ({_few(foreign)}); nothing was written there. "
        f"Set {key} to a new or empty directory (or one of our earlier outputs), or move those files away."
    )


def claim_output_dir(path: str | Path, *, key: str, kind: str, ours: Callable[[Path], bool] = _never) -> Path:
    """Make `path` ours before writing into it: refuse (`ForeignOutputError`) what `output_dir_error` refuses, else
    create it and mark it (`OUTPUT_MARKER`, listing `kind` — export, reports, root, ...) so that a later run knows
    whatever it holds then as ours. Returns `path`."""
    path = Path(path).expanduser()
    error = output_dir_error(path, key=key, ours=ours)
    if error is not None:
        raise ForeignOutputError(error)
    marker = read_marker(path) or {"written_by": WRITER, "kinds": []}
    if kind not in marker["kinds"]:
        marker["kinds"] = sorted({*marker["kinds"], kind})
        atomic_write_text(path / OUTPUT_MARKER, json.dumps(marker, indent=1) + "\n", key=key)
    return path


def output_file_error(
    path: str | Path, *, key: str, ours: Callable[[Path], bool], fix: str | None = None
) -> str | None:
    """None when the file `path` may be (over)written: it does not exist, or `ours` recognises it as one we wrote;
    else the refusal, naming `key` (a config key or flag, or a folder such as `results/`), the file and `fix`
    (default: name a new file for `key`). Reads only."""
    path = Path(path).expanduser()
    where = str(path) if key.endswith("/") else f"{key}={path}"
    fix = fix or f"Name a new file for {key}, or move that one away."
    if not path.exists():
        return None
    if path.is_dir():
        return f"{where} is a directory, not a file; nothing was written. {fix}"
    if ours(path):
        return None
    return f"{where} is a file that DSpark Lab did not write; it was left as it is and nothing was written. {fix}"


def check_output_file(path: str | Path, *, key: str, ours: Callable[[Path], bool], fix: str | None = None) -> Path:
    """`path` when `output_file_error` allows writing it, else `ForeignOutputError`."""
    error = output_file_error(path, key=key, ours=ours, fix=fix)
    if error is not None:
        raise ForeignOutputError(error)
    return Path(path)


def head_text(path: Path, size: int = 4096) -> str:
    """The first `size` bytes of a file as text ("" when unreadable)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(size).decode("utf-8", errors="replace")
    except OSError:
        return ""


def is_our_markdown(path: Path) -> bool:
    """A markdown file one of our report writers emitted (`MARKDOWN_OPENINGS`)."""
    return head_text(path, 64).startswith(MARKDOWN_OPENINGS)


def is_our_figure(path: Path) -> bool:
    """A PNG written by matplotlib (every figure of ours is): the PNG signature and its `Software` text chunk."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(256)
    except OSError:
        return False
    return head.startswith(b"\x89PNG\r\n\x1a\n") and b"Matplotlib" in head


def is_report_entry(path: Path) -> bool:
    """What our report writers leave in paths.reports: reports, their figures and claims, and the hand-written
    `<name>.notes.md` they read."""
    name = path.name
    if not path.is_file():
        return False
    if name.endswith((".notes.md", ".claims.json")):
        return True
    return is_our_figure(path) if name.endswith(".png") else name.endswith(".md") and is_our_markdown(path)
