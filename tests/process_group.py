"""Shared launcher of the two-process gloo tests (tests/test_loss_ddp.py, tests/test_metrics_ddp.py).

Workers start by `spawn`, never `fork`: a forked child inherits every lock the pytest process holds at that moment
(an OpenMP pool, a writer's buffer lock, a background thread's logging lock), and one held lock deadlocks the child
before it reaches the rendezvous. That hang is intermittent and silent — it once stopped CI at test 330 for the
rest of its 90 minutes. A spawned child starts from a fresh interpreter and rebuilds its inputs from files.

Every launch also has a deadline: on expiry each child still running first prints every thread's Python stack to
stderr (faulthandler on SIGUSR1, installed before the worker starts), then is killed, and the test fails naming the
ranks still running, instead of waiting forever in `join`. The stacks land in the test's captured stderr: a hang
says where it hung.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

import pytest
import torch.multiprocessing as mp

DEADLINE_S = 240.0  # two tiny ranks finish in ~15 s (spawn imports included) on a loaded 2-core machine
STACK_DUMP_WAIT_S = 3.0  # how long a hung child gets to print its stacks before it is killed


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous or a local server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _traced(rank: int, worker: Callable[..., None], *args) -> None:
    """The spawned entry point: dump every thread's stack on SIGUSR1 (the parent's deadline), then run the worker."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    worker(rank, *args)


def run_ranks(worker: Callable[..., None], args: tuple, world: int, deadline_s: float = DEADLINE_S) -> None:
    """Run `worker(rank, *args)` in `world` spawned processes; re-raise a worker's exception; fail on the deadline.

    `worker` must be a module-level function of an importable module (spawn pickles it by name) and `args` must
    pickle; anything else a worker needs it loads from files."""
    context = mp.start_processes(_traced, args=(worker, *args), nprocs=world, join=False, start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=max(0.1, min(5.0, end - time.monotonic()))):
            if time.monotonic() >= end:
                alive = [rank for rank, proc in enumerate(context.processes) if proc.is_alive()]
                _dump_stacks([context.processes[rank] for rank in alive])
                pytest.fail(f"gloo ranks {alive} still running after {deadline_s:.0f} s (killed): a worker hung")
    finally:
        for proc in context.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _dump_stacks(processes: list) -> None:
    """Ask each process for its threads' stacks (they print to the stderr pytest captures) and give them time to."""
    for proc in processes:
        try:
            os.kill(proc.pid, signal.SIGUSR1)
        except ProcessLookupError:  # it ended between the check and the signal
            continue
    time.sleep(STACK_DUMP_WAIT_S)
