"""Serving policies (METHOD §6, paper §5.2): ℓ_r per request from [R, γ] confidences, prefix rules only."""

from __future__ import annotations

import pytest
import torch

from dspark.scheduling import SPSTable, async_capacity_schedule, plan_columns, schedule_verification
from dspark.serving.policies import SERVE_POLICIES, SchedulerPolicy, build_serve_policy

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
    first = policy.choose(confidences=low, num_drafts=DRAFTS)  # no history: the synchronous scheduler
    assert (
        first.tolist()
        == schedule_verification(torch.tensor([[0.2] * 4, [0.2] * 4, [0.2, 0.2, 0, 0]]).double(), sps=SPS).tolist()
    )
    policy.choose(confidences=high, num_drafts=DRAFTS)
    third = policy.choose(confidences=high, num_drafts=DRAFTS)  # capacity from `low`, two steps old
    masked_high = torch.tensor([[0.95] * 4, [0.95] * 4, [0.95, 0.95, 0, 0]]).double()
    masked_low = torch.tensor([[0.2] * 4, [0.2] * 4, [0.2, 0.2, 0, 0]]).double()
    assert third.tolist() == async_capacity_schedule(masked_low, masked_high, sps=SPS).tolist()
    assert third.sum() < schedule_verification(masked_high, sps=SPS).sum()  # the stale budget binds
    policy.reset()
    assert (
        policy.choose(confidences=high, num_drafts=DRAFTS).tolist()
        == schedule_verification(masked_high, sps=SPS).tolist()
    )


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
    with pytest.raises(ValueError, match="serve.scheduler_cost='bogus'"):
        build_serve_policy("scheduler", sps=SPS, scheduler_cost="bogus")
    with pytest.raises(ValueError, match="serve.scheduler_cost"):
        SchedulerPolicy(SPS, key="serve", cost="packed")
    assert SERVE_POLICIES.names() == sorted(
        ["mtp1", "static", "fixed", "threshold", "calibrated_threshold", "scheduler", "async"]
    )


# The measured R = 8 case (reports/serving.notes-2026-12-03-bf16.md): the bf16 verify forward of 8 rows takes 99.6 ms at 1 token per
# row and 142 ms at 2 (a staircase: 9–16 tokens cost the same), ~185 ms at 3; the engine's drafting and per-row work
# add ~110 ms per step (serve.step_overhead=measured). c̃_1 ≈ 0.35 on every row.
MEASURED_VERIFY = SPSTable(
    batch_tokens=[8, 9, 16, 17, 24], steps_per_second=[1 / 0.0996, 1 / 0.142, 1 / 0.142, 1 / 0.185, 1 / 0.185]
)
MEASURED_STEP = MEASURED_VERIFY.with_step_overhead(0.110)
MEASURED_CONF = torch.tensor([[0.35, 0.35, 0.3]] * 8)


def test_columns_admit_the_padded_column_that_algorithm_1_refuses_one_candidate_at_a_time():
    """Algorithm 1 prices the first candidate (+0.35 tokens) against the whole [8, 1] → [8, 2] forward and admits
    nothing; the column planner weighs that forward against the column's 8 × 0.35 = 2.8 tokens and admits it
    (Θ: 8 / 0.2096 = 38.2 → 10.8 / 0.252 = 42.9 tok/s), then refuses column 2 (11.78 / 0.295 = 39.9)."""
    drafts = torch.full((8,), 3)
    tokens = build_serve_policy("scheduler", sps=MEASURED_STEP)
    columns = build_serve_policy("scheduler", sps=MEASURED_STEP, scheduler_cost="columns")
    assert tokens.choose(confidences=MEASURED_CONF, num_drafts=drafts).tolist() == [0] * 8
    assert columns.choose(confidences=MEASURED_CONF, num_drafts=drafts).tolist() == [1] * 8
    plan = plan_columns(MEASURED_CONF.double(), sps=MEASURED_STEP)
    assert plan.num_columns == 1
    assert plan.throughput[:3].tolist() == pytest.approx([8 / 0.2096, 10.8 / 0.252, 11.78 / 0.295], rel=1e-3)
    # A row that drafted nothing (a stop id at x_0's step) verifies nothing; the others still get their column.
    short = drafts.clone()
    short[3] = 0
    assert columns.choose(confidences=MEASURED_CONF, num_drafts=short).tolist() == [1, 1, 1, 0, 1, 1, 1, 1]
    # Drafting: slot 1 is verified, slot 2 never is, so the proposer stops before x_2.
    assert not columns.stop_drafting(MEASURED_CONF[:, :1]) and columns.stop_drafting(MEASURED_CONF[:, :2])
    assert tokens.stop_drafting(MEASURED_CONF[:, :1])


def test_columns_survive_repricing_with_the_measured_step_overhead():
    """serve.step_overhead=measured hands the policy a new table each step (`reprice`); the cost model stays: on
    the verify forward alone even the column does not pay (10.8 × 7.04 < 8 × 10.04), with the step priced it does."""
    drafts = torch.full((8,), 3)
    policy = build_serve_policy("scheduler", sps=MEASURED_VERIFY, scheduler_cost="columns")
    assert policy.choose(confidences=MEASURED_CONF, num_drafts=drafts).tolist() == [0] * 8
    policy.reprice(MEASURED_STEP)
    assert policy.cost == "columns" and policy.sps is MEASURED_STEP
    assert policy.choose(confidences=MEASURED_CONF, num_drafts=drafts).tolist() == [1] * 8


def test_columns_policy_is_the_column_plan_over_the_drafted_slots():
    """R > 1: ℓ_r = min(k*, γ'_r) with k* from `plan_columns` on the drafted columns (undrafted slots ignored),
    and the policy's drafting stop never changes that plan (the proposer stops before slot k* + 1) and fires."""
    generator = torch.Generator().manual_seed(11)
    fired = 0
    for _ in range(200):
        rows, block = (
            int(torch.randint(2, 7, (1,), generator=generator)),
            int(torch.randint(1, 6, (1,), generator=generator)),
        )
        values = torch.rand(rows, block, generator=generator, dtype=torch.float64) ** float(
            torch.rand((), generator=generator) * 2
        )
        drafted = torch.randint(0, block + 1, (rows,), generator=generator)
        masked = torch.where(torch.arange(block).unsqueeze(0) < drafted.unsqueeze(1), values, 0.0)
        policy = build_serve_policy("scheduler", sps=SPS, scheduler_cost="columns")
        full = policy.choose(confidences=values, num_drafts=drafted)
        expected = plan_columns(masked, sps=SPS, num_drafts=drafted)
        assert full.tolist() == expected.lengths.tolist()
        assert full.tolist() == [min(expected.num_columns, int(n)) for n in drafted]
        stop_at = next((k for k in range(1, block + 1) if policy.stop_drafting(masked[:, :k])), None)
        if stop_at is None:
            continue
        fired += 1
        assert stop_at == expected.num_columns + 1
        shorter = masked.clone()
        shorter[:, stop_at - 1 :] = 0.0
        assert torch.equal(policy.choose(confidences=shorter, num_drafts=drafted.clamp(max=stop_at - 1)), full)
    assert fired > 30
