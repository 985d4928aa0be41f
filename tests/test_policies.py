"""Verification policies (dspark.decoding.policies, METHOD §6) on hand-made confidence vectors."""
from __future__ import annotations

import pytest
import torch

from dspark.calibration.sts import STSCalibration
from dspark.decoding.policies import (
    POLICIES,
    FixedPolicy,
    SchedulerPolicy,
    ThresholdPolicy,
    build_policy,
    calibrate_confidences,
)
from dspark.scheduling import SPSTable

# SPS(B) = 1 / (1 + (B-1)/2): Θ_j = (1 + Σ_{i≤j} a_i) / (1 + j/2), so slot j is admitted while
# a_j > (1 + Σ_{i<j} a_i) / (2 + (j-1)) — for slot 1: a_1 > 0.5.
SPS = SPSTable(batch_tokens=list(range(1, 10)), steps_per_second=[1 / (1 + (b - 1) / 2) for b in range(1, 10)])


def conf(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_fixed_verifies_everything_and_ignores_confidences():
    policy = build_policy("fixed")
    assert isinstance(policy, FixedPolicy) and not policy.needs_confidences
    assert policy.choose(confidences=None, num_drafts=5) == 5
    assert policy.choose(confidences=conf(0.0, 0.0), num_drafts=2) == 2
    assert policy.choose(confidences=None, num_drafts=0) == 0


@pytest.mark.parametrize(("values", "threshold", "expected"), [
    ((0.9, 0.8, 0.7, 0.95), 0.5, 4),   # all above: verify all
    ((0.9, 0.4, 0.99, 0.99), 0.5, 1),  # per-step, not cumulative: stops at the first dip even if later recover
    ((0.3, 0.9, 0.9), 0.5, 0),         # ℓ = 0 allowed: only the anchor is verified
    ((0.6, 0.6, 0.6), 0.5, 3),         # 0.6³ < 0.5 would stop a cumulative rule at slot 2; this rule does not
    ((0.5, 0.49), 0.5, 1),             # c_k = θ is kept (strictly below stops)
    ((0.0, 0.0), 0.0, 2),              # θ = 0 never stops
    ((0.99, 1.0), 1.0, 0),             # θ = 1 stops unless c = 1 exactly
])
def test_threshold_prefix_before_first_low_confidence(values, threshold, expected):
    policy = ThresholdPolicy(threshold)
    assert policy.choose(confidences=conf(*values), num_drafts=len(values)) == expected


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_threshold_outside_unit_interval_raises(bad):
    with pytest.raises(ValueError, match=r"decode\.threshold.*\[0, 1\]"):
        build_policy("threshold", threshold=bad)


@pytest.mark.parametrize("name", ["threshold", "scheduler"])
def test_confidence_policies_refuse_missing_confidences(name):
    policy = build_policy(name, threshold=0.5, sps=SPS)
    assert policy.needs_confidences
    with pytest.raises(ValueError, match="confidence head"):
        policy.choose(confidences=None, num_drafts=3)
    with pytest.raises(ValueError, match="3 confidences for 2 drafts"):
        policy.choose(confidences=conf(0.5, 0.5, 0.5), num_drafts=2)


@pytest.mark.parametrize(("values", "expected"), [
    ((0.9, 0.9, 0.9), 3),   # Θ: 1, 1.27, 1.36, 1.37 — keeps improving
    ((0.4, 0.99), 0),       # Θ_1 = 1.4/1.5 < Θ_0 = 1: early stop, even though a_2 would pay off in a full search
    ((0.8, 0.3, 0.9), 1),   # Θ_2 = (1.8 + 0.24)/2 = 1.02 < Θ_1 = 1.2
    ((0.0, 1.0), 0),        # a = 0 is never a candidate
    ((), 0),
])
def test_scheduler_is_algorithm_1_with_early_stop(values, expected):
    policy = build_policy("scheduler", sps=SPS)
    assert policy.choose(confidences=conf(*values), num_drafts=len(values)) == expected


def test_scheduler_without_sps_table_says_to_profile():
    with pytest.raises(ValueError, match="stage=profile"):
        build_policy("scheduler", sps=None)
    with pytest.raises(ValueError, match="stage=profile"):
        SchedulerPolicy(None)


def test_scheduler_uses_the_calibration():
    """Survivals a_j are products of calibrated c̃: sharpening (T = 0.25) and damping (T = 8) move ℓ both ways."""
    sharpen = STSCalibration(temperatures=[0.25] * 3, grid=[0.25], n_bins=20, ece_before=[], ece_after=[])
    dampen = STSCalibration(temperatures=[8.0] * 3, grid=[8.0], n_bins=20, ece_before=[], ece_after=[])
    raw = build_policy("scheduler", sps=SPS)
    # raw a = 0.9, 0.54, 0.32: Θ = 1, 1.27, 1.22 → ℓ = 1; c̃ ≈ 0.9998, 0.835, 0.835 → Θ = 1, 1.33, 1.42, 1.41 → 2
    values = conf(0.9, 0.6, 0.6)
    assert raw.choose(confidences=values, num_drafts=3) == 1
    assert build_policy("scheduler", sps=SPS, calibration=sharpen).choose(confidences=values, num_drafts=3) == 2
    # raw a = 0.9, 0.81, 0.73: Θ keeps rising → 3; c̃ ≈ 0.57 each → Θ = 1, 1.05, 0.95 → 1
    values = conf(0.9, 0.9, 0.9)
    assert raw.choose(confidences=values, num_drafts=3) == 3
    assert build_policy("scheduler", sps=SPS, calibration=dampen).choose(confidences=values, num_drafts=3) == 1


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
        full = policy.choose(confidences=values, num_drafts=6)
        stop_at = next((k for k in range(1, 7) if policy.stop_drafting(values[:k])), None)
        assert (stop_at - 1 if stop_at else 6) == full
        assert policy.choose(confidences=values[:full], num_drafts=full) == full


def test_registry_lists_policies_and_rejects_unknown_names():
    assert POLICIES.names() == ["fixed", "scheduler", "threshold"]
    with pytest.raises(ValueError, match=r"Unknown decode\.policy 'treshold'.*Did you mean 'threshold'"):
        build_policy("treshold")
    with pytest.raises(ValueError, match="Valid: fixed, scheduler, threshold"):
        build_policy("adaptive")
