"""decode.bypass=cost: the per-round "does drafting pay" gate (`scheduling.bypass`) in the single-request engine.

A bypassed round drafts nothing and is a plain target step, so the output stays the target's. Shown three ways:
with a cost table under which drafting can never pay, every round is bypassed and the sampled (and greedy) tokens
are the target-only engine's token for token under the same seed (both draw one uniform per round); with a free
drafter (no drafting cost, verify cost flat in B) the gate never bypasses and the tokens are those of
decode.bypass=off under the same seed (the gate draws no random number); with a table in between, rounds of both
kinds mix and the tokens pass tests/test_lossless.py's PIT chi-square — which a biased verifier fails (the control).
"""

from __future__ import annotations

import pytest
import torch
from lossless_checks import residual_ignoring_verifier
from test_lossless import NUM_GENERATIONS, P_MIN, chi_square_p_values, make_drafter, sample_generations

from dspark.config import resolve_config
from dspark.config.loader import ConfigError
from dspark.decoding import SpeculativeEngine, build_policy, build_proposer
from dspark.decoding import engine as engine_module
from dspark.scheduling import SPSTable
from dspark.scheduling.bypass import BYPASS_PROBE_EVERY, BypassCosts, DraftingGate

FLAT = SPSTable([1, 16], [1.0, 1.0])  # a target forward costs 1 s whatever B: verifying more is free
MIXED = BypassCosts(draft_seconds=0.25, sps=FLAT)  # drafting pays iff τ̂ ≥ 1.25


# ---- the gate ----


def test_gate_never_drafts_when_drafting_cannot_pay_and_always_when_it_is_free():
    """Cannot pay: even γ'+1 = 4 committed tokens per round lose to 4 plain steps → bypass from the first round,
    never a probe. Free: τ ≥ 1 always pays at least a plain step → never bypass, even after rounds with τ = 1."""
    never = DraftingGate(max_tokens=4, costs=BypassCosts(draft_seconds=3.5, sps=FLAT))
    free = DraftingGate(max_tokens=4, costs=BypassCosts(draft_seconds=0.0, sps=FLAT))
    for _ in range(3 * BYPASS_PROBE_EVERY):
        assert not never.draft()
        never.observe(drafted=False, committed=1, verified=0, seconds=1.0, verify_seconds=1.0)
        assert free.draft()
        free.observe(drafted=True, committed=1, verified=3, seconds=1.0, verify_seconds=1.0)
    assert (never.bypassed, never.drafted, free.bypassed) == (3 * BYPASS_PROBE_EVERY, 0, 0)


def test_gate_follows_the_observed_tau_and_probes_after_a_streak():
    """Table: a round costs 0.6 + 1 s, a plain step 1 s, so drafting pays iff τ̂ ≥ 1.6. Low τ → bypass, until
    `probe_every` plain steps in a row force one drafting round; a high τ there brings drafting back."""
    gate = DraftingGate(max_tokens=4, costs=BypassCosts(draft_seconds=0.6, sps=FLAT), weight=1.0)
    assert gate.draft()  # nothing observed: optimistic (γ' + 1 tokens)
    gate.observe(drafted=True, committed=1, verified=3, seconds=1.6, verify_seconds=1.0)
    decisions = []
    for _ in range(BYPASS_PROBE_EVERY + 1):
        decisions.append(gate.draft())
        if not decisions[-1]:
            gate.observe(drafted=False, committed=1, verified=0, seconds=1.0, verify_seconds=1.0)
    assert decisions == [False] * BYPASS_PROBE_EVERY + [True]  # the probe
    gate.observe(drafted=True, committed=3, verified=3, seconds=1.6, verify_seconds=1.0)
    assert gate.draft() and gate.streak == 0


def test_measured_gate_prices_rounds_by_their_seconds():
    """No table: t̂_round and t̂_plain are the rounds' measured seconds (before a plain step, the verify seconds)."""
    gate = DraftingGate(max_tokens=8, weight=1.0)
    assert gate.draft()
    gate.observe(drafted=True, committed=2, verified=7, seconds=3.0, verify_seconds=1.0)  # 2 tokens / 3 s < 1 / 1 s
    assert not gate.draft()
    gate.observe(drafted=False, committed=1, verified=0, seconds=2.0, verify_seconds=1.0)  # a plain step: 2 s
    assert gate.draft()  # 2 tokens / 3 s > 1 token / 2 s
    with pytest.raises(ValueError, match="draft_seconds"):
        BypassCosts(draft_seconds=float("nan"), sps=FLAT)


def test_config_names_and_the_tree_refusal_name_their_keys():
    with pytest.raises(ConfigError, match=r"decode\.bypass"):
        resolve_config(["decode.bypass=always"])
    with pytest.raises(ConfigError) as err:
        resolve_config(["decode.bypass=cost", "decode.tree.shape=dynamic"])
    assert "decode.bypass=cost" in str(err.value) and "decode.tree.shape=dynamic" in str(err.value)
    assert resolve_config(["decode.bypass=cost"]).cfg.decode.bypass == "cost"


# ---- the engine ----

pytestmark = pytest.mark.usefixtures("one_thread")
TINY_TARGET = {"seed": 1}


@pytest.fixture(scope="module")
def target(tiny):
    """The tiny target with a peaked p_t (as tests/test_lossless.py)."""
    with torch.no_grad():
        tiny.model.get_decoder().norm.weight.mul_(12.0)
    return tiny


@pytest.fixture(scope="module")
def prompt(target):
    return target.chat_prompt_ids("What is 2+2?")


@pytest.fixture(scope="module")
def drafter(target):
    return make_drafter(target, "dspark-markov")


def engine(target, drafter, *, bypass="cost", costs=None, temperature=1.0, max_new_tokens=4, policy="fixed"):
    return SpeculativeEngine(
        target=target,
        proposer=None if drafter is None else build_proposer(drafter),
        policy=build_policy(policy),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        bypass=bypass,
        bypass_costs=costs,
    )


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_when_drafting_cannot_pay_every_round_is_the_target_only_round(target, prompt, drafter, temperature):
    never = engine(target, drafter, costs=BypassCosts(draft_seconds=10.0, sps=FLAT), temperature=temperature)
    alone = engine(target, None, bypass="off", temperature=temperature)
    for seed in range(20):
        got = never.generate(prompt, generator=torch.Generator().manual_seed(seed), max_new_tokens=12)
        want = alone.generate(prompt, generator=torch.Generator().manual_seed(seed), max_new_tokens=12)
        assert got.new_tokens == want.new_tokens
        assert all(r.drafts == [] and r.num_verified == 0 for r in got.rounds)
    assert never.gate.drafted == 0 and never.gate.bypassed > 0


def test_when_drafting_is_free_no_round_is_bypassed(target, prompt, drafter):
    free = engine(target, drafter, costs=BypassCosts(draft_seconds=0.0, sps=FLAT))
    off = engine(target, drafter, bypass="off")
    for seed in range(20):
        got = free.generate(prompt, generator=torch.Generator().manual_seed(seed), max_new_tokens=12)
        want = off.generate(prompt, generator=torch.Generator().manual_seed(seed), max_new_tokens=12)
        assert got.new_tokens == want.new_tokens and len(got.rounds) == len(want.rounds)
        assert all(r.drafts for r in got.rounds)  # every round drafted
    assert free.gate.bypassed == 0 and off.gate is None


def test_mixed_rounds_stay_lossless(target, prompt, drafter):
    """MIXED prices a round at 0.25 + 1 s against 1 s a plain step: drafting pays iff τ̂ ≥ 1.25, near this drafter's
    τ (1.56 on average, 1 on most rounds), so plain steps and drafting rounds interleave about evenly."""
    mixed = engine(target, drafter, costs=MIXED)
    results = sample_generations(mixed, prompt, NUM_GENERATIONS)
    assert mixed.gate.drafted > 100 and mixed.gate.bypassed > 100, (mixed.gate.drafted, mixed.gate.bypassed)
    p_values = chi_square_p_values(target, prompt, results)
    assert min(p_values.values()) > P_MIN, p_values


def test_the_mixed_test_can_fail(target, prompt, drafter, monkeypatch):
    monkeypatch.setattr(engine_module, "verify_drafts_from_logits", residual_ignoring_verifier)
    mixed = engine(target, drafter, costs=MIXED)
    results = sample_generations(mixed, prompt, NUM_GENERATIONS)
    assert mixed.gate.bypassed > 100  # the same mix of rounds as above
    assert chi_square_p_values(target, prompt, results)["pooled"] < P_MIN


def test_measured_bypass_runs_on_the_rounds_own_seconds(target, prompt, drafter):
    """No table: the gate reads the engine's measured round seconds; every round is counted once."""
    measured = engine(target, drafter, max_new_tokens=8)
    rounds = sum(len(r.rounds) for r in sample_generations(measured, prompt, 10))
    assert measured.gate.drafted + measured.gate.bypassed == rounds and measured.gate.drafted >= 1
    assert measured.gate.round_seconds > 0
