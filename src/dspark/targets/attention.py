"""The target's attention for multi-token forwards on the CPU: grouped-query SDPA with no copy of the KV cache.

transformers' `sdpa` attention (5.x) hands SDPA `enable_gqa=True` only when a forward has no attention mask: on CUDA a
mask together with `enable_gqa` falls back to the math kernel. For one query with a mask it packs the query heads onto
the key/value heads; for several queries with a mask it expands the keys and values to every query head
(`repeat_kv`), a fresh copy of the whole cache in every layer. Every verify forward is that case — ℓ + 1 queries over a
cache, with the causal mask that offsets them — and so is every padded batch (serving, feature extraction). On the CPU,
torch's SDPA takes a mask and `enable_gqa` together in its flash kernel, with the same outputs as the expanded
keys/values (bit-identical on SmolLM2-135M at 1–8 tokens over a 200-token cache; `tests/test_target_attention.py`
pins it on the tiny target). Measured on an AVX2-only EPYC Zen 3 (2 threads): the copies took 1–8 ms of a 4-token
verify step over 200 cached tokens and the attention kernel itself ~2× its grouped time
(`benchmarks/results/verify-attention.md`).

`use_grouped_sdpa(model)` switches a model that runs transformers' `sdpa` with grouped-query heads (H_q > H_kv) to
`GROUPED_SDPA`: the same mask construction as `sdpa` (its mask function is registered under the new name too) and
this module's attention function, which takes the grouped path for CPU tensors with more than one query and a
mask, and otherwise calls transformers' own `sdpa_attention_forward` unchanged (one query, no mask, other devices,
position biases, soft-capping). `DSPARK_TARGET_ATTENTION=sdpa` keeps transformers' path (for side-by-side timing).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "dspark_grouped_sdpa"
ATTENTION_ENV = "DSPARK_TARGET_ATTENTION"
ATTENTION_CHOICES = ("auto", "sdpa")

__all__ = ["ATTENTION_ENV", "GROUPED_SDPA", "grouped_sdpa_attention", "use_grouped_sdpa"]


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: query [B, H_q, L, hd], key/value [B, H_kv, T, hd] (cache
    included), attention_mask as `sdpa_mask` builds it ([B, 1, L, T] bool or additive float, or None) → output
    [B, L, H_q, hd] and no attention weights. Grouped path where it applies (module docstring), else transformers'."""
    if _takes_grouped_path(module, query, attention_mask, kwargs):
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def _takes_grouped_path(
    module: torch.nn.Module, query: Tensor, attention_mask: Tensor | None, kwargs: dict[str, Any]
) -> bool:
    """Several queries, a mask, grouped heads, on the CPU, and nothing transformers adds to the mask itself."""
    return (
        getattr(module, "num_key_value_groups", 1) > 1
        and query.shape[2] > 1
        and attention_mask is not None
        and query.device.type == "cpu"
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )


def _register() -> None:
    """Register `GROUPED_SDPA` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def use_grouped_sdpa(model: Any) -> str:
    """Switch `model` to `GROUPED_SDPA` if it runs transformers' `sdpa` with H_q > H_kv (and `DSPARK_TARGET_ATTENTION`
    is not `sdpa`); returns the attention implementation the model runs afterwards."""
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice not in ATTENTION_CHOICES:
        raise ValueError(
            f"{ATTENTION_ENV}={choice!r} is not one of {', '.join(ATTENTION_CHOICES)}: auto (grouped "
            "SDPA where the target runs transformers' sdpa with grouped-query heads) or sdpa "
            "(transformers' own path, for timing side by side)"
        )
    config = model.config
    current = getattr(config, "_attn_implementation", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    grouped = bool(heads) and bool(kv_heads) and heads > kv_heads
    if choice == "sdpa" or current != "sdpa" or not grouped or not hasattr(model, "set_attn_implementation"):
        return str(current)
    _register()
    model.set_attn_implementation(GROUPED_SDPA)
    return GROUPED_SDPA
