"""Generate `<paths.reports>/<sweep>.md` (+ PNGs next to it) from the tracking store alone, attach it to the
sweep's parent run. The sweep driver says which parent (`dspark.sweeps.driver.report_sweep` is
`python experiments/run.py sweep=NAME stage=report`): reports know the run tree, not how sweeps are planned.
"""
from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark.config import ResolvedConfig
from dspark.files import atomic_write_text
from dspark.reports import ablations, diagnostics, search, serving  # noqa: F401  (register the builders)
from dspark.reports.collect import SweepRuns, collect_sweep_runs, runs_frame
from dspark.reports.context import REPORT_BUILDERS, ReportContext
from dspark.reports.writer import Provenance, Section, no_runs_section, render_report
from dspark.tracking.runs import COMPLETE_TAG, children

if TYPE_CHECKING:
    from dspark.tracking import TrackingStore

log = logging.getLogger("dspark")


def builder_name(spec: Any) -> str:
    if spec.kind == "optuna":
        return "optuna"
    return spec.report if spec.report in REPORT_BUILDERS else "generic"


def build_report(runs: SweepRuns, *, spec: Any, out_dir: Path, provenance: Provenance,
                 store: TrackingStore | None = None, name: str | None = None) -> tuple[str, list[Path]]:
    """Render the markdown of a sweep's runs; returns it and the figures written (all under `out_dir`)."""
    name = name or spec.name
    ctx = ReportContext(name=name, runs=runs, out_dir=Path(out_dir), paper_ref=spec.paper_ref,
                        description=spec.description, store=store, spec=spec)
    has_trials = spec.kind == "optuna" and runs.every_child is not None and runs.every_child.height > 0
    if runs.empty and not has_trials:
        sections: list[Section] = [no_runs_section(runs, name=name)]
    else:
        sections = REPORT_BUILDERS.resolve(builder_name(spec))(ctx)
        sections.append(Section("Runs", runs_summary(runs)))
    notes = Path(out_dir) / f"{name}.notes.md"
    if notes.is_file():  # hand-written findings about these runs, kept apart so regeneration never loses them
        sections.append(Section("Investigation notes", f"(from `{notes.name}`, written by hand)\n\n"
                                + notes.read_text().strip()))
    figures = sorted(Path(out_dir).glob(f"{name}-*.png"))
    note = runs.note if runs.note and "differs" in runs.note else ""
    text = render_report(name=name, description=spec.description, paper_ref=spec.paper_ref, provenance=provenance,
                         sections=sections, note=note)
    return text, [f for f in figures if f"]({f.name})" in text]


def runs_summary(runs: SweepRuns) -> str:
    counts = ", ".join(f"{k} {v}" for k, v in sorted(runs.status_counts.items()))
    return (f"{runs.frame.height} completed child runs (all children by status: {counts or 'none'}); "
            "incomplete or failed cells are left out of every table. Each table cell is the mean over the runs "
            "of one configuration (seeds are replicates) ± the 95% Student-t half-width, with n runs.")


def write_sweep_report(rc: ResolvedConfig, spec: Any, *, store: TrackingStore, parent_id: str | None = None,
                       sweep_hash: str | None = None, now: datetime.datetime | None = None) -> Path:
    """Collect (the given parent, else the parent of `sweep_hash`, else the newest), render, write, attach."""
    if parent_id is not None:
        runs = collect_parent(store, spec.name, parent_id)
    else:
        runs = collect_sweep_runs(store, sweep=spec.name, sweep_hash=sweep_hash)
    out_dir = Path(rc.cfg.paths.reports)
    out_dir.mkdir(parents=True, exist_ok=True)
    fallback = {"target": rc.cfg.target, "budget": rc.cfg.budget,
                "command": " ".join(["python experiments/run.py", *rc.argv])}
    provenance = Provenance.from_runs(runs, store=store, experiment=rc.cfg.tracking.experiment, now=now,
                                      fallback=fallback,
                                      selection_keys=spec.axis_keys() if spec.kind == "grid" else ())
    text, figures = build_report(runs, spec=spec, out_dir=out_dir, provenance=provenance, store=store)
    path = atomic_write_text(out_dir / f"{spec.name}.md", text, key="paths.reports")
    if runs.parent is not None:
        for item in [path, *figures]:
            store.client.log_artifact(runs.parent.info.run_id, str(item), artifact_path="report")
    return path


def collect_parent(store: TrackingStore, sweep: str, parent_id: str) -> SweepRuns:
    """The runs of a known parent (right after a sweep ran)."""

    parent = store.client.get_run(parent_id)
    kids = children(store, parent_id)
    counts: dict[str, int] = {}
    for run in kids:
        counts[run.info.status] = counts.get(run.info.status, 0) + 1
    done = [r for r in kids if r.info.status == "FINISHED" and r.data.tags.get(COMPLETE_TAG) == "true"]
    return SweepRuns(sweep=sweep, parent=parent, frame=runs_frame(done), status_counts=counts,
                     note=f"parent run {parent_id}", every_child=runs_frame(kids))
