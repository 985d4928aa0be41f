"""All-or-nothing output files, and the errors a full disk or a read-only directory gives.

Every result file (drafter.pt, reports, plots, run records) is written to a temporary file in the same directory
and `os.replace`d over the destination, so a crash, a full disk or a kill mid-write leaves either the previous
good file or none, never a half-written one that a later run would load. A failed write raises `OutputError`
naming the path and the fix, and removes its temporary file.
"""

from __future__ import annotations

import errno
import os
import uuid
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
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")  # unique: writers may race
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, mode.replace("w", "x"), **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        _remove(tmp)
        cause = _os_error_in(err)
        if cause is None or isinstance(err, OutputError):
            raise
        raise OutputError(cause.errno, describe_write_failure(path, cause, key=key)) from err


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
    turns a failed write into `RuntimeError: ... unexpected pos`)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError) and err.errno is not None:
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _remove(path: Path) -> None:
    """Best effort: on a read-only file system even a missing file's unlink fails (EROFS, not ENOENT)."""
    try:
        path.unlink()
    except OSError:
        pass


def check_writable_dir(path: str | Path, *, key: str) -> str | None:
    """None when `path` (created if missing) takes a new file, else a message naming `key`, the path and the fix.
    Preflight calls it so a read-only or full output directory stops the run before any work."""
    path = Path(path).expanduser()
    probe = path / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
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
