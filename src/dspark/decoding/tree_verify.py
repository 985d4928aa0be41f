"""The one verifier on a tree: exactly lossless acceptance of a path through a `DraftTree` at any temperature.

The target's rows come from one forward over [x_0, nodes] (`tree.tree_attention`): row 0 is p_t after the anchor,
row i + 1 is p_t after node i's path. Walking down from the anchor, each visited node either descends into one of its
children (that child is accepted) or stops with one extra token y the target emits there; the committed tokens are the
accepted path then y, as with a chain (τ = path length + 1). Two schemes (`TREE_SCHEMES`, `decode.tree.scheme`):

    descent   at node u draw y ~ p_t(· | u); if y is the token of a child c of u, accept c and continue from c,
              else stop and emit y. Exact for *any* set of candidates, drafted however (a deterministic top-k tree
              included): every committed token is a sample of p_t, the candidates only decide how far one forward
              goes. Acceptance at u is the target's mass on u's children, Σ_c p_t(c | u).
    rrsw      recursive rejection sampling without replacement (Jeon et al. 2024; SpecTr's k-sequential case) on the
              children of u that were *drawn* c_1..c_k in that order without replacement from q_u (`tree.sampled`),
              then descent on what is left: p ← p_t(· | u), q ← q_u; for i = 1..k accept c_i with probability
              min(1, p(c_i) / q(c_i)); on a rejection p ← norm(max(0, p − q)) and q ← q with c_i removed,
              renormalised; when every drawn child is rejected, draw y ~ p and descend if y is one of u's other
              (deterministic) children, else emit y. Exact: each c_i is a draw from the current q, and the emitted or
              descended token after the rejections is a draw from the residual, which is the target's conditional
              given those rejections. With k = 1 and no other child it is the chain's rejection sampling
              (`verify.verify_drafts`); a node with no drawn child is plain descent. Acceptance at u is at least
              Σ min(p_t, q_u) (the chain's) plus the residual's mass on the other children.

At T = 0 both are greedy descent: accept the child whose token is argmax p_t(· | u), else emit that argmax — the
target's greedy tokens.

Random numbers: one float64 uniform per test and per emitted token, drawn from the generator as the walk needs them
(so a batched call reproduces the single calls made in the same order with the same generator). Stop handling is the
engine's, as with chains (`shared.commit_verified`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspark.decoding.tree import DraftTree
from dspark.decoding.verify import RESIDUAL_MIN_MASS, draw_uniforms, probs_from_logits, sample_from_probs
from dspark.registry import Registry

TREE_SCHEMES: Registry[str] = Registry("decode.tree.scheme")
TREE_SCHEMES.register("descent", label="sample p_t at each node, descend when it is a child (any tree)")("descent")
TREE_SCHEMES.register("rrsw", label="rejection sampling on drawn children, then descent on the residual")("rrsw")


@dataclass
class TreeVerifyResult:
    """Outcome of verifying one tree."""

    path: list[int]  # accepted nodes, depth 1 first
    accepted_tokens: Tensor  # [A] long, the accepted nodes' tokens
    next_token: int  # y, emitted where the walk stopped

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    @property
    def tokens(self) -> list[int]:
        return [*self.accepted_tokens.tolist(), self.next_token]


def _uniform(generator: torch.Generator | None, device: torch.device) -> Tensor:
    if generator is None:
        raise ValueError("verify_tree: sampling (temperature > 0) needs a torch.Generator")
    return draw_uniforms((), generator, device)


def check_scheme(scheme: str) -> None:
    """Refuse an unknown scheme (naming the valid ones)."""
    TREE_SCHEMES.resolve(scheme)


class LazyRows:
    """The target's logits of a tree forward, one row at a time: `hidden` [N+1, d] final-norm states and the LM head
    `to_logits` ([k, d] → [k, V]) applied only to the rows the walk visits (at most depth + 1 of N + 1: with a
    32-node tree, the [33, V] product over SmolLM2's 49,152-row head would cost more than the walk)."""

    def __init__(self, hidden: Tensor, to_logits) -> None:
        self.hidden, self.to_logits = hidden, to_logits
        self.num_rows = hidden.shape[0]
        self.device = hidden.device

    def row(self, index: int) -> Tensor:
        return self.to_logits(self.hidden[index : index + 1])[0]


class _TensorRows:
    def __init__(self, logits: Tensor) -> None:
        self.logits, self.num_rows, self.device = logits, logits.shape[0], logits.device

    def row(self, index: int) -> Tensor:
        return self.logits[index]


def verify_tree(
    *,
    tree: DraftTree,
    target_logits: Tensor | LazyRows,
    temperature: float,
    scheme: str = "descent",
    generator: torch.Generator | None = None,
) -> TreeVerifyResult:
    """Walk `tree` [N nodes] with the target's logits [N+1, V] (row 0: after the anchor; row i+1: after node i; a
    `LazyRows` computes them as visited) and return the accepted path and the extra token (module docstring)."""
    rows = target_logits if isinstance(target_logits, LazyRows) else _TensorRows(target_logits)
    if isinstance(target_logits, Tensor) and target_logits.dim() != 2 or rows.num_rows != tree.size + 1:
        raise ValueError(
            f"verify_tree: target_logits must be [N+1, V] = [{tree.size + 1}, V] for a tree of {tree.size} nodes, "
            f"got {rows.num_rows} rows"
        )
    check_scheme(scheme)
    tokens = tree.tokens.tolist()
    node, path = -1, []
    if temperature == 0:
        while True:
            best = int(rows.row(node + 1).argmax())
            by_token = {tokens[c]: c for c in tree.children(node)}
            chosen = by_token.get(best)
            if chosen is None:
                return _result(tree, path, best)
            path.append(chosen)
            node = chosen
    device = rows.device
    while True:
        p_t = probs_from_logits(rows.row(node + 1).unsqueeze(0), temperature)[0]
        kids = tree.children(node)
        drawn = tree.sampled.get(node, 0) if scheme == "rrsw" else 0
        if drawn:
            chosen, p_t = _rrsw_step(p_t, tree.child_probs[node], [tokens[c] for c in kids[:drawn]], generator, device)
            chosen = None if chosen is None else kids[chosen]
        else:
            chosen = None
        if chosen is None:  # descent on the (residual) distribution over the remaining children
            y = int(sample_from_probs(p_t, uniforms=_uniform(generator, device), trusted=True))
            chosen = next((c for c in kids[drawn:] if tokens[c] == y), None)
        if chosen is None:
            return _result(tree, path, y)
        path.append(chosen)
        node = chosen


def _rrsw_step(
    p_t: Tensor, q: Tensor, candidates: list[int], generator: torch.Generator | None, device: torch.device
) -> tuple[int | None, Tensor]:
    """The drawn children of one node under `rrsw`: (index of the accepted candidate, or None and the residual
    distribution [V] float64 the node's extra token or descent is then drawn from)."""
    p = p_t.to(torch.float64, copy=True)
    q = q.to(torch.float64, copy=True)
    for i, token in enumerate(candidates):
        q_total = float(q.sum())
        q_token = float(q[token]) / q_total if q_total > 0 else 0.0
        u = float(_uniform(generator, device))
        if q_token > 0 and u * q_token < float(p[token]):
            return i, p
        if q_token <= 0:
            continue  # a candidate the proposal could not have drawn: never accepted
        residual = (p - q / q_total).clamp_min_(0.0)
        mass = float(residual.sum())
        p = residual / mass if mass >= RESIDUAL_MIN_MASS else p
        q[token] = 0.0
    return None, p


def _result(tree: DraftTree, path: list[int], next_token: int) -> TreeVerifyResult:
    rows = torch.tensor(path, dtype=torch.long, device=tree.tokens.device)
    return TreeVerifyResult(path, tree.tokens[rows], int(next_token))


def verify_trees_batched(
    *,
    trees: list[DraftTree],
    target_logits: Tensor,
    temperature: float,
    scheme: str = "descent",
    generator: torch.Generator | None = None,
) -> list[TreeVerifyResult]:
    """R trees verified from one padded forward: target_logits [R, L+1, V] with L ≥ every N_r (rows past N_r + 1 are
    padding, never read). Request r equals `verify_tree(tree=trees[r], target_logits=target_logits[r, :N_r+1], ...)`
    called in turn with the same generator."""
    if target_logits.dim() != 3 or target_logits.shape[0] != len(trees):
        raise ValueError(
            f"verify_trees_batched: target_logits must be [R, L+1, V] with R = {len(trees)} trees, "
            f"got {tuple(target_logits.shape)}"
        )
    width = max((t.size for t in trees), default=0)
    if target_logits.shape[1] < width + 1:
        raise ValueError(
            f"verify_trees_batched: target_logits has {target_logits.shape[1]} rows per request, fewer than the "
            f"largest tree's {width} nodes + 1"
        )
    return [
        verify_tree(
            tree=tree,
            target_logits=target_logits[r, : tree.size + 1],
            temperature=temperature,
            scheme=scheme,
            generator=generator,
        )
        for r, tree in enumerate(trees)
    ]
