"""Frontier analysis over serving summaries (paper §5.4 Fig. 7/8, METHOD §7).

Input: `ServeSummary` records of several policies × concurrency levels R, real or simulated. A policy's
*concurrency curve* is its points ordered by R: (throughput, per-user speed) pairs that usually trade one for the
other as R grows. Comparisons interpolate piecewise-linearly along that curve:

- `speedup_at_matched_throughput`: at each baseline point whose throughput the policy's curve also reaches, the
  policy's per-user speed there over the baseline's (the paper's "+60–85% TPS at matched throughput");
- `throughput_gain_at_user_speed`: at fixed per-user speed targets (SLAs), the policy's throughput over the
  baseline's (the paper's "+51% throughput at 80 tok/s/user");
- `gap_to_best_static`: per R, the policy's throughput relative to the best of mtp1 / static / fixed.

Where a curve crosses a value more than once (throughput saturating and falling), the best crossing counts (the
frontier is what the policy can achieve). Missing policies or no overlap give NaN / empty results with a `reason`,
never exceptions: these functions sit on report paths.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

import polars as pl

from dspark.serving.records import ServeSummary

STATIC_POLICIES = ("mtp1", "static", "fixed")
NAN = float("nan")


def _finite(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _points(summaries: Sequence[ServeSummary], policy: str, simulated: bool | None) -> list[ServeSummary]:
    """The policy's usable points, one per R (a real run over a simulated one, later over earlier), ordered by R."""
    by_rows: dict[int, ServeSummary] = {}
    for s in summaries:
        if s.policy != policy or (simulated is not None and s.simulated != simulated):
            continue
        if not _finite(s.throughput, s.user_speed):
            continue
        kept = by_rows.get(s.concurrency)
        if kept is None or kept.simulated or not s.simulated:
            by_rows[s.concurrency] = s
    return [by_rows[r] for r in sorted(by_rows)]


def frontier(summaries: Sequence[ServeSummary], policy: str, *, simulated: bool | None = None) -> list[ServeSummary]:
    """The policy's points (finite throughput and user speed, one per R) sorted by throughput; [] when none.

    simulated: True / False keeps only simulated / real points; None keeps both (real wins at equal R).
    """
    return sorted(_points(summaries, policy, simulated), key=lambda s: (s.throughput, s.concurrency))


def _interpolate(curve: Sequence[tuple[float, float]], x: float) -> float:
    """max over the segments of `curve` (ordered pairs) that contain x of the linearly interpolated y; NaN if none."""
    best = NAN
    if len(curve) == 1 and curve[0][0] == x:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if not min(x0, x1) <= x <= max(x0, x1):
            continue
        y = max(y0, y1) if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
        best = y if math.isnan(best) else max(best, y)
    return best


def _span(values: Sequence[float]) -> str:
    return f"[{min(values):.4g}, {max(values):.4g}]"


# ---- per-user speed at matched throughput ----


@dataclass
class SpeedupPoint:
    concurrency: int  # the baseline point's R
    throughput: float  # the matched throughput (tokens/s)
    baseline_speed: float  # tokens/s/user
    policy_speed: float  # interpolated on the policy's concurrency curve
    ratio: float  # policy_speed / baseline_speed


@dataclass
class MatchedSpeedup:
    """Per-user speed ratios at baseline points inside the policy's throughput range."""

    policy: str
    baseline: str
    points: list[SpeedupPoint] = field(default_factory=list)
    min: float = NAN
    median: float = NAN
    max: float = NAN
    reason: str | None = None  # why there are no points (None when there are)


def speedup_at_matched_throughput(
    summaries: Sequence[ServeSummary], policy: str, baseline: str, *, simulated: bool | None = None
) -> MatchedSpeedup:
    """Per-user speed of `policy` over `baseline` at the throughputs of the baseline's points (module docstring)."""
    mine, theirs = _points(summaries, policy, simulated), _points(summaries, baseline, simulated)
    result = MatchedSpeedup(policy, baseline)
    if not mine or not theirs:
        result.reason = (
            f"not enough points: {policy} has {len(mine)} and {baseline} has {len(theirs)} usable "
            "summaries (finite throughput and user speed)"
        )
        return result
    curve = [(s.throughput, s.user_speed) for s in mine]
    for point in sorted(theirs, key=lambda s: s.throughput):
        speed = _interpolate(curve, point.throughput)
        if _finite(speed) and point.user_speed > 0:
            result.points.append(
                SpeedupPoint(point.concurrency, point.throughput, point.user_speed, speed, speed / point.user_speed)
            )
    if not result.points:
        result.reason = (
            f"not enough points: no overlap in throughput ({baseline} "
            f"{_span([s.throughput for s in theirs])}, {policy} {_span([c[0] for c in curve])} "
            "tokens/s); add concurrency levels where both reach the same throughput"
        )
        return result
    ratios = [p.ratio for p in result.points]
    result.min, result.median, result.max = min(ratios), statistics.median(ratios), max(ratios)
    return result


# ---- throughput at per-user speed targets (SLAs) ----


@dataclass
class ThroughputGain:
    target: float  # per-user speed (tokens/s/user)
    policy_throughput: float  # interpolated on the policy's concurrency curve (NaN when out of range)
    baseline_throughput: float
    ratio: float  # policy_throughput / baseline_throughput
    reason: str | None = None  # why ratio is NaN


def _throughput_at(points: list[ServeSummary], name: str, target: float) -> tuple[float, str | None]:
    if not points:
        return NAN, f"not enough points: no usable summaries of {name}"
    speeds = [s.user_speed for s in points]
    value = _interpolate([(s.user_speed, s.throughput) for s in points], target)
    if _finite(value):
        return value, None
    if target > max(speeds):
        return NAN, f"{name} never reaches {target:g} tokens/s/user (fastest {max(speeds):.4g})"
    return NAN, (
        f"{target:g} tokens/s/user is below every measured point of {name} (slowest {min(speeds):.4g}); "
        "add higher concurrency levels"
    )


def throughput_gain_at_user_speed(
    summaries: Sequence[ServeSummary],
    policy: str,
    baseline: str,
    targets: Sequence[float],
    *,
    simulated: bool | None = None,
) -> list[ThroughputGain]:
    """Throughput ratio policy / baseline at each per-user speed target (throughput interpolated against speed)."""
    mine, theirs = _points(summaries, policy, simulated), _points(summaries, baseline, simulated)
    gains = []
    for target in targets:
        ours, why_ours = _throughput_at(mine, policy, float(target))
        base, why_base = _throughput_at(theirs, baseline, float(target))
        ratio = ours / base if _finite(ours, base) and base > 0 else NAN
        reason = why_ours or why_base or (None if _finite(ratio) else f"{baseline} throughput is 0")
        gains.append(ThroughputGain(float(target), ours, base, ratio, reason))
    return gains


# ---- gap to the best static policy per concurrency ----


@dataclass
class GapRow:
    concurrency: int
    throughput: float  # the policy's
    best_static: str | None  # which of the static policies was best at this R
    best_static_throughput: float
    gap: float  # throughput / best − 1 (negative = below the best static)
    reason: str | None = None


@dataclass
class StaticGap:
    policy: str
    rows: list[GapRow] = field(default_factory=list)
    reason: str | None = None  # why there are no rows


def gap_to_best_static(
    summaries: Sequence[ServeSummary],
    policy: str = "scheduler",
    *,
    statics: Sequence[str] = STATIC_POLICIES,
    simulated: bool | None = None,
) -> StaticGap:
    """Per R where `policy` ran: its throughput relative to the best static policy run at the same R."""
    mine = _points(summaries, policy, simulated)
    result = StaticGap(policy)
    if not mine:
        result.reason = f"not enough points: no usable summaries of {policy}"
        return result
    static_points = {name: {s.concurrency: s for s in _points(summaries, name, simulated)} for name in statics}
    for point in mine:
        rivals = [
            (pts[point.concurrency].throughput, name) for name, pts in static_points.items() if point.concurrency in pts
        ]
        if not rivals:
            result.rows.append(
                GapRow(
                    point.concurrency,
                    point.throughput,
                    None,
                    NAN,
                    NAN,
                    f"no static policy ({', '.join(statics)}) ran at R={point.concurrency}",
                )
            )
            continue
        best, name = max(rivals)
        gap = point.throughput / best - 1.0 if best > 0 else NAN
        result.rows.append(
            GapRow(
                point.concurrency,
                point.throughput,
                name,
                best,
                gap,
                None if _finite(gap) else f"{name} throughput is 0",
            )
        )
    return result


# ---- report table ----

SUMMARY_SCHEMA = {
    "policy": pl.String,
    "concurrency": pl.Int64,
    "simulated": pl.Boolean,
    "throughput": pl.Float64,
    "user_speed": pl.Float64,
    "budget": pl.Float64,
    "tau": pl.Float64,
    "num_requests": pl.Int64,
    "num_steps": pl.Int64,
    "wall_seconds": pl.Float64,
}


def summaries_frame(summaries: Sequence[ServeSummary]) -> pl.DataFrame:
    """One row per summary (columns of `ServeSummary`), sorted by policy, simulated, R; empty frame when none."""
    rows = [{key: getattr(s, key) for key in SUMMARY_SCHEMA} for s in summaries]
    frame = pl.DataFrame(rows, schema=SUMMARY_SCHEMA)
    return frame.sort(["policy", "simulated", "concurrency"])
