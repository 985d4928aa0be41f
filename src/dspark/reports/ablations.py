"""Reports of the drafter ablations: `main` (Table 1), `depth` (Fig. 3), `objective`, and (in `reports.sequential`)
`block_size` and `head`; also
the generic table any other grid sweep gets. Numbers are means over seeds ± 95% Student-t half-width (n runs);
gains are ratios of means minus 1, the paper's side computed over the same prompt sets (METHOD §9).

Drafters and heads come from their registries (`DRAFTER_BUILDERS`, `SEQUENTIAL_HEADS`), so a newly registered one
enters every comparison: drafters in the paper's Table 1 order after any the paper does not rank, heads in
registration order against no head and against the paper's default head. Every judged line is also recorded in
`ctx.claims` (`dspark.reports.claims.Claim`, ids '<report>.<comparison>.<scope>').
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable

from dspark.drafters.factory import DRAFTER_BUILDERS
from dspark.drafters.heads import SEQUENTIAL_HEADS
from dspark.reports import paper
from dspark.reports.claims import (
    Claim,
    Difference,
    difference_claim,
    judged,
    pooled_plain,
    pooled_tau,
)
from dspark.reports.context import (
    REPORT_BUILDERS,
    TAU_PROB,
    ReportContext,
    axis_text,
    domain_tau,
    drafter_label,
    eval_datasets,
    eval_domains,
    headline_metric,
    tau_note,
    variant_label,
)
from dspark.reports.plots import plot_bars, plot_lines
from dspark.markdown import markdown_table, num, pct
from dspark.reports.stats import Estimate, estimate, ratio_gain
from dspark.reports.writer import Section

Group = dict[str, Any]


def est(ctx: ReportContext, group: Group, column: str) -> Estimate:
    rows = ctx.rows_of(group)
    return estimate(rows[column].to_list() if column in rows.columns else [])


def drafter_of(group: Group) -> str:
    return str(group.get("axis.drafter") or group.get("drafter") or "")


def drafter_order(present) -> list[str]:
    """The registered drafters among `present`: those the paper does not rank first (registration order), then
    the paper's Table 1 order, best first."""
    present = set(present)
    new = [d for d in DRAFTER_BUILDERS.ordered() if d in present and d not in paper.DRAFTER_ORDER]
    return new + [d for d in paper.DRAFTER_ORDER if d in present and d in DRAFTER_BUILDERS]


def drafter_pairs(present) -> list[tuple[str, str]]:
    """Every (a, b) with a before b in `drafter_order`: a is the drafter expected ahead."""
    return list(itertools.combinations(drafter_order(present), 2))


def compared_heads(present) -> list[str]:
    """The registered heads among `present` other than no head, in registration order."""
    return [h for h in SEQUENTIAL_HEADS.ordered() if h in present and h != paper.NO_HEAD]


def judge(
    ctx: ReportContext,
    label: str,
    diff: Difference,
    *,
    id: str,
    statement: str,
    paper_text: str,
    scope: str,
    arms: tuple[Group, Group],
    relative: bool = True,
) -> str:
    """The line `judged` prints, recording the same numbers as a Claim in `ctx.claims`."""
    ctx.claims.append(
        difference_claim(
            diff, id=id, statement=statement, paper=paper_text, scope=scope, seeds=ctx.seeds(*arms), relative=relative
        )
    )
    return judged(label, diff, relative=relative)


def point_claim(
    ctx: ReportContext,
    *,
    id: str,
    statement: str,
    paper_text: str,
    gain: float,
    ours: str,
    scope: str,
    arms: tuple[Group, ...],
    column: str,
) -> None:
    """Record a judgement the report makes on point estimates (no interval) as a Claim."""
    runs = min(est(ctx, g, column).n for g in arms) if math.isfinite(gain) else 0
    ctx.claims.append(
        Claim.judge(
            id=id,
            statement=statement,
            paper=paper_text,
            ours=f"{ours} (no interval)",
            mean=gain,
            runs=runs,
            seeds=ctx.seeds(*arms),
            scope=scope,
        )
    )


def config_table(
    ctx: ReportContext, groups: list[Group], *, label: Callable[[Group], str], reference: Group | None = None
) -> str:
    """Per configuration: τ per domain and overall, the teacher-forced proxy, and the gain over `reference`."""
    domains = eval_domains(ctx.frame)
    columns = [(f"τ {d}", domain_tau(d), 2) for d in domains] + ([("τ all", "eval/all/tau", 2)] if domains else [])
    columns += [
        (name, col, digits)
        for name, col, digits in (("τ_prob (val)", TAU_PROB, 3), ("speed-up", "summary/speedup", 2))
        if ctx.has(col)
    ]
    header = ["configuration", *[name for name, _, _ in columns]]
    if reference is not None:
        header.append(f"τ vs {label(reference)}")
    rows = []
    for group in groups:
        row = [label(group), *[est(ctx, group, col).text(digits) for _, col, digits in columns]]
        if reference is not None:
            metric = "eval/all/tau" if domains else TAU_PROB
            row.append(pct(ratio_gain(est(ctx, group, metric), est(ctx, reference, metric))))
        rows.append(row)
    return markdown_table(header, rows)


def domain_panels(ctx: ReportContext) -> list[tuple[str, str]]:
    """(panel title, column) per domain when runs evaluated, else one panel of the proxy."""
    domains = eval_domains(ctx.frame)
    if domains:
        return [(d, domain_tau(d)) for d in domains]
    return [("all (validation proxy)", TAU_PROB)]


def claim_section(name: str, lines: list[str]) -> Section:
    return Section("Paper vs ours", "\n".join([f"Paper: {paper.CLAIMS[name]}", "", *lines]))


# ---- main (Table 1) ----


def per_set_means(ctx: ReportContext, group: Group, datasets: list[str]) -> dict[str, float]:
    out = {}
    for d in datasets:
        e = est(ctx, group, f"eval/{d}/tau")
        if e.ok:
            out[d] = e.mean
    return out


def table1(ctx: ReportContext, groups: list[Group], datasets: list[str]) -> str:
    """Table 1 layout: τ per prompt set, domain and overall for each drafter, ours then the paper's."""
    known = [g for g in groups if drafter_of(g) in paper.TABLE1_TAU]
    header = [
        "prompt set",
        *[f"{variant_label(g)} ours" for g in groups],
        *[f"{variant_label(g)} paper" for g in known],
    ]
    rows = []
    for d in datasets:
        rows.append(
            [
                d,
                *[est(ctx, g, f"eval/{d}/tau").text() for g in groups],
                *[num(paper.TABLE1_TAU[drafter_of(g)].get(d)) for g in known],
            ]
        )
    for domain in eval_domains(ctx.frame):
        sets = [d for d in datasets if paper.domain_of(d) == domain]
        rows.append(
            [
                f"**{domain}** ({len(sets)} sets)",
                *[est(ctx, g, domain_tau(domain)).text() for g in groups],
                *[num(paper.mean(paper.TABLE1_TAU[drafter_of(g)].get(d) for d in sets)) for g in known],
            ]
        )
    rows.append(
        [
            f"**all** ({len(datasets)} sets)",
            *[est(ctx, g, "eval/all/tau").text() for g in groups],
            *[num(paper.mean(paper.TABLE1_TAU[drafter_of(g)].get(d) for d in datasets)) for g in known],
        ]
    )
    return markdown_table(header, rows)


def gains_table(ctx: ReportContext, by_drafter: dict[str, Group], datasets: list[str]) -> str:
    """Relative gains between drafters per domain and macro, ours and the paper's over the same sets."""
    pairs = drafter_pairs(by_drafter)
    means = {k: per_set_means(ctx, g, datasets) for k, g in by_drafter.items()}
    header = ["group"]
    for a, b in pairs:
        names = f"{drafter_label(a)} vs {drafter_label(b)}"
        header += [f"{names} ours", f"{names} paper"]
    groups = [(d, paper.DOMAINS[d]) for d in paper.DOMAINS] + [("macro", paper.DATASETS)]
    rows = []
    for name, sets in groups:
        sets = [d for d in sets if d in datasets]
        if not sets:
            continue
        row = [f"{name} ({len(sets)} sets)"]
        for a, b in pairs:
            row += [
                pct(paper.macro_gain(means[a], means[b], datasets=sets)),
                pct(paper.macro_gain(paper.TABLE1_TAU.get(a, {}), paper.TABLE1_TAU.get(b, {}), datasets=sets)),
            ]
        rows.append(row)
    return markdown_table(header, rows)


def ordering_lines(ctx: ReportContext, by_drafter: dict[str, Group], datasets: list[str]) -> list[str]:
    """On how many prompt sets the paper's ordering DSpark > DFlash > EAGLE-3 holds for us."""
    order = [d for d in paper.DRAFTER_ORDER if d in by_drafter]
    if len(order) < 2:
        return []
    means = {k: per_set_means(ctx, by_drafter[k], datasets) for k in order}
    holds = [
        d
        for d in datasets
        if all(d in means[k] for k in order) and all(means[a][d] > means[b][d] for a, b in zip(order, order[1:]))
    ]
    chain = " > ".join(drafter_label(k) for k in order)
    return [
        f"Ordering {chain} holds on {len(holds)} of {len(datasets)} prompt sets"
        + (f" ({', '.join(holds)})." if holds else ".")
    ]


def cond_section(ctx: ReportContext, groups: list[Group]) -> Section | None:
    """cond@k per position and domain (plot) and cond@1 beside the paper's Fig. 2 values."""
    domains = [d for d in eval_domains(ctx.frame) if ctx.has(f"eval/domain/{d}/cond/pos1")]
    if not domains:
        return None
    positions = sorted({int(c.rsplit("pos", 1)[1]) for c in ctx.frame.columns if "/cond/pos" in c})
    panels = {
        d: {variant_label(g): [(k, est(ctx, g, f"eval/domain/{d}/cond/pos{k}")) for k in positions] for g in groups}
        for d in domains
    }
    path = plot_lines(
        panels,
        ctx.png("cond"),
        xlabel="draft position k",
        ylabel="cond@k",
        xticks=positions,
        title="Conditional acceptance per position (paper Fig. 2)",
    )
    header = ["configuration", *[f"cond@1 {d} ours" for d in domains], *[f"cond@1 {d} paper" for d in domains]]
    rows = [
        [
            variant_label(g),
            *[est(ctx, g, f"eval/domain/{d}/cond/pos1").text(3) for d in domains],
            *[num(paper.COND_SLOT1.get(drafter_of(g), {}).get(d)) for d in domains],
        ]
        for g in groups
    ]
    return Section("Conditional acceptance per position", f"![cond@k]({path.name})\n\n" + markdown_table(header, rows))


@REPORT_BUILDERS.register("main")
def build_main(ctx: ReportContext) -> list[Section]:
    """Table 1: τ per set, relative gains, per-drafter summary, cond@k."""
    groups = ctx.group_dicts()
    by_drafter = {drafter_of(g): g for g in groups}
    datasets = eval_datasets(ctx.frame)
    sections = [Section("How to read", tau_note(ctx))]
    if datasets:
        sections.append(Section("τ per prompt set (Table 1)", table1(ctx, groups, datasets)))
        if len(by_drafter) >= 2:
            sections.append(
                Section(
                    "Relative gains (ratio of unweighted means over the same sets)",
                    gains_table(ctx, by_drafter, datasets),
                )
            )
    sections.append(Section("Per drafter", config_table(ctx, groups, label=variant_label)))
    cond = cond_section(ctx, groups)
    if cond:
        sections.append(cond)
    macro_claims(ctx, by_drafter, datasets)
    sections.append(claim_section("main", ordering_lines(ctx, by_drafter, datasets) + main_judgements(ctx, by_drafter)))
    return sections


def main_statement(a: str, b: str) -> str:
    claim = "Table 1" if a in paper.DRAFTER_ORDER and b in paper.DRAFTER_ORDER else "not a paper claim"
    return f"{drafter_label(a)} reaches a longer accepted length τ than {drafter_label(b)} ({claim})."


def macro_claims(ctx: ReportContext, by_drafter: dict[str, Group], datasets: list[str]) -> None:
    """Each pair's macro gain over the prompt sets both ran (the gains table's macro row; the paper's headline
    +30.9% / +16.3%): a ratio of unweighted means over sets, so a point estimate without an interval."""
    sets = [d for d in paper.DATASETS if d in datasets]
    for a, b in drafter_pairs(by_drafter):
        gain = paper.macro_gain(
            per_set_means(ctx, by_drafter[a], sets), per_set_means(ctx, by_drafter[b], sets), datasets=sets
        )
        if math.isfinite(gain):
            point_claim(
                ctx,
                id=f"main.{a}_vs_{b}.macro",
                statement=main_statement(a, b),
                paper_text=paper.table1_gain_text(a, b),
                gain=gain,
                ours=pct(gain),
                scope=f"macro τ gain: ratio of unweighted means over the {len(sets)} Table 1 sets both ran",
                arms=(by_drafter[a], by_drafter[b]),
                column="eval/all/tau",
            )


def scopes(ctx: ReportContext) -> list[str]:
    """The domains the runs evaluated, then `all`."""
    return [*eval_domains(ctx.frame), "all"]


def scope_text(scope: str) -> str:
    return "all prompts" if scope == "all" else f"the {scope} prompts"


def tau_difference(ctx: ReportContext, a: Group, b: Group, scope: str) -> Difference:
    return Difference(pooled_tau(ctx.rows_of(a), scope), pooled_tau(ctx.rows_of(b), scope))


def main_judgements(ctx: ReportContext, by_drafter: dict[str, Group]) -> list[str]:
    """Each pair of drafters per domain and overall, with CIs (the paper: DSpark > DFlash > EAGLE-3 in every
    domain); a claim per (pair, scope)."""
    lines: list[str] = []
    if not ctx.has("eval/all/tau_prompt_mean"):
        return lines
    for a, b in drafter_pairs(by_drafter):
        arms = (by_drafter[a], by_drafter[b])
        diffs = {s: tau_difference(ctx, *arms, s) for s in scopes(ctx)}
        label = f"{drafter_label(a)} vs {drafter_label(b)}"
        lines += ["", f"{label}, per-prompt τ, gain with 95% CI (prompts and seeds, claims module):"]
        lines += [
            "- "
            + judge(
                ctx,
                scope,
                d,
                id=f"main.{a}_vs_{b}.{scope}",
                statement=main_statement(a, b),
                paper_text=paper.table1_gain_text(a, b, scope),
                arms=arms,
                scope=f"per-prompt τ gain, {scope_text(scope)}",
            )
            for scope, d in diffs.items()
        ]
        domains = [s for s in diffs if s != "all"]
        if domains:
            held = [s for s in domains if diffs[s].verdict == "holds"]
            reversed_ = [s for s in domains if diffs[s].verdict == "reversed"]
            lines.append(
                f'- → "{drafter_label(a)} > {drafter_label(b)} in every domain": '
                + (
                    "**holds**"
                    if len(held) == len(domains)
                    else "**reversed** in " + ", ".join(reversed_)
                    if reversed_
                    else f"**not resolved** (significant in {len(held)} of {len(domains)} domains)"
                )
            )
    return lines


# ---- depth (Fig. 3) ----


def sort_key(groups: list[Group], *axes: str) -> Callable[[Group], tuple]:
    """Drafters in `drafter_order`, heads in registration order, then the `axes` values."""
    drafters = drafter_order(drafter_of(g) for g in groups)
    heads = SEQUENTIAL_HEADS.ordered()
    rank = lambda order, value: order.index(value) if value in order else len(order)  # noqa: E731
    return lambda g: (
        (rank(drafters, drafter_of(g)), rank(heads, str(g.get("axis.model.head", ""))))
        + tuple(g.get(a) if g.get(a) is not None else -1 for a in axes)
    )


def challengers(groups: list[Group]) -> list[str]:
    """The drafters compared with the figure's baseline (DFlash), in `drafter_order`."""
    return [d for d in drafter_order(drafter_of(g) for g in groups) if d != paper.BASELINE_DRAFTER]


@REPORT_BUILDERS.register("depth")
def build_depth(ctx: ReportContext) -> list[Section]:
    """Fig. 3: τ against depth with the DFlash-5 level, and the 2-layer claim checked."""
    groups = sorted(ctx.group_dicts(), key=sort_key(ctx.group_dicts(), "axis.model.depth"))
    label = lambda g: f"{variant_label(g)} depth {g.get('axis.model.depth')}"  # noqa: E731
    reference = next((g for g in groups if drafter_of(g) == paper.BASELINE_DRAFTER), None)
    column, ylabel = headline_metric(ctx)
    panels, hlines = {}, {}
    for title, col in domain_panels(ctx):
        panels[title] = {
            drafter_label(d): [(g["axis.model.depth"], est(ctx, g, col)) for g in groups if drafter_of(g) == d]
            for d in challengers(groups)
        }
        if reference is not None:
            hlines[title] = {label(reference): est(ctx, reference, col).mean}
    depths = sorted({g["axis.model.depth"] for g in groups})
    path = plot_lines(
        panels,
        ctx.png("depth"),
        xlabel="draft layers (depth)",
        ylabel=ylabel,
        hlines=hlines,
        xticks=depths,
        title="τ against drafter depth (paper Fig. 3)",
    )
    lines = []
    for drafter in challengers(groups):
        two = next((g for g in groups if drafter_of(g) == drafter and g.get("axis.model.depth") == 2), None)
        if two is not None and reference is not None:
            lines += two_layer_claim(ctx, two, reference, label=label)
        lines += depth_trend(ctx, [g for g in groups if drafter_of(g) == drafter])
    return [
        Section("How to read", tau_note(ctx)),
        Section(
            "τ by depth", config_table(ctx, groups, label=label, reference=reference) + f"\n\n![depth]({path.name})"
        ),
        claim_section("depth", lines),
    ]


def two_layer_claim(ctx: ReportContext, two: Group, reference: Group, *, label: Callable[[Group], str]) -> list[str]:
    """A 2-layer drafter against the baseline per domain: point gains, then per-prompt τ with 95% CIs."""
    name, base = drafter_of(two), f"{drafter_of(reference)}{reference.get('axis.model.depth')}"
    statement = f"A 2-layer {drafter_label(name)} beats the {label(reference)} baseline in every domain " + (
        "(Fig. 3)." if name in paper.DRAFTER_ORDER else "(not a paper claim)."
    )
    paper_text = "2-layer DSpark above 5-layer DFlash in every domain (Fig. 3)" if name == "dspark" else "–"
    arms, rollouts = (two, reference), ctx.has("eval/all/tau_prompt_mean")
    gains = {title: ratio_gain(est(ctx, two, col), est(ctx, reference, col)) for title, col in domain_panels(ctx)}
    verdict = "holds" if all(g > 0 for g in gains.values()) else "does NOT hold"
    lines = [
        f"Ours: {drafter_label(name)} depth 2 vs {label(reference)}: "
        + ", ".join(f"{d} {pct(g)}" for d, g in gains.items())
        + f" → the claim {verdict} here."
    ]
    if not rollouts:  # the point gains are all there is: recorded as claims without an interval
        for (title, col), gain in zip(domain_panels(ctx), gains.values()):
            point_claim(
                ctx,
                id=f"depth.{name}2_vs_{base}.{title.split(' ')[0]}",
                statement=statement,
                paper_text=paper_text,
                gain=gain,
                ours=pct(gain),
                scope=f"{col} gain",
                arms=arms,
                column=col,
            )
        return lines
    diffs = {s: tau_difference(ctx, two, reference, s) for s in scopes(ctx)}
    lines += [
        "",
        "With 95% CIs (per-prompt τ; prompts and seeds):",
        *[
            "- "
            + judge(
                ctx,
                s,
                d,
                id=f"depth.{name}2_vs_{base}.{s}",
                statement=statement,
                paper_text=paper_text,
                scope=f"per-prompt τ gain, {scope_text(s)}",
                arms=arms,
            )
            for s, d in diffs.items()
        ],
    ]
    worse = [s for s, d in diffs.items() if d.verdict == "reversed"]
    lines.append(
        f'- → "a 2-layer {drafter_label(name)} ≥ {label(reference)}": '
        + (
            f"**reversed** in {', '.join(worse)}"
            if worse
            else "**holds** (no domain significantly below; "
            + ", ".join(f"{s} {d.verdict}" for s, d in diffs.items() if s != "all")
            + ")"
        )
    )
    return lines


def depth_trend(ctx: ReportContext, series: list[Group]) -> list[str]:
    """Each deeper drafter against the shallowest of its kind (the groups come sorted by depth), with 95% CIs:
    per-prompt rollout τ over all sets, and held-out τ_prob between seeds (no within-run se: one seed gives no
    interval). The paper's Fig. 3 has τ rise with depth; the verdict line reads the deepest against the
    shallowest."""
    if len(series) < 2:
        return []
    base, name = series[0], drafter_of(series[0])
    shallow = base["axis.model.depth"]
    rollouts = ctx.has("eval/all/tau_prompt_mean")
    statement = f"{drafter_label(name)}'s τ rises with its depth (Fig. 3)."
    paper_text = "τ rises monotonically with depth 1→5, most from 1 to 2 layers (Fig. 3)" if name == "dspark" else "–"
    lines = ["", f"Deeper {drafter_label(name)} vs depth {shallow} (the paper: τ rises with depth), 95% CIs:"]
    for group in series[1:]:
        parts, verdicts = [], {}  # the loop ends on the deepest: its verdicts make the summary line
        prefix, arms = f"depth.{name}{group['axis.model.depth']}_vs_{name}{shallow}", (group, base)
        if rollouts:
            rollout = tau_difference(ctx, group, base, "all")
            parts.append(
                judge(
                    ctx,
                    "τ all (per prompt)",
                    rollout,
                    id=f"{prefix}.all",
                    statement=statement,
                    paper_text=paper_text,
                    scope="per-prompt τ gain, all prompts",
                    arms=arms,
                )
            )
            verdicts["rollout τ"] = rollout.verdict
        proxy = Difference(pooled_plain(ctx.rows_of(group), TAU_PROB), pooled_plain(ctx.rows_of(base), TAU_PROB))
        if proxy.ok or (proxy.a.ok and proxy.b.ok):
            claim = judge(
                ctx,
                "held-out τ_prob (seeds only)",
                proxy,
                id=f"{prefix}.tau_prob",
                statement=statement,
                paper_text=paper_text,
                relative=False,
                arms=arms,
                scope="held-out teacher-forced τ_prob difference, between seeds only",
            )
            if proxy.ok:
                parts.append(claim)
                verdicts["held-out τ_prob"] = proxy.verdict
            else:
                parts.append(f"held-out τ_prob {proxy.a.mean:.3f} vs {proxy.b.mean:.3f} (a single seed: no interval)")
                verdicts["held-out τ_prob"] = "not measured"
        lines.append(f"- depth {group['axis.model.depth']}: " + ("; ".join(parts) or "not measured"))
    deepest = series[-1]["axis.model.depth"]
    domains = [s for s in scopes(ctx) if s != "all"] if rollouts else []
    if domains:  # an "all" that does not move can hide domains that do, in opposite directions
        lines.append(f"- depth {deepest} vs {shallow} by domain (per-prompt τ):")
        lines += [
            "  - "
            + judge(
                ctx,
                s,
                tau_difference(ctx, series[-1], base, s),
                statement=statement,
                id=f"depth.{name}{deepest}_vs_{name}{shallow}.{s}",
                paper_text=paper_text,
                scope=f"per-prompt τ gain, {scope_text(s)}",
                arms=(series[-1], base),
            )
            for s in domains
        ]
    lines.append(
        f'- → "τ rises with depth" (depth {deepest} vs {shallow}): '
        + "; ".join(f"{metric} **{verdict}**" for metric, verdict in verdicts.items())
    )
    return lines


# ---- block size (Fig. 4 left) ----


def objective_label(group: Group) -> str:
    kind = str(group.get("axis.loss.kind") or group.get("loss.kind") or "paper")
    return f"{variant_label(group)}, {'D-PARD' if kind == 'dpard' else 'paper loss'}"


@REPORT_BUILDERS.register("objective")
def build_objective(ctx: ReportContext) -> list[Section]:
    """loss.kind=paper vs dpard at fixed depth and γ: τ per objective and D-PARD's gain over the paper's loss."""
    groups = sorted(ctx.group_dicts(), key=sort_key(ctx.group_dicts()))
    by_kind = {str(g.get("axis.loss.kind") or g.get("loss.kind") or "paper"): g for g in groups}
    reference = by_kind.get("paper")
    column, ylabel = headline_metric(ctx)
    panels = {title: {objective_label(g): est(ctx, g, col) for g in groups} for title, col in domain_panels(ctx)}
    path = plot_bars(panels, ctx.png("objective"), ylabel=ylabel, title="Training objective at fixed depth and γ")
    col = "eval/all/tau" if eval_domains(ctx.frame) else TAU_PROB
    claims = (
        [
            f"Ours ({col}): D-PARD vs the paper's loss "
            f"{pct(ratio_gain(est(ctx, by_kind['dpard'], col), est(ctx, reference, col)))}."
        ]
        if reference is not None and "dpard" in by_kind
        else []
    )
    return [
        Section("How to read", tau_note(ctx)),
        Section(
            "τ by training objective",
            config_table(ctx, groups, label=objective_label, reference=reference) + f"\n\n![objectives]({path.name})",
        ),
        Section("Findings", "\n".join(f"- {line}" for line in claims) or "Needs both objectives' runs."),
    ]


# ---- any other grid sweep ----


@REPORT_BUILDERS.register("generic")
def build_generic(ctx: ReportContext) -> list[Section]:
    groups = ctx.group_dicts()
    return [
        Section("How to read", tau_note(ctx)),
        Section("Results per configuration", config_table(ctx, groups, label=lambda g: axis_text(g))),
    ]
