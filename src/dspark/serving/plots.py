"""Serving figures (matplotlib's Agg canvas via `dspark.plotting.save_figure`, no pyplot state).

- `plot_frontier` (paper Fig. 7): per-user speed (tokens/s/user) against aggregate throughput (tokens/s), one line
  per policy through its concurrency levels, each point labelled with its R.
- `plot_budget` (paper Fig. 8): aggregate throughput (top panel) and the mean number of drafts verified per request
  per step ℓ (bottom panel) against concurrency R, one line per policy. The paper's budget counts the anchor too
  (MTP-1 = 2); ours is ℓ alone (MTP-1 = 1).

Real runs are solid lines with filled markers; simulated ones (`ServeSummary.simulated`) dashed with hollow markers
and "(simulated)" in the legend. Points with a non-finite value are left out.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure

from dspark.plotting import save_figure
from dspark.serving.records import ServeSummary


def policy_order() -> list[str]:
    """The policies in registration order (`decoding.policies.POLICIES`): a new policy gets its line and colour."""
    from dspark.decoding.policies import POLICIES

    return POLICIES.ordered()


def _series(summaries: Sequence[ServeSummary]) -> list[tuple[str, bool, list[ServeSummary]]]:
    """(policy, simulated, points ordered by R) for every policy and kind present, in a stable policy order."""
    order = policy_order()
    names = sorted({s.policy for s in summaries}, key=lambda n: (order.index(n) if n in order else len(order), n))
    series = []
    for name in names:
        for simulated in (False, True):
            points = sorted(
                (s for s in summaries if s.policy == name and s.simulated == simulated), key=lambda s: s.concurrency
            )
            if points:
                series.append((name, simulated, points))
    return series


def _colour(name: str, names: list[str]) -> str:
    return f"C{names.index(name) % 10}"


def _style(simulated: bool, colour: str) -> dict:
    return {
        "linestyle": "--" if simulated else "-",
        "marker": "o",
        "color": colour,
        "markerfacecolor": "none" if simulated else colour,
    }


def _label(name: str, simulated: bool) -> str:
    return f"{name} (simulated)" if simulated else name


def _finish(axis, *, xlabel: str, ylabel: str, title: str = "", legend: bool = True) -> None:
    axis.set(xlabel=xlabel, ylabel=ylabel, title=title)
    axis.grid(alpha=0.3)
    if legend and axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7)


def plot_frontier(summaries: Sequence[ServeSummary], path: str | Path, *, title: str = "") -> Path:
    """Fig. 7: per-user speed against throughput, one line per policy (and kind), points labelled R."""
    fig = Figure(figsize=(6.4, 4.8))
    axis = fig.subplots()
    series = _series(summaries)
    names = list(dict.fromkeys(name for name, _, _ in series))
    for name, simulated, points in series:
        points = [s for s in points if math.isfinite(s.throughput) and math.isfinite(s.user_speed)]
        if not points:
            continue
        xs, ys = [s.throughput for s in points], [s.user_speed for s in points]
        axis.plot(xs, ys, label=_label(name, simulated), **_style(simulated, _colour(name, names)))
        real_levels = {q.concurrency for q in summaries if q.policy == name and not q.simulated}
        for s in points:
            if simulated and s.concurrency in real_levels:
                continue  # the real point at this R carries the label
            axis.annotate(
                f"R={s.concurrency}",
                (s.throughput, s.user_speed),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=6,
                color=_colour(name, names),
            )
    _finish(
        axis,
        xlabel="aggregate throughput (tokens/s)",
        ylabel="per-user speed (tokens/s/user)",
        title=title or "Throughput–interactivity frontier",
    )
    return save_figure(fig, path, dpi=110)


def plot_budget(summaries: Sequence[ServeSummary], path: str | Path, *, title: str = "") -> Path:
    """Fig. 8: throughput and mean verified drafts per request against concurrency, one line per policy."""
    fig = Figure(figsize=(6.4, 6.4))
    top, bottom = fig.subplots(2, 1, sharex=True)
    series = _series(summaries)
    names = list(dict.fromkeys(name for name, _, _ in series))
    for axis, field in ((top, "throughput"), (bottom, "budget")):
        for name, simulated, points in series:
            points = [s for s in points if math.isfinite(getattr(s, field))]
            if points:
                axis.plot(
                    [s.concurrency for s in points],
                    [getattr(s, field) for s in points],
                    label=_label(name, simulated),
                    **_style(simulated, _colour(name, names)),
                )
    levels = sorted({s.concurrency for s in summaries if s.concurrency > 0})
    if levels and levels[-1] >= 8 * levels[0]:
        bottom.set_xscale("log", base=2)  # concurrency grids are usually geometric
        bottom.set_xticks(levels, [str(r) for r in levels])
    _finish(top, xlabel="", ylabel="aggregate throughput (tokens/s)", title=title or "Throughput and budget under load")
    _finish(
        bottom,
        xlabel="concurrent requests R",
        ylabel="drafts verified per request ℓ\n(paper's budget = ℓ + 1)",
        legend=False,
    )
    return save_figure(fig, path, dpi=110)
