"""The prefix scheduler (Algorithm 1), its unsafe full search (paper Appendix A) and the SPS(B) table."""
from __future__ import annotations

import json
import random

import pytest
import torch

from dspark.scheduling import (
    SPSTable,
    admit_top_k,
    async_capacity_schedule,
    expected_throughput,
    machine_fingerprint,
    plan_verification,
    profile_sps,
    schedule_verification,
)

UNSAFE = dict(early_stop=False, allow_unsafe_full_search=True)

# Paper Appendix A: vocabulary {A, B}, one request, γ = 2.
APPENDIX_SPS = SPSTable([1, 2, 3], [1.0, 0.5, 0.45])
P_TARGET = {"A": 0.7, "B": 0.3}
P_DRAFT = {"A": 0.5, "B": 0.5}
C2 = {"A": 0.9, "B": 0.0}  # c_2 depends on the sampled x_1 (through the Markov feature)


def _appendix_confidences(x1: str) -> torch.Tensor:
    return torch.tensor([[0.8, C2[x1]]])


def _p_first_is_a(x1: str, length: int) -> float:
    """Exact P(first committed token = A | x_1, ℓ), from the acceptance rule of METHOD §5."""
    if length == 0:
        return P_TARGET["A"]
    accept = min(1.0, P_TARGET[x1] / P_DRAFT[x1])
    residual = {v: max(0.0, P_TARGET[v] - P_DRAFT[v]) for v in "AB"}
    correction_a = residual["A"] / sum(residual.values())
    return accept * (x1 == "A") + (1 - accept) * correction_a


def _output_p_a(**kwargs) -> float:
    return sum(P_DRAFT[x1] * _p_first_is_a(x1, int(schedule_verification(
        _appendix_confidences(x1), sps=APPENDIX_SPS, **kwargs)[0])) for x1 in "AB")


def test_appendix_a_early_stop_is_exact():
    for x1 in "AB":
        assert schedule_verification(_appendix_confidences(x1), sps=APPENDIX_SPS).tolist() == [0]
    assert _output_p_a() == pytest.approx(0.7, abs=1e-12)


def test_appendix_a_full_search_is_biased():
    lengths = {x1: int(schedule_verification(_appendix_confidences(x1), sps=APPENDIX_SPS, **UNSAFE)[0])
               for x1 in "AB"}
    assert lengths == {"A": 2, "B": 0}
    assert _output_p_a(**UNSAFE) == pytest.approx(0.85, abs=1e-12)


def test_appendix_a_throughput_values():
    plan = plan_verification(_appendix_confidences("A"), sps=APPENDIX_SPS)
    assert plan.throughput.tolist() == pytest.approx([1.0, 0.9, 1.134])
    assert plan.num_admitted == 0
    conf_b = _appendix_confidences("B")
    assert plan_verification(conf_b, sps=APPENDIX_SPS).throughput.tolist() == pytest.approx([1.0, 0.9])
    assert expected_throughput(conf_b, torch.tensor([2]), sps=APPENDIX_SPS) == pytest.approx(0.81)
    assert expected_throughput(conf_b, torch.tensor([0]), sps=APPENDIX_SPS) == pytest.approx(1.0)


def test_unsafe_search_needs_explicit_flag():
    with pytest.raises(ValueError, match="Appendix A"):
        schedule_verification(_appendix_confidences("A"), sps=APPENDIX_SPS, early_stop=False)


def _reference_schedule(conf: list[list[float]], sps: SPSTable, early_stop: bool) -> list[int]:
    """Algorithm 1 written plainly: candidates, sort, admit one at a time."""
    num_requests = len(conf)
    candidates = []
    for r, row in enumerate(conf):
        survival = 1.0
        for j, c in enumerate(row, start=1):
            survival *= c
            if survival > 0:
                candidates.append((survival, j, r))
    candidates.sort(key=lambda cand: (-cand[0], cand[1], cand[2]))
    lengths, admitted_sum = [0] * num_requests, 0.0
    best, best_lengths = num_requests * sps(num_requests), [0] * num_requests
    for count, (survival, j, r) in enumerate(candidates, start=1):
        admitted_sum += survival
        lengths[r] = j
        theta = (num_requests + admitted_sum) * sps(num_requests + count)
        if theta > best:
            best, best_lengths = theta, list(lengths)
        elif early_stop:
            break
    return best_lengths


def _random_case(rng: random.Random) -> tuple[torch.Tensor, SPSTable]:
    num_requests, block = rng.randint(1, 6), rng.randint(1, 5)
    conf = [[rng.choice([0.0, 1.0, rng.random(), rng.random(), rng.random()]) for _ in range(block)]
            for _ in range(num_requests)]
    # Sizes sometimes stop short of R·(γ+1), so extrapolation is exercised too.
    sizes = sorted(rng.sample(range(1, num_requests * (block + 1) + 3), k=rng.randint(1, 4)))
    rates = sorted((rng.uniform(0.2, 1.0) for _ in sizes), reverse=rng.random() < 0.8)
    return torch.tensor(conf, dtype=torch.float64), SPSTable(sizes, rates)


@pytest.mark.parametrize("early_stop", [True, False])
def test_matches_plain_reference(early_stop):
    rng = random.Random(0)
    for _ in range(300):
        conf, sps = _random_case(rng)
        flags = dict(early_stop=early_stop, allow_unsafe_full_search=True)
        got = schedule_verification(conf, sps=sps, **flags).tolist()
        assert got == _reference_schedule(conf.tolist(), sps, early_stop)


def test_single_request_fast_path_takes_the_tensor_paths_decision():
    """R = 1 (the single-request engine's every round): plain floats, the same ℓ as Algorithm 1's tensor path, and
    the scheduler policy routes through it, capped by the drafts actually drafted."""
    from dspark.decoding.policies import build_policy
    from dspark.scheduling.scheduler import schedule_single

    rng = random.Random(2)
    for _ in range(3000):
        block = rng.randint(1, 15)
        conf = [[rng.choice([0.0, 1.0, 0.5, rng.random(), rng.random(), rng.random()]) for _ in range(block)]]
        sizes = sorted(rng.sample(range(1, block + 4), k=rng.randint(1, 4)))
        sps = SPSTable(sizes, sorted((rng.uniform(0.2, 1.0) for _ in sizes), reverse=rng.random() < 0.8))
        if rng.random() < 0.2:
            sps = SPSTable([1, 64], [1.0, 1.0])  # flat: ties between Θ values
        expected = int(schedule_verification(torch.tensor(conf, dtype=torch.float64), sps=sps)[0])
        rates = sps(torch.arange(1, block + 2, dtype=torch.float64)).tolist()
        assert schedule_single(conf[0], rates=rates) == expected
        drafted = rng.randint(0, block)
        policy = build_policy("scheduler", sps=sps)
        got = policy.choose(confidences=torch.tensor(conf), num_drafts=drafted)
        capped = torch.tensor([[c if j < drafted else 0.0 for j, c in enumerate(conf[0])]], dtype=torch.float64)
        assert got.tolist() == [min(drafted, int(schedule_verification(capped, sps=sps)[0]))]
    with pytest.raises(ValueError, match="calibrated per-slot probabilities"):
        schedule_single([0.5, 1.5], rates=[1.0, 1.0, 1.0])


def test_admitted_set_is_a_prefix_of_each_request_even_with_ties():
    rng = random.Random(1)
    flat = SPSTable([1, 64], [1.0, 1.0])
    for _ in range(200):
        conf = torch.tensor([[rng.choice([0.0, 0.5, 1.0, 1.0]) for _ in range(4)] for _ in range(5)])
        sps = flat if rng.random() < 0.5 else SPSTable([1, 8, 30], [1.0, 0.9, 0.4])
        plan = plan_verification(conf, sps=sps)
        admitted = set(zip(plan.requests[: plan.num_admitted].tolist(), plan.slots[: plan.num_admitted].tolist()))
        assert admitted == {(r, j) for r, ell in enumerate(plan.lengths.tolist()) for j in range(1, ell + 1)}
        survival = conf.double().cumprod(1)
        for r, ell in enumerate(plan.lengths.tolist()):
            assert bool((survival[r, :ell] > 0).all())


def test_zero_confidence_verifies_nothing_and_flat_sps_admits_all_positive():
    assert schedule_verification(torch.zeros(4, 3), sps=SPSTable([1, 16], [1.0, 0.1])).tolist() == [0, 0, 0, 0]
    conf = torch.tensor([[0.9, 0.2, 0.0, 0.7], [0.1, 0.1, 0.1, 0.1], [0.0, 1.0, 1.0, 1.0]])
    assert schedule_verification(conf, sps=SPSTable([1, 64], [2.0, 2.0])).tolist() == [2, 4, 0]


def test_decision_on_slot_k_ignores_later_slots():
    """Causality (why the early stop is lossless): whether (r, k) is verified may not depend on c_{r,j>k}."""
    rng = random.Random(2)
    sps = SPSTable([1, 4, 8, 16, 32], [1.0, 0.97, 0.9, 0.7, 0.4])
    for _ in range(200):
        conf = torch.rand(4, 5, generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))
        r, k = rng.randrange(4), rng.randint(1, 4)
        changed = conf.clone()
        changed[r, k:] = torch.rand(5 - k)
        for schedule in (lambda c: schedule_verification(c, sps=sps),
                         lambda c: async_capacity_schedule(conf, c, sps=sps)):
            assert (schedule(conf)[r] >= k) == (schedule(changed)[r] >= k)


def test_async_capacity_schedule():
    gen = torch.Generator().manual_seed(4)
    sps = SPSTable([1, 8, 16, 40], [1.0, 0.95, 0.8, 0.3])
    stale, current = torch.rand(6, 5, generator=gen), torch.rand(6, 5, generator=gen)
    full = schedule_verification(stale, sps=sps, **UNSAFE)
    # Same confidences: the top-K fill reproduces the full search it took K from.
    assert torch.equal(async_capacity_schedule(stale, stale, sps=sps), full)
    lengths = async_capacity_schedule(stale, current, sps=sps)
    assert int(lengths.sum()) == int(full.sum())
    assert torch.equal(lengths, admit_top_k(current, capacity=int(full.sum())))
    # Top-K by survival: everything admitted is at least as likely as everything left out.
    survival = current.double().cumprod(1)
    admitted = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)
    assert float(survival[admitted].min()) >= float(survival[~admitted].max())
    assert admit_top_k(torch.tensor([[0.5, 0.0]]), capacity=5).tolist() == [1]


def test_confidences_must_be_probabilities():
    with pytest.raises(ValueError, match="STS"):
        schedule_verification(torch.tensor([[1.2, 0.5]]), sps=APPENDIX_SPS)
    with pytest.raises(ValueError, match=r"\[R, γ\]"):
        schedule_verification(torch.tensor([0.5]), sps=APPENDIX_SPS)


def test_sps_interpolation_and_extrapolation():
    table = SPSTable([2, 4, 8], [10.0, 8.0, 5.0])
    assert table(2) == 10.0 and table(8) == 5.0
    assert table(3) == pytest.approx(9.0) and table(6) == pytest.approx(6.5)
    assert table(1) == 10.0  # clamped below
    # Above: step time grows by the last segment's seconds per token: (1/5 − 1/8)/4 per token.
    assert table(12) == pytest.approx(1.0 / (0.2 + 4 * (0.2 - 0.125) / 4))
    query = torch.tensor([1, 2, 3, 6, 8, 12, 100])
    assert table(query).tolist() == pytest.approx([table(int(b)) for b in query])
    assert SPSTable([4], [2.0])(8) == pytest.approx(1.0)  # one entry: time ∝ tokens
    with pytest.raises(ValueError, match="increasing"):
        SPSTable([4, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match="positive"):
        SPSTable([1, 2], [1.0, 0.0])


def test_sps_save_load_and_matching(tmp_path):
    table = SPSTable([1, 8], [20.0, 15.5], target_fingerprint="tiny-abc", machine=machine_fingerprint())
    path = table.save(tmp_path / "sps" / "table.json")
    assert json.loads(path.read_text())["batch_tokens"] == [1, 8]
    assert [p.name for p in path.parent.iterdir()] == ["table.json"]  # no temp file left behind
    loaded = SPSTable.load(path)
    assert loaded == table
    assert loaded.matches("tiny-abc", machine_fingerprint())
    assert not loaded.matches("other-target", machine_fingerprint())
    assert not loaded.matches("tiny-abc", "another machine")


def test_profile_sps_times_each_size():
    calls = []

    def forward(num_tokens: int) -> None:
        calls.append(num_tokens)
        torch.ones(num_tokens, 256).sum()

    table = profile_sps(forward, batch_tokens=[8, 1, 4], repeats=3, warmup=2, target_fingerprint="t")
    assert table.batch_tokens == [1, 4, 8]
    assert calls == [1] * 5 + [4] * 5 + [8] * 5
    assert all(rate > 0 for rate in table.steps_per_second)
    assert table.target_fingerprint == "t" and table.machine == machine_fingerprint()
