"""Sweep reports generated from the tracking store: runs → polars → tables (mean ± 95% CI, n) beside the paper's
numbers → markdown with a provenance header and PNG figures (`<paths.reports>/<sweep>.md`)."""

from dspark.reports.collect import SweepRuns, collect_sweep_runs, runs_frame
from dspark.reports.generate import NoFinishedRuns, build_report, write_sweep_report
from dspark.reports.writer import Provenance, Section, render_report

__all__ = [
    "NoFinishedRuns",
    "Provenance",
    "Section",
    "SweepRuns",
    "build_report",
    "collect_sweep_runs",
    "render_report",
    "runs_frame",
    "write_sweep_report",
]
