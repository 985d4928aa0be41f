"""What a sweep records on its parent run besides the run tree (`dspark.tracking.runs`): the sweep file, every
cell's resolved config, and how each cell ended (`outcomes.json`, `sweep/cells_*` metrics)."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from dspark.files import atomic_write_text
from dspark.markdown import markdown_table
from dspark.tracking import TrackingStore


def log_parent_record(
    store: TrackingStore, parent_id: str, *, spec_text: str, cells: list[dict], out_dir: Path
) -> None:
    """Attach the sweep file and every cell's resolved config to the parent (before any cell runs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "sweep.yaml", spec_text)
    atomic_write_text(out_dir / "cells.yaml", yaml.safe_dump(cells, sort_keys=False, allow_unicode=True))
    table = markdown_table(
        ["#", "cell", "run name", "training key"],
        [[c["index"], c["cell"], c["run_name"], c["training_key"]] for c in cells],
    )
    atomic_write_text(out_dir / "cells.md", table + "\n")
    for name in ("sweep.yaml", "cells.yaml", "cells.md"):
        store.client.log_artifact(parent_id, str(out_dir / name), artifact_path="sweep")


@dataclass
class CellOutcome:
    """How one cell ended: status FINISHED | FAILED | KILLED | SKIPPED, its run id, its timings."""

    key: str
    status: str
    run_id: str | None = None
    seconds: float = 0.0
    work_seconds: float = 0.0  # time inside the cell runner; seconds - work_seconds = driver overhead


def log_outcomes(store: TrackingStore, parent_id: str, outcomes: list[CellOutcome], *, out_dir: Path) -> None:
    """Per-cell status table and timing metrics on the parent."""
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    ran = [o for o in outcomes if o.status != "SKIPPED"]
    metrics = {f"sweep/cells_{k.lower()}": float(v) for k, v in counts.items()}
    if ran:
        metrics["sweep/driver_overhead_seconds"] = max(o.seconds - o.work_seconds for o in ran)
    store.log_metrics(parent_id, metrics)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "outcomes.json"
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    atomic_write_text(path, json.dumps({"finished": stamp, "cells": [o.__dict__ for o in outcomes]}, indent=1))
    store.client.log_artifact(parent_id, str(path), artifact_path="sweep")
