"""R requests decoded together with draft trees: each request drafts its own tree, one target forward verifies them
all (METHOD §5.1; the single-request loop is `decoding.tree_engine.TreeEngine`).

Per step, for the R requests still active (row r of the `BatchedKVCache`):

    1  every request grows its tree from its own proposer (one per request, sharing the drafter's weights)
    2  one forward over the right-padded block [x_0, nodes…, pad…] of every row: per-row positions p_r + depth and a
       [R, Q, Q] tree mask (`BatchedKVCache.forward_tree`)
    3  the tree verifier on each row in turn with the one generator (`tree_verify.verify_trees_batched`: request r is
       exactly `verify_tree` on its rows)
    4  commit per request (stop ids end it, as in every engine); keep the anchor's and the accepted path's columns, the
       rest become holes (`keep_columns`); compact when holes would dominate; finished rows leave the cache
    5  each proposer's context gains its anchor and accepted path

Random numbers are drawn in request order within each stage, so with R = 1 the output equals `TreeEngine`'s for the
same generator (tested), and the tokens of every request are distributed as the target's own samples.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import torch

from dspark.decoding.records import GenerationResult, RoundRecord
from dspark.decoding.shared import (
    check_max_new_tokens,
    check_temperature,
    commit_verified,
    is_done,
    prompt_error,
    sample_first,
    stop_reason,
)
from dspark.decoding.tree import TreeShape, tree_attention
from dspark.decoding.tree_proposers import propose_tree
from dspark.decoding.tree_verify import check_scheme, verify_trees_batched
from dspark.decoding.verify import probs_from_logits
from dspark.serving.kv import BatchedKVCache, prefill

KEY = "decode"


@dataclass
class _Request:
    proposer: Any
    prompt: list[int]
    anchor: int
    position: int
    new_tokens: list[int]
    rounds: list[RoundRecord]
    done: bool = False


def fresh_proposer(proposer: Any) -> Any:
    """A proposer for one more request: the same drafter and parallel stage (weights shared, never copied), an empty
    context of its own."""
    clone = copy.copy(proposer)
    clone._reset()
    return clone


class BatchedTreeEngine:
    """Decode a list of prompts together, one tree per request per step (module docstring). `shape` is not `chain`;
    `scheme` is `descent` | `rrsw` (rrsw: `branching` at T > 0)."""

    def __init__(
        self,
        *,
        target: Any,
        proposer: Any,
        shape: TreeShape,
        scheme: str = "descent",
        temperature: float,
        max_new_tokens: int,
    ) -> None:
        if shape.kind == "chain":
            raise ValueError("decode.tree.shape=chain is the chain engines' (BatchedEngine, SpeculativeEngine)")
        self.temperature = check_temperature(temperature, KEY)
        self.max_new_tokens = check_max_new_tokens(max_new_tokens, KEY)
        self.target, self.proposer, self.shape, self.scheme = target, proposer, shape, scheme
        check_scheme(scheme)
        self.stop_ids = frozenset(int(t) for t in target.stop_token_ids)
        self.max_positions = getattr(target.hf_config, "max_position_embeddings", None)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, generator: torch.Generator | None) -> list[GenerationResult]:
        """One `GenerationResult` per prompt (in order); `generator` drives every random choice."""
        for prompt in prompts:
            error = prompt_error(
                list(prompt),
                limit=self.max_new_tokens,
                vocab_size=self.target.vocab_size,
                max_positions=self.max_positions,
                key=KEY,
            )
            if error is not None:
                raise ValueError(error)
        start = time.perf_counter()
        requests, cache = self._prefill(prompts, generator)
        prefill_seconds = time.perf_counter() - start
        active = [r for r in requests if not r.done]
        cache.remove_rows(torch.tensor([i for i, r in enumerate(requests) if not r.done], dtype=torch.long))
        while active:
            self._step(active, cache, generator)
            keep = [i for i, r in enumerate(active) if not r.done]
            if len(keep) < len(active):
                cache.remove_rows(torch.tensor(keep, dtype=torch.long, device=self.target.device))
                active = [active[i] for i in keep]
            cache.maybe_compact()
        total = time.perf_counter() - start
        return [
            GenerationResult(
                prompt_ids=list(r.prompt),
                new_tokens=r.new_tokens[: self.max_new_tokens],
                rounds=r.rounds,
                stop_reason=stop_reason(r.new_tokens[: self.max_new_tokens], self.stop_ids),
                prefill_seconds=prefill_seconds,
                total_seconds=total,
            )
            for r in requests
        ]

    def _prefill(self, prompts: list[list[int]], generator) -> tuple[list[_Request], BatchedKVCache]:
        batch = prefill(self.target, [list(p) for p in prompts])
        cache = BatchedKVCache(self.target)
        cache.add_rows(batch)
        logits = self.target.logits_from_hidden(batch.last_hidden)
        requests = []
        for row, prompt in enumerate(prompts):
            first = sample_first(
                probs_from_logits(logits[row : row + 1], self.temperature), generator, greedy=self.temperature == 0
            )
            request = _Request(fresh_proposer(self.proposer), list(prompt), first, len(prompt), [first], [])
            request.done = first in self.stop_ids or self.max_new_tokens <= 1
            if not request.done:
                request.proposer.start(features=batch.features[row : row + 1, : len(prompt)], token_ids=list(prompt))
            requests.append(request)
        return requests, cache

    def _step(self, active: list[_Request], cache: BatchedKVCache, generator) -> None:
        start = time.perf_counter()
        # 1. Each request's tree.
        trees, draft_seconds = [], []
        for request in active:
            tree, seconds = propose_tree(
                request.proposer,
                self.shape,
                anchor_token=request.anchor,
                anchor_position=request.position,
                temperature=self.temperature,
                generator=generator,
                stop_ids=self.stop_ids,
                sample=self.scheme == "rrsw",
            )
            tree = tree.cut_to_depth(None if self.max_positions is None else self.max_positions - 1 - request.position)
            trees.append(tree)
            draft_seconds.append(seconds)
        # 2. One forward over every row's padded tree.
        verify_start = time.perf_counter()
        device = self.target.device
        width = max(t.size for t in trees) + 1
        ids = torch.zeros(len(active), width, dtype=torch.long, device=device)
        positions = torch.zeros(len(active), width, dtype=torch.long, device=device)
        valid = torch.zeros(len(active), width, dtype=torch.bool, device=device)
        block = torch.zeros(len(active), width, width, dtype=torch.bool, device=device)
        for row, (request, tree) in enumerate(zip(active, trees)):
            n = tree.size + 1
            ids[row, :n] = torch.cat([torch.tensor([request.anchor]), tree.tokens.cpu()]).to(device)
            positions[row, :n] = request.position + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths.cpu()])
            positions[row, n:] = request.position  # padding: any position (never attended by a real query)
            valid[row, :n] = True
            block[row, :n, :n] = tree_attention(tree, context=0)[0, 0].to(device)
        forward = cache.forward_tree(ids, position_ids=positions, input_valid=valid, block_mask=block)
        # 3. Each row's walk, in request order with the one generator.
        logits = self.target.logits_from_hidden(forward.final_hidden)
        results = verify_trees_batched(
            trees=trees, target_logits=logits, temperature=self.temperature, scheme=self.scheme, generator=generator
        )
        verify_seconds = time.perf_counter() - verify_start
        # 4–5. Commit, keep the accepted columns, extend each proposer.
        keep = torch.zeros(len(active), width, dtype=torch.bool, device=device)
        for row, (request, tree, result) in enumerate(zip(active, trees, results)):
            accepted, committed, extra = commit_verified(result, self.stop_ids)
            request.new_tokens.extend(committed)
            request.done = is_done(
                extra, stop_ids=self.stop_ids, committed=len(request.new_tokens), limit=self.max_new_tokens
            )
            path = result.path[: len(accepted)]
            columns = [0, *(1 + i for i in path)]
            keep[row, columns] = True
            if not request.done:
                rows = torch.tensor(columns, device=forward.features.device)
                request.proposer.extend(
                    features=forward.features[row : row + 1, rows], token_ids=[request.anchor, *accepted]
                )
            request.rounds.append(
                RoundRecord(
                    anchor_position=request.position,
                    drafts=tree.tokens.tolist(),
                    confidences=None,
                    calibrated=None,
                    num_verified=tree.depth,
                    num_accepted=len(accepted),
                    committed=len(committed),
                    extra_token=extra,
                    seconds_draft_parallel=draft_seconds[row],
                    seconds_verify=verify_seconds,
                    tree_nodes=tree.size,
                )
            )
            if not request.done:
                request.anchor, request.position = extra, request.position + len(accepted) + 1
        cache.keep_columns(keep)
        total = time.perf_counter() - start
        for request in active:  # the step's remaining time is every request's overhead
            record = request.rounds[-1]
            record.seconds_other = max(0.0, total - sum(draft_seconds) - verify_seconds)
