"""Ablation sweeps: `python experiments/run.py sweep=NAME` expands `sweeps/NAME.yaml` (a grid or an Optuna
search) into cells, runs them one by one under one MLflow parent run, resumes, and writes the report."""

from dspark.sweeps.spec import Cell, SweepSpec, load_sweep, parse_sweep

__all__ = ["Cell", "SweepSpec", "load_sweep", "parse_sweep", "run_sweep"]


def run_sweep(rc, *, max_cells=None):
    """See `dspark.sweeps.driver.run_sweep` (imported lazily: the driver pulls in MLflow)."""
    from dspark.sweeps.driver import run_sweep as _run

    return _run(rc, max_cells=max_cells)
