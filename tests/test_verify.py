"""The verifier (dspark.decoding.verify): losslessness by distribution tests, greedy paths, batched == single."""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from torch import Tensor

from dspark.decoding.verify import (
    probs_from_logits,
    sample_from_probs,
    verify_drafts,
    verify_drafts_batched,
)

V = 5
P_T1 = torch.tensor([0.35, 0.25, 0.2, 0.15, 0.05], dtype=torch.float64)
# p_t for slot 2 depends on the first token (row = x_1); one row has a zero the residual must respect.
P_T2 = torch.tensor(
    [
        [0.1, 0.2, 0.3, 0.2, 0.2],
        [0.5, 0.1, 0.1, 0.2, 0.1],
        [0.2, 0.2, 0.2, 0.2, 0.2],
        [0.0, 0.4, 0.3, 0.2, 0.1],
        [0.3, 0.3, 0.1, 0.1, 0.2],
    ],
    dtype=torch.float64,
)
P_T3 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)

DRAFT_CASES = {
    # name: (p_d for slot 1 [V], p_d for slot 2 given x_1 [V, V])
    "arbitrary": (
        torch.tensor([0.1, 0.4, 0.1, 0.1, 0.3]),
        torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.1]] * 2 + [[0.05, 0.05, 0.3, 0.3, 0.3]] * 3),
    ),
    "zeros_where_target_positive": (
        torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0]),
        torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]] * 3 + [[0.5, 0.0, 0.0, 0.0, 0.5]] * 2),
    ),
    "equal_to_target": (P_T1, P_T2),
    "one_hot_on_rare_token": (torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0]), torch.eye(V)[[4, 3, 2, 1, 0]]),
}


def _simulate(p_d1: Tensor, p_d2: Tensor, num: int, seed: int) -> tuple[Tensor, Tensor]:
    """Full pipeline, vectorised over `num` independent generations: draft, verify with a random ℓ ∈ {0,1,2},
    and, when no draft was accepted, a second round from the correction. Returns the first two committed tokens."""
    gen = torch.Generator().manual_seed(seed)
    p_d1, p_d2 = p_d1.to(torch.float64), p_d2.to(torch.float64)
    lengths = torch.randint(0, 3, (num,), generator=gen)
    x1 = sample_from_probs(p_d1.expand(num, V), gen)
    x2 = sample_from_probs(p_d2[x1], gen)
    result = verify_drafts_batched(
        draft_tokens=torch.stack([x1, x2], 1),
        draft_probs=torch.stack([p_d1.expand(num, V), p_d2[x1]], 1),
        target_probs=torch.stack([P_T1.expand(num, V), P_T2[x1], P_T3.expand(num, V)], 1),
        lengths=lengths,
        generator=gen,
    )
    accepted, y = result.num_accepted, result.next_tokens
    # Round 2 (used where A = 0): anchor y, one draft from p_d2[y], target p_t2[y].
    x1_next = sample_from_probs(p_d2[y], gen)
    second_round = verify_drafts_batched(
        draft_tokens=x1_next.unsqueeze(1),
        draft_probs=p_d2[y].unsqueeze(1),
        target_probs=torch.stack([P_T2[y], P_T3.expand(num, V)], 1),
        lengths=torch.ones(num, dtype=torch.long),
        generator=gen,
    )
    first_of_round2 = torch.where(second_round.num_accepted >= 1, x1_next, second_round.next_tokens)
    first = torch.where(accepted >= 1, x1, y)
    second = torch.where(accepted >= 2, x2, torch.where(accepted == 1, y, first_of_round2))
    return first, second


def _chi_square_p(observed: Tensor, expected_probs: Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test on cells with positive expected probability."""
    positive = expected_probs > 0
    assert int(observed[~positive].sum()) == 0, "a token with zero target probability was committed"
    expected = expected_probs[positive] / expected_probs[positive].sum() * observed.sum()
    return float(stats.chisquare(observed[positive].double().numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("case", sorted(DRAFT_CASES))
def test_committed_tokens_follow_target_distribution(case):
    """Catches any error in accept ratio, residual or bonus: the joint law of two committed tokens is p_t's."""
    p_d1, p_d2 = DRAFT_CASES[case]
    num = 20_000
    first, second = _simulate(p_d1, p_d2, num, seed=1234)
    assert _chi_square_p(torch.bincount(first, minlength=V), P_T1) > 1e-3
    joint = torch.bincount(first * V + second, minlength=V * V)
    assert _chi_square_p(joint, (P_T1.unsqueeze(1) * P_T2).reshape(-1)) > 1e-3


def test_wrong_residual_is_detected():
    """The distribution test can fail: sampling the correction from p_t instead of the residual is biased."""
    p_d1 = DRAFT_CASES["arbitrary"][0].double()
    gen = torch.Generator().manual_seed(0)
    num = 20_000
    x1 = sample_from_probs(p_d1.expand(num, V), gen)
    accept = torch.rand(num, generator=gen, dtype=torch.float64) * p_d1[x1] < P_T1[x1]
    biased = torch.where(accept, x1, sample_from_probs(P_T1.expand(num, V), gen))
    assert _chi_square_p(torch.bincount(biased, minlength=V), P_T1) < 1e-3


def test_single_verifier_is_lossless():
    p_d1 = DRAFT_CASES["zeros_where_target_positive"][0].double()
    gen = torch.Generator().manual_seed(7)
    firsts = []
    for _ in range(3000):
        x1 = sample_from_probs(p_d1, gen)
        result = verify_drafts(
            draft_tokens=x1.reshape(1),
            draft_probs=p_d1.unsqueeze(0),
            target_probs=torch.stack([P_T1, P_T2[int(x1)]]),
            generator=gen,
        )
        firsts.append(result.tokens[0])
    assert _chi_square_p(torch.bincount(torch.tensor(firsts), minlength=V), P_T1) > 1e-3


def _random_round(gen: torch.Generator, num: int, width: int):
    lengths = torch.randint(0, width + 1, (num,), generator=gen)
    draft_probs = torch.softmax(2 * torch.randn(num, width, V, generator=gen), -1)
    draft_probs[:, :, 0] = 0.0  # some zeros in p_d where p_t > 0
    draft_probs = draft_probs / draft_probs.sum(-1, keepdim=True)
    target_probs = torch.softmax(2 * torch.randn(num, width + 1, V, generator=gen), -1)
    draft_tokens = sample_from_probs(draft_probs, gen)
    return draft_tokens, draft_probs, target_probs, lengths


@pytest.mark.parametrize("greedy", [False, True])
def test_batched_equals_single_given_uniforms(greedy):
    """Catches layout bugs in the batched uniforms (row r: slots at 0..ℓ_r-1, extra token at ℓ_r) and padding."""
    gen = torch.Generator().manual_seed(3)
    tokens, d_probs, t_probs, lengths = _random_round(gen, 300, 4)
    uniforms = torch.rand(300, 5, generator=gen, dtype=torch.float64)
    batched = verify_drafts_batched(
        draft_tokens=tokens,
        draft_probs=d_probs,
        target_probs=t_probs,
        lengths=lengths,
        greedy=greedy,
        uniforms=uniforms,
    )
    for r, result in enumerate(batched.unbatch()):
        ell = int(lengths[r])
        single = verify_drafts(
            draft_tokens=tokens[r, :ell],
            draft_probs=d_probs[r, :ell],
            target_probs=t_probs[r, : ell + 1],
            greedy=greedy,
            uniforms=uniforms[r, : ell + 1],
        )
        assert (single.num_accepted, single.next_token) == (result.num_accepted, result.next_token)
        assert torch.equal(single.accepted_tokens, result.accepted_tokens)
    assert len(set(batched.num_accepted.tolist())) > 2  # the cases cover several acceptance lengths


def test_batched_generator_draws_documented_layout():
    gen = torch.Generator().manual_seed(5)
    tokens, d_probs, t_probs, lengths = _random_round(gen, 50, 3)
    kwargs = dict(draft_tokens=tokens, draft_probs=d_probs, target_probs=t_probs, lengths=lengths)
    from_generator = verify_drafts_batched(**kwargs, generator=torch.Generator().manual_seed(11))
    uniforms = torch.rand(50, 4, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    from_uniforms = verify_drafts_batched(**kwargs, uniforms=uniforms)
    assert torch.equal(from_generator.num_accepted, from_uniforms.num_accepted)
    assert torch.equal(from_generator.next_tokens, from_uniforms.next_tokens)


def test_greedy_follows_argmax_path():
    logits = torch.tensor([[0.0, 3, 1, 0, 0], [2, 0, 0, 0, 0], [0, 0, 0, 5, 0], [0, 0, 0, 0, 1]])
    target = probs_from_logits(logits, 0.0)
    drafts_probs = torch.full((3, V), 1.0 / V)
    # argmax path is 1, 0, 3, then bonus 4
    cases = {(1, 0, 2): (2, 3), (1, 0, 3): (3, 4), (2, 0, 3): (0, 1), (1, 4, 3): (1, 0)}
    for drafts, (accepted, nxt) in cases.items():
        result = verify_drafts(
            draft_tokens=torch.tensor(drafts), draft_probs=drafts_probs, target_probs=target, greedy=True
        )
        assert (result.num_accepted, result.next_token) == (accepted, nxt)
        assert result.tokens == [*drafts[:accepted], nxt]


def test_zero_drafts_samples_from_first_target_row():
    result = verify_drafts(
        draft_tokens=torch.zeros(0, dtype=torch.long),
        draft_probs=torch.zeros(0, V),
        target_probs=P_T1.unsqueeze(0),
        uniforms=torch.tensor([0.5], dtype=torch.float64),
    )
    # CDF of P_T1: 0.35, 0.60, ... so u = 0.5 falls in token 1
    assert (result.num_accepted, result.next_token, result.tokens) == (0, 1, [1])


def test_equal_distributions_never_reject():
    gen = torch.Generator().manual_seed(9)
    probs = torch.softmax(torch.randn(200, 4, V, generator=gen), -1)
    tokens = sample_from_probs(probs[:, :3], gen)
    result = verify_drafts_batched(
        draft_tokens=tokens, draft_probs=probs[:, :3], target_probs=probs, lengths=torch.full((200,), 3), generator=gen
    )
    assert bool((result.num_accepted == 3).all())


def test_draft_the_target_forbids_is_always_rejected_and_corrected():
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.2] * 5])
    draft = torch.tensor([[0.9, 0.1, 0.0, 0.0, 0.0]])
    for seed in range(20):
        result = verify_drafts(
            draft_tokens=torch.tensor([0]),
            draft_probs=draft,
            target_probs=target,
            generator=torch.Generator().manual_seed(seed),
        )
        # residual max(0, p_t − p_d) = (0, 0.4, 0.5, 0, 0)
        assert result.num_accepted == 0 and result.next_token in (1, 2)


def test_sample_from_probs_never_returns_zero_weight_index():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    uniforms = torch.tensor([0.0, 0.5, 1 - 2.0**-53, 0.4999999], dtype=torch.float64)
    assert sample_from_probs(probs, uniforms=uniforms).tolist() == [1, 3, 3, 1]
    with pytest.raises(ValueError, match="positive mass"):
        sample_from_probs(torch.zeros(2, 3), uniforms=torch.zeros(2, dtype=torch.float64))


def test_probs_from_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert probs_from_logits(logits, 0).tolist() == [[0.0, 1.0, 0.0]]
    assert torch.allclose(probs_from_logits(logits, 2.0), torch.softmax(logits / 2.0, -1))
    with pytest.raises(ValueError, match="temperature"):
        probs_from_logits(logits, -1.0)


def test_shape_and_randomness_errors():
    with pytest.raises(ValueError, match=r"\[ℓ\+1, V\]"):
        verify_drafts(draft_tokens=torch.tensor([1]), draft_probs=torch.zeros(1, V), target_probs=torch.zeros(1, V))
    with pytest.raises(ValueError, match="Generator"):
        verify_drafts(draft_tokens=torch.tensor([1]), draft_probs=torch.ones(1, V), target_probs=torch.ones(2, V))
    with pytest.raises(ValueError, match="lengths"):
        verify_drafts_batched(
            draft_tokens=torch.zeros(2, 1, dtype=torch.long),
            draft_probs=torch.ones(2, 1, V),
            target_probs=torch.ones(2, 2, V),
            lengths=torch.tensor([0, 2]),
            greedy=True,
        )


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_verifying_from_logits_equals_verifying_the_full_probabilities(temperature):
    """The lazy verifier (p_t rows only up to the first rejection) gives exactly `verify_drafts` on the softmax of
    every row, for the same uniforms: same A, same extra token — drafts from a draft vocabulary, from the target's
    own argmax (long accepted runs) and at random, every ℓ in 0..7."""
    from dspark.decoding.verify import verify_drafts_from_logits

    generator = torch.Generator().manual_seed(11)
    vocab, accepted_counts = 300, set()
    for trial in range(400):
        length = trial % 8
        logits = torch.randn(length + 1, vocab, generator=generator) * 3
        draft_logits = logits[:length] + torch.randn(length, vocab, generator=generator) * (trial % 3)
        draft_logits[:, vocab // 2 :] = float("-inf") if trial % 4 == 0 else draft_logits[:, vocab // 2 :]
        draft_probs = probs_from_logits(draft_logits, max(temperature, 1.0))
        tokens = (
            (
                draft_probs.argmax(-1)
                if trial % 2
                else torch.multinomial(draft_probs, 1, generator=generator).squeeze(-1)
            )
            if length
            else torch.zeros(0, dtype=torch.long)
        )
        uniforms = torch.rand(length + 1, generator=generator, dtype=torch.float64)
        expected = verify_drafts(
            draft_tokens=tokens,
            draft_probs=draft_probs,
            target_probs=probs_from_logits(logits, temperature),
            uniforms=uniforms,
            greedy=temperature == 0,
        )
        got = verify_drafts_from_logits(
            draft_tokens=tokens,
            draft_probs=draft_probs,
            target_logits=logits,
            temperature=temperature,
            uniforms=uniforms,
        )
        assert (got.num_accepted, got.next_token) == (expected.num_accepted, expected.next_token), trial
        assert torch.equal(got.accepted_tokens, expected.accepted_tokens)
        accepted_counts.add(got.num_accepted)
    assert accepted_counts >= {0, 1, 2, 3}
    with pytest.raises(ValueError, match=r"target_logits \[ℓ\+1, V\]"):
        verify_drafts_from_logits(
            draft_tokens=torch.zeros(2, dtype=torch.long),
            draft_probs=torch.zeros(2, 5),
            target_logits=torch.zeros(2, 5),
            temperature=1.0,
            uniforms=torch.rand(3),
        )
