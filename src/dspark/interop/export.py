"""Export a trained drafter to the DeepSpec / vLLM or the speculators layout (config.json + model.safetensors).

    export_drafter(drafter, spec, target, out_dir, layout="deepspec")   # DSpark / DFlash
    export_drafter(drafter, spec, target, out_dir, layout="speculators") # DSpark / DFlash / EAGLE-3

Every field written is documented in docs/INTEROP.md, with the reference file it comes from. What a layout cannot
hold raises a ValueError naming it (e.g. a Llama-shaped DSpark drafter in the speculators layout, whose DFlash
layers always carry Qwen3's q/k norms).

`out_dir` must be new, empty or an earlier export of ours (`dspark.files.claim_output_dir`): pointed at someone's
model directory, the export refuses before writing, so their config.json and weights stay as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dspark.files import ForeignOutputError, atomic_path, atomic_write_text, claim_output_dir, output_dir_error
from dspark.interop.layouts import (
    FORMAT_VERSION,
    LAYOUTS,
    SPECULATORS_VERSION,
    d2t_offsets,
    drafter_layout,
    map_names,
    markov_head_type,
    t2d_mask,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE)  #: everything an export writes (besides the ownership marker)
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_NUM_ANCHORS = 512  # DeepSpec's config requires num_anchors (a training setting); its configs use 512
# Keys of the target's HF config that describe the target checkpoint, not the drafter.
TARGET_ONLY_KEYS = (
    "architectures",
    "auto_map",
    "_name_or_path",
    "quantization_config",
    "rope_scaling",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "layer_types",
    "sliding_window",
    "max_window_layers",
    "use_sliding_window",
    "tie_word_embeddings",
)


def export_drafter(
    drafter: Any,
    spec: Any,
    target: Any,
    out_dir: str | Path,
    *,
    layout: str = "deepspec",
    dtype: str = "float32",
    num_anchors: int = DEFAULT_NUM_ANCHORS,
) -> Path:
    """Write `out_dir/config.json` and `out_dir/model.safetensors` (`EXPORT_FILES`); returns `out_dir`.

    drafter: a DSparkDrafter (kind dspark | dflash) or Eagle3Drafter built for `target` (the `DrafterSpec` `spec`).
    dtype: of every floating tensor written (float32 keeps the round trip bit-exact). Raises ValueError naming
    `export.layout` / `export.dtype` for an unknown value, and naming what cannot be represented otherwise;
    `ForeignOutputError` (a ValueError) before anything is computed when `out_dir` holds what we did not write.
    """
    out_dir = Path(out_dir)
    error = out_dir_error(out_dir)
    if error is not None:
        raise ForeignOutputError(error)
    if layout not in LAYOUTS:
        raise ValueError(f"export.layout={layout!r} is not one of {', '.join(LAYOUTS)}")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export.dtype={dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    _check_lm_head(target)
    architecture, name_map = drafter_layout(spec.kind, layout=layout)
    config = (_deepspec_config if layout == "deepspec" else _speculators_config)(
        drafter, spec, target, architecture=architecture, dtype=dtype, num_anchors=num_anchors
    )
    tensors = _drafter_tensors(drafter, target, name_map)
    claim_output_dir(out_dir, key="export.out_dir", kind="export", ours=is_export_entry)
    config["dspark_lab"] = {
        "format_version": FORMAT_VERSION,
        "layout": layout,
        "kind": spec.kind,
        "head": spec.head,
        "target_name": target.name,
        "target_fingerprint": spec.target_fingerprint,
    }
    _save(tensors, out_dir / WEIGHTS_FILE, dtype=getattr(torch, dtype))
    atomic_write_text(out_dir / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n", key="export.out_dir")
    return out_dir


def out_dir_error(out_dir: str | Path) -> str | None:
    """None when `out_dir` may take an export (new, empty, or an export of ours), else the refusal naming
    `export.out_dir`, what is there and the fix."""
    return output_dir_error(out_dir, key="export.out_dir", ours=is_export_entry)


def is_export_entry(path: Path) -> bool:
    """One of `EXPORT_FILES` beside a config.json we wrote (its `dspark_lab` block): an export from before the
    ownership marker."""
    if path.name not in EXPORT_FILES or not path.is_file():
        return False
    try:
        config = json.loads((path.parent / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("dspark_lab"), dict)


# ---- tensors ----


def draft_vocab_ids(drafter: Any, vocab_size: int) -> Tensor | None:
    """The drafter's draft-to-target ids [Vd], or None for the full vocabulary (Vd == V)."""
    ids = getattr(drafter, "draft_to_target", None)
    if ids is None or ids.numel() == vocab_size:
        return None
    return ids.detach().cpu().long()


def _frozen_tables(drafter: Any, target: Any) -> dict[str, Tensor]:
    """The target's embedding and (draft-vocabulary rows of the) LM head, plus d2t / t2d for a draft vocabulary."""
    lm_head = target.lm_head.weight.detach().cpu()
    tables = {"embed_tokens.weight": target.embed_tokens.weight.detach().cpu().clone()}
    ids = draft_vocab_ids(drafter, target.vocab_size)
    if ids is None:
        tables["lm_head.weight"] = lm_head.clone()
    else:
        tables |= {
            "lm_head.weight": lm_head[ids].clone(),
            "d2t": d2t_offsets(ids),
            "t2d": t2d_mask(ids, target.vocab_size),
        }
    return tables


def _drafter_tensors(drafter: Any, target: Any, name_map: tuple) -> dict[str, Tensor]:
    """The drafter's weights under their names (`name_map`, `layouts.NAME_MAPS`) plus the frozen tables."""
    state = {k: v.detach().cpu() for k, v in drafter.state_dict().items()}
    mask = state.pop("backbone.mask_embedding", None)  # DSpark / DFlash only
    names = map_names(state, name_map)
    tensors = {theirs: state[ours] for ours, theirs in names.items()} | _frozen_tables(drafter, target)
    if mask is not None:
        # Their MASK input is the embedding row of mask_token_id (DeepSpec create_noise_embed, vLLM
        # embed_input_ids); ours is a trained vector, so it goes into that row of the drafter's own embedding copy.
        tensors["embed_tokens.weight"][drafter.mask_token_id] = mask.to(tensors["embed_tokens.weight"].dtype)
    return tensors


def _check_lm_head(target: Any) -> None:
    if getattr(target.lm_head, "bias", None) is not None:
        raise ValueError(
            f"target '{target.name}' has an LM-head bias; the exported layouts have none, so its "
            "drafter cannot be represented"
        )


def _save(tensors: dict[str, Tensor], path: Path, *, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    out = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    with atomic_path(path, key="export.out_dir") as tmp:
        save_file(out, str(tmp), metadata={"format": "pt"})


# ---- configs ----


def _layer_config(spec_layer: Any, target: Any, *, depth: int) -> dict[str, Any]:
    """The draft decoder-layer config: the target's HF config with the drafter's depth and plain RoPE.

    Our draft layers use RoPE with the target's θ and no scaling, so the exported config says exactly that
    (a rope-scaled target's drafter would otherwise run with another RoPE in DeepSpec / vLLM).
    """
    base = target.hf_config.to_dict()
    base = base.get("text_config", base) if "hidden_size" not in base else base
    config = {k: v for k, v in base.items() if k not in TARGET_ONLY_KEYS}
    config.update(
        hidden_size=spec_layer.hidden_size,
        num_attention_heads=spec_layer.num_attention_heads,
        num_key_value_heads=spec_layer.num_key_value_heads,
        head_dim=spec_layer.head_dim,
        intermediate_size=spec_layer.intermediate_size,
        rms_norm_eps=spec_layer.rms_norm_eps,
        vocab_size=spec_layer.vocab_size,
        num_hidden_layers=depth,
        hidden_act="silu",
        attention_bias=False,
        rope_theta=spec_layer.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": spec_layer.rope_theta},
        layer_types=["full_attention"] * depth,
        tie_word_embeddings=False,
    )
    config["model_type"] = "qwen3" if spec_layer.qk_norm else config.get("model_type", "llama")
    return config


def _heads_fields(drafter: Any, spec: Any, *, layout: str) -> dict[str, Any]:
    head_type = markov_head_type(spec.head, layout=layout)
    rank = int(spec.markov_rank) if head_type is not None else 0
    fields: dict[str, Any] = {"markov_rank": rank, "enable_confidence_head": drafter.confidence_head is not None}
    if rank > 0:
        fields["markov_head_type"] = head_type
    if fields["enable_confidence_head"]:
        fields["confidence_head_with_markov"] = bool(getattr(drafter.confidence_head, "rank", 0))
    return fields


DEEPSPEC_EAGLE3_STEP_LOSS_DECAY = 0.8  # DeepSpec config/eagle3/*.py; a training setting its config must carry


def _deepspec_config(
    drafter: Any, spec: Any, target: Any, *, architecture: str, dtype: str, num_anchors: int
) -> dict[str, Any]:
    """deepspec/modeling/dspark/qwen3/config.py `build_draft_config`: target config + these fields."""
    family = "Qwen3" if target.layer_spec.qk_norm else "Llama"  # DeepSpec and vLLM ship Qwen3 (and Gemma4) only
    if architecture == "Eagle3Model":
        return _deepspec_eagle3_config(drafter, spec, target, dtype=dtype, family=family)
    config = _layer_config(target.layer_spec, target, depth=spec.depth)
    config.update(
        architectures=[f"{family}{architecture}"],
        num_target_layers=target.num_layers,
        block_size=spec.block_size,
        mask_token_id=spec.mask_token_id,
        target_layer_ids=list(spec.feature_layers),
        num_anchors=int(num_anchors),
        dtype=dtype,
        **_heads_fields(drafter, spec, layout="deepspec"),
    )
    ids = draft_vocab_ids(drafter, target.vocab_size)
    if ids is not None:  # vLLM qwen3_dspark.py reads draft_vocab_size + d2t; DeepSpec itself has no draft vocab
        config["draft_vocab_size"] = int(ids.numel())
    return config


def _deepspec_eagle3_config(drafter: Any, spec: Any, target: Any, *, dtype: str, family: str) -> dict[str, Any]:
    """deepspec/modeling/eagle3/qwen3/config.py `build_draft_config`: one Eagle3 layer over the full vocabulary."""
    if draft_vocab_ids(drafter, target.vocab_size) is not None:
        raise ValueError(
            "export.layout=deepspec: DeepSpec's EAGLE-3 predicts over the full vocabulary, so a drafter "
            "with a draft vocabulary cannot be represented; use export.layout=speculators (d2t/t2d)"
        )
    config = _layer_config(target.layer_spec, target, depth=1)
    config.update(
        architectures=[f"{family}Eagle3Model"],
        num_target_layers=target.num_layers,
        target_layer_ids=list(spec.feature_layers),
        ttt_length=spec.block_size,
        step_loss_decay=DEEPSPEC_EAGLE3_STEP_LOSS_DECAY,
        draft_num_hidden_layers=1,
        target_model_name_or_path=target.name,
        dtype=dtype,
    )
    return config


def _speculators_config(
    drafter: Any, spec: Any, target: Any, *, architecture: str, dtype: str, num_anchors: int
) -> dict[str, Any]:
    """speculators DSparkSpeculatorConfig / DFlashSpeculatorConfig / Eagle3SpeculatorConfig fields."""
    eagle3 = architecture == "Eagle3Speculator"
    depth = 1 if eagle3 else spec.depth
    if not eagle3 and not target.layer_spec.qk_norm:
        raise ValueError(
            "export.layout=speculators: speculators' DFlash/DSpark layers are Qwen3 layers (q/k norms "
            "always on), so a drafter for a Llama-shaped target cannot be represented; use "
            "export.layout=deepspec"
        )
    ids = draft_vocab_ids(drafter, target.vocab_size)
    algorithm = spec.kind  # speculators' model types are our drafter names
    config: dict[str, Any] = {
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "architectures": [architecture],
        "transformer_layer_config": _layer_config(target.layer_spec, target, depth=depth),
        "draft_vocab_size": target.vocab_size if ids is None else int(ids.numel()),
        "target_hidden_size": None,
        "dtype": dtype,
        "speculators_config": {
            "algorithm": algorithm,
            # our blocks predict from the anchor on (sample_from_anchor), so γ drafts per round
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": spec.block_size,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": target.name,
                "architectures": list(getattr(target.hf_config, "architectures", None) or []),
            },
        },
    }
    # speculators / vLLM aux ids index HF hidden_states (0 = embeddings): our layer-output id i is i + 1
    aux_ids = [int(i) + 1 for i in spec.feature_layers]
    if eagle3:
        config |= {
            "eagle_aux_hidden_state_layer_ids": aux_ids,
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
            "embed_requires_grad": False,
        }
        return config
    config |= {
        "block_size": spec.block_size,
        "aux_hidden_state_layer_ids": aux_ids,
        "mask_token_id": spec.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": True,
    }
    if architecture == "DSparkSpeculator":
        fields = _heads_fields(drafter, spec, layout="speculators")
        config |= {
            "markov_rank": fields["markov_rank"],
            "markov_head_type": fields.get("markov_head_type", "vanilla"),
            "enable_confidence_head": fields["enable_confidence_head"],
            "confidence_head_with_markov": fields.get("confidence_head_with_markov", False),
        }
    return config
