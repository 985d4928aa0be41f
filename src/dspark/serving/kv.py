"""The target's KV cache for R concurrent requests: one DynamicCache with holes (METHOD §5 per row; paper §5.2, §7).

Rows of one transformers `DynamicCache` are the active requests; `valid` [R, W] marks which key columns hold a
committed position of that row's sequence. Positions are per request and absolute (prompt at 0..S-1) and always go
to the model as explicit `position_ids`, so RoPE is right whatever column a position sits in; the column order of
a row is its chronological order, which is all the causal part of the mask needs (queries are appended after every
cached column). One engine step:

    forward      append Q columns to every row (the right-padded verify block [x_0, x_1..x_ℓ_r, pad…])
    keep_new     of those Q columns keep only each row's anchor + accepted drafts; rejected drafts and padding
                 stay in the tensors as masked holes instead of being cropped row by row
    compact      when the width exceeds the longest row by more than `compact_fraction` of it allows, gather each
                 row's valid columns (left-aligned, order kept) so memory stays O(R · longest sequence)

Requests join through `prefill` (all joiners of a step in ONE right-padded forward) and `add_rows` (the narrower
side padded with hole columns), and leave through `remove_rows`. transformers 5.24 builds the attention mask from
the 2-D `attention_mask` [R, W + Q] (holes → False) and the cache length (causal part in column space), and
`DynamicLayer` keeps `.keys` / `.values` [R, H_kv, W, hd], which is what the row and column surgery edits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

COMPACT_HOLE_FRACTION = (
    0.25  # compact once the width's hole columns could be a quarter of it: width ≤ 4/3 of the longest row
)
MEMORY_SAFETY_FRACTION = 0.5  # plan the KV caches into half the free memory: holes, activations, the verify block


@dataclass
class Prefill:
    """One batched prompt forward: the cache of its J rows, their valid columns and the target's outputs."""

    cache: DynamicCache
    valid: Tensor  # [J, S_max] bool, True on each prompt's S_j positions (right padding False)
    lengths: Tensor  # [J] long, S_j
    features: Tensor  # [J, S_max, m·d] raw feature-layer outputs
    last_hidden: Tensor  # [J, d] final-norm hidden state at each prompt's last position (gives token S_j)


def prefill(target: Any, prompts: list[list[int]]) -> Prefill:
    """Run all `prompts` (non-empty token lists) through the target in one right-padded forward."""
    device = target.device
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    width = int(lengths.max())
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)
    columns = torch.arange(width, device=device).unsqueeze(0)
    valid = columns < lengths.unsqueeze(1)
    cache = target.new_cache()
    forward = target.forward(
        ids, attention_mask=valid.long(), position_ids=columns.expand(len(prompts), -1), cache=cache
    )
    last = forward.final_hidden[torch.arange(len(prompts), device=device), lengths - 1]
    return Prefill(cache=cache, valid=valid, lengths=lengths, features=forward.features, last_hidden=last)


class BatchedKVCache:
    """The target's cache for the active requests (row r = the r-th active request); see the module docstring."""

    def __init__(self, target: Any, *, compact_fraction: float = COMPACT_HOLE_FRACTION) -> None:
        if not 0.0 < compact_fraction < 1.0:
            raise ValueError(f"BatchedKVCache: compact_fraction={compact_fraction} must lie in (0, 1), e.g. 0.25")
        self.target, self.compact_fraction = target, float(compact_fraction)
        self.cache = _checked_cache(target)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=target.device)  # [R, W]
        self._block = 0  # columns appended by the last forward (what keep_new trims)

    @property
    def num_rows(self) -> int:
        return int(self.valid.shape[0])

    @property
    def width(self) -> int:
        return int(self.valid.shape[1])

    @property
    def lengths(self) -> Tensor:
        """[R] long: valid (committed) positions per row."""
        return self.valid.sum(dim=1)

    @property
    def hole_fraction(self) -> float:
        """Share of the R·W cache cells that are holes or padding."""
        cells = self.valid.numel()
        return 1.0 - float(self.valid.sum()) / cells if cells else 0.0

    def forward(self, input_ids: Tensor, *, position_ids: Tensor, input_valid: Tensor):
        """Append the block input_ids [R, Q] at absolute position_ids [R, Q]; input_valid [R, Q] False on padding.

        Returns the `TargetForward`; the Q new columns count as valid (as input_valid says) until `keep_new`.
        """
        if input_ids.shape[0] != self.num_rows:
            raise ValueError(f"BatchedKVCache.forward: {input_ids.shape[0]} input rows for {self.num_rows} cache rows")
        mask = torch.cat([self.valid, input_valid.to(torch.bool)], dim=1)
        forward = self.target.forward(
            input_ids, attention_mask=mask.long(), position_ids=position_ids, cache=self.cache
        )
        self.valid, self._block = mask, int(input_ids.shape[1])
        return forward

    def forward_tree(self, input_ids: Tensor, *, position_ids: Tensor, input_valid: Tensor, block_mask: Tensor):
        """Append R draft trees as one block: input_ids [R, Q] ([x_0, nodes…, pad…] per row), position_ids [R, Q]
        (p + depth), input_valid [R, Q] False on padding, block_mask [R, Q, Q] bool (query j sees block column i: the
        anchor, its ancestors and itself). Every query also sees its row's valid cache columns; a padding query sees
        itself only (its output is never read). Returns the `TargetForward`; keep the accepted columns with
        `keep_columns`."""
        if input_ids.shape[0] != self.num_rows:
            raise ValueError(f"BatchedKVCache.forward_tree: {input_ids.shape[0]} input rows for {self.num_rows} rows")
        rows, queries = input_ids.shape
        valid = input_valid.to(torch.bool)
        eye = torch.eye(queries, dtype=torch.bool, device=valid.device).unsqueeze(0)
        block = (block_mask.to(torch.bool) & valid.unsqueeze(1) & valid.unsqueeze(2)) | eye
        past = self.valid.unsqueeze(1).expand(rows, queries, self.width)
        mask = torch.cat([past, block], dim=2).unsqueeze(1)  # [R, 1, Q, W + Q]
        forward = self.target.forward(input_ids, attention_mask=mask, position_ids=position_ids, cache=self.cache)
        self.valid, self._block = torch.cat([self.valid, valid], dim=1), int(queries)
        return forward

    def keep_columns(self, keep: Tensor) -> None:
        """Of the last forward's Q columns keep those with keep[r, j] ([R, Q] bool) per row (the anchor and the
        accepted path of a tree, in node order: chronological); the rest become holes."""
        if self._block == 0:
            return
        block = self.valid[:, -self._block :] & keep.to(device=self.valid.device, dtype=torch.bool)
        self.valid = torch.cat([self.valid[:, : -self._block], block], dim=1)
        self._block = 0

    def keep_new(self, keep: Tensor) -> None:
        """Of the last forward's Q columns keep the first keep[r] ([R] long) per row; the rest become holes."""
        if self._block == 0:
            return
        columns = torch.arange(self._block, device=self.valid.device).unsqueeze(0)
        block = self.valid[:, -self._block :] & (columns < keep.to(self.valid.device).unsqueeze(1))
        self.valid = torch.cat([self.valid[:, : -self._block], block], dim=1)
        self._block = 0

    def add_rows(self, prefill: Prefill, rows: Tensor | None = None) -> None:
        """Append the rows `rows` ([J'] long, default all) of a prefill as new last rows (width padded with holes)."""
        rows = torch.arange(prefill.valid.shape[0], device=prefill.valid.device) if rows is None else rows
        valid = prefill.valid[rows]
        if rows.numel() == 0:
            return
        if self.num_rows == 0:
            prefill.cache.batch_select_indices(rows)
            self.cache, self.valid = prefill.cache, valid
            self._block = 0
            return
        width = max(self.width, valid.shape[1])
        for layer, new in zip(self.cache.layers, prefill.cache.layers):
            layer.keys = torch.cat([_pad_columns(layer.keys, width), _pad_columns(new.keys[rows], width)])
            layer.values = torch.cat([_pad_columns(layer.values, width), _pad_columns(new.values[rows], width)])
        self.valid = torch.cat([_pad_columns(self.valid, width, dim=1), _pad_columns(valid, width, dim=1)])
        self._block = 0

    def remove_rows(self, keep_rows: Tensor) -> None:
        """Keep only the rows `keep_rows` ([R'] long, in the new order); an empty selection resets the cache."""
        if keep_rows.numel() == 0:
            self.cache = _checked_cache(self.target)
            self.valid = self.valid.new_zeros(0, 0)
        else:
            keep_rows = keep_rows.to(self.valid.device)
            self.cache.batch_select_indices(keep_rows)
            self.valid = self.valid[keep_rows]
        self._block = 0

    def maybe_compact(self) -> bool:
        """Compact when the width exceeds the longest row by more than holes may take (width > longest / (1 −
        `compact_fraction`): 4/3 of it at 0.25); True when it did.

        The width, not the share of hole cells, decides: rows of different lengths leave padding that no compaction
        removes (a row of 60 tokens beside one of 160 is 62% padding), and a hole-share trigger then gathered the
        whole cache at nearly every step — 31 of 49 steps at R = 8, ~12 ms each on the Zen 3, most of the engine's
        per-step "other" time — without making it narrower."""
        longest = int(self.lengths.max()) if self.num_rows else 0
        if self.width * (1.0 - self.compact_fraction) <= longest:
            return False
        self.compact()
        return True

    def compact(self) -> None:
        """Gather each row's valid columns to the left (order kept); width becomes the longest row."""
        lengths = self.lengths
        width = int(lengths.max()) if self.num_rows else 0
        # Stable sort puts valid columns first, each row's in its original (chronological) order.
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :width]
        for layer in self.cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        self.valid = torch.arange(width, device=self.valid.device).unsqueeze(0) < lengths.unsqueeze(1)
        self._block = 0


def _checked_cache(target: Any) -> DynamicCache:
    """A new cache of `target`, refused when a layer is not a plain full-attention `DynamicLayer` (the holes would
    break sliding windows, and other layer kinds hold no per-column keys)."""
    cache = target.new_cache()
    odd = [type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer]
    if odd:
        raise ValueError(
            f"serving needs a full-attention target (plain DynamicCache layers); '{target.name}' has "
            f"{sorted(set(odd))} layers: serve it with the single-request engine (stage=eval)"
        )
    return cache


def _pad_columns(x: Tensor, width: int, dim: int = 2) -> Tensor:
    """Pad `x` with zeros (holes) along `dim` up to `width`."""
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


@dataclass
class KVBudget:
    """Memory needed per request and what the machine offers (bytes)."""

    positions: int  # longest prompt + max_new_tokens among the requests
    target_bytes: int  # positions × layers × 2 × kv heads × head dim × dtype size
    drafter_bytes: int  # the drafter's context keys/values for the same positions
    available: int | None  # MemAvailable (CPU) or free device memory; None when unknown
    device: str

    @property
    def per_request(self) -> int:
        return self.target_bytes + self.drafter_bytes

    @property
    def max_concurrency(self) -> int | None:
        if self.available is None or self.per_request == 0:
            return None
        return int(self.available * MEMORY_SAFETY_FRACTION) // self.per_request


def kv_budget(*, target: Any, drafter: Any | None, positions: int) -> KVBudget:
    """Bytes of KV cache one request of `positions` positions needs on the target (and drafter) device."""
    config = target.hf_config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    itemsize = torch.empty(0, dtype=target.dtype).element_size()
    target_bytes = positions * target.num_layers * 2 * kv_heads * head_dim * itemsize
    drafter_bytes = 0
    if drafter is not None:
        spec, weight = drafter.spec, drafter.backbone.fc.weight
        drafter_bytes = (
            positions
            * len(drafter.backbone.layers)
            * 2
            * spec.num_key_value_heads
            * spec.head_dim
            * weight.element_size()
        )
    return KVBudget(
        positions=positions,
        target_bytes=target_bytes,
        drafter_bytes=drafter_bytes,
        available=available_memory_bytes(target.device),
        device=str(target.device),
    )


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory for new tensors: torch.cuda.mem_get_info on a GPU, /proc/meminfo MemAvailable on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


def check_concurrency(concurrency: int, budget: KVBudget) -> None:
    """ValueError naming serve.concurrency when `concurrency` requests' KV caches do not fit (safety margin kept)."""
    limit = budget.max_concurrency
    if limit is None or concurrency <= limit:
        return
    raise ValueError(
        f"serve.concurrency={concurrency} does not fit in memory: each request needs about {budget.per_request:,} "
        f"bytes of KV cache ({budget.positions} positions (longest prompt + max_new_tokens) × layers × 2 × KV heads "
        f"× head dim × dtype size = {budget.target_bytes:,} bytes for the target, plus {budget.drafter_bytes:,} "
        f"for the drafter's context cache), and {budget.available:,} bytes are available on {budget.device}, of "
        f"which {MEMORY_SAFETY_FRACTION:.0%} is planned for KV caches: at most {limit} concurrent requests. Lower "
        "serve.concurrency (or max_new_tokens / the prompt length)"
    )
