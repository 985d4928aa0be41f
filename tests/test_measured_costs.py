"""Round costs re-measured while decoding (`dspark.scheduling.measured`, `decode.step_costs=measured`): measured
sizes replace the profile, untried sizes keep its shape at today's level, the overhead is an EMA added to every size,
and a misprofiled staircase stops steering the scheduler to the dearest ℓ once the rounds have paid for it."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.decoding import SpeculativeEngine, build_policy, build_proposer
from dspark.drafters.factory import DrafterSpec, build_drafter
from dspark.scheduling import SPSTable
from dspark.scheduling.measured import MeasuredRoundCosts
from dspark.scheduling.scheduler import schedule_single

# The profile the Zen 3 benchmark read (1-3 tokens one cost, then a staircase), in seconds per forward.
PROFILE_SECONDS = [0.120, 0.120, 0.120, 0.127, 0.152, 0.156, 0.159, 0.159]
PROFILE = SPSTable(batch_tokens=list(range(1, 9)), steps_per_second=[1 / t for t in PROFILE_SECONDS])


def seconds(table: SPSTable) -> list[float]:
    return [1 / table(b) for b in range(1, 9)]


def test_before_any_round_the_table_is_the_profile():
    costs = MeasuredRoundCosts(PROFILE)
    assert seconds(costs.table()) == pytest.approx(PROFILE_SECONDS, rel=1e-12)
    assert costs.level() == 1.0 and costs.overhead is None


def test_a_size_measured_min_samples_times_is_priced_by_its_median_and_others_follow_todays_level():
    costs = MeasuredRoundCosts(PROFILE, min_samples=3)
    for verify in (0.250, 0.230, 0.240):  # B = 2 at twice the profile: the machine is twice as slow now
        costs.observe(2, verify, 0.0)
    table = seconds(costs.table())
    assert table[1] == pytest.approx(0.240)  # measured: the median of the three
    assert costs.level() == pytest.approx(2.0)
    assert table[0] == pytest.approx(0.240) and table[3] == pytest.approx(0.254)  # the profile's shape × 2
    costs2 = MeasuredRoundCosts(PROFILE, min_samples=3)
    costs2.observe(2, 0.240, 0.0)
    costs2.observe(2, 0.240, 0.0)  # two samples: not yet trusted
    assert seconds(costs2.table()) == pytest.approx(PROFILE_SECONDS)


def test_only_the_last_window_verify_times_count():
    costs = MeasuredRoundCosts(PROFILE, window=4, min_samples=1)
    for verify in (1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1):
        costs.observe(1, verify, 0.0)
    assert costs.measured()[1] == pytest.approx(0.1)  # median of [1.0, 0.1, 0.1, 0.1]


def test_a_size_not_chosen_for_stale_rounds_forgets_its_measurements_and_is_priced_afresh():
    """A few slow first rounds at B = 3 (first calls of a new shape) must not price it out for the rest of the run."""
    costs = MeasuredRoundCosts(PROFILE, min_samples=3, stale_rounds=10)
    for _ in range(3):
        costs.observe(3, 0.500, 0.0)  # slow outliers
    for _ in range(10):
        costs.observe(2, 0.120, 0.0)
    assert costs.measured()[3] == pytest.approx(0.500)  # 10 rounds since: still held
    costs.observe(2, 0.120, 0.0)
    assert 3 not in costs.measured() and costs.samples(3) == 0
    assert costs.verify_seconds(3) == pytest.approx(0.120)  # the profile's value at today's level (1.0 here)
    with pytest.raises(ValueError, match="stale_rounds"):
        MeasuredRoundCosts(PROFILE, stale_rounds=0)


def test_the_overhead_is_an_ema_added_to_every_size():
    costs = MeasuredRoundCosts(PROFILE, overhead_ema=0.2)
    costs.observe(1, 0.120, 0.020)
    assert costs.overhead == pytest.approx(0.020)
    costs.observe(1, 0.120, 0.030)
    assert costs.overhead == pytest.approx(0.8 * 0.020 + 0.2 * 0.030)
    table = seconds(costs.table())
    assert table[4] == pytest.approx(PROFILE_SECONDS[4] + costs.overhead)


def test_clock_glitches_are_ignored_and_bad_arguments_refused():
    costs = MeasuredRoundCosts(PROFILE, min_samples=1)
    for bad in (math.nan, math.inf, -1.0, 0.0):
        costs.observe(3, bad, bad)
    assert costs.measured() == {} and costs.overhead in (None, 0.0) and costs.rounds == 4
    with pytest.raises(ValueError, match="batch_tokens"):
        costs.observe(0, 0.1, 0.0)
    with pytest.raises(ValueError, match="min_samples"):
        MeasuredRoundCosts(PROFILE, window=2, min_samples=3)
    with pytest.raises(ValueError, match="overhead_ema"):
        MeasuredRoundCosts(PROFILE, overhead_ema=0.0)


def test_a_misprofiled_staircase_stops_steering_the_scheduler_to_the_dearest_length():
    """The Zen 3 case: the profile reads B = 1..3 as one cost, the rounds pay 114 / 141 / 124 ms for ℓ = 1 / 2 / 3
    and ~22 ms of drafting. On the profile, confidences (0.5, 0.35, …) choose ℓ = 2; once each size was paid for,
    the same confidences choose ℓ = 1, and the real round throughput agrees."""
    confidences = [0.5, 0.35, 0.3, 0.3, 0.3, 0.3, 0.3]
    rates = [PROFILE(b) for b in range(1, 9)]
    assert schedule_single(confidences, rates=rates) == 2
    costs = MeasuredRoundCosts(PROFILE)
    paid = {1: 0.115, 2: 0.114, 3: 0.141, 4: 0.124}
    for _ in range(3):
        for b, verify in paid.items():
            costs.observe(b, verify, 0.022)
    table = costs.table()
    chosen = schedule_single(confidences, rates=[table(b) for b in range(1, 9)])
    assert chosen == 1

    def real_throughput(ell):  # tokens per second of a round at ℓ with the costs really paid
        survival = [math.prod(confidences[:j]) for j in range(1, ell + 1)]
        return (1 + sum(survival)) / (paid[ell + 1] + 0.022)

    assert real_throughput(1) > real_throughput(2)


def test_the_engine_reprices_an_sps_policy_after_every_round_only_when_asked(tiny):
    spec = DrafterSpec(
        kind="dspark",
        head="markov",
        depth=1,
        block_size=3,
        markov_rank=8,
        feature_layers=tuple(tiny.feature_layer_ids),
        mask_token_id=tiny.mask_token_id,
        target_fingerprint=tiny.fingerprint,
    )
    torch.manual_seed(0)
    drafter = build_drafter(spec, tiny).eval()
    prompt = tiny.chat_prompt_ids("Hi")
    table = SPSTable(batch_tokens=[1, 2, 3, 4], steps_per_second=[10.0, 9.0, 8.0, 7.0])
    for step_costs, repriced in (("profile", False), ("measured", True)):
        policy = build_policy("scheduler", sps=table)
        engine = SpeculativeEngine(
            target=tiny,
            proposer=build_proposer(drafter),
            policy=policy,
            temperature=1.0,
            max_new_tokens=8,
            step_costs=step_costs,
        )
        result = engine.generate(prompt, generator=torch.Generator().manual_seed(0))
        assert (policy.sps is not table) == repriced
        if repriced:
            assert engine.round_costs.rounds == len(result.rounds)
            assert engine.round_costs.overhead > 0
        else:
            assert engine.round_costs is None
    static = SpeculativeEngine(
        target=tiny,
        proposer=build_proposer(drafter),
        policy=build_policy("static"),
        temperature=1.0,
        max_new_tokens=8,
        step_costs="measured",
    )
    assert static.round_costs is None  # no SPS table to re-price: the option does nothing
    with pytest.raises(ValueError, match="decode.step_costs"):
        SpeculativeEngine(
            target=tiny, proposer=None, policy=None, temperature=1.0, max_new_tokens=8, step_costs="online"
        )
