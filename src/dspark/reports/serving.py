"""Report of `sweep=serving` (paper Fig. 7, Fig. 8, §7): the throughput–interactivity frontier per policy.

Reads only the tracking store: per cell (policy × concurrency R) the real engine's `serve/{throughput, user_speed,
budget, tau}` and the simulator's `sim/R{R}/...` (trace replay at higher R) and `sim/validation/*_rel_err` (the
simulator replaying the same cell, against the real numbers). Seeds are averaged per (policy, R); a policy's
simulated point at level R is the mean over that policy's cells (each replays the same trace with its own fitted
step costs). The comparisons come from `dspark.serving.load`: every registered policy other than the static ones
(`POLICIES` order) against MTP-1, each a claim 'serving.<policy>_vs_mtp1.user_speed[_simulated]': on the real engine
a median over matched points, one cell per (policy, R), so no interval; simulated, the same median per *replay* —
the cells of one real R (one per policy) replay every simulated level with their own fitted step costs, so each
real R is one replicate — with the Student-t interval over the replays (`replicate_interval`; replays that agree
exactly give no interval: they did not vary). Seeds are the runs of a claim; with one seed the verdict of an
interval reads "seed variance not measured" (`claims.verdict_of`): replays vary the step costs, not the trace.
A level where a policy verified (almost) nothing (mean ℓ < NOTHING_VERIFIED: target-only decoding) is named where
its ratio is printed. Fig. 8 is judged as 'serving.scheduler_budget_vs_load[_simulated]': the scheduler's mean ℓ
at the highest R minus at the lowest (the paper: the budget shrinks as load grows), real (one cell per R: no
interval) and simulated (per replay, as above). And the scheduler's worst gap to the best static policy
('serving.scheduler_vs_best_static.throughput').
"""

from __future__ import annotations

import math
import re

import polars as pl

from dspark.decoding.policies import POLICIES
from dspark.markdown import markdown_table, num, pct
from dspark.reports.claims import ONE_SEED, Claim
from dspark.reports.context import REPORT_BUILDERS, ReportContext
from dspark.reports.stats import Estimate, estimate
from dspark.reports.writer import Section
from dspark.serving.records import ServeSummary

BASELINE_POLICY = "mtp1"  # the paper's serving baseline (Fig. 7: MTP-1 verifies one draft per request and step)
FIELDS = ("throughput", "user_speed", "budget", "tau")
POLICY_AXIS, CONCURRENCY_AXIS = "axis.serve.policy", "axis.serve.concurrency"
_SIM = re.compile(r"^sim/R(\d+)/throughput$")
NOTHING_VERIFIED = 0.05  #: mean ℓ per request per step below which a policy verified (almost) nothing there
STATISTICS_NOTE = (
    "Statistics (docs/STATISTICS.md): each policy against MTP-1 is its own claim (no family, no multiplicity "
    "adjustment). The real engine ran one cell per (policy, R), so its ratios have no interval. A simulated "
    "ratio's interval is Student-t over the replays: one per real R, each with its cell's fitted step costs. With "
    "one seed the replays share one trace, so a deciding interval reads *seed variance not measured*."
)
PAPER_CLAIM = (
    "Paper (Fig. 7, §7): at matched aggregate throughput the confidence scheduler raises per-user speed "
    "1.60–1.85× over MTP-1, and it tracks the best static verification length at every concurrency "
    "(Fig. 8: the budget shrinks as concurrency grows)."
)


def _policies(frame: pl.DataFrame) -> list[str]:
    """The policies of the cells, in registration order (`POLICIES`), then any the registry no longer has."""
    found = [str(p) for p in frame[POLICY_AXIS].unique().to_list()] if POLICY_AXIS in frame.columns else []
    order = POLICIES.ordered()
    return [p for p in order if p in found] + sorted(p for p in found if p not in order)


def adaptive_policies(summaries: list[ServeSummary]) -> list[str]:
    """The policies served other than the static ones (`serving.load.STATIC_POLICIES`), in registration order."""
    from dspark.serving.load import STATIC_POLICIES

    served = {s.policy for s in summaries}
    return [p for p in POLICIES.ordered() if p in served and p not in STATIC_POLICIES]


def _arms(frame: pl.DataFrame, *policies: str) -> tuple[int, str]:
    """(runs per arm: the fewest seeds among `policies`, all their seeds as '0,1')."""
    column = "axis.seed" if "axis.seed" in frame.columns else "seed"
    if column not in frame.columns or POLICY_AXIS not in frame.columns:
        return 0, ""
    seeds = {
        p: {v for v in frame.filter(pl.col(POLICY_AXIS) == p)[column].to_list() if v is not None} for p in policies
    }
    every = sorted(set().union(*seeds.values()), key=str)
    return min(len(v) for v in seeds.values()), ",".join(str(v) for v in every)


def _mean(frame: pl.DataFrame, column: str) -> float:
    values = [v for v in frame[column].to_list() if v is not None] if column in frame.columns else []
    return sum(values) / len(values) if values else float("nan")


def real_summaries(frame: pl.DataFrame) -> list[ServeSummary]:
    """One summary per (policy, R) from the real engine's metrics, seeds averaged."""
    out = []
    for policy in _policies(frame):
        part = frame.filter(pl.col(POLICY_AXIS) == policy)
        for level in sorted({int(r) for r in part[CONCURRENCY_AXIS].to_list()}):
            rows = part.filter(pl.col(CONCURRENCY_AXIS) == level)
            values = {f: _mean(rows, f"serve/{f}") for f in FIELDS}
            if math.isfinite(values["throughput"]):
                out.append(
                    ServeSummary(
                        policy=policy,
                        concurrency=level,
                        num_requests=int(_mean(rows, "serve/num_requests")),
                        num_steps=int(_mean(rows, "serve/steps")),
                        wall_seconds=_mean(rows, "serve/wall_seconds"),
                        **values,
                    )
                )
    return out


def simulated_summaries(frame: pl.DataFrame) -> list[ServeSummary]:
    """One simulated summary per (policy, simulated R): the mean over the policy's cells."""
    levels = sorted({int(m.group(1)) for c in frame.columns if (m := _SIM.match(c))})
    out = []
    for policy in _policies(frame):
        part = frame.filter(pl.col(POLICY_AXIS) == policy)
        for level in levels:
            values = {f: _mean(part, f"sim/R{level}/{f}") for f in FIELDS}
            if math.isfinite(values["throughput"]):
                out.append(
                    ServeSummary(
                        policy=policy,
                        concurrency=level,
                        num_requests=0,
                        num_steps=0,
                        wall_seconds=float("nan"),
                        simulated=True,
                        **values,
                    )
                )
    return out


def replay_levels(frame: pl.DataFrame) -> list[int]:
    """The real concurrency levels whose cells replayed the simulated levels: every (policy, R) cell simulates the
    same levels with its own fitted step costs, so the cells of one real R (one per policy) are one replicate of
    the simulated frontier (none without simulated metrics)."""
    if not any(_SIM.match(c) for c in frame.columns) or CONCURRENCY_AXIS not in frame.columns:
        return []
    return sorted({int(r) for r in frame[CONCURRENCY_AXIS].to_list()})


def replicate_interval(values: list[float]) -> Estimate:
    """Mean and 95% Student-t interval over replicates (n − 1 df); replicates that agree exactly give no interval:
    they did not vary, so they say nothing about the spread."""
    found = estimate(values)
    if found.n >= 2 and not found.half_width > 0:
        return Estimate(found.mean, math.nan, found.n)
    return found


def replicated_speedups(frame: pl.DataFrame, policy: str) -> list[float]:
    """Per replay (`replay_levels`), the simulated per-user speed ratio of `policy` over MTP-1 at matched
    throughput, the median over its matched points (as the pooled claim reads); a replay whose curves do not
    overlap in throughput gives none."""
    from dspark.serving.load import speedup_at_matched_throughput

    ratios = []
    for level in replay_levels(frame):
        cells = simulated_summaries(frame.filter(pl.col(CONCURRENCY_AXIS) == level))
        result = speedup_at_matched_throughput(cells, policy, BASELINE_POLICY, simulated=True)
        if not result.reason:
            ratios.append(result.median)
    return ratios


def verified_nothing(summaries: list[ServeSummary], policy: str, *, simulated: bool) -> list[int]:
    """The levels R at which `policy` verified (almost) nothing (mean ℓ < NOTHING_VERIFIED: target-only decoding)."""
    return [
        s.concurrency
        for s in summaries
        if s.policy == policy and s.simulated == simulated and math.isfinite(s.budget) and s.budget < NOTHING_VERIFIED
    ]


def nothing_text(levels: list[int], policy: str) -> str:
    if not levels:
        return ""
    where = ", ".join(f"R = {r}" for r in levels)
    return f" At {where} {policy} verified nothing (mean ℓ < {NOTHING_VERIFIED}): target-only decoding there."


def _summary_table(summaries: list[ServeSummary], frame: pl.DataFrame) -> str:
    header = ["policy", "R", "throughput (tok/s)", "per-user speed (tok/s/user)", "mean ℓ per request", "τ", "n"]
    rows = []
    for s in summaries:
        part = frame.filter((pl.col(POLICY_AXIS) == s.policy) & (pl.col(CONCURRENCY_AXIS) == s.concurrency))
        speed = estimate(part["serve/user_speed"].to_list())
        rows.append(
            [s.policy, s.concurrency, num(s.throughput, 2), speed.text(2), num(s.budget, 2), num(s.tau, 3), part.height]
        )
    return markdown_table(header, rows)


def _sim_table(summaries: list[ServeSummary]) -> str:
    header = ["policy", "R (simulated)", "throughput (tok/s)", "per-user speed", "mean ℓ", "τ", "note"]
    return markdown_table(
        header,
        [
            [
                s.policy,
                s.concurrency,
                num(s.throughput, 2),
                num(s.user_speed, 2),
                num(s.budget, 2),
                num(s.tau, 3),
                "verified nothing: target-only" if math.isfinite(s.budget) and s.budget < NOTHING_VERIFIED else "",
            ]
            for s in summaries
        ],
    )


def _speedup_lines(ctx: ReportContext, summaries: list[ServeSummary], *, simulated: bool) -> list[str]:
    from dspark.serving.load import speedup_at_matched_throughput, throughput_gain_at_user_speed

    kind = "simulated" if simulated else "real engine"
    lines = []
    for policy in adaptive_policies(summaries):
        result = speedup_at_matched_throughput(summaries, policy, BASELINE_POLICY, simulated=simulated)
        nothing = nothing_text(verified_nothing(summaries, policy, simulated=simulated), policy)
        if result.reason:
            lines.append(f"- {policy} vs {BASELINE_POLICY} ({kind}): {result.reason}.{nothing}")
            continue
        points = ", ".join(
            f"{p.ratio:.2f}× at {p.throughput:.1f} tok/s ({BASELINE_POLICY} R={p.concurrency})" for p in result.points
        )
        summary = f"{result.median:.2f}× median (min {result.min:.2f}×, max {result.max:.2f}×)"
        runs, seeds = _arms(ctx.frame, policy, BASELINE_POLICY)
        judged = {
            "id": f"serving.{policy}_vs_{BASELINE_POLICY}.user_speed" + ("_simulated" if simulated else ""),
            "statement": f"At matched aggregate throughput, {policy} raises the per-user speed over MTP-1 "
            + ("(Fig. 7)." if policy != "async" else "(the production variant of the scheduler, §5.2)."),
            "paper": "1.60–1.85× (Fig. 7, §7)"
            if policy == "scheduler"
            else "tracks the scheduler (§5.2; no number)"
            if policy == "async"
            else "–",
            "runs": runs,
            "seeds": seeds,
        }
        scope = f"per-user speed ratio − 1 at matched throughput, median over matched points ({kind})"
        if nothing:
            scope += f"; {policy} verified nothing at R = " + ", ".join(
                str(r) for r in verified_nothing(summaries, policy, simulated=simulated)
            )
        replays = replicate_interval(replicated_speedups(ctx.frame, policy)) if simulated else None
        if replays is not None and replays.n >= 2 and math.isfinite(replays.half_width):
            total = len(replay_levels(ctx.frame))
            ours = (
                f"{replays.mean:.2f}× [{replays.low:.2f}, {replays.high:.2f}] over {replays.n} of {total} replays "
                f"(the others' curves do not overlap); {summary} on the cells' mean"
                if replays.n < total
                else f"{replays.mean:.2f}× [{replays.low:.2f}, {replays.high:.2f}] over {replays.n} replays; "
                f"{summary} on the cells' mean"
            )
            claim = Claim.judge(
                **judged,
                ours=ours,
                mean=replays.mean - 1.0,
                low=replays.low - 1.0,
                high=replays.high - 1.0,
                scope=f"{scope}; 95% t over the {replays.n} replays (one per real R: each cell's fitted step costs)"
                + (f"; {ONE_SEED}: replays vary the step costs, not the trace" if runs < 2 else ""),
            )
        else:
            why = (
                f"; the {replays.n} replays agree exactly: no interval"
                if replays is not None and replays.n >= 2
                else "; one cell per (policy, R): no interval"
            )
            ours = f"{summary} (no interval)"
            claim = Claim.judge(**judged, ours=ours, mean=result.median - 1.0, scope=scope + why)
        ctx.claims.append(claim)
        lines.append(
            f"- {policy} vs {BASELINE_POLICY} ({kind}): per-user speed at matched throughput {ours}: {points} "
            f"→ **{claim.verdict}**.{nothing}"
        )
    baseline = [s.user_speed for s in summaries if s.policy == BASELINE_POLICY and s.simulated == simulated]
    if baseline:
        gains = throughput_gain_at_user_speed(
            summaries, "scheduler", BASELINE_POLICY, sorted(baseline), simulated=simulated
        )
        text = ", ".join(
            f"{g.ratio:.2f}× at {g.target:.2f} tok/s/user"
            if math.isfinite(g.ratio)
            else f"n/a at {g.target:.2f} tok/s/user"
            for g in gains
        )
        lines.append(
            f"- scheduler vs {BASELINE_POLICY} ({kind}): aggregate throughput at {BASELINE_POLICY}'s "
            f"per-user speeds: {text}."
        )
    return lines


def _budget_lines(ctx: ReportContext, summaries: list[ServeSummary], *, simulated: bool) -> list[str]:
    """Fig. 8: the scheduler's mean ℓ at the lowest R minus at the highest (positive: the budget shrinks under load,
    the paper's direction), a claim 'serving.scheduler_budget_vs_load[_simulated]'; simulated levels are judged
    over the replays (module docstring)."""
    mine = sorted(
        (s for s in summaries if s.policy == "scheduler" and s.simulated == simulated and math.isfinite(s.budget)),
        key=lambda s: s.concurrency,
    )
    if len(mine) < 2:
        return []
    kind = "simulated" if simulated else "real engine"
    low, high = mine[0].concurrency, mine[-1].concurrency
    path = " → ".join(f"R={s.concurrency} {s.budget:.2f}" for s in mine)
    runs, seeds = _arms(ctx.frame, "scheduler")
    judged = {
        "id": "serving.scheduler_budget_vs_load" + ("_simulated" if simulated else ""),
        "statement": "The scheduler's verification budget shrinks as concurrency grows (Fig. 8).",
        "paper": "the budget shrinks as load grows (Fig. 8; no single number)",
        "runs": runs,
        "seeds": seeds,
    }
    scope = f"scheduler's mean ℓ at R={low} minus at R={high} ({kind}; positive: shrinks)"
    replays = replicate_interval(budget_drops(ctx.frame, low, high)) if simulated else None
    if replays is not None and replays.n >= 2 and math.isfinite(replays.half_width):
        ours = f"{replays.mean:+.2f} [{replays.low:+.2f}, {replays.high:+.2f}] over {replays.n} replays"
        claim = Claim.judge(
            **judged,
            ours=ours,
            mean=replays.mean,
            low=replays.low,
            high=replays.high,
            scope=f"{scope}; 95% t over the replays" + (f"; {ONE_SEED}" if runs < 2 else ""),
        )
    else:
        why = f"the {replays.n} replays agree exactly" if replays is not None and replays.n >= 2 else "one cell per R"
        ours = f"{mine[0].budget - mine[-1].budget:+.2f} (no interval: {why})"
        claim = Claim.judge(**judged, ours=ours, mean=mine[0].budget - mine[-1].budget, scope=scope)
    ctx.claims.append(claim)
    nothing = nothing_text(verified_nothing(summaries, "scheduler", simulated=simulated), "scheduler")
    return [f"- scheduler, {kind}: mean ℓ {path}; at R={low} minus at R={high}: {ours} → **{claim.verdict}**.{nothing}"]


def budget_drops(frame: pl.DataFrame, low: int, high: int) -> list[float]:
    """Per replay (`replay_levels`), the scheduler's simulated mean ℓ at R=low minus at R=high."""
    part = frame.filter(pl.col(POLICY_AXIS) == "scheduler") if POLICY_AXIS in frame.columns else frame.clear()
    drops = []
    for level in replay_levels(frame):
        rows = part.filter(pl.col(CONCURRENCY_AXIS) == level)
        first, last = _mean(rows, f"sim/R{low}/budget"), _mean(rows, f"sim/R{high}/budget")
        if math.isfinite(first) and math.isfinite(last):
            drops.append(first - last)
    return drops


def _gap_section(ctx: ReportContext, summaries: list[ServeSummary]) -> str:
    from dspark.serving.load import STATIC_POLICIES, gap_to_best_static

    gap = gap_to_best_static(summaries, "scheduler", simulated=False)
    if gap.reason:
        return gap.reason
    rows = [
        [
            r.concurrency,
            num(r.throughput, 2),
            r.best_static or "–",
            num(r.best_static_throughput, 2),
            pct(r.gap) if math.isfinite(r.gap) else (r.reason or "–"),
        ]
        for r in gap.rows
    ]
    worst = min((r.gap for r in gap.rows if math.isfinite(r.gap)), default=float("nan"))
    verdict = (
        f"Worst gap {pct(worst)} (goal: never more than 5% below the best static policy)."
        if math.isfinite(worst)
        else ""
    )
    if math.isfinite(worst):
        runs, seeds = _arms(ctx.frame, "scheduler", *[p for p in STATIC_POLICIES if p in _policies(ctx.frame)])
        ctx.claims.append(
            Claim.judge(
                id="serving.scheduler_vs_best_static.throughput",
                mean=worst,
                ours=f"{pct(worst)} (no interval)",
                statement="The scheduler tracks the best static verification length at every concurrency (Fig. 8).",
                paper="tracks the best static policy at every R (Fig. 8; no single number)",
                runs=runs,
                seeds=seeds,
                scope="the scheduler's aggregate throughput relative to the best static policy, worst over R",
            )
        )
    return markdown_table(["R", "scheduler tok/s", "best static", "its tok/s", "gap"], rows) + f"\n\n{verdict}"


def _validation_section(frame: pl.DataFrame) -> str:
    columns = [f"sim/validation/{f}_rel_err" for f in FIELDS]
    if not any(c in frame.columns for c in columns):
        return "No cell logged simulator validation errors."
    rows = []
    for row in frame.sort([POLICY_AXIS, CONCURRENCY_AXIS]).iter_rows(named=True):
        rows.append(
            [
                row[POLICY_AXIS],
                row[CONCURRENCY_AXIS],
                *[pct(row.get(c)) if row.get(c) is not None and math.isfinite(row[c]) else "–" for c in columns],
            ]
        )
    errors = [
        abs(v) for c in columns if c in frame.columns for v in frame[c].to_list() if v is not None and math.isfinite(v)
    ]
    mean_abs = sum(errors) / len(errors) if errors else float("nan")
    return (
        "The simulator replays the policy=fixed trace with each cell's policy and concurrency, timing steps "
        "with this machine's SPS(B) and step costs fitted to the real engine; (simulated − real) / real:\n\n"
        + markdown_table(["policy", "R", "throughput", "per-user speed", "mean ℓ", "τ"], rows)
        + f"\n\nMean absolute relative error {pct(mean_abs, signed=False)}."
    )


@REPORT_BUILDERS.register("serving")
def build_serving(ctx: ReportContext) -> list[Section]:
    """Fig. 7 frontier, Fig. 8 budget, scheduler vs MTP-1, gap to the best static policy, simulator validation."""
    from dspark.serving.plots import plot_budget, plot_frontier

    frame = ctx.frame
    if POLICY_AXIS not in frame.columns or "serve/throughput" not in frame.columns:
        return [
            Section(
                "No serving cells",
                "No completed cell logged serve/* metrics: the serving sweep runs "
                "stage=serve per cell (sweeps/serving.yaml).",
            )
        ]
    real, simulated = real_summaries(frame), simulated_summaries(frame)
    frontier = plot_frontier(real + simulated, ctx.png("frontier"), title="Throughput–interactivity frontier")
    budget = plot_budget(real + simulated, ctx.png("budget"), title="Verification budget against concurrency")
    sections = [
        Section(
            "Throughput–interactivity frontier (Fig. 7)",
            f"![frontier]({frontier.name})\n\nReal engine (one batched target forward per step, continuous "
            "batching, closed loop: a finished request is replaced at once); per (policy, R) the means over seeds, "
            "per-user speed ± its 95% Student-t half-width over runs (n):\n\n" + _summary_table(real, frame),
        ),
        Section(
            "Verification budget against concurrency (Fig. 8)",
            "\n".join(
                [
                    f"![budget]({budget.name})",
                    "",
                    "mean ℓ = drafts verified per request per step (the paper plots ℓ + 1). The paper: the "
                    "scheduler's budget shrinks as concurrency grows.",
                    "",
                    *_budget_lines(ctx, real, simulated=False),
                    *(_budget_lines(ctx, simulated, simulated=True) if simulated else []),
                ]
            ),
        ),
        Section(
            "Scheduler vs MTP-1",
            "\n".join(
                [
                    PAPER_CLAIM,
                    "",
                    STATISTICS_NOTE,
                    "",
                    *_speedup_lines(ctx, real, simulated=False),
                    *(_speedup_lines(ctx, simulated, simulated=True) if simulated else []),
                ]
            ),
        ),
        Section("Scheduler vs the best static policy", _gap_section(ctx, real)),
    ]
    if simulated:
        sections.append(
            Section(
                "Simulated concurrency levels (labelled simulated)",
                "Trace replay of recorded confidences and acceptance outcomes; each level's steps "
                "are timed with the SPS(B) of that level: this machine's batched verify forward "
                "profiled with R rows (up to R·(γ+1) tokens), or the `serve.sps_table` the run "
                "names:\n\n" + _sim_table(simulated),
            )
        )
    sections.append(Section("Simulator validation", _validation_section(frame)))
    return sections
