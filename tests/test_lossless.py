"""Lossless decoding end to end (METHOD §5): whatever the drafter and policy, the engine's tokens are distributed
exactly as the target's own samples, and at temperature 0 they are the target's greedy tokens.

Distribution test. The tiny target's final norm is scaled up so that p_t is peaked (top-10 mass ≈ 0.4), and the
drafters' weights are scaled so that p_d is peaked elsewhere: about a quarter of the drafts are accepted, so
acceptances, rejections with residual sampling, bonus tokens, cache rollbacks and context updates all happen.
For every generated token x_k the exact conditional p_t(· | prompt, x_<k) comes from one batched cache-free
forward; the randomised probability integral transform u = F(x_k⁻) + V·p_t(x_k) (tokens ordered by p_t,
V ~ U(0, 1)) is then exactly U(0, 1) under losslessness, independently across samples. Each position's u's
go through a 10-bin chi-square test. `test_the_test_can_fail` shows the same test catching a verifier whose
correction ignores the residual.

Also covered: a draft vocabulary (Vd = 256 of the tiny target's 512 ids, so p_t has mass the drafter can never
propose) under every policy of the one family, with an STS calibration so `calibrated_threshold`, `scheduler` and
`async` read other numbers than `threshold`; the bf16 parallel stage; and a faulty drafter (NaN, all −inf and
all-zero logits at slots chosen by x_{k-1}, NaN confidences), whose unusable slots are never proposed; the int8
parallel stage (`decode.drafter_precision=int8`).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dspark.calibration.sts import STSCalibration
from dspark.config.schema import CONFIDENCE_HEAD, CONFIDENCE_POLICIES, FIXED_HEAD
from dspark.decoding import POLICIES as POLICY_REGISTRY
from dspark.decoding import SpeculativeEngine, build_policy, build_proposer
from dspark.decoding import engine as engine_module
from dspark.drafters.factory import DRAFTER_BUILDERS, DrafterSpec, build_drafter
from dspark.drafters.heads import SEQUENTIAL_HEADS
from dspark.scheduling import SPSTable
from lossless_checks import pit_values, residual_ignoring_verifier, uniformity_p_values

GAMMA = 3
NEW_TOKENS = 4  # token 1 comes from the prefill; 2..4 from rounds
NUM_GENERATIONS = 300  # ≈ 4 s per drafter/policy pair on one core
P_MIN = 1e-3
# Slot j is admitted while Θ improves; for slot 1 that is a_1 > 0.5 (see tests/test_policies.py).
SPS = SPSTable(batch_tokens=list(range(1, 10)), steps_per_second=[1 / (1 + (b - 1) / 2) for b in range(1, 10)])


def lossless_drafters() -> dict[str, tuple[str, str]]:
    """name → (kind, head) of every registered drafter: '<kind>' for a kind that fixes its head (config.schema
    FIXED_HEAD), '<kind>-<head>' for every registered head but `none` otherwise — so a newly registered drafter or
    head is tested here with no edit (tests/test_registry_coverage.py checks that)."""
    out = {}
    for kind in DRAFTER_BUILDERS.ordered():
        fixed = FIXED_HEAD.get(kind)
        heads = [fixed] if fixed is not None else [h for h in SEQUENTIAL_HEADS.ordered() if h != "none"]
        out |= {kind if fixed is not None else f"{kind}-{head}": (kind, head) for head in heads}
    return out


# name → (kind, head); a "-vd" suffix drafts over DRAFT_VOCAB, "-bf16" runs the parallel stage in bf16.
DRAFTERS = lossless_drafters() | {
    "dspark-markov-vd": ("dspark", "markov"),
    "dflash-vd": ("dflash", "none"),
    "eagle3-vd": ("eagle3", "none"),
    "dspark-rnn-vd-bf16": ("dspark", "rnn"),
    "dspark-markov-vd-int8": ("dspark", "markov"),
}
POLICIES = ("fixed", "threshold", "scheduler")
ALL_POLICIES = tuple(POLICY_REGISTRY.ordered())
CASES = (
    [(d, p) for d in lossless_drafters() for p in POLICIES]
    + [("dspark-markov-vd", p) for p in ALL_POLICIES]
    + [
        ("dflash-vd", "fixed"),
        ("eagle3-vd", "fixed"),
        ("dspark-rnn-vd-bf16", "scheduler"),
        ("dspark-markov-vd-int8", "scheduler"),
    ]
)


# The fast tier (`make test`) keeps a draft-dependent ℓ (threshold) for every registered drafter and head, the fixed,
# threshold and both planning policies on the draft-vocabulary DSpark (mtp1, static and calibrated_threshold are
# fixed-length or threshold rules covered there), and the fixed policy on the draft-vocabulary DFlash and EAGLE-3;
# every case runs in the slow tier (`make test-all`).
FAST_CASES = (
    {(d, "threshold") for d in lossless_drafters()}
    | {("dspark-markov-vd", p) for p in ("fixed", "threshold", "scheduler", "async")}
    | {("dflash-vd", "fixed"), ("eagle3-vd", "fixed")}
)
TIERED_CASES = [pytest.param(*case, marks=() if case in FAST_CASES else pytest.mark.slow) for case in CASES]


def needs_confidence_head(drafter_name: str, policy: str) -> bool:
    """A policy that reads c_k with a drafter that has no confidence head (DFlash, EAGLE-3): refused."""
    return not CONFIDENCE_HEAD[DRAFTERS[drafter_name][0]] and policy in CONFIDENCE_POLICIES


# Uneven per-slot temperatures: calibrated confidences differ from the raw ones in both directions.
CALIBRATION = STSCalibration(temperatures=[2.0, 0.5, 1.0], grid=[0.5, 1.0, 2.0], n_bins=20, ece_before=[], ece_after=[])
EXPECTED_LENGTHS = {"fixed": {GAMMA}, "mtp1": {1}, "static": {2}}  # others: every ℓ in 0..2 at least
# Policies whose proposers stop drafting early (`max_drafts`, `stop_drafting`) → the most slots a proposal may have.
LEAN_POLICIES = {"mtp1": 1, "static": 2, "threshold": GAMMA, "calibrated_threshold": GAMMA, "scheduler": GAMMA}


def draft_vocab(target) -> torch.Tensor:
    """256 of the 512 target ids (fixed seed), sorted: the drafter can never propose the other half."""
    return torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(5))[:256].sort().values


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread (tests/conftest.py)


TINY_TARGET = {"seed": 1}  # the `tiny` fixture's options (tests/conftest.py)


@pytest.fixture(scope="module")
def target(tiny):
    """The tiny target (seed 1: a varied greedy path) with a peaked p_t; argmax is unchanged by the scaling."""
    with torch.no_grad():
        tiny.model.get_decoder().norm.weight.mul_(12.0)
    return tiny


@pytest.fixture(scope="module")
def prompt(target):
    return target.chat_prompt_ids("What is 2+2?")


def make_drafter(target, name):
    """A fresh drafter with weights ×5 (p_d far from uniform) and a ×6 LM-head input (peaked p_d). Its confidence
    head reads only W_1[x_{k-1}] (logit std ≈ 2, bias 0.5): c_k then varies from round to round with the
    previous token — the very dependence on x_{k-1} that makes a look-ahead policy biased (METHOD §6) — and the
    threshold and scheduler choose every ℓ in 0..γ."""
    kind, head = DRAFTERS[name]
    ids = draft_vocab(target) if "-vd" in name else None
    spec = DrafterSpec(
        kind=kind,
        head=head,
        depth=1,
        block_size=GAMMA,
        markov_rank=8 if head != "none" else 0,
        feature_layers=tuple(target.feature_layer_ids),
        mask_token_id=target.mask_token_id,
        target_fingerprint=target.fingerprint,
        draft_vocab_size=0 if ids is None else len(ids),
    )
    torch.manual_seed(0)
    drafter = build_drafter(spec, target, draft_vocab_ids=ids)
    with torch.no_grad():
        for param_name, param in drafter.named_parameters():
            if "norm" not in param_name and "confidence" not in param_name:
                param.mul_(5.0)
        (drafter.norm if kind == "eagle3" else drafter.backbone.norm).weight.mul_(6.0)
        if getattr(drafter, "confidence_head", None) is not None:
            proj, w1 = drafter.confidence_head.proj, drafter.head.w1.weight
            proj.weight.zero_()
            proj.weight[0, drafter.spec.hidden_size :] = torch.randn(w1.shape[1]) * 2.0 / w1.norm(dim=1).mean()
            proj.bias.fill_(0.5)
    return drafter.eval()


def make_engine(
    target, drafter_name, policy, *, temperature=1.0, max_new_tokens=NEW_TOKENS, drafter=None, step_costs="profile"
):
    drafter = make_drafter(target, drafter_name) if drafter is None else drafter
    precision = drafter_name.rsplit("-", 1)[-1] if drafter_name.endswith(("-bf16", "-int8")) else "fp32"
    proposer = build_proposer(drafter, precision=precision)
    calibration = CALIBRATION if "-vd" in drafter_name and proposer.has_confidence else None
    return SpeculativeEngine(
        target=target,
        proposer=proposer,
        policy=build_policy(policy, threshold=0.5, static_k=2, sps=SPS),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        calibration=calibration,
        step_costs=step_costs,
    )


def sample_generations(engine, prompt, num, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [engine.generate(prompt, generator=generator) for _ in range(num)]


def chi_square_p_values(target, prompt, results) -> dict[str, float]:
    """10-bin chi-square p-values of the PIT values at each position from 2 on, and of positions 2.. pooled
    (the PITs of successive tokens are independent uniforms too). Token 1 comes from the prefill alone."""
    u_values = pit_values(target, prompt, [r.new_tokens for r in results], np.random.default_rng(0))[1:]
    groups = {f"position {k + 2}": u for k, u in enumerate(u_values)} | {"pooled": np.concatenate(u_values)}
    return uniformity_p_values(groups)


@pytest.mark.parametrize(("drafter_name", "policy"), TIERED_CASES)
def test_sampling_matches_the_target_distribution(target, prompt, drafter_name, policy):
    if needs_confidence_head(drafter_name, policy):  # DFlash and EAGLE-3 have no confidence head
        with pytest.raises(ValueError, match="confidence head"):
            make_engine(target, drafter_name, policy)
        return
    results = sample_generations(make_engine(target, drafter_name, policy), prompt, NUM_GENERATIONS)
    rounds = [r for result in results for r in result.rounds]
    assert any(r.num_accepted > 0 for r in rounds) and any(r.num_accepted < r.num_verified for r in rounds)
    expected = EXPECTED_LENGTHS.get(policy, {0, 1, 2})
    assert expected <= {r.num_verified for r in rounds}  # the policy really truncates, differently per round
    if policy in LEAN_POLICIES:  # drafts nobody verifies are not drawn (the lean round), and that stays lossless
        assert all(len(r.drafts) <= LEAN_POLICIES[policy] for r in rounds)
        assert any(len(r.drafts) == r.num_verified < GAMMA for r in rounds)
    if "-vd" in drafter_name:
        allowed = set(draft_vocab(target).tolist())
        assert all(set(r.drafts) <= allowed for r in rounds)
        outside = [t for result in results for t in result.new_tokens[1:] if t not in allowed]
        assert outside  # the target still emits tokens the drafter cannot propose (via corrections and bonuses)
    p_values = chi_square_p_values(target, prompt, results)
    assert len(p_values) == NEW_TOKENS and min(p_values.values()) > P_MIN, p_values


def test_sampling_with_round_costs_measured_while_decoding_matches_the_target_distribution(target, prompt):
    """decode.step_costs=measured: the scheduler is re-priced after every round from the rounds' own (real, timing-
    dependent) verify and drafting times, so ℓ follows the clock, not just the confidences — still lossless."""
    engine = make_engine(target, "dspark-markov-vd", "scheduler", step_costs="measured")
    results = sample_generations(engine, prompt, NUM_GENERATIONS)
    rounds = [r for result in results for r in result.rounds]
    assert engine.round_costs.rounds == len(rounds) and engine.policy.sps is not SPS  # re-priced, from every round
    assert any(r.num_accepted > 0 for r in rounds) and len({r.num_verified for r in rounds}) > 1
    p_values = chi_square_p_values(target, prompt, results)
    assert len(p_values) == NEW_TOKENS and min(p_values.values()) > P_MIN, p_values


def faulty(drafter):
    """Wrap `sequential_step`: by x_{k-1} mod 4 the slot's logits are NaN (0), all −inf (2), all zero (1, a valid
    uniform distribution) or the drafter's own (3); NaN confidences at 0. Works for [1] and [R] previous tokens."""
    step = drafter.sequential_step

    def broken(*, hidden_k, parallel_logits_k, prev_token, state):
        logits, confidence, state = step(
            hidden_k=hidden_k, parallel_logits_k=parallel_logits_k, prev_token=prev_token, state=state
        )
        mod = (prev_token % 4).unsqueeze(-1)
        logits = torch.where(mod == 0, float("nan"), logits)
        logits = torch.where(mod == 2, float("-inf"), logits)
        logits = torch.where(mod == 1, 0.0, logits)
        if confidence is not None:
            confidence = torch.where(mod[..., 0] == 0, float("nan"), confidence)
        return logits, confidence, state

    drafter.sequential_step = broken
    return drafter


def usable_prefix(anchor, drafts) -> bool:
    """Every proposed slot k had an odd x_{k-1}: no slot with unusable logits was ever sampled or verified."""
    return all(token % 2 == 1 for token in [anchor, *drafts][: len(drafts)])


@pytest.mark.parametrize(
    ("drafter_name", "policy"),
    [("dspark-markov-vd", "fixed"), pytest.param("dspark-rnn", "scheduler", marks=pytest.mark.slow)],
)
def test_faulty_drafter_slots_are_never_proposed_and_the_output_is_still_the_targets(
    target, prompt, drafter_name, policy
):
    engine = make_engine(target, drafter_name, policy, drafter=faulty(make_drafter(target, drafter_name)))
    results = sample_generations(engine, prompt, NUM_GENERATIONS)
    rounds = [(result, r) for result in results for r in result.rounds]
    sequences = {id(result): [*prompt, *result.new_tokens] for result in results}
    assert all(usable_prefix(sequences[id(res)][r.anchor_position], r.drafts) for res, r in rounds)
    assert any(len(r.drafts) == 0 for _, r in rounds) and any(len(r.drafts) == GAMMA for _, r in rounds)
    assert any(r.num_accepted > 0 for _, r in rounds)  # the remaining drafts (uniform ones included) still work
    assert all(c == c for _, r in rounds for c in (r.confidences or []))  # NaN confidences were read as 0
    p_values = chi_square_p_values(target, prompt, results)
    assert len(p_values) == NEW_TOKENS and min(p_values.values()) > P_MIN, p_values


def test_the_test_can_fail(target, prompt, monkeypatch):
    monkeypatch.setattr(engine_module, "verify_drafts_from_logits", residual_ignoring_verifier)
    results = sample_generations(make_engine(target, "dspark-markov", "fixed"), prompt, NUM_GENERATIONS)
    assert chi_square_p_values(target, prompt, results)["pooled"] < P_MIN


def hf_greedy(target, prompt, *, max_new_tokens, stop_ids):
    out = target.model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(stop_ids),
        pad_token_id=target.tokenizer.pad_token_id,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def greedy_cases(target, prompt):
    """(stop ids, expected stop reason, HF's greedy tokens): one run to max_new_tokens, one ending at a stop id
    that the greedy path emits as its 6th token."""
    free = hf_greedy(target, prompt, max_new_tokens=20, stop_ids=target.stop_token_ids)
    assert len(free) == 20 and not set(free) & set(target.stop_token_ids)
    stop = free[5]
    assert stop not in free[:5]
    stopped = hf_greedy(target, prompt, max_new_tokens=20, stop_ids=[stop])
    assert stopped == free[:6]
    return [(list(target.stop_token_ids), "max_new_tokens", free), ([stop], "eos", stopped)]


@pytest.mark.parametrize(("drafter_name", "policy"), [c for c in CASES if not needs_confidence_head(*c)])
def test_greedy_equals_hf_generate(target, prompt, greedy_cases, drafter_name, policy):
    for stop_ids, reason, expected in greedy_cases:
        stopped = copy.copy(target)
        stopped.stop_token_ids = stop_ids
        result = make_engine(stopped, drafter_name, policy, temperature=0.0, max_new_tokens=20).generate(
            prompt, generator=torch.Generator().manual_seed(0)
        )
        assert result.new_tokens == expected and result.stop_reason == reason
