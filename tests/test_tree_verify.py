"""Draft trees and their verifier (METHOD §5.1): tree structure, sizing, and exact distribution tests.

Exact test. The "target" is a Markov chain over a 5-token vocabulary (p_t(· | path) = P[last token]), the drafter
another one (Q). A round's committed tokens are extended with draws from P until two tokens exist; under losslessness
(x_1, x_2) is distributed as P[a, x_1] P[x_1, x_2] whatever the tree, which a 25-cell chi-square tests. Each scheme
is tested on the trees it is exact for — `descent` on deterministic trees (top-k children, beams) and sampled ones,
`rrsw` on trees drawn without replacement (`gumbel_order`) — with a planted biased verifier that the same test
catches, batched (one padded forward's rows, several trees) as well as single.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from dspark.decoding.tree import (
    TREE_SHAPES,
    DraftTree,
    TreeShape,
    best_nodes,
    choose_node_budget,
    min_worthwhile_score,
    step_cost_table,
    tree_attention,
    tree_positions,
)
from dspark.decoding.tree_proposers import gumbel_order
from dspark.decoding.tree_verify import TREE_SCHEMES, TreeVerifyResult, verify_tree, verify_trees_batched
from dspark.decoding.verify import sample_from_probs
from dspark.scheduling import SPSTable

V = 5
ANCHOR = 0
TRIALS = 4000
P_MIN = 1e-3


def markov(seed: int, peak: float) -> torch.Tensor:
    """[V, V] row-stochastic table, each row a Dirichlet draw mixed with a floor (every cell ≥ 0.02)."""
    rng = np.random.default_rng(seed)
    rows = rng.dirichlet(np.full(V, peak), size=V)
    return torch.tensor(0.9 * rows + 0.1 / V, dtype=torch.float64)


P = markov(1, 0.7)  # the target
Q = markov(2, 0.7)  # the drafter: a different chain, so there are rejections, corrections and acceptances


def tree_from(tokens, parents, child_probs=None, sampled=None) -> DraftTree:
    tokens_t = torch.tensor(tokens, dtype=torch.long)
    parents_t = torch.tensor(parents, dtype=torch.long)
    depths = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return DraftTree(
        tokens_t,
        parents_t,
        torch.tensor(depths),
        torch.ones(len(tokens), dtype=torch.float64),
        child_probs or {},
        sampled or {},
    )


def deterministic_tree(branching) -> DraftTree:
    """Top-k children by Q at every node: the same tree every time."""
    tokens, parents, frontier = [], [], [(-1, ANCHOR)]
    for k in branching:
        nxt = []
        for node, token in frontier:
            for child in Q[token].topk(k).indices.tolist():
                nxt.append((len(tokens), child))
                tokens.append(child)
                parents.append(node)
        frontier = nxt
    return tree_from(tokens, parents)


def sampled_tree(branching, generator) -> DraftTree:
    """Children drawn without replacement from Q[parent] (Gumbel-top-k), Q recorded per parent."""
    tokens, parents, frontier, child_probs, sampled = [], [], [(-1, ANCHOR)], {}, {}
    for k in branching:
        nxt = []
        for node, token in frontier:
            q = Q[token].float()
            child_probs[node] = q
            sampled[node] = k
            for child in gumbel_order(q, k, generator).tolist():
                nxt.append((len(tokens), child))
                tokens.append(child)
                parents.append(node)
        frontier = nxt
    return tree_from(tokens, parents, child_probs, sampled)


def mixed_tree(branching, generator) -> DraftTree:
    """Each node's first child drawn from Q[parent], the others Q's top tokens besides it (widths / dynamic with
    decode.tree.scheme=rrsw)."""
    tokens, parents, frontier, child_probs, sampled = [], [], [(-1, ANCHOR)], {}, {}
    for k in branching:
        nxt = []
        for node, token in frontier:
            q = Q[token].float()
            child_probs[node], sampled[node] = q, 1
            drawn = int(gumbel_order(q, 1, generator))
            extras = [t for t in q.topk(k).indices.tolist() if t != drawn][: k - 1]
            for child in [drawn, *extras]:
                nxt.append((len(tokens), child))
                tokens.append(child)
                parents.append(node)
        frontier = nxt
    return tree_from(tokens, parents, child_probs, sampled)


def target_logits(tree: DraftTree) -> torch.Tensor:
    """[N+1, V]: row 0 after the anchor, row i+1 after node i (the Markov target reads the last token)."""
    last = [ANCHOR, *tree.tokens.tolist()]
    return P[last].log().float()


def first_two(result: TreeVerifyResult, generator) -> tuple[int, int]:
    tokens = result.tokens
    while len(tokens) < 2:
        tokens.append(int(sample_from_probs(P[tokens[-1]], generator)))
    return tokens[0], tokens[1]


def joint_p_value(pairs) -> float:
    counts = np.zeros((V, V))
    for a, b in pairs:
        counts[a, b] += 1
    expected = (P[ANCHOR].unsqueeze(1) * P).numpy() * len(pairs)
    return stats.chisquare(counts.ravel(), expected.ravel()).pvalue


def run_trials(make_tree, verifier, scheme, *, batched: bool = False, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    pairs, accepted = [], 0
    step = 3 if batched else 1
    for _ in range(TRIALS // step):
        trees = [make_tree(generator) for _ in range(step)]
        if batched:  # one padded [R, L+1, V] block, as from one batched forward
            width = max(t.size for t in trees)
            logits = torch.zeros(step, width + 1, V)
            for r, tree in enumerate(trees):
                logits[r, : tree.size + 1] = target_logits(tree)
            results = verifier(trees=trees, target_logits=logits, temperature=1.0, scheme=scheme, generator=generator)
        else:
            results = [
                verifier(
                    tree=trees[0],
                    target_logits=target_logits(trees[0]),
                    temperature=1.0,
                    scheme=scheme,
                    generator=generator,
                )
            ]
        for result in results:
            accepted += result.num_accepted
            pairs.append(first_two(result, generator))
    return joint_p_value(pairs), accepted / len(pairs)


CASES = {
    "descent/top-k [2,2]": (lambda g: deterministic_tree([2, 2]), "descent"),
    "descent/top-k [3,1,1]": (lambda g: deterministic_tree([3, 1, 1]), "descent"),
    "descent/sampled [2,2]": (lambda g: sampled_tree([2, 2], g), "descent"),
    "rrsw/sampled [2,2]": (lambda g: sampled_tree([2, 2], g), "rrsw"),
    "rrsw/sampled [3,1]": (lambda g: sampled_tree([3, 1], g), "rrsw"),
    "rrsw/sampled chain [1,1]": (lambda g: sampled_tree([1, 1], g), "rrsw"),
    "rrsw/drawn first + top-k [3,2]": (lambda g: mixed_tree([3, 2], g), "rrsw"),
}


def test_every_registered_scheme_is_tested():
    assert {scheme for _, scheme in CASES.values()} == set(TREE_SCHEMES.names())


BATCHED = (
    "descent/top-k [2,2]",
    "rrsw/sampled [2,2]",
    "rrsw/drawn first + top-k [3,2]",
)  # one per scheme: the batched call is the singles in turn


@pytest.mark.parametrize(
    ("case", "batched"), [(c, False) for c in CASES] + [(c, True) for c in BATCHED], ids=lambda v: str(v)
)
def test_tree_verification_is_exactly_the_targets_distribution(case, batched):
    make_tree, scheme = CASES[case]
    verifier = verify_trees_batched if batched else verify_tree
    p_value, mean_accepted = run_trials(make_tree, verifier, scheme, batched=batched)
    assert mean_accepted > 0.3  # acceptances, descents and corrections all happen
    assert p_value > P_MIN, p_value


def naive_sequential_verifier(*, tree, target_logits, temperature, scheme, generator):
    """A plausible bug: accept each child c with probability p_t(c) in turn, never renormalising after a rejection
    (as if each child were the only candidate), then emit y ~ p_t."""
    node, path = -1, []
    tokens = tree.tokens.tolist()
    while True:
        p = torch.softmax(target_logits[node + 1].double(), -1)
        chosen = None
        for child in tree.children(node):
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(p[tokens[child]]):
                chosen = child
                break
        if chosen is None:
            y = int(sample_from_probs(p, generator))
            return TreeVerifyResult(path, tree.tokens[path], y)
        path.append(chosen)
        node = chosen


def with_replacement_rrsw(*, tree, target_logits, temperature, scheme, generator):
    """A plausible bug in rrsw: the drawn candidates are not removed from q (sampling treated as with replacement)."""
    node, path = -1, []
    tokens = tree.tokens.tolist()
    while True:
        p = torch.softmax(target_logits[node + 1].double(), -1)
        kids = tree.children(node)
        chosen = None
        if kids:
            q = tree.child_probs[node].double()
            for child in kids:
                token = tokens[child]
                if float(torch.rand((), generator=generator, dtype=torch.float64)) * float(q[token]) < float(p[token]):
                    chosen = child
                    break
                p = (p - q).clamp_min(0)
                p = p / p.sum()
        if chosen is None:
            y = int(sample_from_probs(p, generator))
            return TreeVerifyResult(path, tree.tokens[path], y)
        path.append(chosen)
        node = chosen


def residual_ignoring_descent(*, tree, target_logits, temperature, scheme, generator):
    """A plausible bug in rrsw's second half: after the drawn child is rejected, descend with a fresh y ~ p_t instead
    of a draw from the residual (the rejection's information is thrown away)."""
    node, path = -1, []
    tokens = tree.tokens.tolist()
    while True:
        p = torch.softmax(target_logits[node + 1].double(), -1)
        kids = tree.children(node)
        chosen = None
        if kids and tree.sampled.get(node):
            q = tree.child_probs[node].double()
            token = tokens[kids[0]]
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * float(q[token]) < float(p[token]):
                chosen = kids[0]
        if chosen is None:
            y = int(sample_from_probs(p, generator))
            chosen = next((c for c in kids[1:] if tokens[c] == y), None)
            if chosen is None:
                return TreeVerifyResult(path, tree.tokens[path], y)
        path.append(chosen)
        node = chosen


@pytest.mark.parametrize(
    ("case", "planted"),
    [
        ("descent/top-k [3,1,1]", naive_sequential_verifier),
        ("rrsw/sampled [2,2]", with_replacement_rrsw),
        ("rrsw/drawn first + top-k [3,2]", residual_ignoring_descent),
    ],
)
def test_the_test_can_fail(case, planted):
    make_tree, scheme = CASES[case]
    p_value, _ = run_trials(make_tree, planted, scheme)
    assert p_value < P_MIN, p_value


def test_greedy_walk_follows_the_targets_argmax():
    tree = deterministic_tree([3, 2])
    logits = target_logits(tree)
    result = verify_tree(tree=tree, target_logits=logits, temperature=0.0)
    expected, token = [], ANCHOR
    while True:  # the target's greedy tokens: accepted while they are among the current node's children
        best = int(P[token].argmax())
        expected.append(best)
        kids = [c for c in tree.children(result.path[len(expected) - 2] if len(expected) > 1 else -1)]
        if best not in [int(tree.tokens[c]) for c in kids]:
            break
        token = best
    assert result.tokens == expected


def test_rrsw_on_a_tree_without_drawn_children_is_descent():
    tree = deterministic_tree([2, 2])
    for seed in range(20):
        results = [
            verify_tree(
                tree=tree,
                target_logits=target_logits(tree),
                temperature=1.0,
                scheme=scheme,
                generator=torch.Generator().manual_seed(seed),
            )
            for scheme in ("descent", "rrsw")
        ]
        assert results[0].tokens == results[1].tokens


def test_a_subtree_keeps_only_a_leading_run_of_drawn_children():
    tree = sampled_tree([3], torch.Generator().manual_seed(0))
    assert tree.sampled == {-1: 3}
    assert tree.subtree([0, 1]).sampled == {-1: 2}
    assert tree.subtree([1, 2]).sampled == {}  # the first draw is gone: the others are plain candidates now
    assert tree.subtree([0, 2]).sampled == {-1: 1}


# ---- structure and sizing ----


def test_attention_mask_and_positions_follow_the_ancestors():
    #        anchor
    #       /      \
    #      0        1
    #     / \       |
    #    2   3      4
    tree = tree_from([1, 2, 3, 4, 0], [-1, -1, 0, 0, 1])
    mask = tree_attention(tree, context=2)[0, 0]
    assert mask.shape == (6, 8) and bool(mask[:, :2].all())
    rows = mask[:, 2:].int().tolist()
    assert rows == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert tree_positions(tree, anchor_position=7).tolist() == [[7, 8, 8, 9, 9, 9]]
    assert tree.path(4) == [1, 4] and tree.children(0) == [2, 3]


def test_a_parent_after_its_child_or_a_wrong_depth_is_refused():
    with pytest.raises(ValueError, match="parent must be an earlier node"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]), torch.tensor([2, 1]), torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="depth one more"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.tensor([1, 3]), torch.ones(2, dtype=torch.float64))


def test_best_nodes_form_a_tree_even_with_ties():
    tree = tree_from([1, 2, 3, 4, 0], [-1, -1, 0, 0, 1])
    tree.scores = torch.tensor([0.5, 0.5, 0.5, 0.1, 0.4], dtype=torch.float64)
    for count in range(6):
        chosen = best_nodes(tree, count)
        assert len(chosen) == count
        assert all(tree.parents[i] < 0 or int(tree.parents[i]) in chosen for i in chosen)
        sub = tree.subtree(chosen)
        assert sub.size == count


def test_node_budget_maximises_expected_tokens_per_second():
    scores = torch.tensor([0.9, 0.6, 0.3, 0.2, 0.05], dtype=torch.float64)

    def step(tokens):  # flat until 3 tokens, then +40% per token
        return 1.0 + max(0, tokens - 3) * 0.4

    costs = torch.tensor([step(b) for b in range(1, 7)], dtype=torch.float64)
    chosen = choose_node_budget(scores, step_costs=costs)
    rates = [(1 + float(scores[:n].sum())) / step(n + 1) for n in range(6)]
    assert chosen == int(np.argmax(rates))
    flat = torch.ones(4, dtype=torch.float64)
    assert choose_node_budget(scores, step_costs=flat) == 3  # free verification: the cap (3 nodes)
    assert choose_node_budget(scores, step_costs=torch.arange(1, 7, dtype=torch.float64)) == 0  # none pays
    # the table: seconds per forward at B = 1..N+1, from any SPS(B)
    sps = SPSTable(batch_tokens=[1, 2, 4], steps_per_second=[10.0, 9.0, 5.0])
    table = step_cost_table(sps, 3)
    torch.testing.assert_close(table, torch.tensor([0.1, 1 / 9, 1 / 7, 0.2], dtype=torch.float64))


def test_growth_stops_where_no_node_can_pay_for_itself():
    costs = torch.tensor([1.0, 1.1, 1.3, 1.6], dtype=torch.float64)  # +10%, +18%, +23% per extra token
    threshold = min_worthwhile_score(costs)
    assert threshold == pytest.approx(0.1)
    for count in range(1, 4):  # below the threshold no node of any score raises the rate, at any N
        base = torch.tensor([0.9, 0.5, 0.3], dtype=torch.float64)[: count - 1]
        with_weak = torch.cat([base, torch.tensor([threshold * 0.99], dtype=torch.float64)])
        assert choose_node_budget(with_weak, step_costs=costs) <= count - 1


def test_shapes_are_registered_and_checked():
    assert set(TREE_SHAPES.names()) == {"chain", "widths", "branching", "dynamic"}
    assert TreeShape("branching", branching=(2, 2, 1)).max_nodes(7) == 2 + 4 + 4
    assert TreeShape("widths", widths=(4, 2, 2, 1, 1, 1, 1)).max_nodes(5) == 4 + 2 + 2 + 1 + 1
    assert TreeShape("dynamic", nodes=10, beam=4).max_nodes(7) == 10
    with pytest.raises(ValueError, match="decode.tree.widths"):
        TreeShape("widths")
    with pytest.raises(ValueError, match="decode.tree.shape='star'"):
        TreeShape("star")
