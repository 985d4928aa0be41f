"""Report figures (matplotlib's Agg canvas, no pyplot state): one PNG per call, one panel per domain.

Every point is a `Point`: anything with `ok`, `mean`, `low` and `high` — the report's judged intervals
(`claims.Pooled`, `claims.Difference`-derived gains: Student-t on the Satterthwaite df of their prompt and seed terms,
what the text judges) or a table cell's `stats.Estimate` (Student-t over runs) where no judged interval exists. A
point without a finite interval is drawn without a bar. `clip` bounds the bars (and points) of a bounded quantity,
(0, 1) for a probability: an interval that reaches below 0 is drawn to 0, never to −4. `references` marks the paper's
values, black stars labelled with their key (e.g. 'paper').

- `plot_lines`: series of (x, point) per panel, optional horizontal reference lines (τ against depth with the
  DFlash level, τ against proposal length γ+1, cond@k against position, ...).
- `plot_bars`: one bar per label per panel, with error bars (heads, calibration before/after).
- `plot_trials`: an Optuna search's objective per trial with the running best.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from matplotlib.figure import Figure

from dspark.plotting import save_figure


class Point(Protocol):
    @property
    def ok(self) -> bool: ...
    @property
    def mean(self) -> float: ...
    @property
    def low(self) -> float: ...
    @property
    def high(self) -> float: ...


Series = list[tuple[float, Point]]
Bounds = tuple[float, float] | None
#: {panel: {label: [(x, y), ...]}}: the paper's values, drawn as labelled markers
References = dict[str, dict[str, list[tuple[float, float]]]]


def _save(fig: Figure, path: Path) -> Path:
    return save_figure(fig, path, dpi=110)


def clipped(value: float, clip: Bounds) -> float:
    return value if clip is None else min(max(value, clip[0]), clip[1])


def error_bars(points: Sequence[Point], *, clip: Bounds = None) -> tuple[list[float], list[float], list[float]]:
    """(centres, lower lengths, upper lengths) of the points' intervals, clipped to `clip`; no interval: 0 lengths;
    a point that is not `ok` (no run): centre 0, no bar."""
    centres, below, above = [], [], []
    for p in points:
        if not p.ok:
            centres.append(0.0)
            below.append(0.0)
            above.append(0.0)
            continue
        centre = clipped(p.mean, clip)
        finite = math.isfinite(p.low) and math.isfinite(p.high)
        centres.append(centre)
        below.append(max(0.0, centre - clipped(p.low, clip)) if finite else 0.0)
        above.append(max(0.0, clipped(p.high, clip) - centre) if finite else 0.0)
    return centres, below, above


def _references(axis, marks: dict[str, list[tuple[float, float]]]) -> None:
    for index, (label, points) in enumerate(marks.items()):
        points = [(x, y) for x, y in points if y is not None and math.isfinite(y)]
        if points:
            xs, ys = zip(*points)
            marker = "*" if index == 0 else ("P", "X", "D")[index % 3]
            # above the legend (zorder 5): a paper value must never hide behind it
            axis.scatter(xs, ys, marker=marker, s=90, color="black", zorder=6, label=label)


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
    clip: Bounds = None,
    references: References | None = None,
) -> Path:
    """One panel per key of `panels`; in each, one line with error bars per series (module docstring: `clip`,
    `references`)."""
    fig, axes = _axes(len(panels))
    for axis, (panel, series) in zip(axes, panels.items()):
        for index, (label, points) in enumerate(series.items()):
            points = [(x, e) for x, e in points if e.ok]
            if not points:
                continue
            centres, below, above = error_bars([p[1] for p in points], clip=clip)
            axis.errorbar(
                [p[0] for p in points],
                centres,
                yerr=[below, above],
                marker="o",
                capsize=3,
                label=label,
                color=f"C{index}",
            )
        for index, (label, value) in enumerate((hlines or {}).get(panel, {}).items()):
            if value is not None and math.isfinite(value):
                axis.axhline(value, linestyle="--", color=f"C{index + len(series)}", label=label)
        _references(axis, (references or {}).get(panel, {}))
        if clip is not None:
            axis.set_ylim(clip[0] - 0.02 * (clip[1] - clip[0]), clip[1] + 0.02 * (clip[1] - clip[0]))
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
    panels: dict[str, dict[str, Point]],
    path: Path,
    *,
    ylabel: str,
    title: str = "",
    references: dict[str, dict[str, float]] | None = None,
    clip: Bounds = None,
) -> Path:
    """One panel per key; bars per label with error bars (the points' intervals, clipped to `clip`); optional
    reference markers labelled 'paper' ({panel: {bar label: the paper's value}})."""
    fig, axes = _axes(len(panels))
    for axis, (panel, bars) in zip(axes, panels.items()):
        labels = list(bars)
        centres, below, above = error_bars([bars[label] for label in labels], clip=clip)
        axis.bar(
            range(len(labels)),
            centres,
            yerr=[below, above],
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
        if clip is not None:
            axis.set_ylim(clip[0], clip[1] + 0.02 * (clip[1] - clip[0]))
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


@dataclass(frozen=True)
class Band:
    """A derived point with its interval (a relative gain's mean, low and high), for the figures."""

    mean: float
    low: float
    high: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.mean)
