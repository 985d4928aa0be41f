"""Parallel DSpark/DFlash backbone: fused target context + KV-injected draft layers (METHOD §2.1).

    H_ctx = RMSNorm(W_c [H_l1; …; H_lm])                       one context vector per target token
    layer ℓ:  q = W_Q^ℓ norm(h)              (block tokens only)
              k = [W_K^ℓ H_ctx ; W_K^ℓ norm(h)],  v = [W_V^ℓ H_ctx ; W_V^ℓ norm(h)]
    h_k = RMSNorm(h after `depth` layers)                        the final-norm backbone output

The context is never run through the layers or their input norms: each layer only projects it to keys and
values (k-norm and RoPE at the context's absolute positions 0..T-1). With `block_conv` (the selector_conv head's
parallel half) each sublayer is wrapped in a two-tap dynamic convolution along the block's slots
(`dspark.drafters.block_conv`); it reads the block stream only and never crosses a block boundary. A block with anchor `a` has RoPE positions
`a+0..a+γ-1`; a block token attends to its whole block (bidirectional) and to valid context positions `j < a`,
never to another block, so all N blocks of a sequence run in one attention call.

Shape symbols: B sequences, T context length, N blocks per sequence, γ block size, d hidden size, m feature layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dspark.drafters.block_conv import BlockConv
from dspark.drafters.layers import (
    DraftLayerSpec,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rotary,
    init_new_weights,
    linear_from,
)

# (block keys, block values) [B, H_kv, L, hd] → keys/values to attend [B, H_kv, T+L, hd] (cached context first)
ExtendKV = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def create_block_mask(*, anchor_positions: Tensor, context_valid: Tensor, block_size: int) -> Tensor:
    """Boolean attention mask (True = attend) for N blocks over [context ; blocks] keys.

    anchor_positions [B, N] long, context_valid [B, T] bool → [B, 1, N·γ, T + N·γ]. Query (n, i) sees context key
    j iff `j < anchor_positions[b, n]` and `context_valid[b, j]`, and block key (n', i') iff `n' == n`. Every row
    sees at least its own block, so no row is fully masked (no NaN from the softmax).
    """
    batch, num_blocks = anchor_positions.shape
    ctx_len = context_valid.shape[1]
    device = anchor_positions.device
    before_anchor = torch.arange(ctx_len, device=device) < anchor_positions.unsqueeze(-1)  # [B, N, T]
    ctx_mask = (before_anchor & context_valid.unsqueeze(1)).repeat_interleave(block_size, dim=1)  # [B, Nγ, T]
    block_id = torch.arange(num_blocks, device=device).repeat_interleave(block_size)  # [Nγ]
    same_block = (block_id.unsqueeze(1) == block_id.unsqueeze(0)).expand(batch, -1, -1)  # [B, Nγ, Nγ]
    return torch.cat([ctx_mask, same_block], dim=-1).unsqueeze(1)


@dataclass
class BlockMask:
    """The structure of `create_block_mask` without its dense [Nγ, T + Nγ] form (training with many blocks).

    context_mask [B, N, T] bool: block n sees context key j iff `j < anchor_n` and `context_valid[j]`; every
    block sees its own γ keys (bidirectional) and never another block's. Dense, the block-to-block part is
    N²γ² entries of which only Nγ² are True: with N = 96 blocks that is 99% wasted work.
    """

    context_mask: Tensor
    block_size: int


def block_structured_attention(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask) -> Tensor:
    """Attention of N blocks over [context ; own block]: q [B, H, Nγ, hd], k/v [B, H, T + Nγ, hd] → [B, H, Nγ, hd].

    The same numbers as SDPA with the dense `create_block_mask` (tested), from two score matrices: queries ×
    context keys [Nγ, T] and, per block, γ × γ — one softmax over their concatenation. The scores stay in the
    matmul's dtype (bf16 under autocast, which is what the products return anyway) until the softmax, which
    computes in fp32: masking and concatenating at half the width, with no separate fp32 copy, made the step's
    attention ~20% cheaper on the CPU with bit-identical outputs and gradients (q·2^-3 is exact for hd = 64).
    """
    batch, heads, length, head_dim = q.shape
    gamma = mask.block_size
    blocks = length // gamma
    ctx_len = k.shape[2] - length
    k_ctx, k_blk = k[:, :, :ctx_len], k[:, :, ctx_len:]
    v_ctx, v_blk = v[:, :, :ctx_len], v[:, :, ctx_len:]
    q = q * head_dim**-0.5
    s_ctx = q @ k_ctx.transpose(-1, -2)  # [B, H, Nγ, T]
    q_b, k_b = q.view(batch, heads, blocks, gamma, head_dim), k_blk.view(batch, heads, blocks, gamma, head_dim)
    s_blk = q_b @ k_b.transpose(-1, -2)  # [B, H, N, γ, γ]
    scores = torch.cat([s_ctx, s_blk.view(batch, heads, length, gamma)], dim=-1)  # [B, H, Nγ, T + γ]
    hidden = torch.cat([~mask.context_mask, mask.context_mask.new_zeros(batch, blocks, gamma)], dim=-1)
    scores = scores.masked_fill(hidden.repeat_interleave(gamma, dim=1).unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    p_ctx, p_blk = probs[..., :ctx_len], probs[..., ctx_len:]
    out_blk = p_blk.reshape(batch, heads, blocks, gamma, gamma) @ v_blk.view(batch, heads, blocks, gamma, head_dim)
    return p_ctx @ v_ctx + out_blk.view(batch, heads, length, head_dim)


def block_mask(*, anchor_positions: Tensor, context_valid: Tensor, block_size: int) -> Tensor | BlockMask:
    """The dense mask for one block per sequence (decoding, cheap), the structured one for several (training)."""
    if anchor_positions.shape[1] == 1:
        return create_block_mask(anchor_positions=anchor_positions, context_valid=context_valid, block_size=block_size)
    before_anchor = torch.arange(context_valid.shape[1], device=anchor_positions.device) < anchor_positions.unsqueeze(
        -1
    )
    return BlockMask(context_mask=before_anchor & context_valid.unsqueeze(1), block_size=block_size)


class KVInjectionAttention(nn.Module):
    """GQA attention whose queries are the block tokens and whose keys/values are [context ; block]."""

    def __init__(self, spec: DraftLayerSpec) -> None:
        super().__init__()
        if spec.num_attention_heads % spec.num_key_value_heads:
            raise ValueError(
                "target: num_attention_heads must be a multiple of num_key_value_heads for grouped-query attention"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
        )
        d = spec.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        # Qwen3-style per-head norms; absent (identity) for Llama-like targets.
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else nn.Identity()
        # decode-only copies (`fuse_projections`): [W_Q; W_K; W_V] and [W_K; W_V] as one product each
        self.qkv_proj: nn.Linear | None = None
        self.kv_proj: nn.Linear | None = None

    def _heads(self, x: Tensor, proj: nn.Linear, num_heads: int, norm: nn.Module | None = None) -> Tensor:
        """[B, L, d] → per-head projection [B, H, L, hd], then the per-head norm if given."""
        return self._split_heads(proj(x), num_heads, norm)

    def forward(
        self, block: Tensor, context: Tensor, *, rope: tuple[Tensor, Tensor], mask: Tensor | BlockMask
    ) -> Tensor:
        """block [B, L, d] (already input-normed), context [B, T, d] (H_ctx), rope = (cos, sin) [B, T+L, hd] for
        the keys (the last L rows are the queries'), mask [B, 1, L, T+L] bool or a `BlockMask` → [B, L, d]."""
        cos, sin = rope
        length = block.shape[1]
        kv_input = torch.cat([context, block], dim=1)  # one projection for context and block keys/values
        q = self._heads(block, self.q_proj, self.num_heads, self.q_norm)
        k = self._heads(kv_input, self.k_proj, self.num_kv_heads, self.k_norm)
        v = self._heads(kv_input, self.v_proj, self.num_kv_heads)
        q = apply_rotary(q, cos[:, -length:], sin[:, -length:])
        k = apply_rotary(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if isinstance(mask, BlockMask):
            out = block_structured_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, L, hd]
        return self.o_proj(out.transpose(1, 2).flatten(-2))

    # ---- cached decoding (dspark.decoding.proposers, dspark.serving.proposer) ----

    def fuse_projections(self) -> None:
        """Replace q/k/v by one [W_Q; W_K; W_V] product for block rows and one [W_K; W_V] product for context rows
        (decode-time copies only: `dspark.decoding.drafting.ParallelStage`). Each output row of a product
        depends on its own weight row only, so the outputs are the separate products' (bit-identical in int8,
        whose activation scale is per call and the input is shared; fp32/bf16 up to the kernel's blocking);
        two and one fewer calls per layer in every round. The separate projections are dropped: a fused
        copy runs `forward_cached` and `context_kv` only."""
        q, k, v = self.q_proj.weight, self.k_proj.weight, self.v_proj.weight
        self.qkv_proj = linear_from(torch.cat([q, k, v]))
        self.kv_proj = linear_from(torch.cat([k, v]))
        self.q_proj = self.k_proj = self.v_proj = None

    def _split_heads(self, x: Tensor, num_heads: int, norm: nn.Module | None = None) -> Tensor:
        """[B, L, H·hd] (a projection, or a slice of a fused one) → [B, H, L, hd], then the per-head norm if given."""
        x = x.unflatten(-1, (num_heads, self.head_dim))
        return (x if norm is None else norm(x)).transpose(1, 2)

    def context_kv(self, context: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Keys (k-norm, RoPE) and values of fused context rows: context [B, T, d] (H_ctx), rope (cos, sin)
        [B, T, hd] at their absolute positions → ([B, H_kv, T, hd], [B, H_kv, T, hd]). Each row depends on its
        own position only, so a decoder computes it once per committed position and caches it."""
        cos, sin = rope
        if self.kv_proj is not None:
            k, v = self.kv_proj(context).chunk(2, dim=-1)
            return (
                apply_rotary(self._split_heads(k, self.num_kv_heads, self.k_norm), cos, sin),
                self._split_heads(v, self.num_kv_heads),
            )
        return (
            apply_rotary(self._heads(context, self.k_proj, self.num_kv_heads, self.k_norm), cos, sin),
            self._heads(context, self.v_proj, self.num_kv_heads),
        )

    def forward_cached(
        self, block: Tensor, *, rope: tuple[Tensor, Tensor], extend_kv: ExtendKV, mask: Tensor | None = None
    ) -> Tensor:
        """`forward` over cached context keys/values: block [B, L, d] (already input-normed), rope (cos, sin)
        [B, L, hd] of the block positions; `extend_kv(k, v)` receives the block's keys/values [B, H_kv, L, hd]
        and returns the keys/values to attend, [cached context ; block] ([B, H_kv, T+L, hd]; how they are
        stored is the caller's choice); mask [B, 1, L, T+L] bool or None (attend to all) → [B, L, d]."""
        cos, sin = rope
        if self.qkv_proj is not None:
            kv_width = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(block).split([self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)
            q = apply_rotary(self._split_heads(q, self.num_heads, self.q_norm), cos, sin)
            k = apply_rotary(self._split_heads(k, self.num_kv_heads, self.k_norm), cos, sin)
            keys, values = extend_kv(k, self._split_heads(v, self.num_kv_heads))
        else:
            q = apply_rotary(self._heads(block, self.q_proj, self.num_heads, self.q_norm), cos, sin)
            keys, values = extend_kv(*self.context_kv(block, rope))
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class DraftDecoderLayer(nn.Module):
    """Pre-norm decoder layer of the target's family with KV injection; the context skips its norms.

    `block_conv` wraps both sublayers in a two-tap dynamic convolution along the block's slots
    (`dspark.drafters.block_conv`, the parallel half of `model.head=selector_conv`); off, the layer is exactly a
    decoder layer of the target's family (`model.init_layers` copies it)."""

    def __init__(self, spec: DraftLayerSpec, *, block_conv: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = KVInjectionAttention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size)
        self.attn_conv = BlockConv(spec.hidden_size) if block_conv else None
        self.mlp_conv = BlockConv(spec.hidden_size) if block_conv else None

    def forward(
        self,
        hidden: Tensor,
        context: Tensor,
        *,
        rope: tuple[Tensor, Tensor],
        mask: Tensor,
        block_size: int | None = None,
    ) -> Tensor:
        """hidden [B, L, d] block stream (blocks of `block_size` slots; None: one block), context [B, T, d] → new
        block stream [B, L, d]."""
        attend = partial(self.self_attn, context=context, rope=rope, mask=mask)
        hidden = hidden + self._sublayer(self.attn_conv, attend, self.input_layernorm(hidden), block_size)
        return hidden + self._sublayer(self.mlp_conv, self.mlp, self.post_attention_layernorm(hidden), block_size)

    @staticmethod
    def _sublayer(conv: BlockConv | None, sublayer, x: Tensor, block_size: int | None) -> Tensor:
        """sublayer(x), wrapped in the block convolution when the layer has one."""
        return sublayer(x) if conv is None else conv.wrap(sublayer, x, block_size=block_size)

    def fuse_projections(self) -> None:
        """Decode-time copies: fused q/k/v, k/v and gate/up products (`KVInjectionAttention.fuse_projections`,
        `SwiGLU.fuse_projections`)."""
        self.self_attn.fuse_projections()
        self.mlp.fuse_projections()

    def context_kv(self, context: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """This layer's cacheable keys/values of fused context rows (`KVInjectionAttention.context_kv`)."""
        return self.self_attn.context_kv(context, rope)

    def forward_cached(
        self, hidden: Tensor, *, rope: tuple[Tensor, Tensor], extend_kv: ExtendKV, mask: Tensor | None = None
    ) -> Tensor:
        """`forward` for a block over cached context keys/values (`KVInjectionAttention.forward_cached`):
        hidden [B, L, d] block stream (one block per row) → [B, L, d]; equal to `forward` with the context the cache
        was built from."""
        attend = partial(self.self_attn.forward_cached, rope=rope, extend_kv=extend_kv, mask=mask)
        hidden = hidden + self._sublayer(self.attn_conv, attend, self.input_layernorm(hidden), None)
        return hidden + self._sublayer(self.mlp_conv, self.mlp, self.post_attention_layernorm(hidden), None)


class DSparkBackbone(nn.Module):
    """Fusion + `depth` KV-injected draft layers + final norm; returns h_k for every slot of every block.

    `embed_tokens` is the target's frozen embedding, kept out of `parameters()` and `state_dict()`; the MASK id
    uses the trained `mask_embedding` instead. Callable on one block with a precomputed context (decoding):
    `backbone(features [1, S, m·d], block_input_ids=[1, 1, γ], anchor_positions=[[S]])`.
    """

    def __init__(
        self,
        *,
        spec: DraftLayerSpec,
        num_feature_layers: int,
        depth: int,
        embed_tokens: nn.Module,
        mask_token_id: int,
        block_conv: bool = False,
    ) -> None:
        super().__init__()
        d = spec.hidden_size
        self.spec = spec
        self.mask_token_id = mask_token_id
        self._frozen = (embed_tokens,)  # a tuple: not a submodule, so not in parameters() or state_dict()
        self.fc = nn.Linear(num_feature_layers * d, d, bias=False)
        self.context_norm = RMSNorm(d, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DraftDecoderLayer(spec, block_conv=block_conv) for _ in range(depth))
        self.norm = RMSNorm(d, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta)
        self.mask_embedding = nn.Parameter(torch.empty(d))
        init_new_weights(self)
        nn.init.normal_(self.mask_embedding, mean=0.0, std=0.02)
        for module in self.modules():  # init_new_weights drew the block convolutions' projections: back to identity
            if isinstance(module, BlockConv):
                module.reset_parameters()

    @property
    def embed_tokens(self) -> nn.Module:
        return self._frozen[0]

    def fuse_context(self, context_features: Tensor) -> Tensor:
        """[B, T, m·d] raw target features → H_ctx [B, T, d]. Per token, so it can be cached incrementally."""
        # the norm's dtype is the stage's activation dtype (fc's weight is packed int8 in a quantised copy)
        return self.context_norm(self.fc(context_features.to(self.context_norm.weight.dtype)))

    def embed_block(self, block_input_ids: Tensor) -> Tensor:
        """[B, N, γ] ids → [B, N, γ, d]: target embedding, except the MASK id → `mask_embedding`."""
        emb = self.embed_tokens(block_input_ids).to(self.mask_embedding.dtype)
        is_mask = (block_input_ids == self.mask_token_id).unsqueeze(-1)
        return torch.where(is_mask, self.mask_embedding, emb)

    def forward(
        self,
        context_features: Tensor,
        *,
        block_input_ids: Tensor,
        anchor_positions: Tensor,
        context_valid: Tensor | None = None,
    ) -> Tensor:
        """context_features [B, T, m·d], block_input_ids [B, N, γ], anchor_positions [B, N] (position of x_0),
        context_valid [B, T] bool (default all True) → h [B, N, γ, d] (final-norm)."""
        return self.attend(
            self.fuse_context(context_features),
            block_input_ids=block_input_ids,
            anchor_positions=anchor_positions,
            context_valid=context_valid,
        )

    def attend(
        self,
        context_hidden: Tensor,
        *,
        block_input_ids: Tensor,
        anchor_positions: Tensor,
        context_valid: Tensor | None = None,
    ) -> Tensor:
        """Like `forward`, from an already fused context H_ctx [B, T, d] (lets a decoder cache the fusion)."""
        batch, num_blocks, block_size = block_input_ids.shape
        ctx_len = context_hidden.shape[1]
        if context_valid is None:
            context_valid = torch.ones(batch, ctx_len, dtype=torch.bool, device=context_hidden.device)
        mask = block_mask(anchor_positions=anchor_positions, context_valid=context_valid, block_size=block_size)
        rope = self._rope(anchor_positions, ctx_len=ctx_len, block_size=block_size)
        hidden = self.embed_block(block_input_ids).flatten(1, 2)  # [B, Nγ, d]
        for layer in self.layers:
            hidden = layer(hidden, context_hidden, rope=rope, mask=mask, block_size=block_size)
        return self.norm(hidden).view(batch, num_blocks, block_size, -1)

    def _rope(self, anchor_positions: Tensor, *, ctx_len: int, block_size: int) -> tuple[Tensor, Tensor]:
        """cos/sin [B, T + N·γ, hd] for keys: context at 0..T-1, block n at anchor_n + 0..γ-1."""
        device = anchor_positions.device
        ctx_pos = torch.arange(ctx_len, device=device).expand(anchor_positions.shape[0], -1)
        block_pos = (anchor_positions.unsqueeze(-1) + torch.arange(block_size, device=device)).flatten(1)
        return self.rotary(torch.cat([ctx_pos, block_pos], dim=1))
