"""dspark.metrics under real DDP: 2 CPU processes on gloo, each on its own uneven shard, must compute exactly the
single-process value on all data (METHOD §8: sums are all-reduced before any ratio is taken)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from process_group import free_port, run_ranks

from dspark.metrics import CumulativeCalibration, PositionCrossEntropy, RolloutAcceptance, TeacherForcedAcceptance

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # two gloo processes: the slow tier (make test-all)

GAMMA = 4
WORLD = 2
CUTS = {"blocks": 13, "cal": 70, "rounds": 180}  # rank 0 takes rows [:cut], rank 1 the rest: uneven on purpose


def make_data() -> dict:
    """All data, identical in every process (fixed seed); padded slots hold NaN."""
    gen = torch.Generator().manual_seed(1234)
    lengths = torch.randint(0, GAMMA + 1, (40, 6), generator=gen)
    valid = torch.arange(GAMMA) < lengths.unsqueeze(-1)
    c_star = torch.rand(40, 6, GAMMA, generator=gen).masked_fill(~valid, float("nan"))
    conf = torch.rand(200, GAMMA, generator=gen) * 0.5 + 0.5
    accepted = torch.rand(200, GAMMA, generator=gen) < conf
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    ell = torch.randint(0, GAMMA + 1, (250,), generator=gen)
    acc = (torch.rand(250, generator=gen) * (ell + 1)).long().clamp(max=ell)
    return {
        "blocks": (c_star, valid),
        "cal": (
            conf,
            torch.arange(1, GAMMA + 1) <= num_accepted.unsqueeze(-1),
            torch.ones(200, GAMMA, dtype=torch.bool),
        ),
        "rounds": (ell, acc, acc + 1),
    }


def shard(data: dict, rank: int | None) -> dict:
    """Rank's rows of every tensor (rank None: everything)."""
    if rank is None:
        return data
    pick = (lambda t, cut: t[:cut]) if rank == 0 else (lambda t, cut: t[cut:])
    return {key: tuple(pick(t, CUTS[key]) for t in tensors) for key, tensors in data.items()}


def compute_all(data: dict, **metric_kwargs) -> dict[str, torch.Tensor]:
    """Update every metric on `data`; return their computed values (and the reliability table), keys prefixed."""
    c_star, valid = data["blocks"]
    conf, event, cal_valid = data["cal"]
    ell, acc, tau = data["rounds"]
    acceptance, ce = TeacherForcedAcceptance(GAMMA, **metric_kwargs), PositionCrossEntropy(GAMMA, **metric_kwargs)
    calibration, rollout = CumulativeCalibration(GAMMA, **metric_kwargs), RolloutAcceptance(GAMMA, **metric_kwargs)
    acceptance.update(c_star, valid)
    ce.update(c_star * 2, valid)
    calibration.update(conf, event, cal_valid)
    rollout.update(num_verified=ell, num_accepted=acc, committed=tau)
    out = {}
    for name, metric in (("tf", acceptance), ("ce", ce), ("cal", calibration), ("roll", rollout)):
        out.update({f"{name}:{key}": value for key, value in metric.compute().items()})
    out["cal:reliability_count"] = calibration.reliability().count
    out["local:rounds"] = rollout.rounds.clone()  # after compute() the local (unsynced) state is restored
    return out


def assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, atol=1e-12, rtol=0, equal_nan=True, msg=key)


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    data = make_data()
    single = compute_all(data, sync_on_compute=False)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        synced = compute_all(shard(data, rank))
        dist.barrier()  # nobody tears down (rank 0 hosts the rendezvous store) while another rank still talks
    finally:
        dist.destroy_process_group()
    local_rounds = synced.pop("local:rounds")
    single.pop("local:rounds")
    assert_same(synced, single)  # raises in the worker → mp.spawn re-raises in the parent
    torch.save({"values": synced, "local_rounds": local_rounds}, Path(out_dir) / f"rank{rank}.pt")


def test_metrics_are_exact_under_two_process_gloo(tmp_path):
    run_ranks(_worker, args=(free_port(), str(tmp_path)), world=WORLD)  # spawned: see tests/process_group.py
    expected = compute_all(make_data())
    total_rounds = expected.pop("local:rounds")
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]
    for result in results:
        assert_same(result["values"], expected)
    # each rank really held only its shard (so the agreement above came from the all-reduce)
    local = [int(result["local_rounds"]) for result in results]
    assert local == [CUTS["rounds"], int(total_rounds) - CUTS["rounds"]]
