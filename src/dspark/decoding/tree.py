"""Draft trees: many candidate continuations of one anchor, verified by the target in one forward (METHOD §5.1).

A tree holds N nodes after the anchor x_0. Node i carries a target token id, its parent (−1 = the anchor) and its depth
(1 = a candidate for slot 1); nodes are in topological order (a parent before its children, depths non-decreasing), and
the children of a node are kept in the order they were drawn. The target verifies the anchor and every node in one
forward over N + 1 tokens: each attends to the context and to its own ancestors (`tree_attention`), at position
p + depth (`tree_positions`), so row 0 of the target's output is p_t after the anchor and row i + 1 is p_t after node
i's path.

Shapes (`TreeShape`, `decode.tree.*`) — how many nodes, and which:

    widths     nodes per depth, e.g. [4, 2, 2, 1, 1, 1, 1]: at each depth the w_d candidates of highest path score among
               the children of the previous depth (a beam; the chain is [1] * γ)
    branching  children per node at each depth, e.g. [2, 2, 1]: every node at depth d has b_d children (2 + 4 + 4 nodes);
               at T > 0 they are *drawn* without replacement from the node's draft distribution (`rrsw` accepts them
               by rejection sampling)
    dynamic    the beam [beam] * depth, then only the N nodes of highest path score, N ≤ `nodes` chosen per round
               (`choose_node_budget`: expected accepted tokens per second from this machine's SPS(B) table)

With `decode.tree.scheme=rrsw` at T > 0, the widths and dynamic shapes draw the first child of every node they expand
from the draft distribution (kept whatever the beam says) and fill the rest of the depth's width with the best
deterministic candidates: each node then accepts at least what a chain's rejection sampling would, plus the target's
residual mass on its other children (`tree_verify`).

The path score of a node is the product of the draft probabilities (at T = 1) of the tokens on its path: the drafter's
estimate of the chance the target accepts the whole path. Scores never grow along a path, so the N best nodes
(ties broken toward shallower nodes) always form a tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dspark.registry import Registry

TREE_KEY = "decode.tree"
TREE_SHAPES: Registry[str] = Registry(f"{TREE_KEY}.shape")
for _name, _about in (
    ("chain", "one path of γ drafts: today's chain engine (decode.policy chooses ℓ)"),
    ("widths", "nodes per depth (decode.tree.widths), the best path scores among the previous depth's children"),
    ("branching", "children per node at each depth (decode.tree.branching); sampled without replacement at T > 0"),
    ("dynamic", "the best decode.tree.nodes path scores of a [decode.tree.beam] * depth beam, N sized per round"),
):
    TREE_SHAPES.register(_name, label=_about)(_name)


@dataclass
class DraftTree:
    """N drafted nodes after one anchor (module docstring). Shape symbols: N nodes, V the target's vocabulary."""

    tokens: Tensor  # [N] long, target ids
    parents: Tensor  # [N] long, −1 = the anchor, else an earlier node
    depths: Tensor  # [N] long, 1..D
    scores: Tensor  # [N] float64, path scores (product of the draft probabilities at T = 1 along the path)
    #: parent (−1 = anchor) → [V] float32 distribution q its sampled children were drawn from (the `rrsw` verifier's)
    child_probs: dict[int, Tensor] = field(default_factory=dict)
    #: parent → how many of its first children (in node order) were drawn in that order without replacement from
    #: child_probs[parent]; its other children are any further candidates (deterministic top-k). Absent = none sampled
    sampled: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if not (self.parents.shape == self.depths.shape == self.scores.shape == (n,)):
            raise ValueError(
                f"DraftTree: tokens, parents, depths and scores must all be [N], got {tuple(self.tokens.shape)}, "
                f"{tuple(self.parents.shape)}, {tuple(self.depths.shape)}, {tuple(self.scores.shape)}"
            )
        parents, depths = self.parents.tolist(), self.depths.tolist()
        for i, (parent, depth) in enumerate(zip(parents, depths)):
            expected = 1 if parent < 0 else depths[parent] + 1 if parent < i else None
            if expected is None or depth != expected:
                raise ValueError(
                    f"DraftTree: node {i} has parent {parent} and depth {depth}; a parent must be an earlier node "
                    "(or −1, the anchor) and a depth one more than its parent's"
                )
        self._parent_list, self._depth_list = parents, depths
        self._children: list[list[int]] = [[] for _ in range(n + 1)]  # [u + 1]: the children of u, in node order
        for i, parent in enumerate(parents):
            self._children[parent + 1].append(i)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def depth(self) -> int:
        """The deepest node's depth (0 for an empty tree)."""
        return max(self._depth_list, default=0)

    def children(self, node: int) -> list[int]:
        """Nodes whose parent is `node` (−1 = the anchor), in draw order."""
        return self._children[node + 1]

    def path(self, node: int) -> list[int]:
        """Nodes from depth 1 down to `node` (empty for −1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self._parent_list[node]
        return out[::-1]

    def cut_to_depth(self, room: int | None) -> DraftTree:
        """The nodes of depth ≤ `room` (the positions left in the target's context; None: no limit)."""
        if room is None or self.depth <= room:
            return self
        return self.subtree([i for i, depth in enumerate(self._depth_list) if depth <= room])

    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self._parent_list))

    def subtree(self, keep: list[int]) -> DraftTree:
        """The tree of the nodes `keep` (each node's parent kept too; any order), renumbered in their tree order."""
        keep = sorted(set(keep))
        index = {old: new for new, old in enumerate(keep)}
        missing = [i for i in keep if self._parent_list[i] >= 0 and self._parent_list[i] not in index]
        if missing:
            raise ValueError(f"DraftTree.subtree: nodes {missing} are kept without their parents")
        rows = torch.tensor(keep, dtype=torch.long, device=self.tokens.device)
        parents = torch.tensor(
            [index[self._parent_list[i]] if self._parent_list[i] >= 0 else -1 for i in keep],
            dtype=torch.long,
            device=self.tokens.device,
        )
        # A parent keeps its sampled children only as the same leading run of draws: dropping the first draw leaves
        # the later ones conditioned on it, so they count as plain candidates (its node is then verified by descent).
        kept = set(keep)
        sampled, child_probs = {}, {}
        for parent, count in self.sampled.items():
            if parent >= 0 and parent not in index:
                continue
            children = self.children(parent)
            run = 0
            while run < count and children[run] in kept:
                run += 1
            new_parent = index[parent] if parent >= 0 else -1
            if run:
                sampled[new_parent], child_probs[new_parent] = run, self.child_probs[parent]
        return DraftTree(self.tokens[rows], parents, self.depths[rows], self.scores[rows], child_probs, sampled)


def empty_tree(device: torch.device | str = "cpu") -> DraftTree:
    none = torch.zeros(0, dtype=torch.long, device=device)
    return DraftTree(none, none.clone(), none.clone(), torch.zeros(0, dtype=torch.float64, device=device))


def tree_attention(tree: DraftTree, *, context: int) -> Tensor:
    """[1, 1, N+1, context+N+1] bool: row 0 (the anchor) and each node row see the `context` cached positions, the
    anchor and the node's ancestors and itself (True = attend), the mask of one verify forward."""
    n = tree.size
    device = tree.tokens.device
    ancestors = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=device)
    ancestors[:, 0] = True
    parents = tree._parent_list
    for i in range(n):
        row = i + 1
        parent_row = parents[i] + 1
        ancestors[row] = ancestors[parent_row]
        ancestors[row, row] = True
    past = torch.ones(n + 1, context, dtype=torch.bool, device=device)
    return torch.cat([past, ancestors], dim=1)[None, None]


def tree_positions(tree: DraftTree, *, anchor_position: int) -> Tensor:
    """[1, N+1] long: p for the anchor, p + depth for each node."""
    depths = torch.cat([tree.depths.new_zeros(1), tree.depths])
    return (depths + anchor_position).unsqueeze(0)


@dataclass(frozen=True)
class TreeShape:
    """What tree a round drafts (module docstring; config `decode.tree`)."""

    kind: str = "chain"
    widths: tuple[int, ...] = ()
    branching: tuple[int, ...] = ()
    nodes: int = 16  # dynamic: the most nodes a round may verify
    beam: int = 4  # dynamic: nodes expanded (and kept) per depth
    depth: int = 0  # dynamic: deepest level drafted (0 = the drafter's γ)

    def __post_init__(self) -> None:
        if self.kind not in TREE_SHAPES:
            raise ValueError(f"{TREE_KEY}.shape={self.kind!r}: choose one of {', '.join(TREE_SHAPES.ordered())}")
        for key, values in (("widths", self.widths), ("branching", self.branching)):
            if any(int(v) < 1 for v in values):
                raise ValueError(f"{TREE_KEY}.{key}={list(values)}: every entry must be >= 1")
        if self.kind == "widths" and not self.widths:
            raise ValueError(f"{TREE_KEY}.shape=widths needs {TREE_KEY}.widths, e.g. [4,2,2,1,1,1,1]")
        if self.kind == "branching" and not self.branching:
            raise ValueError(f"{TREE_KEY}.shape=branching needs {TREE_KEY}.branching, e.g. [2,2,1,1]")
        if self.kind == "dynamic" and (self.nodes < 1 or self.beam < 1 or self.depth < 0):
            raise ValueError(
                f"{TREE_KEY}: dynamic needs nodes >= 1, beam >= 1 and depth >= 0 (0 = γ); got nodes={self.nodes}, "
                f"beam={self.beam}, depth={self.depth}"
            )

    @classmethod
    def from_config(cls, tree: Any) -> TreeShape:
        """From the `decode.tree` config group (`config.schema.TreeConfig`)."""
        return cls(
            kind=tree.shape,
            widths=tuple(int(w) for w in tree.widths),
            branching=tuple(int(b) for b in tree.branching),
            nodes=int(tree.nodes),
            beam=int(tree.beam),
            depth=int(tree.depth),
        )

    def label(self) -> str:
        """A short name for reports and file names: chain, widths[4,2,2], branching[2,2,1], dynamic16b4."""
        if self.kind == "widths":
            return "widths[" + ",".join(map(str, self.widths)) + "]"
        if self.kind == "branching":
            return "branching[" + ",".join(map(str, self.branching)) + "]"
        if self.kind == "dynamic":
            return f"dynamic{self.nodes}b{self.beam}" + (f"d{self.depth}" if self.depth else "")
        return "chain"

    def levels(self, gamma: int) -> list[int]:
        """Per-depth counts the growth uses: nodes per depth (widths, dynamic's beam) or children per node
        (branching), cut to the drafter's γ slots."""
        if self.kind == "chain":
            return [1] * gamma
        if self.kind == "widths":
            return list(self.widths)[:gamma]
        if self.kind == "branching":
            return list(self.branching)[:gamma]
        return [self.beam] * min(gamma, self.depth or gamma)

    def max_nodes(self, gamma: int) -> int:
        """The most nodes a round of this shape drafts for a drafter of γ slots."""
        levels = self.levels(gamma)
        if self.kind == "branching":
            total, width = 0, 1
            for b in levels:
                width *= b
                total += width
            return total
        total = sum(levels)
        return min(total, self.nodes) if self.kind == "dynamic" else total


def best_nodes(tree: DraftTree, count: int) -> list[int]:
    """The `count` nodes of highest path score, ties toward shallower then earlier nodes: a tree (module docstring)."""
    order = sorted(range(tree.size), key=lambda i: (-float(tree.scores[i]), tree._depth_list[i], i))
    chosen: set[int] = set()
    for i in order:
        if len(chosen) == count:
            break
        if tree._parent_list[i] < 0 or tree._parent_list[i] in chosen:
            chosen.add(i)
    return sorted(chosen)


def expected_accepted(scores: Tensor) -> Tensor:
    """[N] path scores sorted descending → [N+1] expected tokens per round with the best 0..N nodes: 1 + Σ scores."""
    return torch.cat([scores.new_ones(1), 1 + scores.cumsum(0)])


def step_cost_table(sps, max_nodes: int) -> Tensor:
    """[max_nodes + 1] float64: seconds of one target forward at B = 1..max_nodes + 1 tokens (1 / SPS(B)), computed
    once per engine so that sizing a round is one vector expression, not a table look-up per candidate N."""
    tokens = torch.arange(1, max_nodes + 2, dtype=torch.float64)
    return 1.0 / torch.as_tensor(sps(tokens), dtype=torch.float64)


def choose_node_budget(scores: Tensor, *, step_costs: Tensor, draft_seconds: float = 0.0) -> int:
    """The paper's Algorithm 1 with a node budget instead of a prefix length: N* = argmax over N ≤ max_nodes of
    (1 + Σ_{i ≤ N} s_(i)) / (draft_seconds + step_costs[N]), s_(i) the path scores in descending order (the best N
    nodes form a tree) and step_costs[N] this machine's target step at B = N + 1 tokens (`step_cost_table`, whose
    length − 1 is max_nodes). Ties go to the smaller N."""
    max_nodes = step_costs.shape[0] - 1
    ranked = scores.double().sort(descending=True).values[:max_nodes]
    gains = expected_accepted(ranked)
    rates = gains / (draft_seconds + step_costs[: gains.shape[0]].to(gains))
    return int(rates.argmax())


def min_worthwhile_score(step_costs: Tensor, *, draft_seconds: float = 0.0) -> float:
    """A node whose path score is below this never raises expected tokens per second, whatever else is verified:
    adding score s to E ≥ 1 expected tokens at cost D + T pays only if s > E·ΔT/(D + T) ≥ min over B of
    ΔT(B)/(D + T(B)). Path scores never grow downwards, so growth can stop once every frontier node is below it (the
    engine passes the previous round's drafting time as D: a growth heuristic; the sizing itself is exact)."""
    if step_costs.shape[0] < 2:
        return float("inf")
    relative = (step_costs[1:] - step_costs[:-1]) / (draft_seconds + step_costs[:-1])
    return max(0.0, float(relative.min()))
