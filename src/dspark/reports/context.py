"""What every report builder receives, the builder registry, and shared lookups over the runs frame.

Metric names read here (written by the stages): `eval/<set>/tau`, `eval/domain/<math|code|chat>/tau`,
`eval/all/tau`, `eval/domain/<d>/cond/pos{k}`, `eval/domain/<d>/verify_rate`, `summary/tau`, `summary/speedup`,
`val/tau_prob` (teacher-forced proxy, present whenever training ran), `calibration/*`, `latency/*`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import polars as pl

from dspark.config.schema import FIXED_HEAD
from dspark.drafters.factory import DRAFTER_BUILDERS
from dspark.registry import Registry
from dspark.reports.claims import Claim
from dspark.reports.collect import SweepRuns
from dspark.reports.paper import DATASETS
from dspark.reports.stats import Estimate, group_estimates
from dspark.reports.writer import Section

if TYPE_CHECKING:
    from dspark.tracking import TrackingStore

DOMAIN_ORDER = ("math", "code", "chat")
TAU = "summary/tau"
TAU_PROB = "val/tau_prob"
_DATASET_TAU = re.compile(r"^eval/([^/]+)/tau$")


@dataclass
class ReportContext:
    """A sweep's completed runs plus where the report's figures go; builders append the paper claims they judge
    to `claims` (the same numbers as their text; the generator writes them beside the report)."""

    name: str
    runs: SweepRuns
    out_dir: Path
    paper_ref: str = ""
    description: str = ""
    store: TrackingStore | None = None  # for artifact downloads (reliability diagrams)
    spec: Any = None  # the SweepSpec (Optuna reports read the objective and the search space)
    claims: list[Claim] = field(default_factory=list)
    _rows: dict = field(default_factory=dict, repr=False)

    @property
    def frame(self) -> pl.DataFrame:
        return self.runs.frame

    def png(self, suffix: str) -> Path:
        return self.out_dir / f"{self.name}-{suffix}.png"

    def has(self, column: str) -> bool:
        return column in self.frame.columns and self.frame[column].drop_nulls().len() > 0

    def group_axes(self) -> list[str]:
        """Axis columns that define a configuration (seeds are replicates)."""
        return [c for c in self.runs.axis_columns() if c != "axis.seed"]

    def groups(self, metrics: list[str]) -> dict[tuple, dict[str, Estimate]]:
        return group_estimates(self.frame, by=self.group_axes(), metrics=metrics)

    def group_dicts(self) -> list[dict[str, Any]]:
        """One dict of axis values (plus the run tags drafter / model.head of the first run) per configuration."""
        axes = self.group_axes()
        if not axes:
            return [{}] if self.frame.height else []
        out = []
        for row in self.frame.unique(subset=axes, maintain_order=True).iter_rows(named=True):
            tags = {"drafter": row.get("drafter"), "model.head": row.get("model.head")}
            out.append({**{a: row[a] for a in axes}, **tags})
        return out

    def rows_of(self, group: dict[str, Any]) -> pl.DataFrame:
        """The runs of one configuration (memoised: builders ask for the same group many times)."""
        key = tuple(sorted((k, v) for k, v in group.items() if k.startswith("axis.")))
        if key not in self._rows:
            frame = self.frame
            for column, value in key:
                # An axis absent from a cell's grid block (dflash has no model.head axis in block_size) is null;
                # `== None` would match nothing and silently drop those runs.
                frame = frame.filter(pl.col(column).is_null() if value is None else pl.col(column) == value)
            self._rows[key] = frame
        return self._rows[key]

    def seeds(self, *groups: dict[str, Any]) -> str:
        """The seeds of the runs of `groups`, e.g. '0,1' ('' when the frame has no seed column)."""
        found: set = set()
        for group in groups:
            rows = self.rows_of(group)
            column = "axis.seed" if "axis.seed" in rows.columns else "seed"
            if column in rows.columns:
                found |= {v for v in rows[column].to_list() if v is not None}
        return ",".join(str(v) for v in sorted(found, key=lambda v: (str(type(v)), v)))


ReportBuilder = Callable[[ReportContext], list[Section]]
REPORT_BUILDERS: Registry[ReportBuilder] = Registry("sweep report")


def eval_datasets(frame: pl.DataFrame) -> list[str]:
    """Prompt sets with a τ column, Table 1's order first."""
    found = [m.group(1) for c in frame.columns if (m := _DATASET_TAU.match(c)) and m.group(1) not in ("domain", "all")]
    return [d for d in DATASETS if d in found] + sorted(d for d in found if d not in DATASETS)


def eval_domains(frame: pl.DataFrame) -> list[str]:
    found = {c.split("/")[2] for c in frame.columns if c.startswith("eval/domain/") and c.endswith("/tau")}
    return [d for d in DOMAIN_ORDER if d in found] + sorted(found - set(DOMAIN_ORDER))


def domain_tau(domain: str) -> str:
    return f"eval/domain/{domain}/tau"


def head_of(group: dict[str, Any]) -> str | None:
    """The sequential head of a group ('markov', 'rnn', …), from its axis value or else its run tag."""
    return group.get("axis.model.head") or group.get("model.head")


def drafter_label(name: str) -> str:
    """A drafter's display label from its registration (`DRAFTER_BUILDERS`; the name when it gave none)."""
    return DRAFTER_BUILDERS.label(name)


def takes_head(drafter: str) -> bool:
    """Whether `model.head` chooses this drafter's sequential head (config.schema.FIXED_HEAD: dflash/eagle3 fix it)."""
    return FIXED_HEAD.get(drafter) is None


def variant_label(group: dict[str, Any]) -> str:
    """'DSpark (markov)', 'DFlash', 'EAGLE-3', from the axis values or the run tags."""
    drafter = str(group.get("axis.drafter") or group.get("drafter") or "?")
    head = head_of(group)
    label = drafter_label(drafter)
    return f"{label} ({head})" if drafter in DRAFTER_BUILDERS and takes_head(drafter) and head else label


def variant_slug(group: dict[str, Any]) -> str:
    """The claim-id form of `variant_label`: 'dspark_markov', 'dflash'."""
    drafter = str(group.get("axis.drafter") or group.get("drafter") or "unknown")
    head = head_of(group)
    return f"{drafter}_{head}" if drafter in DRAFTER_BUILDERS and takes_head(drafter) and head else drafter


def axis_text(group: dict[str, Any], *, skip: tuple[str, ...] = ()) -> str:
    parts = [f"{k[5:]}={v}" for k, v in group.items() if k.startswith("axis.") and k not in skip]
    return ", ".join(parts) or "(single configuration)"
