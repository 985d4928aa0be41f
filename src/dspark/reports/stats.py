"""Replicate statistics for report tables: mean ± 95% Student-t half-width over runs, with n.

Replicates are the runs of one group (the cells that differ only in `seed`). With one run the half-width is
undefined and the cell shows the value with n = 1; the per-prompt spread of a single evaluation is reported
separately by the evaluation (eval/<set>/tau_prompt_ci95), never mixed into these intervals.

These are the tables' numbers, not the verdicts': a table of `eval/<set>/tau` shows τ *pooled* over rounds (Σ
committed / Σ rounds per set, a ratio of pooled means) averaged over seeds, whereas every verdict reads the
*per-prompt* τ (`tau_prompt_mean`, the mean over prompts of each prompt's τ) pooled over prompts and seeds by
`dspark.reports.claims`. `POOLED_NOTE` / `PER_PROMPT_NOTE` say which a table shows; `ratio_gain` of two pooled
means is a point estimate, never a verdict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import polars as pl

from dspark.intervals import finite_values, mean_ci
from dspark.markdown import MISSING

POOLED_NOTE = (
    "Tables show τ pooled over rounds (Σ committed / Σ rounds of each prompt set, a ratio of pooled means; `all` "
    "the unweighted mean over the sets), the mean over seeds ± its 95% Student-t half-width over runs (n). The "
    "verdicts read per-prompt τ instead (the mean over prompts of each prompt's τ, pooled over prompts and seeds): "
    "the two can differ by a few percent."
)
PER_PROMPT_NOTE = (
    "per-prompt τ: the mean over prompts of each prompt's τ, with its 95% interval over prompts and seeds "
    "(Student-t, Satterthwaite df) — the statistic the verdicts read"
)


@dataclass(frozen=True)
class Estimate:
    mean: float
    half_width: float  # NaN when n < 2
    n: int

    @property
    def ok(self) -> bool:
        return self.n > 0 and math.isfinite(self.mean)

    @property
    def low(self) -> float:
        return self.mean - self.half_width if self.n >= 2 else math.nan

    @property
    def high(self) -> float:
        return self.mean + self.half_width if self.n >= 2 else math.nan

    def text(self, digits: int = 2, *, show_n: bool = True) -> str:
        """'2.31 ± 0.12 (n=3)', '2.31 (n=1)', or '–'."""
        if not self.ok:
            return MISSING
        body = f"{self.mean:.{digits}f}"
        if self.n >= 2 and math.isfinite(self.half_width):
            body += f" ± {self.half_width:.{digits}f}"
        return f"{body} (n={self.n})" if show_n else body


def estimate(values: Iterable[float | None]) -> Estimate:
    """Mean and 95% half-width of the finite values."""
    finite = finite_values(values)
    mean, half_width = mean_ci(finite)
    return Estimate(mean, half_width, len(finite))


def column_values(frame: pl.DataFrame, column: str) -> list[float | None]:
    return frame[column].to_list() if column in frame.columns else []


def group_estimates(
    frame: pl.DataFrame, *, by: Sequence[str], metrics: Sequence[str]
) -> dict[tuple, dict[str, Estimate]]:
    """{group key tuple: {metric: Estimate}} over the rows of each group, groups in first-seen order."""
    out: dict[tuple, dict[str, Estimate]] = {}
    if frame.height == 0:
        return out
    keys = [c for c in by if c in frame.columns]
    for key, part in frame.group_by(keys, maintain_order=True):
        key = key if isinstance(key, tuple) else (key,)
        out[key] = {m: estimate(column_values(part, m)) for m in metrics}
    return out


def ratio_gain(numerator: Estimate, denominator: Estimate) -> float:
    """Relative gain of two means, numerator / denominator − 1 (NaN when either is missing)."""
    if not (numerator.ok and denominator.ok) or denominator.mean == 0:
        return float("nan")
    return numerator.mean / denominator.mean - 1.0
