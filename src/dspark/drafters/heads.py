"""Sequential heads B_k (METHOD §2.2) and the confidence head c_k (METHOD §2.3).

    p_k(v | x_0, x_<k) = softmax(U_k + B_k(x_0, x_<k))(v)
    none:    B_k = 0                                                  (DFlash)
    markov:  B_k = W_2 W_1[x_{k-1}]                                   W_1 ∈ R^{V×r}, W_2: r → V
    gated:   B_k = W_2 (σ(A [h_k; W_1[x_{k-1}]] + b) ⊙ W_1[x_{k-1}])   A: d + r → r (DeepSpec GatedMarkovHead)
    rnn:     z_k = [s_{k-1}; W_1[x_{k-1}]; h_k],  (g, c, o) = A z_k + b,  s_0 = 0
             s_k = σ(g)⊙s_{k-1} + (1-σ(g))⊙tanh(c),  B_k = W_2 tanh(o)
    gru:     s_k = GRU(W_1[x_{k-1}], s_{k-1}),  s_0 = 0,  B_k = W_2 SiLU(P [h_k; s_k] + b)       (Domino-style)
    selector_conv:  C_k = top-K(U_k),  B_k(v) = [v ∈ C_k] · W_2[v]·(W_1[x_{k-1}] ⊙ (H h_k + b))    (DFlash2-style,
             with the block convolution of `dspark.drafters.block_conv` in every draft layer)
    confidence: c_k = σ(w·[h_k ; W_1[x_{k-1}]] + b)   (h_k alone for `none`)

`x_{k-1}` is the previous token of slot k (`x_0`, the anchor, for k = 1): ground truth in training
(teacher-forced, all slots in parallel, the recurrences unrolled over the block), the drafted token at inference,
where `step` runs slot by slot. Neither B_k nor c_k ever sees x_k (non-anticipation, METHOD §2.3). A head may read
the slot's parallel logits U_k (`parallel_logits`, passed to every head; only the selector uses them): they depend on
the context and the block's hidden states, never on a drafted token. `markov_rank = 0` turns every head into `none`
(as DeepSpec's `markov_rank=0`): exactly the DFlash logits.

With a draft vocabulary W₂ maps r → Vd (the bias is over draft ids) while W₁ stays a [V, r] table indexed by any
target token (`output_size` = Vd; V without one).

Shape symbols: B sequences, N blocks, γ block size, d hidden size, V vocabulary, Vd draft vocabulary, r rank,
K selector candidates; `...` any batch shape.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dspark.drafters.block_conv import BlockConv
from dspark.drafters.decode_tables import BiasTable, DecodeProjection
from dspark.drafters.layers import init_new_weights
from dspark.registry import Registry

SEQUENTIAL_HEADS: Registry[type["SequentialHead"]] = Registry("model.head")


class SequentialHead(nn.Module):
    """Interface of the sequential stage. `rank` is the width r of the previous-token embedding (0: none).

    `None` as a bias means B_k ≡ 0 and as a state means "stateless"; callers add the bias only when present.
    """

    rank: int = 0
    #: the drafter wraps every draft layer's sublayers in a block convolution (`dspark.drafters.block_conv`):
    #: the head's parallel half, built by the backbone
    block_conv: bool = False

    def teacher_forced_bias(
        self, hidden: Tensor, prev_tokens: Tensor, *, parallel_logits: Tensor | None = None
    ) -> Tensor | None:
        """hidden [B, N, γ, d] (final-norm h_k), prev_tokens [B, N, γ] (x_{k-1}), parallel_logits [B, N, γ, Vd]
        (U_k) → B_k [B, N, γ, Vd] or None."""
        return None

    def init_state(self, batch_shape: tuple[int, ...]) -> Tensor | None:
        """State before slot 1 (s_0) for a batch of `batch_shape` blocks: [*batch_shape, ...] (callers slice and
        concatenate it along the batch dimensions: a tree carries one row per node)."""
        return None

    def step(
        self, hidden_k: Tensor, prev_token: Tensor, state: Tensor | None, *, parallel_logits: Tensor | None = None
    ) -> tuple[Tensor | None, Tensor | None]:
        """One slot: hidden_k [..., d], prev_token [...] (x_{k-1}), state, parallel_logits [..., Vd] (U_k) →
        (B_k [..., Vd] or None, new state)."""
        return None, state

    def prev_token_embedding(self, prev_tokens: Tensor) -> Tensor | None:
        """W_1 rows of the previous tokens: [...] → [..., r], or None without a W_1 table."""
        return None


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

    def teacher_forced_bias(self, hidden: Tensor, prev_tokens: Tensor, *, parallel_logits=None) -> Tensor:
        return self.w2(self.w1(prev_tokens))

    def enable_bias_table(self, ids: Tensor | None) -> bool:
        """Decode with a lookup table of B(x) for the previous tokens `ids` (`BiasTable`); None disables it."""
        return self._table.enable(self, ids)

    def step(self, hidden_k: Tensor, prev_token: Tensor, state: Tensor | None, *, parallel_logits=None) -> tuple:
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

    def teacher_forced_bias(self, hidden: Tensor, prev_tokens: Tensor, *, parallel_logits=None) -> Tensor:
        return self.w2(self._gated(hidden, self.w1(prev_tokens)))

    def step(self, hidden_k: Tensor, prev_token: Tensor, state: Tensor | None, *, parallel_logits=None) -> tuple:
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

    def teacher_forced_bias(self, hidden: Tensor, prev_tokens: Tensor, *, parallel_logits=None) -> Tensor:
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

    def step(self, hidden_k: Tensor, prev_token: Tensor, state: Tensor | None, *, parallel_logits=None) -> tuple:
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


@SEQUENTIAL_HEADS.register("gru")
class GRUHead(SequentialHead):
    """Domino-style correction head: a GRU over the previous tokens, read with h_k through a bottleneck.

        e_k = W_1[x_{k-1}],  s_k = GRU(e_k, s_{k-1}),  s_0 = 0,  B_k = W_2 SiLU(P [h_k; s_k] + b)

    The GRU is `torch.nn.GRUCell`'s (gates r, z, n), width r; P: d + r → r. Follows Domino (arXiv 2605.29707;
    sgl-project/SpecForge#571): a causal state built from the block's previous tokens only, concatenated with the
    backbone state and projected through a bottleneck MLP to an additive logit delta on the parallel logits.
    Departs: (i) the token embeddings are a trained rank-r table W_1 (Domino reads the draft model's token embedding)
    — the confidence head then reads W_1[x_{k-1}] as for every head here, and the parameter budget sits on the same
    V × r table as the Markov head's; (ii) GRU width and bottleneck are both r (one knob, `model.markov_rank`);
    (iii) slot 1 is corrected too, from the anchor x_0 (known when drafting starts, as for the Markov head);
    (iv) no base-logit curriculum (Domino's λ·CE(U_k) term): the objective trains U_k + B_k like every head's, so a
    head comparison varies the head only. Unlike `rnn`, the recurrence never reads h_k: the state is a function of
    the drafted prefix alone, and h_k enters only at the read-out.
    """

    def __init__(self, *, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        self.w1 = nn.Embedding(vocab_size, rank)
        self.cell = nn.GRUCell(rank, rank)
        self.proj = nn.Linear(hidden_size + rank, rank)  # input columns [h | s]
        self.w2 = nn.Linear(rank, output_size or vocab_size, bias=False)
        self._decode_w2 = DecodeProjection()
        init_new_weights(self)
        for name, param in self.cell.named_parameters():  # METHOD §3: N(0, 0.02) weights, zero biases
            if name.startswith("bias"):
                nn.init.zeros_(param)
            else:
                nn.init.normal_(param, mean=0.0, std=0.02)

    def teacher_forced_bias(self, hidden: Tensor, prev_tokens: Tensor, *, parallel_logits=None) -> Tensor:
        inputs = self._input_part(prev_tokens)  # [B, N, γ, 3r]: only the state part stays inside the loop
        state = self.init_state(inputs.shape[:-2])
        states = []
        for k in range(inputs.shape[-2]):
            state = self._update(inputs[..., k, :], state)
            states.append(state)
        return self.w2(self._features(hidden, torch.stack(states, dim=-2)))

    def init_state(self, batch_shape: tuple[int, ...]) -> Tensor:
        return self.w2.weight.new_zeros(*batch_shape, self.rank)

    def step(self, hidden_k: Tensor, prev_token: Tensor, state: Tensor | None, *, parallel_logits=None) -> tuple:
        if state is None:
            state = self.init_state(prev_token.shape)
        state = self._update(self._input_part(prev_token), state)
        return self._decode_w2(self.w2, self._features(hidden_k, state)), state

    def prev_token_embedding(self, prev_tokens: Tensor) -> Tensor:
        return self.w1(prev_tokens)

    def _input_part(self, prev_tokens: Tensor) -> Tensor:
        """W_ih W_1[x_{k-1}] + b_ih: [..., 3r]."""
        return F.linear(self.w1(prev_tokens), self.cell.weight_ih, self.cell.bias_ih)

    def _update(self, input_part: Tensor, state: Tensor) -> Tensor:
        """(precomputed input part [..., 3r], s_{k-1} [..., r]) → s_k, as `nn.GRUCell` computes it (any batch
        shape; GRUCell itself takes one batch dimension)."""
        i_r, i_z, i_n = input_part.chunk(3, dim=-1)
        h_r, h_z, h_n = F.linear(state, self.cell.weight_hh, self.cell.bias_hh).chunk(3, dim=-1)
        reset, update = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        candidate = torch.tanh(i_n + reset * h_n)
        return (1 - update) * candidate + update * state

    def _features(self, hidden: Tensor, state: Tensor) -> Tensor:
        """SiLU(P [h_k; s_k] + b): [..., r]."""
        return F.silu(self.proj(torch.cat([hidden.to(state.dtype), state], dim=-1)))


@SEQUENTIAL_HEADS.register("selector_conv")
class SelectorConvHead(SequentialHead):
    """DFlash2-style path selector: a bilinear pair score between the previous token and the K best candidates of
    U_k, added to those K logits; with it, the block convolution in every draft layer (`block_conv`).

        C_k = top-K(U_k),  g_k = H h_k + b,  B_k(v) = W_2[v] · (W_1[x_{k-1}] ⊙ g_k)  for v ∈ C_k,  0 elsewhere

    W_1 [V, r] is the predecessor codebook, W_2 [Vd, r] the candidate codebook, H: d → r the context projection
    (its bias starts at 1, so the selector starts as a Markov bias restricted to the candidates). K = `TOP_K`.
    Follows DFlash2 (z-lab / Inco AI, 2026; vllm-project/speculators#1014, vllm-project/vllm#52816): the pair score
    S_k(a, b) = U_k(b) + ⟨A(a) ⊙ H(h_k), B(b)⟩ over the top-16 candidates, rank 256 codebooks, and the two-tap
    dynamic convolution. Departs, to fit the per-slot sampling interface that keeps decoding lossless:
    (i) q_k = softmax(U_k + B_k) keeps full support over the draft vocabulary (DFlash2 keeps only the K candidates):
    the bias moves mass among the candidates, a token outside them keeps its U_k logit, so the training losses (CE,
    TV to p_t, c*) are finite everywhere and a target token outside C_k stays reachable; (ii) the path is drawn slot
    by slot from q_k given the drafted x_{k-1} — the greedy walk at T = 0, a sample at T > 0 — where DFlash2 walks
    its pair lattice; (iii) the predecessor a = x_{k-1} is any token (a row of W_1), not only one of slot k−1's
    candidates, since the per-slot sampler may draft outside them; (iv) C_k is a hard top-K of U_k (not
    differentiated). The decode cost per slot is K rows of W_2 (K·r), not all of it (Vd·r) as for the Markov head.
    """

    block_conv = True
    #: candidates per slot (DFlash2's `selector_top_k` 16)
    TOP_K = 16

    def __init__(self, *, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        self.w1 = nn.Embedding(vocab_size, rank)
        self.context = nn.Linear(hidden_size, rank)
        self.w2 = nn.Linear(rank, output_size or vocab_size, bias=False)
        init_new_weights(self)
        nn.init.ones_(self.context.bias)  # g_k = 1 at the start: a Markov bias restricted to the candidates

    def teacher_forced_bias(self, hidden: Tensor, prev_tokens: Tensor, *, parallel_logits=None) -> Tensor:
        return self._bias(hidden, prev_tokens, parallel_logits)

    def step(self, hidden_k: Tensor, prev_token: Tensor, state: Tensor | None, *, parallel_logits=None) -> tuple:
        return self._bias(hidden_k, prev_token, parallel_logits), None

    def prev_token_embedding(self, prev_tokens: Tensor) -> Tensor:
        return self.w1(prev_tokens)

    def _bias(self, hidden: Tensor, prev_tokens: Tensor, parallel_logits: Tensor | None) -> Tensor:
        """hidden [..., d], prev_tokens [...], parallel_logits [..., Vd] → B_k [..., Vd], nonzero on C_k only."""
        if parallel_logits is None:
            raise ValueError("model.head=selector_conv reads the parallel logits U_k: pass parallel_logits")
        query = self.w1(prev_tokens) * self.context(hidden.to(self.w1.weight.dtype))  # [..., r]
        candidates = parallel_logits.detach().topk(min(self.TOP_K, parallel_logits.shape[-1]), dim=-1).indices
        rows = F.embedding(candidates, self.w2.weight)  # [..., K, r]
        scores = (rows @ query.unsqueeze(-1)).squeeze(-1)  # [..., K]
        return scores.new_zeros(*scores.shape[:-1], parallel_logits.shape[-1]).scatter(-1, candidates, scores)


def build_sequential_head(
    name: str, *, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None
) -> SequentialHead:
    """Resolve `model.head`; rank 0 means no W_1/W_2 at all, so any head degrades to `none` (DFlash).

    vocab_size V sizes W₁ (indexed by target ids); output_size (Vd, default V) sizes W₂'s output."""
    head_cls = SEQUENTIAL_HEADS.resolve(name)
    if rank == 0:
        head_cls = NoneHead
    return head_cls(hidden_size=hidden_size, vocab_size=vocab_size, rank=rank, output_size=output_size)


def head_parameter_count(
    name: str, *, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None, depth: int = 0
) -> int:
    """Parameters head `name` adds to the parallel drafter at rank r: its own, plus the block convolutions of the
    `depth` draft layers for a head with `block_conv`. Counted on the meta device (no memory, no time)."""
    head_cls = NoneHead if rank == 0 else SEQUENTIAL_HEADS.resolve(name)
    with torch.device("meta"):
        head = head_cls(hidden_size=hidden_size, vocab_size=vocab_size, rank=rank, output_size=output_size)
        convs = 2 * depth * sum(p.numel() for p in BlockConv(hidden_size).parameters()) if head_cls.block_conv else 0
    return sum(p.numel() for p in head.parameters()) + convs


def matched_rank(
    name: str, *, rank: int, hidden_size: int, vocab_size: int, output_size: int | None = None, depth: int = 0
) -> int:
    """The rank r' at which head `name` adds as many parameters as the Markov head at `rank`, or fewer (the largest
    such r' up to 4·rank; `model.match_params`): `rank` itself for `markov`, and for `none` (no parameters at all).
    Raises ValueError when even r' = 1 exceeds the Markov budget (fixed parts, e.g. convolutions, larger than it)."""
    dims = {"hidden_size": hidden_size, "vocab_size": vocab_size, "output_size": output_size, "depth": depth}
    budget = head_parameter_count("markov", rank=rank, **dims)
    if rank == 0 or SEQUENTIAL_HEADS.resolve(name) is NoneHead:
        return rank
    if head_parameter_count(name, rank=1, **dims) > budget:
        raise ValueError(
            f"model.match_params: model.head={name} adds more parameters at rank 1 than the Markov head at "
            f"model.markov_rank={rank} ({budget:,}); raise model.markov_rank or set model.match_params=false"
        )
    low, high = 1, 4 * rank  # count grows with r: the largest r' in [low, high] within the budget
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if head_parameter_count(name, rank=middle, **dims) <= budget else (low, middle - 1)
    return low


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
