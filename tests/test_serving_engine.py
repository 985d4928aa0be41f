"""The batched serving engine's parts (dspark.serving): KV store with holes, batched proposer, one forward per step,
bad input, and record bookkeeping. Distributional correctness is in tests/test_serving_lossless.py."""

from __future__ import annotations

import pytest
import torch

from dspark.calibration.sts import STSCalibration, scale_confidence
from dspark.decoding import DSparkProposer
from dspark.drafters.factory import DrafterSpec, build_drafter
from dspark.drafters.heads import SEQUENTIAL_HEADS
from dspark.scheduling import SPSTable
from dspark.serving import (
    BatchedDSparkProposer,
    BatchedEngine,
    BatchedKVCache,
    ServeRequest,
    build_serve_policy,
    kv_budget,
    prefill,
)
from dspark.serving import kv as kv_module

GAMMA = 3
TEXTS = ("What is 2+2?", "Hi", "Write a short poem about the sea and the wind, please.", "Name three colours.")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread (tests/conftest.py)


TINY_TARGET = {"seed": 1}  # the `tiny` fixture's options (tests/conftest.py)


@pytest.fixture(scope="module")
def target(tiny):
    return tiny


@pytest.fixture(scope="module")
def prompts(target):
    return [target.chat_prompt_ids(text) for text in TEXTS]


def make_drafter(target, kind="dspark", head="markov"):
    spec = DrafterSpec(
        kind=kind,
        head=head if kind == "dspark" else "none",
        depth=1,
        block_size=GAMMA,
        markov_rank=8 if kind == "dspark" and head != "none" else 0,
        feature_layers=tuple(target.feature_layer_ids),
        mask_token_id=target.mask_token_id,
        target_fingerprint=target.fingerprint,
    )
    torch.manual_seed(0)
    drafter = build_drafter(spec, target)
    with torch.no_grad():  # N(0, 0.02) weights leave p_d ≈ uniform; larger ones draft varied tokens
        for name, param in drafter.named_parameters():
            if "norm" not in name:
                param.mul_(5.0)
    return drafter.eval()


def fresh_logits(target, sequence, count):
    """Logits of the last `count` tokens of `sequence` from a cache-free forward (the reference)."""
    return target.forward(torch.tensor([sequence]), return_logits=True).logits[0, -count:]


def step_blocks(kv, sequences, generator, vocab, *, positions_from_columns=False):
    """One padded block of random tokens per row; returns (logits [R, Q, V], blocks, valid counts)."""
    rows, width = kv.num_rows, 4
    blocks = torch.randint(0, vocab, (rows, width), generator=generator)
    counts = torch.randint(1, width + 1, (rows,), generator=generator)
    if positions_from_columns:  # the bug explicit positions prevent: RoPE at the column index
        positions = torch.full((rows, 1), kv.width) + torch.arange(width)
    else:
        positions = torch.tensor([len(s) for s in sequences]).unsqueeze(1) + torch.arange(width)
    valid = torch.arange(width).unsqueeze(0) < counts.unsqueeze(1)
    forward = kv.forward(blocks, position_ids=positions, input_valid=valid)
    return kv.target.logits_from_hidden(forward.final_hidden), blocks, counts


def test_kv_store_join_leave_compact_matches_fresh_forwards(target, prompts):
    """Rows join (one prefill, narrower side padded), keep random prefixes of padded blocks (holes), leave and
    are compacted; every row's logits always equal a fresh forward of that request's committed sequence."""
    generator = torch.Generator().manual_seed(0)
    kv = BatchedKVCache(target)
    kv.add_rows(prefill(target, prompts[:2]))
    sequences = [list(p) for p in prompts[:2]]
    for step in range(7):
        if step == 2:  # a longer prompt joins: the existing rows get hole columns
            kv.add_rows(prefill(target, prompts[2:]))
            sequences += [list(p) for p in prompts[2:]]
        logits, blocks, counts = step_blocks(kv, sequences, generator, target.vocab_size)
        keep = torch.minimum(torch.randint(1, 5, (kv.num_rows,), generator=generator), counts)
        for r, sequence in enumerate(sequences):
            n = int(counts[r])
            expected = fresh_logits(target, sequence + blocks[r, :n].tolist(), n)
            torch.testing.assert_close(logits[r, :n], expected, atol=1e-5, rtol=1e-4)
            sequence += blocks[r, : int(keep[r])].tolist()
        kv.keep_new(keep)
        assert kv.lengths.tolist() == [len(s) for s in sequences]
        if step == 3:  # rows 1 and 3 leave, the others are reordered
            kv.remove_rows(torch.tensor([2, 0]))
            sequences = [sequences[2], sequences[0]]
        if step == 4:
            holes_before = kv.hole_fraction
            kv.compact()
            assert kv.width == max(len(s) for s in sequences) and kv.hole_fraction < holes_before
    assert not kv.maybe_compact() or kv.width == max(len(s) for s in sequences)


def test_compaction_waits_for_removable_holes_not_for_padding(target, prompts):
    """Rows of different lengths are padding that no compaction removes: no compaction for it, however large its
    share of the cells; hole columns beyond 4/3 of the longest row are compacted away."""
    kv = BatchedKVCache(target)
    short, long = list(prompts[0][:3]), list(prompts[2]) * 4
    kv.add_rows(prefill(target, [short, long]))
    assert kv.hole_fraction > kv.compact_fraction  # the short row is mostly padding
    assert not kv.maybe_compact() and kv.width == len(long)  # nothing to gain: no copy
    generator = torch.Generator().manual_seed(0)
    sequences = [short, long]
    while kv.width * (1 - kv.compact_fraction) <= max(map(len, sequences)):  # verify blocks with one column kept
        _, blocks, counts = step_blocks(kv, sequences, generator, target.vocab_size)
        kv.keep_new(torch.ones(kv.num_rows, dtype=torch.long))
        sequences = [s + blocks[r, :1].tolist() for r, s in enumerate(sequences)]
    assert kv.maybe_compact() and kv.width == max(map(len, sequences))


def test_positions_matter_so_the_kv_check_can_fail(target, prompts):
    """With holes, RoPE at the column index instead of the request's position changes the logits."""
    kv = BatchedKVCache(target)
    kv.add_rows(prefill(target, prompts[:2]))  # row 1 is shorter: its next position != its column
    generator = torch.Generator().manual_seed(0)
    logits, blocks, counts = step_blocks(kv, prompts[:2], generator, target.vocab_size, positions_from_columns=True)
    n = int(counts[1])
    expected = fresh_logits(target, list(prompts[1]) + blocks[1, :n].tolist(), n)
    assert (logits[1, :n] - expected).abs().max() > 1e-3


def test_remove_all_rows_then_join_again(target, prompts):
    kv = BatchedKVCache(target)
    kv.add_rows(prefill(target, prompts[:2]))
    kv.remove_rows(torch.zeros(0, dtype=torch.long))
    assert kv.num_rows == 0 and kv.width == 0
    kv.add_rows(prefill(target, prompts[2:3]))
    logits, blocks, counts = step_blocks(kv, prompts[2:3], torch.Generator().manual_seed(1), target.vocab_size)
    n = int(counts[0])
    torch.testing.assert_close(
        logits[0, :n], fresh_logits(target, list(prompts[2]) + blocks[0, :n].tolist(), n), atol=1e-5, rtol=1e-4
    )


@pytest.mark.parametrize(
    ("kind", "head", "temperature"),
    [("dspark", head, 1.0) for head in SEQUENTIAL_HEADS.ordered() if head != "none"]
    + [("dflash", "none", 1.0), ("dspark", "markov", 0.0)],
)
def test_batched_proposer_equals_dspark_proposer(target, prompts, kind, head, temperature):
    """Same contexts (joined, extended by different counts, a row leaving) → the same drafts, p_d and c_k as one
    DSparkProposer per request with the same generator; many stop ids make rows stop drafting early."""
    drafter = make_drafter(target, kind, head)
    stop_ids = set(range(0, target.vocab_size, 5))
    contexts = [target.forward(torch.tensor([p])).features[0] for p in prompts]
    singles = [DSparkProposer(drafter) for _ in prompts]
    generators = [torch.Generator().manual_seed(10 + i) for i in range(len(prompts))]
    single_generators = [torch.Generator().manual_seed(10 + i) for i in range(len(prompts))]
    batched = BatchedDSparkProposer(drafter)
    rows = [0, 1, 2]  # request index of each row
    batched.add_rows([contexts[i] for i in rows])
    for i in rows:
        singles[i].start(features=contexts[i][None])
    stopped_early = False
    for step in range(4):
        if step == 2:  # request 0 leaves, request 3 joins
            batched.remove_rows(torch.tensor([1, 2]))
            batched.add_rows([contexts[3]])
            singles[3].start(features=contexts[3][None])
            rows = [1, 2, 3]
        anchors = torch.tensor([(7 * i + step) % 50 + 1 for i in rows])
        positions = batched.lengths.clone()
        proposal = batched.propose(
            anchor_tokens=anchors,
            anchor_positions=positions,
            temperature=temperature,
            generators=[generators[i] for i in rows],
            stop_ids=stop_ids,
        )
        for r, i in enumerate(rows):
            single = singles[i].propose(
                anchor_token=int(anchors[r]),
                anchor_position=int(positions[r]),
                temperature=temperature,
                generator=single_generators[i],
                stop_ids=stop_ids,
            )
            count = int(proposal.num_drafts[r])
            stopped_early |= count < GAMMA
            assert count == single.tokens.shape[0] and proposal.tokens[r, :count].tolist() == single.tokens.tolist()
            torch.testing.assert_close(proposal.draft_probs[r, :count], single.draft_probs, atol=1e-5, rtol=1e-4)
            if single.confidences is not None:
                torch.testing.assert_close(proposal.confidences[r, :count], single.confidences, atol=1e-5, rtol=1e-4)
        counts = torch.tensor([1 + (step + r) % 3 for r in range(len(rows))])
        new_features = torch.randn(len(rows), 3, contexts[0].shape[-1], generator=torch.Generator().manual_seed(step))
        batched.extend(features=new_features, counts=counts)
        for r, i in enumerate(rows):
            singles[i].extend(features=new_features[r : r + 1, : int(counts[r])])
    assert stopped_early


def test_eagle3_is_rejected(target):
    with pytest.raises(ValueError, match="drafter=dspark/dflash"):
        BatchedEngine(
            target=target, drafter=make_drafter(target, "eagle3"), policy=None, temperature=1.0, max_new_tokens=4
        )


def test_confidence_policy_needs_a_confidence_head(target):
    with pytest.raises(ValueError, match="serve.policy=threshold"):
        BatchedEngine(
            target=target,
            drafter=make_drafter(target, "dflash"),
            policy=build_serve_policy("threshold"),
            temperature=1.0,
            max_new_tokens=4,
        )


def count_calls(monkeypatch, obj, name):
    """Record each call's first positional argument / keyword arguments of obj.name."""
    calls = []
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return calls


@pytest.mark.parametrize("concurrency", [1, 2, 4])
def test_one_target_and_one_drafter_forward_per_step(target, prompts, monkeypatch, concurrency):
    drafter = make_drafter(target)
    target_calls = count_calls(monkeypatch, target, "forward")
    drafter_calls = count_calls(monkeypatch, drafter, "project")
    engine = BatchedEngine(
        target=target, drafter=drafter, policy=build_serve_policy("fixed"), temperature=1.0, max_new_tokens=8
    )
    requests = [ServeRequest(i, prompts[i % len(prompts)]) for i in range(6)]
    result = engine.serve(requests, concurrency=concurrency, seed=0, progress=False)
    prefills = [c for c in target_calls if int(c[1]["position_ids"].min()) == 0]
    verifies = [c for c in target_calls if int(c[1]["position_ids"].min()) > 0]
    assert len(verifies) == len(result.steps) == len(drafter_calls)
    assert [c[0][0].shape[0] for c in verifies] == [s.num_active for s in result.steps]
    assert [c[0][0].shape[1] for c in verifies] == [1 + max(r.num_verified for r in s.rounds) for s in result.steps]
    assert sum(c[0][0].shape[0] for c in prefills) == len(requests)
    assert max(s.num_active for s in result.steps) == concurrency
    if concurrency == 4:  # four joined at step 0 in one forward, then one by one as slots freed
        assert prefills[0][0][0].shape[0] == 4


def test_bad_requests_are_rejected_alone(target, prompts):
    engine = BatchedEngine(
        target=target,
        drafter=make_drafter(target),
        policy=build_serve_policy("fixed"),
        temperature=0.0,
        max_new_tokens=6,
    )
    too_long = [5] * (target.hf_config.max_position_embeddings - 3)
    good = [ServeRequest(0, prompts[0]), ServeRequest(3, prompts[1])]
    mixed = [good[0], ServeRequest(1, too_long), ServeRequest(2, []), good[1]]
    alone = engine.serve(good, concurrency=2, seed=0, progress=False)
    result = engine.serve(mixed, concurrency=2, seed=0, progress=False)
    by_id = {r.request_id: r for r in result.requests}
    assert by_id[1].stop_reason == "rejected" and "max_position_embeddings" in by_id[1].error
    assert by_id[2].stop_reason == "rejected" and "empty" in by_id[2].error
    assert by_id[1].new_tokens == [] and by_id[1].num_rounds == 0
    assert [by_id[0].new_tokens, by_id[3].new_tokens] == [r.new_tokens for r in alone.requests]
    assert result.summary("fixed").num_requests == 2


def test_concurrency_checks(target, prompts, monkeypatch):
    engine = BatchedEngine(target=target, drafter=make_drafter(target), policy=None, temperature=1.0, max_new_tokens=20)
    requests = [ServeRequest(i, prompts[i % 2]) for i in range(4)]
    with pytest.raises(ValueError, match="serve.concurrency=0"):
        engine.serve(requests, concurrency=0, seed=0, progress=False)
    budget = kv_budget(target=target, drafter=engine.drafter, positions=len(prompts[0]) + 20)
    # tiny: 8 layers × 2 × 2 KV heads × 16 head dim × 4 bytes per position; drafter: 1 layer, same head shape
    assert budget.target_bytes == budget.positions * 8 * 2 * 2 * 16 * 4
    assert budget.drafter_bytes == budget.positions * 1 * 2 * 2 * 16 * 4
    monkeypatch.setattr(kv_module, "available_memory_bytes", lambda device: 5 * budget.per_request)
    with pytest.raises(ValueError, match=r"serve.concurrency=3 .*at most 2 concurrent") as error:
        engine.serve(requests, concurrency=3, seed=0, progress=False)
    assert f"{budget.per_request:,} bytes" in str(error.value)
    engine.serve(requests, concurrency=2, seed=0, progress=False)  # fits


def test_records_are_consistent(target, prompts):
    engine = BatchedEngine(
        target=target,
        drafter=make_drafter(target),
        policy=build_serve_policy("static", static_k=2),
        temperature=1.0,
        max_new_tokens=9,
    )
    requests = [ServeRequest(i, prompts[i % len(prompts)], domain="chat") for i in range(7)]
    result = engine.serve(requests, concurrency=3, seed=0, progress=False)
    rounds = {r.request_id: [] for r in requests}
    for step in result.steps:
        assert step.num_active == len(step.rounds) <= 3
        assert step.batch_tokens == sum(1 + r.num_verified for r in step.rounds)
        assert step.committed == sum(r.committed for r in step.rounds)
        assert len({r.request_id for r in step.rounds}) == len(step.rounds)
        for r in step.rounds:
            assert r.num_verified <= min(2, r.num_drafted) and r.num_accepted <= r.num_verified
            # static k=2 < γ draws 2 drafts at most (the lean step); a proposal it cut carries no accept_if_all
            assert r.num_drafted <= 2
            cut_by_policy = r.num_drafted == 2 < GAMMA
            assert (r.accept_if_all is not None) == (r.num_verified == r.num_drafted and not cut_by_policy)
            rounds[r.request_id].append(r)
    active = [s.num_active for s in result.steps]
    assert active[0] == 3 and min(active) < 3  # full while the queue lasted, then rows left
    for request in result.requests:
        own = rounds[request.request_id]
        committed = 1 + sum(r.committed for r in own)  # the first token comes from the prefill
        assert request.num_rounds == len(own) and request.finished_at >= request.joined_at
        if request.stop_reason == "eos":
            assert committed == len(request.new_tokens)
        else:  # the last round counts whole; new_tokens is cut at max_new_tokens
            assert len(request.new_tokens) == 9 and 0 <= committed - 9 <= GAMMA
        positions = [r.anchor_position for r in own]
        # round i anchors at S + Σ_{j<i} τ_j (the prefill's token sits at S)
        assert positions == [len(request.prompt_ids) + sum(r.committed for r in own[:i]) for i in range(len(own))]
    summary = result.summary("static")
    assert summary.num_requests == len(requests) and summary.num_steps == len(result.steps)
    assert summary.tau == pytest.approx(
        sum(s.committed for s in result.steps) / sum(len(s.rounds) for s in result.steps)
    )


def test_policy_reads_calibrated_confidences(target, prompts):
    """With an STS calibration the records carry c̃ = σ(logit(c)/T_k) and `threshold` cuts on c̃, not on c."""
    calibration = STSCalibration(
        temperatures=[0.5, 2.0, 4.0], grid=[0.5, 2.0, 4.0], n_bins=20, ece_before=[0.0] * GAMMA, ece_after=[0.0] * GAMMA
    )
    engine = BatchedEngine(
        target=target,
        drafter=make_drafter(target),
        policy=build_serve_policy("threshold", threshold=0.5),
        temperature=1.0,
        max_new_tokens=8,
        calibration=calibration,
    )
    result = engine.serve([ServeRequest(i, prompts[i % 3]) for i in range(5)], concurrency=3, seed=0, progress=False)
    rounds = [r for step in result.steps for r in step.rounds]
    for r in rounds:
        raw = torch.tensor(r.confidences, dtype=torch.float64)
        expected = scale_confidence(raw, torch.tensor([0.5, 2.0, 4.0][: len(raw)], dtype=torch.float64))
        torch.testing.assert_close(torch.tensor(r.calibrated, dtype=torch.float64), expected, atol=1e-6, rtol=0)
        below = [k for k, c in enumerate(r.calibrated) if c < 0.5]
        assert r.num_verified == (below[0] if below else r.num_drafted)
    with pytest.raises(ValueError, match="block_size=2"):
        BatchedEngine(
            target=target,
            drafter=make_drafter(target),
            policy=None,
            temperature=1.0,
            max_new_tokens=4,
            calibration=STSCalibration([1.0, 1.0], [1.0], 20, [0.0, 0.0], [0.0, 0.0]),
        )


def test_policies_with_history_are_reset_at_serve_start(target, prompts):
    """`async` keeps the confidences of two steps ago; a second serve must not read the first one's."""
    sps = SPSTable(batch_tokens=list(range(1, 17)), steps_per_second=[1 / (1 + (b - 1) / 6) for b in range(1, 17)])
    engine = BatchedEngine(
        target=target,
        drafter=make_drafter(target),
        policy=build_serve_policy("async", sps=sps),
        temperature=1.0,
        max_new_tokens=8,
    )
    requests = [ServeRequest(i, prompts[i % 3]) for i in range(5)]
    first, second = (engine.serve(requests, concurrency=3, seed=0, progress=False) for _ in range(2))
    assert [r.new_tokens for r in first.requests] == [r.new_tokens for r in second.requests]
    lengths = [[r.num_verified for r in s.rounds] for s in first.steps]
    assert lengths == [[r.num_verified for r in s.rounds] for s in second.steps]


def test_step_overhead_table_and_plan():
    """with_step_overhead adds the seconds to every step's time; a steep verify table that makes a 0.35-survival
    draft not worth verifying alone makes it worth verifying once the step's other ~110 ms are priced."""
    from dspark.scheduling import schedule_verification

    steep = SPSTable(batch_tokens=[8, 9, 16], steps_per_second=[10.0, 9.0, 7.0])  # R = 8: +1 token costs 11%
    priced = steep.with_step_overhead(0.11)
    assert priced.batch_tokens == steep.batch_tokens
    assert priced.steps_per_second == pytest.approx([1 / (0.1 + 0.11), 1 / (1 / 9 + 0.11), 1 / (1 / 7 + 0.11)])
    assert steep.with_step_overhead(0.0).steps_per_second == steep.steps_per_second
    with pytest.raises(ValueError, match="finite and >= 0"):
        steep.with_step_overhead(-0.01)
    survival = torch.full((8, 1), 0.6, dtype=torch.float64)
    assert schedule_verification(survival, sps=steep).sum() == 0  # 8.6 × 9 < 8 × 10: the first draft does not pay
    assert schedule_verification(survival, sps=priced).sum() > 0  # 8.6 / 0.221 > 8 / 0.21 once 110 ms are priced


@pytest.mark.parametrize("policy", ["scheduler", "scheduler:columns", "async"])
def test_measured_step_overhead_reprices_the_policy(target, prompts, policy):
    """serve.step_overhead=measured: after every step the policy plans with its verify table plus the EMA of the
    recorded draft + other seconds; each serve starts again from the verify table; none leaves it untouched.
    "scheduler:columns" (serve.scheduler_cost=columns) keeps its cost model across the repricing."""
    sps = SPSTable(batch_tokens=list(range(1, 17)), steps_per_second=[1 / (1 + (b - 1) / 6) for b in range(1, 17)])
    requests = [ServeRequest(i, prompts[i % 3]) for i in range(4)]
    policy, _, cost = policy.partition(":")
    cost = {"scheduler_cost": cost} if cost else {}
    plain = build_serve_policy(policy, sps=sps, **cost)
    BatchedEngine(target=target, drafter=make_drafter(target), policy=plain, temperature=1.0, max_new_tokens=6).serve(
        requests, concurrency=2, seed=0, progress=False
    )
    assert plain.sps is sps
    measured = build_serve_policy(policy, sps=sps, **cost)
    engine = BatchedEngine(
        target=target,
        drafter=make_drafter(target),
        policy=measured,
        temperature=1.0,
        max_new_tokens=6,
        step_overhead="measured",
    )
    result = engine.serve(requests, concurrency=2, seed=0, progress=False)
    expected = None
    for step in result.steps:
        # "other" splits into the per-row verifier, the context updates and the bookkeeping left over
        assert step.seconds_verify_rows > 0 and step.seconds_extend > 0
        assert step.seconds_verify_rows + step.seconds_extend <= step.seconds_other + 1e-9
        assert step.seconds_bookkeeping == pytest.approx(
            step.seconds_other - step.seconds_verify_rows - step.seconds_extend, abs=1e-9
        )
        seconds = step.seconds_draft + step.seconds_other
        expected = seconds if expected is None else 0.8 * expected + 0.2 * seconds
    assert measured.sps is not sps and expected > 0
    assert measured.sps.steps_per_second == pytest.approx(sps.with_step_overhead(expected).steps_per_second)
    assert getattr(measured, "cost", None) == cost.get("scheduler_cost", "tokens" if policy == "scheduler" else None)
    with pytest.raises(ValueError, match="serve.step_overhead"):
        BatchedEngine(
            target=target,
            drafter=make_drafter(target),
            policy=build_serve_policy(policy, sps=sps),
            temperature=1.0,
            max_new_tokens=6,
            step_overhead="guess",
        )
