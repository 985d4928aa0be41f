"""`main(argv)`: the command line of DSpark Lab (`python experiments/run.py [sweep=NAME] [key=value ...]`).

It parses and dispatches: one experiment (`dspark.stages.experiment`) or a whole sweep (`dspark.sweeps.driver`).
Exit codes: 0 success, 1 the run failed (the MLflow run is marked FAILED), 2 bad configuration (nothing ran).
"""
from __future__ import annotations

import logging
import sys

from dspark.config import ConfigError, resolve_config
from dspark.stages.experiment import preflight, run_experiment


def main(argv: list[str] | None = None) -> int:
    """Resolve the config, then run one experiment or a whole sweep."""
    _setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rc = resolve_config(argv)
        preflight(rc)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if rc.cfg.sweep:
        from dspark.sweeps.driver import run_sweep

        return run_sweep(rc)
    return run_experiment(rc)


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
    logging.getLogger("lightning.pytorch").propagate = False  # Lightning prints its own lines
    for noisy in ("mlflow", "alembic", "urllib3", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
