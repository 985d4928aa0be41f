"""Read a sweep's runs from the MLflow store into a polars frame (one row per completed child run).

Columns: `run_id`, `run_name`, `status`, `cell`, `cell_index`, the flat tags the reports group by (`drafter`,
`model.head`, `seed`, `optuna.trial`, `optuna.state`, ...), one `axis.<key>` column per sweep axis (numeric when every
value parses as a number), and one column per metric (`summary/tau`, `eval/gsm8k/tau`, `val/tau_prob`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from dspark.tracking.runs import COMPLETE_TAG, children, find_parent

if TYPE_CHECKING:
    from dspark.tracking import TrackingStore

TAG_COLUMNS = (
    "cell",
    "cell.index",
    "drafter",
    "model.head",
    "seed",
    "target",
    "budget",
    "training.key",
    "optuna.trial",
    "optuna.state",
    "optuna.defaults",
    "git.commit",
    "machine",
    "ledger.source",
)


@dataclass
class SweepRuns:
    """The parent run of a sweep and its completed children."""

    sweep: str
    parent: Any | None
    frame: pl.DataFrame
    status_counts: dict[str, int] = field(default_factory=dict)  # every child by status, incomplete ones included
    note: str = ""  # how the parent was chosen
    every_child: pl.DataFrame | None = None  # all children whatever their status (Optuna reports show pruned trials)

    @property
    def empty(self) -> bool:
        return self.frame.height == 0

    def axis_columns(self) -> list[str]:
        return [c for c in self.frame.columns if c.startswith("axis.")]

    def parent_tag(self, name: str, default: str = "–") -> str:
        return self.parent.data.tags.get(name, default) if self.parent is not None else default

    def tag_counts(self, tag: str) -> list[tuple[str, int]]:
        """The values of a tag column over the completed cells with their run counts, most runs first (empty when no
        cell carries the tag): the machines a resumed sweep ran on, the commits its cells were trained at."""
        if self.empty or tag not in self.frame.columns:
            return []
        counts = self.frame.get_column(tag).drop_nulls().value_counts(sort=True)
        return [(str(value), int(n)) for value, n in counts.iter_rows()]

    def machines(self) -> str | None:
        """The machines the completed cells ran on, with their run counts, most runs first (`machine` tag), e.g.
        `A (7 runs); B (5 runs)`; None when no cell carries the tag. A sweep resumed on another machine says so."""
        return counted(self.tag_counts("machine")) or None

    def from_ledger(self) -> str | None:
        """`N of M (file)` when some completed cells were imported from a sweep ledger (`dspark.tracking.ledger`:
        finished on another checkout or machine), else None."""
        if self.empty or "ledger.source" not in self.frame.columns:
            return None
        sources = self.frame.get_column("ledger.source").drop_nulls()
        if sources.len() == 0:
            return None
        files = ", ".join(sorted({Path(s).name for s in sources.to_list()}))
        return f"{sources.len()} of {self.frame.height} completed cells ({files})"

    def parent_metric(self, name: str) -> float | None:
        return self.parent.data.metrics.get(name) if self.parent is not None else None


def counted(pairs: list[tuple[str, int]]) -> str:
    """`A (7 runs); B (1 run)` from (name, count) pairs."""
    return "; ".join(f"{name} ({n} run{'s' if n != 1 else ''})" for name, n in pairs)


def run_row(run: Any) -> dict[str, Any]:
    """One child run → a flat dict of ids, tags and metrics."""
    tags = run.data.tags
    row: dict[str, Any] = {
        "run_id": run.info.run_id,
        "run_name": run.info.run_name or tags.get("mlflow.runName", ""),
        "status": run.info.status,
        "complete": tags.get(COMPLETE_TAG) == "true",
    }
    row.update({name: tags.get(name) for name in TAG_COLUMNS})
    row.update({k: v for k, v in tags.items() if k.startswith("axis.")})
    row.update({k: float(v) for k, v in run.data.metrics.items()})
    return row


def _typed(frame: pl.DataFrame, column: str) -> pl.DataFrame:
    """Cast a string column of numbers to Int64 (or Float64) so that sorting and plotting are numeric."""
    for dtype in (pl.Int64, pl.Float64):
        try:
            return frame.with_columns(pl.col(column).cast(dtype, strict=True))
        except (pl.exceptions.InvalidOperationError, pl.exceptions.ComputeError):
            continue
    return frame


def runs_frame(runs: list[Any]) -> pl.DataFrame:
    """Rows of `run_row`, with numeric axis / seed / index columns typed and sorted by cell index."""
    if not runs:
        return pl.DataFrame(schema={"run_id": pl.String, "status": pl.String, "cell": pl.String})
    frame = pl.DataFrame([run_row(r) for r in runs], infer_schema_length=None)
    for column in [c for c in frame.columns if c.startswith("axis.")] + ["seed", "cell.index", "optuna.trial"]:
        if column in frame.columns and frame[column].dtype == pl.String:
            frame = _typed(frame, column)
    order = [c for c in ("cell.index", "optuna.trial") if c in frame.columns]
    return frame.sort(order, nulls_last=True) if order else frame


def collect_sweep_runs(store: TrackingStore, *, sweep: str, sweep_hash: str | None = None) -> SweepRuns:
    """The parent with this hash (else the newest parent of the sweep) and its completed children."""
    parent = find_parent(store, sweep=sweep, sweep_hash=sweep_hash) if sweep_hash else None
    note = f"parent run with sweep.hash={sweep_hash}" if parent is not None else ""
    if parent is None:
        parent = find_parent(store, sweep=sweep)
        if parent is not None:
            note = (
                f"newest parent run of sweep {sweep} (its sweep.hash {parent.data.tags.get('sweep.hash')} differs "
                "from this command's: the sweep file or the command-line overrides changed)"
                if sweep_hash
                else f"newest parent run of sweep {sweep}"
            )
    if parent is None:
        return SweepRuns(sweep=sweep, parent=None, frame=runs_frame([]), note="no parent run of this sweep")
    kids = children(store, parent.info.run_id)
    counts: dict[str, int] = {}
    for run in kids:
        counts[run.info.status] = counts.get(run.info.status, 0) + 1
    completed = [r for r in kids if r.info.status == "FINISHED" and r.data.tags.get(COMPLETE_TAG) == "true"]
    return SweepRuns(
        sweep=sweep,
        parent=parent,
        frame=runs_frame(completed),
        status_counts=counts,
        note=note,
        every_child=runs_frame(kids),
    )
