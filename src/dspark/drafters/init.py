"""Initialising draft layers from the target's own decoder layers (`model.init_layers`).

A draft layer has the parameters of a decoder layer of the target's family under the same names
(`input_layernorm`, `self_attn.{q,k,v,o}_proj`, the Qwen3 `q_norm`/`k_norm`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj`; `dspark.drafters.backbone.DraftDecoderLayer`), so a copy starts it as a layer that already
maps token embeddings and hidden states to useful ones instead of noise. Some draft-model recipes seed their layers
this way (e.g. from the target's first and last layers); whether it helps a KV-injected block drafter is measured,
not assumed (`experiments/budgets/cpu-ref.yaml`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


#: draft-layer parameters with no counterpart in a target decoder layer (drafters.block_conv, model.head=selector_conv)
BLOCK_CONV_PREFIXES = ("attn_conv.", "mlp_conv.")


def copy_target_layers(layers: nn.ModuleList, target: Any, layer_ids: list[int]) -> list[str]:
    """Copy target decoder layer `layer_ids[i]` into draft layer `i`, parameter by parameter, by name.

    Every draft-layer parameter must have a same-named, same-shaped target parameter (a draft layer is a decoder
    layer of the target's family); the target layer may have more (rotary buffers, biases of other families are
    refused by the shape check of the ones both have). Returns the copied parameter names of layer 0 (for the log).
    Raises ValueError naming `model.init_layers` on a count, id or shape mismatch, before anything is copied.
    """
    if len(layer_ids) != len(layers):
        raise ValueError(
            f"model.init_layers names {len(layer_ids)} target layers for {len(layers)} draft layers; "
            "give one target layer id per draft layer"
        )
    pairs = []
    for draft_layer, layer_id in zip(layers, layer_ids):
        source = dict(target.decoder_layer(int(layer_id)).named_parameters())
        for name, param in draft_layer.named_parameters():
            if name.startswith(
                BLOCK_CONV_PREFIXES
            ):  # selector_conv's block convolutions: no target twin, kept identity
                continue
            if name not in source or source[name].shape != param.shape:
                found = "missing" if name not in source else f"shape {tuple(source[name].shape)}"
                raise ValueError(
                    f"model.init_layers: draft parameter {name} {tuple(param.shape)} has no match in "
                    f"target layer {layer_id} ({found}); this target's layers cannot initialise the "
                    "draft layers: use model.init_layers=[]"
                )
            pairs.append((param, source[name]))
    with torch.no_grad():
        for param, weight in pairs:
            param.copy_(weight.to(dtype=param.dtype, device=param.device))
    return (
        [name for name, _ in layers[0].named_parameters() if not name.startswith(BLOCK_CONV_PREFIXES)]
        if len(layers)
        else []
    )
