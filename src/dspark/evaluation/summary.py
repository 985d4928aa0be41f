"""Evaluation metrics from decoding rollouts, per dataset, per domain and overall (METHOD §8, §9).

Per dataset (all rounds of its prompts):
    tau                 = Σ τ / #rounds                 pooled over rounds (DeepSpec's convention, the headline)
    tau_prompt_mean     = mean over prompts of (Σ τ / #rounds of the prompt), with tau_prompt_ci95 its 95%
                          Student-t half-width over prompts (z-lab's convention, reported beside, never instead)
    survival/pos{k}, cond/pos{k}, verify_rate, draft_accept_rate, rounds      `RolloutAcceptance`
    tokens_per_second / target_tokens_per_second = Σ new tokens / Σ seconds (prefill included) of speculative /
                          target-only decoding of the same prompts; speedup = their ratio; speedup_prompt_mean
                          (± speedup_prompt_ci95) the mean of per-prompt ratios
    time/{verify,draft_parallel,draft_sequential,other}_ms  mean wall time per round

A separate speed measurement (a speed policy against target-only decoding on a subset of the prompts) is summarised
the same way; `speed_metrics` logs its overall values as `speed/…`, and `tau_phrase` / `speedup_phrase` state the
results with their intervals in the run's last line.

A "benchmark" is a dataset restricted to one domain (a single-domain set is one benchmark). Domain and overall
(`all`) values are unweighted means of the per-benchmark values (paper Fig. 2 averages per-benchmark rates; Table 1's
macro numbers average per-set τ), except counts (`rounds`, `prompts`: sums), the per-prompt statistics (computed over
the pooled prompts) and `tau_rounds_pooled` (Σ τ / #rounds over all rounds of the group).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import polars as pl
import torch

from dspark.intervals import mean_ci
from dspark.markdown import markdown_table, num
from dspark.metrics.rollout import RolloutAcceptance

ROUND_TIMES = {
    "seconds_verify": "verify_ms",
    "seconds_draft_parallel": "draft_parallel_ms",
    "seconds_draft_sequential": "draft_sequential_ms",
    "seconds_other": "other_ms",
}
SUMMED = ("rounds", "prompts")
PER_PROMPT = ("tau_prompt_mean", "tau_prompt_ci95", "speedup_prompt_mean", "speedup_prompt_ci95")
_UNSAFE = re.compile(r"[^A-Za-z0-9_/. -]")
_ROUND_SCHEMA = {
    "dataset": pl.String,
    "domain": pl.String,
    "prompt_id": pl.String,
    "num_verified": pl.Int64,
    "num_accepted": pl.Int64,
    "committed": pl.Int64,
    **{k: pl.Float64 for k in ROUND_TIMES},
}
_PROMPT_SCHEMA = {
    "dataset": pl.String,
    "domain": pl.String,
    "prompt_id": pl.String,
    "mode": pl.String,
    "new_tokens": pl.Int64,
    "seconds": pl.Float64,
}


def rounds_frame(rollouts: Sequence[Any]) -> pl.DataFrame:
    """One row per round of the speculative rollouts: ids, ℓ_eff, A, τ and the four timings."""
    rows = [
        {
            "dataset": r.dataset,
            "domain": r.domain,
            "prompt_id": r.prompt_id,
            "num_verified": int(rd["num_verified"]),
            "num_accepted": int(rd["num_accepted"]),
            "committed": int(rd["committed"]),
            **{k: float(rd.get(k) or 0.0) for k in ROUND_TIMES},
        }
        for r in rollouts
        if r.mode == "speculative"
        for rd in r.rounds
    ]
    return pl.DataFrame(rows, schema=_ROUND_SCHEMA)


def prompts_frame(rollouts: Sequence[Any]) -> pl.DataFrame:
    """One row per prompt: per-mode tokens and seconds, rounds, Σ τ, per-prompt τ and speed-up."""
    runs = pl.DataFrame(
        [
            {
                "dataset": r.dataset,
                "domain": r.domain,
                "prompt_id": r.prompt_id,
                "mode": r.mode,
                "new_tokens": len(r.new_tokens),
                "seconds": float(r.total_seconds),
            }
            for r in rollouts
        ],
        schema=_PROMPT_SCHEMA,
    )
    keys = ["dataset", "domain", "prompt_id"]
    frames = [
        runs.filter(pl.col("mode") == mode).select(
            *keys, pl.col("new_tokens").alias(f"{mode}_tokens"), pl.col("seconds").alias(f"{mode}_seconds")
        )
        for mode in ("speculative", "target")
    ]
    per_prompt = frames[0].join(frames[1], on=keys, how="full", coalesce=True)
    counts = rounds_frame(rollouts).group_by(keys).agg(pl.len().alias("rounds"), pl.col("committed").sum())
    per_prompt = per_prompt.join(counts, on=keys, how="left").with_columns(
        (pl.col("committed") / pl.col("rounds")).alias("tau"),
        (
            (pl.col("speculative_tokens") / pl.col("speculative_seconds"))
            / (pl.col("target_tokens") / pl.col("target_seconds"))
        ).alias("speedup"),
    )
    return per_prompt.sort(keys)


def acceptance_metrics(rounds: pl.DataFrame, *, block_size: int) -> dict[str, float]:
    """`RolloutAcceptance` over the rows of a rounds frame (NaN ratios when it has none)."""
    metric = RolloutAcceptance(block_size)
    metric.update(
        **{
            name: torch.tensor(rounds[name].to_list(), dtype=torch.long)
            for name in ("num_verified", "num_accepted", "committed")
        }
    )
    return {name: float(value) for name, value in metric.compute().items()}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator and math.isfinite(denominator) else float("nan")


def _speed_metrics(prompts: pl.DataFrame) -> dict[str, float]:
    sums = {
        c: float(prompts[c].fill_null(0).sum()) if c in prompts.columns else 0.0
        for c in ("speculative_tokens", "speculative_seconds", "target_tokens", "target_seconds")
    }
    speculative = _ratio(sums["speculative_tokens"], sums["speculative_seconds"])
    target = _ratio(sums["target_tokens"], sums["target_seconds"])
    return {
        "tokens_per_second": speculative,
        "target_tokens_per_second": target,
        "speedup": _ratio(speculative, target),
    }


def _per_prompt_metrics(prompts: pl.DataFrame) -> dict[str, float]:
    tau_mean, tau_ci = mean_ci(prompts["tau"].drop_nulls().to_list())
    speedup_mean, speedup_ci = mean_ci(prompts["speedup"].drop_nulls().to_list())
    return {
        "prompts": float(prompts.height),
        "tau_prompt_mean": tau_mean,
        "tau_prompt_ci95": tau_ci,
        "speedup_prompt_mean": speedup_mean,
        "speedup_prompt_ci95": speedup_ci,
    }


def group_metrics(rounds: pl.DataFrame, prompts: pl.DataFrame, *, block_size: int) -> dict[str, float]:
    """Every metric of the module docstring for one group of rounds and its prompts."""
    out = acceptance_metrics(rounds, block_size=block_size)
    out.update(_per_prompt_metrics(prompts))
    out.update(_speed_metrics(prompts))
    for column, name in ROUND_TIMES.items():
        out[f"time/{name}"] = 1000.0 * float(rounds[column].mean()) if rounds.height else float("nan")
    return out


def aggregate(benchmarks: list[dict[str, float]], rounds: pl.DataFrame, prompts: pl.DataFrame) -> dict[str, float]:
    """Domain / overall values: unweighted means over benchmarks, with the exceptions of the module docstring."""
    names = [name for name in benchmarks[0] if name not in PER_PROMPT]
    out = {}
    for name in names:
        values = [b[name] for b in benchmarks if math.isfinite(b[name])]
        if name in SUMMED:
            out[name] = float(sum(values))
        else:
            out[name] = sum(values) / len(values) if values else float("nan")
    out.update({k: v for k, v in _per_prompt_metrics(prompts).items() if k != "prompts"})
    out["tau_rounds_pooled"] = _ratio(float(rounds["committed"].sum()), float(rounds.height))
    out["benchmarks"] = float(len(benchmarks))
    return out


@dataclass
class EvalSummary:
    """Metrics of one evaluation: per dataset, per benchmark (dataset, domain), per domain and overall."""

    block_size: int
    datasets: dict[str, dict[str, float]] = field(default_factory=dict)
    benchmarks: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    domains: dict[str, dict[str, float]] = field(default_factory=dict)
    overall: dict[str, float] = field(default_factory=dict)

    def domain_benchmarks(self, domain: str) -> list[str]:
        """Datasets contributing to a domain's mean."""
        return [dataset for dataset, dom in self.benchmarks if dom == domain]


def summarize(rollouts: Sequence[Any], *, block_size: int) -> EvalSummary:
    """Compute the `EvalSummary` of speculative + target-only rollouts of the same prompts."""
    if not rollouts:
        raise ValueError("No rollouts to summarise: decode.eval_sets selected no prompts (decode.prompts_per_set=0?)")
    rounds, prompts = rounds_frame(rollouts), prompts_frame(rollouts)
    summary = EvalSummary(block_size=block_size)
    for (dataset,) in sorted(prompts.select("dataset").unique().rows()):
        select = pl.col("dataset") == dataset
        summary.datasets[dataset] = group_metrics(rounds.filter(select), prompts.filter(select), block_size=block_size)
    for dataset, domain in sorted(prompts.select("dataset", "domain").unique().rows()):
        select = (pl.col("dataset") == dataset) & (pl.col("domain") == domain)
        summary.benchmarks[(dataset, domain)] = group_metrics(
            rounds.filter(select), prompts.filter(select), block_size=block_size
        )
    for (domain,) in sorted(prompts.select("domain").unique().rows()):
        select = pl.col("domain") == domain
        parts = [m for (_, dom), m in summary.benchmarks.items() if dom == domain]
        summary.domains[domain] = aggregate(parts, rounds.filter(select), prompts.filter(select))
    summary.overall = aggregate(list(summary.benchmarks.values()), rounds, prompts)
    return summary


def metric_name(*parts: str) -> str:
    """An MLflow-safe metric name: characters outside [A-Za-z0-9_/. -] become '_'."""
    return _UNSAFE.sub("_", "/".join(parts))


def flatten_metrics(summary: EvalSummary) -> dict[str, float]:
    """`eval/<dataset>/…`, `eval/domain/<domain>/…`, `eval/all/…`, `summary/tau`, `summary/speedup`."""
    flat = {}
    for dataset, metrics in summary.datasets.items():
        flat.update({metric_name("eval", dataset, k): v for k, v in metrics.items()})
    for domain, metrics in summary.domains.items():
        flat.update({metric_name("eval", "domain", domain, k): v for k, v in metrics.items()})
    flat.update({metric_name("eval", "all", k): v for k, v in summary.overall.items()})
    flat["summary/tau"] = summary.overall["tau"]
    flat["summary/speedup"] = summary.overall["speedup"]
    return flat


SPEED_KEYS = (
    "speedup",
    "speedup_prompt_mean",
    "speedup_prompt_ci95",
    "tokens_per_second",
    "target_tokens_per_second",
    "tau",
    "prompts",
)


def speed_metrics(summary: EvalSummary) -> dict[str, float]:
    """`speed/…`: the overall speed-up (pooled and per prompt ± CI), tokens/s and τ of a speed measurement."""
    return {f"speed/{k}": summary.overall[k] for k in SPEED_KEYS if k in summary.overall}


def interval(mean: float, half: float, *, digits: int = 2, unit: str = "") -> str:
    """`1.21× [1.15, 1.27]` (mean and mean ± half), `1.21×` without a finite half-width, `–` without a mean."""
    if not math.isfinite(mean):
        return "–"
    text = f"{mean:.{digits}f}{unit}"
    if math.isfinite(half):
        text += f" [{mean - half:.{digits}f}, {mean + half:.{digits}f}]"
    return text


def tau_phrase(summary: EvalSummary, *, setting: str) -> str:
    """`τ 1.41 [1.37, 1.45] per prompt, 1.43 pooled (fixed ℓ=γ=7, T=1, 9 prompts)`: the per-prompt mean with its
    95% Student-t interval, and beside it the pooled τ of the report's headline column (which has no interval)."""
    m = summary.overall
    return (
        f"τ {interval(m['tau_prompt_mean'], m['tau_prompt_ci95'])} per prompt, {num(m['tau'])} pooled "
        f"({setting}, {int(m['prompts'])} prompts)"
    )


def speedup_phrase(summary: EvalSummary, *, setting: str) -> str:
    """`speed-up 1.21× [1.15, 1.27] per prompt <setting> (6 prompts)`, or `speed-up not measured …` when the
    rollouts hold no target-only decoding."""
    m = summary.overall
    if not math.isfinite(m.get("speedup_prompt_mean", float("nan"))):
        return f"speed-up not measured ({setting}: no target-only decoding)"
    return (
        f"speed-up {interval(m['speedup_prompt_mean'], m['speedup_prompt_ci95'], unit='×')} per prompt "
        f"{setting} ({int(m['prompts'])} prompts)"
    )


def _ci(metrics: dict[str, float], mean: str, half: str) -> str:
    return f"{num(metrics[mean])} ± {num(metrics[half])}"


def main_table(summary: EvalSummary) -> str:
    """Per dataset, per domain and overall: τ pooled, τ per-prompt ± CI, rates, speed."""
    header = [
        "group",
        "prompts",
        "rounds",
        "τ pooled",
        "τ per-prompt ± 95% CI",
        "verify rate",
        "draft accept",
        "tok/s spec",
        "tok/s target",
        "speed-up",
        "speed-up per-prompt ± CI",
    ]
    groups = [(name, m) for name, m in summary.datasets.items()]
    groups += [
        (f"**{domain}** (mean of {len(summary.domain_benchmarks(domain))})", m) for domain, m in summary.domains.items()
    ]
    groups.append(("**all**", summary.overall))
    rows = [
        [
            name,
            num(m["prompts"], 0),
            num(m["rounds"], 0),
            num(m["tau"], 3),
            _ci(m, "tau_prompt_mean", "tau_prompt_ci95"),
            num(m["verify_rate"], 3),
            num(m["draft_accept_rate"], 3),
            num(m["tokens_per_second"], 1),
            num(m["target_tokens_per_second"], 1),
            num(m["speedup"], 2),
            _ci(m, "speedup_prompt_mean", "speedup_prompt_ci95"),
        ]
        for name, m in groups
    ]
    return markdown_table(header, rows)


def position_table(summary: EvalSummary, *, kind: str) -> str:
    """cond@k or survival@k (kind = 'cond' | 'survival') per dataset and per domain."""
    positions = range(1, summary.block_size + 1)
    header = ["group", *[f"{kind}@{k}" for k in positions]]
    groups = list(summary.datasets.items()) + [(f"**{d}**", m) for d, m in summary.domains.items()]
    rows = [[name, *[num(m[f"{kind}/pos{k}"], 3) for k in positions]] for name, m in groups]
    return markdown_table(header, rows)


def timing_table(summary: EvalSummary) -> str:
    """Mean wall time per round split into verification, parallel draft, sequential loop and the rest."""
    header = ["group", "verify ms", "draft parallel ms", "draft sequential ms", "other ms"]
    groups = list(summary.datasets.items()) + [("**all**", summary.overall)]
    rows = [[name, *[num(m[f"time/{key}"], 1) for key in ROUND_TIMES.values()]] for name, m in groups]
    return markdown_table(header, rows)


def speed_section(speed: EvalSummary, meta: dict) -> list[str]:
    """The speed measurement's section: its policy against target-only decoding on a subset of the prompts."""
    info = meta.get("speed") or {}
    policy = info.get("policy", "scheduler")
    return [
        f"## Speed: decode.policy={policy} against target-only decoding",
        "",
        f"The τ above is measured with every draft verified (decode.policy={meta['decode']['policy']}), which is "
        f"not a speed policy. The speed-up is measured here: decode.policy={policy} (with the STS calibration "
        f"when decode.calibrate) and target-only decoding, interleaved prompt by prompt with the same seeds, on "
        f"{int(speed.overall['prompts'])} of the prompts above (decode.speed_prompts, spread over the sets); "
        f"round records {info.get('rounds_file', '–')}.",
        "",
        main_table(speed),
        "",
    ]


def report_markdown(
    meta: dict,
    summary: EvalSummary,
    *,
    cond_plot: str,
    calibration_md: str | None = None,
    reliability_plot: str | None = None,
    speed: EvalSummary | None = None,
) -> str:
    """The evaluation report: the headline, what ran, the command, the tables and the figures (relative file
    names); `speed` is the separate speed measurement (`speed_section`), when there was one."""
    decode = meta["decode"]
    policy = decode["policy"] + (
        f" (θ = {decode['threshold']:g})"
        if "threshold" in decode["policy"]
        else f" (ℓ = {decode.get('static_k')})"
        if decode["policy"] == "static"
        else ""
    )
    lines = [f"# Evaluation — {meta['run_name']}", ""]
    if meta.get("headline"):
        lines += [f"**{meta['headline']}**", ""]
    lines += [
        f"- command: `{meta['command']}`",
        f"- target: {meta['target']} (fingerprint {meta['target_fingerprint'][:12]}); drafter: {meta['drafter_kind']}"
        f" head={meta['spec']['head']} depth={meta['spec']['depth']} γ={summary.block_size} ({meta['drafter_path']})",
        f"- decoding: policy {policy}, temperature {decode['temperature']:g}, max_new_tokens "
        f"{decode['max_new_tokens']}, {decode['prompts_per_set']} prompts per set from {', '.join(decode['eval_sets'])}"
        f"; first user turn under the chat template, no system prompt of ours; seed {meta['seed']}",
        f"- speed-up baseline: target-only decoding of the same prompts with the same engine and seeds",
        f"- MLflow run {meta.get('mlflow_run_id') or '–'}; git {meta.get('git_commit', '–')[:12]}; "
        f"round records {meta['rounds_file']}; finished {meta.get('finished', '–')}",
    ]
    if meta.get("paths_relative_to"):
        lines.append(f"- paths are relative to {meta['paths_relative_to']}")
    if meta.get("machine"):  # absent from evaluations written before the field existed
        lines.append(f"- machine: {meta['machine']}; {meta.get('precision', '')}".rstrip("; "))
    if meta.get("sps_table"):
        lines.append(f"- scheduler SPS table: {meta['sps_table']}")
    lines += [
        "",
        "τ pooled = Σ τ / #rounds over all rounds of a dataset (DeepSpec's convention, METHOD §1); τ "
        "per-prompt = the mean over prompts of each prompt's pooled τ, ± the 95% Student-t half-width over "
        "prompts. Domain and `all` rows average the per-dataset values (paper Fig. 2 / Table 1 macro means). "
        "verify rate = Σ τ / Σ (ℓ_eff + 1); draft accept = Σ A / Σ ℓ_eff (METHOD §8). tok/s include prefill.",
        "",
        main_table(summary),
        "",
    ]
    if speed is not None:
        lines += speed_section(speed, meta)
    lines += [
        "## Conditional acceptance per position (cond@k, paper Fig. 2)",
        "",
        f"![cond@k]({cond_plot})",
        "",
        position_table(summary, kind="cond"),
        "",
        "## Survival per position (survival@k = DeepSpec's eval accept_rate@k-1)",
        "",
        position_table(summary, kind="survival"),
        "",
        "## Time per round",
        "",
        timing_table(summary),
        "",
    ]
    if calibration_md:
        lines += ["## Confidence calibration (STS, METHOD §6)", "", calibration_md, ""]
        if reliability_plot:
            lines += [f"![reliability]({reliability_plot})", ""]
    return "\n".join(lines)
