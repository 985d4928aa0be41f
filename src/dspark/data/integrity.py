"""Integrity of the data caches (regenerated / reference datasets, feature caches): checksums in the manifest,
verification on reuse, and one builder per cache at a time.

A cache directory is finished when its `COMPLETE` marker exists. `seal_cache` records every file's size and
sha256 in the manifest (`checksums`) before writing that marker; `building(out_dir)` takes the cache's lock file
(`.lock` inside it, so a second process preparing the same cache waits and then reuses the first one's
result) and tells the builder whether a whole finished cache is already there. A finished cache whose files no
longer match their checksums (cut off, bit-flipped, deleted) loses those files and its marker, with a warning, so
the builder regenerates exactly them (builders skip the shards that exist): damaged data is rebuilt, never
trained on. Caches sealed before checksums existed are reused unverified.

Verification reads every file once per process (sha256, ~0.4 GB/s on 2 busy cores: ~2 s for the cpu budget's
0.8 GB feature cache); later reuses in the same process only compare sizes and mtimes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from dspark.files import OutputError, atomic_write_bytes

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
CHECKSUMS = "checksums"
LOCK = ".lock"  # inside the cache directory, so listings of the caches stay one entry per cache
log = logging.getLogger("dspark")
_verified: dict[str, tuple] = {}  # cache dir → (name, size, mtime_ns) of its files when last verified here


def file_digest(path: Path) -> dict[str, Any]:
    """{"bytes": size, "sha256": hex digest} of one file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(8 << 20), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def seal_cache(out_dir: Path, manifest: dict[str, Any], files: list[str]) -> None:
    """Record the checksums of `files` (names inside out_dir) in the manifest, write it, then the COMPLETE marker."""
    manifest[CHECKSUMS] = {name: file_digest(out_dir / name) for name in files}
    atomic_write_bytes(out_dir / MANIFEST, json.dumps(manifest, indent=2).encode(), key="paths.root")
    atomic_write_bytes(out_dir / COMPLETE, b"", key="paths.root")
    _verified[str(out_dir)] = _fingerprint(out_dir, files)


def read_cache_manifest(out_dir: Path) -> dict[str, Any]:
    """The manifest of a cache directory; a ValueError naming the file and the fix when it is missing or not a
    JSON object (a finished cache with such a manifest is rebuilt by `building`)."""
    path = Path(out_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not valid JSON"
        raise ValueError(f"{path} cannot be read ({reason}); {_REBUILD.format(dir=out_dir)}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} is not a JSON object; {_REBUILD.format(dir=out_dir)}")
    return manifest


_REBUILD = "delete {dir} and rerun the same command: it rebuilds the cache"


def damaged_files(out_dir: Path) -> list[str] | None:
    """Names of a finished cache's files that are missing or differ from their recorded size / sha256 ([] when all
    match); None when the manifest records no checksums (an older cache) or cannot be read."""
    try:
        recorded = json.loads((out_dir / MANIFEST).read_text()).get(CHECKSUMS)
    except (OSError, ValueError):
        return None
    if not recorded:
        return None
    fingerprint = _fingerprint(out_dir, list(recorded))
    if _verified.get(str(out_dir)) == fingerprint:
        return []
    bad = [
        name
        for name, want in recorded.items()
        if not (out_dir / name).is_file()
        or (out_dir / name).stat().st_size != want["bytes"]
        or file_digest(out_dir / name)["sha256"] != want["sha256"]
    ]
    if not bad:
        _verified[str(out_dir)] = fingerprint
    return bad


def _fingerprint(out_dir: Path, files: list[str]) -> tuple:
    stats = [(out_dir / name).stat() if (out_dir / name).is_file() else None for name in files]
    return tuple((name, s.st_size, s.st_mtime_ns) if s else (name,) for name, s in zip(files, stats))


@contextmanager
def building(out_dir: Path) -> Iterator[bool]:
    """Hold `out_dir`'s lock; yield True when a whole finished cache is there (reuse it), else False (build or
    finish it inside the block, ending with `seal_cache`). Damaged files of a finished cache are removed first."""
    from filelock import FileLock

    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(out_dir / LOCK))
        lock.acquire()
    except OSError as err:  # a full disk or a read-only cache root: name the directory, not a bare errno
        raise OutputError(err.errno, _unwritable(out_dir, err)) from err
    try:
        yield _whole_or_reset(out_dir)
    finally:
        lock.release()


@contextmanager
def resumable() -> Iterator[None]:
    """Around a shard's write: its `OutputError` (a full disk mid-build) also says that the cache's finished shards
    are kept and the same command resumes from them (builders skip the shards that exist)."""
    try:
        yield
    except OutputError as err:
        note = "The cache's finished shards are kept: rerun the same command to resume."
        raise OutputError(err.errno, f"{err.strerror} {note}") from err


def _unwritable(out_dir: Path, err: OSError) -> str:
    full = err.errno in (errno.ENOSPC, errno.EDQUOT)
    fix = "free disk space there" if full else "make it writable"
    return (
        f"could not create the cache directory {out_dir} ({err.strerror or err}); {fix}, or point paths.root at "
        "another disk. Nothing was written."
    )


def _whole_or_reset(out_dir: Path) -> bool:
    if not (out_dir / COMPLETE).exists():
        return False
    try:
        read_cache_manifest(out_dir)
    except ValueError:
        log.warning("cache %s has no readable manifest: rebuilding it", out_dir)
        _remove_all(out_dir)
        return False
    bad = damaged_files(out_dir)
    if not bad:  # whole, or an older cache without checksums (None)
        return True
    log.warning(
        "cache %s: %d file(s) do not match the checksums in its manifest (%s): rebuilding them",
        out_dir,
        len(bad),
        ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""),
    )
    for name in [*bad, COMPLETE]:
        (out_dir / name).unlink(missing_ok=True)
    _verified.pop(str(out_dir), None)
    return False


def _remove_all(out_dir: Path) -> None:
    for path in out_dir.iterdir():
        if path.is_file() and path.name != LOCK:  # the lock is held by this process: keep its file
            os.unlink(path)
