"""Report figures (matplotlib's Agg canvas, no pyplot state): one PNG per call, one panel per domain.

- `plot_lines`: series of (x, mean ± 95% half-width) per panel, optional horizontal reference lines
  (τ against depth with the DFlash level, τ against proposal length γ+1, cond@k against position, ...).
- `plot_bars`: one bar per label per panel, with error bars (heads, calibration before/after).
- `plot_trials`: an Optuna search's objective per trial with the running best.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure

from dspark.plotting import save_figure
from dspark.reports.stats import Estimate

Series = list[tuple[float, Estimate]]


def _save(fig: Figure, path: Path) -> Path:
    return save_figure(fig, path, dpi=110)


def _err(values: Sequence[Estimate]) -> list[float]:
    return [e.half_width if e.n >= 2 and math.isfinite(e.half_width) else 0.0 for e in values]


def _axes(count: int, *, width: float = 4.2, height: float = 3.6):
    fig = Figure(figsize=(width * max(1, count), height))
    return fig, fig.subplots(1, max(1, count), squeeze=False)[0]


def plot_lines(
    panels: dict[str, dict[str, Series]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    hlines: dict[str, dict[str, float]] | None = None,
    xticks: Sequence[float] | None = None,
) -> Path:
    """One panel per key of `panels`; in each, one line with error bars per series."""
    fig, axes = _axes(len(panels))
    for axis, (panel, series) in zip(axes, panels.items()):
        for index, (label, points) in enumerate(series.items()):
            points = [(x, e) for x, e in points if e.ok]
            if not points:
                continue
            xs, est = [p[0] for p in points], [p[1] for p in points]
            axis.errorbar(
                xs, [e.mean for e in est], yerr=_err(est), marker="o", capsize=3, label=label, color=f"C{index}"
            )
        for index, (label, value) in enumerate((hlines or {}).get(panel, {}).items()):
            if value is not None and math.isfinite(value):
                axis.axhline(value, linestyle="--", color=f"C{index + len(series)}", label=label)
        axis.set(xlabel=xlabel, ylabel=ylabel, title=panel)
        if xticks is not None:
            axis.set_xticks(list(xticks))
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_bars(
    panels: dict[str, dict[str, Estimate]],
    path: Path,
    *,
    ylabel: str,
    title: str = "",
    references: dict[str, dict[str, float]] | None = None,
) -> Path:
    """One panel per key; bars per label with error bars; optional reference markers (e.g. the paper's)."""
    fig, axes = _axes(len(panels))
    for axis, (panel, bars) in zip(axes, panels.items()):
        labels = list(bars)
        est = [bars[label] for label in labels]
        axis.bar(
            range(len(labels)),
            [e.mean if e.ok else 0.0 for e in est],
            yerr=_err(est),
            capsize=3,
            color=[f"C{i}" for i in range(len(labels))],
        )
        refs = (references or {}).get(panel, {})
        ref_x = [i for i, label in enumerate(labels) if label in refs]
        if ref_x:
            axis.scatter(
                ref_x, [refs[labels[i]] for i in ref_x], marker="*", s=80, color="black", zorder=3, label="paper"
            )
            axis.legend(fontsize=7)
        axis.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
        axis.set(ylabel=ylabel, title=panel)
        axis.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_trials(
    trials: Sequence[tuple[int, float, bool]], path: Path, *, ylabel: str, maximize: bool, title: str = ""
) -> Path:
    """(trial number, objective, is the paper's default) per completed trial, with the best-so-far line."""
    fig, (axis,) = _axes(1, width=6.0)
    ordered = sorted(trials)
    xs, ys = [t[0] for t in ordered], [t[1] for t in ordered]
    axis.scatter(xs, ys, color="C0", label="trial")
    defaults = [(t[0], t[1]) for t in ordered if t[2]]
    if defaults:
        axis.scatter(*zip(*defaults), marker="*", s=120, color="C3", label="paper defaults", zorder=3)
    best, running = [], None
    for y in ys:
        running = y if running is None else (max(running, y) if maximize else min(running, y))
        best.append(running)
    axis.step(xs, best, where="post", color="C1", label="best so far")
    axis.set(xlabel="trial", ylabel=ylabel, title=title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return _save(fig, path)
