"""Report of the draft-tree sweep `tree` (sweeps/tree.yaml, METHOD §5.1): do draft trees beat the chain on each
drafter, at equal node budgets?

Per drafter and tree shape (the chain included):

- τ: the per-prompt τ over all prompts, pooled over prompts and seeds (`claims.pooled_tau`: each run's within-run
  se from its logged prompt interval plus the between-seed spread), with its 95% Student-t interval (the
  Welch–Satterthwaite df of those terms, `claims` module docstring);
- nodes per round: the nodes the target verified per round, a tree's N (`RoundRecord.tree_nodes`) and the chain's
  ℓ_eff, as the mean over the rounds of each run's records (`eval/rounds.jsonl`, where the store holds them), else
  what the shape fixes: a static tree its size (rounds cut at the context's end verify fewer), a dynamic tree its cap
  N ≤ nodes, the chain τ / verify_rate − 1 (METHOD §1: verify_rate = Σ τ / Σ (ℓ_eff + 1), from the logged means);
- speed-up: tokens per second against target-only decoding of the same prompts, per prompt, pooled as τ is, when
  the cells measured it (decode.baseline).

One claim per drafter, `tree.<drafter>_best_tree_vs_chain.all`: the τ of its best tree shape over its chain's. The
best of K shapes is chosen by its point estimate, and judging the winner at 95% would overstate it (the winner's
curse), so that interval is Bonferroni-widened to 95% over all K comparisons (the t quantile at 1 − 0.025 / K on
the log ratio's Satterthwaite df; a selection, not a family of separate claims, hence Bonferroni, not Holm). A
ratio's interval is the delta method on log τ, SE² = (se_tree / τ_tree)² + (se_chain / τ_chain)², the arms taken as
independent: they share the drafter and the prompts, a positive correlation, so the interval errs wide. The claim's
effect is the ratio − 1 (0 = no gain) and its verdict `claims.verdict_of` of that interval (one seed: seed variance
not measured); an arm with no spread at all (one run of one prompt) gives no interval.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.decoding.tree import TREE_SHAPES, TreeShape
from dspark.intervals import t_quantile_df
from dspark.markdown import MISSING, markdown_table
from dspark.reports.ablations import Group, drafter_of, drafter_order
from dspark.reports.claims import ALPHA, Claim, Pooled, pooled_prompt_metric, pooled_tau, satterthwaite, scaled
from dspark.reports.context import REPORT_BUILDERS, ReportContext, drafter_label
from dspark.reports.plots import plot_bars
from dspark.reports.stats import estimate
from dspark.reports.writer import Section

CHAIN = "chain"
SHAPE_AXIS = "axis.decode.tree.shape"
ROUNDS_ARTIFACT = "eval/rounds.jsonl"  # the evaluation's round records, attached to each cell's run
STATEMENT = "Draft trees beat the chain on {drafter}: its best tree shape reaches a longer τ (not a paper claim)."


@dataclass(frozen=True)
class Ratio:
    """τ_a / τ_b with its interval at `z` (delta method on the log: module docstring)."""

    mean: float
    low: float
    high: float

    def gain_text(self) -> str:
        return f"{self.mean - 1:+.1%} [{self.low - 1:+.1%}, {self.high - 1:+.1%}]"

    def text(self) -> str:
        return f"×{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def log_ratio_df(a: Pooled, b: Pooled) -> float:
    """The Welch–Satterthwaite df of log a − log b (the arms' terms over their means², `claims.scaled`)."""
    return satterthwaite(scaled(a.parts, 1 / a.mean**2) + scaled(b.parts, 1 / b.mean**2))


def ratio_interval(a: Pooled, b: Pooled, *, z: float | None = None, comparisons: int = 1) -> Ratio | None:
    """a / b with the interval exp(log a − log b ± z·SE), z the Bonferroni t quantile over `comparisons` on
    `log_ratio_df` unless given; None when either arm lacks a positive mean or a spread."""
    if not (a.ok and b.ok) or a.mean <= 0 or b.mean <= 0:
        return None
    if not all(math.isfinite(p.se) and p.se > 0 for p in (a, b)):
        return None
    z = familywise_z(comparisons, df=log_ratio_df(a, b)) if z is None else z
    log_ratio = math.log(a.mean / b.mean)
    se = math.hypot(a.se / a.mean, b.se / b.mean)
    return Ratio(math.exp(log_ratio), math.exp(log_ratio - z * se), math.exp(log_ratio + z * se))


def familywise_z(comparisons: int, *, df: float = math.inf) -> float:
    """The t quantile (df ∞: normal) of a Bonferroni 95% interval over `comparisons` two-sided comparisons."""
    return t_quantile_df(df, 1 - ALPHA / max(1, comparisons))


# ---- the arms ----


def shape_of(group: Group) -> str:
    return str(group.get(SHAPE_AXIS) or CHAIN)


def axis_list(group: Group, key: str) -> tuple[int, ...] | None:
    """A list-valued axis (`decode.tree.widths`), from the frame's JSON text or a list; None when not an axis."""
    value = group.get(f"axis.decode.tree.{key}")
    if value is None:
        return None
    values = json.loads(value) if isinstance(value, str) else value
    return tuple(int(v) for v in values)


def axis_int(group: Group, key: str) -> int | None:
    value = group.get(f"axis.decode.tree.{key}")
    return None if value is None else int(value)


def tree_label(group: Group) -> str:
    """'chain', 'widths [4,2,2,1,1,1,1]', 'branching [3,1,1,1] rrsw', 'dynamic N≤12 beam 4' (what the axes name)."""
    shape = shape_of(group)
    if shape == CHAIN:
        return CHAIN
    levels = axis_list(group, shape) if shape in ("widths", "branching") else None
    parts = [shape + (" [" + ",".join(map(str, levels)) + "]" if levels else "")]
    if shape == "dynamic":
        nodes, beam = axis_int(group, "nodes"), axis_int(group, "beam")
        parts += ([f"N≤{nodes}"] if nodes else []) + ([f"beam {beam}"] if beam else [])
    scheme = group.get("axis.decode.tree.scheme")
    return " ".join(parts + ([str(scheme)] if scheme and scheme != "descent" else []))


def shape_nodes(group: Group) -> str:
    """The nodes per round the shape fixes (the fallback when no round records were read), or '–'."""
    shape = shape_of(group)
    levels = axis_list(group, shape) if shape in ("widths", "branching") else None
    if levels:
        size = TreeShape(kind=shape, **{shape: levels}).max_nodes(gamma=len(levels))
        return f"{size} (shape)"
    nodes = axis_int(group, "nodes") if shape == "dynamic" else None
    return f"≤ {nodes} (shape)" if nodes else MISSING


def arms_by_drafter(ctx: ReportContext) -> dict[str, list[Group]]:
    """The configurations per drafter (`drafter_order`), shapes in registration order (chain first)."""
    groups = ctx.group_dicts()
    shapes = TREE_SHAPES.ordered()
    rank = lambda g: shapes.index(shape_of(g)) if shape_of(g) in shapes else len(shapes)  # noqa: E731
    found = drafter_order(drafter_of(g) for g in groups)
    found += sorted({drafter_of(g) for g in groups} - set(found))
    return {d: sorted((g for g in groups if drafter_of(g) == d), key=rank) for d in found}


# ---- per-arm numbers ----


def interval_text(p: Pooled, digits: int = 2) -> str:
    """'2.31 [2.20, 2.42]' (its 95% t interval), '2.31 (no interval)' or '–'."""
    if not p.ok:
        return MISSING
    if not (math.isfinite(p.se) and p.se > 0):
        return f"{p.mean:.{digits}f} (no interval)"
    return f"{p.mean:.{digits}f} [{p.low:.{digits}f}, {p.high:.{digits}f}]"


def nodes_of_rollouts(rollouts: list[Any]) -> float:
    """Mean nodes the target verified per round over the speculative rounds: `tree_nodes` (a tree round), else
    `num_verified` (a chain round's ℓ_eff); NaN without rounds."""
    counts = [
        int(r["tree_nodes"]) if r.get("tree_nodes") is not None else int(r["num_verified"])
        for rollout in rollouts
        if rollout.mode == "speculative"
        for r in rollout.rounds
    ]
    return sum(counts) / len(counts) if counts else math.nan


@contextlib.contextmanager
def quiet_downloads():
    """MLflow without its per-download progress bar (a report reads one small file per run: a bar each)."""
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def recorded_nodes(ctx: ReportContext, run_id: str) -> float | None:
    """The mean nodes per round of one run from its attached round records (None when the store has none)."""
    from dspark.evaluation.rollouts import read_rollouts_jsonl

    if ctx.store is None or not run_id:
        return None
    try:
        names = {a.path for a in ctx.store.client.list_artifacts(run_id, "eval")}
        if ROUNDS_ARTIFACT not in names:
            return None
        with tempfile.TemporaryDirectory() as tmp, quiet_downloads():
            local = ctx.store.client.download_artifacts(run_id, ROUNDS_ARTIFACT, tmp)
            value = nodes_of_rollouts(read_rollouts_jsonl(Path(local)))
    except Exception:  # a store whose artifacts cannot be read (a ledger's): the shape's number stands in
        return None
    return value if math.isfinite(value) else None


def nodes_text(ctx: ReportContext, group: Group) -> str:
    """Nodes per round: measured from the round records (mean ± 95% over runs), else the shape's (`shape_nodes`),
    else the chain's ℓ_eff derived from τ and the verify rate."""
    rows = ctx.rows_of(group)
    ids = rows["run_id"].to_list() if "run_id" in rows.columns else []
    measured = [v for v in (recorded_nodes(ctx, i) for i in ids) if v is not None]
    if measured:
        return estimate(measured).text(1)
    if shape_of(group) != CHAIN:
        return shape_nodes(group)
    if not {"eval/all/tau", "eval/all/verify_rate"} <= set(rows.columns):
        return MISSING
    ell = [
        t / v - 1.0
        for t, v in zip(rows["eval/all/tau"].to_list(), rows["eval/all/verify_rate"].to_list())
        if t is not None and v
    ]
    return f"≈ {estimate(ell).text(1)} (τ / verify rate)" if ell else MISSING


# ---- table, figure, claims ----


def tree_table(ctx: ReportContext, by_drafter: dict[str, list[Group]]) -> str:
    """Per drafter and shape: nodes per round, τ [95%], τ over the chain's [95%], speed-up [95%] when measured."""
    speed = any(pooled_prompt_metric(ctx.rows_of(g), "speedup").ok for arms in by_drafter.values() for g in arms)
    header = ["drafter", "tree", "nodes / round", "τ [95% CI]", "τ / chain [95% CI]"]
    header += ["speed-up vs target-only [95% CI]"] if speed else []
    rows = []
    for drafter, arms in by_drafter.items():
        chain = next((g for g in arms if shape_of(g) == CHAIN), None)
        base = pooled_tau(ctx.rows_of(chain)) if chain is not None else None
        for group in arms:
            tau = pooled_tau(ctx.rows_of(group))
            ratio = ratio_interval(tau, base) if base is not None and group is not chain else None
            vs = "1 (the reference)" if group is chain else (ratio.text() if ratio else MISSING)
            row = [drafter_label(drafter), tree_label(group), nodes_text(ctx, group), interval_text(tau), vs]
            row += [interval_text(pooled_prompt_metric(ctx.rows_of(group), "speedup"))] if speed else []
            rows.append(row)
    return markdown_table(header, rows)


def tree_figure(ctx: ReportContext, by_drafter: dict[str, list[Group]]) -> Path:
    """τ per shape with the 95% t interval the table prints (`claims.pooled_tau`)."""
    panels = {
        drafter_label(d): {tree_label(g): pooled_tau(ctx.rows_of(g)) for g in arms} for d, arms in by_drafter.items()
    }
    return plot_bars(panels, ctx.png("tau"), ylabel="τ per prompt (95% CI)", title="τ per draft-tree shape")


def judge_drafter(ctx: ReportContext, drafter: str, arms: list[Group]) -> str:
    """The drafter's claim (module docstring), recorded in `ctx.claims`; returns its line."""
    label = drafter_label(drafter)
    chain = next((g for g in arms if shape_of(g) == CHAIN), None)
    trees = [(g, pooled_tau(ctx.rows_of(g))) for g in arms if shape_of(g) != CHAIN]
    measured = [(g, p) for g, p in trees if p.ok]
    base = pooled_tau(ctx.rows_of(chain)) if chain is not None else Pooled(math.nan, math.nan, 0)
    common = {"id": f"tree.{drafter}_best_tree_vs_chain.all", "statement": STATEMENT.format(drafter=label)}
    common["paper"] = "– (trees are not in the paper)"
    if not (measured and base.ok):
        missing = "its chain" if not base.ok else "a tree shape"
        claim = Claim.judge(**common, ours=MISSING, mean=math.nan, runs=0, seeds="", scope=f"no run of {missing}")
        ctx.claims.append(claim)
        return f"- {label}: not run yet (no finished run of {missing})."
    best, tau = max(measured, key=lambda item: item[1].mean)
    family = len(measured)
    ratio = ratio_interval(tau, base, comparisons=family)
    runs, seeds = min(tau.runs, base.runs), ctx.seeds(best, chain)
    scope = (
        f"per-prompt τ ratio − 1, all prompts, best of {family} tree shape(s) ({tree_label(best)}) over the chain; "
        f"Bonferroni 95% over the {family}"
    )
    if ratio is None:
        gain = tau.mean / base.mean - 1
        ours = f"{gain:+.1%} (no interval)"
        claim = Claim.judge(**common, ours=ours, mean=gain, runs=runs, seeds=seeds, scope=scope)
    else:
        ours = ratio.gain_text()
        low, high = ratio.low - 1, ratio.high - 1
        claim = Claim.judge(
            **common, ours=ours, mean=ratio.mean - 1, low=low, high=high, runs=runs, seeds=seeds, scope=scope
        )
    ctx.claims.append(claim)
    detail = f" (τ {ratio.text()})" if ratio else ""
    return (
        f"- {label}: best tree {tree_label(best)} τ {tau.mean:.2f} vs chain {base.mean:.2f}: {ours}{detail}, "
        f"familywise 95% over {family} shape(s) (runs {tau.runs} vs {base.runs}) → **{claim.verdict}**"
    )


NOTE = (
    "τ = tokens committed per round (METHOD §1), per prompt, pooled over prompts and seeds with its 95% interval. "
    "A tree round commits its accepted path plus the target's token, so τ compares directly with the chain's. The "
    "chain verifies ℓ = γ nodes per round; the trees share one node budget among themselves, so a tree's longer τ "
    "is bought with more verified nodes per round: the speed-up column (when the cells measured it) says whether it "
    "pays on this machine. `τ / chain` is each shape's ratio to its drafter's chain at 95% for that one shape; the "
    "claims below judge the best shape with an interval widened for having picked it among K. At T > 0 the schemes "
    "accept differently (METHOD §5.1): `descent` takes a node only when the target's own sample is one of its "
    "children (the target's mass on them), the chain and `rrsw` by min(p_t, q) as rejection sampling does, so on a "
    "target whose next-token distribution is flat a deterministic tree (widths, dynamic) can commit less than the "
    "chain whatever its size; at T = 0 both are greedy."
)


@REPORT_BUILDERS.register("tree")
def build_tree(ctx: ReportContext) -> list[Section]:
    """Per drafter: τ, nodes per round and speed-up per tree shape, and the claim 'trees beat chains'."""
    by_drafter = arms_by_drafter(ctx)
    if not by_drafter:
        return [Section("No finished cells", "No cell of this sweep has finished: run the sweep first.")]
    path = tree_figure(ctx, by_drafter)
    lines = [judge_drafter(ctx, d, arms) for d, arms in by_drafter.items()]
    return [
        Section("How to read", NOTE),
        Section("τ per tree shape", tree_table(ctx, by_drafter) + f"\n\n![τ per tree shape]({path.name})"),
        Section("Do trees beat chains?", "\n".join(lines)),
    ]
