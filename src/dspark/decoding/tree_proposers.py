"""Tree proposals: every drafter grows a `DraftTree` through one small interface, an expander (METHOD §5.1).

An expander answers one question — the draft logits over the draft vocabulary [F, Vd] for the children of F nodes
of one depth — and keeps whatever per-node state that needs. `grow_tree` does the rest for every drafter alike:
which nodes to expand, which children to keep (`tree.TreeShape`), path scores, sampling without replacement for
sampled trees, the draft → target id map, the fault guard and stop ids.

    DSpark / DFlash   the block forward gives h_k and U_k for every depth once (shared by every node at that depth);
                      a node's children read U_d + B_d(parent token, parent state): the Markov / gated bias is one
                      row per node, the RNN state is carried down each path. DFlash (no head) gives every node of a
                      depth the same marginal: a product tree.
    EAGLE-3           expanded autoregressively, one batched layer step per depth: each node of the depth is a query
                      at its position that sees the context's step-0 keys and its own ancestors' keys (a tree mask),
                      as EAGLE's own tree drafting does.

Children of a node: the top-k of its logits (deterministic trees), or, for `branching` at T > 0, k draws without
replacement from q = softmax(logits / T) by Gumbel-top-k (sorting log q + Gumbel noise gives the order of sequential
draws without replacement), with q recorded over the target's vocabulary for the `rrsw` verifier. A node whose
logits are unusable (NaN, +inf, all −inf) gets no children; a node whose token is a stop id is never expanded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from typing import Protocol

import torch
from torch import Tensor

from dspark.decoding.drafting import to_target_probs, usable_logits
from dspark.decoding.proposers import DSparkProposer, Eagle3Proposer
from dspark.decoding.tree import DraftTree, TreeShape, best_nodes
from dspark.timing import synchronize


class TreeExpander(Protocol):
    """Draft logits for the children of the nodes of one depth."""

    draft_ids: Tensor | None  # [Vd] long draft → target map (None: the full vocabulary)
    vocab_size: int  # the target's V

    def expand(self, nodes: list[int], parents: list[int], tokens: list[int], depth: int) -> Tensor:
        """nodes (−1 = the anchor) at `depth − 1`, their parents (−2 for the anchor) and tokens (target ids) →
        logits [F, Vd] float32 of their children at `depth` (1-based slot)."""


class DSparkTreeExpander:
    """DSpark / DFlash: base logits per depth from one block forward, the sequential head per node."""

    def __init__(self, proposer: DSparkProposer, *, anchor_token: int, anchor_position: int, depth: int) -> None:
        if anchor_position != proposer.context_length:
            raise ValueError(
                f"DSparkProposer: anchor at position {anchor_position} but the context holds "
                f"{proposer.context_length} positions; it must hold exactly the positions before the anchor"
            )
        self.drafter = proposer.drafter
        self.hidden = proposer.block_hidden(anchor_token, anchor_position)  # [γ, d]
        self.base = proposer.stage.logits(self.hidden[:depth])  # [D, Vd]: U_k, shared by every node of depth k
        self.draft_ids, self.vocab_size = proposer.stage.ids, proposer.vocab_size
        self._state_after: dict[int, Tensor | None] = {-2: None}  # node → the head's state after expanding it

    def expand(self, nodes: list[int], parents: list[int], tokens: list[int], depth: int) -> Tensor:
        count = len(nodes)
        hidden = self.hidden[depth - 1].expand(count, -1)
        base = self.base[depth - 1].expand(count, -1)
        states = [self._state_after.get(p) for p in parents]
        state = None if any(s is None for s in states) else torch.cat(states)
        prev = torch.tensor(tokens, dtype=torch.long, device=hidden.device)
        logits, _, new_state = self.drafter.sequential_step(
            hidden_k=hidden, parallel_logits_k=base, prev_token=prev, state=state
        )
        for i, node in enumerate(nodes):
            self._state_after[node] = None if new_state is None else new_state[i : i + 1]
        return logits.float()


class Eagle3TreeExpander:
    """EAGLE-3: one layer step per depth over all its nodes, under a tree mask (module docstring)."""

    def __init__(self, proposer: Eagle3Proposer, *, anchor_token: int, anchor_position: int) -> None:
        self.drafter = proposer.drafter
        self._last = proposer.step0(anchor_token, anchor_position)  # [1, 1, d]
        self._context = proposer.context
        self._seq_len = self._context[0].shape[2]
        self.draft_ids, self.vocab_size = proposer._ids, proposer.vocab_size
        self._hidden: dict[int, Tensor] = {-1: self._last[0, 0]}  # node → its step output h [d] (−1: the anchor's)
        self._columns: list[int] = []  # node of each tree key column, in the order its keys were appended
        self._keys: Tensor | None = None  # [1, H_kv, M, hd]
        self._values: Tensor | None = None
        self._parent: dict[int, int] = {}

    def expand(self, nodes: list[int], parents: list[int], tokens: list[int], depth: int) -> Tensor:
        drafter = self.drafter
        if depth == 1:  # the anchor's children: the step-0 output of the last position
            return drafter.draft_head(drafter.norm(self._last))[:, -1].float().expand(len(nodes), -1)
        device = self._last.device
        for node, parent in zip(nodes, parents):
            self._parent[node] = parent
        hidden = torch.stack([self._hidden[self._parent[node]] for node in nodes]).unsqueeze(0)  # [1, F, d]
        embeds = drafter.embed_tokens(torch.tensor([tokens], device=device)).to(hidden.dtype)
        position = self._seq_len - 1 + depth - 1  # a depth-(d−1) node runs at the chain step d − 1
        cos, sin = drafter.rotary(torch.full((len(nodes),), position, device=device))
        past = [self._context] + ([] if self._keys is None else [(self._keys, self._values)])
        mask = self._mask(nodes, device)
        out, (keys, values) = drafter.layer(hidden, embeds, rope=(cos[None], sin[None]), past=past, mask=mask)
        self._keys = keys if self._keys is None else torch.cat([self._keys, keys], dim=2)
        self._values = values if self._values is None else torch.cat([self._values, values], dim=2)
        self._columns.extend(nodes)
        for i, node in enumerate(nodes):
            self._hidden[node] = out[0, i]
        return drafter.draft_head(drafter.norm(out))[0].float()

    def _mask(self, nodes: list[int], device: torch.device) -> Tensor:
        """[1, 1, F, S + M + F] bool: the context, each query's ancestors among the tree columns, and itself."""
        count, tree_cols = len(nodes), len(self._columns)
        column = {node: j for j, node in enumerate(self._columns)}
        rows = torch.zeros(count, tree_cols + count, dtype=torch.bool, device=device)
        for i, node in enumerate(nodes):
            rows[i, tree_cols + i] = True
            ancestor = self._parent[node]
            while ancestor >= 0:
                if ancestor in column:
                    rows[i, column[ancestor]] = True
                ancestor = self._parent.get(ancestor, -1)
        context = torch.ones(count, self._seq_len, dtype=torch.bool, device=device)
        return torch.cat([context, rows], dim=1)[None, None]


def tree_expander(proposer, *, anchor_token: int, anchor_position: int, depth: int) -> TreeExpander:
    """The expander of a chain proposer (`decoding.proposers`)."""
    if isinstance(proposer, DSparkProposer):
        return DSparkTreeExpander(proposer, anchor_token=anchor_token, anchor_position=anchor_position, depth=depth)
    if isinstance(proposer, Eagle3Proposer):
        return Eagle3TreeExpander(proposer, anchor_token=anchor_token, anchor_position=anchor_position)
    raise ValueError(f"no tree expander for a {type(proposer).__name__}; expected a DSparkProposer or Eagle3Proposer")


def gumbel_order(probs: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """`count` indices of `probs` [Vd] drawn in order without replacement (Gumbel-top-k; never a zero-mass index;
    fewer when fewer indices have mass)."""
    count = min(count, int((probs > 0).sum()))
    uniforms = torch.rand(probs.shape, generator=generator, device=generator.device, dtype=torch.float64)
    keys = probs.double().log().to(uniforms.device) - (-uniforms.clamp_min(1e-300).log()).log()
    return keys.topk(count).indices.to(probs.device)


def grow_tree(
    expander: TreeExpander,
    shape: TreeShape,
    *,
    anchor_token: int,
    gamma: int,
    temperature: float,
    generator: torch.Generator | None,
    stop_ids: Collection[int],
    min_score: float = 0.0,
    sample: bool = False,
) -> DraftTree:
    """Grow one round's tree (module docstring); the dynamic shape is returned whole (its N is chosen later), except
    that growth stops once every node of the last depth has a path score below `min_score` (none deeper could pay
    for itself: `tree.min_worthwhile_score`). `sample` (at T > 0): widths and dynamic draw the first child of every
    node they expand (`decode.tree.scheme=rrsw`); branching draws every child at T > 0 either way."""
    levels = shape.levels(gamma)
    draw_all = shape.kind == "branching" and temperature > 0
    draw_first = sample and temperature > 0 and not draw_all
    if (draw_all or draw_first) and generator is None:
        raise ValueError("grow_tree: a tree with drawn children (T > 0) needs a torch.Generator")
    ids = expander.draft_ids
    to_target = None if ids is None else ids.tolist()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    child_probs: dict[int, Tensor] = {}
    sampled: dict[int, int] = {}
    frontier = [-1]
    log_min_score = math.log(min_score) if min_score > 0 else -math.inf  # scores are kept as log-probabilities
    for depth, count in enumerate(levels, start=1):
        open_nodes = [u for u in frontier if u < 0 or tokens[u] not in stop_ids]
        if not open_nodes:
            break
        logits = expander.expand(
            open_nodes,
            [parents[u] if u >= 0 else -2 for u in open_nodes],
            [tokens[u] if u >= 0 else anchor_token for u in open_nodes],
            depth,
        )
        usable = usable_logits(logits).tolist()
        scoring = torch.log_softmax(logits.double(), dim=-1)  # path scores at T = 1
        rows = [(row, node, 0.0 if node < 0 else scores[node]) for row, node in enumerate(open_nodes) if usable[row]]
        if draw_all:
            chosen = []
            for row, node, base in rows:
                drawn = _draw(logits[row], temperature, count, generator, child_probs, node, ids, expander.vocab_size)
                sampled[node] = len(drawn)
                chosen += _scored(scoring[row], drawn, base, node)
        else:
            chosen = _beam(
                rows,
                logits,
                scoring,
                count,
                draw_first,
                temperature,
                generator,
                child_probs,
                sampled,
                ids,
                expander.vocab_size,
            )
        frontier = []
        for score, parent, j in chosen:
            frontier.append(len(tokens))
            tokens.append(j if to_target is None else to_target[j])
            parents.append(parent)
            depths.append(depth)
            scores.append(score)
        if not frontier or max(scores[i] for i in frontier) < log_min_score:
            break
    device = expander_device(expander)
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long, device=device),
        torch.tensor(parents, dtype=torch.long, device=device),
        torch.tensor(depths, dtype=torch.long, device=device),
        torch.tensor(scores, dtype=torch.float64, device=device).exp(),
        child_probs,
        sampled,
    )


def _draw(logits, temperature, count, generator, child_probs, node, ids, vocab_size) -> Tensor:
    """`count` children of `node` drawn without replacement from q = softmax(logits / T); q recorded over V."""
    q = torch.softmax(logits.double() / temperature, dim=-1)
    child_probs[node] = to_target_probs(q.float().unsqueeze(0), ids, vocab_size)[0]
    return gumbel_order(q, count, generator)


def _scored(scoring_row: Tensor, drawn: Tensor, base: float, node: int) -> list[tuple[float, int, int]]:
    """(path score, parent, draft id) of the children `drawn` (one read of their log-probabilities)."""
    return [(base + s, node, j) for s, j in zip(scoring_row[drawn].tolist(), drawn.tolist())]


def _beam(rows, logits, scoring, count, draw_first, temperature, generator, child_probs, sampled, ids, vocab_size):
    """One depth of a widths / dynamic tree: the `count` best children of the depth by path score (ties keep draw
    order), grouped under their parents in order. With `draw_first`, each of the `count` best parents first gets one
    child drawn from its q — kept whatever its score, so that it is a real draw — and the best deterministic
    candidates fill the rest."""
    forced: list[tuple[float, int, int]] = []
    if draw_first:
        for row, node, base in sorted(rows, key=lambda r: -r[2])[:count]:
            drawn = _draw(logits[row], temperature, 1, generator, child_probs, node, ids, vocab_size)
            if drawn.numel():
                sampled[node] = 1
                forced += _scored(scoring[row], drawn, base, node)
    taken = {(node, j) for _, node, j in forced}
    candidates = []
    for row, node, base in rows:
        top = logits[row].topk(min(count + 1, logits.shape[-1])).indices
        candidates += [c for c in _scored(scoring[row], top, base, node) if (node, c[2]) not in taken][:count]
    chosen = forced + sorted(candidates, key=lambda c: -c[0])[: max(0, count - len(forced))]
    order = {node: i for i, (_, node, _) in enumerate(rows)}
    # children grouped under their parents, the drawn child first (the sampled prefix `rrsw` relies on)
    return sorted(chosen, key=lambda c: (order[c[1]], (c[1], c[2]) not in taken))


def expander_device(expander: TreeExpander) -> torch.device:
    drafter = getattr(expander, "drafter", None)
    return next(drafter.parameters()).device if drafter is not None else torch.device("cpu")


@torch.no_grad()
def propose_tree(
    proposer,
    shape: TreeShape,
    *,
    anchor_token: int,
    anchor_position: int,
    temperature: float,
    generator: torch.Generator | None,
    stop_ids: Collection[int],
    min_score: float = 0.0,
    sample: bool = False,
) -> tuple[DraftTree, float]:
    """One round's tree from a chain proposer and the seconds it took to draft (block forward and growth)."""
    start = time.perf_counter()
    gamma = proposer.block_size
    depth = len(shape.levels(gamma))
    expander = tree_expander(proposer, anchor_token=anchor_token, anchor_position=anchor_position, depth=depth)
    tree = grow_tree(
        expander,
        shape,
        anchor_token=anchor_token,
        gamma=gamma,
        temperature=temperature,
        generator=generator,
        stop_ids=stop_ids,
        min_score=min_score if shape.kind == "dynamic" else 0.0,
        sample=sample,
    )
    if shape.kind == "dynamic" and tree.size > shape.nodes:
        tree = tree.subtree(best_nodes(tree, shape.nodes))
    synchronize(expander_device(expander))
    return tree, time.perf_counter() - start


__all__ = [
    "DSparkTreeExpander",
    "Eagle3TreeExpander",
    "TreeExpander",
    "grow_tree",
    "gumbel_order",
    "propose_tree",
    "tree_expander",
]
