"""CPU and memory use of a run in MLflow (`system/*` metrics), where `tracking.system_metrics` is on.

MLflow's `SystemMetricsMonitor` samples psutil (CPU utilisation, system memory, disk, network; a GPU's where pynvml
is installed) on a daemon thread every `SAMPLING_INTERVAL_S` and logs each sample as one step. Our runs are created
by the client, not by `mlflow.start_run`, so the fluent switch (`mlflow.enable_system_metrics_logging`) would never
see them: the monitor is started on the run's id here. Two additions to MLflow's loop: the CPU counter is primed at
the start (psutil's first `cpu_percent()` reads 0.0), and a last sample is logged when the run ends (MLflow's loop
drops the samples of an unfinished interval, so a run shorter than one interval logged nothing). The thread waits on
an event, so stopping it takes one store call, not an interval (measured in tests/test_lineage.py).
`MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL` (seconds) overrides the interval, as in MLflow.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dspark.config.secrets import mask_text

log = logging.getLogger("dspark")
#: seconds between samples: a sweep cell of minutes gets tens of points; each costs a few psutil reads and one
#: store read (is the run still RUNNING?), nothing a run would notice
SAMPLING_INTERVAL_S = 10.0


@contextmanager
def system_metrics(store: Any, run_id: str | None, *, enabled: bool) -> Iterator[None]:
    """Log `system/*` metrics to the run while the block runs (nothing when not `enabled` or without a store)."""
    monitor = _start(store.uri, run_id) if enabled and store is not None and run_id else None
    try:
        yield
    finally:
        if monitor is not None:
            _stop(monitor)


def _start(uri: str, run_id: str) -> Any:
    try:
        import psutil
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    except ImportError as err:  # psutil is a dependency (pyproject); a broken environment still runs
        log.warning("system metrics are off: %s (pip install psutil)", err)
        return None
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # no "started/stopped" lines per run
    psutil.cpu_percent()  # primes the counter: the first sample is the CPU use since now, not 0
    monitor = SystemMetricsMonitor(run_id, sampling_interval=SAMPLING_INTERVAL_S, tracking_uri=uri)
    monitor.start()
    return monitor


def _stop(monitor: Any) -> None:
    """Stop the thread, then log what it sampled since its last step plus a final sample, as one last step."""
    try:
        monitor.finish()
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()
    except Exception as err:  # noqa: BLE001 — a record of the run, never its failure
        log.warning("could not log the last system metrics: %s", mask_text(str(err)))
