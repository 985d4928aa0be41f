"""Batched tree decoding (`serving.trees.BatchedTreeEngine`): R requests, each with its own tree, verified in one
padded forward over a cache with holes. With R = 1 it is exactly the single-request `TreeEngine`; with prompts of
different lengths its greedy output is HF's greedy output per prompt; sampled, its tokens follow the target's own
distribution (PIT chi-square, as tests/test_lossless.py), with a planted biased verifier that the test catches.

The target's own likely continuation is spliced into every tree (as tests/test_tree_engine.py does) so that long
paths are accepted from columns that are not contiguous in the block, with other rows padded around them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.decoding import build_proposer
from dspark.decoding.tree import DraftTree, TreeShape
from dspark.decoding.tree_engine import TreeEngine
from dspark.serving import trees as trees_module
from dspark.serving.trees import BatchedTreeEngine
from lossless_checks import pit_values, uniformity_p_values
from test_lossless import hf_greedy, make_drafter
from test_tree_verify import naive_sequential_verifier

TINY_TARGET = {"seed": 1}
P_MIN = 1e-3
pytestmark = pytest.mark.usefixtures("one_thread")
SHAPES = {
    "branching-rrsw": (TreeShape("branching", branching=(2, 2, 1)), "rrsw"),
    "dynamic": (TreeShape("dynamic", nodes=6, beam=3), "descent"),
    "widths": (TreeShape("widths", widths=(3, 2, 1)), "descent"),
}


@pytest.fixture(scope="module")
def target(tiny):
    with torch.no_grad():
        tiny.model.get_decoder().norm.weight.mul_(12.0)  # peaked p_t (tests/test_lossless.py)
    return tiny


@pytest.fixture(scope="module")
def prompts(target):
    return [target.chat_prompt_ids(text) for text in ("What is 2+2?", "Name a colour.", "Count to three, please now.")]


def batched(target, drafter_name, shape_name, *, temperature, max_new_tokens, kind=BatchedTreeEngine):
    shape, scheme = SHAPES[shape_name]
    return kind(
        target=target,
        proposer=build_proposer(make_drafter(target, drafter_name)),
        shape=shape,
        scheme=scheme,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
    )


@pytest.mark.parametrize(("drafter_name", "shape_name"), [("dspark-rnn", "branching-rrsw"), ("eagle3-vd", "dynamic")])
def test_one_request_is_exactly_the_single_engine(target, prompts, drafter_name, shape_name):
    shape, scheme = SHAPES[shape_name]
    drafter = make_drafter(target, drafter_name)
    single = TreeEngine(
        target=target, proposer=build_proposer(drafter), shape=shape, scheme=scheme, temperature=1.0, max_new_tokens=12
    )
    together = BatchedTreeEngine(
        target=target, proposer=build_proposer(drafter), shape=shape, scheme=scheme, temperature=1.0, max_new_tokens=12
    )
    for seed in range(3):
        expected = single.generate(prompts[0], generator=torch.Generator().manual_seed(seed))
        (got,) = together.generate([prompts[0]], generator=torch.Generator().manual_seed(seed))
        assert got.new_tokens == expected.new_tokens
        assert [r.num_accepted for r in got.rounds] == [r.num_accepted for r in expected.rounds]


class TargetBranches(BatchedTreeEngine):
    """Every request's tree also holds the target's two most likely next tokens, each with its greedy successor."""

    def _step(self, active, cache, generator):
        contexts = {id(r.proposer): [*r.prompt, *r.new_tokens] for r in active}
        original = trees_module.propose_tree
        target = self.target

        def propose(proposer, shape, **kwargs):
            tree, seconds = original(proposer, shape, **kwargs)
            context = contexts[id(proposer)]
            with torch.no_grad():
                firsts = target.forward(torch.tensor([context]), return_logits=True).logits[0, -1].topk(2).indices
                both = torch.tensor([[*context, int(t)] for t in firsts])
                seconds_ = target.forward(both, return_logits=True).logits[:, -1].argmax(-1)
            n = tree.size
            return DraftTree(
                torch.cat([tree.tokens, torch.stack([firsts[0], seconds_[0], firsts[1], seconds_[1]])]),
                torch.cat([tree.parents, torch.tensor([-1, n, -1, n + 2])]),
                torch.cat([tree.depths, torch.tensor([1, 2, 1, 2])]),
                torch.cat([tree.scores, torch.full((4,), 0.5, dtype=torch.float64)]),
            ), seconds

        trees_module.propose_tree = propose
        try:
            return super()._step(active, cache, generator)
        finally:
            trees_module.propose_tree = original


@pytest.mark.parametrize("shape_name", ["widths", "dynamic"])
def test_greedy_equals_hf_generate_for_prompts_of_different_lengths(target, prompts, shape_name):
    engine = batched(target, "dspark-markov", shape_name, temperature=0.0, max_new_tokens=16, kind=TargetBranches)
    results = engine.generate(prompts, generator=torch.Generator().manual_seed(0))
    for prompt, result in zip(prompts, results):
        assert result.new_tokens == hf_greedy(target, prompt, max_new_tokens=16, stop_ids=target.stop_token_ids)
        assert result.tau > 2.0  # the spliced branches are accepted, from columns past the drafter's nodes


def sample(target, prompt, drafter_name, shape_name, *, kind, steps=60, rows=4):
    engine = batched(target, drafter_name, shape_name, temperature=1.0, max_new_tokens=4, kind=kind)
    generator = torch.Generator().manual_seed(0)
    return [r for _ in range(steps) for r in engine.generate([prompt] * rows, generator=generator)]


def chi_square(target, prompt, results):
    u_values = pit_values(target, prompt, [r.new_tokens for r in results], np.random.default_rng(0))[1:]
    groups = {f"position {k + 2}": u for k, u in enumerate(u_values)}
    return uniformity_p_values(groups | {"pooled": np.concatenate(u_values)})


@pytest.mark.parametrize(
    ("drafter_name", "shape_name", "kind"),
    [
        ("dspark-markov-vd", "branching-rrsw", BatchedTreeEngine),
        pytest.param("eagle3", "widths", TargetBranches, marks=pytest.mark.slow),  # the slow tier (make test-all)
    ],
)
def test_sampling_matches_the_target_distribution(target, prompts, drafter_name, shape_name, kind):
    results = sample(target, prompts[0], drafter_name, shape_name, kind=kind)
    assert any(r.num_accepted > 0 for result in results for r in result.rounds)
    p_values = chi_square(target, prompts[0], results)
    assert min(p_values.values()) > P_MIN, p_values


def test_the_test_can_fail(target, prompts, monkeypatch):
    def planted(*, trees, target_logits, temperature, scheme, generator):
        return [
            naive_sequential_verifier(
                tree=tree,
                target_logits=target_logits[r, : tree.size + 1] / temperature,
                temperature=temperature,
                scheme=scheme,
                generator=generator,
            )
            for r, tree in enumerate(trees)
        ]

    monkeypatch.setattr(trees_module, "verify_trees_batched", planted)
    results = sample(target, prompts[0], "dspark-markov", "widths", kind=TargetBranches)
    assert chi_square(target, prompts[0], results)["pooled"] < P_MIN
