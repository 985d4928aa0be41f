"""EAGLE-3 baseline drafter: one autoregressive decoder layer trained with training-time test (METHOD §4).

    g_0    = fc([f_l1; …; f_lm])                        fc: m·d → d, no bias, no norm
    u      = [input_norm(E[token]) ; hidden_norm(g)]    2d wide; q, k and v all read u
    a      = g + o_proj(Attn(q(u), k(u), v(u)))         the residual stream is g
    h      = a + MLP(post_attention_norm(a))            the layer's output hidden (fed back as the next g)
    logits = lm_head(norm(h))                           the target's frozen LM head (rows of the draft vocabulary)

Training-time test (TTT), horizon γ = `block_size`, 0-based positions, sequence x_0..x_{T-1}. At step k
(k = 0..γ-1) position i has

    g input   step 0: fc(f_i);  step k ≥ 1: h of step k-1 at position i
    token     x_{i+1+k}  (teacher-forced, one more shift per step; a zero embedding past the end)
    RoPE      position i + k, for the step's queries and keys
    attends   step-0 keys j ≤ i (causal) and, for s = 1..k, the key of step s at position i (`create_ttt_mask`)
    predicts  x_{i+k+2}

so step k at position i depends on features f_{≤i} and tokens x_{≤i+1+k} only. At inference (`draft_chain`) the
last context position plays position i: every further draft step is one more TTT step at that position, which
sees the step-0 keys of the whole context plus one key per earlier draft — an ordinary growing KV list.

Shape symbols: B sequences, T length, γ block size (TTT horizon), d hidden size, m feature layers, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from dspark.drafters.layers import DraftLayerSpec, RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary, init_new_weights
from dspark.drafters.vocab import DraftVocabHead

KeyValue = tuple[Tensor, Tensor]  # (keys, values), each [B, KV heads, L, hd], RoPE already applied to the keys
SampleFn = Callable[[Tensor], tuple[Tensor, Tensor]]


def create_ttt_mask(seq_len: int, step: int) -> Tensor:
    """Attention mask of TTT step `step`: bool [T, (step+1)·T], True = may attend.

    Row i is the query at position i; column block s (keys of step s, s = 0..step) is causal for s = 0
    (key j ≤ i) and the diagonal for s ≥ 1 (key i only): a query sees the context causally but, of the later
    steps, only its own chain of earlier predictions (METHOD §4).
    """
    if seq_len < 1 or step < 0:
        raise ValueError(f"create_ttt_mask needs seq_len >= 1 and step >= 0, got seq_len={seq_len}, step={step}")
    idx = torch.arange(seq_len)
    causal = idx.unsqueeze(0) <= idx.unsqueeze(1)
    diagonal = torch.eye(seq_len, dtype=torch.bool)
    return torch.cat([causal] + [diagonal] * step, dim=1)


@dataclass
class Eagle3Output:
    """TTT outputs; element k of each list is step k (k = 0..γ-1), whose position i predicts x_{i+k+2}."""

    logits: list[Tensor]  # γ × [B, T, Vd]  lm_head(norm(h_k)) over the draft vocabulary (Vd = V without one)
    hidden: list[Tensor]  # γ × [B, T, d]  the layer's output h_k before the final norm (g of step k+1)


@dataclass
class Eagle3Draft:
    """A drafted chain: n ≤ num_tokens tokens (fewer when a stop id was drafted; it is kept, last)."""

    tokens: Tensor  # [1, n] long
    probs: Tensor  # [1, n, V]  the distribution each token was sampled from (as returned by sample_fn)


class Eagle3Attention(nn.Module):
    """GQA self-attention reading the 2d-wide input u, with keys/values of earlier TTT steps prepended."""

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
        width = 2 * spec.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, spec.hidden_size, bias=False)
        # Qwen3-style per-head norms; identity for Llama-like targets.
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else nn.Identity()

    def _heads(self, x: Tensor, proj: nn.Linear, num_heads: int, norm: nn.Module) -> Tensor:
        """[B, L, 2d] → [B, heads, L, hd], per-head norm applied."""
        return norm(proj(x).unflatten(-1, (num_heads, self.head_dim))).transpose(1, 2)

    def forward(
        self, u: Tensor, *, rope: tuple[Tensor, Tensor], past: list[KeyValue], mask: Tensor | None
    ) -> tuple[Tensor, KeyValue]:
        """u [B, L, 2d]; rope = (cos, sin) [1 or B, L, hd] for this call's positions; past = earlier steps'
        (keys, values) in mask-column order; mask bool [B or 1, 1, L, ΣL_past + L] or None (attend to all)
        → (output [B, L, d], this call's (keys, values) to append to `past`)."""
        cos, sin = rope
        q = apply_rotary(self._heads(u, self.q_proj, self.num_heads, self.q_norm), cos, sin)
        k = apply_rotary(self._heads(u, self.k_proj, self.num_kv_heads, self.k_norm), cos, sin)
        v = self._heads(u, self.v_proj, self.num_kv_heads, nn.Identity())
        keys = torch.cat([pk for pk, _ in past] + [k], dim=2)
        values = torch.cat([pv for _, pv in past] + [v], dim=2)
        groups = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, H, L, hd]
        return self.o_proj(out.transpose(1, 2).flatten(-2)), (k, v)


class Eagle3DecoderLayer(nn.Module):
    """The single EAGLE-3 layer: attention over [input_norm(embed) ; hidden_norm(g)], residual g, SwiGLU MLP."""

    def __init__(self, spec: DraftLayerSpec) -> None:
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Eagle3Attention(spec)
        self.post_attention_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size)

    def forward(
        self, g: Tensor, token_embeds: Tensor, *, rope: tuple[Tensor, Tensor], past: list[KeyValue], mask: Tensor | None
    ) -> tuple[Tensor, KeyValue]:
        """g, token_embeds [B, L, d] → (h [B, L, d] before the final norm, this call's (keys, values))."""
        u = torch.cat([self.input_norm(token_embeds), self.hidden_norm(g)], dim=-1)
        attn, kv = self.self_attn(u, rope=rope, past=past, mask=mask)
        hidden = g + attn
        return hidden + self.mlp(self.post_attention_norm(hidden)), kv


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter (METHOD §4). `forward` runs TTT for training; `draft_chain` drafts at inference.

    `embed_tokens` and `lm_head` are the target's modules: frozen here (requires_grad False) and kept out of
    `parameters()` and `state_dict()`; `.to()` on the drafter does not move them (they live with the target).
    New weights are N(0, 0.02), norms start at one.
    """

    def __init__(
        self,
        *,
        spec: DraftLayerSpec,
        num_feature_layers: int,
        block_size: int,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        draft_vocab_ids: Tensor | None = None,
    ) -> None:
        super().__init__()
        if num_feature_layers < 1:
            raise ValueError(
                f"num_feature_layers must be >= 1, got {num_feature_layers}; "
                "pass the number of target feature layers (m)"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (the TTT horizon γ), got {block_size}")
        d = spec.hidden_size
        self.spec = spec
        self.num_feature_layers = num_feature_layers
        self.block_size = block_size
        self.fc = nn.Linear(num_feature_layers * d, d, bias=False)
        self.layer = Eagle3DecoderLayer(spec)
        self.norm = RMSNorm(d, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta)
        init_new_weights(self)
        embed_tokens.requires_grad_(False)
        lm_head.requires_grad_(False)
        self._frozen = (embed_tokens, lm_head)  # a tuple: not a submodule, so not in parameters() or state_dict()
        # logits over the draft vocabulary (dspark.drafters.vocab): the frozen LM-head rows of its ids
        self.draft_head = DraftVocabHead(lm_head, vocab_size=spec.vocab_size, draft_vocab_ids=draft_vocab_ids)

    @property
    def embed_tokens(self) -> nn.Module:
        return self._frozen[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._frozen[1]

    @property
    def draft_vocab_size(self) -> int:
        """Vd, the width of every logits tensor (V without a draft vocabulary)."""
        return self.draft_head.size

    @property
    def draft_to_target(self) -> Tensor:
        """[Vd] long: the target id of each draft id."""
        return self.draft_head.draft_to_target

    def forward(
        self, *, features: Tensor, input_ids: Tensor, attention_mask: Tensor, logit_positions: Tensor | None = None
    ) -> Eagle3Output:
        """Training-time test over γ = block_size steps.

        features [B, T, m·d] raw target feature layers; input_ids [B, T] long; attention_mask [B, T] bool,
        right-padded (RoPE positions are 0..T-1). Padded keys are hidden from step 0 (each query still sees
        itself, so no softmax row is empty); under right padding they never reach a real position anyway.

        logit_positions [B, N] long (optional): run TTT only for these positions' chains. Step 0 still runs over
        all T positions (its keys are every later step's context), but a step k ≥ 1 query at position i sees
        only step-0 keys and its *own* chain's keys (`create_ttt_mask`), so steps ≥ 1 need only the N chains:
        the same numbers for a T + (γ−1)·N instead of γ·T token cost. Then every `logits[k]` is [B, N, V],
        `hidden[0]` is [B, T, d] and `hidden[k ≥ 1]` is [B, N, d].
        """
        self._check_features(features, input_ids)
        batch, seq_len = input_ids.shape
        g = self.fc(features.to(self.fc.weight.dtype))
        embeds = self.embed_tokens(input_ids).to(g.dtype)
        positions = torch.arange(seq_len, device=input_ids.device)
        if logit_positions is not None:
            return self._sampled_ttt(g, embeds, attention_mask.bool(), logit_positions)
        past: list[KeyValue] = []
        logits, hidden = [], []
        for step in range(self.block_size):
            cos, sin = self.rotary(positions + step)
            mask = self._step_mask(attention_mask.bool(), step=step)
            g, kv = self.layer(g, _shift_left(embeds, step + 1), rope=(cos[None], sin[None]), past=past, mask=mask)
            past.append(kv)
            hidden.append(g)
            logits.append(self.draft_head(self.norm(g)))
        return Eagle3Output(logits=logits, hidden=hidden)

    def _sampled_ttt(self, g: Tensor, embeds: Tensor, key_valid: Tensor, chains: Tensor) -> Eagle3Output:
        """TTT for the chains at positions `chains` [B, N] (see `forward`)."""
        seq_len = g.shape[1]
        positions = torch.arange(seq_len, device=g.device)
        cos, sin = self.rotary(positions)
        g, kv = self.layer(
            g, _shift_left(embeds, 1), rope=(cos[None], sin[None]), past=[], mask=self._step_mask(key_valid, step=0)
        )
        hidden, past = [g], [kv]
        g = _gather_rows(g, chains)
        logits = [self.draft_head(self.norm(g))]
        # Query n sees step-0 keys j ≤ chains[n] (real ones, plus its own position as in `_step_mask`) and, of
        # later steps, only its own chain's keys.
        keys = positions.view(1, 1, -1)
        causal = ((keys <= chains.unsqueeze(-1)) & key_valid.unsqueeze(1)) | (keys == chains.unsqueeze(-1))
        own = torch.eye(chains.shape[1], dtype=torch.bool, device=g.device).expand(chains.shape[0], -1, -1)
        for step in range(1, self.block_size):
            cos, sin = self.rotary(chains + step)  # [B, N, hd]
            token_index = chains + 1 + step
            tokens = _gather_rows(embeds, token_index.clamp(max=seq_len - 1))
            tokens = torch.where((token_index < seq_len).unsqueeze(-1), tokens, 0.0)  # zero embedding past the end
            mask = torch.cat([causal] + [own] * step, dim=-1).unsqueeze(1)  # [B, 1, N, T + step·N]
            g, kv = self.layer(g, tokens, rope=(cos, sin), past=past, mask=mask)
            past.append(kv)
            hidden.append(g)
            logits.append(self.draft_head(self.norm(g)))
        return Eagle3Output(logits=logits, hidden=hidden)

    @torch.no_grad()
    def draft_chain(
        self,
        *,
        context_features: Tensor,
        context_ids: Tensor,
        num_tokens: int,
        sample_fn: SampleFn,
        stop_ids: Collection[int] = (),
    ) -> Eagle3Draft:
        """Draft up to `num_tokens` tokens autoregressively after the anchor (METHOD §4, "at evaluation").

        context_features [1, S, m·d]: target features of positions 0..S-1 (everything before the anchor);
        context_ids [1, S+1]: the committed tokens x_0..x_S, the anchor x_S last. Step 0 runs the layer over
        positions 0..S-1 with tokens x_1..x_S (the training shift) and position S-1 predicts the first draft;
        draft k ≥ 1 is TTT step k at position S-1: g = that position's previous output h, token = draft k-1,
        RoPE position S-1+k, keys = the step-0 keys of all S positions plus one key per earlier step.
        `sample_fn(logits [1, V]) -> (token [1] long, probs [1, V])` owns temperature and sampling; drafting
        stops after a token in `stop_ids` (kept as the last draft).

        Cost: this runs step 0 over the whole prefix, O(S·d² + S²·d); a decoding loop keeps the step-0 keys and
        values instead (`extend_context`, then `draft_from`), as `Eagle3Proposer` does.
        """
        self._check_chain_inputs(context_features, context_ids, num_tokens)
        context, last = self.extend_context(None, features=context_features, next_ids=context_ids[:, 1:])
        return self.draft_from(context, last, num_tokens=num_tokens, sample_fn=sample_fn, stop_ids=stop_ids)

    @torch.no_grad()
    def extend_context(
        self, context: KeyValue | None, *, features: Tensor, next_ids: Tensor
    ) -> tuple[KeyValue, Tensor]:
        """Step 0 over n more positions after the L already in `context`.

        context: step-0 (keys, values) of positions 0..L-1, each [1, KV heads, L, hd] (None: L = 0);
        features [1, n, m·d] of positions L..L+n-1; next_ids [1, n] long, the token after each of them
        (x_{i+1} at position i, the training shift) → (step-0 keys/values of positions 0..L+n-1, the last
        position's output h [1, 1, d]). Step 0 is causal, so positions already cached never change: extending
        by pieces gives the keys, values and last output of one pass over the whole prefix.
        """
        past = [] if context is None else [context]
        cached = 0 if context is None else context[0].shape[2]
        count = features.shape[1]
        if count < 1 or tuple(next_ids.shape) != (1, count) or features.shape[0] != 1:
            raise ValueError(
                f"extend_context: features must be [1, n >= 1, m·d] and next_ids [1, n], got "
                f"{tuple(features.shape)} and {tuple(next_ids.shape)}"
            )
        self._check_features(features, next_ids)
        g = self.fc(features.to(self.fc.weight.dtype))
        embeds = self.embed_tokens(next_ids).to(g.dtype)
        cos, sin = self.rotary(torch.arange(cached, cached + count, device=next_ids.device))
        # new position i sees every cached key and the new keys up to itself; one query sees everything
        mask = (
            None
            if count == 1
            else torch.cat([torch.ones(count, cached, dtype=torch.bool), create_ttt_mask(count, 0)], dim=1).to(
                next_ids.device
            )[None, None]
        )
        hidden, (keys, values) = self.layer(g, embeds, rope=(cos[None], sin[None]), past=past, mask=mask)
        if context is not None:
            keys, values = torch.cat([context[0], keys], dim=2), torch.cat([context[1], values], dim=2)
        return (keys, values), hidden[:, -1:]

    @torch.no_grad()
    def draft_from(
        self,
        context: KeyValue,
        last_hidden: Tensor,
        *,
        num_tokens: int,
        sample_fn: SampleFn,
        stop_ids: Collection[int] = (),
    ) -> Eagle3Draft:
        """The chain after step 0 (`draft_chain` has the contract): context = step-0 keys/values of positions
        0..S-1 (`extend_context`), last_hidden [1, 1, d] = position S-1's step-0 output."""
        if num_tokens < 1:
            raise ValueError(f"draft_from needs num_tokens >= 1 (block_size), got {num_tokens}")
        seq_len = context[0].shape[2]
        hidden, past = last_hidden, [context]
        stops = {int(s) for s in stop_ids}
        tokens, probs = [], []
        for step in range(num_tokens):
            if step > 0:
                hidden, kv = self._chain_step(hidden, tokens[-1], position=seq_len - 1 + step, past=past)
                past.append(kv)
            token, prob = sample_fn(self.draft_head(self.norm(hidden))[:, -1])  # over the draft vocabulary
            # the chain feeds back and returns target ids; p_d goes back over the full V (0 outside Vd)
            tokens.append(self.draft_head.to_target_ids(token.reshape(1)))
            probs.append(self.draft_head.expand(prob.reshape(1, -1)))
            if int(tokens[-1].reshape(-1)[0]) in stops:  # the target id, not the draft id
                break
        return Eagle3Draft(tokens=torch.stack(tokens, dim=1), probs=torch.stack(probs, dim=1))

    def _chain_step(
        self, hidden: Tensor, token: Tensor, *, position: int, past: list[KeyValue]
    ) -> tuple[Tensor, KeyValue]:
        """One further TTT step at the last context position: hidden [1, 1, d], token [1] → (h, keys/values)."""
        cos, sin = self.rotary(torch.tensor([position], device=token.device))
        embeds = self.embed_tokens(token.view(1, 1)).to(hidden.dtype)
        # The only query is the last position: every step-0 key is causal for it and each later key is its own.
        return self.layer(hidden, embeds, rope=(cos[None], sin[None]), past=past, mask=None)

    def _step_mask(self, key_valid: Tensor, *, step: int) -> Tensor:
        """create_ttt_mask with padded step-0 keys hidden (the diagonal kept): [B, 1, T, (step+1)·T]."""
        batch, seq_len = key_valid.shape
        device = key_valid.device
        ttt = create_ttt_mask(seq_len, step).to(device)
        later = torch.ones(batch, step * seq_len, dtype=torch.bool, device=device)
        keys_ok = torch.cat([key_valid, later], dim=1).unsqueeze(1)  # [B, 1, (step+1)·T]
        diagonal = torch.eye(seq_len, dtype=torch.bool, device=device)
        diagonal = torch.cat([diagonal, torch.zeros(seq_len, step * seq_len, dtype=torch.bool, device=device)], 1)
        return ((ttt & keys_ok) | diagonal).unsqueeze(1)

    def _check_features(self, features: Tensor, input_ids: Tensor) -> None:
        width = self.num_feature_layers * self.spec.hidden_size
        if features.dim() != 3 or features.shape[-1] != width:
            raise ValueError(
                f"EAGLE-3 features have shape {tuple(features.shape)} but need [B, T, {width}] "
                f"(num_feature_layers={self.num_feature_layers} × hidden_size={self.spec.hidden_size}); "
                "set num_feature_layers to the number of target feature layers"
            )
        if features.shape[:2] != input_ids.shape[:2]:
            raise ValueError(
                f"features {tuple(features.shape[:2])} and token ids {tuple(input_ids.shape[:2])} "
                "must share [B, T]: pass one feature vector per token"
            )

    def _check_chain_inputs(self, context_features: Tensor, context_ids: Tensor, num_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"draft_chain needs num_tokens >= 1 (block_size), got {num_tokens}")
        shape_ok = context_features.dim() == 3 and context_ids.dim() == 2
        if (
            not shape_ok
            or context_features.shape[0] != 1
            or context_ids.shape[0] != 1
            or context_features.shape[1] < 1
            or context_ids.shape[1] != context_features.shape[1] + 1
        ):
            raise ValueError(
                "draft_chain drafts one sequence: context_features must be [1, S, m·d] with S >= 1 "
                f"and context_ids [1, S+1] (anchor last), got {tuple(context_features.shape)} and "
                f"{tuple(context_ids.shape)}"
            )
        self._check_features(context_features, context_ids[:, 1:])


def _shift_left(x: Tensor, shift: int) -> Tensor:
    """[B, T, d] → y with y[:, i] = x[:, i+shift], zeros where i+shift ≥ T (those positions are unsupervised)."""
    seq_len = x.shape[1]
    if shift >= seq_len:
        return torch.zeros_like(x)
    return F.pad(x[:, shift:], (0, 0, 0, shift))


def _gather_rows(x: Tensor, positions: Tensor) -> Tensor:
    """x [B, T, d], positions [B, N] long → [B, N, d]."""
    return x.gather(1, positions.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
