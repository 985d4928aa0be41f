"""`dspark.api.speculative_generate` takes the engine's `decode.*` options (static ℓ, drafter precision, step
costs, ...) and they reach the engine: each changes what the rounds show, never the lossless output at T = 0."""

from __future__ import annotations

import pytest
import torch

from dspark.api import speculative_generate
from dspark.drafters.factory import DrafterSpec, build_drafter
from dspark.scheduling import SPSTable

GAMMA = 3
PROMPT = "What is 2+2?"

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread (tests/conftest.py)


@pytest.fixture(scope="module")
def drafter(tiny):
    """An untrained DSpark-Markov drafter (γ = 3, with a confidence head) around the tiny target."""
    spec = DrafterSpec(
        kind="dspark",
        head="markov",
        depth=1,
        block_size=GAMMA,
        markov_rank=8,
        feature_layers=tuple(tiny.feature_layer_ids),
        mask_token_id=tiny.mask_token_id,
        target_fingerprint=tiny.fingerprint,
    )
    torch.manual_seed(0)
    return build_drafter(spec, tiny).eval()


def generate(tiny, drafter, **options):
    return speculative_generate(tiny, drafter, PROMPT, max_new_tokens=12, seed=0, **options)


def test_static_k_sets_the_drafts_verified_per_round(tiny, drafter):
    """policy=static verifies static_k drafts per round (fewer only where drafting stopped), fixed verifies γ."""
    for k in (1, 2):
        rounds = generate(tiny, drafter, policy="static", static_k=k).rounds
        assert max(r.num_verified for r in rounds) == k
        assert all(r.num_verified == min(k, len(r.drafts)) for r in rounds)
    assert max(r.num_verified for r in generate(tiny, drafter, policy="fixed").rounds) == GAMMA


def test_drafter_precision_changes_the_drafter_not_the_greedy_output(tiny, drafter):
    """A bf16 parallel stage gives other confidences than fp32; verification at T = 0 still commits the target's
    greedy continuation. An unknown precision is refused with the config key's name."""
    fp32 = generate(tiny, drafter, temperature=0.0, drafter_precision="fp32")
    bf16 = generate(tiny, drafter, temperature=0.0, drafter_precision="bf16")
    assert bf16.new_tokens == fp32.new_tokens
    assert bf16.rounds[0].confidences != fp32.rounds[0].confidences
    with pytest.raises(ValueError, match="decode.drafter_precision"):
        generate(tiny, drafter, drafter_precision="fp8")


def test_scheduler_options_reach_the_engine(tiny, drafter):
    """The scheduler reads `sps`; `step_costs=measured` re-prices it from the rounds and, at T = 0, commits the same
    tokens; a step_costs outside profile | measured is refused naming decode.step_costs."""
    sps = SPSTable(batch_tokens=[1, 2, 3, 4], steps_per_second=[10.0, 9.5, 9.0, 8.5])
    profiled = generate(tiny, drafter, policy="scheduler", sps=sps, temperature=0.0)
    measured = generate(tiny, drafter, policy="scheduler", sps=sps, temperature=0.0, step_costs="measured")
    assert measured.new_tokens == profiled.new_tokens
    with pytest.raises(ValueError, match="step_costs"):
        generate(tiny, drafter, policy="scheduler", sps=sps, step_costs="fast")
    with pytest.raises(ValueError, match="decode.policy"):
        generate(tiny, drafter, policy="scheduler")  # no SPS table: the scheduler cannot plan


def test_threshold_one_verifies_nothing(tiny, drafter):
    """θ reaches the threshold policy: c_k < 1 always, so no draft is verified and every round commits one token."""
    rounds = generate(tiny, drafter, policy="threshold", threshold=1.0).rounds
    assert all(r.num_verified == 0 and r.committed == 1 for r in rounds)
