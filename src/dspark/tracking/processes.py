"""Which process a run belongs to, so that a plain run left RUNNING by a killed process is closed at the next start
(a sweep's cells are closed by its driver, which holds the cell's claim: `runs.close_stale`; a plain run has none).

Every run is tagged with its process: `process.host`, `process.pid`, `process.started` (the process's start time, so
that a reused pid is not taken for it) and `process.space` (the boot and the pid namespace, where that pid names that
process). A RUNNING plain run of the experiment is dead when it was started in this process space and its pid is gone,
a zombie, or another process; `close_dead_runs` marks it KILLED with a `process.closed` note.

A run from another machine, container or boot cannot be checked from here and is left alone (its own machine closes
it at its next start there): a live run is never closed.
"""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from typing import Any

from dspark.tracking.runs import ACTIVE, search_all, tag_filter
from dspark.tracking.store import TrackingStore

NOTE_TAG = "process.closed"


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def process_space() -> str:
    """Where a pid names one process: this boot and pid namespace (Linux), else the host name."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{boot} {namespace}" if boot and namespace else f"host {socket.gethostname()}"


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state first), [] where unknown."""
    return _read(f"/proc/{pid}/stat").rpartition(")")[2].split()


def process_started(pid: int) -> str:
    """The start time of process `pid` (clock ticks since boot), "" where unknown."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else ""


def process_tags() -> dict[str, str]:
    """The `process.*` tags of a run started by this process."""
    pid = os.getpid()
    return {
        "process.host": socket.gethostname(),
        "process.pid": str(pid),
        "process.started": process_started(pid),
        "process.space": process_space(),
    }


def is_alive(pid: int, *, started: str = "") -> bool:
    """Whether process `pid` of this process space still runs (and is the one that started at `started`, if
    given); True where it cannot be told."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    fields = _stat(pid)
    if fields and fields[0] == "Z":  # killed, not yet reaped by its parent
        return False
    now = process_started(pid)
    return not (started and now and now != started)


def _is_dead(run: Any, space: str) -> bool:
    tags = run.data.tags
    if tags.get("process.space") != space or "mlflow.parentRunId" in tags or "sweep.role" in tags:
        return False
    try:
        pid = int(tags.get("process.pid", ""))
    except ValueError:
        return False
    return pid != os.getpid() and not is_alive(pid, started=tags.get("process.started", ""))


def close_dead_runs(store: TrackingStore) -> list[str]:
    """Mark the plain runs of the store's experiment that a process of this process space left active and that is
    gone as KILLED, with a note saying so; returns their run ids."""
    space = process_space()
    closed = []
    for status in ACTIVE:  # MLflow's filter has no `or`
        runs = search_all(store, f"attributes.status = '{status}' and {tag_filter(**{'process.space': space})}")
        for run in (r for r in runs if _is_dead(r, space)):
            tags = run.data.tags
            stamp = datetime.datetime.now().isoformat(timespec="seconds")
            note = f"process {tags['process.pid']} on {tags.get('process.host', '?')} ended without closing the run"
            store.client.set_tag(run.info.run_id, NOTE_TAG, f"{note}; marked KILLED by a run started at {stamp}")
            store.finish(run.info.run_id, status="KILLED")
            closed.append(run.info.run_id)
    return closed
