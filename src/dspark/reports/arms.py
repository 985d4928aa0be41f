"""Arm-against-baseline reports: one axis of a sweep holds arms (a verifier, a stop rule, a confidence source), one of
its values is the baseline, and every other arm is judged against it within each group of the other axes (the same
drafter and seeds, so the same prompts) — per-prompt τ and per-prompt speed-up over target-only decoding, with the
claims module's t intervals (docs/STATISTICS.md). Used by `sweep=verifier` (token vs block), `sweep=scheduler_arms`
(Algorithm 1's stop vs the global argmax and the bypass) and `sweep=confidence` (the sources vs the head).

A lossy arm (`eval/lossy` = 1: the scheduler's global argmax, paper Appendix A) is marked in the table and its
claims: its τ is not the target's distribution's, so "more τ" there is not a gain a lossless engine can have.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import polars as pl

from dspark.markdown import markdown_table
from dspark.reports.claims import (
    MULTIPLICITY,
    Difference,
    Pooled,
    difference_claim,
    judged,
    pooled_prompt_metric,
    pooled_tau,
)
from dspark.reports.context import REPORT_BUILDERS, ReportContext
from dspark.reports.writer import Section


def metric_values(rows: pl.DataFrame, name: str) -> list[float | None]:
    """A metric column as a list (Nones when no run logged it)."""
    return rows[name].to_list() if name in rows.columns else [None] * rows.height


def pooled_speedup(rows: pl.DataFrame) -> Pooled:
    """Per-prompt mean speed-up over target-only decoding, pooled by the claims module's one rule (as τ is)."""
    return pooled_prompt_metric(rows, "speedup")


def interval_text(p: Pooled, digits: int = 3) -> str:
    """'1.234 [1.100, 1.368] (n=2)', the point with n when there is no interval, or '–'."""
    if not p.ok:
        return "–"
    if not math.isfinite(p.se):
        return f"{p.mean:.{digits}f} (n={p.runs})"
    return f"{p.mean:.{digits}f} [{p.low:.{digits}f}, {p.high:.{digits}f}] (n={p.runs})"


def slug(text: str) -> str:
    """A claim-id part from free text (MLflow metric names allow letters, digits, _ - . / and spaces only)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "all"


@dataclass(frozen=True)
class ArmSpec:
    """What a report compares: `axis` (a config key), the `baseline` value, and how the claims are worded."""

    report: str  # claim ids start with it
    axis: str  # e.g. "decode.verifier"
    baseline: str
    statement: str  # "{arm}" is replaced by the arm's value: "decode.verifier={arm} beats token verification"
    paper: str = "–"
    extra_metrics: tuple[tuple[str, str], ...] = ()  # (column, label) shown per arm in the table (no claim)


def _arms(ctx: ReportContext, spec: ArmSpec) -> dict[tuple, dict[str, dict]]:
    """{other axes: {arm value: group}} over the sweep's configurations."""
    column = f"axis.{spec.axis}"
    out: dict[tuple, dict[str, dict]] = {}
    for group in ctx.group_dicts():
        arm = str(group.get(column, spec.baseline))
        rest = tuple(sorted((k, str(v)) for k, v in group.items() if k.startswith("axis.") and k != column))
        out.setdefault(rest, {})[arm] = group
    return out


def _mean(rows: pl.DataFrame, column: str) -> float:
    values = [float(v) for v in metric_values(rows, column) if v is not None and math.isfinite(float(v))]
    return sum(values) / len(values) if values else math.nan


def _number(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else "–"


def arms_sections(ctx: ReportContext, spec: ArmSpec) -> list[Section]:
    """The table of every arm (τ, speed-up, extra metrics) and each arm's judged difference from the baseline."""
    header = ["configuration", spec.axis, "τ per prompt [95% CI]", "speed-up per prompt [95% CI]"]
    header += [label for _, label in spec.extra_metrics] + ["lossless"]
    table, lines = [], []
    for rest, by_arm in _arms(ctx, spec).items():
        where = ", ".join(f"{k[5:]}={v}" for k, v in rest) or "all runs"
        for arm, group in by_arm.items():
            rows = ctx.rows_of(group)
            extras = [_number(_mean(rows, column)) for column, _ in spec.extra_metrics]
            lossy = _mean(rows, "eval/lossy") == 1.0
            table.append(
                [
                    where,
                    arm,
                    interval_text(pooled_tau(rows)),
                    interval_text(pooled_speedup(rows)),
                    *extras,
                    "**no (Appendix A)**" if lossy else "yes",
                ]
            )
        base = by_arm.get(spec.baseline)
        if base is None:
            continue
        base_rows = ctx.rows_of(base)
        for arm, group in by_arm.items():
            if arm == spec.baseline:
                continue
            rows = ctx.rows_of(group)
            lossy = " — lossy arm: not the target's distribution" if _mean(rows, "eval/lossy") == 1.0 else ""
            seeds = ",".join(str(s) for s in sorted({s for s in metric_values(rows, "axis.seed") if s is not None}))
            for metric, pooled, label in (("tau", pooled_tau, "τ"), ("speedup", pooled_speedup, "speed-up")):
                diff = Difference(pooled(rows), pooled(base_rows))
                lines.append("- " + judged(f"{spec.axis}={arm} vs {spec.baseline}, {label} ({where}){lossy}", diff))
                ctx.claims.append(
                    difference_claim(
                        diff,
                        id=f"{spec.report}.{slug(arm)}_vs_{slug(spec.baseline)}.{metric}.{slug(where)}",
                        statement=spec.statement.format(arm=arm) + f" ({label}){lossy}",
                        paper=spec.paper,
                        scope=f"per-prompt {label}, {where}",
                        seeds=seeds,
                    )
                )
    caption = (
        "Per-prompt τ and per-prompt speed-up over target-only decoding on the same prompts, pooled over seeds with "
        "the claims module's t intervals; each arm is judged against "
        f"{spec.axis}={spec.baseline} within the same configuration of the other axes."
    )
    judged_lines = lines or [f"No arm ran beside {spec.axis}={spec.baseline}: nothing to judge."]
    return [
        Section("Arms", caption + "\n\n" + markdown_table(header, table)),
        Section("Arms vs the baseline", "\n".join([f"Paper: {spec.paper}", "", MULTIPLICITY, "", *judged_lines])),
    ]


VERIFIER = ArmSpec(
    report="verifier",
    axis="decode.verifier",
    baseline="token",
    statement="Block verification accepts more than token verification (decode.verifier={arm})",
    paper="– (Sun et al. 2024; vLLM reported +0.05–0.08 acceptance length, FIELD.md)",
)
SCHEDULER_STOP = ArmSpec(
    report="scheduler_arms",
    axis="decode.scheduler_stop",
    baseline="first_non_improvement",
    statement="The scheduler's global argmax (decode.scheduler_stop={arm}) beats Algorithm 1's first-non-improvement stop",
    paper="Appendix A: the global argmax is biased (P(A) 0.85 instead of 0.7 in its example)",
)
BYPASS = ArmSpec(
    report="scheduler_arms",
    axis="decode.bypass",
    baseline="off",
    statement="A per-round 'does drafting pay' bypass (decode.bypass={arm}) speeds up the scheduler",
    paper="– (single-user engines report it helps, FIELD.md)",
    extra_metrics=(("eval/bypass_rate", "bypass rate"),),
)


def restricted(ctx: ReportContext, key: str, value: str) -> ReportContext:
    """The context of the runs whose axis `key` is `value` (all runs when the sweep has no such axis); claims are
    appended to the same list."""
    column = f"axis.{key}"
    if column not in ctx.frame.columns:
        return ctx
    frame = ctx.frame.filter(pl.col(column).cast(pl.Utf8) == value)
    return dataclasses.replace(ctx, runs=dataclasses.replace(ctx.runs, frame=frame), _rows={})


@REPORT_BUILDERS.register("verifier")
def build_verifier(ctx: ReportContext) -> list[Section]:
    """Token vs block verification per drafter."""
    if ctx.frame.height == 0:
        return [Section("No finished runs", "No cell of this sweep has finished yet.")]
    return arms_sections(ctx, VERIFIER)


@REPORT_BUILDERS.register("scheduler_arms")
def build_scheduler_arms(ctx: ReportContext) -> list[Section]:
    """The scheduler's stop rule and the bypass, each against Algorithm 1 as written (bypass off)."""
    if ctx.frame.height == 0:
        return [Section("No finished runs", "No cell of this sweep has finished yet.")]
    stop = arms_sections(restricted(ctx, "decode.bypass", "off"), SCHEDULER_STOP)
    bypass = arms_sections(restricted(ctx, "decode.scheduler_stop", "first_non_improvement"), BYPASS)
    for section, prefix in ((stop, "Stop rule"), (bypass, "Bypass")):
        for part in section:
            part.title = f"{prefix}: {part.title}"
    return stop + bypass
