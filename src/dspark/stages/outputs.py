"""The output locations of a run, checked and claimed before any work (`output_location_errors`, which preflight
calls in place of a bare writability check).

A run writes everything under `paths.root` (the MLflow store, caches, run directories, ledgers, sweep records) and
its markdown reports into `paths.reports`; `export.out_dir` is checked by the export stage's own preflight
(`dspark.stages.export.preflight_errors`). Each directory is new, empty or ours (`dspark.files.claim_output_dir`:
our marker, or, from before markers, only names we write there), else the run is refused naming it. The repository's
own `outputs/` (the default root, git-ignored) is ours by construction: never refused, never marked (only checked
for writability, like every location).

A store named by path is checked too: an existing SQLite file at `tracking.uri` or `optuna.storage` must be
MLflow's or Optuna's (either would add its tables to someone else's database), and an `optuna.storage` journal file
must be Optuna's journal (it would append to any file). A file neither can read is left to their own checks.
"""

from __future__ import annotations

import fnmatch
import json
import sqlite3
from pathlib import Path
from typing import Any, Callable

from dspark.config import repo_root
from dspark.files import check_writable_dir, claim_output_dir, head_text, is_report_entry, output_dir_error

#: What a run writes directly under paths.root (dspark.tracking.store, dspark.stages.context, the sweep driver and
#: ledger, dspark.sweeps.optuna_study, benchmarks/common.py), and the `logs/` people keep beside them.
ROOT_ENTRIES = frozenset(
    {
        "mlflow.db",
        ".mlflow.db.lock",
        "mlartifacts",
        "cache",
        "runs",
        "reports",
        "ledgers",
        "sweeps",
        "latency",
        "optuna.db",
        "optuna.db.lock",
        "benchmarks",
        "logs",
    }
)
ROOT_PATTERNS = ("mlflow.db-*", "optuna.db-*", "optuna-*.lock")  # SQLite's journal / WAL files, Optuna's locks
#: What `<paths.root>/cache` (and a benchmark's --cache-dir) holds.
CACHE_ENTRIES = frozenset({"datasets", "features", "hardware", "locks", "regen", "sps", "targets"})
MLFLOW_TABLES = {"experiments", "runs"}
OPTUNA_TABLES = {"studies", "trials"}


def is_root_entry(path: Path) -> bool:
    """A name a run writes directly under paths.root."""
    return path.name in ROOT_ENTRIES or any(fnmatch.fnmatch(path.name, p) for p in ROOT_PATTERNS)


def is_cache_entry(path: Path) -> bool:
    return path.is_dir() and path.name in CACHE_ENTRIES


def in_default_root(path: str | Path) -> bool:
    """Inside the repository's own `outputs/`."""
    default = (repo_root() / "outputs").resolve()
    resolved = Path(path).expanduser().resolve()
    return resolved == default or default in resolved.parents


def output_location_errors(cfg: Any) -> list[str]:
    """Preflight's checks of where the run writes; returns the refusals (empty: all is well). Creates nothing:
    `claim_output_locations` marks the accepted locations once every preflight check has passed.

    First ownership, reading only: paths.root and paths.reports must be new, empty or ours, and a location inside a
    refused one is not looked at, so a refused directory is left exactly as it was. Then the accepted ones must take
    a file (`check_writable_dir`). stage=report only reads the store under paths.root: there, paths.reports alone is
    checked. Last, the stores named by path (`store_file_errors`)."""
    errors, refused = [], []
    for key, path, _, ours in _locations(cfg):
        if any(path == r or r in path.parents for r in refused):
            continue
        error = None if in_default_root(path) else output_dir_error(path, key=key, ours=ours)
        if error is not None:
            errors.append(error)
            refused.append(path)
        elif unwritable := check_writable_dir(path, key=key):
            errors.append(unwritable)
    return errors + store_file_errors(cfg)


def claim_output_locations(cfg: Any) -> None:
    """Create and mark (`claim_output_dir`) the locations `output_location_errors` accepted: the last step of a
    preflight that passed, so a refused run leaves nothing behind. The repository's own outputs/ needs no mark."""
    for key, path, kind, ours in _locations(cfg):
        if in_default_root(path):
            path.mkdir(parents=True, exist_ok=True)
        else:
            claim_output_dir(path, key=key, kind=kind, ours=ours)


def _locations(cfg: Any) -> list[tuple[str, Path, str, Callable[[Path], bool]]]:
    """(key, directory, kind, the predicate of entries we write there) of the run's output locations."""
    locations = [("paths.reports", Path(cfg.paths.reports), "reports", is_report_entry)]
    if cfg.stage != "report":  # a report reads the store under paths.root and writes only into paths.reports
        locations.insert(0, ("paths.root", Path(cfg.paths.root), "root", is_root_entry))
    return locations


def store_file_errors(cfg: Any) -> list[str]:
    """`tracking.uri` / `optuna.storage` naming a local file that belongs to something else."""
    errors = []
    uri = cfg.tracking.uri
    if uri.startswith("sqlite:///"):
        errors.append(_database_error(Path(uri[len("sqlite:///") :]), key="tracking.uri", tables=MLFLOW_TABLES))
    storage = cfg.optuna.storage if cfg.sweep else ""
    if storage.startswith("sqlite:///"):
        errors.append(_database_error(Path(storage[len("sqlite:///") :]), key="optuna.storage", tables=OPTUNA_TABLES))
    elif storage and "://" not in storage:
        errors.append(_journal_error(Path(storage).expanduser()))
    return [e for e in errors if e]


def _database_error(path: Path, *, key: str, tables: set[str]) -> str | None:
    """A refusal when `path` is an SQLite database with tables but not `tables` (someone else's database)."""
    found = _sqlite_tables(path)
    if not found or tables <= found:
        return None
    names = ", ".join(sorted(found)[:4]) + (" ..." if len(found) > 4 else "")
    return (
        f"{key}={path} is an SQLite database of something else (tables {names}); nothing was written to it. Point "
        f"{key} at a new file or at a store this platform created."
    )


def _sqlite_tables(path: Path) -> set[str]:
    """The table names of an SQLite file, opened read-only; empty when it is missing, empty or unreadable."""
    if not path.is_file() or not head_text(path, 16).startswith("SQLite format 3"):
        return set()
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error:
        return set()


def _journal_error(path: Path) -> str | None:
    """A refusal when `path` is a non-empty file whose first line is not an Optuna journal record (a first line
    still being written by another worker, a `{` without its newline yet, passes)."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    first, newline, _ = head_text(path).partition("\n")
    if not newline:
        ours = first.startswith("{")
    else:
        try:
            record = json.loads(first)
        except ValueError:
            record = None
        ours = isinstance(record, dict) and "op_code" in record
    if ours:
        return None
    return (
        f"optuna.storage={path} is a file that is not an Optuna journal; nothing was appended to it. Point "
        "optuna.storage at a new file, an existing journal of ours, or leave it empty for sqlite under paths.root."
    )
