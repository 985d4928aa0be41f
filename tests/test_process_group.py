"""The gloo-test launcher (tests/process_group.py) fails a hung worker on its deadline and re-raises a worker's error:
a hang must cost one failed test, not the whole CI run."""

from __future__ import annotations

import time

import pytest
from process_group import run_ranks
from torch.multiprocessing import ProcessRaisedException


def _sleep_on_rank_one(rank: int) -> None:
    if rank == 1:
        time.sleep(600)


def _raise_on_rank_zero(rank: int) -> None:
    if rank == 0:
        raise ValueError("rank zero broke")


def test_a_hung_rank_fails_the_test_at_the_deadline_and_prints_where_it_hung(capfd):
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[1\] still running"):
        run_ranks(_sleep_on_rank_one, args=(), world=2, deadline_s=8.0)
    assert time.monotonic() - start < 60  # killed, not waited for
    stderr = capfd.readouterr().err
    assert "in _sleep_on_rank_one" in stderr, stderr  # faulthandler's frame line of the hung worker


def test_a_worker_error_is_raised_in_the_parent():
    with pytest.raises(ProcessRaisedException, match="rank zero broke"):
        run_ranks(_raise_on_rank_zero, args=(), world=2)
