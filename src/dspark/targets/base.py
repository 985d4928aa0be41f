"""The frozen target LLM `M_t`: one wrapper over any transformers causal LM (METHOD §1, §2.1).

Drafters read three things from the target: the raw outputs of `m` decoder layers (the context features
`[H_l1; …; H_lm]` of METHOD §2.1), the final-norm hidden state (whose LM-head image is the target distribution
`p_t`), and its embedding table and LM head (shared, frozen). The feature layers are captured with forward
hooks on the decoder layers, so any id `0..L-1` works; the last entry of HF `hidden_states` is post-norm and is
never used as a feature (METHOD §10).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from dspark.drafters.layers import DraftLayerSpec
from dspark.targets.attention import use_grouped_sdpa
from dspark.targets.layout import choose_few_row_layout

FEATURE_LAYERS_KEY = "model.feature_layers"


def default_feature_layer_ids(num_layers: int, m: int = 5) -> list[int]:
    """METHOD §2.1 default ids `round(1 + i*(L-4)/(m-1))`, `i = 0..m-1`, Python round (half to even).

    36 layers → [1, 9, 17, 25, 33]; 30 layers → [1, 8, 14, 20, 27]. Raises when the formula cannot give `m`
    distinct valid layers (tiny models), asking for explicit ids.
    """
    if m < 1:
        raise ValueError(f"{FEATURE_LAYERS_KEY}: need at least one feature layer, got m={m}")
    step = (num_layers - 4) / (m - 1) if m > 1 else 0.0
    ids = [round(1 + i * step) for i in range(m)]
    if len(set(ids)) != m or min(ids) < 0 or max(ids) > num_layers - 1:
        raise ValueError(
            f"{FEATURE_LAYERS_KEY}: the default formula gives {ids} for {num_layers} layers and m={m}, which is "
            f"not {m} distinct ids in [0, {num_layers - 1}]; set {FEATURE_LAYERS_KEY} explicitly"
        )
    return ids


def resolve_feature_layer_ids(feature_layers: list[int] | None, *, num_layers: int, num_default: int = 5) -> list[int]:
    """Validate explicit ids (any order, no duplicates, each in [0, L-1]) and sort them; None → the default of
    `num_default` (m) layers."""
    if feature_layers is None:
        return default_feature_layer_ids(num_layers, num_default)
    ids = [int(i) for i in feature_layers]
    bad = [i for i in ids if not 0 <= i <= num_layers - 1]
    if not ids or bad or len(set(ids)) != len(ids):
        problem = "is empty" if not ids else (f"has ids out of range {bad}" if bad else "has duplicate ids")
        raise ValueError(
            f"{FEATURE_LAYERS_KEY}={list(feature_layers)} {problem}: give distinct decoder-layer ids in the "
            f"valid range [0, {num_layers - 1}] (this target has {num_layers} layers){_default_hint(num_layers)}"
        )
    return sorted(ids)


def _default_hint(num_layers: int) -> str:
    try:
        return f", or omit it for the default {default_feature_layer_ids(num_layers)}"
    except ValueError:
        return ""


@dataclass
class TargetForward:
    """One target forward. B batch, T tokens in this call, m feature layers, d hidden size, V vocabulary."""

    features: Tensor  # [B, T, m*d] raw outputs of the feature layers, concatenated in layer-id order
    final_hidden: Tensor  # [B, T, d] final-norm hidden state (lm_head(final_hidden) == logits)
    logits: Tensor | None  # [B, T, V] only when return_logits=True
    cache: Any | None  # the DynamicCache after this forward (when use_cache=True or a cache was given)


class Target:
    """A frozen causal LM plus what the drafters and the data pipeline need from it.

    Attributes: `name`, `model` (eval, requires_grad False), `tokenizer`, `hf_config`, `num_layers`,
    `hidden_size`, `vocab_size`, `feature_layer_ids` (sorted), `mask_token_id` (reserved MASK row, never in
    data), `stop_token_ids`, `embed_tokens` / `lm_head` (frozen, shared with drafters), `layer_spec`,
    `fingerprint` (cache key: the weights as loaded, dtype included), `checkpoint_fingerprint` (the checkpoint's
    identity whatever dtype it was loaded in: the fp32 load's fingerprint; drafters record it, so a drafter trained
    against the fp32 target also serves a bf16 load of the same files), `default_system_prompt` (True when the chat template inserts its own system turn
    if none is given, as SmolLM2's does; `chat_prompt_ids` keeps that behaviour), `few_row_layout` (`linear`, or
    `transposed` where this machine computes few-token products faster as (W xᵀ)ᵀ: `layout.choose_few_row_layout`),
    `row_padding` ({n: m} where, in that layout, n-token products run as m rows, the extra ones zero; empty if none);
    both measured once per machine and kept in `few_row_decision` when given (`layout.few_row_decision_path`);
    `attention`, the attention implementation the model runs (`dspark.targets.attention.GROUPED_SDPA` where
    transformers' `sdpa` would copy the KV cache for every multi-token forward, else transformers' own).
    """

    def __init__(
        self,
        *,
        name: str,
        model: nn.Module,
        tokenizer: Any,
        feature_layer_ids: list[int],
        mask_token_id: int,
        stop_token_ids: list[int],
        fingerprint: str,
        checkpoint_fingerprint: str | None = None,
        few_row_decision: Path | None = None,
    ) -> None:
        model.eval()
        model.requires_grad_(False)
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.hf_config = model.config
        self._decoder = model.get_decoder()
        self.num_layers = len(self._decoder.layers)
        self.hidden_size = int(self.hf_config.hidden_size)
        self.feature_layer_ids = resolve_feature_layer_ids(feature_layer_ids, num_layers=self.num_layers)
        self.mask_token_id = int(mask_token_id)
        self.stop_token_ids = list(stop_token_ids)
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.layer_spec = DraftLayerSpec.from_hf_config(self.hf_config)
        self.fingerprint = fingerprint
        self.checkpoint_fingerprint = checkpoint_fingerprint or fingerprint
        self.default_system_prompt = _template_adds_system_turn(tokenizer)
        self.few_row_layout, self.row_padding = choose_few_row_layout(model, self.lm_head.weight, few_row_decision)
        # multi-token forwards (verify, padded batches) attend with grouped-query SDPA, no copy of the KV cache
        self.attention = use_grouped_sdpa(model)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def decoder_layer(self, layer_id: int) -> nn.Module:
        """The frozen decoder layer `layer_id` (negative ids count from the end), e.g. to initialise a draft layer
        from (`dspark.drafters.init.copy_target_layers`)."""
        if not -self.num_layers <= layer_id < self.num_layers:
            raise ValueError(
                f"target layer {layer_id} does not exist: the target has {self.num_layers} decoder layers "
                f"(ids 0..{self.num_layers - 1}, or -1..-{self.num_layers} from the end)"
            )
        return self._decoder.layers[layer_id]

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: Any | None = None,
        use_cache: bool = False,
        return_logits: bool = False,
    ) -> TargetForward:
        """Run the target on `input_ids` [B, T] (appending to `cache` when given; it is updated in place).

        attention_mask: [B, T_past + T] 1 = real token (HF convention); position_ids: [B, T] RoPE positions
        (default: continue after the cache). Features are captured by hooks, so no `hidden_states` tuple and,
        unless asked, no [B, T, V] logits are built.
        """
        captured: dict[int, Tensor] = {}
        handles = [
            self._decoder.layers[i].register_forward_hook(_capture_into(captured, i)) for i in self.feature_layer_ids
        ]
        use_cache = use_cache or cache is not None
        try:
            out = self._decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
            )
        finally:
            for handle in handles:
                handle.remove()
        final_hidden = out.last_hidden_state
        return TargetForward(
            features=torch.cat([captured[i] for i in self.feature_layer_ids], dim=-1),
            final_hidden=final_hidden,
            logits=self.logits_from_hidden(final_hidden) if return_logits else None,
            cache=out.cache if use_cache else None,
        )

    __call__ = forward

    def logits_from_hidden(self, final_hidden: Tensor) -> Tensor:
        """[..., d] final-norm hidden → [..., V] logits, with the final-logit soft-cap of Gemma-like configs."""
        logits = self.lm_head(final_hidden)
        cap = getattr(self.hf_config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def new_cache(self) -> DynamicCache:
        """An empty KV cache for this model."""
        return DynamicCache(config=self.hf_config)

    def rollback(self, cache: DynamicCache, *, keep: int) -> None:
        """Keep the first `keep` cached positions (drop rejected drafts). transformers 5.24 `crop` takes only
        n ≤ 0 (`crop(-k)` drops k tokens); keep == current length is a no-op."""
        length = cache.get_seq_length()
        if not 0 <= keep <= length:
            raise ValueError(f"rollback: keep={keep} must be in [0, {length}] (the cache holds {length} positions)")
        if keep < length:
            cache.crop(keep - length)

    def keep_positions(self, cache: DynamicCache, *, prefix: int, rows: list[int]) -> None:
        """Keep the first `prefix` cached positions and then the cache rows `rows` (each ≥ prefix, increasing), in
        that order; drop the rest. After a tree verify forward this keeps the context, the anchor and the accepted
        path's keys/values (rows of the forward's accepted nodes), so the cache again holds one causal sequence."""
        length = cache.get_seq_length()
        if not 0 <= prefix <= length or any(not prefix <= r < length for r in rows) or rows != sorted(set(rows)):
            raise ValueError(
                f"keep_positions: prefix={prefix} and rows={rows} must satisfy 0 <= prefix <= rows (increasing) "
                f"< {length}, the cached positions"
            )
        if rows == list(range(prefix, prefix + len(rows))):  # the accepted path is already contiguous: a crop
            self.rollback(cache, keep=prefix + len(rows))
            return
        # Move the kept rows down into place (a copy of those rows only), then crop: cost ∝ the path, not the cache.
        for layer in cache.layers:
            index = torch.tensor(rows, dtype=torch.long, device=layer.keys.device)
            for name in ("keys", "values"):
                states = getattr(layer, name)
                states[:, :, prefix : prefix + len(rows)] = states.index_select(2, index)
        self.rollback(cache, keep=prefix + len(rows))

    def chat_prompt_ids(self, user_text: str, *, system_prompt: str | None = None) -> list[int]:
        """Token ids of one user turn under the chat template, ending with the assistant header.

        system_prompt None keeps the template's own behaviour (SmolLM2 then inserts its default system turn;
        see `default_system_prompt`).
        """
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        messages.append({"role": "user", "content": user_text})
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _capture_into(store: dict[int, Tensor], layer_id: int):
    """Forward hook storing a decoder layer's raw output (a tensor in 5.24; a tuple in older layers)."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        store[layer_id] = output[0] if isinstance(output, tuple) else output

    return hook


def _template_adds_system_turn(tokenizer: Any) -> bool:
    """Whether rendering a lone user turn puts a system turn before it (the template's default system prompt)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    sentinel = "\u2063user-text\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False)
    return "system" in text.split(sentinel)[0]
