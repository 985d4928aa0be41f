"""Generate `<paths.reports>/<sweep>.md` (+ PNGs and `<sweep>.claims.json` next to it) from the tracking store
alone, attach it to the sweep's parent run. The sweep driver says which parent and which of its runs are current
(`dspark.sweeps.driver.report_sweep` is `python experiments/run.py sweep=NAME stage=report`): reports know the run
tree, not how sweeps are planned. A sweep with no finished cell gets no report (`NoFinishedRuns`), so an existing
report is never replaced by an empty page; nor is a file we did not write: paths.reports must be new, empty or ours,
and `<sweep>.md` there one of our reports (`ForeignOutputError` otherwise, before any figure is drawn).
"""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark.config import ResolvedConfig
from dspark.files import atomic_write_text, check_output_file, claim_output_dir, is_our_markdown, is_report_entry
from dspark.reports import ablations, arms, confidence, diagnostics, search, sequential, serving, trees  # noqa: F401  (register the builders)
from dspark.reports.collect import SweepRuns, collect_sweep_runs, runs_frame
from dspark.reports.context import REPORT_BUILDERS, ReportContext
from dspark.reports.writer import Provenance, Section, render_report
from dspark.tracking.runs import COMPLETE_TAG, children
from dspark.tracking.ui import public_command

if TYPE_CHECKING:
    from dspark.tracking import TrackingStore

log = logging.getLogger("dspark")


class NoFinishedRuns(ValueError):
    """A sweep without a finished cell: nothing to report (the message names the sweep and the fix)."""


def builder_name(spec: Any) -> str:
    if spec.kind == "optuna":
        return "optuna"
    return spec.report if spec.report in REPORT_BUILDERS else "generic"


def build_report(
    runs: SweepRuns,
    *,
    spec: Any,
    out_dir: Path,
    provenance: Provenance,
    store: TrackingStore | None = None,
    name: str | None = None,
    drift: dict[str, list[str]] | None = None,
    notes_dir: Path | None = None,
) -> tuple[str, list[Path], ReportContext]:
    """Render the markdown of a sweep's runs; returns it, the figures written (all under `out_dir`) and the context
    (whose `claims` the builders filled). `drift`: cell → keys on which its run differs from today's recipe.

    NoFinishedRuns before anything is written; then `out_dir` is claimed (`claim_output_dir`) and `<name>.md` there
    must be missing or one of our reports, else ForeignOutputError before the first figure."""
    name = name or spec.name
    ctx = ReportContext(
        name=name,
        runs=runs,
        out_dir=Path(out_dir),
        paper_ref=spec.paper_ref,
        description=spec.description,
        store=store,
        spec=spec,
    )
    has_trials = spec.kind == "optuna" and runs.every_child is not None and runs.every_child.height > 0
    if runs.empty and not has_trials:
        raise NoFinishedRuns(no_runs_message(runs, name=name))
    claim_output_dir(out_dir, key="paths.reports", kind="reports", ours=is_report_entry)
    check_output_file(Path(out_dir) / f"{name}.md", key="paths.reports", ours=is_our_markdown)
    sections = REPORT_BUILDERS.resolve(builder_name(spec))(ctx)
    if drift:
        sections.append(Section("Recorded under an older recipe", drift_section(drift, name=name)))
    sections.append(Section("Runs", runs_summary(runs)))
    notes = Path(notes_dir) / "notes.md" if notes_dir else Path(out_dir) / f"{name}.notes.md"
    if notes.is_file():  # hand-written findings about these runs, kept apart so regeneration never loses them
        sections.append(
            Section("Investigation notes", f"(from `{notes.name}`, written by hand)\n\n" + notes.read_text().strip())
        )
    figures = sorted(Path(out_dir).glob(f"{name}-*.png"))
    note = runs.note if runs.note and "differs" in runs.note else ""
    text = render_report(
        name=name,
        description=spec.description,
        paper_ref=spec.paper_ref,
        provenance=provenance,
        sections=sections,
        note=note,
    )
    return text, [f for f in figures if f"]({f.name})" in text], ctx


def no_runs_message(runs: SweepRuns, *, name: str) -> str:
    """Why there is no report, and the command that makes one."""
    counts = ", ".join(f"{k} {v}" for k, v in sorted(runs.status_counts.items())) or "none"
    where = "its parent run" if runs.parent is not None else "no parent run of this sweep identity in this store"
    return (
        f"sweep `{name}` has no finished cell ({where}; child runs by status: {counts}); no report was written "
        f"and none was replaced. Run `python experiments/run.py sweep={name}` with the same budget and overrides "
        "(same paths.root / tracking.uri) first; it resumes any unfinished cells."
    )


def drift_section(drift: dict[str, list[str]], *, name: str) -> str:
    """The cells whose reported run was recorded under an older recipe, with the keys that differ."""
    rows = "\n".join(f"- `{cell}`: {', '.join(f'`{k}`' for k in keys)}" for cell, keys in sorted(drift.items()))
    return (
        f"{len(drift)} cell(s) shown here ran with a config that today's defaults resolve differently, on keys "
        f"their stages read (the sweep's identity is unchanged, so they are kept and reported):\n\n{rows}\n\n"
        f"Rerunning the sweep's command (`sweep={name}`, same budget and overrides) runs only these cells again."
    )


def runs_summary(runs: SweepRuns) -> str:
    counts = ", ".join(f"{k} {v}" for k, v in sorted(runs.status_counts.items()))
    return (
        f"{runs.frame.height} completed child runs (all children by status: {counts or 'none'}); "
        "incomplete or failed cells are left out of every table. Each table cell is the mean over the runs "
        "of one configuration (seeds are replicates) ± the 95% Student-t half-width, with n runs."
    )


def write_sweep_report(
    rc: ResolvedConfig,
    spec: Any,
    *,
    store: TrackingStore,
    parent_id: str | None = None,
    sweep_hash: str | None = None,
    now: datetime.datetime | None = None,
    run_ids: set[str] | None = None,
    drift: dict[str, list[str]] | None = None,
    attach: bool = True,
    notes_dir: Path | None = None,
) -> Path:
    """Collect (the given parent, else the parent of `sweep_hash`, else the newest), render, write, attach.

    `run_ids` limits the report to those children (each cell's current run); NoFinishedRuns when nothing is left,
    before anything is written. Also writes `<name>.claims.json` (the builders' judged claims, for results/INDEX.md).
    Hand-written notes are read from `notes_dir/notes.md` (a results/ folder) or else `<paths.reports>/<name>.notes.md`."""
    if parent_id is not None:
        runs = collect_parent(store, spec.name, parent_id, run_ids=run_ids)
    elif sweep_hash is not None and spec.kind == "grid":
        runs = SweepRuns(sweep=spec.name, parent=None, frame=runs_frame([]), note="no parent run of this sweep")
    else:
        runs = collect_sweep_runs(store, sweep=spec.name, sweep_hash=sweep_hash)
    out_dir = Path(rc.cfg.paths.reports)
    fallback = {
        "target": rc.cfg.target,
        "budget": rc.cfg.budget,
        "command": public_command(rc.argv),  # credentials masked, as in every run's command tag
    }
    provenance = Provenance.from_runs(
        runs,
        store=store,
        experiment=rc.cfg.tracking.experiment,
        now=now,
        fallback=fallback,
        selection_keys=spec.axis_keys() if spec.kind == "grid" else (),
    )
    text, figures, ctx = build_report(
        runs, spec=spec, out_dir=out_dir, provenance=provenance, store=store, drift=drift, notes_dir=notes_dir
    )
    path = atomic_write_text(out_dir / f"{spec.name}.md", text, key="paths.reports")
    claims = [c.to_dict() for c in getattr(ctx, "claims", [])]
    claims_path = atomic_write_text(
        out_dir / f"{spec.name}.claims.json",
        json.dumps(claims, indent=1, sort_keys=True, default=str) + "\n",
        key="paths.reports",
    )
    if attach and runs.parent is not None:
        from dspark.tracking.artifacts import log_report

        log_report(store, runs.parent.info.run_id, path, figures, artifact_path="report")
        store.client.log_artifact(runs.parent.info.run_id, str(claims_path), artifact_path="report")
        store.log_metrics(runs.parent.info.run_id, headline_metrics(claims))
    return path


def headline_metrics(claims: list[dict[str, Any]]) -> dict[str, float]:
    """The sweep's judged claims as metrics of its parent run (`claim/<id>/mean|low|high`), so the runs table
    shows a sweep's answers beside its cells'."""
    out = {}
    for claim in claims:
        for part in ("mean", "low", "high"):
            value = claim.get(part)
            if isinstance(value, (int, float)) and value == value:  # NaN and None stay out
                out[f"claim/{claim['id']}/{part}"] = float(value)
    return out


def collect_parent(store: TrackingStore, sweep: str, parent_id: str, *, run_ids: set[str] | None = None) -> SweepRuns:
    """The runs of a known parent (right after a sweep ran); `run_ids` keeps only those completed children (each
    cell's current run: a cell run again under today's recipe is not counted twice)."""

    parent = store.client.get_run(parent_id)
    kids = children(store, parent_id)
    counts: dict[str, int] = {}
    for run in kids:
        counts[run.info.status] = counts.get(run.info.status, 0) + 1
    done = [
        r
        for r in kids
        if r.info.status == "FINISHED"
        and r.data.tags.get(COMPLETE_TAG) == "true"
        and (run_ids is None or r.info.run_id in run_ids)
    ]
    return SweepRuns(
        sweep=sweep,
        parent=parent,
        frame=runs_frame(done),
        status_counts=counts,
        note=f"parent run {parent_id}",
        every_child=runs_frame(kids),
    )
