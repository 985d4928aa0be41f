"""Report of an Optuna search (`loss_weights`, `rank`): every trial, the best parameters, importances, and the
paper's defaults (always enqueued as a trial) against the best trial found.
"""

from __future__ import annotations

import json
import math

import polars as pl

from dspark.reports.context import REPORT_BUILDERS, ReportContext
from dspark.reports.plots import plot_trials
from dspark.markdown import markdown_table, num, pct
from dspark.reports.writer import Section

OBJECTIVE = "optuna/objective"


def _trials(ctx: ReportContext) -> pl.DataFrame:
    frame = ctx.runs.every_child if ctx.runs.every_child is not None else ctx.frame
    if "optuna.trial" not in frame.columns:
        return frame.head(0)
    return frame.filter(pl.col("optuna.trial").is_not_null()).sort("optuna.trial")


def _value(row: dict, column: str) -> float | None:
    value = row.get(column)
    return float(value) if value is not None and math.isfinite(float(value)) else None


def _param(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def trials_table(trials: pl.DataFrame, params: list[str]) -> str:
    """One row per trial: state, params, objective and the run's τ metrics."""
    header = ["trial", "state", *[p[5:] for p in params], "objective", "summary/tau", "val/tau_prob", "paper defaults"]
    rows = []
    for row in trials.iter_rows(named=True):
        state = row.get("optuna.state") or row.get("status")
        rows.append(
            [
                str(row["optuna.trial"]),
                str(state),
                *[_param(row.get(p)) for p in params],
                num(_value(row, OBJECTIVE), 3),
                num(_value(row, "summary/tau"), 3),
                num(_value(row, "val/tau_prob"), 3),
                "★" if row.get("optuna.defaults") == "true" else "",
            ]
        )
    return markdown_table(header, rows)


def best_lines(ctx: ReportContext, trials: pl.DataFrame, maximize: bool) -> list[str]:
    """Best trial, paper defaults against it, and parameter importances (from the parent run)."""
    lines = []
    best_params = ctx.runs.parent_tag("optuna.best_params", "")
    best_value = ctx.runs.parent_metric("best/value")
    if best_params:
        params = ", ".join(f"{k}={_param(v)}" for k, v in json.loads(best_params).items())
        lines.append(
            f"Best trial {num(ctx.runs.parent_metric('best/trial'), 0)}: {params} → objective {num(best_value, 3)}."
        )
    defaults = [
        r
        for r in trials.iter_rows(named=True)
        if r.get("optuna.defaults") == "true" and _value(r, OBJECTIVE) is not None
    ]
    if defaults and best_value is not None:
        value = _value(defaults[0], OBJECTIVE)
        gain = (best_value / value - 1.0) if value else float("nan")
        lines.append(
            f"Paper defaults (trial {defaults[0]['optuna.trial']}): objective {num(value, 3)}; best "
            f"trial {pct(gain if maximize else -gain)} {'above' if maximize else 'below'} it."
        )
    importances = {
        k.split("/", 1)[1]: v
        for k, v in (ctx.runs.parent.data.metrics.items() if ctx.runs.parent else [])
        if k.startswith("importance/")
    }
    if importances:
        ranked = sorted(importances.items(), key=lambda kv: -kv[1])
        lines.append(
            "Parameter importances (fANOVA, normalised): " + ", ".join(f"{k} {v:.2f}" for k, v in ranked) + "."
        )
    else:
        lines.append("Parameter importances need at least two completed trials with different parameters.")
    return lines


@REPORT_BUILDERS.register("optuna")
def build_optuna(ctx: ReportContext) -> list[Section]:
    """The report of an Optuna search."""
    trials = _trials(ctx)
    spec = ctx.spec.optuna if ctx.spec is not None else None
    maximize = spec is None or spec.direction == "maximize"
    params = [c for c in trials.columns if c.startswith("axis.")]
    objective = ", ".join(f"{k}: {v}" for k, v in spec.objective.items()) if spec else "objective"
    how = (
        f"Objective ({'maximised' if maximize else 'minimised'}): the trial run's metric by stage ({objective}); "
        f"study `{ctx.runs.parent_tag('optuna.study')}` in `{ctx.runs.parent_tag('optuna.storage')}`. Pruned "
        "trials stopped early on the validation metric (median rule); ★ = the paper's defaults, always enqueued."
    )
    sections = [Section("How to read", how), Section("Trials", trials_table(trials, params))]
    done = [
        (int(r["optuna.trial"]), _value(r, OBJECTIVE), r.get("optuna.defaults") == "true")
        for r in trials.iter_rows(named=True)
        if _value(r, OBJECTIVE) is not None
    ]
    if done:
        path = plot_trials(
            done, ctx.png("trials"), ylabel="objective", maximize=maximize, title=f"Optuna search {ctx.name}"
        )
        sections.append(Section("Search history", f"![trials]({path.name})"))
    sections.append(Section("Best parameters", "\n".join(best_lines(ctx, trials, maximize))))
    return sections
