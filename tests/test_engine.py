"""The speculative engine (dspark.decoding.engine): counts, EOS rules, cache rollback, drafter context, API.

Stub proposers draft the tiny target's own greedy continuation with chosen slots spoiled, so at temperature 0
every round's A, τ and ℓ_eff are known in advance (never / always / partly accepted). Real drafters (freshly
initialised, weights scaled up so they disagree with the target) check the context bookkeeping under sampling.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dspark import api
from dspark.api import load_trained_drafter, speculative_generate
from dspark.decoding import DSparkProposer, Eagle3Proposer, Proposal, SpeculativeEngine, build_policy
from dspark.decoding.verify import probs_from_logits
from dspark.drafters.factory import DrafterSpec, build_drafter
from dspark.drafters.heads import SEQUENTIAL_HEADS
from dspark.metrics.rollout import RolloutAcceptance
from dspark.scheduling import SPSTable
from dspark.drafters.checkpoint import save_drafter

GAMMA = 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread (tests/conftest.py)


# seed 1: a tiny target whose greedy continuation of PROMPT starts with 7 distinct tokens (seed 0 repeats one)
TINY_TARGET = {"seed": 1}  # the `tiny` fixture's options (tests/conftest.py)


@pytest.fixture(scope="module")
def target(tiny):
    return tiny


@pytest.fixture(scope="module")
def prompt(target):
    return target.chat_prompt_ids("What is 2+2?")


def with_stop_ids(target, stop_ids):
    """A shallow copy of the target with other stop ids (same model, cache-compatible)."""
    clone = copy.copy(target)
    clone.stop_token_ids = list(stop_ids)
    return clone


def make_drafter(target, kind, *, head="markov", gamma=GAMMA, seed=0, scale=5.0, sharpen=8.0):
    spec = DrafterSpec(
        kind=kind,
        head=head if kind == "dspark" else "none",
        depth=1,
        block_size=gamma,
        markov_rank=8 if kind == "dspark" else 0,
        feature_layers=tuple(target.feature_layer_ids),
        mask_token_id=target.mask_token_id,
        target_fingerprint=target.fingerprint,
    )
    torch.manual_seed(seed)
    drafter = build_drafter(spec, target)
    with torch.no_grad():  # N(0, 0.02) weights leave p_d ≈ uniform; larger ones make real disagreements
        for name, param in drafter.named_parameters():
            if "norm" not in name:
                param.mul_(scale)
        final_norm = drafter.backbone.norm if kind != "eagle3" else drafter.norm
        final_norm.weight.mul_(sharpen)  # scales the LM-head input: a peaked p_d
    return drafter.eval()


def greedy_continuation(target, ids, n):
    """The target's greedy next n tokens after `ids` (full forwards, no cache: an independent reference)."""
    seq = list(ids)
    for _ in range(n):
        logits = target.forward(torch.tensor([seq]), return_logits=True).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(ids) :]


class OracleProposer:
    """Drafts the target's greedy continuation; slots ≥ `correct` are spoiled (+1), `inject` forces tokens."""

    has_confidence = False

    def __init__(self, target, *, correct, inject=None, block_size=GAMMA):
        self.target, self.correct, self.inject, self.block_size = target, correct, inject or {}, block_size
        self.tokens: list[int] = []

    def start(self, *, features, token_ids):
        assert features.shape[1] == len(token_ids)
        self.tokens = list(token_ids)

    def extend(self, *, features, token_ids):
        assert features.shape[1] == len(token_ids)
        self.tokens += list(token_ids)

    def propose(
        self, *, anchor_token, anchor_position, temperature, generator, stop_ids, policy_hook=None, max_drafts=None
    ):
        assert anchor_position == len(self.tokens)
        greedy = greedy_continuation(self.target, [*self.tokens, anchor_token], self.block_size)
        drafts = [g if k < self.correct else (g + 1) % self.target.vocab_size for k, g in enumerate(greedy)]
        for slot, token in self.inject.items():
            drafts[slot] = token
        tokens = torch.tensor(drafts)
        return Proposal(tokens, torch.nn.functional.one_hot(tokens, self.target.vocab_size).float(), None)


def engine(target, proposer, *, policy="fixed", temperature=0.0, max_new_tokens=13, **kw):
    return SpeculativeEngine(
        target=target,
        proposer=proposer,
        policy=build_policy(policy, **kw),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
    )


def run(eng, prompt, seed=0, **kw):
    return eng.generate(prompt, generator=torch.Generator().manual_seed(seed), **kw)


@pytest.mark.parametrize(("correct", "accepted", "num_rounds"), [(3, 3, 3), (0, 0, 12), (1, 1, 6)])
def test_counts_for_always_never_and_partly_accepted_drafts(target, prompt, correct, accepted, num_rounds):
    target = with_stop_ids(target, [])
    result = run(engine(target, OracleProposer(target, correct=correct)), prompt)
    reference = greedy_continuation(target, prompt, 13)
    assert result.new_tokens == reference and result.stop_reason == "max_new_tokens"
    assert len(result.rounds) == num_rounds  # 1 (first token, not a round) + rounds·τ = 13
    assert [(r.num_verified, r.num_accepted, r.committed) for r in result.rounds] == [
        (GAMMA, accepted, accepted + 1)
    ] * num_rounds
    positions = [r.anchor_position for r in result.rounds]
    assert positions == [len(prompt) + k * (accepted + 1) for k in range(num_rounds)]
    assert [r.extra_token for r in result.rounds] == [reference[p - len(prompt) + accepted + 1] for p in positions]
    assert result.tau == accepted + 1
    metric = RolloutAcceptance(block_size=GAMMA)
    metric.update(**result.round_counts())
    assert float(metric.compute()["tau"]) == result.tau


def test_last_round_counts_whole_and_output_is_truncated(target, prompt):
    target = with_stop_ids(target, [])
    result = run(engine(target, OracleProposer(target, correct=3)), prompt, max_new_tokens=3)
    assert len(result.new_tokens) == 3 and result.stop_reason == "max_new_tokens"
    assert [r.committed for r in result.rounds] == [4]
    assert run(engine(target, OracleProposer(target, correct=3)), prompt, max_new_tokens=1).rounds == []


def _greedy_with_distinct(target, prompt, n):
    reference = greedy_continuation(target, prompt, n)
    assert len(set(reference)) == n, "pick a prompt whose greedy continuation has no repeated token"
    return reference


def test_accepted_stop_draft_ends_the_round_without_extra_token(target, prompt):
    g = _greedy_with_distinct(target, prompt, 6)
    stopped = with_stop_ids(target, [g[2]])  # round 1 drafts g1 g2 g3: g2 is a stop id
    result = run(engine(stopped, OracleProposer(stopped, correct=3)), prompt)
    (only,) = result.rounds
    assert (only.drafts, only.num_verified, only.num_accepted, only.committed, only.extra_token) == (
        g[1:4],
        2,
        2,
        2,
        None,
    )  # ℓ_eff cut at the drafted stop id; τ = A through it
    assert result.new_tokens == g[:3] and result.stop_reason == "eos"


def test_stop_token_as_extra_token_ends_generation(target, prompt):
    g = _greedy_with_distinct(target, prompt, 6)
    stopped = with_stop_ids(target, [g[4]])  # bonus token of round 1 (after g1 g2 g3 accepted)
    result = run(engine(stopped, OracleProposer(stopped, correct=3)), prompt)
    assert [(r.num_accepted, r.committed, r.extra_token) for r in result.rounds] == [(3, 4, g[4])]
    assert result.new_tokens == g[:5] and result.stop_reason == "eos"
    first = with_stop_ids(target, [g[0]])
    result = run(engine(first, OracleProposer(first, correct=3)), prompt)
    assert (result.new_tokens, result.rounds, result.stop_reason) == ([g[0]], [], "eos")


def test_rejected_stop_draft_only_truncates_verification(target, prompt):
    g = greedy_continuation(target, prompt, 14)
    stop = next(t for t in range(3, target.vocab_size) if t not in g)
    stopped = with_stop_ids(target, [stop])
    proposer = OracleProposer(stopped, correct=1, inject={1: stop})  # [correct, stop, spoiled]: stop rejected
    result = run(engine(stopped, proposer), prompt)
    assert result.new_tokens == g[:13] and result.stop_reason == "max_new_tokens"
    assert {(r.num_verified, r.num_accepted, r.committed) for r in result.rounds} == {(2, 1, 2)}


class SpyTarget:
    """Delegates to a target and keeps every forward's inputs and outputs."""

    def __init__(self, target):
        self._target, self.calls = target, []

    def __getattr__(self, name):
        return getattr(self._target, name)

    def forward(self, input_ids, **kwargs):
        out = self._target.forward(input_ids, **kwargs)
        self.calls.append((input_ids[0].tolist(), out.final_hidden[0].clone(), out.features[0].clone()))
        return out


@pytest.mark.parametrize("case", ["partly-accepted-greedy", "dspark-sampled"])
def test_cache_rollback_matches_a_fresh_forward(target, prompt, case):
    """After rejections, every verify forward's outputs at committed positions equal a fresh, cache-free
    forward over the committed sequence: the KV cache holds exactly the committed positions."""
    spy = SpyTarget(with_stop_ids(target, []))
    if case == "dspark-sampled":
        proposer, temperature = DSparkProposer(make_drafter(target, "dspark")), 1.0
    else:
        proposer, temperature = OracleProposer(target, correct=1), 0.0
    result = run(engine(spy, proposer, temperature=temperature, max_new_tokens=16), prompt)
    assert any(r.num_accepted < r.num_verified for r in result.rounds)
    sequence = [*prompt, *result.new_tokens]
    fresh = target.forward(torch.tensor([sequence]))
    assert len(spy.calls) == 1 + len(result.rounds)  # the prefill, then one verify forward per round
    for record, (inputs, hidden, features) in zip(result.rounds, spy.calls[1:]):
        p = record.anchor_position
        keep = min(record.num_accepted + 1, len(sequence) - p)
        assert inputs[:keep] == sequence[p : p + keep]
        torch.testing.assert_close(hidden[:keep], fresh.final_hidden[0, p : p + keep], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(features[:keep], fresh.features[0, p : p + keep], atol=1e-5, rtol=1e-5)


class RecordingDSpark(DSparkProposer):
    """Keeps the cached context and the block's hidden states at every propose."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.seen = []

    def propose(self, *, anchor_token, anchor_position, **kwargs):
        with torch.no_grad():
            hidden = self.block_hidden(anchor_token, anchor_position)
        self.seen.append((anchor_token, anchor_position, self.context.clone(), hidden))
        return super().propose(anchor_token=anchor_token, anchor_position=anchor_position, **kwargs)


@pytest.mark.parametrize("head", [h for h in SEQUENTIAL_HEADS.ordered() if h != "none"])
def test_dspark_context_is_exactly_the_committed_positions_before_the_anchor(target, prompt, head):
    """H_ctx cached incrementally = a fresh fusion of the committed sequence's features at 0..p-1 (never a
    rejected draft's), and the cached-K/V block forward = the backbone's own forward on that context."""
    drafter = make_drafter(target, "dspark", head=head)
    proposer = RecordingDSpark(drafter)
    result = run(engine(with_stop_ids(target, []), proposer, temperature=1.0, max_new_tokens=16), prompt)
    assert any(r.num_accepted < r.num_verified for r in result.rounds)
    sequence = [*prompt, *result.new_tokens]
    with torch.no_grad():
        fused = drafter.backbone.fuse_context(target.forward(torch.tensor([sequence])).features)
        assert [s[1] for s in proposer.seen] == [r.anchor_position for r in result.rounds]
        for anchor, position, context, hidden in proposer.seen:
            assert anchor == sequence[position]
            torch.testing.assert_close(context, fused[:, :position], atol=1e-5, rtol=1e-5)
            block = torch.full((1, 1, GAMMA), target.mask_token_id)
            block[0, 0, 0] = anchor
            expected = drafter.backbone.attend(
                fused[:, :position], block_input_ids=block, anchor_positions=torch.tensor([[position]])
            )
            torch.testing.assert_close(hidden, expected[0, 0], atol=1e-5, rtol=1e-5)


def test_eagle3_cached_rounds_equal_a_full_recomputation(target, prompt):
    """The proposer keeps EAGLE-3's step-0 keys/values and runs only the positions committed since the last round;
    every round's drafts then have the p_d of `draft_chain` recomputed from scratch over the committed sequence's
    features (never a rejected draft's), fed the same drafts."""
    seen = []

    class Recording(Eagle3Proposer):
        def propose(self, **kwargs):
            proposal = super().propose(**kwargs)
            seen.append((kwargs["anchor_position"], kwargs["anchor_token"], list(self._tokens), proposal))
            return proposal

    drafter = make_drafter(target, "eagle3")
    result = run(engine(with_stop_ids(target, []), Recording(drafter), temperature=1.0, max_new_tokens=16), prompt)
    assert any(r.num_accepted < r.num_verified for r in result.rounds)  # some drafts were rejected and dropped
    sequence = [*prompt, *result.new_tokens]
    with torch.no_grad():
        features = target.forward(torch.tensor([sequence])).features
    assert len(seen) == len(result.rounds) > 2
    to_draft = {int(t): d for d, t in enumerate(drafter.draft_to_target.tolist())}
    for position, anchor, tokens, proposal in seen:
        assert tokens == sequence[:position] and anchor == sequence[position]
        queue = [to_draft[t] for t in proposal.tokens.tolist()]

        def forced(logits):
            return torch.tensor([queue.pop(0)]), torch.softmax(logits.float(), dim=-1)

        fresh = drafter.draft_chain(
            context_features=features[:, :position],
            context_ids=torch.tensor([sequence[: position + 1]]),
            num_tokens=len(queue),
            sample_fn=forced,
        )
        assert fresh.tokens[0].tolist() == proposal.tokens.tolist()
        torch.testing.assert_close(proposal.draft_probs, fresh.probs[0].float(), atol=1e-5, rtol=1e-4)


def test_eagle3_extending_the_context_by_pieces_equals_one_pass(target):
    """extend_context over a prefix split into pieces (1, 3, then 2 positions) gives the keys, values and last
    output of one pass over the whole prefix."""
    drafter = make_drafter(target, "eagle3")
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, target.vocab_size, (1, 7), generator=generator)
    with torch.no_grad():
        features = target.forward(ids[:, :6]).features
        whole, last = drafter.extend_context(None, features=features, next_ids=ids[:, 1:])
        context = None
        for lo, hi in [(0, 1), (1, 4), (4, 6)]:
            context, piece_last = drafter.extend_context(
                context, features=features[:, lo:hi], next_ids=ids[:, lo + 1 : hi + 1]
            )
    for got, expected in zip(context, whole):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(piece_last, last, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="next_ids"):
        drafter.extend_context(None, features=features, next_ids=ids[:, 1:3])


@pytest.mark.parametrize("temperature", [0.7, 0.0])
@pytest.mark.parametrize("head", SEQUENTIAL_HEADS.ordered())
def test_dspark_proposal_probs_are_the_teacher_forced_distributions(target, prompt, head, temperature):
    """p_d_k and c_k of a proposal equal the drafter's teacher-forced outputs with the drafted tokens as
    x_{k-1}: the verifier is given exactly the distribution each draft was sampled from (greedy: the one-hot
    of the teacher-forced argmax, which the proposer writes over V at the end of its loop)."""
    drafter = make_drafter(target, "dspark" if head != "none" else "dflash", head=head)
    proposer = DSparkProposer(drafter)
    features = target.forward(torch.tensor([prompt])).features
    proposer.start(features=features, token_ids=prompt)
    anchor, position = 17, len(prompt)
    proposal = proposer.propose(
        anchor_token=anchor,
        anchor_position=position,
        temperature=temperature,
        generator=torch.Generator().manual_seed(3),
        stop_ids=(),
    )
    assert proposal.tokens.shape == (GAMMA,)
    block = torch.full((1, 1, GAMMA), target.mask_token_id)
    block[0, 0, 0] = anchor
    prev = torch.tensor([[[anchor, *proposal.tokens[:-1].tolist()]]])
    with torch.no_grad():
        out = drafter(
            context_features=features,
            context_valid=torch.ones(1, position, dtype=torch.bool),
            block_input_ids=block,
            anchor_positions=torch.tensor([[position]]),
            prev_tokens=prev,
        )
    torch.testing.assert_close(
        proposal.draft_probs, probs_from_logits(out.logits[0, 0], temperature), atol=1e-6, rtol=1e-5
    )
    if head == "none":
        assert proposal.confidences is None
    else:
        torch.testing.assert_close(
            proposal.confidences, torch.sigmoid(out.confidence_logits[0, 0]), atol=1e-6, rtol=1e-5
        )


def test_threshold_policy_stops_drafting_at_the_first_low_confidence(target, prompt):
    drafter = make_drafter(target, "dspark", head="rnn")  # its c_1 spreads over (0.1, 0.99) here
    result = run(
        engine(
            with_stop_ids(target, []),
            DSparkProposer(drafter),
            policy="threshold",
            threshold=0.6,
            temperature=1.0,
            max_new_tokens=30,
        ),
        prompt,
    )
    lengths = {len(r.drafts) for r in result.rounds}
    assert len(lengths) > 1 and 0 in lengths  # stops at different slots, before slot 1 included
    for record in result.rounds:
        assert len(record.confidences) == len(record.drafts) == record.num_verified
        assert all(c >= 0.6 for c in record.confidences)
    fixed = run(engine(with_stop_ids(target, []), DSparkProposer(drafter), temperature=1.0), prompt)
    assert {len(r.drafts) for r in fixed.rounds} == {GAMMA}


def test_target_only_mode_is_plain_decoding(target, prompt):
    plain = with_stop_ids(target, [])
    result = run(engine(plain, None, policy="threshold", threshold=0.9, max_new_tokens=8), prompt)
    assert result.new_tokens == greedy_continuation(plain, prompt, 8)
    assert [(r.drafts, r.num_verified, r.num_accepted, r.committed) for r in result.rounds] == [([], 0, 0, 1)] * 7
    sampled = run(engine(plain, None, temperature=1.0, max_new_tokens=8), prompt, seed=1)
    assert len(sampled.new_tokens) == 8 and sampled.tau == 1.0
    assert sampled.tokens_per_second > 0 and all(r.seconds_verify > 0 for r in sampled.rounds)


def test_bad_inputs_raise(target, prompt):
    eagle = Eagle3Proposer(make_drafter(target, "eagle3"))
    with pytest.raises(ValueError, match="prompt is empty"):
        run(engine(target, None), [])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        run(engine(target, None), [5] * 2040)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        run(engine(target, None), [5, target.vocab_size])
    with pytest.raises(ValueError, match="decode.max_new_tokens"):
        run(engine(target, None), prompt, max_new_tokens=0)
    with pytest.raises(ValueError, match="decode.temperature"):
        engine(target, None, temperature=-1.0)
    with pytest.raises(ValueError, match=r"decode\.threshold"):
        engine(target, None, policy="threshold", threshold=2.0)
    with pytest.raises(ValueError, match="stage=profile"):
        engine(target, None, policy="scheduler", sps=None)
    with pytest.raises(ValueError, match="confidence head"):
        engine(target, eagle, policy="threshold", threshold=0.5)
    with pytest.raises(ValueError, match="context holds"):
        eagle.start(features=torch.zeros(1, 3, len(target.feature_layer_ids) * target.hidden_size), token_ids=[1, 2, 3])
        eagle.propose(anchor_token=4, anchor_position=5, temperature=1.0, generator=None, stop_ids=())


def test_api_round_trip(target, tmp_path):
    drafter = make_drafter(target, "dspark")
    spec = DrafterSpec(
        kind="dspark",
        head="markov",
        depth=1,
        block_size=GAMMA,
        markov_rank=8,
        feature_layers=tuple(target.feature_layer_ids),
        mask_token_id=target.mask_token_id,
        target_fingerprint=target.fingerprint,
    )
    save_drafter(tmp_path / "drafter.pt", spec=spec, state_dict=drafter.state_dict(), metrics={})
    for where in (tmp_path, tmp_path / "drafter.pt"):
        loaded = load_trained_drafter(where, target)
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    result = speculative_generate(
        target, loaded, "What is 2+2?", policy="threshold", threshold=0.3, max_new_tokens=10, seed=1
    )
    assert result.prompt_ids == target.chat_prompt_ids("What is 2+2?") and 1 <= len(result.new_tokens) <= 10
    assert all(r.confidences is not None and r.num_accepted <= r.num_verified for r in result.rounds)
    again = speculative_generate(
        target,
        loaded,
        result.prompt_ids,
        chat_template=False,
        max_new_tokens=10,
        seed=1,
        policy="threshold",
        threshold=0.3,
    )
    assert again.new_tokens == result.new_tokens  # same seed, same tokens
    baseline = speculative_generate(target, None, "hello", chat_template=False, max_new_tokens=4, temperature=0.0)
    assert baseline.prompt_ids == target.tokenizer("hello", add_special_tokens=False)["input_ids"]
    sps = SPSTable(batch_tokens=[1, 2, 3], steps_per_second=[1.0, 0.5, 0.45])  # paper Appendix A
    assert api.schedule_verification(torch.tensor([[0.8, 0.9]]), sps=sps).tolist() == [0]
    with pytest.raises(ValueError, match="allow_unsafe_full_search"):
        api.schedule_verification(torch.tensor([[0.8, 0.9]]), sps=sps, early_stop=False)
