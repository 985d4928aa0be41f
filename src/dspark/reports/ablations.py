"""Reports of the drafter ablations: `main` (Table 1), `depth` (Fig. 3), `objective`, and (in `reports.sequential`)
`block_size` and `head`; also
the generic table any other grid sweep gets. Tables show τ pooled over rounds, means over seeds ± 95% Student-t
half-width (n runs), and their gains are ratios of those means minus 1 (point estimates; the paper's side computed
over the same prompt sets, METHOD §9); every table says so (`stats.POOLED_NOTE`). Verdicts read per-prompt τ
only, with the intervals of `dspark.reports.claims` (Student-t on Satterthwaite df, Holm within a family of
domains, one seed: seed variance not measured), and the figures draw those same intervals (`plotted`).

Drafters and heads come from their registries (`DRAFTER_BUILDERS`, `SEQUENTIAL_HEADS`), so a newly registered one
enters every comparison: drafters in the paper's Table 1 order after any the paper does not rank, heads in
registration order against no head and against the paper's default head. Every judged line is also recorded in
`ctx.claims` (`dspark.reports.claims.Claim`, ids '<report>.<comparison>.<scope>').
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from dspark.drafters.factory import DRAFTER_BUILDERS
from dspark.drafters.heads import SEQUENTIAL_HEADS
from dspark.markdown import markdown_table, num, pct
from dspark.reports import paper
from dspark.reports.claims import (
    MULTIPLICITY,
    Claim,
    Difference,
    difference_claim,
    every_scope,
    holm,
    judged,
    pooled_cond,
    pooled_plain,
    pooled_tau,
    tau_scope,
)
from dspark.reports.context import (
    REPORT_BUILDERS,
    TAU,
    TAU_PROB,
    ReportContext,
    axis_text,
    domain_tau,
    drafter_label,
    eval_datasets,
    eval_domains,
    variant_label,
)
from dspark.reports.plots import Point, plot_bars, plot_lines
from dspark.reports.stats import POOLED_NOTE, Estimate, estimate, ratio_gain
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


def domain_sets(ctx: ReportContext) -> dict[str, list[str]]:
    """{domain: the prompt sets of the runs in it} (Table 1's domains of our set names)."""
    datasets = eval_datasets(ctx.frame)
    return {d: [s for s in datasets if paper.domain_of(s) == d] for d in eval_domains(ctx.frame)}


def how_to_read(ctx: ReportContext) -> str:
    """What τ the tables and the figures show, how many prompt sets make each domain here, and which τ the verdicts
    read."""
    if not ctx.has(TAU):
        return (
            "No run of this sweep evaluated (stage=train?): tables and figures show the teacher-forced proxy τ_prob "
            "= 1 + Σ_k Π_{i≤k} c*_i on the validation split (METHOD §8), not rollout τ; its intervals are Student-t "
            "over seeds."
        )
    sets = domain_sets(ctx)
    if not any(sets.values()):
        made = "a domain's τ is the unweighted mean of its prompt sets' (the runs logged no per-set τ)"
    elif all(len(v) == 1 for v in sets.values()):
        made = "each domain is one prompt set here (" + ", ".join(f"{d}: {v[0]}" for d, v in sets.items()) + ")"
    else:
        made = "a domain's τ is the unweighted mean of its sets' — " + "; ".join(
            f"{d}: {len(v)} set{'s' * (len(v) != 1)} ({', '.join(v)})" if v else f"{d}: sets not logged"
            for d, v in sets.items()
        )
    figures = (
        "Figures draw per-prompt τ with the intervals the verdicts judge."
        if ctx.has("eval/all/tau_prompt_mean")
        else "Figures draw the tables' pooled τ (no per-prompt τ was logged)."
    )
    intro = "τ = tokens committed per round from lossless speculative decoding (METHOD §1)"
    return f"{intro}; {made}. {POOLED_NOTE} {figures}"


def plotted(ctx: ReportContext, group: Group, column: str) -> Point:
    """What a figure draws for a τ column: per-prompt τ of its scope with the interval the claims judge
    (`claims.pooled_tau`) when the runs logged it, else the column's mean over runs ± Student-t (the table's)."""
    scope = (
        "all"
        if column in (TAU, "eval/all/tau")
        else column.split("/")[2]
        if column.startswith("eval/domain/")
        else None
    )
    if scope is not None and ctx.has(f"{tau_scope(scope)}/tau_prompt_mean"):
        return pooled_tau(ctx.rows_of(group), scope)
    return est(ctx, group, column)


def plotted_label(ctx: ReportContext) -> str:
    """The y label of a figure of `plotted` points."""
    if ctx.has("eval/all/tau_prompt_mean"):
        return "τ per prompt (95% CI: prompts and seeds)"
    return "τ pooled (95% t over runs)" if ctx.has(TAU) else "τ_prob (val, teacher-forced; 95% t over runs)"


def config_table(
    ctx: ReportContext, groups: list[Group], *, label: Callable[[Group], str], reference: Group | None = None
) -> str:
    """Per configuration: τ per domain and overall, the teacher-forced proxy, and the gain over `reference` (pooled
    τ: a caption says so)."""
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
    caption = (
        "Pooled τ (ratio of pooled means per set), mean over seeds ± 95% t over runs (n); gains: ratio of those "
        "means, point estimates."
        if domains
        else "Means over seeds ± 95% t over runs (n); gains: ratio of those means, point estimates."
    )
    return caption + "\n\n" + markdown_table(header, rows)


def domain_panels(ctx: ReportContext) -> list[tuple[str, str]]:
    """(panel title, column) per domain when runs evaluated, else one panel of the proxy."""
    domains = eval_domains(ctx.frame)
    if domains:
        return [(d, domain_tau(d)) for d in domains]
    return [("all (validation proxy)", TAU_PROB)]


def claim_section(name: str, lines: list[str]) -> Section:
    """The paper's claim, our judged lines, and the statistics / multiplicity note they follow."""
    return Section("Paper vs ours", "\n".join([f"Paper: {paper.CLAIMS[name]}", "", MULTIPLICITY, "", *lines]))


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
    caption = (
        "Pooled τ per prompt set (Σ committed / Σ rounds), mean over seeds ± 95% t over runs (n); a domain row is "
        "the unweighted mean of its sets (the count in brackets), as the paper's columns beside it."
    )
    return caption + "\n\n" + markdown_table(header, rows)


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
    caption = (
        "Pooled τ: ratio of the unweighted means of the sets' pooled τ (seeds averaged), minus 1 — the paper's macro "
        "definition; point estimates, no interval (the verdicts below read per-prompt τ)."
    )
    return caption + "\n\n" + markdown_table(header, rows)


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


def cond_point(ctx: ReportContext, group: Group, domain: str, k: int) -> Point:
    """cond@k of a domain with the interval the claims judge (`claims.pooled_cond`: binomial over the rounds that
    reached slot k, and seeds), else the mean over runs ± Student-t."""
    pooled = pooled_cond(ctx.rows_of(group), k, domain)
    return pooled if pooled.ok else est(ctx, group, f"eval/domain/{domain}/cond/pos{k}")


def cond_section(ctx: ReportContext, groups: list[Group]) -> Section | None:
    """cond@k per position and domain (plot, the paper's Fig. 2 slot-1 values marked) and cond@1 beside them."""
    domains = [d for d in eval_domains(ctx.frame) if ctx.has(f"eval/domain/{d}/cond/pos1")]
    if not domains:
        return None
    positions = sorted({int(c.rsplit("pos", 1)[1]) for c in ctx.frame.columns if "/cond/pos" in c})
    panels = {
        d: {variant_label(g): [(k, cond_point(ctx, g, d, k)) for k in positions] for g in groups} for d in domains
    }
    references = {
        d: {
            f"paper {drafter_label(drafter_of(g))} (Qwen3-4B)": [(1, paper.COND_SLOT1[drafter_of(g)][d])]
            for g in groups
            if d in paper.COND_SLOT1.get(drafter_of(g), {})
        }
        for d in domains
    }
    path = plot_lines(
        panels,
        ctx.png("cond"),
        xlabel="draft position k",
        ylabel="cond@k (95% CI: rounds and seeds)",
        xticks=positions,
        title="Conditional acceptance per position (paper Fig. 2)",
        clip=(0.0, 1.0),
        references=references,
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
    caption = "cond@1 per domain: mean over seeds ± 95% t over runs (n); the figure's intervals add the rounds' spread."
    return Section(
        "Conditional acceptance per position", f"![cond@k]({path.name})\n\n{caption}\n\n" + markdown_table(header, rows)
    )


@REPORT_BUILDERS.register("main")
def build_main(ctx: ReportContext) -> list[Section]:
    """Table 1: τ per set, relative gains, per-drafter summary, cond@k."""
    groups = ctx.group_dicts()
    by_drafter = {drafter_of(g): g for g in groups}
    datasets = eval_datasets(ctx.frame)
    sections = [Section("How to read", how_to_read(ctx))]
    if datasets:
        sections.append(Section("τ per prompt set (Table 1)", table1(ctx, groups, datasets)))
        if len(by_drafter) >= 2:
            sections.append(
                Section(
                    "Relative gains (pooled τ: ratio of unweighted means over the same sets)",
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


def domain_family(ctx: ReportContext, a: Group, b: Group) -> dict[str, Difference]:
    """a − b in per-prompt τ per scope: the domains Holm-adjusted as one family (one claim over its domains), `all`
    a single 95% test."""
    diffs = {s: tau_difference(ctx, a, b, s) for s in scopes(ctx)}
    domains = holm({s: d for s, d in diffs.items() if s != "all"})
    return {s: domains.get(s, d) for s, d in diffs.items()}


def main_judgements(ctx: ReportContext, by_drafter: dict[str, Group]) -> list[str]:
    """Each pair of drafters per domain and overall, with CIs (the paper: DSpark > DFlash > EAGLE-3 in every
    domain; the domains one Holm family); a claim per (pair, scope)."""
    lines: list[str] = []
    if not ctx.has("eval/all/tau_prompt_mean"):
        return lines
    for a, b in drafter_pairs(by_drafter):
        arms = (by_drafter[a], by_drafter[b])
        diffs = domain_family(ctx, *arms)
        label = f"{drafter_label(a)} vs {drafter_label(b)}"
        lines += ["", f"{label}, per-prompt τ gain (prompts and seeds; domains Holm-adjusted, `all` 95%):"]
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
        domains = {s: d.verdict for s, d in diffs.items() if s != "all"}
        if domains:
            lines.append(f'- → "{drafter_label(a)} > {drafter_label(b)} in every domain": ' + every_scope(domains))
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
    panels, hlines = {}, {}
    for title, col in domain_panels(ctx):
        panels[title] = {
            drafter_label(d): [(g["axis.model.depth"], plotted(ctx, g, col)) for g in groups if drafter_of(g) == d]
            for d in challengers(groups)
        }
        if reference is not None:
            hlines[title] = {label(reference): plotted(ctx, reference, col).mean}
    depths = sorted({g["axis.model.depth"] for g in groups})
    path = plot_lines(
        panels,
        ctx.png("depth"),
        xlabel="draft layers (depth)",
        ylabel=plotted_label(ctx),
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
        Section("How to read", how_to_read(ctx)),
        Section(
            "τ by depth", config_table(ctx, groups, label=label, reference=reference) + f"\n\n![depth]({path.name})"
        ),
        claim_section("depth", lines),
    ]


def two_layer_claim(ctx: ReportContext, two: Group, reference: Group, *, label: Callable[[Group], str]) -> list[str]:
    """A 2-layer drafter against the baseline per domain: point gains, then per-prompt τ with CIs (the domains
    one Holm family) and the "≥ in every domain" summary (`claims.every_scope`)."""
    name, base = drafter_of(two), f"{drafter_of(reference)}{reference.get('axis.model.depth')}"
    statement = f"A 2-layer {drafter_label(name)} beats the {label(reference)} baseline in every domain " + (
        "(Fig. 3)." if name in paper.DRAFTER_ORDER else "(not a paper claim)."
    )
    paper_text = "2-layer DSpark above 5-layer DFlash in every domain (Fig. 3)" if name == "dspark" else "–"
    arms, rollouts = (two, reference), ctx.has("eval/all/tau_prompt_mean")
    gains = {title: ratio_gain(est(ctx, two, col), est(ctx, reference, col)) for title, col in domain_panels(ctx)}
    lines = [
        f"Ours: {drafter_label(name)} depth 2 vs {label(reference)}, pooled τ point gains (no interval, not a "
        "verdict): " + ", ".join(f"{d} {pct(g)}" for d, g in gains.items()) + "."
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
    diffs = domain_family(ctx, two, reference)
    lines += [
        "",
        "With CIs (per-prompt τ; prompts and seeds; domains Holm-adjusted, `all` 95%):",
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
    lines.append(
        f'- → "a 2-layer {drafter_label(name)} ≥ {label(reference)} in every domain": '
        + every_scope({s: d.verdict for s, d in diffs.items() if s != "all"})
    )
    return lines


def depth_trend(ctx: ReportContext, series: list[Group]) -> list[str]:
    """Each deeper drafter against the shallowest of its kind (the groups come sorted by depth), with CIs:
    per-prompt rollout τ over all sets, and held-out τ_prob between seeds (no within-run se: one seed gives no
    interval); the depths of each metric are one Holm family, as are the domains of the deepest. The paper's Fig. 3
    has τ rise with depth; the verdict line reads the deepest against the shallowest."""
    if len(series) < 2:
        return []
    base, name = series[0], drafter_of(series[0])
    shallow = base["axis.model.depth"]
    rollouts = ctx.has("eval/all/tau_prompt_mean")
    statement = f"{drafter_label(name)}'s τ rises with its depth (Fig. 3)."
    paper_text = "τ rises monotonically with depth 1→5, most from 1 to 2 layers (Fig. 3)" if name == "dspark" else "–"
    lines = [
        "",
        f"Deeper {drafter_label(name)} vs depth {shallow} (the paper: τ rises with depth; depths Holm-adjusted):",
    ]
    deeper = {g["axis.model.depth"]: g for g in series[1:]}
    rollout_family = holm({d: tau_difference(ctx, g, base, "all") for d, g in deeper.items()}) if rollouts else {}
    proxy_family = holm(
        {
            d: Difference(pooled_plain(ctx.rows_of(g), TAU_PROB), pooled_plain(ctx.rows_of(base), TAU_PROB))
            for d, g in deeper.items()
        }
    )
    for depth, group in deeper.items():
        parts, verdicts = [], {}  # the loop ends on the deepest: its verdicts make the summary line
        prefix, arms = f"depth.{name}{depth}_vs_{name}{shallow}", (group, base)
        if rollouts:
            rollout = rollout_family[depth]
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
        proxy = proxy_family[depth]
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
        lines.append(f"- depth {depth}: " + ("; ".join(parts) or "not measured"))
    deepest = series[-1]["axis.model.depth"]
    domains = [s for s in scopes(ctx) if s != "all"] if rollouts else []
    if domains:  # an "all" that does not move can hide domains that do, in opposite directions
        by_domain = holm({s: tau_difference(ctx, series[-1], base, s) for s in domains})
        lines.append(f"- depth {deepest} vs {shallow} by domain (per-prompt τ; domains Holm-adjusted):")
        lines += [
            "  - "
            + judge(
                ctx,
                s,
                d,
                statement=statement,
                id=f"depth.{name}{deepest}_vs_{name}{shallow}.{s}",
                paper_text=paper_text,
                scope=f"per-prompt τ gain, {scope_text(s)}",
                arms=(series[-1], base),
            )
            for s, d in by_domain.items()
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
    panels = {title: {objective_label(g): plotted(ctx, g, col) for g in groups} for title, col in domain_panels(ctx)}
    path = plot_bars(
        panels, ctx.png("objective"), ylabel=plotted_label(ctx), title="Training objective at fixed depth and γ"
    )
    col = "eval/all/tau" if eval_domains(ctx.frame) else TAU_PROB
    claims = []
    if reference is not None and "dpard" in by_kind:
        point = pct(ratio_gain(est(ctx, by_kind["dpard"], col), est(ctx, reference, col)))
        claims.append(f"Ours ({col}, point estimate of the table's means): D-PARD vs the paper's loss {point}.")
        if ctx.has("eval/all/tau_prompt_mean"):
            claims.append(
                judge(
                    ctx,
                    "D-PARD vs the paper's loss, per-prompt τ (all)",
                    tau_difference(ctx, by_kind["dpard"], reference, "all"),
                    id="objective.dpard_vs_paper.all",
                    statement="D-PARD's objective trains a drafter with a longer τ than the paper's loss (not a paper "
                    "claim).",
                    paper_text="–",
                    scope="per-prompt τ gain, all prompts",
                    arms=(by_kind["dpard"], reference),
                )
            )
    return [
        Section("How to read", how_to_read(ctx)),
        Section(
            "τ by training objective",
            config_table(ctx, groups, label=objective_label, reference=reference) + f"\n\n![objectives]({path.name})",
        ),
        Section(
            "Findings",
            "\n".join([MULTIPLICITY, "", *(f"- {line}" for line in claims)])
            if claims
            else "Needs both objectives' runs.",
        ),
    ]


# ---- any other grid sweep ----


@REPORT_BUILDERS.register("generic")
def build_generic(ctx: ReportContext) -> list[Section]:
    groups = ctx.group_dicts()
    return [
        Section("How to read", how_to_read(ctx)),
        Section("Results per configuration", config_table(ctx, groups, label=lambda g: axis_text(g))),
    ]
