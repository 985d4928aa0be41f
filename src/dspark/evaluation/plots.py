"""Evaluation figures (matplotlib, Agg canvas, no pyplot state):

- `plot_conditional_acceptance`: cond@k per position, one line per domain (the mean of its benchmarks' rates,
  paper Fig. 2) with the benchmarks as thin lines;
- `plot_threshold_sweep`: per domain, accepted and rejected drafts per round (stacked bars) and the verify rate
  (line) against a static confidence threshold (paper Fig. 5);
- `plot_latency_breakdown`: time per round split into target verification, parallel draft and sequential loop, per
  head and block size, one panel per context length (paper Fig. 4 right).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from matplotlib.figure import Figure

from dspark.plotting import save_figure

DOMAIN_COLOURS = {"math": "tab:blue", "code": "tab:green", "chat": "tab:orange"}
PHASES = (
    ("verify_ms", "target verification", "tab:blue"),
    ("draft_parallel_ms", "parallel draft", "tab:orange"),
    ("draft_sequential_ms", "sequential loop", "tab:red"),
    ("other_ms", "other (Python)", "tab:grey"),
)


def _colour(domain: str, index: int) -> str:
    return DOMAIN_COLOURS.get(domain, f"C{index + 3}")


def plot_conditional_acceptance(summary: Any, path: str | Path, *, title: str = "") -> Path:
    """Write cond@k against slot k (1-based) for every domain of an `EvalSummary`."""
    positions = list(range(1, summary.block_size + 1))
    fig = Figure(figsize=(6.4, 4.2))
    axis = fig.subplots()
    for index, (domain, metrics) in enumerate(summary.domains.items()):
        colour = _colour(domain, index)
        for (dataset, dom), bench in summary.benchmarks.items():
            if dom == domain and len(summary.domain_benchmarks(domain)) > 1:
                axis.plot(
                    positions,
                    [bench[f"cond/pos{k}"] for k in positions],
                    color=colour,
                    alpha=0.35,
                    linewidth=0.8,
                    linestyle="--",
                )
        axis.plot(
            positions,
            [metrics[f"cond/pos{k}"] for k in positions],
            color=colour,
            marker="o",
            label=f"{domain} ({', '.join(summary.domain_benchmarks(domain))})",
        )
    axis.set(
        xlabel="draft position k",
        ylabel="conditional acceptance cond@k",
        ylim=(0, 1.02),
        xticks=positions,
        title=title or "Per-position conditional acceptance (mean of benchmarks)",
    )
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return save_figure(fig, path)


def plot_threshold_sweep(rows: Sequence[dict], path: str | Path) -> Path:
    """rows: dicts with domain, threshold, accepted_per_round, rejected_per_round, verify_rate."""
    domains = sorted({row["domain"] for row in rows})
    fig = Figure(figsize=(4.2 * max(1, len(domains)), 3.8))
    axes = fig.subplots(1, max(1, len(domains)), squeeze=False)[0]
    for axis, domain in zip(axes, domains):
        part = sorted((r for r in rows if r["domain"] == domain), key=lambda r: r["threshold"])
        labels = [f"{r['threshold']:g}" for r in part]
        accepted = [r["accepted_per_round"] for r in part]
        rejected = [r["rejected_per_round"] for r in part]
        axis.bar(labels, accepted, color="tab:green", label="accepted drafts / round")
        axis.bar(labels, rejected, bottom=accepted, color="tab:red", alpha=0.7, label="rejected drafts / round")
        # head-room above the bars and the rate line keeps the legend off the data
        top = max([a + b for a, b in zip(accepted, rejected)] + [1e-9])
        axis.set(title=domain, xlabel="confidence threshold θ", ylabel="drafts per round", ylim=(0, 1.45 * top))
        rate = axis.twinx()
        rate.plot(labels, [r["verify_rate"] for r in part], color="black", marker="o", label="verify rate")
        rate.set(ylim=(0, 1.45), yticks=[0, 0.25, 0.5, 0.75, 1.0], ylabel="verify rate Σ τ / Σ(ℓ+1)")
        handles = axis.get_legend_handles_labels()[0] + rate.get_legend_handles_labels()[0]
        axis.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper right")
    return save_figure(fig, path)


def plot_latency_breakdown(rows: Sequence[dict], path: str | Path) -> Path:
    """rows: dicts with head, block_size, context_length and the per-round ms of each phase in `PHASES`."""
    contexts = sorted({row["context_length"] for row in rows})
    heads = list(dict.fromkeys(row["head"] for row in rows))
    blocks = sorted({row["block_size"] for row in rows})
    fig = Figure(figsize=(4.6 * max(1, len(contexts)), 4.0))
    axes = fig.subplots(1, max(1, len(contexts)), squeeze=False)[0]
    width = 0.8 / max(1, len(heads))
    for axis, context in zip(axes, contexts):
        for h, head in enumerate(heads):
            for b, block in enumerate(blocks):
                row = next(
                    (r for r in rows if (r["context_length"], r["head"], r["block_size"]) == (context, head, block)),
                    None,
                )
                if row is None:
                    continue
                x, bottom = b + (h - (len(heads) - 1) / 2) * width, 0.0
                for key, label, colour in PHASES:
                    axis.bar(
                        x,
                        row[key],
                        width * 0.9,
                        bottom=bottom,
                        color=colour,
                        label=label if (h, b) == (0, 0) else None,
                        hatch=("", "//", "..")[h % 3],
                    )
                    bottom += row[key]
                axis.text(x, bottom, head, ha="center", va="bottom", fontsize=6, rotation=90)
        axis.set(
            title=f"context {context} tokens",
            xlabel="block size γ",
            ylabel="ms per round",
            xticks=range(len(blocks)),
            xticklabels=[str(b) for b in blocks],
        )
        axis.legend(fontsize=7, loc="upper left")
    return save_figure(fig, path)
