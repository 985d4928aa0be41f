"""Serving policies (METHOD §6, paper §5.2): ℓ_r per request from [R, γ] confidences, prefix rules only."""
from __future__ import annotations

import pytest
import torch

from dspark.scheduling import SPSTable, async_capacity_schedule, schedule_verification
from dspark.serving.policies import SERVE_POLICIES, build_serve_policy

# Step time grows by 1/8 of a forward per extra token: verifying pays while the expected gain beats that.
SPS = SPSTable(batch_tokens=list(range(1, 65)), steps_per_second=[1 / (1 + (b - 1) / 8) for b in range(1, 65)])
CONF = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.5, 0.9, 0.9, 0.9], [0.99, 0.99, 0.1, 0.9]])
DRAFTS = torch.tensor([4, 4, 2])


def choose(name, confidences=CONF, drafts=DRAFTS, **kw):
    return build_serve_policy(name, sps=SPS, **kw).choose(confidences=confidences, num_drafts=drafts).tolist()


def test_static_policies():
    assert choose("mtp1") == [1, 1, 1]
    assert choose("static", static_k=3) == [3, 3, 2]
    assert choose("static", static_k=0) == [0, 0, 0]
    assert choose("fixed") == [4, 4, 2]
    assert choose("fixed", confidences=None) == [4, 4, 2]  # no confidences needed


def test_threshold_cuts_each_request_at_its_first_low_confidence():
    assert choose("threshold", threshold=0.75) == [2, 0, 2]
    assert choose("threshold", threshold=0.0) == [4, 4, 2]
    assert choose("calibrated_threshold", threshold=0.75) == [2, 0, 2]  # the same rule on what it is given


def test_scheduler_is_algorithm_1_over_all_requests_with_undrafted_slots_excluded():
    masked = CONF.clone()
    masked[2, 2:] = 0.0  # request 2 drafted 2 tokens only
    assert choose("scheduler") == schedule_verification(masked.double(), sps=SPS).tolist()
    assert all(0 <= ell <= n for ell, n in zip(choose("scheduler"), DRAFTS.tolist()))


def test_async_uses_the_capacity_of_two_steps_ago():
    policy = build_serve_policy("async", sps=SPS)
    low = torch.full((3, 4), 0.2)
    high = torch.full((3, 4), 0.95)
    first = policy.choose(confidences=low, num_drafts=DRAFTS)   # no history: the synchronous scheduler
    assert first.tolist() == schedule_verification(torch.tensor([[0.2] * 4, [0.2] * 4, [0.2, 0.2, 0, 0]]).double(),
                                                   sps=SPS).tolist()
    policy.choose(confidences=high, num_drafts=DRAFTS)
    third = policy.choose(confidences=high, num_drafts=DRAFTS)  # capacity from `low`, two steps old
    masked_high = torch.tensor([[0.95] * 4, [0.95] * 4, [0.95, 0.95, 0, 0]]).double()
    masked_low = torch.tensor([[0.2] * 4, [0.2] * 4, [0.2, 0.2, 0, 0]]).double()
    assert third.tolist() == async_capacity_schedule(masked_low, masked_high, sps=SPS).tolist()
    assert third.sum() < schedule_verification(masked_high, sps=SPS).sum()  # the stale budget binds
    policy.reset()
    assert policy.choose(confidences=high, num_drafts=DRAFTS).tolist() == \
        schedule_verification(masked_high, sps=SPS).tolist()


@pytest.mark.parametrize("name", ["threshold", "calibrated_threshold", "scheduler", "async"])
def test_confidence_policies_need_confidences(name):
    with pytest.raises(ValueError, match="confidence head"):
        choose(name, confidences=None)


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="serve.threshold"):
        build_serve_policy("threshold", threshold=1.5)
    with pytest.raises(ValueError, match="serve.static_k"):
        build_serve_policy("static", static_k=-1)
    with pytest.raises(ValueError, match="SPS"):
        build_serve_policy("scheduler", sps=None)
    with pytest.raises(ValueError, match="Unknown serve.policy 'mtp2'"):
        build_serve_policy("mtp2")
    assert SERVE_POLICIES.names() == sorted(["mtp1", "static", "fixed", "threshold", "calibrated_threshold",
                                             "scheduler", "async"])
