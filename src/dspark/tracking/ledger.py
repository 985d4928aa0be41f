"""A grid sweep's finished cells as a small file beside its report, so a sweep resumes — and its report regenerates —
on another checkout or machine.

Why. The tracking store (`<paths.root>/mlflow.db`) lives beside one checkout. A reference sweep whose cells take
longer than one machine's session (sweep=depth at budget=cpu-ref: ~4.5 h of cells on two cores), or that goes on
from a fresh clone, would otherwise lose every finished cell with the store and start again. The ledger keeps, per
sweep and sweep hash, each completed child run's name, tags, params and latest metrics — everything the reports
read (`dspark.reports.collect`) — in `<paths.reports>/cells/<experiment>/<sweep>-<sweep hash>.json`: sorted JSON, a few kB per
cell, committed beside the report.

Contract:
- `record_cells` writes every completed child of a parent (`tracking.runs.done_cells`) to the ledger, merged with the
  cells the file already holds (the store's copy wins for a cell in both, unless the store's run was imported from
  that very entry: then the entry stays byte for byte); the file is replaced atomically.
- `import_cells` adds to a parent the ledger's cells that the store has not completed: FINISHED child runs tagged
  `sweep.complete=true` (so the driver skips them like cells finished here), `ledger.source` (the file) and
  `ledger.run_id` (the run they were recorded from), with the recorded tags (the `machine` tag says where each ran),
  params and metrics. Artifacts (drafter checkpoints, evaluation records, reliability diagrams) are not carried.
- The hash in the file name is the sweep's config hash (`sweeps.driver.config_hash`): a ledger is read only by the
  sweep it was written for. A file that is not a ledger of this sweep and hash is refused with the file named.
"""
from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

from dspark.files import atomic_write_text
from dspark.tracking.runs import CELL, COMPLETE_TAG, children, done_cells
from dspark.tracking.store import TrackingStore

LEDGER_FORMAT = "dspark-sweep-ledger"
LEDGER_VERSION = 1
SOURCE_TAG, RUN_ID_TAG = "ledger.source", "ledger.run_id"
#: tags MLflow sets itself (the parent link is re-made on import)
_STORE_TAGS = ("mlflow.",)
#: tags that only mean something in one store: not recorded (`ledger.run_id` becomes the entry's run_id)
_LOCAL_TAGS = ("sweep.attempt", SOURCE_TAG, RUN_ID_TAG)


class LedgerError(ValueError):
    """A ledger file that cannot be read as this sweep's ledger."""


def ledger_path(reports_dir: str | Path, *, experiment: str, sweep: str, sweep_hash: str) -> Path:
    """`<reports_dir>/cells/<experiment>/<sweep>-<sweep_hash>.json`: one file per MLflow experiment (the store's
    namespace: two experiments never share cells), sweep and hash; characters other than letters, digits, `._-`
    in the experiment name become `_`."""
    folder = re.sub(r"[^A-Za-z0-9._-]", "_", experiment) or "_"
    return Path(reports_dir) / "cells" / folder / f"{sweep}-{sweep_hash}.json"


def read_ledger(path: str | Path, *, sweep: str, sweep_hash: str) -> dict[str, dict[str, Any]]:
    """cell key → recorded entry ({} when the file does not exist); LedgerError names the file and the fix when it
    is not a ledger of this sweep and hash."""
    path = Path(path)
    if not path.exists():
        return {}
    fix = f"delete {path} to run its cells again, or restore it from git (`git checkout -- {path}`)"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise LedgerError(f"sweep ledger {path} is unreadable ({err}): {fix}") from None
    if not isinstance(data, dict) or data.get("format") != LEDGER_FORMAT:
        raise LedgerError(f"{path} is not a sweep ledger (no \"format\": \"{LEDGER_FORMAT}\"): {fix}")
    if data.get("version") != LEDGER_VERSION:
        raise LedgerError(f"sweep ledger {path} has version {data.get('version')!r}; this code reads version "
                          f"{LEDGER_VERSION}: {fix}")
    if data.get("sweep") != sweep or data.get("sweep_hash") != sweep_hash:
        raise LedgerError(f"sweep ledger {path} records sweep {data.get('sweep')!r} hash {data.get('sweep_hash')!r}, "
                          f"not {sweep!r} hash {sweep_hash!r}: {fix}")
    cells = data.get("cells")
    if not isinstance(cells, list) or not all(isinstance(c, dict) and isinstance(c.get("cell"), str)
                                              and isinstance(c.get("tags"), dict) for c in cells):
        raise LedgerError(f"sweep ledger {path}: \"cells\" must be a list of objects with \"cell\" and \"tags\": {fix}")
    return {c["cell"]: c for c in cells}


def _entry(run: Any) -> dict[str, Any]:
    """A completed child run as a ledger entry."""
    tags = {k: v for k, v in sorted(run.data.tags.items()) if not k.startswith(_STORE_TAGS) and k not in _LOCAL_TAGS}
    return {"cell": run.data.tags["cell"], "run_id": run.data.tags.get(RUN_ID_TAG, run.info.run_id),
            "run_name": run.info.run_name or "", "start_time": run.info.start_time, "end_time": run.info.end_time,
            "tags": tags, "params": dict(sorted(run.data.params.items())),
            "metrics": {k: float(v) for k, v in sorted(run.data.metrics.items())}}


def _index(entry: dict[str, Any]) -> tuple[int, str]:
    try:
        return int(entry["tags"].get("cell.index", 10**9)), entry["cell"]
    except (TypeError, ValueError):
        return 10**9, entry["cell"]


def record_cells(store: TrackingStore, parent_id: str, path: str | Path, *, sweep: str, sweep_hash: str) -> int:
    """Write the parent's completed cells (merged with the file's) to the ledger at `path`; returns the cell count.

    Nothing is written while no cell has completed (no empty ledgers beside reports)."""
    path = Path(path)
    entries = read_ledger(path, sweep=sweep, sweep_hash=sweep_hash)
    kids = {r.info.run_id: r for r in children(store, parent_id)}
    for cell, run_id in done_cells(kids.values()).items():
        recorded_from = kids[run_id].data.tags.get(RUN_ID_TAG)
        if cell in entries and recorded_from == entries[cell].get("run_id"):
            continue  # imported from this very entry: keep it as written (its times are the original run's)
        entries[cell] = _entry(kids[run_id])
    if not entries:
        return 0
    payload = {"format": LEDGER_FORMAT, "version": LEDGER_VERSION, "sweep": sweep, "sweep_hash": sweep_hash,
               "cells": sorted(entries.values(), key=_index)}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return len(entries)


def import_cells(store: TrackingStore, parent_id: str, path: str | Path, *, sweep: str, sweep_hash: str) -> list[str]:
    """Add the ledger's cells that the parent has not completed as finished child runs; returns their keys."""
    path = Path(path)
    entries = read_ledger(path, sweep=sweep, sweep_hash=sweep_hash)
    done = done_cells(children(store, parent_id))
    imported = []
    for cell, entry in sorted(entries.items(), key=lambda item: _index(item[1])):
        if cell in done:
            continue
        _add_run(store, parent_id, entry, source=path)
        imported.append(cell)
    return imported


def _add_run(store: TrackingStore, parent_id: str, entry: dict[str, Any], *, source: Path) -> str:
    from mlflow.entities import Param

    tags = {k: str(v) for k, v in entry["tags"].items() if not k.startswith(_STORE_TAGS)}
    tags |= {"sweep.role": CELL, "cell": entry["cell"], SOURCE_TAG: str(source), RUN_ID_TAG: str(entry.get("run_id")),
             "sweep.attempt": uuid.uuid4().hex}  # a fresh attempt id: never confused with a cell running here
    tags.pop(COMPLETE_TAG, None)  # set last, once params and metrics are in: a crash mid-import leaves no done cell
    run_id = store.create_run(run_name=str(entry.get("run_name") or entry["cell"]), tags=tags, parent_run_id=parent_id)
    params = [Param(str(k), str(v)) for k, v in (entry.get("params") or {}).items()]
    for i in range(0, len(params), 100):
        store.client.log_batch(run_id, params=params[i:i + 100])
    store.log_metrics(run_id, {str(k): float(v) for k, v in (entry.get("metrics") or {}).items()})
    store.client.set_tag(run_id, COMPLETE_TAG, "true")
    store.finish(run_id)
    return run_id
