"""Reports of the drafter ablations: `main` (Table 1), `depth` (Fig. 3), `block_size` (Fig. 4 left), `head`, and
the generic table any other grid sweep gets. Numbers are means over seeds ± 95% Student-t half-width (n runs);
gains are ratios of means minus 1, the paper's side computed over the same prompt sets (METHOD §9).
"""
from __future__ import annotations

import math
from typing import Any, Callable

from dspark.reports import paper
from dspark.reports.claims import (
    MIN_ROUNDS,
    Difference,
    gain_change,
    judged,
    pooled_cond,
    pooled_plain,
    pooled_tau,
)
from dspark.reports.context import (
    REPORT_BUILDERS,
    TAU_PROB,
    ReportContext,
    axis_text,
    domain_tau,
    eval_datasets,
    eval_domains,
    head_of,
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


def config_table(ctx: ReportContext, groups: list[Group], *, label: Callable[[Group], str],
                 reference: Group | None = None) -> str:
    """Per configuration: τ per domain and overall, the teacher-forced proxy, and the gain over `reference`."""
    domains = eval_domains(ctx.frame)
    columns = [(f"τ {d}", domain_tau(d), 2) for d in domains] + ([("τ all", "eval/all/tau", 2)] if domains else [])
    columns += [(name, col, digits) for name, col, digits in (("τ_prob (val)", TAU_PROB, 3),
                                                               ("speed-up", "summary/speedup", 2)) if ctx.has(col)]
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
    header = ["prompt set", *[f"{variant_label(g)} ours" for g in groups],
              *[f"{variant_label(g)} paper" for g in known]]
    rows = []
    for d in datasets:
        rows.append([d, *[est(ctx, g, f"eval/{d}/tau").text() for g in groups],
                     *[num(paper.TABLE1_TAU[drafter_of(g)].get(d)) for g in known]])
    for domain in eval_domains(ctx.frame):
        sets = [d for d in datasets if paper.domain_of(d) == domain]
        rows.append([f"**{domain}** ({len(sets)} sets)", *[est(ctx, g, domain_tau(domain)).text() for g in groups],
                     *[num(paper.mean(paper.TABLE1_TAU[drafter_of(g)].get(d) for d in sets)) for g in known]])
    rows.append([f"**all** ({len(datasets)} sets)", *[est(ctx, g, "eval/all/tau").text() for g in groups],
                 *[num(paper.mean(paper.TABLE1_TAU[drafter_of(g)].get(d) for d in datasets)) for g in known]])
    return markdown_table(header, rows)


def gains_table(ctx: ReportContext, by_drafter: dict[str, Group], datasets: list[str]) -> str:
    """Relative gains between drafters per domain and macro, ours and the paper's over the same sets."""
    pairs = [(a, b) for a, b in (("dspark", "dflash"), ("dspark", "eagle3"), ("dflash", "eagle3"))
             if a in by_drafter and b in by_drafter]
    means = {k: per_set_means(ctx, g, datasets) for k, g in by_drafter.items()}
    header = ["group"]
    for a, b in pairs:
        names = f"{paper.DRAFTER_LABELS[a]} vs {paper.DRAFTER_LABELS[b]}"
        header += [f"{names} ours", f"{names} paper"]
    groups = [(d, paper.DOMAINS[d]) for d in paper.DOMAINS] + [("macro", paper.DATASETS)]
    rows = []
    for name, sets in groups:
        sets = [d for d in sets if d in datasets]
        if not sets:
            continue
        row = [f"{name} ({len(sets)} sets)"]
        for a, b in pairs:
            row += [pct(paper.macro_gain(means[a], means[b], datasets=sets)),
                    pct(paper.macro_gain(paper.TABLE1_TAU[a], paper.TABLE1_TAU[b], datasets=sets))]
        rows.append(row)
    return markdown_table(header, rows)


def ordering_lines(ctx: ReportContext, by_drafter: dict[str, Group], datasets: list[str]) -> list[str]:
    """On how many prompt sets the paper's ordering DSpark > DFlash > EAGLE-3 holds for us."""
    order = [d for d in ("dspark", "dflash", "eagle3") if d in by_drafter]
    if len(order) < 2:
        return []
    means = {k: per_set_means(ctx, by_drafter[k], datasets) for k in order}
    holds = [d for d in datasets if all(d in means[k] for k in order)
             and all(means[a][d] > means[b][d] for a, b in zip(order, order[1:]))]
    chain = " > ".join(paper.DRAFTER_LABELS[k] for k in order)
    return [f"Ordering {chain} holds on {len(holds)} of {len(datasets)} prompt sets"
            + (f" ({', '.join(holds)})." if holds else ".")]


def cond_section(ctx: ReportContext, groups: list[Group]) -> Section | None:
    """cond@k per position and domain (plot) and cond@1 beside the paper's Fig. 2 values."""
    domains = [d for d in eval_domains(ctx.frame) if ctx.has(f"eval/domain/{d}/cond/pos1")]
    if not domains:
        return None
    positions = sorted({int(c.rsplit("pos", 1)[1]) for c in ctx.frame.columns if "/cond/pos" in c})
    panels = {d: {variant_label(g): [(k, est(ctx, g, f"eval/domain/{d}/cond/pos{k}")) for k in positions]
                  for g in groups} for d in domains}
    path = plot_lines(panels, ctx.png("cond"), xlabel="draft position k", ylabel="cond@k", xticks=positions,
                      title="Conditional acceptance per position (paper Fig. 2)")
    header = ["configuration", *[f"cond@1 {d} ours" for d in domains], *[f"cond@1 {d} paper" for d in domains]]
    rows = [[variant_label(g), *[est(ctx, g, f"eval/domain/{d}/cond/pos1").text(3) for d in domains],
             *[num(paper.COND_SLOT1.get(drafter_of(g), {}).get(d)) for d in domains]] for g in groups]
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
            sections.append(Section("Relative gains (ratio of unweighted means over the same sets)",
                                    gains_table(ctx, by_drafter, datasets)))
    sections.append(Section("Per drafter", config_table(ctx, groups, label=variant_label)))
    cond = cond_section(ctx, groups)
    if cond:
        sections.append(cond)
    sections.append(claim_section("main", ordering_lines(ctx, by_drafter, datasets)
                                  + main_judgements(ctx, by_drafter)))
    return sections


def scopes(ctx: ReportContext) -> list[str]:
    """The domains the runs evaluated, then `all`."""
    return [*eval_domains(ctx.frame), "all"]


def tau_difference(ctx: ReportContext, a: Group, b: Group, scope: str) -> Difference:
    return Difference(pooled_tau(ctx.rows_of(a), scope), pooled_tau(ctx.rows_of(b), scope))


def main_judgements(ctx: ReportContext, by_drafter: dict[str, Group]) -> list[str]:
    """DSpark vs DFlash per domain (the paper: DSpark ahead in every domain) and DFlash vs EAGLE-3, with CIs."""
    lines: list[str] = []
    if not ctx.has("eval/all/tau_prompt_mean"):
        return lines
    for a, b in (("dspark", "dflash"), ("dflash", "eagle3"), ("dspark", "eagle3")):
        if a not in by_drafter or b not in by_drafter:
            continue
        diffs = {s: tau_difference(ctx, by_drafter[a], by_drafter[b], s) for s in scopes(ctx)}
        label = f"{paper.DRAFTER_LABELS[a]} vs {paper.DRAFTER_LABELS[b]}"
        lines += ["", f"{label}, per-prompt τ, gain with 95% CI (prompts and seeds, claims module):"]
        lines += [f"- {judged(scope, d)}" for scope, d in diffs.items()]
        domains = [s for s in diffs if s != "all"]
        if a == "dspark" and b == "dflash" and domains:
            held = [s for s in domains if diffs[s].verdict == "holds"]
            reversed_ = [s for s in domains if diffs[s].verdict == "reversed"]
            lines.append(f"- → \"DSpark > DFlash in every domain\": "
                         + ("**holds**" if len(held) == len(domains) else
                            "**reversed** in " + ", ".join(reversed_) if reversed_ else
                            f"**not resolved** (significant in {len(held)} of {len(domains)} domains)"))
    return lines


# ---- depth (Fig. 3) ----

def sort_key(*axes: str) -> Callable[[Group], tuple]:
    return lambda g: tuple((drafter_of(g) != "dspark", str(g.get("axis.model.head", "")))) + tuple(
        g.get(a) if g.get(a) is not None else -1 for a in axes)


@REPORT_BUILDERS.register("depth")
def build_depth(ctx: ReportContext) -> list[Section]:
    """Fig. 3: τ against depth with the DFlash-5 level, and the 2-layer claim checked."""
    groups = sorted(ctx.group_dicts(), key=sort_key("axis.model.depth"))
    label = lambda g: f"{variant_label(g)} depth {g.get('axis.model.depth')}"  # noqa: E731
    reference = next((g for g in groups if drafter_of(g) == "dflash"), None)
    column, ylabel = headline_metric(ctx)
    panels, hlines = {}, {}
    for title, col in domain_panels(ctx):
        series = [(g["axis.model.depth"], est(ctx, g, col)) for g in groups if drafter_of(g) == "dspark"]
        panels[title] = {"DSpark": series}
        if reference is not None:
            hlines[title] = {label(reference): est(ctx, reference, col).mean}
    depths = sorted({g["axis.model.depth"] for g in groups})
    path = plot_lines(panels, ctx.png("depth"), xlabel="draft layers (depth)", ylabel=ylabel, hlines=hlines,
                      xticks=depths, title="τ against drafter depth (paper Fig. 3)")
    lines = []
    two = next((g for g in groups if drafter_of(g) == "dspark" and g.get("axis.model.depth") == 2), None)
    if two is not None and reference is not None:
        gains = {title: ratio_gain(est(ctx, two, col), est(ctx, reference, col)) for title, col in domain_panels(ctx)}
        verdict = "holds" if all(g > 0 for g in gains.values()) else "does NOT hold"
        lines.append(f"Ours: DSpark depth 2 vs {label(reference)}: "
                     + ", ".join(f"{d} {pct(g)}" for d, g in gains.items()) + f" → the claim {verdict} here.")
        if ctx.has("eval/all/tau_prompt_mean"):
            diffs = {s: tau_difference(ctx, two, reference, s) for s in scopes(ctx)}
            lines += ["", f"With 95% CIs (per-prompt τ; prompts and seeds):",
                      *[f"- {judged(s, d)}" for s, d in diffs.items()]]
            worse = [s for s, d in diffs.items() if d.verdict == "reversed"]
            lines.append("- → \"a 2-layer DSpark ≥ a 5-layer DFlash\": " + (
                f"**reversed** in {', '.join(worse)}" if worse else
                "**holds** (no domain significantly below; " + ", ".join(
                    f"{s} {d.verdict}" for s, d in diffs.items() if s != "all") + ")"))
    lines += depth_trend(ctx, [g for g in groups if drafter_of(g) == "dspark"])
    return [Section("How to read", tau_note(ctx)),
            Section("τ by depth", config_table(ctx, groups, label=label, reference=reference)
                    + f"\n\n![depth]({path.name})"),
            claim_section("depth", lines)]


def depth_trend(ctx: ReportContext, dspark: list[Group]) -> list[str]:
    """Each deeper DSpark against the shallowest (the groups come sorted by depth), with 95% CIs: per-prompt
    rollout τ over all sets, and held-out τ_prob between seeds (no within-run se: one seed gives no interval).
    The paper's Fig. 3 has τ rise with depth; the verdict line reads the deepest against the shallowest."""
    if len(dspark) < 2:
        return []
    base = dspark[0]
    shallow = base["axis.model.depth"]
    rollouts = ctx.has("eval/all/tau_prompt_mean")
    lines = ["", f"Deeper DSpark vs depth {shallow} (the paper: τ rises with depth), 95% CIs:"]
    for group in dspark[1:]:
        parts, verdicts = [], {}  # the loop ends on the deepest: its verdicts make the summary line
        if rollouts:
            rollout = tau_difference(ctx, group, base, "all")
            parts.append(judged("τ all (per prompt)", rollout))
            verdicts["rollout τ"] = rollout.verdict
        proxy = Difference(pooled_plain(ctx.rows_of(group), TAU_PROB), pooled_plain(ctx.rows_of(base), TAU_PROB))
        if proxy.ok:
            parts.append(judged("held-out τ_prob (seeds only)", proxy, relative=False))
            verdicts["held-out τ_prob"] = proxy.verdict
        elif proxy.a.ok and proxy.b.ok:
            parts.append(f"held-out τ_prob {proxy.a.mean:.3f} vs {proxy.b.mean:.3f} (a single seed: no interval)")
            verdicts["held-out τ_prob"] = "not measured"
        lines.append(f"- depth {group['axis.model.depth']}: " + ("; ".join(parts) or "not measured"))
    deepest = dspark[-1]["axis.model.depth"]
    domains = [s for s in scopes(ctx) if s != "all"] if rollouts else []
    if domains:  # an "all" that does not move can hide domains that do, in opposite directions
        lines.append(f"- depth {deepest} vs {shallow} by domain (per-prompt τ):")
        lines += [f"  - {judged(s, tau_difference(ctx, dspark[-1], base, s))}" for s in domains]
    lines.append(f"- → \"τ rises with depth\" (depth {deepest} vs {shallow}): "
                 + "; ".join(f"{name} **{verdict}**" for name, verdict in verdicts.items()))
    return lines


# ---- block size (Fig. 4 left) ----

@REPORT_BUILDERS.register("block_size")
def build_block_size(ctx: ReportContext) -> list[Section]:
    """Fig. 4 left: τ against γ+1 per variant and DSpark's gain over DFlash per γ."""
    groups = sorted(ctx.group_dicts(), key=sort_key("axis.model.block_size"))
    label = lambda g: f"{variant_label(g)} γ={g.get('axis.model.block_size')}"  # noqa: E731
    column, ylabel = headline_metric(ctx)
    variants = list(dict.fromkeys(variant_label(g) for g in groups))
    panels = {title: {v: [(g["axis.model.block_size"] + 1, est(ctx, g, col)) for g in groups
                          if variant_label(g) == v] for v in variants} for title, col in domain_panels(ctx)}
    sizes = sorted({g["axis.model.block_size"] for g in groups})
    path = plot_lines(panels, ctx.png("block_size"), xlabel="proposal length γ+1", ylabel=ylabel,
                      xticks=[s + 1 for s in sizes], title="τ against block size (paper Fig. 4 left)")
    sections = [Section("How to read", tau_note(ctx)),
                Section("τ by block size", config_table(ctx, groups, label=label) + f"\n\n![block size]({path.name})")]
    domains = eval_domains(ctx.frame)
    gains = block_gains(ctx, groups, sizes, domains) if domains else None
    if gains:
        sections.append(Section("DSpark gain over DFlash by block size", gains))
    sections.append(claim_section("block_size", block_claim(ctx, groups, sizes)))
    return sections


def block_pair(groups: list[Group], variant: str, size: int) -> tuple[Group | None, Group | None]:
    """The `variant` DSpark cell and the DFlash cell at block size `size` (either None when not run)."""
    mine = next((g for g in groups if variant_label(g) == variant and g["axis.model.block_size"] == size), None)
    base = next((g for g in groups if drafter_of(g) == "dflash" and g["axis.model.block_size"] == size), None)
    return mine, base


def block_claim(ctx: ReportContext, groups: list[Group], sizes: list[int]) -> list[str]:
    """Our overall gain of each DSpark variant over DFlash per γ, and whether it grows with γ: in rollout τ when
    the cells were evaluated, and in held-out teacher-forced τ_prob (less noisy: no sampling) beside it."""
    columns = ["eval/all/tau", TAU_PROB] if eval_domains(ctx.frame) else [TAU_PROB]
    lines = []
    for variant in dict.fromkeys(variant_label(g) for g in groups if drafter_of(g) == "dspark"):
        if lines and lines[-1]:
            lines.append("")  # a variant's lines must not continue the previous one's list in markdown
        for col in (c for c in columns if ctx.has(c)):
            gains = []
            for size in sizes:
                mine, base = block_pair(groups, variant, size)
                if mine is not None and base is not None:
                    gains.append((size, ratio_gain(est(ctx, mine, col), est(ctx, base, col))))
            if len(gains) >= 2:
                grows = all(b[1] > a[1] for a, b in zip(gains, gains[1:]))
                lines += [f"Ours, {variant} vs DFlash ({col}): " + ", ".join(f"γ={s} {pct(g)}" for s, g in gains)
                          + f" → the point estimates {'grow' if grows else 'do not grow monotonically'} with γ.", ""]
        lines += block_judgements(ctx, groups, sizes, variant)
    return lines + head_by_size(ctx, groups, sizes)


def head_by_size(ctx: ReportContext, groups: list[Group], sizes: list[int]) -> list[str]:
    """Per γ where both heads ran: the RNN head against the Markov head in per-prompt τ with its 95% CI, and in
    held-out τ_prob beside it (the paper: the RNN head is only marginally above Markov, and only at long blocks)."""
    pairs = {}
    for size in sizes:
        at = {str(head_of(g)): g for g in groups
              if drafter_of(g) == "dspark" and g["axis.model.block_size"] == size}
        if "rnn" in at and "markov" in at:
            pairs[size] = (at["rnn"], at["markov"])
    if not pairs:
        return []
    lines = ["", "DSpark (rnn) vs DSpark (markov) at the same γ (paper: the RNN head only marginally above Markov, "
                 "at long blocks):"]
    for size, (rnn, markov) in pairs.items():
        parts = []
        if ctx.has("eval/all/tau_prompt_mean"):
            parts.append(judged("per-prompt τ (all)", tau_difference(ctx, rnn, markov, "all")))
        if ctx.has(TAU_PROB):
            parts.append(f"held-out τ_prob {pct(ratio_gain(est(ctx, rnn, TAU_PROB), est(ctx, markov, TAU_PROB)))}")
        lines.append(f"- γ={size}: " + "; ".join(parts))
    return lines


def block_judgements(ctx: ReportContext, groups: list[Group], sizes: list[int], variant: str) -> list[str]:
    """Per γ the variant's τ gain over DFlash with its 95% CI, and the change of the gain from the smallest to
    the largest γ (the paper: the gain grows with γ) with the CI of that change; then the same per domain as a
    table (the paper reports the growth per domain)."""
    if not ctx.has("eval/all/tau_prompt_mean"):
        return []
    pairs = {}
    for size in sizes:
        mine, base = block_pair(groups, variant, size)
        if mine is not None and base is not None:
            pairs[size] = (mine, base)
    if len(pairs) < 2:
        return []
    diffs = {size: tau_difference(ctx, mine, base, "all") for size, (mine, base) in pairs.items()}
    lines = ["", f"{variant} vs DFlash, per-prompt τ (all), 95% CIs:",
             *[f"- γ={s}: {judged('gain', d)}" for s, d in diffs.items()]]
    change = gain_change(diffs[min(diffs)], diffs[max(diffs)])
    if change is not None:
        lines.append(f"- → gain at γ={max(diffs)} minus gain at γ={min(diffs)}: {change.text()} "
                     f"→ **{change.verdict}**")
    domains = [d for d in eval_domains(ctx.frame) if ctx.has(f"eval/domain/{d}/tau_prompt_mean")]
    if domains:
        by_domain = {d: {s: tau_difference(ctx, mine, base, d) for s, (mine, base) in pairs.items()} for d in domains}
        rows = [[f"γ={s}", *[by_domain[d][s].text() for d in domains]] for s in pairs]
        changes = [gain_change(by_domain[d][min(pairs)], by_domain[d][max(pairs)]) for d in domains]
        rows.append([f"γ={max(pairs)} − γ={min(pairs)}",
                     *[f"{c.text()} → {c.verdict}" if c is not None else "–" for c in changes]])
        lines += ["", f"{variant} vs DFlash by domain, per-prompt τ gain, 95% CIs:", "",
                  markdown_table(["γ", *domains], rows)]
    return lines


def block_gains(ctx: ReportContext, groups: list[Group], sizes: list[int], domains: list[str]) -> str | None:
    """Per γ and domain: each DSpark variant's gain over DFlash at the same γ, with the paper's."""
    header = ["γ", "variant", *[f"{d} ours" for d in domains], *[f"{d} paper" for d in domains]]
    rows = []
    for size in sizes:
        at = [g for g in groups if g["axis.model.block_size"] == size]
        base = next((g for g in at if drafter_of(g) == "dflash"), None)
        if base is None:
            continue
        for g in (g for g in at if drafter_of(g) == "dspark"):
            head = head_of(g)
            ref = paper.BLOCK_SIZE_GAIN.get(size, {}) if head == "markov" else {}
            rows.append([str(size), f"{variant_label(g)} vs DFlash",
                         *[pct(ratio_gain(est(ctx, g, domain_tau(d)), est(ctx, base, domain_tau(d)))) for d in domains],
                         *[pct(ref.get(d)) for d in domains]])
    return markdown_table(header, rows) if rows else None


# ---- head ----

@REPORT_BUILDERS.register("head")
def build_head(ctx: ReportContext) -> list[Section]:
    """Heads none / markov / gated / rnn at fixed depth and γ, gains over no head."""
    groups = sorted(ctx.group_dicts(), key=sort_key())
    reference = next((g for g in groups if head_of(g) == "none"), None)
    column, ylabel = headline_metric(ctx)
    panels = {title: {variant_label(g): est(ctx, g, col) for g in groups} for title, col in domain_panels(ctx)}
    path = plot_bars(panels, ctx.png("head"), ylabel=ylabel, title="Sequential head at fixed depth and block size")
    return [Section("How to read", tau_note(ctx)),
            Section("τ by sequential head", config_table(ctx, groups, label=variant_label, reference=reference)
                    + f"\n\n![heads]({path.name})"),
            claim_section("head", head_claim(ctx, groups, reference))]


def head_claim(ctx: ReportContext, groups: list[Group], reference: Group | None) -> list[str]:
    """Our gains of each head over none and of rnn over markov."""
    col = "eval/all/tau" if eval_domains(ctx.frame) else TAU_PROB
    by_head = {str(head_of(g)): g for g in groups}
    lines = []
    gain = lambda a, b: pct(ratio_gain(est(ctx, a, col), est(ctx, b, col)))  # noqa: E731
    if reference is not None:
        lines += [f"Ours ({col}): {head} vs none {gain(by_head[head], reference)}."
                  for head in ("markov", "gated", "rnn") if head in by_head]
    among = [head for head in ("gated", "rnn") if head in by_head and "markov" in by_head]
    lines += [f"Ours: {head} vs markov {gain(by_head[head], by_head['markov'])}." for head in among]
    if among and ctx.has("eval/all/tau_prompt_mean"):
        lines += ["", "The heads among themselves, per-prompt τ (all), 95% CIs:",
                  *[f"- {judged(f'{head} vs markov', tau_difference(ctx, by_head[head], by_head['markov'], 'all'))}"
                    for head in among]]
    if reference is not None:
        lines += head_judgements(ctx, by_head, reference)
    return lines


def head_judgements(ctx: ReportContext, by_head: dict[str, Group], reference: Group) -> list[str]:
    """Each head vs none: τ and cond@k for k ≥ 2 from rollouts, and the teacher-forced slot acceptances, with
    95% CIs (the paper: the sequential head restores intra-block dependencies, so cond@k rises for k ≥ 2)."""
    none_rows = ctx.rows_of(reference)
    positions = sorted({int(c.rsplit("pos", 1)[1]) for c in ctx.frame.columns if c.startswith("eval/all/cond/pos")})
    tf_positions = sorted({int(c.rsplit("pos", 1)[1]) for c in ctx.frame.columns if c.startswith("val/accept/pos")})
    lines: list[str] = []
    if not (ctx.has("eval/all/tau_prompt_mean") or tf_positions):
        return lines
    for head in ("markov", "gated", "rnn"):
        if head not in by_head:
            continue
        rows = ctx.rows_of(by_head[head])
        lines += ["", f"{head} vs none, 95% CIs:"]
        if ctx.has("eval/all/tau_prompt_mean"):
            lines.append(f"- {judged('τ (all, per prompt)', tau_difference(ctx, by_head[head], reference, 'all'))}")
        cond = {k: Difference(pooled_cond(rows, k), pooled_cond(none_rows, k)) for k in positions if k >= 2}
        unmeasured = [k for k, d in cond.items() if not d.ok]
        cond = {k: d for k, d in cond.items() if d.ok}
        lines += [f"- {judged(f'rollout cond@{k}', d, relative=False)}" for k, d in cond.items()]
        if unmeasured:
            lines.append(f"- rollout cond@k for k ∈ {unmeasured}: fewer than {MIN_ROUNDS} rounds reached the slot in "
                         "some run — no estimate")
        tf = {k: Difference(pooled_plain(rows, f"val/accept/pos{k}"), pooled_plain(none_rows, f"val/accept/pos{k}"))
              for k in tf_positions}
        if tf and all(d.ok for d in tf.values()):
            lines += [f"- {judged(f'teacher-forced acceptance slot {k} (seeds only)', d, relative=False)}"
                      for k, d in tf.items()]
        elif tf:  # one seed: no between-seed interval; the values themselves
            mine, base = ([f"{d.a.mean:.3f}" if d.a.ok else "–" for d in tf.values()],
                          [f"{d.b.mean:.3f}" if d.b.ok else "–" for d in tf.values()])
            lines.append(f"- teacher-forced acceptance, slots {min(tf)}–{max(tf)} (one seed, no interval): "
                         f"{head} {', '.join(mine)} vs none {', '.join(base)}")
        raised = [k for k, d in cond.items() if d.verdict == "holds"]
        lowered = [k for k, d in cond.items() if d.verdict == "reversed"]
        if cond:
            lines.append(f"- → \"{head} raises cond@k for k ≥ 2\" (rollouts): significantly raised at "
                         f"k ∈ {raised or '∅'}, lowered at k ∈ {lowered or '∅'}, of the measured k ∈ {list(cond)}")
    return lines


# ---- objective ----

def objective_label(group: Group) -> str:
    kind = str(group.get("axis.loss.kind") or group.get("loss.kind") or "paper")
    return f"{variant_label(group)}, {'D-PARD' if kind == 'dpard' else 'paper loss'}"


@REPORT_BUILDERS.register("objective")
def build_objective(ctx: ReportContext) -> list[Section]:
    """loss.kind=paper vs dpard at fixed depth and γ: τ per objective and D-PARD's gain over the paper's loss."""
    groups = sorted(ctx.group_dicts(), key=sort_key())
    by_kind = {str(g.get("axis.loss.kind") or g.get("loss.kind") or "paper"): g for g in groups}
    reference = by_kind.get("paper")
    column, ylabel = headline_metric(ctx)
    panels = {title: {objective_label(g): est(ctx, g, col) for g in groups} for title, col in domain_panels(ctx)}
    path = plot_bars(panels, ctx.png("objective"), ylabel=ylabel, title="Training objective at fixed depth and γ")
    col = "eval/all/tau" if eval_domains(ctx.frame) else TAU_PROB
    claims = ([f"Ours ({col}): D-PARD vs the paper's loss "
               f"{pct(ratio_gain(est(ctx, by_kind['dpard'], col), est(ctx, reference, col)))}."]
              if reference is not None and "dpard" in by_kind else [])
    return [Section("How to read", tau_note(ctx)),
            Section("τ by training objective", config_table(ctx, groups, label=objective_label, reference=reference)
                    + f"\n\n![objectives]({path.name})"),
            Section("Findings", "\n".join(f"- {line}" for line in claims) or "Needs both objectives' runs.")]


# ---- any other grid sweep ----

@REPORT_BUILDERS.register("generic")
def build_generic(ctx: ReportContext) -> list[Section]:
    groups = ctx.group_dicts()
    return [Section("How to read", tau_note(ctx)),
            Section("Results per configuration", config_table(ctx, groups, label=lambda g: axis_text(g)))]
