"""Sequential heads B_k (METHOD §2.2) and the confidence head c_k (METHOD §2.3).

    p_k(v | x_0, x_<k) = softmax(U_k + B_k(x_0, x_<k))(v)
    none:    B_k = 0                                                  (DFlash)
    markov:  B_k = W_2 W_1[x_{k-1}]                                   W_1 ∈ R^{V×r}, W_2: r → V
    gated:   B_k = W_2 (σ(A [h_k; W_1[x_{k-1}]] + b) ⊙ W_1[x_{k-1}])   A: d + r → r (DeepSpec GatedMarkovHead)
    rnn:     z_k = [s_{k-1}; W_1[x_{k-1}]; h_k],  (g, c, o) = A z_k + b,  s_0 = 0
             s_k = σ(g)⊙s_{k-1} + (1-σ(g))⊙tanh(c),  B_k = W_2 tanh(o)
    confidence: c_k = σ(w·[h_k ; W_1[x_{k-1}]] + b)   (h_k alone for `none`)

`x_{k-1}` is the previous token of slot k (`x_0`, the anchor, for k = 1): ground truth in training
(teacher-forced, all slots in parallel, the RNN unrolled over the block), the drafted token at inference, where
`step` runs slot by slot. Neither B_k nor c_k ever sees x_k (non-anticipation, METHOD §2.3).
`markov_rank = 0` turns `markov`/`rnn` into `none` (as DeepSpec's `markov_rank=0`): exactly the DFlash logits.

With a draft vocabulary W₂ maps r → Vd (the bias is over draft ids) while W₁ stays a [V, r] table indexed by any
target token (`output_size` = Vd; V without one).

Shape symbols: B sequences, N blocks, γ block size, d hidden size, V vocabulary, Vd draft vocabulary, r rank;
`...` any batch shape.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dspark.drafters.layers import init_new_weights
from dspark.registry import Registry

SEQUENTIAL_HEADS: Registry[type["SequentialHead"]] = Registry("model.head")


class SequentialHead(nn.Module):
    """Interface of the sequential stage. `rank` is the width r of the previous-token embedding (0: none).

    `None` as a bias means B_k ≡ 0 and as a state means "stateless"; callers add the bias only when present.
    """

    rank: int = 0

    def teacher_forced_bias(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor | None:
        """hidden [B, N, γ, d] (final-norm h_k), prev_tokens [B, N, γ] (x_{k-1}) → B_k [B, N, γ, Vd] or None."""
        return None

    def init_state(self, batch_shape: tuple[int, ...]) -> Tensor | None:
        """State before slot 1 (s_0) for a batch of `batch_shape` blocks."""
        return None

    def step(self, hidden_k: Tensor, prev_token: Tensor, state: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """One slot: hidden_k [..., d], prev_token [...] (x_{k-1}), state → (B_k [..., Vd] or None, new state)."""
        return None, state

    def prev_token_embedding(self, prev_tokens: Tensor) -> Tensor | None:
        """W_1 rows of the previous tokens: [...] → [..., r], or None without a W_1 table."""
        return None


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


@SEQUENTIAL_HEADS.register("none")
class NoneHead(SequentialHead):
    """B_k = 0: the parallel logits are the draft logits (DFlash)."""

    def __init__(self, *, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None) -> None:
        super().__init__()


@SEQUENTIAL_HEADS.register("markov")
class MarkovHead(SequentialHead):
    """First-order Markov bias B_k = W_2 W_1[x_{k-1}] of rank r (paper r = 256)."""

    def __init__(self, *, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        self.w1 = nn.Embedding(vocab_size, rank)
        self.w2 = nn.Linear(rank, output_size or vocab_size, bias=False)
        self._decode_w2 = DecodeProjection()
        self._table = BiasTable()
        init_new_weights(self)

    def teacher_forced_bias(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor:
        return self.w2(self.w1(prev_tokens))

    def enable_bias_table(self, ids: Tensor | None) -> bool:
        """Decode with a lookup table of B(x) for the previous tokens `ids` (`BiasTable`); None disables it."""
        return self._table.enable(self, ids)

    def step(self, hidden_k: Tensor, prev_token: Tensor, state: Tensor | None) -> tuple[Tensor, None]:
        bias = self._table.lookup(self, prev_token)
        if bias is not None:
            return bias, None
        return self._decode_w2(self.w2, self.w1(prev_token)), None

    def prev_token_embedding(self, prev_tokens: Tensor) -> Tensor:
        return self.w1(prev_tokens)


@SEQUENTIAL_HEADS.register("gated")
class GatedMarkovHead(SequentialHead):
    """Markov bias whose r features are gated by the backbone state: B_k = W_2 (g_k ⊙ W_1[x_{k-1}]),
    g_k = σ(A [h_k; W_1[x_{k-1}]] + b) — DeepSpec's `GatedMarkovHead` (markov_head.py, `gate_proj`, input columns
    [h | W_1[x]]). Still memoryless in x (first order), but how much of the transition applies depends on h_k."""

    def __init__(self, *, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        self.w1 = nn.Embedding(vocab_size, rank)
        self.gate = nn.Linear(hidden_size + rank, rank)  # input columns [h | W_1[x]]
        self.w2 = nn.Linear(rank, output_size or vocab_size, bias=False)
        self._decode_w2 = DecodeProjection()
        init_new_weights(self)  # zero gate bias: every gate starts at σ(0) = ½

    def teacher_forced_bias(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor:
        return self.w2(self._gated(hidden, self.w1(prev_tokens)))

    def step(self, hidden_k: Tensor, prev_token: Tensor, state: Tensor | None) -> tuple[Tensor, None]:
        return self._decode_w2(self.w2, self._gated(hidden_k, self.w1(prev_token))), None

    def prev_token_embedding(self, prev_tokens: Tensor) -> Tensor:
        return self.w1(prev_tokens)  # ungated, as DeepSpec's confidence input (get_prev_embeddings)

    def _gated(self, hidden: Tensor, embedding: Tensor) -> Tensor:
        """hidden [..., d], embedding W_1[x] [..., r] → g ⊙ W_1[x] [..., r]."""
        gate = torch.sigmoid(self.gate(torch.cat([hidden.to(embedding.dtype), embedding], dim=-1)))
        return gate * embedding


@SEQUENTIAL_HEADS.register("rnn")
class RNNHead(SequentialHead):
    """Gated recurrent bias over the block: one Linear(2r + d → 3r, bias) on [s_{k-1}; W_1[x_{k-1}]; h_k]."""

    def __init__(self, *, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        self.w1 = nn.Embedding(vocab_size, rank)
        self.cell = nn.Linear(2 * rank + hidden_size, 3 * rank)  # input columns [s | W_1[x] | h]
        self.w2 = nn.Linear(rank, output_size or vocab_size, bias=False)
        self._decode_w2 = DecodeProjection()
        init_new_weights(self)

    def teacher_forced_bias(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor:
        # The token and hidden parts of the cell do not depend on the state: project all slots at once and
        # keep only the state part inside the loop over γ.
        inputs = self._input_part(hidden, prev_tokens)  # [B, N, γ, 3r]
        state = self.init_state(inputs.shape[:-2])
        outputs = []
        for k in range(inputs.shape[-2]):
            state, out = self._recur(inputs[..., k, :], state)
            outputs.append(out)
        return self.w2(torch.stack(outputs, dim=-2))

    def init_state(self, batch_shape: tuple[int, ...]) -> Tensor:
        return self.w2.weight.new_zeros(*batch_shape, self.rank)

    def step(self, hidden_k: Tensor, prev_token: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
        if state is None:
            state = self.init_state(prev_token.shape)
        state, out = self._recur(self._input_part(hidden_k, prev_token), state)
        return self._decode_w2(self.w2, out), state

    def prev_token_embedding(self, prev_tokens: Tensor) -> Tensor:
        return self.w1(prev_tokens)

    def _input_part(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor:
        """A_x W_1[x_{k-1}] + A_h h_k + b: [..., 3r]."""
        r, weight = self.rank, self.cell.weight
        return F.linear(self.w1(prev_tokens), weight[:, r : 2 * r]) + F.linear(
            hidden, weight[:, 2 * r :], self.cell.bias
        )

    def _recur(self, input_part: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """(s_{k-1}, precomputed input part) → (s_k, tanh(o_k))."""
        gate, candidate, output = (input_part + F.linear(state, self.cell.weight[:, : self.rank])).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return gate * state + (1 - gate) * torch.tanh(candidate), torch.tanh(output)


def build_sequential_head(
    name: str, *, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None
) -> SequentialHead:
    """Resolve `model.head`; rank 0 means no W_1/W_2 at all, so any head degrades to `none` (DFlash).

    vocab_size V sizes W₁ (indexed by target ids); output_size (Vd, default V) sizes W₂'s output."""
    head_cls = SEQUENTIAL_HEADS.resolve(name)
    if rank == 0:
        head_cls = NoneHead
    return head_cls(hidden_size=hidden_size, vocab_size=vocab_size, rank=rank, output_size=output_size)


class ConfidenceHead(nn.Module):
    """c_k logit = w·[h_k ; W_1[x_{k-1}]] + b; input h_k alone when the head has no W_1 (rank 0)."""

    def __init__(self, *, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.proj = nn.Linear(hidden_size + rank, 1)
        init_new_weights(self)

    def forward(self, hidden: Tensor, prev_embedding: Tensor | None) -> Tensor:
        """hidden [..., d], prev_embedding [..., r] or None → pre-sigmoid confidence [...]."""
        features = hidden if prev_embedding is None else torch.cat([hidden, prev_embedding.to(hidden.dtype)], -1)
        return self.proj(features).squeeze(-1)
