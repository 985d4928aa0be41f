"""DSpark/DFlash drafting for R concurrent requests in one forward (METHOD §2.1–§2.3, §5; paper §5.2).

The batched counterpart of `dspark.decoding.proposers.DSparkProposer`, with the same outputs for the same
context. Per draft layer it caches every request's context keys (k-norm and RoPE at absolute positions 0..S_r-1)
and values, right-padded into [R, H_kv, C, hd] with `lengths` [R] (the context never has holes: it only gains
committed positions). One step:

    1  ONE block forward for all rows: queries [R, γ] = [x_0, MASK×(γ−1)] at positions p_r..p_r+γ−1, keys
       [context_r (length mask) ; block_r]                                           → h [R, γ, d], U [R, γ, V]
    2  the sequential loop batched over rows: logits_k = U_k + B_k(x_{k-1}), c_k = σ(·) (before x_k),
       x_{r,k} ~ softmax(logits_k / T) drawn with row r's own generator (T = 0: argmax)
    3  a row stops drafting after a drafted stop id (num_drafts[r] < γ); it draws no more random numbers
    4  all rows stop at `max_drafts` slots, or before slot k when `policy_hook(c_{·,1..k})` says no row's slot k or
       later will be verified (the policy's `max_drafts` / `stop_drafting`, `decoding.policies`): drafts nobody
       verifies are not drawn

Each row draws exactly the uniforms the single-request proposer would (one float64 per sampled slot, in slot
order), so a request's drafts do not depend on which other requests share its step.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dspark.decoding.confidence import ConfidenceSource, source_has_confidence, top_probability
from dspark.decoding.drafting import (
    ParallelStage,
    clean_confidences,
    prepare_sequential_head,
    resolve_precision,
    to_target_probs,
    usable_logits,
)
from dspark.decoding.proposers import PolicyHook, draft_count
from dspark.decoding.verify import draw_uniforms, probs_from_logits, sample_from_probs
from dspark.drafters.dspark import DSparkDrafter
from dspark.timing import synchronize

MIN_CAPACITY = 64  # context columns allocated at least (capacity doubles when full)


@dataclass
class BatchProposal:
    """One step's drafts for R rows, right-padded to γ (shape symbols: R rows, γ block size, V vocabulary)."""

    tokens: Tensor  # [R, γ] long, x_{r,1..γ'_r}; columns ≥ γ'_r are meaningless padding
    draft_probs: Tensor  # [R, γ, V] float32, the distribution each x_{r,k} was drawn from (one-hot at T = 0)
    confidences: Tensor | None  # [R, γ] float32 raw c_k (0 after γ'_r); None without a confidence head
    num_drafts: Tensor  # [R] long, γ'_r ≤ γ
    policy_cut: Tensor | None = None  # [R] bool: drafting ended by the policy (step 4), not by a stop id, γ or a fault
    seconds_parallel: float = 0.0
    seconds_sequential: float = 0.0


def check_serving_drafter(drafter: nn.Module | None) -> DSparkDrafter | None:
    """The drafter if serving supports it (DSparkDrafter: dspark, dflash), else ValueError."""
    if drafter is None or isinstance(drafter, DSparkDrafter):
        return drafter
    raise ValueError(
        f"serving supports drafter=dspark/dflash (a DSparkDrafter), not a {type(drafter).__name__}: "
        "EAGLE-3 has no batched proposer (its chain runs per request); serve it with "
        "drafter=dspark or dflash, or evaluate it with the single-request engine"
    )


class BatchedDSparkProposer:
    """Cached context keys/values of R requests and batched drafting (see the module docstring)."""

    def __init__(
        self, drafter: DSparkDrafter, *, precision: str = "fp32", confidence: ConfidenceSource | None = None
    ) -> None:
        self.drafter = check_serving_drafter(drafter).eval()
        self.block_size = drafter.block_size
        self.confidence = confidence  # serve.confidence: where c_k comes from (None = the head)
        self.has_confidence = source_has_confidence(confidence, has_head=drafter.confidence_head is not None)
        self.vocab_size = drafter.spec.vocab_size
        attn = drafter.backbone.layers[0].self_attn
        self._kv_shape = (attn.num_kv_heads, attn.head_dim)
        self.device = drafter.backbone.fc.weight.device
        self.stage = ParallelStage(drafter, resolve_precision(precision, self.device))
        prepare_sequential_head(drafter, self.stage.ids)
        self.dtype = self.stage.activation_dtype  # of the cached keys/values
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [R] context positions per row
        self._keys = [self._empty(0, 0) for _ in drafter.backbone.layers]  # [R, H_kv, C, hd], RoPE applied
        self._values = [self._empty(0, 0) for _ in drafter.backbone.layers]  # [R, H_kv, C, hd]

    def _empty(self, rows: int, capacity: int) -> Tensor:
        return torch.zeros(rows, self._kv_shape[0], capacity, self._kv_shape[1], dtype=self.dtype, device=self.device)

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        return int(self._keys[0].shape[2])

    @torch.no_grad()
    def add_rows(self, features: list[Tensor]) -> None:
        """New last rows whose contexts are features[j] [S_j, m·d] (positions 0..S_j-1, S_j ≥ 1)."""
        if not features:
            return
        counts = torch.tensor([f.shape[0] for f in features], dtype=torch.long, device=self.device)
        padded = torch.nn.utils.rnn.pad_sequence([f.to(self.device) for f in features], batch_first=True)
        first = self.num_rows
        self._keys = [torch.cat([k, self._empty(len(features), self.capacity)]) for k in self._keys]
        self._values = [torch.cat([v, self._empty(len(features), self.capacity)]) for v in self._values]
        self.lengths = torch.cat([self.lengths, torch.zeros_like(counts)])
        self._write(torch.arange(first, first + len(features), device=self.device), padded, counts)

    def remove_rows(self, keep_rows: Tensor) -> None:
        """Keep the rows `keep_rows` ([R'] long, in the new order); shrinks the capacity when it is 4× too large."""
        keep_rows = keep_rows.to(self.device)
        self.lengths = self.lengths[keep_rows]
        longest = int(self.lengths.max()) if self.num_rows else 0
        capacity = min(max(2 * longest, MIN_CAPACITY), self.capacity) if 4 * longest < self.capacity else self.capacity
        self._keys = [k[keep_rows, :, :capacity] for k in self._keys]
        self._values = [v[keep_rows, :, :capacity] for v in self._values]

    @torch.no_grad()
    def extend(self, *, features: Tensor, counts: Tensor) -> None:
        """Append features[r, :counts[r]] ([R, n, m·d], counts [R] long) — newly committed positions only."""
        if features.shape[0] != self.num_rows:
            raise ValueError(
                f"BatchedDSparkProposer.extend: {features.shape[0]} rows of features for {self.num_rows} requests"
            )
        self._write(torch.arange(self.num_rows, device=self.device), features, counts.to(self.device))

    def _write(self, rows: Tensor, features: Tensor, counts: Tensor) -> None:
        """Fuse and project features[i, :counts[i]] once, written at columns lengths[rows[i]] + j of row rows[i]."""
        selected = torch.arange(features.shape[1], device=self.device).unsqueeze(0) < counts.unsqueeze(1)
        if not bool(selected.any()):
            return
        flat_rows = rows.unsqueeze(1).expand_as(selected)[selected]  # [N]
        columns = (self.lengths[rows].unsqueeze(1) + torch.arange(features.shape[1], device=self.device))[selected]
        self._reserve(int(columns.max()) + 1)
        backbone = self.stage.backbone
        fused = backbone.fuse_context(features.to(self.device)[selected].unsqueeze(0))  # [1, N, d]
        rope = backbone.rotary(columns.unsqueeze(0))
        for layer, keys, values in zip(backbone.layers, self._keys, self._values):
            k, v = layer.context_kv(fused, rope)  # [1, H_kv, N, hd]
            keys[flat_rows, :, columns] = k[0].transpose(0, 1)  # [N, H_kv, hd]
            values[flat_rows, :, columns] = v[0].transpose(0, 1)
        self.lengths = self.lengths.index_add(0, rows, counts)

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity, MIN_CAPACITY)
        grow = capacity - self.capacity
        self._keys = [torch.cat([k, self._empty(k.shape[0], grow)], dim=2) for k in self._keys]
        self._values = [torch.cat([v, self._empty(v.shape[0], grow)], dim=2) for v in self._values]

    @torch.no_grad()
    def propose(
        self,
        *,
        anchor_tokens: Tensor,
        anchor_positions: Tensor,
        temperature: float,
        generators: list[torch.Generator | None],
        stop_ids: Collection[int],
        policy_hook: PolicyHook | None = None,
        max_drafts: int | None = None,
    ) -> BatchProposal:
        """Draft after anchor_tokens [R] at anchor_positions [R] (each == that row's context length); at most
        `max_drafts` slots; `policy_hook(c [R, k])` → True stops before slot k (module docstring, step 4)."""
        anchor_tokens, anchor_positions = anchor_tokens.to(self.device), anchor_positions.to(self.device)
        if not torch.equal(anchor_positions, self.lengths):
            raise ValueError(
                f"BatchedDSparkProposer: anchors at positions {anchor_positions.tolist()} but the "
                f"contexts hold {self.lengths.tolist()}; each must hold exactly the positions before "
                "its anchor"
            )
        start = time.perf_counter()
        hidden = self.block_hidden(anchor_tokens, anchor_positions)  # [R, γ, d] float32
        parallel_logits = self.stage.logits(hidden)  # [R, γ, Vd] float32
        synchronize(self.device)
        middle = time.perf_counter()
        proposal = self._sequential(
            hidden,
            parallel_logits,
            anchor_tokens=anchor_tokens,
            temperature=temperature,
            generators=generators,
            stop_ids=stop_ids,
            policy_hook=policy_hook,
            max_drafts=max_drafts,
        )
        synchronize(self.device)
        proposal.seconds_parallel, proposal.seconds_sequential = middle - start, time.perf_counter() - middle
        return proposal

    def block_hidden(self, anchor_tokens: Tensor, anchor_positions: Tensor) -> Tensor:
        """h [R, γ, d] (float32) of the blocks [x_0, MASK×(γ−1)] over each row's cached context (one forward)."""
        backbone, gamma = self.stage.backbone, self.block_size
        ids = torch.full((self.num_rows, 1, gamma), self.drafter.mask_token_id, dtype=torch.long, device=self.device)
        ids[:, 0, 0] = anchor_tokens
        hidden = backbone.embed_block(ids).flatten(1, 2)  # [R, γ, d]
        positions = anchor_positions.unsqueeze(1) + torch.arange(gamma, device=self.device)
        rope = backbone.rotary(positions)
        width = int(self.lengths.max())
        in_context = torch.arange(width, device=self.device).unsqueeze(0) < self.lengths.unsqueeze(1)  # [R, C]
        mask = torch.cat([in_context, in_context.new_ones(self.num_rows, gamma)], dim=1)[:, None, None, :]
        for layer, keys, values in zip(backbone.layers, self._keys, self._values):
            hidden = layer.forward_cached(
                hidden, rope=rope, extend_kv=_after(keys[:, :, :width], values[:, :, :width]), mask=mask
            )
        return backbone.norm(hidden).float()

    def _sequential(
        self,
        hidden: Tensor,
        parallel_logits: Tensor,
        *,
        anchor_tokens: Tensor,
        temperature: float,
        generators: list[torch.Generator | None],
        stop_ids: Collection[int],
        policy_hook: PolicyHook | None = None,
        max_drafts: int | None = None,
    ) -> BatchProposal:
        """Slot by slot for all rows, over the draft vocabulary: c_k from x_{k-1} first, then x_k; a row stops
        after a drafted stop id, or before a slot whose logits are unusable (fault guard, `decoding.drafting`);
        every row stops at `max_drafts` or when `policy_hook` says so (before sampling that slot)."""
        rows, gamma, _ = parallel_logits.shape
        ids = self.stage.ids
        stops = torch.tensor(sorted(int(s) for s in stop_ids), dtype=torch.long, device=self.device)
        tokens = torch.zeros(rows, gamma, dtype=torch.long, device=self.device)
        probs = torch.zeros(rows, gamma, self.vocab_size, dtype=torch.float32, device=self.device)
        confidences = torch.zeros(rows, gamma, dtype=torch.float32, device=self.device) if self.has_confidence else None
        drafting = torch.ones(rows, dtype=torch.bool, device=self.device)
        num_drafts = torch.zeros(rows, dtype=torch.long, device=self.device)
        prev, state = anchor_tokens, None
        count = draft_count(gamma, max_drafts)
        cut = torch.zeros(rows, dtype=torch.bool, device=self.device)
        source = self.confidence if self.has_confidence else None
        if source is not None:
            source.reset(rows)
        for k in range(count):
            logits, conf_logit, state = self.drafter.sequential_step(
                hidden_k=hidden[:, k], parallel_logits_k=parallel_logits[:, k], prev_token=prev, state=state
            )
            drafting &= usable_logits(logits)
            if confidences is not None:
                head = None if conf_logit is None else torch.sigmoid(conf_logit.float()).reshape(rows)
                if source is not None:  # c_k from q_k, before x_k is drawn (`decoding.confidence`)
                    head = source.slot(k, head=head, top_prob=top_probability(logits, temperature))
                confidences[:, k] = torch.where(drafting, clean_confidences(head), 0.0)
                if policy_hook is not None and policy_hook(confidences[:, : k + 1]):
                    confidences[:, k] = 0.0  # slot k is not drafted: γ'_r stays k
                    cut = drafting.clone()
                    break
            slot_probs = torch.where(drafting.unsqueeze(1), probs_from_logits(logits, temperature), 0.0)
            probs[:, k] = to_target_probs(slot_probs, ids, self.vocab_size)
            index = _sample_rows(slot_probs, drafting, temperature=temperature, generators=generators)
            prev = index if ids is None else ids[index]
            tokens[:, k] = prev
            num_drafts += drafting.long()
            drafting &= ~torch.isin(prev, stops)
            if not bool(drafting.any()):
                break
        else:
            if count < gamma:
                cut = drafting.clone()  # stopped at max_drafts
        return BatchProposal(tokens, probs, confidences, num_drafts, policy_cut=cut)


def _after(keys: Tensor, values: Tensor):
    """`extend_kv` for one layer: [cached context ; block] along the position axis."""
    return lambda k, v: (torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2))


def _sample_rows(
    probs: Tensor, drafting: Tensor, *, temperature: float, generators: list[torch.Generator | None]
) -> Tensor:
    """x_k [R] from probs [R, V]: argmax at T = 0; else one uniform from each drafting row's generator (rows that
    stopped draw nothing and return 0)."""
    if temperature == 0:
        return probs.argmax(dim=-1)
    active = torch.nonzero(drafting).flatten().tolist()
    tokens = torch.zeros(probs.shape[0], dtype=torch.long, device=probs.device)
    if not active:
        return tokens
    if any(generators[r] is None for r in active):
        raise ValueError("BatchedDSparkProposer: sampling (temperature > 0) needs a torch.Generator for every row")
    uniforms = torch.cat([draw_uniforms((1,), generators[r], probs.device) for r in active])
    tokens[active] = sample_from_probs(probs[active], uniforms=uniforms)
    return tokens
