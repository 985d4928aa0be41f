"""Trace-replay serving simulator (dspark.serving.simulator) and the batched SPS(B) profile (serving.profile)."""

from __future__ import annotations

import json
import logging
import math
import random

import pytest
import torch

from dspark.scheduling.sps import SPSTable, machine_fingerprint
from dspark.serving.profile import (
    load_or_profile_serving_sps,
    load_sps_table,
    monotone_table,
    profile_serving_sps,
    serving_batch_grid,
    serving_sps_path,
)
from dspark.serving.records import ServeRound, ServeStep, ServeSummary
from dspark.serving.simulator import (
    StepCosts,
    TraceRound,
    fit_step_costs,
    simulate_frontier,
    simulate_serving,
    trace_from_steps,
    validate,
)

pytestmark = pytest.mark.usefixtures("one_thread")
GAMMA = 4
FLAT = SPSTable([1, 64], [10.0, 10.0])
# Memory-bound up to 16 tokens (flat), compute-bound beyond (time ∝ B).
STEEP = SPSTable([1, 16, 32, 64, 128], [20.0, 20.0, 10.0, 5.0, 2.5])


def _recorded_steps(*, num_requests=5, seed=0, stop_request=None, confidences=True) -> list[ServeStep]:
    """Engine-like records under policy `fixed`: R = num_requests requests decoded together, 3–6 rounds each;
    c_k ~ high where the draft was accepted. `stop_request` ends its last round with an accepted stop id (τ = A)."""
    rng = random.Random(seed)
    lengths = [rng.randint(3, 6) for _ in range(num_requests)]
    steps = []
    for index in range(max(lengths)):
        rounds = []
        for rid in range(num_requests):
            if index >= lengths[rid]:
                continue
            drafted = rng.randint(1, GAMMA)
            accepted = rng.randint(0, drafted)
            conf = [
                round(rng.uniform(0.7, 0.95) if k < accepted else rng.uniform(0.05, 0.5), 3) for k in range(drafted)
            ]
            stop = rid == stop_request and index == lengths[rid] - 1
            accepted = drafted if stop else accepted
            committed = accepted if stop else accepted + 1
            rounds.append(
                ServeRound(
                    rid,
                    index,
                    100 + 3 * index,
                    drafted,
                    conf if confidences else None,
                    [min(1.0, c + 0.02) for c in conf] if confidences else None,
                    drafted,
                    accepted,
                    committed,
                    accept_if_all=accepted,
                )
            )
        steps.append(
            ServeStep(
                index,
                len(rounds),
                sum(1 + r.num_verified for r in rounds),
                sum(r.committed for r in rounds),
                seconds_draft=0.01 + 0.002 * len(rounds),
                seconds_verify=0.05,
                seconds_other=0.003 + 0.001 * len(rounds),
                seconds_prefill=0.02 if index == 0 else 0.0,
                rounds=rounds,
            )
        )
    return steps


@pytest.fixture(scope="module")
def trace():
    return trace_from_steps(_recorded_steps(stop_request=2))


def test_trace_from_steps_groups_by_request_in_step_order(trace):
    steps = _recorded_steps(stop_request=2)
    shuffled = trace_from_steps(list(reversed(steps)))
    assert [q.request_id for q in shuffled.requests] == list(range(5))
    assert shuffled.requests == trace.requests
    first = steps[0].rounds[0]
    assert trace.requests[0].rounds[0].accept_if_all == first.accept_if_all
    assert trace.requests[0].rounds[0].confidences == tuple(first.confidences)
    total = sum(r.committed for s in steps for r in s.rounds) / sum(len(s.rounds) for s in steps)
    assert trace.tau == pytest.approx(total)


def test_trace_from_steps_errors():
    with pytest.raises(ValueError, match="serve.policy=fixed"):
        trace_from_steps([])
    steps = _recorded_steps()
    for step in steps:
        for r in step.rounds:
            r.accept_if_all = None
    with pytest.raises(ValueError, match="serve.policy=fixed"):
        trace_from_steps(steps)
    bad = _recorded_steps()
    bad[0].rounds[0].accept_if_all = bad[0].rounds[0].num_drafted + 1
    with pytest.raises(ValueError, match="inconsistent"):
        trace_from_steps(bad)
    with pytest.raises(ValueError, match="several runs"):
        trace_from_steps(_recorded_steps() + _recorded_steps(seed=1))


def test_outcome_is_the_coupling_truncation():
    normal, stop = TraceRound(4, 2, 3, None, None), TraceRound(3, 3, 3, None, None)
    assert [normal.outcome(v) for v in range(5)] == [(0, 1), (1, 2), (2, 3), (2, 3), (2, 3)]
    assert [stop.outcome(v) for v in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]


@pytest.mark.parametrize("concurrency", [1, 3, 7])
def test_fixed_replays_the_trace_tau_exactly(trace, concurrency):
    summary = simulate_serving(trace, policy="fixed", concurrency=concurrency, sps=FLAT).summary()
    assert summary.tau == pytest.approx(trace.tau, rel=1e-12)
    assert summary.budget == pytest.approx(sum(r.num_drafted for r in trace.rounds) / len(trace.rounds))
    assert summary.simulated and summary.policy == "fixed" and summary.concurrency == concurrency


def _mtp1_run(trace):
    return simulate_serving(trace, policy="mtp1", concurrency=2, sps=FLAT, max_new_tokens=30)


def _breaks_min_rule(result) -> bool:
    """Whether some round accepted more than the one verified draft or committed other than accepted + 1."""
    return any(
        r.num_accepted > min(1, r.num_verified) or r.committed != r.num_accepted + 1
        for s in result.steps
        for r in s.rounds
    )


def test_mtp1_verifies_one_draft(trace):
    result = _mtp1_run(trace)
    summary = result.summary()
    assert summary.budget == 1.0 and 1.0 < summary.tau <= 2.0
    assert not _breaks_min_rule(result)
    assert all(len(q.new_tokens) == 30 for q in result.requests)


def test_mtp1_check_catches_ignoring_the_verification_length(trace, monkeypatch):
    """A replay that always takes the recorded outcome (ignores ℓ) breaks accepted = min(A_all, ℓ)."""
    monkeypatch.setattr(TraceRound, "outcome", lambda self, verified: (self.accept_if_all, self.committed_if_all))
    assert _breaks_min_rule(_mtp1_run(trace))


def test_scheduler_verifies_less_when_compute_bound(trace):
    low = simulate_serving(trace, policy="scheduler", concurrency=2, sps=STEEP).summary()
    high = simulate_serving(trace, policy="scheduler", concurrency=32, sps=STEEP).summary()
    assert low.budget > 2.0 and high.budget < 0.5 * low.budget
    flat_high = simulate_serving(trace, policy="scheduler", concurrency=32, sps=FLAT).summary()
    assert flat_high.budget > 2.0  # with a flat SPS verifying more is free at any R


def test_deterministic_for_a_seed(trace):
    def run(seed):
        result = simulate_serving(trace, policy="threshold", concurrency=3, sps=STEEP, seed=seed, max_new_tokens=25)
        return [s.to_dict() for s in result.steps], result.wall_seconds

    assert run(4) == run(4)
    assert run(4) != run(5)


def _reference_replay(trace, *, concurrency, threshold, sps, costs, max_new_tokens, seed):
    """An independent engine-like closed loop: R slots, threshold rule by hand, coupling by hand."""
    order = torch.randperm(len(trace.requests), generator=torch.Generator().manual_seed(seed)).tolist()
    total = len(trace.requests) * math.ceil(4 * concurrency / len(trace.requests))
    slots, clock, started, finished, taus, budgets = [None] * concurrency, 0.0, 0, [], [], []
    while started < total or any(slots):
        joins = 0
        for i in range(concurrency):
            if slots[i] is None and started < total:
                slots[i] = {"req": trace.requests[order[started % len(order)]], "tokens": 1, "k": 0, "t0": clock}
                started, joins = started + 1, joins + 1
        live = [s for s in slots if s]
        verified_total = 0
        for s in live:
            rd = s["req"].rounds[s["k"] % len(s["req"].rounds)]
            ell = 0
            while ell < rd.num_drafted and rd.calibrated[ell] >= threshold:
                ell += 1
            accepted = min(ell, rd.accept_if_all)
            tau = rd.committed_if_all if accepted == rd.accept_if_all else accepted + 1
            s["tokens"], s["k"] = s["tokens"] + tau, s["k"] + 1
            verified_total += ell
            taus.append(tau)
            budgets.append(ell)
        n = len(live)
        clock += (
            1 / sps(n + verified_total)
            + costs.draft_intercept
            + costs.draft_per_request * n
            + costs.other_intercept
            + costs.other_per_request * n
            + joins * costs.prefill_per_request
        )
        for i, s in enumerate(slots):
            if s and s["tokens"] >= max_new_tokens:
                finished.append(max_new_tokens / (clock - s["t0"]))
                slots[i] = None
    return {
        "throughput": len(finished) * max_new_tokens / clock,
        "user_speed": sum(finished) / len(finished),
        "tau": sum(taus) / len(taus),
        "budget": sum(budgets) / len(budgets),
        "wall": clock,
    }


def test_replay_matches_a_hand_built_engine_loop(trace):
    costs = StepCosts(0.004, 0.001, 0.002, 0.0005, 0.03)
    reference = _reference_replay(
        trace, concurrency=3, threshold=0.6, sps=STEEP, costs=costs, max_new_tokens=17, seed=2
    )
    result = simulate_serving(
        trace, policy="threshold", threshold=0.6, concurrency=3, sps=STEEP, costs=costs, max_new_tokens=17, seed=2
    )
    summary = result.summary()
    assert result.wall_seconds == pytest.approx(reference["wall"], rel=1e-9)
    for key in ("throughput", "user_speed", "tau", "budget"):
        assert getattr(summary, key) == pytest.approx(reference[key], rel=1e-9), key


def test_pad_to_longest_times_the_right_padded_forward(trace):
    linear = SPSTable([1], [1.0])  # one entry: time ∝ B, 1 s per token
    packed = simulate_serving(trace, policy="threshold", concurrency=3, sps=linear, max_new_tokens=12)
    padded = simulate_serving(
        trace, policy="threshold", concurrency=3, sps=linear, max_new_tokens=12, pad_to_longest=True
    )
    assert packed.wall_seconds == pytest.approx(sum(s.batch_tokens for s in packed.steps))
    widths = [s.num_active * (1 + max(r.num_verified for r in s.rounds)) for s in padded.steps]
    assert padded.wall_seconds == pytest.approx(sum(widths)) and padded.wall_seconds > packed.wall_seconds
    assert [s.batch_tokens for s in padded.steps] == [s.batch_tokens for s in packed.steps]


def test_confidence_source_and_missing_confidences():
    raw_only = trace_from_steps(_recorded_steps(confidences=False))
    assert simulate_serving(raw_only, policy="fixed", concurrency=2, sps=FLAT).summary().tau == pytest.approx(
        raw_only.tau
    )
    with pytest.raises(ValueError, match="serve.policy=scheduler needs confidences"):
        simulate_serving(raw_only, policy="scheduler", concurrency=2, sps=FLAT)
    with pytest.raises(ValueError, match="max_new_tokens"):
        simulate_serving(raw_only, policy="fixed", concurrency=2, sps=FLAT, max_new_tokens=1)


def test_fit_step_costs_recovers_linear_costs():
    costs = fit_step_costs(_recorded_steps(num_requests=5, seed=3))
    assert costs.draft_intercept == pytest.approx(0.01) and costs.draft_per_request == pytest.approx(0.002)
    assert costs.other_intercept == pytest.approx(0.003) and costs.other_per_request == pytest.approx(0.001)
    assert costs.prefill_per_request == pytest.approx(0.02 / 5)
    single = fit_step_costs([ServeStep(0, 4, 8, 6, seconds_draft=0.02, seconds_verify=0.1, seconds_other=0.01)] * 3)
    assert (single.draft_intercept, single.draft_per_request) == (pytest.approx(0.02), 0.0)
    with pytest.raises(ValueError, match="StepCosts by hand"):
        fit_step_costs([])


def test_validate_relative_errors():
    real = ServeSummary("fixed", 4, 100.0, 10.0, 0.0, 2.0, 8, 20, 1.0)
    sim = ServeSummary("fixed", 4, 110.0, 9.0, 1.5, 2.0, 8, 20, 1.0, simulated=True)
    errors = validate(real, sim)
    assert errors["throughput"] == pytest.approx(0.1) and errors["user_speed"] == pytest.approx(-0.1)
    assert errors["tau"] == 0.0 and math.isnan(errors["budget"])


def test_simulate_frontier_uses_the_table_of_each_concurrency(trace):
    tables = {2: FLAT, 32: STEEP}
    summaries = simulate_frontier(
        trace, policies=["mtp1", "scheduler"], concurrency_levels=[2, 24], sps=tables, max_new_tokens=20
    )
    assert [(s.policy, s.concurrency) for s in summaries] == [
        ("mtp1", 2),
        ("scheduler", 2),
        ("mtp1", 24),
        ("scheduler", 24),
    ]
    by_key = {(s.policy, s.concurrency): s for s in summaries}
    assert by_key[("scheduler", 24)].budget < by_key[("scheduler", 2)].budget  # 24 → the steep R=32 table


# ---- batched SPS(B) profile (tiny target) ----

TINY_TARGET = {"feature_layers": [0, 3, 6, 7]}  # the `tiny` fixture's options (tests/conftest.py)


def test_serving_batch_grid():
    assert serving_batch_grid(64, num_rows=8) == [8, 9, 10, 11, 12, 13, 14, 15, 16, 23, 32, 45, 64]
    assert serving_batch_grid(5) == [1, 2, 3, 4, 5]
    assert serving_batch_grid(200, num_rows=32) == [32, 45, 64, 91, 128, 181, 200]
    with pytest.raises(ValueError, match="at least R tokens"):
        serving_batch_grid(20, num_rows=32)


def test_monotone_table_removes_timing_dips():
    noisy = SPSTable([1, 2, 3, 4], [1.0, 1 / 3, 0.5, 0.25], target_fingerprint="t", machine="m")
    clean = monotone_table(noisy)
    assert [1 / s for s in clean.steps_per_second] == pytest.approx([1.0, 2.0, 2.0, 4.0])
    assert (clean.target_fingerprint, clean.machine, clean.created) == ("t", "m", noisy.created)


def test_profile_runs_padded_rows_on_a_rolled_back_cache(tiny, monkeypatch):
    seen = []
    forward = tiny.forward

    def spy(ids, *, cache=None, **kwargs):
        seen.append((tuple(ids.shape), cache.get_seq_length()))
        return forward(ids, cache=cache, **kwargs)

    monkeypatch.setattr(tiny, "forward", spy)
    table = profile_serving_sps(tiny, max_batch_tokens=7, num_rows=3, context_length=10, repeats=1, warmup=0)
    assert table.batch_tokens == [3, 4, 5, 6, 7] and all(s > 0 for s in table.steps_per_second)
    assert table.target_fingerprint == tiny.fingerprint and table.machine == machine_fingerprint()
    assert seen[0] == ((3, 10), 0)  # the one prefill
    assert [s for s, _ in seen[1:]] == [(3, 1), (3, 2), (3, 2), (3, 2), (3, 3)]  # q = ⌈B/R⌉
    assert all(length == 10 for _, length in seen[1:])  # every call starts from the same context


def test_cached_table_reused_and_reprofiled_on_mismatch(tiny, tmp_path, caplog):
    kwargs = dict(cache_dir=tmp_path, max_batch_tokens=4, num_rows=2, context_length=8, repeats=1)
    table, path = load_or_profile_serving_sps(tiny, **kwargs)
    assert path == serving_sps_path(tmp_path, tiny, num_rows=2, context_length=8) and path.name.endswith("-r2-c8.json")
    again, _ = load_or_profile_serving_sps(tiny, **kwargs)
    assert again.created == table.created and again.steps_per_second == table.steps_per_second
    table.machine = "another machine"
    table.save(path)
    with caplog.at_level(logging.WARNING, logger="dspark"):
        fresh, _ = load_or_profile_serving_sps(tiny, **kwargs)
    assert "another target or machine" in caplog.text and fresh.machine == machine_fingerprint()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dspark"):
        wider, _ = load_or_profile_serving_sps(tiny, **{**kwargs, "max_batch_tokens": 5})
    assert "covers B <= 4" in caplog.text and wider.batch_tokens[-1] == 5
    assert load_sps_table(path).batch_tokens == wider.batch_tokens


def test_a_table_of_another_forward_path_is_not_reused(tiny, tmp_path, monkeypatch):
    """A change in our code that moves a verify forward's cost bumps FORWARD_PATH_REVISION: older tables are
    re-profiled, as are tables of the other few-row layout or of another row-padding table."""
    import dspark.scheduling.profile as profile_module

    kwargs = dict(cache_dir=tmp_path, max_batch_tokens=3, num_rows=1, context_length=8, repeats=1)
    first, path = load_or_profile_serving_sps(tiny, **kwargs)
    monkeypatch.setattr(profile_module, "FORWARD_PATH_REVISION", profile_module.FORWARD_PATH_REVISION + 1)
    second, newer = load_or_profile_serving_sps(tiny, **kwargs)
    monkeypatch.setattr(tiny, "few_row_layout", "transposed")
    third, transposed = load_or_profile_serving_sps(tiny, **kwargs)
    monkeypatch.setattr(tiny, "row_padding", {1: 2}, raising=False)
    _, padded = load_or_profile_serving_sps(tiny, **kwargs)
    monkeypatch.setattr(tiny, "row_padding", {1: 2, 3: 4}, raising=False)
    _, padded_more = load_or_profile_serving_sps(tiny, **kwargs)
    paths = (path, newer, transposed, padded, padded_more)
    assert len(set(paths)) == 5 and all(p.exists() for p in paths)
    assert "-f" in padded_more.name and "tp1.2-3.4-" in padded_more.name
    assert first.created <= second.created <= third.created


def test_engine_profile_times_the_batched_engines_own_forward(tiny, tmp_path, monkeypatch):
    """serve.sps_forward=engine: every timed call is the BatchedKVCache forward (2-D mask, per-token positions after
    each row's committed tokens), the rows keep `context_length` committed tokens whatever the holes, and the
    table is cached under its own name beside the plain one."""
    from dspark.serving.kv import BatchedKVCache
    from dspark.serving.profile import engine_forward, load_or_profile_sps_of

    seen = []
    forward = BatchedKVCache.forward

    def spy(self, input_ids, *, position_ids, input_valid):
        seen.append((tuple(input_ids.shape), self.lengths.tolist(), position_ids[:, 0].tolist()))
        return forward(self, input_ids, position_ids=position_ids, input_valid=input_valid)

    monkeypatch.setattr(BatchedKVCache, "forward", spy)
    table = profile_serving_sps(
        tiny, max_batch_tokens=7, num_rows=3, context_length=10, repeats=2, warmup=1, forward=engine_forward
    )
    assert table.batch_tokens == [3, 4, 5, 6, 7] and all(s > 0 for s in table.steps_per_second)
    assert [shape for shape, _, _ in seen[:5]] == [(3, 1), (3, 2), (3, 2), (3, 2), (3, 3)]  # q = ⌈B/R⌉
    assert all(lengths == [10, 10, 10] and first == [10, 10, 10] for _, lengths, first in seen)

    kwargs = dict(cache_dir=tmp_path, max_batch_tokens=3, num_rows=1, context_length=8, repeats=1)
    engine, engine_path = load_or_profile_sps_of("engine", tiny, **kwargs)
    plain, plain_path = load_or_profile_sps_of("plain", tiny, **kwargs)
    assert engine_path.name.endswith("-r1-c8-engine.json") and plain_path.name.endswith("-r1-c8.json")
    assert plain_path == serving_sps_path(tmp_path, tiny, num_rows=1, context_length=8)  # plain: the old name
    again, _ = load_or_profile_sps_of("engine", tiny, **kwargs)
    assert again.created == engine.created  # reused
    with pytest.raises(ValueError, match="serve.sps_forward='fast'.*plain, engine"):
        load_or_profile_sps_of("fast", tiny, **kwargs)


def test_load_sps_table_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_sps_table(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"batch_tokens": [1, 2]}))
    with pytest.raises(ValueError, match="is not an SPS table"):
        load_sps_table(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not an SPS table"):
        load_sps_table(bad)


class _NoDraftingStop:
    """The same policy without `max_drafts` / `stop_drafting`: the proposer would draw every slot."""

    def __init__(self, policy):
        self._policy = policy
        self.name, self.reads, self.needs_confidences = policy.name, policy.reads, policy.needs_confidences

    def choose(self, **kwargs):
        return self._policy.choose(**kwargs)

    def reset(self):
        self._policy.reset()


@pytest.mark.parametrize("policy", ["mtp1", "static", "threshold", "scheduler", "scheduler:columns"])
def test_lean_steps_draw_only_what_the_policy_can_verify_and_keep_its_plan(trace, policy):
    """The simulated proposer stops where the engine's lean proposer does (`max_drafts`, `stop_drafting`): the
    plan (every ℓ, A, τ) is the one drawn from full proposals, drafting is priced per drawn slot, and some step
    draws fewer slots than the longest recorded row. "scheduler:columns": serve.scheduler_cost=columns."""
    from dspark.serving.policies import build_serve_policy

    name, _, cost = policy.partition(":")
    costs = StepCosts(
        0.010, 0.002, 0.003, 0.001, 0.0, slot_intercept=0.001, slot_per_request=0.0005, trace_slots=trace.block_size
    )
    sps = SPSTable([1], [1.0])  # time ∝ B: the scheduler admits only confident slots, so it stops drafting early
    common = dict(concurrency=3, sps=sps, costs=costs, max_new_tokens=14, seed=1)
    options = dict(threshold=0.6, sps=sps, scheduler_cost=cost or "tokens")
    lean = simulate_serving(trace, policy=build_serve_policy(name, **options), **common)
    full = simulate_serving(trace, policy=_NoDraftingStop(build_serve_policy(name, **options)), **common)
    plan = [[(r.num_verified, r.num_accepted, r.committed) for r in s.rounds] for s in lean.steps]
    assert plan == [[(r.num_verified, r.num_accepted, r.committed) for r in s.rounds] for s in full.steps]
    cheaper = 0
    for lean_step, full_step in zip(lean.steps, full.steps):
        slots = max(r.num_drafted for r in lean_step.rounds)
        assert lean_step.seconds_draft == pytest.approx(costs.draft_seconds(lean_step.num_active, slots))
        assert lean_step.seconds_draft_sequential == pytest.approx(slots * costs.slot_seconds(lean_step.num_active))
        assert all(r.num_verified <= r.num_drafted for r in lean_step.rounds)
        cheaper += lean_step.seconds_draft < full_step.seconds_draft
    assert cheaper > 0
    if policy == "mtp1":
        assert all(r.num_drafted <= 1 for s in lean.steps for r in s.rounds)


def test_fit_step_costs_recovers_the_cost_per_drawn_slot():
    """Steps drawing 1–5 slots with a sequential loop of (1 ms + 0.5 ms · R) per slot: the fit finds both."""
    steps = []
    for index, (active, slots) in enumerate([(1, 5), (2, 1), (3, 3), (4, 2), (2, 4), (3, 5)]):
        rounds = [ServeRound(r, index, 0, slots, None, None, 0, 0, 1) for r in range(active)]
        sequential = slots * (0.001 + 0.0005 * active)
        steps.append(
            ServeStep(
                index,
                active,
                active,
                active,
                seconds_draft=0.01 + sequential,
                seconds_verify=0.1,
                seconds_other=0.0,
                seconds_draft_sequential=sequential,
                rounds=rounds,
            )
        )
    costs = fit_step_costs(steps)
    assert costs.slot_intercept == pytest.approx(0.001) and costs.slot_per_request == pytest.approx(0.0005)
    assert costs.trace_slots == pytest.approx(20 / 6)
    assert costs.draft_seconds(2, 3) == pytest.approx(costs.draft_seconds(2) + (3 - 20 / 6) * 0.002)


def test_scheduler_cost_columns_plans_whole_columns(trace):
    """simulate_serving(policy="scheduler", scheduler_cost="columns") builds the scheduler with the column planner,
    as stage=serve's cells with serve.scheduler_cost=columns do: every step's ℓ_r are `plan_columns` on the
    calibrated confidences the step read (one k, ℓ_r = min(k, γ'_r)); "tokens" stays Algorithm 1; bad names fail."""
    from dspark.scheduling import plan_columns

    # a column of R = 3 rows costs half a 3-token forward: it pays when its mass beats ~1.1, so k varies by step
    sps = SPSTable(list(range(1, 17)), [1 / (1 + (b - 1) / 6) for b in range(1, 17)])
    common = dict(policy="scheduler", concurrency=3, sps=sps, max_new_tokens=14, seed=1, pad_to_longest=True)
    columns = simulate_serving(trace, scheduler_cost="columns", **common)
    widths = set()
    for step in columns.steps:
        drafted = torch.tensor([r.num_drafted for r in step.rounds])
        conf = torch.zeros(len(step.rounds), trace.block_size, dtype=torch.float64)
        for row, r in enumerate(step.rounds):
            conf[row, : r.num_drafted] = torch.tensor(r.calibrated, dtype=torch.float64)
        plan = plan_columns(conf, sps=sps, num_drafts=drafted)
        assert [r.num_verified for r in step.rounds] == plan.lengths.tolist()
        widths.add(plan.num_columns)
    assert len(widths) > 1, widths
    tokens = simulate_serving(trace, **common)
    assert [[r.num_verified for r in s.rounds] for s in tokens.steps] != [
        [r.num_verified for r in s.rounds] for s in columns.steps
    ]
    assert (
        simulate_frontier(
            trace,
            policies=["scheduler"],
            concurrency_levels=[3],
            sps=sps,
            max_new_tokens=14,
            seed=1,
            pad_to_longest=True,
            scheduler_cost="columns",
        )[0]
        == columns.summary()
    )
    with pytest.raises(ValueError, match="serve.scheduler_cost"):
        simulate_serving(trace, scheduler_cost="bogus", **common)


# ---- the hindsight bound (simulate_hindsight) ----

HINDSIGHT_COSTS = StepCosts(
    draft_intercept=0.004,
    draft_per_request=0.002,
    other_intercept=0.002,
    other_per_request=0.001,
    prefill_per_request=0.02,
    slot_intercept=0.0005,
    slot_per_request=0.0002,
    trace_slots=2.5,
)
# A staircase: 1–2 tokens per row cost alike, the 3rd and 5th a step each (the fp32 CPU shape).
STAIRS = SPSTable([1, 2, 3, 4, 5, 8, 16, 32], [20.0, 20.0, 16.0, 16.0, 12.0, 10.0, 6.0, 3.0])


def _chooser(k, *, sps=STAIRS, pad=True):
    from dspark.serving.simulator import HindsightChooser

    return HindsightChooser(columns=k, sps=sps, costs=HINDSIGHT_COSTS, pad_to_longest=pad)


@pytest.mark.parametrize("k, name", [(1, "mtp1"), (2, "static"), (GAMMA, "fixed")])
@pytest.mark.parametrize("concurrency", [1, 3])
def test_hindsight_with_fixed_columns_replays_the_static_policy_step_for_step(trace, k, name, concurrency):
    """The chooser's replay is the simulator's: k fixed columns is mtp1 / static k / fixed, step for step."""
    ours = simulate_serving(
        trace,
        policy=_chooser(k),
        concurrency=concurrency,
        sps=STAIRS,
        costs=HINDSIGHT_COSTS,
        pad_to_longest=True,
        seed=3,
    )
    theirs = simulate_serving(
        trace,
        policy=name,
        static_k=k,
        concurrency=concurrency,
        sps=STAIRS,
        costs=HINDSIGHT_COSTS,
        pad_to_longest=True,
        seed=3,
    )
    assert [(s.num_active, s.batch_tokens, s.committed) for s in ours.steps] == [
        (s.num_active, s.batch_tokens, s.committed) for s in theirs.steps
    ]
    assert [s.seconds for s in ours.steps] == pytest.approx([s.seconds for s in theirs.steps], rel=1e-12)


def _long_trace(seed=0, requests=8):
    """Requests of 20–30 rounds (end effects small, as in a serving run's 32-token requests); A ~ geometric-ish,
    c_k high on accepted slots."""
    from dspark.serving.simulator import ServeTrace, TraceRequest

    rng = random.Random(seed)
    recorded = []
    for rid in range(requests):
        rounds = []
        for _ in range(rng.randint(20, 30)):
            drafted = rng.randint(1, GAMMA)
            accepted = min(drafted, int(rng.expovariate(1.2)))
            conf = tuple(rng.uniform(0.6, 0.95) if k < accepted else rng.uniform(0.05, 0.5) for k in range(drafted))
            rounds.append(TraceRound(drafted, accepted, accepted + 1, conf, conf))
        recorded.append(TraceRequest(rid, rounds))
    return ServeTrace(recorded)


@pytest.mark.parametrize("concurrency", [1, 2, 4, 8])
def test_hindsight_is_at_least_as_fast_as_every_policy(concurrency):
    from dspark.serving.simulator import simulate_hindsight

    long_trace = _long_trace()
    bound = simulate_hindsight(
        long_trace, concurrency=concurrency, sps=STAIRS, costs=HINDSIGHT_COSTS, max_new_tokens=32
    )
    assert bound.policy == "hindsight"
    for name in ("mtp1", "static", "fixed", "scheduler", "threshold", "calibrated_threshold"):
        other = simulate_serving(
            long_trace,
            policy=name,
            concurrency=concurrency,
            sps=STAIRS,
            costs=HINDSIGHT_COSTS,
            pad_to_longest=True,
            max_new_tokens=32,
            scheduler_cost="columns",
        )
        assert bound.summary().throughput >= other.summary().throughput * (1 - 1e-9), name


def _fastest_single_request(rounds, *, length, prefill):
    """Exact optimum at R = 1 by dynamic programming: the least time for one request to reach `length` tokens
    through `rounds` (cycled), choosing every step's k knowing each round's outcome; returns tokens / second."""
    chooser = _chooser(0)
    best = {(0, 1): 0.0}  # (rounds used, tokens so far) → least seconds
    finished = math.inf
    frontier = dict(best)
    while frontier:
        following = {}
        for (used, tokens), seconds in frontier.items():
            round_ = rounds[used % len(rounds)]
            for k in range(round_.num_drafted + 1):
                gained, cost = chooser.step_value([round_], k)
                state, total = (used + 1, tokens + gained), seconds + cost
                if state[1] >= length:
                    finished = min(finished, total)
                elif total < following.get(state, math.inf):
                    following[state] = total
        frontier = following
    return length / (prefill + finished)


@pytest.mark.parametrize("seed", range(6))
def test_hindsight_reaches_the_exact_optimum_of_one_request(seed):
    """R = 1, one recorded request: against an exhaustive search over every step's k (dynamic programming)."""
    from dspark.serving.simulator import ServeTrace, TraceRequest, simulate_hindsight

    rng = random.Random(seed)
    rounds = []
    for _ in range(rng.randint(3, 6)):
        drafted = rng.randint(1, GAMMA)
        accepted = rng.randint(0, drafted)
        rounds.append(TraceRound(drafted, accepted, accepted + 1, None, None))
    single = ServeTrace([TraceRequest(0, rounds)])
    length = rng.randint(8, 20)
    bound = simulate_hindsight(
        single, concurrency=1, sps=STAIRS, costs=HINDSIGHT_COSTS, max_new_tokens=length, num_requests=1
    )
    optimum = _fastest_single_request(rounds, length=length, prefill=HINDSIGHT_COSTS.prefill_per_request)
    assert bound.summary().throughput == pytest.approx(optimum, rel=1e-9)
