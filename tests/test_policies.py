"""Verification policies (dspark.decoding.policies, METHOD §6) on hand-made confidence vectors, one request at a time
(R = 1, as the single-request engine calls them; tests/test_serving_policies.py covers R > 1)."""

from __future__ import annotations

import pytest
import torch

from dspark.calibration.sts import STSCalibration
from dspark.decoding.policies import (
    POLICIES,
    SchedulerPolicy,
    StaticPolicy,
    ThresholdPolicy,
    build_policy,
    calibrate_confidences,
    policy_confidences,
)
from dspark.scheduling import SPSTable

# SPS(B) = 1 / (1 + (B-1)/2): Θ_j = (1 + Σ_{i≤j} a_i) / (1 + j/2), so slot j is admitted while
# a_j > (1 + Σ_{i<j} a_i) / (2 + (j-1)) — for slot 1: a_1 > 0.5.
SPS = SPSTable(batch_tokens=list(range(1, 10)), steps_per_second=[1 / (1 + (b - 1) / 2) for b in range(1, 10)])


def conf(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def choose1(policy, confidences, num_drafts: int) -> int:
    """ℓ of one request through the batched contract ([1, γ] confidences, [1] counts → [1])."""
    batch = None if confidences is None else confidences.reshape(1, -1)
    lengths = policy.choose(confidences=batch, num_drafts=torch.tensor([num_drafts]))
    assert lengths.shape == (1,) and lengths.dtype == torch.long
    return int(lengths[0])


def test_fixed_verifies_everything_and_ignores_confidences():
    policy = build_policy("fixed")
    assert isinstance(policy, StaticPolicy) and policy.name == "fixed" and not policy.needs_confidences
    assert choose1(policy, None, 5) == 5
    assert choose1(policy, conf(0.0, 0.0), 2) == 2
    assert choose1(policy, None, 0) == 0


@pytest.mark.parametrize(
    ("values", "threshold", "expected"),
    [
        ((0.9, 0.8, 0.7, 0.95), 0.5, 4),  # all above: verify all
        ((0.9, 0.4, 0.99, 0.99), 0.5, 1),  # per-step, not cumulative: stops at the first dip even if later recover
        ((0.3, 0.9, 0.9), 0.5, 0),  # ℓ = 0 allowed: only the anchor is verified
        ((0.6, 0.6, 0.6), 0.5, 3),  # 0.6³ < 0.5 would stop a cumulative rule at slot 2; this rule does not
        ((0.5, 0.49), 0.5, 1),  # c_k = θ is kept (strictly below stops)
        ((0.0, 0.0), 0.0, 2),  # θ = 0 never stops
        ((0.99, 1.0), 1.0, 0),  # θ = 1 stops unless c = 1 exactly
    ],
)
def test_threshold_prefix_before_first_low_confidence(values, threshold, expected):
    policy = ThresholdPolicy(threshold)
    assert choose1(policy, conf(*values), len(values)) == expected


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_threshold_outside_unit_interval_raises(bad):
    with pytest.raises(ValueError, match=r"decode\.threshold.*\[0, 1\]"):
        build_policy("threshold", threshold=bad)


@pytest.mark.parametrize("name", ["threshold", "calibrated_threshold", "scheduler", "async"])
def test_confidence_policies_refuse_missing_confidences(name):
    policy = build_policy(name, threshold=0.5, sps=SPS)
    assert policy.needs_confidences
    with pytest.raises(ValueError, match="confidence head"):
        choose1(policy, None, 3)
    with pytest.raises(ValueError, match="2 confidences for 3 drafts"):
        choose1(policy, conf(0.5, 0.5), 3)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ((0.9, 0.9, 0.9), 3),  # Θ: 1, 1.27, 1.36, 1.37 — keeps improving
        ((0.4, 0.99), 0),  # Θ_1 = 1.4/1.5 < Θ_0 = 1: early stop, even though a_2 would pay off in a full search
        ((0.8, 0.3, 0.9), 1),  # Θ_2 = (1.8 + 0.24)/2 = 1.02 < Θ_1 = 1.2
        ((0.0, 1.0), 0),  # a = 0 is never a candidate
        ((), 0),
    ],
)
def test_scheduler_is_algorithm_1_with_early_stop(values, expected):
    policy = build_policy("scheduler", sps=SPS)
    assert choose1(policy, conf(*values), len(values)) == expected


def test_scheduler_without_sps_table_says_to_profile():
    with pytest.raises(ValueError, match=r"decode\.policy=scheduler.*SPS\(B\).*stage=profile"):
        build_policy("scheduler", sps=None)
    with pytest.raises(ValueError, match="stage=profile"):
        SchedulerPolicy(None)


def test_scheduler_reads_calibrated_confidences_and_threshold_raw_ones():
    """The engine calibrates once, before the policy (`policy_confidences`): the scheduler's survivals a_j are
    products of calibrated c̃ — sharpening (T = 0.25) and damping (T = 8) move ℓ both ways — while `threshold`
    compares the raw c_k and `calibrated_threshold` the calibrated ones."""
    sharpen = STSCalibration(temperatures=[0.25] * 3, grid=[0.25], n_bins=20, ece_before=[], ece_after=[])
    dampen = STSCalibration(temperatures=[8.0] * 3, grid=[8.0], n_bins=20, ece_before=[], ece_after=[])
    scheduler = build_policy("scheduler", sps=SPS)

    def read(policy, values, sts):
        return policy_confidences(
            policy, raw=values, calibrated=None if sts is None else calibrate_confidences(sts, values)
        )

    # raw a = 0.9, 0.54, 0.32: Θ = 1, 1.27, 1.22 → ℓ = 1; c̃ ≈ 0.9998, 0.835, 0.835 → Θ = 1, 1.33, 1.42, 1.41 → 2
    values = conf(0.9, 0.6, 0.6)
    assert choose1(scheduler, read(scheduler, values, None), 3) == 1
    assert choose1(scheduler, read(scheduler, values, sharpen), 3) == 2
    # raw a = 0.9, 0.81, 0.73: Θ keeps rising → 3; c̃ ≈ 0.57 each → Θ = 1, 1.05, 0.95 → 1
    values = conf(0.9, 0.9, 0.9)
    assert choose1(scheduler, read(scheduler, values, None), 3) == 3
    assert choose1(scheduler, read(scheduler, values, dampen), 3) == 1
    raw_threshold = build_policy("threshold", threshold=0.7)
    calibrated_threshold = build_policy("calibrated_threshold", threshold=0.7)
    assert raw_threshold.reads == "raw" and calibrated_threshold.reads == "calibrated"
    assert choose1(raw_threshold, read(raw_threshold, values, dampen), 3) == 3  # raw 0.9 ≥ 0.7
    assert choose1(calibrated_threshold, read(calibrated_threshold, values, dampen), 3) == 0  # c̃ ≈ 0.57 < 0.7
    assert choose1(calibrated_threshold, read(calibrated_threshold, values, None), 3) == 3  # no calibration: raw


def test_policies_no_longer_take_a_calibration():
    sts = STSCalibration(temperatures=[1.0] * 3, grid=[1.0], n_bins=20, ece_before=[], ece_after=[])
    with pytest.raises(ValueError, match="engine applies the STS calibration"):
        build_policy("scheduler", sps=SPS, calibration=sts)


def test_calibrate_confidences_handles_short_proposals():
    sts = STSCalibration(temperatures=[1.0, 2.0, 0.5], grid=[1.0], n_bins=20, ece_before=[], ece_after=[])
    full = calibrate_confidences(sts, conf(0.7, 0.8, 0.9))
    torch.testing.assert_close(calibrate_confidences(sts, conf(0.7, 0.8)), full[:2])
    assert calibrate_confidences(sts, conf()).shape == (0,)
    with pytest.raises(ValueError, match="block_size=3"):
        calibrate_confidences(sts, conf(0.5, 0.5, 0.5, 0.5))


def test_stop_drafting_agrees_with_choose_on_every_prefix():
    """The proposer stops before sampling x_k iff the policy would not verify slot k given c_1..c_k — and the
    choice on the shortened proposal equals the choice on the full one (prefix rule; METHOD §5 losslessness)."""
    policy = build_policy("threshold", threshold=0.5)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        values = torch.rand(6, generator=generator)
        full = choose1(policy, values, 6)
        stop_at = next((k for k in range(1, 7) if policy.stop_drafting(values[:k])), None)
        assert (stop_at - 1 if stop_at else 6) == full
        assert choose1(policy, values[:full], full) == full


def _staircase(generator: torch.Generator) -> SPSTable:
    """A random staircase SPS(B), B = 1..64 (flat stretches, then steps down), like a CPU target's."""
    times, current = [], 1.0
    for _ in range(64):
        if float(torch.rand((), generator=generator)) < 0.3:
            current += float(torch.rand((), generator=generator))
        times.append(current)
    return SPSTable(batch_tokens=list(range(1, 65)), steps_per_second=[1 / t for t in times])


@pytest.mark.parametrize("policy_name", ["scheduler", "threshold"])
def test_batched_drafting_stop_never_changes_the_plan_and_does_fire(policy_name):
    """R requests drafted slot by slot: stopping before slot k when `stop_drafting(c[:, :k])` says so gives the
    plan of the full proposal (the shorter proposal's columns past γ' are ignored), and on these random cases the
    stop saves slots (it is not a rule that never fires). Scheduler: on random staircase SPS tables."""
    generator = torch.Generator().manual_seed(3)
    fired = 0
    for trial in range(300):
        sps = _staircase(generator)
        policy = build_policy(policy_name, sps=sps, threshold=0.6)
        rows = int(torch.randint(1, 6, (1,), generator=generator))
        block = int(torch.randint(1, 8, (1,), generator=generator))
        values = torch.rand(rows, block, generator=generator, dtype=torch.float64) ** float(
            torch.rand((), generator=generator) * 2
        )
        drafted = torch.randint(0, block + 1, (rows,), generator=generator)  # a drafted stop id ends a row early
        values[torch.arange(block).unsqueeze(0) >= drafted.unsqueeze(1)] = 0.0
        full = policy.choose(confidences=values, num_drafts=drafted)
        stop_at = next((k for k in range(1, block + 1) if policy.stop_drafting(values[:, :k])), None)
        if stop_at is None:
            continue
        fired += 1
        assert bool((full < stop_at).all()), (trial, full, stop_at)
        shorter = values.clone()
        shorter[:, stop_at - 1 :] = 0.0
        assert torch.equal(policy.choose(confidences=shorter, num_drafts=drafted.clamp(max=stop_at - 1)), full)
    assert fired > 50


def test_scheduler_single_request_drafting_stop_equals_the_full_choice():
    """One request: the scheduler stops drafting before slot k exactly when it would not verify slot k."""
    generator = torch.Generator().manual_seed(5)
    for _ in range(300):
        policy = build_policy("scheduler", sps=_staircase(generator))
        values = torch.rand(7, generator=generator, dtype=torch.float64) ** 0.3
        full = choose1(policy, values, 7)
        stop_at = next((k for k in range(1, 8) if policy.stop_drafting(values[:k])), None)
        assert (stop_at - 1 if stop_at else 7) == full
        assert policy.stop_drafting(values[: full + 1].reshape(1, -1)) == (full < 7)  # the [1, k] form agrees


def test_static_policies_draft_no_more_than_they_verify():
    assert build_policy("static", static_k=3).max_drafts == 3
    assert build_policy("mtp1").max_drafts == 1
    assert build_policy("fixed").max_drafts is None
    assert build_policy("scheduler", sps=SPS).max_drafts is None


def test_registry_lists_policies_and_rejects_unknown_names():
    names = ["async", "calibrated_threshold", "fixed", "mtp1", "scheduler", "static", "threshold"]
    assert POLICIES.names() == names
    with pytest.raises(ValueError, match=r"Unknown decode\.policy 'treshold'.*Did you mean 'threshold'"):
        build_policy("treshold")
    with pytest.raises(ValueError, match="Valid: " + ", ".join(names)):
        build_policy("adaptive")


def test_config_lists_the_one_policy_family_for_decode_and_serve():
    from dspark.config.schema import POLICIES as DECODE_NAMES
    from dspark.config.schema import SERVE_POLICIES as SERVE_NAMES

    assert sorted(DECODE_NAMES) == sorted(SERVE_NAMES) == POLICIES.names()


def test_scheduler_single_request_fast_path_equals_algorithm_1_on_the_checked_row():
    """The one-request path (plain floats) decides as `schedule_verification` does on `_check`'s row: NaN → 0,
    columns past γ' zeroed; counts as an int or a [1] tensor; float32 and float64 confidences."""
    from dspark.scheduling.scheduler import schedule_verification

    policy = build_policy("scheduler", sps=SPS)
    generator = torch.Generator().manual_seed(7)
    for trial in range(400):
        block = int(torch.randint(1, 9, (1,), generator=generator))
        values = torch.rand(block, generator=generator, dtype=torch.float64) ** 0.3
        if trial % 5 == 0:
            values[int(torch.randint(0, block, (1,), generator=generator))] = float("nan")
        values = values.to(torch.float32 if trial % 2 else torch.float64)
        count = int(torch.randint(0, block + 1, (1,), generator=generator))
        checked = torch.nan_to_num(values.to(torch.float64), nan=0.0)
        checked[count:] = 0.0
        expected = min(int(schedule_verification(checked.reshape(1, -1), sps=SPS)[0]), count)
        assert int(policy.choose(confidences=values.reshape(1, -1), num_drafts=count)[0]) == expected
        assert choose1(policy, values, count) == expected
    with pytest.raises(ValueError, match="calibrated per-slot probabilities"):
        policy.choose(confidences=conf(0.5, float("inf")).reshape(1, -1), num_drafts=2)
    with pytest.raises(ValueError, match="3 confidences for 4 drafts"):
        policy.choose(confidences=conf(0.5, 0.5, 0.5).reshape(1, -1), num_drafts=4)


def test_every_policy_says_whether_it_is_lossless_and_only_the_look_ahead_stop_is_not():
    """`lossless` (what the stages flag as "lossy"): True for every policy of the registry as built by default, False
    for the scheduler with scheduler_stop=global_argmax — which also never stops drafting early (its decision on
    slot k reads the slots after k), while Algorithm 1's stop does on the same prefix (the control)."""
    assert all(build_policy(name, sps=SPS).lossless for name in POLICIES.ordered())
    argmax = build_policy("scheduler", sps=SPS, scheduler_stop="global_argmax")
    assert isinstance(argmax, SchedulerPolicy) and not argmax.lossless
    low = conf(0.3, 0.9, 0.9)  # a_1 < 0.5: Algorithm 1 admits nothing and stops before slot 2
    assert build_policy("scheduler", sps=SPS).stop_drafting(low[:2])
    assert not any(argmax.stop_drafting(low[:k]) for k in range(1, 4))
    assert choose1(build_policy("scheduler", sps=SPS), low, 3) == 0
    from dspark.scheduling.scheduler import schedule_verification

    for values in (low, conf(0.9, 0.2, 0.9), conf(0.95, 0.95, 0.1)):  # the one-request path = the tensor search
        search = schedule_verification(
            values.double().reshape(1, -1), sps=SPS, early_stop=False, allow_unsafe_full_search=True
        )
        assert choose1(argmax, values, 3) == int(search[0])
