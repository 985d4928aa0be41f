"""Speculative decoding with draft trees: the chain engine's loop with a tree round (METHOD §5.1).

Per round, anchor x_0 at position p (the target's cache holds positions 0..p−1, so does the proposer's context):

    1  grow the round's tree from the proposer (`tree_proposers.propose_tree`); the dynamic shape keeps the N best
       nodes, N chosen by expected accepted tokens per second on this machine's SPS(B) table (`tree.choose_node_budget`)
    2  drop nodes past the end of the target's context
    3  one target forward over [x_0, nodes] with the tree mask and positions p + depth, appended to the cache
    4  the tree verifier (`tree_verify.verify_tree`, scheme `descent` or `rrsw`) on the rows it visits → accepted path
       and the extra token y
    5  commit the path and y (an accepted stop id ends the round there, as with chains)
    6  keep the target's KV of the context, the anchor and the accepted path (`Target.keep_positions`)
    7  extend the proposer with the features of the anchor and the accepted path; y anchors at p + A + 1

Round records: `drafts` are the tree's tokens in node order, `tree_nodes` = N, `num_verified` = the tree's depth (the
most drafts the round could accept), `num_accepted` = A the path length;
the tree's drafting time is `seconds_draft_parallel`. The prefill, first token, prompt checks and stop rules are the
chain engine's (`SpeculativeEngine`, which this extends).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dspark.decoding.engine import SpeculativeEngine, _Decoding
from dspark.decoding.proposers import Proposer
from dspark.decoding.records import RoundRecord
from dspark.decoding.shared import commit_verified, is_done
from dspark.decoding.tree import (
    DraftTree,
    TreeShape,
    best_nodes,
    choose_node_budget,
    min_worthwhile_score,
    step_cost_table,
    tree_attention,
    tree_positions,
)
from dspark.decoding.tree_proposers import propose_tree
from dspark.decoding.tree_verify import LazyRows, check_scheme, verify_tree
from dspark.scheduling.sps import SPSTable
from dspark.timing import synchronize


class TreeEngine(SpeculativeEngine):
    """Draft a tree → verify it in one forward → commit the accepted path (numbered steps: module docstring).

    shape: `TreeShape` (not `chain`: chains run on `SpeculativeEngine`); scheme: `descent` | `rrsw`; sps: the SPS(B)
    table that sizes dynamic trees (None: every dynamic round verifies `shape.nodes` nodes).
    """

    def __init__(
        self,
        *,
        target: Any,
        proposer: Proposer,
        shape: TreeShape,
        scheme: str = "descent",
        temperature: float,
        max_new_tokens: int,
        sps: SPSTable | None = None,
    ) -> None:
        if proposer is None:
            raise ValueError("TreeEngine needs a drafter: target-only decoding runs on SpeculativeEngine")
        if shape.kind == "chain":
            raise ValueError("decode.tree.shape=chain is the chain engine: use SpeculativeEngine (decode.policy)")
        super().__init__(
            target=target, proposer=proposer, policy=None, temperature=temperature, max_new_tokens=max_new_tokens
        )
        check_scheme(scheme)
        self.shape, self.scheme, self.sps = shape, scheme, sps
        # dynamic trees: the step cost of every candidate N once, and the score below which no node pays for itself
        sized = shape.kind == "dynamic" and sps is not None
        self._step_costs = step_cost_table(sps, shape.nodes) if sized else None
        self._draft_seconds = 0.0  # the previous round's drafting time (growth stops on `min_worthwhile_score`)

    @torch.no_grad()
    def _round(self, state: _Decoding, generator: torch.Generator | None) -> RoundRecord:
        start, position, anchor = time.perf_counter(), state.position, state.anchor
        # 1. Grow the tree (and size a dynamic one).
        tree, draft_seconds = propose_tree(
            self.proposer,
            self.shape,
            anchor_token=anchor,
            anchor_position=position,
            temperature=self.temperature,
            generator=generator,
            stop_ids=self.stop_ids,
            sample=self.scheme == "rrsw",
            min_score=0.0
            if self._step_costs is None
            else min_worthwhile_score(self._step_costs, draft_seconds=self._draft_seconds),
        )
        self._draft_seconds = draft_seconds
        tree = self._sized(tree, draft_seconds)
        # 2. Nothing past the target's context.
        tree = tree.cut_to_depth(None if self.max_positions is None else self.max_positions - 1 - position)
        # 3. One forward over the anchor and every node, each seeing the context and its ancestors.
        verify_start = time.perf_counter()
        device = self.target.device
        ids = torch.cat([torch.tensor([anchor], device=device), tree.tokens.to(device)]).unsqueeze(0)
        forward = self.target.forward(
            ids,
            attention_mask=tree_attention(tree, context=position).to(device),
            position_ids=tree_positions(tree, anchor_position=position).to(device),
            cache=state.cache,
        )
        # 4. Walk the tree on the rows it visits.
        result = verify_tree(
            tree=tree,
            target_logits=LazyRows(forward.final_hidden[0], self.target.logits_from_hidden),
            temperature=self.temperature,
            scheme=self.scheme,
            generator=generator,
        )
        synchronize(device)
        verify_seconds = time.perf_counter() - verify_start
        # 5. Commit.
        accepted, committed, extra = commit_verified(result, self.stop_ids)
        state.new_tokens.extend(committed)
        state.done = is_done(extra, stop_ids=self.stop_ids, committed=len(state.new_tokens), limit=state.limit)
        extend_seconds = 0.0
        if not state.done:
            path = result.path[: len(accepted)]
            # 6. The cache keeps the context, the anchor (row p) and the accepted nodes' rows, in path order.
            self.target.keep_positions(state.cache, prefix=position + 1, rows=[position + 1 + i for i in path])
            # 7. The proposer's context gains the anchor and the path; y anchors at p + A + 1.
            extend_start = time.perf_counter()
            rows = torch.tensor([0, *(1 + i for i in path)], device=forward.features.device)
            self.proposer.extend(features=forward.features[:, rows], token_ids=[anchor, *accepted])
            synchronize(device)
            extend_seconds = time.perf_counter() - extend_start
            state.anchor, state.position = extra, position + len(accepted) + 1
        total = time.perf_counter() - start
        return RoundRecord(
            anchor_position=position,
            drafts=tree.tokens.tolist(),
            confidences=None,
            calibrated=None,
            num_verified=tree.depth,
            num_accepted=len(accepted),
            committed=len(committed),
            extra_token=extra,
            seconds_draft_parallel=draft_seconds + extend_seconds,
            seconds_draft_sequential=0.0,
            seconds_verify=verify_seconds,
            seconds_other=max(0.0, total - draft_seconds - extend_seconds - verify_seconds),
            tree_nodes=tree.size,
        )

    def _sized(self, tree: DraftTree, draft_seconds: float) -> DraftTree:
        """Dynamic trees: the N* best nodes by expected accepted tokens per second (`choose_node_budget`)."""
        if self._step_costs is None or tree.size == 0:
            return tree
        count = choose_node_budget(tree.scores, step_costs=self._step_costs, draft_seconds=draft_seconds)
        return tree.subtree(best_nodes(tree, count))
