"""The confidence-source report (`sweep=confidence`): where c_k comes from — the trained head, the drafter's own max
probability, or an online logistic estimator (`decode.confidence`, dspark.decoding.confidence) — judged two ways,
side by side per drafter:

1. how well each source's cumulative confidence a_k ranks and calibrates prefix acceptance, on held-out rounds (the
   STS fit / score split of dspark.evaluation.calibrate): AUROC with a 95% interval (Hanley–McNeil within each run,
   pooled over seeds by the claims module's rule), ECE before and after STS; cells with too few accepts or
   rejections are "uninformative", as the calibration table says;
2. what each source buys under the scheduler: per-prompt τ and per-prompt speed-up over target-only decoding, with
   their 95% intervals, and each head-less source against the head (same drafter, same prompts) as a judged claim.

The field's evidence (FIELD.md): vLLM's online estimator on logit(max q) beat one checkpoint's trained head in
throughput; other engines use plain max-softmax. The paper has no such comparison, so its column reads "–".
"""

from __future__ import annotations

import math
import re

import polars as pl

from dspark.markdown import markdown_table
from dspark.reports.arms import ArmSpec, arms_sections, metric_values
from dspark.reports.claims import Pooled, pool
from dspark.reports.context import REPORT_BUILDERS, ReportContext, axis_text
from dspark.reports.writer import Section

SOURCE_AXIS = "axis.decode.confidence"
HEAD = "head"


def _positions(ctx: ReportContext) -> list[int]:
    found = {int(m.group(1)) for c in ctx.frame.columns if (m := re.match(r"calibration/count/pos(\d+)$", c))}
    return sorted(found)


def _informative(rows: pl.DataFrame, k: int) -> list[bool]:
    flags = metric_values(rows, f"calibration/informative/pos{k}")
    return [flag is None or float(flag) == 1.0 for flag in flags]  # None: logged before the flag existed


def pooled_auroc(rows: pl.DataFrame, k: int, *, when: str = "before") -> Pooled:
    """AUROC of a_k at position k (raw source: `before`; after STS: `after`) over the runs whose cell is
    informative, with its within-run Hanley–McNeil se."""
    keep = _informative(rows, k)
    values = [v if ok else None for v, ok in zip(metric_values(rows, f"calibration/auroc_{when}/pos{k}"), keep)]
    return pool(values, metric_values(rows, f"calibration/auroc_{when}_se/pos{k}"))


def _interval(p: Pooled, digits: int = 3) -> str:
    if not p.ok:
        return "uninformative"
    if not math.isfinite(p.se):
        return f"{p.mean:.{digits}f} (n={p.runs})"
    return f"{p.mean:.{digits}f} [{p.low:.{digits}f}, {p.high:.{digits}f}] (n={p.runs})"


def _ece(rows: pl.DataFrame, k: int, when: str) -> str:
    column = zip(metric_values(rows, f"calibration/ece_{when}/pos{k}"), _informative(rows, k))
    values = [v for v, ok in column if ok and v is not None and math.isfinite(v)]
    return f"{100 * sum(values) / len(values):.1f}" if values else "uninformative"


def _group_label(group: dict) -> str:
    return axis_text(group, skip=("axis.seed",))


def quality_section(ctx: ReportContext, positions: list[int]) -> Section:
    header = [
        "configuration",
        "k",
        "rounds scored",
        "accepts",
        "AUROC raw [95% CI]",
        "AUROC after STS",
        "ECE % raw → STS",
    ]
    rows = []
    for group in ctx.group_dicts():
        frame = ctx.rows_of(group)
        for k in positions:
            counts = [v for v in metric_values(frame, f"calibration/count/pos{k}") if v is not None]
            accepts = [v for v in metric_values(frame, f"calibration/positives/pos{k}") if v is not None]
            rows.append(
                [
                    _group_label(group),
                    k,
                    int(sum(counts)),
                    int(sum(accepts)),
                    _interval(pooled_auroc(frame, k)),
                    _interval(pooled_auroc(frame, k, when="after")),
                    f"{_ece(frame, k, 'before')} → {_ece(frame, k, 'after')}",
                ]
            )
    body = (
        "Held-out rounds decoded with ℓ = γ: STS fitted on one half of the calibration prompts, every number here "
        "scored on the other half (dspark.evaluation.calibrate). AUROC of the cumulative a_k against the "
        "prefix-accept event, its 95% interval from Hanley–McNeil's se within each run pooled over seeds "
        "(rounds of one prompt are correlated, so the within-run part is optimistic); accepts and rounds summed "
        "over the runs; *uninformative*: fewer than 10 accepts or 10 rejections at that position in a run "
        "(dspark.evaluation.calibrate.MIN_EVENTS), where ECE is small by construction and AUROC noise."
    )
    return Section("Ranking and calibration per source (held-out)", body + "\n\n" + markdown_table(header, rows))


SOURCES = ArmSpec(
    report="confidence",
    axis="decode.confidence",
    baseline=HEAD,
    statement="decode.confidence={arm} beats the trained head under the scheduler",
    paper="– (the paper uses its trained head only; vLLM reported an online estimator on logit(max q) ahead of one "
    "checkpoint's trained head in throughput, FIELD.md)",
    extra_metrics=(("confidence/online/updates", "online updates"),),
)


@REPORT_BUILDERS.register("confidence")
def build_confidence(ctx: ReportContext) -> list[Section]:
    """Confidence sources side by side: held-out AUROC / ECE and τ / speed-up under the scheduler, each head-less
    source judged against the head."""
    if ctx.frame.height == 0:
        return [Section("No finished runs", "No cell of this sweep has finished yet.")]
    sections = []
    positions = _positions(ctx)
    if positions:
        sections.append(quality_section(ctx, positions))
    else:
        sections.append(
            Section("No calibration", "No cell logged held-out calibration metrics (decode.calibrate=false?).")
        )
    return sections + arms_sections(ctx, SOURCES)
