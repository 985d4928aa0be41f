"""Tree decoding end to end on the tiny target (METHOD §5.1): the tree forward, the cache after a tree round, and
lossless output for every drafter at T = 1 (PIT chi-square, as tests/test_lossless.py) and T = 0 (HF's greedy tokens),
the draft vocabulary included, with a planted biased verifier that the distribution test catches.

Random drafters rarely propose the target's greedy token, so the greedy tests also splice the target's own greedy
continuation into every tree as an extra branch, appended after the drafter's nodes: the accepted path's rows are then
not contiguous in the verify forward, which exercises `Target.keep_positions`.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from lossless_checks import pit_values, uniformity_p_values
from test_lossless import DRAFTERS, draft_vocab, hf_greedy, lossless_drafters, make_drafter  # noqa: F401
from test_tree_verify import naive_sequential_verifier

from dspark.decoding import build_proposer
from dspark.decoding import tree_engine as tree_engine_module
from dspark.decoding.tree import DraftTree, TreeShape, tree_attention, tree_positions
from dspark.decoding.tree_engine import TreeEngine
from dspark.decoding.tree_proposers import propose_tree

TINY_TARGET = {"seed": 1}
NEW_TOKENS = 4
NUM_GENERATIONS = 200
P_MIN = 1e-3
pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = {
    "widths": (TreeShape("widths", widths=(3, 2, 2)), "descent"),
    "branching-rrsw": (TreeShape("branching", branching=(2, 2, 1)), "rrsw"),
    "branching-descent": (TreeShape("branching", branching=(2, 1, 1)), "descent"),
    "dynamic": (TreeShape("dynamic", nodes=6, beam=3), "descent"),
    "widths-rrsw": (TreeShape("widths", widths=(3, 2, 2)), "rrsw"),  # first child drawn, then the best others
    "dynamic-rrsw": (TreeShape("dynamic", nodes=6, beam=3), "rrsw"),
}
TREE_DRAFTERS = [*lossless_drafters(), "dspark-markov-vd", "eagle3-vd"]


@pytest.fixture(scope="module")
def target(tiny):
    with torch.no_grad():
        tiny.model.get_decoder().norm.weight.mul_(12.0)  # peaked p_t (tests/test_lossless.py)
    return tiny


@pytest.fixture(scope="module")
def prompt(target):
    return target.chat_prompt_ids("What is 2+2?")


def engine(target, drafter_name, shape_name, *, temperature, max_new_tokens=NEW_TOKENS):
    shape, scheme = SHAPES[shape_name]
    return TreeEngine(
        target=target,
        proposer=build_proposer(make_drafter(target, drafter_name)),
        shape=shape,
        scheme=scheme,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
    )


def test_tree_forward_rows_equal_causal_forwards_of_each_path(target, prompt):
    tree = DraftTree(
        torch.tensor([5, 9, 11, 7, 3]),
        torch.tensor([-1, -1, 0, 0, 1]),
        torch.tensor([1, 1, 2, 2, 2]),
        torch.ones(5, dtype=torch.float64),
    )
    anchor, context = 17, torch.tensor([prompt])
    cache = target.new_cache()
    target.forward(context, cache=cache)
    ids = torch.tensor([[anchor, *tree.tokens.tolist()]])
    out = target.forward(
        ids,
        attention_mask=tree_attention(tree, context=len(prompt)),
        position_ids=tree_positions(tree, anchor_position=len(prompt)),
        cache=cache,
        return_logits=True,
    )
    for node in range(-1, tree.size):
        path = [anchor, *tree.tokens[tree.path(node)].tolist()]
        causal = target.forward(torch.tensor([[*prompt, *path]]), return_logits=True).logits[0, -1]
        torch.testing.assert_close(out.logits[0, node + 1], causal, atol=1e-4, rtol=1e-4)
    # keep the anchor and the path 1 → 4 (rows 2 and 5): the cache is that causal sequence's
    target.keep_positions(cache, prefix=len(prompt) + 1, rows=[len(prompt) + 2, len(prompt) + 5])
    following = torch.tensor([[21]])
    after = target.forward(following, cache=cache, return_logits=True).logits[0, -1]
    causal = target.forward(torch.tensor([[*prompt, anchor, 9, 3, 21]]), return_logits=True).logits[0, -1]
    torch.testing.assert_close(after, causal, atol=1e-4, rtol=1e-4)


def test_keep_positions_refuses_rows_outside_the_cache(target, prompt):
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), cache=cache)
    with pytest.raises(ValueError, match="keep_positions"):
        target.keep_positions(cache, prefix=2, rows=[len(prompt) + 3])


@pytest.fixture(scope="module")
def greedy_path(target, prompt):
    return hf_greedy(target, prompt, max_new_tokens=20, stop_ids=target.stop_token_ids)


def splicing(free, prompt_length):
    """`propose_tree` with the target's greedy continuation after the anchor appended as one more branch."""

    def propose(proposer, shape, *, anchor_token, anchor_position, **kwargs):
        tree, seconds = propose_tree(
            proposer, shape, anchor_token=anchor_token, anchor_position=anchor_position, **kwargs
        )
        start = anchor_position - prompt_length + 1
        branch = free[start : start + 3]
        n = tree.size
        tokens = torch.cat([tree.tokens, torch.tensor(branch, dtype=torch.long)])
        parents = torch.cat([tree.parents, torch.tensor([-1, n, n + 1][: len(branch)])])
        depths = torch.cat([tree.depths, torch.arange(1, len(branch) + 1)])
        scores = torch.cat([tree.scores, torch.full((len(branch),), 0.5, dtype=torch.float64)])
        return DraftTree(tokens, parents, depths, scores, tree.child_probs), seconds

    return propose


@pytest.mark.parametrize("shape_name", ["widths", "branching-rrsw", "dynamic"])
@pytest.mark.parametrize("drafter_name", TREE_DRAFTERS)
def test_greedy_equals_hf_generate(target, prompt, greedy_path, drafter_name, shape_name, monkeypatch):
    plain = engine(target, drafter_name, shape_name, temperature=0.0, max_new_tokens=20)
    result = plain.generate(prompt, generator=torch.Generator().manual_seed(0))
    assert result.new_tokens == greedy_path
    if shape_name != "widths":
        return
    monkeypatch.setattr(tree_engine_module, "propose_tree", splicing(greedy_path, len(prompt)))
    spliced = engine(target, drafter_name, shape_name, temperature=0.0, max_new_tokens=20)
    result = spliced.generate(prompt, generator=torch.Generator().manual_seed(0))
    assert result.new_tokens == greedy_path
    assert result.tau > 3.5  # the spliced branch is accepted whole, from rows after the drafter's nodes


def test_greedy_stops_at_a_stop_id_inside_an_accepted_path(target, prompt, greedy_path, monkeypatch):
    stop = greedy_path[5]
    stopped = copy.copy(target)
    stopped.stop_token_ids = [stop]
    monkeypatch.setattr(tree_engine_module, "propose_tree", splicing(greedy_path, len(prompt)))
    result = engine(stopped, "dspark-markov", "widths", temperature=0.0, max_new_tokens=20).generate(
        prompt, generator=torch.Generator().manual_seed(0)
    )
    assert result.new_tokens == greedy_path[:6] and result.stop_reason == "eos"


def chi_square(target, prompt, results):
    """PIT chi-square p-values per position from 2 on and pooled (token 1 comes from the prefill alone)."""
    u_values = pit_values(target, prompt, [r.new_tokens for r in results], np.random.default_rng(0))
    groups = {f"position {k + 2}": u for k, u in enumerate(u_values[1:])}
    return uniformity_p_values(groups | {"pooled": np.concatenate(u_values[1:])})


class TargetBranchEngine(TreeEngine):
    """A tree engine whose every tree also holds the target's own two most likely next tokens after the anchor, each
    with its greedy successor: candidates with real p_t mass, so descents are frequent (and a verifier that
    over-accepts is visible). The branch depends on the committed context only, so `descent` stays exact."""

    def _round(self, state, generator):
        context = [*self.prompt, *state.new_tokens]
        original = tree_engine_module.propose_tree

        def propose(proposer, shape, **kwargs):
            tree, seconds = original(proposer, shape, **kwargs)
            with torch.no_grad():
                logits = self.target.forward(torch.tensor([context]), return_logits=True).logits[0, -1]
                firsts = logits.topk(2).indices.tolist()
                both = torch.tensor([[*context, t] for t in firsts])  # the two continuations in one forward
                seconds_ = self.target.forward(both, return_logits=True).logits[:, -1].argmax(-1).tolist()
            n = tree.size
            tokens = torch.cat([tree.tokens, torch.tensor([firsts[0], seconds_[0], firsts[1], seconds_[1]])])
            parents = torch.cat([tree.parents, torch.tensor([-1, n, -1, n + 2])])
            depths = torch.cat([tree.depths, torch.tensor([1, 2, 1, 2])])
            scores = torch.cat([tree.scores, torch.full((4,), 0.5, dtype=torch.float64)])
            return DraftTree(tokens, parents, depths, scores), seconds

        tree_engine_module.propose_tree = propose
        try:
            return super()._round(state, generator)
        finally:
            tree_engine_module.propose_tree = original

    def generate(self, prompt_ids, **kwargs):
        self.prompt = list(prompt_ids)
        return super().generate(prompt_ids, **kwargs)


def sample(target, prompt, drafter_name, shape_name, *, with_target_branch=False, count=NUM_GENERATIONS):
    shape, scheme = SHAPES[shape_name]
    kind = TargetBranchEngine if with_target_branch else TreeEngine
    tree_engine = kind(
        target=target,
        proposer=build_proposer(make_drafter(target, drafter_name)),
        shape=shape,
        scheme=scheme,
        temperature=1.0,
        max_new_tokens=NEW_TOKENS,
    )
    generator = torch.Generator().manual_seed(0)
    return [tree_engine.generate(prompt, generator=generator) for _ in range(count)]


# Every drafter kind (DSpark with a stateless and a recurrent head, DFlash, EAGLE-3), both schemes, every shape and
# the draft vocabulary; `rrsw` only on sampled trees (a spliced branch would not be a draw from q).
SAMPLING_CASES = [
    ("dspark-markov-vd", "branching-rrsw", False),
    ("dspark-rnn", "branching-rrsw", False),
    ("dflash-vd", "widths", True),
    ("eagle3", "dynamic", True),
    ("dspark-gated", "branching-descent", False),
    ("dspark-markov", "widths-rrsw", False),
    ("eagle3-vd", "dynamic-rrsw", False),
]


@pytest.mark.parametrize(
    ("drafter_name", "shape_name", "with_target_branch"),
    # the fast tier keeps the first case; every case runs in the slow tier (make test-all)
    [pytest.param(*case, marks=() if i == 0 else pytest.mark.slow) for i, case in enumerate(SAMPLING_CASES)],
)
def test_sampling_matches_the_target_distribution(target, prompt, drafter_name, shape_name, with_target_branch):
    results = sample(target, prompt, drafter_name, shape_name, with_target_branch=with_target_branch)
    rounds = [r for result in results for r in result.rounds]
    assert any(r.num_accepted > 0 for r in rounds)  # descents happen, so the path's cache and context are used
    if with_target_branch:
        assert any(r.num_accepted == 2 for r in rounds)
    p_values = chi_square(target, prompt, results)
    assert min(p_values.values()) > P_MIN, p_values


def planted_verifier(*, tree, target_logits, temperature, scheme, generator):
    """`naive_sequential_verifier` (tests/test_tree_verify.py) on the engine's lazily computed rows."""
    rows = torch.stack([target_logits.row(i) for i in range(target_logits.num_rows)]) / temperature
    return naive_sequential_verifier(
        tree=tree, target_logits=rows, temperature=temperature, scheme=scheme, generator=generator
    )


def test_the_test_can_fail(target, prompt, monkeypatch):
    monkeypatch.setattr(tree_engine_module, "verify_tree", planted_verifier)
    results = sample(target, prompt, "dspark-markov", "widths", with_target_branch=True)
    assert chi_square(target, prompt, results)["pooled"] < P_MIN


def test_chains_stay_on_the_chain_engine(target):
    proposer = build_proposer(make_drafter(target, "dspark-markov"))
    with pytest.raises(ValueError, match="chain engine"):
        TreeEngine(target=target, proposer=proposer, shape=TreeShape("chain"), temperature=1.0, max_new_tokens=4)
