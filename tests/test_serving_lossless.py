"""Lossless serving under load (METHOD §5–§6): with R = 3 requests sharing every step, continuous joins and leaves
and per-request verification lengths from any serving policy, each request's tokens are distributed exactly as
the target's own samples for *its* prompt, and at temperature 0 they are its solo greedy tokens.

Distribution test (the method of tests/test_lossless.py). The tiny target's final norm is scaled up so p_t is
peaked, and the drafter's weights so p_d is peaked elsewhere: drafts are accepted often enough that acceptances,
residual corrections, bonus tokens, KV holes and context updates all happen. Three prompts of different lengths
are served interleaved (request i uses prompt i mod 3), more requests than the concurrency, so rows join and
leave all the time. Every generated token's randomised PIT under the exact conditional of its own prompt,
u = F(x⁻) + V·p_t(x), is U(0, 1) under losslessness; a request leaking into another's row (wrong KV row, wrong
context, wrong generator) makes the PITs non-uniform. `test_the_test_can_fail` catches a verifier whose
correction ignores the residual.

Also covered: a draft vocabulary (Vd = 256 of 512) under every policy of the one family with an STS calibration (so
calibrated and raw policies read different numbers), requests that join and leave at every step (alternating
max_new_tokens 2 and 4: a 2-token request leaves after its first step), and a faulty drafter whose NaN / all −inf
slots are never proposed (tests/test_lossless.py `faulty`).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dspark.calibration.sts import STSCalibration
from dspark.decoding import DSparkProposer, SpeculativeEngine, build_policy
from dspark.drafters.factory import DrafterSpec, build_drafter
from dspark.scheduling import SPSTable
from dspark.serving import BatchedEngine, BatchedKVCache, ServeRequest, build_serve_policy, request_generator
from dspark.serving import engine as engine_module
from lossless_checks import pit_values, residual_ignoring_verifier, uniformity_p_values
from test_lossless import draft_vocab, faulty, usable_prefix

GAMMA = 3
NEW_TOKENS = 4  # token 1 comes from the prefill; 2..4 from rounds
NUM_REQUESTS = 240  # 80 per prompt; ≈ 3 s per policy on one core
CONCURRENCY = 3
P_MIN = 1e-3
TEXTS = ("What is 2+2?", "Hi", "Write a short poem about the sea and the wind, please.")
# Admitting candidate n of the scheduler's order pays off while its survival is large enough (see
# tests/test_policies.py): with R = 3 rows B starts at 3 and the steps shrink slowly, so ℓ varies from 0 to γ.
SPS = SPSTable(batch_tokens=list(range(1, 17)), steps_per_second=[1 / (1 + (b - 1) / 6) for b in range(1, 17)])
# "scheduler:columns" is the scheduler with serve.scheduler_cost=columns (whole columns, `plan_columns`).
POLICIES = ("mtp1", "static", "fixed", "threshold", "calibrated_threshold", "scheduler", "scheduler:columns", "async")
CALIBRATION = STSCalibration(temperatures=[2.0, 0.5, 1.0], grid=[0.5, 1.0, 2.0], n_bins=20, ece_before=[], ece_after=[])


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread (tests/conftest.py)


TINY_TARGET = {"seed": 1}  # the `tiny` fixture's options (tests/conftest.py)


@pytest.fixture(scope="module")
def target(tiny):
    """The tiny target with a peaked p_t (argmax unchanged by the scaling)."""
    with torch.no_grad():
        tiny.model.get_decoder().norm.weight.mul_(12.0)
    return tiny


@pytest.fixture(scope="module")
def prompts(target):
    prompts = [target.chat_prompt_ids(text) for text in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    return prompts


def build_test_drafter(target, ids=None):
    """Weights ×5 and a ×6 LM-head input (peaked p_d); the confidence head reads only W_1[x_{k-1}] (logit std ≈ 2,
    bias 0.5), so c_k varies with the previous token and the confidence policies pick every ℓ in 0..γ.
    ids: a draft vocabulary (None = the full one)."""
    spec = DrafterSpec(
        kind="dspark",
        head="markov",
        depth=1,
        block_size=GAMMA,
        markov_rank=8,
        feature_layers=tuple(target.feature_layer_ids),
        mask_token_id=target.mask_token_id,
        target_fingerprint=target.fingerprint,
        draft_vocab_size=0 if ids is None else len(ids),
    )
    torch.manual_seed(0)
    drafter = build_drafter(spec, target, draft_vocab_ids=ids)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" not in name and "confidence" not in name:
                param.mul_(5.0)
        drafter.backbone.norm.weight.mul_(6.0)
        proj, w1 = drafter.confidence_head.proj, drafter.head.w1.weight
        proj.weight.zero_()
        proj.weight[0, drafter.spec.hidden_size :] = torch.randn(w1.shape[1]) * 2.0 / w1.norm(dim=1).mean()
        proj.bias.fill_(0.5)
    return drafter.eval()


@pytest.fixture(scope="module")
def drafter(target):
    return build_test_drafter(target)


@pytest.fixture(scope="module")
def vocab_drafter(target):
    return build_test_drafter(target, draft_vocab(target))


def make_engine(target, drafter, policy, *, temperature=1.0, max_new_tokens=NEW_TOKENS, calibration=None):
    """policy: a serve.policy name, or "scheduler:<serve.scheduler_cost>"."""
    name, _, cost = policy.partition(":")
    if calibration is None and name == "calibrated_threshold":
        # the engines refuse calibrated_threshold without a calibration (no silent raw fallback); the identity
        # STS (every T_k = 1) reads the same numbers as the raw c_k, which is what this test always exercised
        calibration = STSCalibration(temperatures=[1.0] * GAMMA, grid=[1.0], n_bins=20, ece_before=[], ece_after=[])
    serve_policy = (
        None
        if drafter is None
        else build_serve_policy(name, static_k=2, threshold=0.5, sps=SPS, scheduler_cost=cost or "tokens")
    )
    return BatchedEngine(
        target=target,
        drafter=drafter,
        policy=serve_policy,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        calibration=calibration,
    )


def interleaved_requests(prompts, num, limits=None):
    """Request i uses prompt i mod 3 and, when `limits` is given, max_new_tokens limits[i mod len(limits)]."""
    return [
        ServeRequest(
            request_id=i,
            prompt_ids=prompts[i % len(prompts)],
            max_new_tokens=None if limits is None else limits[i % len(limits)],
        )
        for i in range(num)
    ]


def chi_square_p_values(target, prompts, requests, results) -> dict[str, float]:
    """10-bin chi-square p-values of the PITs at each position from 2 on (all prompts together, each token under
    its own prompt's conditional) and pooled over positions. Token 1 comes from the prefill alone."""
    rng = np.random.default_rng(0)
    columns: dict[int, list[np.ndarray]] = {}
    for prompt in prompts:
        sequences = [res.new_tokens for req, res in zip(requests, results) if req.prompt_ids == prompt]
        for k, u in enumerate(pit_values(target, prompt, sequences, rng)[1:]):
            columns.setdefault(k + 2, []).append(u)
    groups = {f"position {k}": np.concatenate(u) for k, u in columns.items()}
    groups["pooled"] = np.concatenate(list(groups.values()))
    return uniformity_p_values(groups)


def serve(engine, requests, seed=0):
    return engine.serve(requests, concurrency=CONCURRENCY, seed=seed, progress=False)


@pytest.mark.parametrize("policy", POLICIES)
def test_sampling_matches_the_target_distribution(target, prompts, drafter, policy):
    requests = interleaved_requests(prompts, NUM_REQUESTS)
    result = serve(make_engine(target, drafter, policy), requests)
    rounds = [r for step in result.steps for r in step.rounds]
    assert any(r.num_accepted > 0 for r in rounds) and any(r.num_accepted < r.num_verified for r in rounds)
    assert max(s.num_active for s in result.steps) == CONCURRENCY
    lengths = {r.num_verified for r in rounds}
    expected = {"mtp1": {1}, "static": {2}, "fixed": {GAMMA}}.get(policy, {0, 1, 2, GAMMA})
    assert expected <= lengths, lengths  # the policy really chooses per request (drafted stop ids aside)
    if policy == "scheduler:columns":  # whole columns: one k per step, ℓ_r = min(k, γ'_r), and k varies
        widths = {max(r.num_verified for r in step.rounds) for step in result.steps}
        assert len(widths) > 1 and all(
            r.num_verified == min(max(o.num_verified for o in step.rounds), r.num_drafted)
            for step in result.steps
            for r in step.rounds
        )
    if (
        policy not in ("fixed", "async")
    ):  # the lean step (async: its capacity is not known while drafting): drafts nobody verifies are not drawn, and the records say so
        assert any(r.num_drafted == r.num_verified < GAMMA and r.accept_if_all is None for r in rounds)
    p_values = chi_square_p_values(target, prompts, requests, result.requests)
    assert len(p_values) == NEW_TOKENS and min(p_values.values()) > P_MIN, p_values


@pytest.mark.parametrize("policy", POLICIES)
def test_draft_vocabulary_with_joins_and_leaves_at_every_step(target, prompts, vocab_drafter, policy):
    """Vd < V, calibrated confidences, and requests alternating max_new_tokens 2 and 4: the set of active requests
    changes at (nearly) every step, and every request's tokens still follow its own prompt's target conditionals."""
    requests = interleaved_requests(prompts, NUM_REQUESTS, limits=(2, 4))
    result = serve(make_engine(target, vocab_drafter, policy, calibration=CALIBRATION), requests)
    rounds = [r for step in result.steps for r in step.rounds]
    allowed = set(draft_vocab(target).tolist())
    sequences = {r.request_id: [*r.prompt_ids, *r.new_tokens] for r in result.requests}
    assert all(set(accepted_drafts(sequences[r.request_id], r)) <= allowed for r in rounds)
    active = [{r.request_id for r in step.rounds} for step in result.steps]
    changes = sum(a != b for a, b in zip(active, active[1:])) / max(1, len(active) - 1)
    assert changes > 0.95, changes  # a join or a leave between (almost) every two steps
    assert any(r.num_accepted > 0 for r in rounds) and any(r.num_accepted < r.num_verified for r in rounds)
    assert {"mtp1": {1}, "static": {2}, "fixed": {GAMMA}}.get(policy, {0, 1, 2}) <= {r.num_verified for r in rounds}
    p_values = chi_square_p_values(target, prompts, requests, result.requests)
    assert len(p_values) == NEW_TOKENS and min(p_values.values()) > P_MIN, p_values


def test_faulty_drafter_rows_are_never_proposed_and_stay_lossless(target, prompts):
    drafter = faulty(build_test_drafter(target, draft_vocab(target)))
    requests = interleaved_requests(prompts, NUM_REQUESTS)
    result = serve(make_engine(target, drafter, "scheduler", calibration=CALIBRATION), requests)
    sequences = {r.request_id: [*r.prompt_ids, *r.new_tokens] for r in result.requests}
    rounds = [r for step in result.steps for r in step.rounds]
    for r in rounds:  # no slot after an even x_{k-1} (NaN / all −inf logits) was drafted
        known = [sequences[r.request_id][r.anchor_position], *accepted_drafts(sequences[r.request_id], r)]
        first_faulty = next((k for k, token in enumerate(known) if token % 2 == 0), None)
        assert first_faulty is None or r.num_drafted <= first_faulty
        assert usable_prefix(known[0], known[1:])
    assert any(r.num_drafted == 0 for r in rounds) and any(r.num_drafted == GAMMA for r in rounds)
    assert any(r.num_accepted > 0 for r in rounds)
    assert all(c == c for r in rounds for c in (r.confidences or []))  # NaN confidences read as 0
    p_values = chi_square_p_values(target, prompts, requests, result.requests)
    assert len(p_values) == NEW_TOKENS and min(p_values.values()) > P_MIN, p_values


def accepted_drafts(sequence, round_):
    """x_1..x_A of a round: the accepted drafts are the committed tokens right after its anchor."""
    start = round_.anchor_position + 1
    return sequence[start : start + round_.num_accepted]


def test_the_test_can_fail(target, prompts, drafter, monkeypatch):
    monkeypatch.setattr(engine_module, "verify_drafts_from_logits", residual_ignoring_verifier)
    requests = interleaved_requests(prompts, NUM_REQUESTS)
    result = serve(make_engine(target, drafter, "fixed"), requests)
    assert chi_square_p_values(target, prompts, requests, result.requests)["pooled"] < P_MIN


def test_sampling_equals_the_single_request_engine(target, prompts, drafter):
    """With `fixed` each request's ℓ depends on its own drafts only, so with its (seed, request_id) generator it
    must reproduce the single-request engine token for token: no randomness or state shared across rows."""
    requests = interleaved_requests(prompts, 9)
    result = serve(make_engine(target, drafter, "fixed", max_new_tokens=10), requests, seed=5)
    solo = SpeculativeEngine(
        target=target,
        proposer=DSparkProposer(drafter),
        policy=build_policy("fixed"),
        temperature=1.0,
        max_new_tokens=10,
    )
    for request, served in zip(requests, result.requests):
        reference = solo.generate(request.prompt_ids, generator=request_generator(5, request.request_id))
        assert served.new_tokens == reference.new_tokens
        assert served.num_rounds == len(reference.rounds)


def solo_greedy(target):
    return SpeculativeEngine(target=target, proposer=None, policy=None, temperature=0.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def greedy_references(target, prompts):
    """Each prompt's solo greedy output (the single-request target-only engine at T = 0), with an extra stop id
    that only the first prompt's greedy path emits (3rd token or later), so that request ends early while the
    others go on."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before the one_thread fixture
    paths = [solo_greedy(target).generate(p, generator=None).new_tokens for p in prompts]
    stop = next(
        t
        for k, t in enumerate(paths[0])
        if k >= 2 and t not in paths[0][:k] and not any(t in other for other in paths[1:])
    )
    stopped = copy.copy(target)
    stopped.stop_token_ids = [*target.stop_token_ids, stop]
    references = [solo_greedy(stopped).generate(p, generator=None) for p in prompts]
    torch.set_num_threads(threads)
    return stopped, references


@pytest.mark.parametrize("policy", (*POLICIES, "target-only"))
def test_greedy_equals_solo_greedy(prompts, drafter, greedy_references, policy):
    stopped, references = greedy_references
    assert references[0].stop_reason == "eos" and references[1].stop_reason == "max_new_tokens"
    requests = interleaved_requests(prompts, 7)
    engine = make_engine(
        stopped, None if policy == "target-only" else drafter, policy, temperature=0.0, max_new_tokens=10
    )
    result = serve(engine, requests)
    for request, served in zip(requests, result.requests):
        reference = references[request.request_id % len(prompts)]
        assert served.new_tokens == reference.new_tokens and served.stop_reason == reference.stop_reason


def test_a_row_mixup_is_caught(prompts, drafter, greedy_references, monkeypatch):
    """The greedy check can fail: a KV store that keeps the surviving rows' keys in the wrong order when a request
    leaves (its mask rows right) hands requests each other's context."""
    original = BatchedKVCache.remove_rows

    def mixed_up(self, keep_rows):
        original(self, keep_rows)
        if self.num_rows > 1:
            self.cache.batch_select_indices(torch.arange(self.num_rows).flip(0))

    monkeypatch.setattr(BatchedKVCache, "remove_rows", mixed_up)
    stopped, references = greedy_references
    requests = interleaved_requests(prompts, 7)
    result = serve(make_engine(stopped, drafter, "fixed", temperature=0.0, max_new_tokens=10), requests)
    assert any(
        served.new_tokens != references[request.request_id % len(prompts)].new_tokens
        for request, served in zip(requests, result.requests)
    )
