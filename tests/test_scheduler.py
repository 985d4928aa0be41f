"""The prefix scheduler (Algorithm 1), its unsafe full search (paper Appendix A) and the SPS(B) table."""

from __future__ import annotations

import itertools
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
    return sum(
        P_DRAFT[x1]
        * _p_first_is_a(x1, int(schedule_verification(_appendix_confidences(x1), sps=APPENDIX_SPS, **kwargs)[0]))
        for x1 in "AB"
    )


def test_appendix_a_early_stop_is_exact():
    for x1 in "AB":
        assert schedule_verification(_appendix_confidences(x1), sps=APPENDIX_SPS).tolist() == [0]
    assert _output_p_a() == pytest.approx(0.7, abs=1e-12)


def test_appendix_a_full_search_is_biased():
    lengths = {x1: int(schedule_verification(_appendix_confidences(x1), sps=APPENDIX_SPS, **UNSAFE)[0]) for x1 in "AB"}
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
    conf = [
        [rng.choice([0.0, 1.0, rng.random(), rng.random(), rng.random()]) for _ in range(block)]
        for _ in range(num_requests)
    ]
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
        for schedule in (
            lambda c: schedule_verification(c, sps=sps),
            lambda c: async_capacity_schedule(conf, c, sps=sps),
        ):
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
    assert calls == [1, 4, 8] * 5  # two warm-up rounds, then three timed ones, every size once per round
    assert all(rate > 0 for rate in table.steps_per_second)
    assert table.target_fingerprint == "t" and table.machine == machine_fingerprint()


def test_profile_sps_is_not_fooled_by_a_machine_that_slows_down_while_profiling():
    """Sizes cost 10 ms + 1 ms per token, and the machine gets 5% slower with every call: timed size by size the
    first size looks cheapest by far and the last dearest; interleaved, each size keeps its true order and the ratios
    stay near the true ones."""
    clock = {"now": 0.0, "calls": 0}

    def forward(num_tokens: int) -> None:
        clock["calls"] += 1
        clock["now"] += (10.0 + num_tokens) * 1.05 ** clock["calls"]

    import dspark.scheduling.sps as sps_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sps_module.time, "perf_counter", lambda: clock["now"] / 1e3)
        table = profile_sps(forward, batch_tokens=[1, 2, 4, 8], repeats=5, warmup=1)
    ms = dict(zip(table.batch_tokens, (1e3 / r for r in table.steps_per_second)))
    assert ms[1] < ms[2] < ms[4] < ms[8]
    true_ratio = (10.0 + 8) / (10.0 + 1)
    assert abs(ms[8] / ms[1] - true_ratio) / true_ratio < 0.2  # size by size: ~2.4x the true ratio (1.05^18)


# ---- the column planner for padded engines (plan_columns, columns_drafting_done) ----


def _reference_columns(conf: list[list[float]], sps: SPSTable, drafts: list[int]) -> int:
    """The column plan written plainly: k* of admitting whole columns while Θ(k) = E(k)·SPS(R·(k+1)) strictly
    improves (a column nobody can accept is refused), stopping at the first refusal."""
    num_requests, block = len(conf), len(conf[0])
    survival = []
    for row, drafted in zip(conf, drafts):
        product, values = 1.0, []
        for j, c in enumerate(row, start=1):
            product *= c
            values.append(product if j <= drafted else 0.0)
        survival.append(values)
    expected, best, admitted = float(num_requests), num_requests * sps(num_requests), 0
    for k in range(1, block + 1):
        mass = 0.0
        for r in range(num_requests):
            mass += survival[r][k - 1]
        expected += mass
        theta = expected * sps(num_requests * (k + 1))
        if not (mass > 0 and theta > best):
            break
        best, admitted = theta, k
    return admitted


def _staircase_table(rng: random.Random, size: int) -> SPSTable:
    """Flat stretches, then steps down (a CPU target's SPS(B)), sometimes a step up (profiling noise)."""
    times, current = [], 1.0
    for _ in range(size):
        if rng.random() < 0.3:
            current = max(0.05, current + rng.uniform(-0.2 if rng.random() < 0.2 else 0.0, 1.0))
        times.append(current)
    return SPSTable(list(range(1, size + 1)), [1 / t for t in times])


def _random_column_case(rng: random.Random) -> tuple[torch.Tensor, SPSTable, list[int] | None]:
    num_requests, block = rng.randint(1, 8), rng.randint(1, 7)
    power = rng.choice([0.3, 1.0, 2.0])
    conf = [
        [
            rng.choice([0.0, 1.0, rng.random() ** power, rng.random() ** power, rng.random() ** power])
            for _ in range(block)
        ]
        for _ in range(num_requests)
    ]
    if rng.random() < 0.5:
        sizes = sorted(rng.sample(range(1, num_requests * (block + 1) + 3), k=rng.randint(1, 5)))
        sps = SPSTable(sizes, sorted((rng.uniform(0.2, 1.0) for _ in sizes), reverse=rng.random() < 0.85))
    else:
        sps = _staircase_table(rng, num_requests * (block + 1))
    drafts = [rng.randint(0, block) for _ in range(num_requests)] if rng.random() < 0.5 else None
    return torch.tensor(conf, dtype=torch.float64), sps, drafts


def test_column_plan_matches_plain_reference():
    """Random R, γ, c̃ (zeros and ones included), monotone / staircase / noisy SPS tables and drafted-count caps:
    plan_columns' k* and ℓ_r = min(k*, n_r) equal the plain loop's; its trace is E(k), Θ(k) of every column."""
    from dspark.scheduling import plan_columns

    rng = random.Random(7)
    sizes = set()
    for _ in range(1000):
        conf, sps, drafts = _random_column_case(rng)
        num_requests, block = conf.shape
        caps = drafts if drafts is not None else [block] * num_requests
        plan = plan_columns(conf, sps=sps, num_drafts=None if drafts is None else torch.tensor(drafts))
        admitted = _reference_columns(conf.tolist(), sps, caps)
        assert plan.num_columns == admitted
        assert plan.lengths.tolist() == [min(admitted, n) for n in caps]
        assert plan.throughput.shape == (block + 1,) and plan.throughput[0] == pytest.approx(
            num_requests * sps(num_requests)
        )
        sizes.add(admitted)
    assert sizes >= {0, 1, 2, 3}, sizes  # the cases exercise refusals at several columns, not only k* = 0


def test_column_plan_ignores_every_column_after_the_first_refused_one():
    """Lossless early stop: whether column k is admitted depends on c̃_{·,≤k} only (c̃_{r,k+1} depends on the
    sampled x_{r,k}), so redrawing every column after k never changes it; the whole plan is a function of the
    columns up to and including the first refused one."""
    from dspark.scheduling import plan_columns

    rng = random.Random(8)
    for _ in range(600):
        conf, sps, drafts = _random_column_case(rng)
        num_requests, block = conf.shape
        counts = None if drafts is None else torch.tensor(drafts)
        plan = plan_columns(conf, sps=sps, num_drafts=counts)
        redrawn = conf.clone()
        decided = min(plan.num_columns + 1, block)  # the admitted columns and the first refused one
        redrawn[:, decided:] = torch.rand(num_requests, block - decided, dtype=torch.float64)
        again = plan_columns(redrawn, sps=sps, num_drafts=counts)
        assert again.num_columns == plan.num_columns and torch.equal(again.lengths, plan.lengths)
        k = rng.randint(1, block)
        later = conf.clone()
        later[:, k:] = torch.rand(num_requests, block - k, dtype=torch.float64)
        assert (plan_columns(later, sps=sps, num_drafts=counts).num_columns >= k) == (plan.num_columns >= k)


def test_a_full_search_over_columns_would_break_the_early_stop_property():
    """The property above can fail: the argmax of Θ(k) over all columns (looking past a drop) lets column 2 decide
    whether column 1 is verified — Appendix A's bias, one column per slot."""
    from dspark.scheduling import plan_columns

    sps = SPSTable([1, 2, 3], [1.0, 0.5, 0.45])

    def argmax_columns(conf):
        return int(torch.argmax(plan_columns(conf, sps=sps).throughput))

    assert argmax_columns(torch.tensor([[0.8, 0.9]])) == 2 and argmax_columns(torch.tensor([[0.8, 0.0]])) == 0
    assert plan_columns(torch.tensor([[0.8, 0.9]]), sps=sps).num_columns == 0  # the early stop refuses column 1
    assert plan_columns(torch.tensor([[0.8, 0.0]]), sps=sps).num_columns == 0


def test_columns_and_tokens_agree_with_one_request():
    """R = 1: a column is one candidate, so the column plan is Algorithm 1 (tensor path and float fast path), capped
    by the drafted count; and the scheduler policy's two cost models choose alike."""
    from dspark.decoding.policies import build_policy
    from dspark.scheduling import plan_columns
    from dspark.scheduling.scheduler import schedule_single

    rng = random.Random(9)
    for _ in range(800):
        block = rng.randint(1, 12)
        conf = [rng.choice([0.0, 1.0, 0.5, rng.random(), rng.random() ** 0.3, rng.random()]) for _ in range(block)]
        sps = _staircase_table(rng, block + 2) if rng.random() < 0.7 else SPSTable([1, 64], [1.0, 1.0])
        drafted = rng.randint(0, block)
        capped = torch.tensor([[c if j < drafted else 0.0 for j, c in enumerate(conf)]], dtype=torch.float64)
        tokens = int(schedule_verification(capped, sps=sps)[0])
        columns = plan_columns(torch.tensor([conf], dtype=torch.float64), sps=sps, num_drafts=torch.tensor([drafted]))
        assert columns.lengths.tolist() == [tokens]
        rates = sps(torch.arange(1, block + 2, dtype=torch.float64)).tolist()
        assert schedule_single(conf[:drafted], rates=rates) == tokens
        chosen = {
            cost: build_policy("scheduler", sps=sps, scheduler_cost=cost)
            .choose(confidences=torch.tensor([conf]), num_drafts=drafted)
            .tolist()
            for cost in ("tokens", "columns")
        }
        assert chosen == {"tokens": [tokens], "columns": [tokens]}


def test_columns_drafting_done_is_the_plan_over_the_known_columns():
    """Drafting stops before slot k exactly when the plan over the k known columns admits fewer than k; the first
    such k is k* + 1 of the full plan (never earlier, so no verified slot goes undrafted), and the stop fires."""
    from dspark.scheduling import columns_drafting_done, plan_columns

    rng = random.Random(10)
    fired = 0
    for _ in range(400):
        conf, sps, drafts = _random_column_case(rng)
        num_requests, block = conf.shape
        if drafts is not None:  # a row that stopped drafting reads c̃ = 0 from there on
            conf[torch.arange(block).unsqueeze(0) >= torch.tensor(drafts).unsqueeze(1)] = 0.0
        done = [columns_drafting_done(conf[:, :k], sps=sps) for k in range(1, block + 1)]
        assert done == [plan_columns(conf[:, :k], sps=sps).num_columns < k for k in range(1, block + 1)]
        full = plan_columns(conf, sps=sps, num_drafts=None if drafts is None else torch.tensor(drafts)).num_columns
        stop_at = next((k for k, stop in enumerate(done, start=1) if stop), None)
        assert stop_at == (full + 1 if full < block else None)
        fired += stop_at is not None and stop_at < block
    assert fired > 50
    assert not columns_drafting_done(torch.zeros(3, 0), sps=APPENDIX_SPS)  # nothing known yet: keep drafting


def test_column_plan_input_checks():
    from dspark.scheduling import plan_columns

    with pytest.raises(ValueError, match="STS"):
        plan_columns(torch.tensor([[1.2, 0.5]]), sps=APPENDIX_SPS)
    with pytest.raises(ValueError, match="num_drafts"):
        plan_columns(torch.tensor([[0.5, 0.5]]), sps=APPENDIX_SPS, num_drafts=torch.tensor([3]))
    with pytest.raises(ValueError, match="num_drafts"):
        plan_columns(torch.tensor([[0.5, 0.5]]), sps=APPENDIX_SPS, num_drafts=torch.tensor([1, 1]))
    assert plan_columns(torch.zeros(0, 3), sps=APPENDIX_SPS).lengths.tolist() == []


# ---- stop rules (decode.scheduler_stop / serve.scheduler_stop) ----


def _appendix_first_token_law(stop: str, verifier: str) -> tuple[float, dict[str, int]]:
    """Exact P(first committed token = A) under `stop` and `verifier`, and ℓ per x_1: x_1, x_2 ~ p_d enumerated,
    ℓ from the scheduler policy on c = (0.8, c_2(x_1)), the verifier's outcome law from its cells
    (tests/test_block_verify.py `round_law`: the real batched verifier, every uniform cell enumerated)."""
    from collections import defaultdict

    from dspark.decoding.policies import build_policy
    from dspark.decoding.verify import VERIFIERS
    from test_block_verify import TinyModel, round_law

    tokens = "AB"
    p_t = torch.tensor([P_TARGET[v] for v in tokens], dtype=torch.float64)
    p_d = torch.tensor([P_DRAFT[v] for v in tokens], dtype=torch.float64)
    model = TinyModel(target=defaultdict(lambda: p_t), draft=defaultdict(lambda: p_d), confidence={})
    policy = build_policy("scheduler", sps=APPENDIX_SPS, scheduler_stop=stop)
    total, lengths = 0.0, {}
    for x1, x2 in itertools.product(range(2), repeat=2):
        length = int(policy.choose(confidences=_appendix_confidences(tokens[x1]), num_drafts=2)[0])
        lengths[tokens[x1]] = length
        law = round_law(model, (x1, x2), length, VERIFIERS.resolve(verifier).batched)
        total += P_DRAFT[tokens[x1]] * P_DRAFT[tokens[x2]] * sum(p for k, p in law.items() if k[0] == 0)
    return total, lengths


@pytest.mark.parametrize("verifier", ["token", "block"])
@pytest.mark.parametrize(
    ("stop", "expected", "lengths"),
    [("first_non_improvement", 0.7, {"A": 0, "B": 0}), ("global_argmax", 0.85, {"A": 2, "B": 0})],
)
def test_appendix_a_stop_rules_by_exact_enumeration(stop, expected, lengths, verifier):
    """Paper Appendix A through the policies and the verifiers: Algorithm 1's stop commits A with p_t(A) = 0.7
    (lossless); the global argmax (TensorRT-LLM's variant) verifies x_1 only when x_1 = A made c_2 high, and commits
    A with 0.85 — biased, with token and block verification alike. The second case is the control: the same exact
    test detects a biased stop rule."""
    from dspark.decoding.policies import build_policy

    got, chosen = _appendix_first_token_law(stop, verifier)
    assert chosen == lengths
    assert got == pytest.approx(expected, abs=1e-12)
    assert build_policy("scheduler", sps=APPENDIX_SPS, scheduler_stop=stop).lossless == (expected == 0.7)


def test_global_argmax_paths_agree_and_search_the_whole_staircase():
    """R = 1 fast path, the tensor path (R > 1 through the policy) and whole columns at R = 1 take the same
    global-argmax decision, Algorithm 1's written plainly without the early stop; it never stops drafting early."""
    from dspark.decoding.policies import build_policy
    from dspark.scheduling import plan_columns
    from dspark.scheduling.scheduler import schedule_single

    rng = random.Random(4)
    differs = 0
    for _ in range(300):
        conf, sps = _random_case(rng)
        reference = _reference_schedule(conf.tolist(), sps, early_stop=False)
        policy = build_policy("scheduler", sps=sps, scheduler_stop="global_argmax")
        got = policy.choose(confidences=conf, num_drafts=torch.full((conf.shape[0],), conf.shape[1])).tolist()
        assert got == reference
        row = conf[:1]
        rates = [float(sps(b)) for b in range(1, conf.shape[1] + 2)]
        single = schedule_single(row[0].tolist(), rates=rates, stop="global_argmax")
        assert single == _reference_schedule(row.tolist(), sps, early_stop=False)[0]
        assert plan_columns(row, sps=sps, stop="global_argmax").num_columns == single
        differs += reference != _reference_schedule(conf.tolist(), sps, early_stop=True)
        assert not policy.stop_drafting(row[0, :1])
    assert differs > 0  # some cases do reach past a first non-improvement (5 of these 300)


def test_stop_rule_names_are_checked_where_they_are_read():
    from dspark.config import resolve_config
    from dspark.config.loader import ConfigError
    from dspark.config.schema import SCHEDULER_STOPS
    from dspark.decoding.policies import build_policy
    from dspark.scheduling.scheduler import FIRST_NON_IMPROVEMENT, GLOBAL_ARGMAX

    assert (FIRST_NON_IMPROVEMENT, GLOBAL_ARGMAX) == SCHEDULER_STOPS
    with pytest.raises(ValueError, match=r"serve\.scheduler_stop='argmax'.*first_non_improvement"):
        build_policy("fixed", key="serve", scheduler_stop="argmax")
    with pytest.raises(ConfigError, match=r"decode\.scheduler_stop"):
        resolve_config(["decode.scheduler_stop=best"])
    cfg = resolve_config(["decode.scheduler_stop=global_argmax", "serve.scheduler_stop=global_argmax"]).cfg
    assert cfg.decode.scheduler_stop == cfg.serve.scheduler_stop == GLOBAL_ARGMAX  # allowed for study (flagged lossy)
