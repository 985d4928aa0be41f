"""Claims on a sweep's cells held in the tracking store, so that workers on several machines sharing one MLflow
server run each cell once (a file lock only reaches the processes of one machine).

A claim is a tag on the sweep's parent run, `claim.<cell index>` = `<worker id> <heartbeat unix seconds>`. MLflow has
no compare-and-swap, so a worker writes its claim, waits `settle` seconds and reads it back: it holds the cell only if
its own value survived (a racing worker's later write wins, and that worker sees its own value). While the cell runs,
a daemon thread renews the heartbeat every `beat` seconds; a claim whose heartbeat is older than `stale` seconds
belongs to a dead worker and may be taken over. Releasing deletes the tag.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

CLAIM_PREFIX = "claim."


def worker_id() -> str:
    """This process, unique across machines: host, pid and a random suffix."""
    import os

    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class StoreClaim:
    """The claim of one worker on one cell of one parent run (see the module docstring)."""

    client: Any  # an MlflowClient
    parent_id: str
    index: int
    worker: str
    beat: float = 30.0
    stale: float = 120.0
    settle: float = 0.5
    _thread: threading.Thread | None = field(default=None, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def tag(self) -> str:
        return f"{CLAIM_PREFIX}{self.index}"

    def holder(self) -> tuple[str, float] | None:
        """(worker, heartbeat) of the current claim, or None when the cell is unclaimed."""
        value = self.client.get_run(self.parent_id).data.tags.get(self.tag, "")
        worker, _, stamp = value.rpartition(" ")
        try:
            return (worker, float(stamp)) if worker else None
        except ValueError:
            return None

    def try_acquire(self) -> bool:
        """Claim the cell unless another live worker holds it; True when this worker holds it afterwards."""
        held = self.holder()
        if held is not None and held[0] != self.worker and time.time() - held[1] < self.stale:
            return False
        self._write()
        time.sleep(self.settle)
        held = self.holder()
        if held is None or held[0] != self.worker:
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name=f"claim-{self.index}", daemon=True)
        self._thread.start()
        return True

    def acquire(self, *, poll: float = 5.0) -> None:
        """Wait until the cell can be claimed (its holder finished or died)."""
        while not self.try_acquire():
            time.sleep(poll)

    def release(self) -> None:
        """Stop the heartbeat and delete the claim if it is still this worker's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.beat)
            self._thread = None
        held = self.holder()
        if held is not None and held[0] == self.worker:
            self.client.delete_tag(self.parent_id, self.tag)

    def _write(self) -> None:
        self.client.set_tag(self.parent_id, self.tag, f"{self.worker} {time.time():.3f}")

    def _renew(self) -> None:
        while not self._stop.wait(self.beat):
            try:
                self._write()
            except Exception:  # a transient server error: the next beat tries again; a long outage makes it stale
                continue


def oldest_run(runs: list[Any]) -> Any:
    """The run that started first (ties broken by run id): the one every racing worker agrees to keep."""
    return min(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))
