"""Decode-time caches of the sequential heads' output projection W_2 (METHOD §2.2): what the one-slot-at-a-time
loop of the proposers reads instead of the training layers. Unused under autograd: training never sees them.

Shape symbols: V vocabulary, Vd draft vocabulary, r rank; `...` any batch shape.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class DecodeProjection:
    """W_2 for the decoding loop: x [..., r] → x W_2ᵀ [..., V] through a cached, contiguous [r, V] copy of W_2.

    At decoding time every slot multiplies a few rows by all of W_2 (r × V, 50 MB for r = 256 and SmolLM2's V): the
    loop is bound by reading it. `nn.Linear` keeps the weight as [V, r] and the CPU BLAS reads it about 3× slower
    for such skinny products than a contiguous [r, V] matrix (measured 31 vs 11 ms for one row, one thread). The copy
    is rebuilt whenever the weight changes (its version counter, storage, dtype or device); under autograd the
    plain layer is used, so training never sees the cache.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._weight_t: Tensor | None = None

    def __call__(self, layer: nn.Linear, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            return layer(x)
        weight = layer.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if key != self._key:
            self._weight_t, self._key = weight.detach().t().contiguous(), key
        return x.to(weight.dtype) @ self._weight_t


class BiasTable:
    """Decode-time lookup of the Markov bias B(x) = W_2 W_1[x] for a fixed set of previous tokens (`enable(ids)`).

    In the decoding loop every slot k ≥ 2 has x_{k-1} drawn from the draft vocabulary, and each such slot would
    otherwise read all of W_2 (r × Vd floats) for one row: that product bounds the sequential loop (measured 0.5 ms
    per slot for 256 × 8,192 on one thread against ~4 µs for a row copy). With a draft vocabulary the bias of every
    draft id fits a [Vd, Vd] fp32 table (268 MB at Vd = 8,192; built once in ~1 s, rebuilt when W_1 or W_2 change,
    like `DecodeProjection`), so the loop looks rows up; a previous token outside the set (the anchor, for k = 1)
    falls back to the product. The table rows are the same product computed in one matrix multiply, equal to the
    per-row product up to float rounding; losslessness never depends on them (p_d is what the token was drawn from).
    Unused under autograd: training never sees it.
    """

    #: the largest set tabulated (Vd² fp32 floats: 16,384 → 1 GiB); the full 49,152-token vocabulary is not
    MAX_IDS = 16384

    def __init__(self) -> None:
        self._ids: Tensor | None = None
        self._key: tuple | None = None
        self._rows: Tensor | None = None
        self._index: Tensor | None = None
        self._index_list: list[int] = []

    def enable(self, head: nn.Module, ids: Tensor | None) -> bool:
        """Tabulate the previous tokens `ids` [n] (target ids) now; None or more than MAX_IDS disables the table.
        Returns whether it is on."""
        self._ids = None if ids is None or ids.numel() > self.MAX_IDS else ids.detach().long()
        self._key = self._rows = self._index = None
        if self._ids is not None:
            self._refresh(head)
        return self._ids is not None

    @torch.no_grad()
    def _refresh(self, head: nn.Module) -> None:
        """(Re)build the rows when W_1 or W_2 changed since the last build."""
        w1, w2 = head.w1.weight, head.w2.weight
        key = (w1.data_ptr(), w1._version, w2.data_ptr(), w2._version, w2.dtype, w2.device)
        if key == self._key:
            return
        ids = self._ids.to(w1.device)
        self._rows = F.linear(F.embedding(ids, w1), w2)  # [n, Vd]
        self._index = torch.full((w1.shape[0],), -1, dtype=torch.long, device=w1.device)
        self._index[ids] = torch.arange(ids.numel(), device=w1.device)
        self._index_list = self._index.tolist()
        self._key = key

    def lookup(self, head: nn.Module, prev_token: Tensor) -> Tensor | None:
        """B(prev_token) [..., Vd] from the table, or None (disabled, under autograd, or a token outside the set)."""
        if self._ids is None or torch.is_grad_enabled():
            return None
        self._refresh(head)
        if prev_token.numel() == 1:  # the single-request loop, once per slot: a Python look-up and a row view
            row = self._index_list[int(prev_token)]
            return None if row < 0 else self._rows[row : row + 1].view(*prev_token.shape, -1)
        rows = self._index[prev_token]
        if bool((rows < 0).any()):
            return None
        return self._rows[rows]
