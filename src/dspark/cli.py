"""`main(argv)`: the command line of DSpark Lab (`python experiments/run.py [sweep=NAME] [key=value ...]`).

It parses and dispatches: one experiment (`dspark.stages.experiment`) or a whole sweep (`dspark.sweeps.driver`).
Exit codes: 0 success, 1 the run failed (the MLflow run is marked FAILED), 2 bad configuration (nothing ran),
130 interrupted (Ctrl-C: the run is marked KILLED; the same command resumes).
"""

from __future__ import annotations

import logging
import sys

from dspark.config import ConfigError, resolve_config
from dspark.hardware import keep_freed_memory
from dspark.stages.experiment import RunInterrupted, preflight, run_experiment


def main(argv: list[str] | None = None) -> int:
    """Resolve the config, then run one experiment or a whole sweep."""
    _setup_logging()
    keep_freed_memory()  # before any tensor: large blocks are reused instead of page-faulted in every step
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            rc = resolve_config(argv)
            preflight(rc)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if rc.cfg.sweep:
            from dspark.sweeps.driver import run_sweep

            return run_sweep(rc)  # it reports its own interruptions (finished cells are kept)
        return run_experiment(rc)
    except RunInterrupted as err:
        print(
            f"interrupted: the run is marked KILLED (kept: {err.kept}). Rerun the same command to resume.",
            file=sys.stderr,
        )
        return 130
    except KeyboardInterrupt:
        print("interrupted before any run started; nothing to resume.", file=sys.stderr)
        return 130


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
        )
    logging.getLogger("lightning.pytorch").propagate = False  # Lightning prints its own lines
    for noisy in ("mlflow", "alembic", "urllib3", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
