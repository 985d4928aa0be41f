"""A grid sweep's finished cells as a small JSON file, so a sweep resumes — and its report regenerates — on another
checkout or machine, from the record alone.

Why. The tracking store (`<paths.root>/mlflow.db`) lives beside one checkout. A reference sweep whose cells take
longer than one session, or that goes on from a fresh clone, would otherwise lose every finished cell with the store.
The ledger keeps, per sweep identity (`dspark.sweeps.identity`), each completed child run's name, tags, params (the
cell's resolved config, so a later default change shows as drift) and latest metrics — everything the reports read.

Where. A run writes only under `paths.root`: `<paths.root>/ledgers/<experiment>/<sweep>-<hash>.json`. The curated
copy of a sweep's current answer is committed as `results/<sweep>/ledger.json` (written by `make results`'s
publishing step, never by a run); the driver imports from it when its identity is the sweep's.

Contract:
- `record_cells` writes the given completed child runs (one per cell) to the ledger, merged with the cells the file
  already holds (the store's copy wins for a cell in both, unless the store's run was imported from that very entry:
  then the entry stays byte for byte); the file is replaced atomically.
- `import_cells` adds to a parent the ledger's cells that the store has not completed: FINISHED child runs tagged
  `sweep.complete=true`, `ledger.source` (the file's name) and `ledger.run_id` (the run they were recorded from),
  with the recorded tags, params and metrics. Artifacts (checkpoints, evaluation records) are not carried.
- Nothing machine-specific or secret is recorded: params of `paths.*`, `tracking.*` and `optuna.*` and the `process.*`
  tags are left out (and every recorded value had its credentials masked when its run logged it).
- A file that is not a ledger, or a ledger of another sweep or hash where one is required, is refused with the file
  named and the fix.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any, Iterable

from dspark.files import atomic_write_text
from dspark.tracking.runs import CELL, COMPLETE_TAG, children
from dspark.tracking.store import TrackingStore

LEDGER_FORMAT = "dspark-sweep-ledger"
LEDGER_VERSION = 2
#: params that say where a run wrote and how it was tracked (a machine's paths, a server's credentials): not recorded
_LOCAL_PARAMS = ("paths.", "tracking.", "optuna.")
SOURCE_TAG, RUN_ID_TAG = "ledger.source", "ledger.run_id"
#: tags MLflow sets itself (the parent link is re-made on import), and the process a run ran in (a pid and a boot
#: mean something on one machine only: `dspark.tracking.processes`)
_STORE_TAGS = ("mlflow.", "process.")
#: tags that only mean something in one store: not recorded (`ledger.run_id` becomes the entry's run_id)
_LOCAL_TAGS = ("sweep.attempt", SOURCE_TAG, RUN_ID_TAG)


class LedgerError(ValueError):
    """A ledger file that cannot be read as this sweep's ledger."""


def ledger_path(root: str | Path, *, experiment: str, sweep: str, sweep_hash: str) -> Path:
    """`<root>/ledgers/<experiment>/<sweep>-<sweep_hash>.json`: one file per MLflow experiment (the store's namespace:
    two experiments never share cells), sweep and hash; characters other than letters, digits, `._-` in the experiment
    name become `_`, and so do the dots of a name made of dots only."""
    folder = re.sub(r"[^A-Za-z0-9._-]", "_", experiment) or "_"
    folder = "_" * len(folder) if set(folder) == {"."} else folder  # `.` and `..` are not folders of their own
    return Path(root) / "ledgers" / folder / f"{sweep}-{sweep_hash}.json"


def load_ledger(path: str | Path) -> dict[str, Any] | None:
    """The ledger file's content (None when it does not exist); LedgerError names the file and the fix when it is
    not a ledger this code reads."""
    path = Path(path)
    if not path.exists():
        return None
    fix = f"delete {path} to run its cells again, or restore it from git (`git checkout -- {path}`)"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise LedgerError(f"sweep ledger {path} is unreadable ({err}): {fix}") from None
    if not isinstance(data, dict) or data.get("format") != LEDGER_FORMAT:
        raise LedgerError(f'{path} is not a sweep ledger (no "format": "{LEDGER_FORMAT}"): {fix}')
    if data.get("version") == 1:
        raise LedgerError(
            f"sweep ledger {path} has version 1 (named by a hash of every default); convert it with "
            f"`python -m dspark.sweeps.migrate {path}` (it writes version {LEDGER_VERSION} beside it)"
        )
    if data.get("version") != LEDGER_VERSION:
        raise LedgerError(
            f"sweep ledger {path} has version {data.get('version')!r}; this code reads version {LEDGER_VERSION}: {fix}"
        )
    cells = data.get("cells")
    if not isinstance(cells, list) or not all(
        isinstance(c, dict) and isinstance(c.get("cell"), str) and isinstance(c.get("tags"), dict) for c in cells
    ):
        raise LedgerError(f'sweep ledger {path}: "cells" must be a list of objects with "cell" and "tags": {fix}')
    if not isinstance(data.get("identity"), dict) or not isinstance(data.get("sweep_hash"), str):
        raise LedgerError(f'sweep ledger {path} has no "identity" / "sweep_hash": {fix}')
    return data


def read_ledger(path: str | Path, *, sweep: str, sweep_hash: str) -> dict[str, dict[str, Any]]:
    """cell key → recorded entry ({} when the file does not exist); LedgerError names the file and the fix when it
    is not a ledger of this sweep and hash."""
    data = load_ledger(path)
    if data is None:
        return {}
    if data.get("sweep") != sweep or data.get("sweep_hash") != sweep_hash:
        raise LedgerError(
            f"sweep ledger {path} records sweep {data.get('sweep')!r} hash {data.get('sweep_hash')!r}, "
            f"not {sweep!r} hash {sweep_hash!r}: delete it to run its cells again, or restore it "
            f"from git (`git checkout -- {path}`)"
        )
    return {c["cell"]: c for c in data["cells"]}


def entry_config(entry: dict[str, Any]) -> dict[str, str]:
    """The resolved config a ledger entry recorded (its params; non-config params are harmless extra keys)."""
    return {str(k): str(v) for k, v in (entry.get("params") or {}).items()}


def _entry(run: Any) -> dict[str, Any]:
    """A completed child run as a ledger entry."""
    tags = {k: v for k, v in sorted(run.data.tags.items()) if not k.startswith(_STORE_TAGS) and k not in _LOCAL_TAGS}
    params = {k: v for k, v in sorted(run.data.params.items()) if not k.startswith(_LOCAL_PARAMS)}
    return {
        "cell": run.data.tags["cell"],
        "run_id": run.data.tags.get(RUN_ID_TAG, run.info.run_id),
        "run_name": run.info.run_name or "",
        "start_time": run.info.start_time,
        "end_time": run.info.end_time,
        "tags": tags,
        "params": params,
        "metrics": {k: float(v) for k, v in sorted(run.data.metrics.items())},
    }


def _index(entry: dict[str, Any]) -> tuple[int, str]:
    try:
        return int(entry["tags"].get("cell.index", 10**9)), entry["cell"]
    except (TypeError, ValueError):
        return 10**9, entry["cell"]


def record_cells(
    runs: Iterable[Any], path: str | Path, *, sweep: str, sweep_hash: str, identity: dict[str, Any]
) -> int:
    """Write the given completed child runs (one per cell: the cell's current run) merged with the file's cells to
    the ledger at `path`; returns the cell count. Nothing is written while no cell has completed."""
    path = Path(path)
    entries = read_ledger(path, sweep=sweep, sweep_hash=sweep_hash)
    for run in runs:
        cell = run.data.tags["cell"]
        recorded_from = run.data.tags.get(RUN_ID_TAG)
        if cell in entries and recorded_from == entries[cell].get("run_id"):
            continue  # imported from this very entry: keep it as written (its times are the original run's)
        entries[cell] = _entry(run)
    if not entries:
        return 0
    write_ledger(path, sweep=sweep, sweep_hash=sweep_hash, identity=identity, entries=entries.values())
    return len(entries)


def write_ledger(
    path: str | Path, *, sweep: str, sweep_hash: str, identity: dict[str, Any], entries: Iterable[dict[str, Any]]
) -> Path:
    """Replace the ledger at `path` atomically (sorted JSON, cells in grid order)."""
    payload = {
        "format": LEDGER_FORMAT,
        "version": LEDGER_VERSION,
        "sweep": sweep,
        "sweep_hash": sweep_hash,
        "identity": identity,
        "cells": sorted(entries, key=_index),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, json.dumps(payload, indent=1, sort_keys=True) + "\n")


def import_cells(store: TrackingStore, parent_id: str, path: str | Path, *, sweep: str, sweep_hash: str) -> list[str]:
    """Add the ledger's cells that the parent has not completed as finished child runs; returns their keys.

    A cell the parent completed under another recipe is imported all the same when the ledger holds it: the
    driver then picks, per cell, the run recorded under today's recipe (`dspark.sweeps.driver.cell_states`)."""
    path = Path(path)
    entries = read_ledger(path, sweep=sweep, sweep_hash=sweep_hash)
    complete = [
        r for r in children(store, parent_id) if r.info.status == "FINISHED" and r.data.tags.get(COMPLETE_TAG) == "true"
    ]
    imported = []
    for cell, entry in sorted(entries.items(), key=lambda item: _index(item[1])):
        if any(_same_record(run, entry) for run in complete if run.data.tags.get("cell") == cell):
            continue
        _add_run(store, parent_id, entry, source=path)
        imported.append(cell)
    return imported


def _same_record(run: Any, entry: dict[str, Any]) -> bool:
    """Whether a completed run of the entry's cell is that entry (recorded from it or imported from it) or ran the
    same config (on the keys both record)."""
    if entry.get("run_id") in (run.info.run_id, run.data.tags.get(RUN_ID_TAG)):
        return True
    config = entry_config(entry)
    shared = [k for k in run.data.params if k in config and not k.startswith(_LOCAL_PARAMS)]
    return all(run.data.params[k] == config[k] for k in shared)


def _add_run(store: TrackingStore, parent_id: str, entry: dict[str, Any], *, source: Path) -> str:
    from mlflow.entities import Param

    tags = {k: str(v) for k, v in entry["tags"].items() if not k.startswith(_STORE_TAGS)}
    tags |= {
        "sweep.role": CELL,
        "cell": entry["cell"],
        SOURCE_TAG: Path(source).name,
        RUN_ID_TAG: str(entry.get("run_id")),
        "sweep.attempt": uuid.uuid4().hex,
    }  # a fresh attempt id: never confused with a cell running here
    tags.pop(COMPLETE_TAG, None)  # set last, once params and metrics are in: a crash mid-import leaves no done cell
    run_id = store.create_run(run_name=str(entry.get("run_name") or entry["cell"]), tags=tags, parent_run_id=parent_id)
    params = [Param(str(k), str(v)) for k, v in (entry.get("params") or {}).items()]
    for i in range(0, len(params), 100):
        store.client.log_batch(run_id, params=params[i : i + 100])
    store.log_metrics(run_id, {str(k): float(v) for k, v in (entry.get("metrics") or {}).items()})
    store.client.set_tag(run_id, COMPLETE_TAG, "true")
    store.finish(run_id)
    return run_id
