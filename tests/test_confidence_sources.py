"""Confidence sources (`decode.confidence`, dspark.decoding.confidence): the registry matches the config, the online
estimator starts at the drafter's max prob and learns from outcomes (censored slots teach nothing), head-less
drafters run the confidence policies with them and decoding stays lossless (test_lossless's chi-square on the
engine's tokens), and why: ℓ chosen from max q stays exact while ℓ chosen from the drawn token's own probability
q(x) is biased (the control, through the real verifier and policy)."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.config import resolve_config
from dspark.config.schema import CONFIDENCE_SOURCES as SCHEMA_SOURCES
from dspark.decoding import SpeculativeEngine, build_policy, build_proposer
from dspark.decoding.confidence import (
    CONFIDENCE_SOURCES,
    DraftMaxProb,
    OnlineLogistic,
    build_confidence_source,
    top_probability,
)
from test_lossless import (  # noqa: F401  (fixtures: target, prompt)
    GAMMA,
    NUM_GENERATIONS,
    P_MIN,
    SPS,
    TINY_TARGET,  # the tiny target's options: the `tiny` fixture reads them from this module
    chi_square_p_values,
    make_drafter,
    prompt,
    sample_generations,
    target,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_registry_matches_the_config_names():
    assert sorted(SCHEMA_SOURCES) == CONFIDENCE_SOURCES.names()
    with pytest.raises(ValueError, match="decode.confidence"):
        build_confidence_source("maxprob", block_size=3)


def test_top_probability_reads_the_sampling_distribution_and_t1_when_greedy():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    t1 = torch.softmax(logits, -1).max()
    assert torch.allclose(top_probability(logits, 1.0), t1)
    assert torch.allclose(top_probability(logits, 0.0), t1)  # greedy: the T = 1 margin, not a one-hot's 1
    assert torch.allclose(top_probability(logits, 0.5), torch.softmax(logits / 0.5, -1).max())
    assert float(top_probability(torch.full((1, 3), float("nan")), 1.0)) == 0.0


def test_online_starts_at_the_drafters_max_prob():
    online, plain = OnlineLogistic(block_size=3), DraftMaxProb()
    top = torch.tensor([0.2, 0.7, 0.95])
    for k in range(3):
        assert torch.allclose(
            online.slot(k, head=None, top_prob=top), plain.slot(k, head=None, top_prob=top), atol=1e-6
        )


def _play(source: OnlineLogistic, rounds: int, *, truth, seed: int = 0) -> None:
    """Rounds of ℓ = γ verified drafts whose slot-k acceptance is truth(k, top), outcomes sampled."""
    rng = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        source.reset(1)
        accepted, alive = 0, True
        for k in range(source.block_size):
            top = torch.rand(1, generator=rng) * 0.9 + 0.05
            source.slot(k, head=None, top_prob=top)
            if alive and float(torch.rand(1, generator=rng)) < truth(k, float(top)):
                accepted += 1
            else:
                alive = False
        source.observe(verified=torch.tensor([source.block_size]), accepted=torch.tensor([accepted]))


def _log_loss(source: OnlineLogistic, *, truth, samples: int = 4000) -> float:
    """Expected log loss of slot-1 predictions under truth (exact in the outcome, sampled in top)."""
    rng = torch.Generator().manual_seed(123)
    total = 0.0
    for _ in range(samples):
        top = torch.rand(1, generator=rng) * 0.9 + 0.05
        c = float(source.slot(0, head=None, top_prob=top))
        p = truth(0, float(top))
        total -= p * math.log(c) + (1 - p) * math.log(1 - c)
    source.reset(1)
    return total / samples


def test_online_learns_a_miscalibrated_max_prob_and_a_tiny_step_does_not():
    def truth(k, top):  # the drafter is overconfident: half its top probability is accepted
        return 0.5 * top

    learner, frozen = OnlineLogistic(block_size=3, lr=0.5, l2=0.0), OnlineLogistic(block_size=3, lr=1e-9, l2=0.0)
    before = _log_loss(OnlineLogistic(block_size=3), truth=truth)
    _play(learner, 600, truth=truth)
    _play(frozen, 600, truth=truth)
    assert _log_loss(learner, truth=truth) < before - 0.02  # learned
    assert abs(_log_loss(frozen, truth=truth) - before) < 1e-4  # the control: no step, no change
    assert learner.updates == 600 and learner.state()["updates"] == 600.0


def test_online_censored_slots_teach_nothing():
    source = OnlineLogistic(block_size=4, lr=1.0, l2=0.0)
    source.reset(1)
    for k in range(4):
        source.slot(k, head=None, top_prob=torch.tensor([0.6]))
    source.observe(verified=torch.tensor([4]), accepted=torch.tensor([1]))  # slot 1 accepted, 2 rejected, 3-4 unseen
    offsets = source.weights[2:]
    assert offsets[0] != 0 and offsets[1] != 0  # observed slots moved
    assert offsets[2] == 0 and offsets[3] == 0  # censored slots did not
    source.reset(1)
    source.observe(verified=torch.tensor([0]), accepted=torch.tensor([0]))  # nothing verified: no update
    assert source.updates == 1


def test_batched_rows_are_observed_separately():
    source = OnlineLogistic(block_size=2, lr=1.0, l2=0.0)
    source.reset(2)
    source.slot(0, head=None, top_prob=torch.tensor([0.9, 0.1]))
    source.slot(1, head=None, top_prob=torch.tensor([0.9, 0.1]))
    source.observe(verified=torch.tensor([2, 1]), accepted=torch.tensor([2, 0]))  # row 0: 2 accepts; row 1: 1 reject
    # mean log-loss gradient over the 3 observed slots, one step of lr 1: slot 2's offset saw one accept at top 0.9
    # (gradient 0.9 − 1); slot 1's an accept at 0.9 and a reject at 0.1 (gradients −0.1 and +0.1) that cancel
    assert source.updates == 1
    assert float(source.weights[3]) == pytest.approx(0.1 / 3, abs=1e-6)
    assert abs(float(source.weights[2])) < 1e-6


def _engine(target, drafter_name, policy, source, *, temperature=1.0):
    """test_lossless's drafter, its LM-head input ×8 more: top probabilities spread over ~0.4–0.98 (median ~0.67),
    so θ = 0.5 and the scheduler choose every ℓ from the head-less sources (×1 they sit near 0.02)."""
    drafter = make_drafter(target, drafter_name)
    with torch.no_grad():
        (drafter.norm if drafter_name == "eagle3" else drafter.backbone.norm).weight.mul_(8.0)
    return SpeculativeEngine(
        target=target,
        proposer=build_proposer(drafter, confidence=source),
        policy=build_policy(policy, threshold=0.5, static_k=2, sps=SPS),
        temperature=temperature,
        max_new_tokens=4,
    )


@pytest.mark.parametrize(
    ("drafter_name", "source_name", "policy"),
    [
        ("dflash", "online", "scheduler"),
        # the slow tier (make test-all): the other sources and drafters
        pytest.param("dflash", "draft_max_prob", "threshold", marks=pytest.mark.slow),
        pytest.param("eagle3", "draft_max_prob", "scheduler", marks=pytest.mark.slow),
        pytest.param("dspark-markov", "online", "threshold", marks=pytest.mark.slow),
    ],
)
def test_head_less_sources_decode_losslessly(target, prompt, drafter_name, source_name, policy):
    source = build_confidence_source(source_name, block_size=GAMMA, lr=0.2)
    engine = _engine(target, drafter_name, policy, source)
    results = sample_generations(engine, prompt, NUM_GENERATIONS)
    rounds = [r for result in results for r in result.rounds]
    assert all(r.confidences is not None for r in rounds)
    assert len({r.num_verified for r in rounds}) >= 2  # the policy really chose ℓ from these confidences
    if source_name == "online":
        assert source.updates > 0 and not torch.equal(source.weights, source.prior)
    p_values = chi_square_p_values(target, prompt, results)
    assert min(p_values.values()) > P_MIN, p_values


# Two tokens {A, B}: the drafter proposes A with 0.8, the target's next token is A with 0.3 (B with 0.7 after it).
Q_DRAFT, P_TARGET = torch.tensor([0.8, 0.2]), torch.tensor([0.3, 0.7])


def _first_token_share_of_a(confidence_of, samples: int = 4000) -> float:
    """P(first committed token = A) when one draft x ~ q is verified iff its confidence ≥ θ = 0.5 (ThresholdPolicy),
    else the target samples the position itself — through the real verifier."""
    from dspark.decoding.verify import sample_from_probs, verify_drafts

    policy, rng = build_policy("threshold", threshold=0.5), torch.Generator().manual_seed(7)
    target_probs = torch.stack([P_TARGET, P_TARGET])  # slot 1 and the bonus slot
    count = 0
    for _ in range(samples):
        x = int(sample_from_probs(Q_DRAFT.unsqueeze(0), rng, trusted=True))
        c = torch.tensor([[confidence_of(x)]])
        if int(policy.choose(confidences=c, num_drafts=1)[0]) == 1:
            first = verify_drafts(
                draft_tokens=torch.tensor([x]),
                draft_probs=Q_DRAFT.unsqueeze(0),
                target_probs=target_probs,
                generator=rng,
            ).tokens[0]
        else:
            first = int(sample_from_probs(P_TARGET.unsqueeze(0), rng, trusted=True))
        count += first == 0
    return count / samples


def test_a_source_that_reads_the_drawn_token_is_biased_and_max_prob_is_not():
    """Why sources read q_k and never q_k(x_k) (module docstring of dspark.decoding.confidence), exactly: with
    c = max q = 0.8 the draft is always verified and A comes out with p_t(A) = 0.3; with c = q(x) (0.8 for A, 0.2 for
    B) only A is verified, and A comes out with 0.8·(0.3/0.8) + 0.2·0.3 = 0.36. Over 4,000 draws a binomial 5-SE band around 0.3
    passes the first and rejects the second (the control)."""
    band = 5 * math.sqrt(0.3 * 0.7 / 4000)
    top = float(DraftMaxProb().slot(0, head=None, top_prob=Q_DRAFT.max().reshape(1)))
    assert abs(_first_token_share_of_a(lambda x: top) - 0.3) < band
    drawn = _first_token_share_of_a(lambda x: float(Q_DRAFT[x]))
    assert abs(drawn - 0.36) < band and abs(drawn - 0.3) > band


def test_config_accepts_head_less_sources_for_headless_drafters_and_refuses_head():
    rc = resolve_config(["budget=smoke", "drafter=dflash", "decode.policy=scheduler", "decode.confidence=online"])
    assert rc.cfg.decode.confidence == "online"
    with pytest.raises(Exception, match="decode.confidence=draft_max_prob or online"):
        resolve_config(["budget=smoke", "drafter=dflash", "decode.policy=scheduler"])
    with pytest.raises(Exception, match="decode.calibrate=false"):
        resolve_config(["budget=smoke", "decode.policy=calibrated_threshold", "decode.calibrate=false"])
    with pytest.raises(Exception, match="decode.confidence"):
        resolve_config(["budget=smoke", "decode.confidence=maxprob"])


def test_engines_refuse_calibrated_threshold_without_a_calibration(target):
    drafter = make_drafter(target, "dspark-markov")
    with pytest.raises(ValueError, match="calibrated_threshold"):
        SpeculativeEngine(
            target=target,
            proposer=build_proposer(drafter),
            policy=build_policy("calibrated_threshold", threshold=0.5),
            temperature=1.0,
            max_new_tokens=4,
        )
