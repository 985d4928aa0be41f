"""Block verification (`decoding.verify`, decode.verifier=block): exact distribution tests beside token verification's.

Exact enumeration. On a tiny vocabulary (V = 3, γ = 3) the target p_t(· | prefix), the drafter p_d(· | prefix) and
the confidences c_k = c(x_<k) are random tables keyed by the prefix, so c_k depends on the drafts and every policy's
ℓ is a function of them. For every draft block x_1..x_γ (probability Π p_d) the policy picks ℓ from c, and the
verifier's outcome is a deterministic function of its ℓ+1 uniforms that only changes where a uniform crosses a
threshold (an acceptance test, or a CDF point of a candidate extra-token row). `round_law` enumerates the product of
those cells and runs the REAL batched verifier at two interior points of each cell (both must agree, else a
breakpoint is missing), weighting each cell by its volume: the exact law of the committed tokens. Continued by the
target up to γ+1 tokens, it must equal the target's law to float precision (1e-12) — for every policy in POLICIES
and every verifier in VERIFIERS. Controls that fail the same test: block verification with token verification's
residual (max(0, p_t − p_d) instead of max(0, w·p_t − p_d)), rejection without any residual (y ~ p_t), and the
scheduler's look-ahead stop (global_argmax). End to end, the engines' tokens pass the PIT chi-square of
tests/test_lossless.py with block verification, and a biased block verifier there fails it.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass

import pytest
import torch
from lossless_checks import residual_ignoring_verifier
from test_lossless import CALIBRATION, NUM_GENERATIONS, P_MIN, chi_square_p_values, make_drafter, sample_generations

from dspark.config import resolve_config
from dspark.config.loader import ConfigError
from dspark.config.schema import VERIFIERS as VERIFIER_NAMES
from dspark.decoding import SpeculativeEngine, build_policy, build_proposer
from dspark.decoding import verify as verify_module
from dspark.decoding.policies import POLICIES
from dspark.decoding.verify import (
    VERIFIERS,
    Verifier,
    block_survival,
    probs_from_logits,
    sample_from_probs,
    verify_block,
    verify_block_batched,
    verify_block_from_logits,
    verify_drafts,
    verify_drafts_batched,
    verify_drafts_from_logits,
)
from dspark.scheduling import SPSTable

V, GAMMA = 3, 3
EXACT = 1e-12
# Slot j is admitted while Θ improves; for slot 1 that is a_1 > 0.5 (tests/test_policies.py).
SPS = SPSTable(batch_tokens=list(range(1, 10)), steps_per_second=[1 / (1 + (b - 1) / 2) for b in range(1, 10)])
# Paper Appendix A's staircase, one size longer: Algorithm 1 never admits a slot, the global argmax often does.
APPENDIX_SPS = SPSTable([1, 2, 3, 4], [1.0, 0.5, 0.45, 0.44])


@dataclass
class TinyModel:
    """Tables keyed by the prefix (a tuple of token ids): p_t for prefixes of length 0..γ, p_d and c for 0..γ-1."""

    target: dict
    draft: dict
    confidence: dict


def _prefixes(length: int):
    for size in range(length + 1):
        yield from itertools.product(range(V), repeat=size)


def _random_row(generator: torch.Generator) -> torch.Tensor:
    """A random distribution over V with a zero 40% of the time (mass the other side cannot propose)."""
    row = (-torch.log(torch.rand(V, generator=generator, dtype=torch.float64))) ** 1.5
    if float(torch.rand((), generator=generator)) < 0.4:
        row[int(torch.randint(V, (1,), generator=generator))] = 0.0
    return row / row.sum()


def random_model(seed: int, *, first_confidence: float) -> TinyModel:
    """Random tables; c_1 (the root's confidence, the same for every block) is given, so that ℓ = 0 can be chosen."""
    generator = torch.Generator().manual_seed(seed)
    target = {p: _random_row(generator) for p in _prefixes(GAMMA)}
    draft = {p: _random_row(generator) for p in _prefixes(GAMMA - 1)}
    confidence = {p: float(torch.rand((), generator=generator, dtype=torch.float64)) for p in _prefixes(GAMMA - 1)}
    confidence[()] = first_confidence
    return TinyModel(target, draft, confidence)


MODELS = {"c1-high": (1, 0.9), "c1-low": (0, 0.3), "c1-mid": (3, 0.6)}


def _rows(table: dict, drafts: tuple, count: int) -> torch.Tensor:
    """[count, V] the table's rows after the prefixes drafts[:0], ..., drafts[:count-1] (V: the table's own)."""
    if count == 0:
        return torch.zeros(0, table[()].shape[0], dtype=torch.float64)
    return torch.stack([table[drafts[:i]] for i in range(count)])


def _cdf_points(row: torch.Tensor) -> list[float]:
    total = float(row.sum())
    return (row.cumsum(0)[:-1] / total).tolist() if total > 0 else []


def _breakpoints(model: TinyModel, drafts: tuple, length: int) -> list[list[float]]:
    """Per uniform (u_0..u_ℓ), every point where a verifier of this module (or a control) may change its outcome:
    the token test p/q and the block test h_i for the slot uniforms, and the CDF points of every candidate extra-token
    row (p_t, both residuals) for u_ℓ. A superset is harmless; a missing point fails `round_law`'s check."""
    q, p = _rows(model.draft, drafts, length), _rows(model.target, drafts, length + 1)
    w = block_survival(draft_tokens=torch.tensor(drafts[:length]), draft_probs=q, target_probs=p).tolist()
    coords = []
    for i in range(length):
        token = drafts[i]
        points = {min(1.0, float(p[i, token] / q[i, token])) if q[i, token] > 0 else 1.0, w[i + 1]}
        if i + 1 < length and w[i + 1] < 1.0:
            mass = float((w[i + 1] * p[i + 1] - q[i + 1]).clamp_min(0).sum())
            points.add(mass / (mass + 1.0 - w[i + 1]))
        coords.append(points)
    extra = set(_cdf_points(p[length]))
    for t in range(length):
        for row in (p[t], (p[t] - q[t]).clamp_min(0), (w[t] * p[t] - q[t]).clamp_min(0)):
            extra.update(_cdf_points(row))
    coords.append(extra)
    return [sorted({0.0, 1.0} | {b for b in points if 0.0 < b < 1.0}) for points in coords]


def round_law(model: TinyModel, drafts: tuple, length: int, batched) -> dict[tuple, float]:
    """{committed tokens (x_1..x_A, y): probability} of one round verifying drafts[:length] (module docstring), for
    any vocabulary (tests/test_scheduler.py runs paper Appendix A's V = 2 through it)."""
    cells = list(itertools.product(*[list(itertools.pairwise(e)) for e in _breakpoints(model, drafts, length)]))
    count, vocab = len(cells), model.target[()].shape[0]
    kwargs = {
        "draft_tokens": torch.tensor(drafts[:length], dtype=torch.long).expand(count, length),
        "draft_probs": _rows(model.draft, drafts, length).expand(count, length, vocab),
        "target_probs": _rows(model.target, drafts, length + 1).expand(count, length + 1, vocab),
        "lengths": torch.full((count,), length),
    }
    outcomes = []
    for fraction in (1 / 3, 2 / 3):
        uniforms = torch.tensor([[a + (b - a) * fraction for a, b in cell] for cell in cells], dtype=torch.float64)
        result = batched(**kwargs, uniforms=uniforms)
        outcomes.append(torch.stack([result.num_accepted, result.next_tokens], 1))
    assert torch.equal(outcomes[0], outcomes[1]), "a verifier decision changed inside a cell: a breakpoint is missing"
    law: dict[tuple, float] = {}
    for cell, (accepted, token) in zip(cells, outcomes[0].tolist()):
        key = (*drafts[:accepted], token)
        law[key] = law.get(key, 0.0) + math.prod(b - a for a, b in cell)
    return law


def _draft_mass(model: TinyModel, drafts: tuple) -> float:
    return math.prod(float(model.draft[drafts[:i]][x]) for i, x in enumerate(drafts))


def _continue(model: TinyModel, committed: tuple, mass: float, out: dict) -> None:
    """Add the law of `committed` continued by the target up to γ+1 tokens into `out`."""
    if len(committed) == GAMMA + 1:
        out[committed] = out.get(committed, 0.0) + mass
        return
    for token in range(V):
        if model.target[committed][token] > 0:
            _continue(model, (*committed, token), mass * float(model.target[committed][token]), out)


def choose(policy, model: TinyModel, drafts: tuple) -> int:
    """ℓ of `policy` (a fresh copy: async keeps history) from c_k = c(x_<k)."""
    confidences = torch.tensor([[model.confidence[drafts[:k]] for k in range(GAMMA)]])
    return int(copy.deepcopy(policy).choose(confidences=confidences, num_drafts=GAMMA)[0])


def sequence_law(model: TinyModel, policy, batched) -> tuple[dict[tuple, float], set[int]]:
    """The law of the first γ+1 tokens (one round under `policy` and `batched`, then the target), and the ℓs used."""
    out, lengths = {}, set()
    for drafts in itertools.product(range(V), repeat=GAMMA):
        mass = _draft_mass(model, drafts)
        if mass == 0.0:
            continue
        length = choose(policy, model, drafts)
        lengths.add(length)
        for committed, probability in round_law(model, drafts, length, batched).items():
            _continue(model, committed, mass * probability, out)
    return out, lengths


def law_error(model: TinyModel, law: dict[tuple, float]) -> float:
    """max |law − the target's own law| over sequences of γ+1 tokens."""
    truth: dict[tuple, float] = {}
    _continue(model, (), 1.0, truth)
    return max(abs(law.get(s, 0.0) - truth.get(s, 0.0)) for s in set(truth) | set(law))


def make_policy(name: str, **kwargs):
    """A policy of the registry, `async` with two rounds of stale confidences already seen."""
    policy = build_policy(name, threshold=0.5, static_k=2, sps=SPS, **kwargs)
    policy.reset()
    if name == "async":
        for stale in ([0.9, 0.8, 0.7], [0.9, 0.2, 0.7]):
            policy.choose(confidences=torch.tensor([stale]), num_drafts=GAMMA)
    return policy


# ---- exact distribution tests ----


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("verifier", VERIFIERS.ordered())
@pytest.mark.parametrize("policy_name", POLICIES.ordered())
def test_every_policy_and_verifier_is_exactly_lossless(policy_name, verifier, model_name):
    """Catches any error in block verification's weights, residual, bonus or padding, for ℓ chosen from the drafts."""
    model = random_model(MODELS[model_name][0], first_confidence=MODELS[model_name][1])
    law, lengths = sequence_law(model, make_policy(policy_name), VERIFIERS.resolve(verifier).batched)
    assert law_error(model, law) < EXACT
    if policy_name in ("threshold", "calibrated_threshold", "scheduler") and model_name != "c1-low":
        assert len(lengths) > 1, lengths  # ℓ really depends on the drafts here


def test_draft_dependent_lengths_cover_every_length():
    """The cases above do make ℓ a function of x_<ℓ: across the models the threshold picks every ℓ in 0..γ."""
    seen = set()
    for seed, first in MODELS.values():
        model = random_model(seed, first_confidence=first)
        seen |= {choose(make_policy("threshold"), model, d) for d in itertools.product(range(V), repeat=GAMMA)}
    assert seen == set(range(GAMMA + 1))


def test_the_single_block_verifier_is_exactly_lossless():
    """The same law through `verify_block` row by row (the single-request entry point), ℓ from the threshold."""
    model = random_model(0, first_confidence=0.9)

    def single(*, draft_tokens, draft_probs, target_probs, lengths, uniforms):
        results = [
            verify_block(
                draft_tokens=draft_tokens[r, : int(lengths[r])],
                draft_probs=draft_probs[r, : int(lengths[r])],
                target_probs=target_probs[r, : int(lengths[r]) + 1],
                uniforms=uniforms[r, : int(lengths[r]) + 1],
            )
            for r in range(draft_tokens.shape[0])
        ]
        return verify_module.BatchVerifyResult(
            torch.tensor([x.num_accepted for x in results]), torch.tensor([x.next_token for x in results]), draft_tokens
        )

    law, _ = sequence_law(model, make_policy("threshold"), single)
    assert law_error(model, law) < EXACT


@pytest.mark.parametrize(
    "control",
    [
        "block-with-token-residual",
        "no-residual-at-all",
        "scheduler-global-argmax-token",
        "scheduler-global-argmax-block",
    ],
)
def test_the_exact_test_can_fail(control, monkeypatch):
    """Controls: each variant is biased, and the same exact test says so (error ≫ 1e-12). The look-ahead stop is
    biased where it lets x_1 decide whether x_1 is verified (ℓ = 0 or ≥ 2 here), with either verifier."""
    model = random_model(1 if control.startswith("scheduler") else 0, first_confidence=0.9)
    original = verify_module._extra_token_weights
    if control == "block-with-token-residual":  # max(0, p_t − p_d) after a block rejection, ignoring w_τ
        monkeypatch.setattr(verify_module, "_extra_token_weights", lambda t, d, scale=None: original(t, d))
    if control == "no-residual-at-all":  # token acceptance, the correction drawn from p_t itself
        monkeypatch.setattr(verify_module, "_extra_token_weights", lambda t, d, scale=None: t.to(torch.float64))
    if control.startswith("scheduler-global-argmax"):
        policy = build_policy("scheduler", sps=APPENDIX_SPS, scheduler_stop="global_argmax")
        batched = verify_drafts_batched if control.endswith("token") else verify_block_batched
    else:
        policy = make_policy("fixed")
        batched = verify_block_batched if control.startswith("block") else verify_drafts_batched
    law, lengths = sequence_law(model, policy, batched)
    assert law_error(model, law) > 1e-3
    if control.startswith("scheduler-global-argmax"):  # with the lossless stop the same case is exact
        safe = build_policy("scheduler", sps=APPENDIX_SPS)
        assert law_error(model, sequence_law(model, safe, batched)[0]) < EXACT
        assert 0 in lengths and len(lengths) > 1


# ---- what block verification buys ----


def _expected_accepted(model: TinyModel, policy, batched, drafts_filter=None) -> float:
    total = 0.0
    for drafts in itertools.product(range(V), repeat=GAMMA):
        mass = _draft_mass(model, drafts)
        if mass == 0.0:
            continue
        law = round_law(model, drafts, choose(policy, model, drafts), batched)
        total += mass * sum(p * (len(k) - 1) for k, p in law.items())
    return total


@pytest.mark.parametrize("policy_name", ["fixed", "threshold", "scheduler"])
def test_block_accepts_at_least_as_many_drafts_in_expectation(policy_name):
    """E[A] under block verification ≥ under token verification, by exact enumeration on random cases: the paper's
    theorem for fixed ℓ = γ, and (checked, not only assumed) for ℓ chosen from the drafts. Strictly more on some."""
    gains = []
    for seed in range(8):
        model = random_model(seed, first_confidence=0.9)
        policy = make_policy(policy_name)
        block = _expected_accepted(model, policy, verify_block_batched)
        token = _expected_accepted(model, policy, verify_drafts_batched)
        assert block >= token - EXACT, (seed, block, token)
        gains.append(block - token)
    assert max(gains) > 1e-3


def test_the_gain_is_in_expectation_not_per_block():
    """For a given draft block block verification may accept fewer drafts than token verification (so the test
    above is in expectation); the per-prefix keep probability is what dominates (next test)."""
    model = random_model(0, first_confidence=0.9)
    worse = 0
    for drafts in itertools.product(range(V), repeat=GAMMA):
        if _draft_mass(model, drafts) == 0.0:
            continue
        mean = {
            name: sum(p * (len(k) - 1) for k, p in round_law(model, drafts, GAMMA, batched).items())
            for name, batched in (("block", verify_block_batched), ("token", verify_drafts_batched))
        }
        worse += mean["block"] < mean["token"] - 1e-9
    assert worse > 0


def test_block_survival_is_the_probability_of_keeping_each_prefix():
    """P(A ≥ i | x_1..x_i) = w_i (`block_survival`), whatever is drafted after x_i, and w_i ≥ Π_{k≤i} min(1, p/q),
    the token verifier's (exact enumeration over the later drafts). Control: the token verifier's own keep
    probability is the product, which differs from w_i on these cases."""
    model = random_model(3, first_confidence=0.9)
    differs = 0
    for i in range(1, GAMMA + 1):
        for prefix in itertools.product(range(V), repeat=i):
            if _draft_mass(model, prefix) == 0.0:
                continue
            kept = {"block": 0.0, "token": 0.0}
            later = 0.0
            for future in itertools.product(range(V), repeat=GAMMA - i):
                drafts = (*prefix, *future)
                mass = _draft_mass(model, drafts) / _draft_mass(model, prefix)
                later += mass
                for name, batched in (("block", verify_block_batched), ("token", verify_drafts_batched)):
                    law = round_law(model, drafts, GAMMA, batched)
                    kept[name] += mass * sum(p for k, p in law.items() if len(k) - 1 >= i)
            q, p = _rows(model.draft, prefix, i), _rows(model.target, prefix, i + 1)
            w = block_survival(draft_tokens=torch.tensor(prefix), draft_probs=q, target_probs=p)
            product = math.prod(min(1.0, float(p[k, prefix[k]] / q[k, prefix[k]])) for k in range(i))
            assert later == pytest.approx(1.0, abs=1e-12)
            assert kept["block"] == pytest.approx(float(w[i]), abs=1e-12)
            assert kept["token"] == pytest.approx(product, abs=1e-12) and float(w[i]) >= product - 1e-15
            differs += abs(float(w[i]) - product) > 1e-6
    assert differs > 0


# ---- entry points, layouts, greedy ----


def _random_rounds(generator: torch.Generator, num: int, width: int, vocab: int = 5):
    lengths = torch.randint(0, width + 1, (num,), generator=generator)
    draft_probs = torch.softmax(2 * torch.randn(num, width, vocab, generator=generator), -1)
    draft_probs[:, :, 0] = 0.0  # zeros in p_d where p_t > 0
    draft_probs = draft_probs / draft_probs.sum(-1, keepdim=True)
    target_probs = torch.softmax(2 * torch.randn(num, width + 1, vocab, generator=generator), -1)
    target_probs[: num // 4, :, 1] = 0.0  # and zeros in p_t where p_d > 0 (drafts the target forbids)
    target_probs = target_probs / target_probs.sum(-1, keepdim=True)
    return sample_from_probs(draft_probs, generator), draft_probs, target_probs, lengths


@pytest.mark.parametrize("greedy", [False, True])
def test_batched_block_equals_single_given_uniforms(greedy):
    """The batched verifier reads row r's uniforms as the single one does (slots at 0..ℓ_r-1, extra at ℓ_r) and never
    reads padding; greedy mode is the token verifier's greedy matching in both."""
    generator = torch.Generator().manual_seed(3)
    tokens, d_probs, t_probs, lengths = _random_rounds(generator, 400, 4)
    uniforms = torch.rand(400, 5, generator=generator, dtype=torch.float64)
    kwargs = {
        "draft_tokens": tokens,
        "draft_probs": d_probs,
        "target_probs": t_probs,
        "lengths": lengths,
        "greedy": greedy,
    }
    batched = verify_block_batched(**kwargs, uniforms=uniforms)
    if greedy:
        token = verify_drafts_batched(**kwargs)
        assert torch.equal(batched.num_accepted, token.num_accepted)
        assert torch.equal(batched.next_tokens, token.next_tokens)
    for r, result in enumerate(batched.unbatch()):
        ell = int(lengths[r])
        single = verify_block(
            draft_tokens=tokens[r, :ell],
            draft_probs=d_probs[r, :ell],
            target_probs=t_probs[r, : ell + 1],
            greedy=greedy,
            uniforms=uniforms[r, : ell + 1],
        )
        assert (single.num_accepted, single.next_token) == (result.num_accepted, result.next_token)
        assert torch.equal(single.accepted_tokens, result.accepted_tokens)
    assert len(set(batched.num_accepted.tolist())) > 2


def test_block_with_one_draft_is_token_verification():
    """At ℓ ≤ 1 the block verifier is the token verifier (u < min(1, p/q), the same residual and bonus): the same
    outcome for the same uniforms; at ℓ > 1 the two differ on some rounds (the control)."""
    generator = torch.Generator().manual_seed(8)
    tokens, d_probs, t_probs, lengths = _random_rounds(generator, 600, 3)
    uniforms = torch.rand(600, 4, generator=generator, dtype=torch.float64)
    kwargs = {
        "draft_tokens": tokens,
        "draft_probs": d_probs,
        "target_probs": t_probs,
        "lengths": lengths,
        "uniforms": uniforms,
    }
    block, token = verify_block_batched(**kwargs), verify_drafts_batched(**kwargs)
    same = (block.num_accepted == token.num_accepted) & (block.next_tokens == token.next_tokens)
    assert bool(same[lengths <= 1].all())
    assert not bool(same[lengths > 1].all())


def test_generator_draws_the_token_verifiers_layout():
    """Drawn uniforms: [ℓ+1] per round (single) and [R, L+1] (batched), the same draws as the token verifier's."""
    generator = torch.Generator().manual_seed(5)
    tokens, d_probs, t_probs, lengths = _random_rounds(generator, 50, 3)
    kwargs = {"draft_tokens": tokens, "draft_probs": d_probs, "target_probs": t_probs, "lengths": lengths}
    drawn = verify_block_batched(**kwargs, generator=torch.Generator().manual_seed(11))
    given = verify_block_batched(
        **kwargs, uniforms=torch.rand(50, 4, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    )
    assert torch.equal(drawn.num_accepted, given.num_accepted) and torch.equal(drawn.next_tokens, given.next_tokens)
    ell = int(lengths[0])
    one = {"draft_tokens": tokens[0, :ell], "draft_probs": d_probs[0, :ell], "target_probs": t_probs[0, : ell + 1]}
    a = verify_block(**one, generator=torch.Generator().manual_seed(2))
    b = verify_block(
        **one, uniforms=torch.rand(ell + 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    )
    assert (a.num_accepted, a.next_token) == (b.num_accepted, b.next_token)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_block_from_logits_equals_block_on_probabilities(temperature):
    """The engines' entry point (logits) is `verify_block` on the softmax at the temperature; at T = 0 it is greedy
    matching, the token verifier's result."""
    generator = torch.Generator().manual_seed(11)
    for trial in range(200):
        length, vocab = trial % 6, 40
        logits = torch.randn(length + 1, vocab, generator=generator) * 3
        draft_probs = probs_from_logits(logits[:length] + torch.randn(length, vocab, generator=generator), 1.0)
        tokens = sample_from_probs(draft_probs, generator) if length else torch.zeros(0, dtype=torch.long)
        uniforms = torch.rand(length + 1, generator=generator, dtype=torch.float64)
        got = verify_block_from_logits(
            draft_tokens=tokens,
            draft_probs=draft_probs,
            target_logits=logits,
            temperature=temperature,
            uniforms=uniforms,
        )
        if temperature == 0:
            expected = verify_drafts_from_logits(
                draft_tokens=tokens, draft_probs=draft_probs, target_logits=logits, temperature=0.0, uniforms=uniforms
            )
        else:
            expected = verify_block(
                draft_tokens=tokens,
                draft_probs=draft_probs,
                target_probs=probs_from_logits(logits, temperature),
                uniforms=uniforms,
            )
        assert (got.num_accepted, got.next_token) == (expected.num_accepted, expected.next_token), trial


def test_registry_and_config_name_the_same_verifiers_and_errors_name_the_key(tiny):
    assert VERIFIERS.names() == sorted(VERIFIER_NAMES)
    assert all(isinstance(VERIFIERS.resolve(n), Verifier) for n in VERIFIERS.ordered())
    assert VERIFIERS.resolve("token").verify is verify_drafts
    with pytest.raises(ValueError, match=r"decode\.verifier 'blok'.*Did you mean 'block'"):
        SpeculativeEngine(target=tiny, proposer=None, policy=None, temperature=1.0, max_new_tokens=4, verifier="blok")
    with pytest.raises(ValueError, match="verify_block: expected"):
        verify_block(draft_tokens=torch.tensor([1]), draft_probs=torch.ones(1, V), target_probs=torch.ones(1, V))


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["decode.verifier=blocks"], ["decode.verifier", "blocks", "block", "token"]),
        (["serve.verifier=joint"], ["serve.verifier", "joint"]),
        (["decode.verifier=block", "decode.tree.shape=widths"], ["decode.verifier=block", "decode.tree.shape=widths"]),
    ],
)
def test_config_refuses_unknown_verifiers_and_block_on_a_tree(argv, needles):
    with pytest.raises(ConfigError) as err:
        resolve_config(argv)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert resolve_config(["decode.verifier=block", "serve.verifier=block"]).cfg.decode.verifier == "block"


# ---- the engines, end to end (tests/test_lossless.py's PIT method) ----

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


def block_engine(target, drafter_name, policy, *, temperature=1.0, max_new_tokens=4, verifier="block"):
    drafter = make_drafter(target, drafter_name)
    proposer = build_proposer(drafter)
    return SpeculativeEngine(
        target=target,
        proposer=proposer,
        policy=build_policy(policy, threshold=0.5, static_k=2, sps=SPS),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        calibration=CALIBRATION if "-vd" in drafter_name and proposer.has_confidence else None,
        verifier=verifier,
    )


# ℓ from the drafts' (calibrated) confidences, and a drafter without a confidence head; every policy is checked
# exactly above, the engines' token path by tests/test_lossless.py
ENGINE_CASES = [("dspark-markov-vd", "scheduler"), ("dflash-vd", "fixed")]


@pytest.mark.parametrize(
    ("drafter_name", "policy"),
    # exact enumeration above proves every policy; of the engine-level chi-square cases the fast tier keeps the
    # first (a draft-dependent ℓ), the slow tier (make test-all) runs both
    [pytest.param(*case, marks=() if i == 0 else pytest.mark.slow) for i, case in enumerate(ENGINE_CASES)],
)
def test_engine_with_block_verification_matches_the_target_distribution(target, prompt, drafter_name, policy):
    results = sample_generations(block_engine(target, drafter_name, policy), prompt, NUM_GENERATIONS)
    rounds = [r for result in results for r in result.rounds]
    assert any(r.num_accepted > 0 for r in rounds) and any(r.num_accepted < r.num_verified for r in rounds)
    if policy != "fixed":
        assert len({r.num_verified for r in rounds}) > 1  # ℓ chosen per round from the drafts' confidences
    p_values = chi_square_p_values(target, prompt, results)
    assert min(p_values.values()) > P_MIN, p_values


def test_engine_block_test_can_fail(target, prompt, monkeypatch):
    """A biased verifier registered as "block" (its correction ignores the residual) fails the same test."""
    biased = Verifier("block", verify_block, residual_ignoring_verifier, verify_block_batched)
    monkeypatch.setitem(VERIFIERS._items, "block", biased)
    results = sample_generations(block_engine(target, "dspark-markov", "fixed"), prompt, NUM_GENERATIONS)
    assert chi_square_p_values(target, prompt, results)["pooled"] < P_MIN


def test_greedy_block_engine_is_the_token_engine(target, prompt):
    """T = 0: block verification is greedy matching, token for token the token verifier's output."""
    outputs = {
        v: block_engine(target, "dspark-markov-vd", "scheduler", temperature=0.0, max_new_tokens=16, verifier=v)
        .generate(prompt, generator=torch.Generator().manual_seed(0))
        .new_tokens
        for v in ("token", "block")
    }
    assert outputs["token"] == outputs["block"] and len(outputs["block"]) == 16


def test_batched_engine_with_block_verification_is_lossless_and_rows_reproduce_the_single_engine(target):
    """R = 3 rows with joins and leaves, block verification per row: each request equals the single-request engine
    with block verification and the same (seed, request_id) generator, and the PITs are uniform."""
    from test_serving_lossless import build_test_drafter
    from test_serving_lossless import chi_square_p_values as serve_p_values

    from dspark.decoding import DSparkProposer
    from dspark.serving import BatchedEngine, ServeRequest, request_generator

    prompts = [target.chat_prompt_ids(t) for t in ("What is 2+2?", "Hi", "Write a short poem about the sea.")]
    drafter = build_test_drafter(target)
    requests = [ServeRequest(request_id=i, prompt_ids=prompts[i % 3]) for i in range(240)]
    engine = BatchedEngine(
        target=target, drafter=drafter, policy=None, temperature=1.0, max_new_tokens=4, verifier="block"
    )
    result = engine.serve(requests, concurrency=3, seed=0, progress=False)
    p_values = serve_p_values(target, prompts, requests, result.requests)
    assert min(p_values.values()) > P_MIN, p_values
    solo = SpeculativeEngine(
        target=target,
        proposer=DSparkProposer(drafter),
        policy=None,
        temperature=1.0,
        max_new_tokens=4,
        verifier="block",
    )
    for request, served in list(zip(requests, result.requests))[:12]:
        reference = solo.generate(request.prompt_ids, generator=request_generator(0, request.request_id))
        assert served.new_tokens == reference.new_tokens
