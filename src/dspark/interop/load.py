"""Import a drafter exported in the DeepSpec / vLLM or the speculators layout, as one of our drafters.

    drafter, spec = import_drafter(path, target, block_size=7)

`path` is a directory with `config.json` + `model.safetensors` (ours from `export_drafter`, an official DeepSpec
checkpoint such as deepseek-ai/dspark_qwen3_4b_block7, or a speculators DSpark/DFlash/EAGLE-3 checkpoint). Every
disagreement with `target` is a ValueError that names it and the fix: hidden size, vocabulary, the draft-layer
shapes, the number of target layers, the target layer ids (`model.feature_layers`), the block size
(`model.block_size`), and an embedding / LM head that are not the target's (another target of the same shape).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dspark.interop.export import CONFIG_FILE, WEIGHTS_FILE
from dspark.interop.layouts import MARKOV_TYPE_TO_HEAD, NAME_MAPS, SPECULATORS_ARCHITECTURES, map_names

# Their tensors we rebuild from the target (or ignore): checked against the target, never loaded as weights.
FROZEN_TENSORS = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")
# Relative tolerance of the embedding / LM-head check: bf16 checkpoints round the target's fp32 tables by ~2^-8.
TABLE_RTOL = 2e-2


def is_exported_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def read_export_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not is_exported_dir(path):
        raise ValueError(
            f"model.import_from={path}: needs a directory with {CONFIG_FILE} and {WEIGHTS_FILE} (a "
            "DeepSpec, vLLM or speculators drafter checkpoint, or one written by stage=export)"
        )
    return json.loads((path / CONFIG_FILE).read_text())


def import_drafter(path: str | Path, target: Any, *, block_size: int | None = None) -> tuple[Any, Any]:
    """(drafter in eval mode, DrafterSpec) for `target`; `block_size` (the run's model.block_size) must match."""
    from safetensors.torch import load_file

    from dspark.drafters.factory import build_drafter

    config = read_export_config(path)
    fields = describe(config, source=str(path))
    check_against_target(fields, target, block_size=block_size, source=str(path))
    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    ids = draft_vocab_from(tensors, fields, target, source=str(path))
    spec = _drafter_spec(fields, target, draft_vocab_size=0 if ids is None else int(ids.numel()))
    drafter = build_drafter(spec, target, draft_vocab_ids=ids)
    check_frozen_tables(tensors, target, mask_token_id=fields["mask_token_id"], draft_vocab_ids=ids, source=str(path))
    state = _our_state_dict(
        drafter, tensors, kind=fields["kind"], mask_token_id=fields["mask_token_id"], source=str(path)
    )
    drafter.load_state_dict(state, strict=True)
    drafter.eval()
    return drafter, spec


# ---- the config, read once into layout-independent fields ----


def describe(config: dict[str, Any], *, source: str) -> dict[str, Any]:
    """Layout-independent fields: kind, head, rank, confidence, depth, block size, mask id, layer ids (ours:
    layer-output ids), layer config, draft vocabulary size. Raises ValueError for what we cannot represent."""
    if "speculators_model_type" in config:
        return _describe_speculators(config, source=source)
    architectures = config.get("architectures") or []
    if any(str(a).endswith("Eagle3Model") for a in architectures) and "target_layer_ids" in config:
        return _describe_deepspec_eagle3(config, source=source)
    if not any(str(a).endswith("DSparkModel") for a in architectures) or "target_layer_ids" not in config:
        raise ValueError(
            f"{source}: config.json is neither a DeepSpec DSpark/DFlash config (architectures "
            "*DSparkModel with target_layer_ids) nor a speculators one (speculators_model_type)"
        )
    layer_ids = [int(i) for i in config["target_layer_ids"]]
    return _heads(config, source=source) | {
        "layout": "deepspec",
        "depth": int(config["num_hidden_layers"]),
        "block_size": int(config["block_size"]),
        "mask_token_id": int(config["mask_token_id"]),
        "feature_layers": layer_ids,
        "num_target_layers": config.get("num_target_layers"),
        "layer_config": config,
        "draft_vocab_size": config.get("draft_vocab_size"),
    }


def _describe_deepspec_eagle3(config: dict[str, Any], *, source: str) -> dict[str, Any]:
    """deepspec/modeling/eagle3/qwen3 `Qwen3Eagle3Model`: ttt_length drafts, target_layer_ids as DSpark's."""
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise ValueError(
            f"{source}: a {config['num_hidden_layers']}-layer EAGLE-3 drafter cannot be represented "
            "(ours has one layer)"
        )
    return {
        "kind": "eagle3",
        "head": "none",
        "markov_rank": 0,
        "confidence": False,
        "confidence_with_markov": True,
        "layout": "deepspec",
        "depth": 1,
        "block_size": int(config["ttt_length"]),
        "mask_token_id": None,
        "feature_layers": [int(i) for i in config["target_layer_ids"]],
        "num_target_layers": config.get("num_target_layers"),
        "layer_config": config,
        "draft_vocab_size": None,
    }


def _describe_speculators(config: dict[str, Any], *, source: str) -> dict[str, Any]:
    kind = config["speculators_model_type"]
    layer_config = config.get("transformer_layer_config") or {}
    if kind == "eagle3":
        extras = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if config.get(k)]
        if extras:
            raise ValueError(
                f"{source}: speculators EAGLE-3 option(s) {extras} are on; our EAGLE-3 layer has "
                "none of them, so this drafter cannot be represented"
            )
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        base = {
            "kind": "eagle3",
            "head": "none",
            "markov_rank": 0,
            "confidence": False,
            "confidence_with_markov": True,
            "depth": 1,
            "block_size": int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]),
            "mask_token_id": None,
        }
        if int(layer_config.get("num_hidden_layers", 1)) != 1:
            raise ValueError(
                f"{source}: a {layer_config['num_hidden_layers']}-layer EAGLE-3 drafter cannot be "
                "represented (ours has one layer)"
            )
    elif kind in ("dspark", "dflash"):
        if not config.get("sample_from_anchor", kind == "dspark"):
            raise ValueError(
                f"{source}: sample_from_anchor=false (the anchor is the bonus token and slot k "
                "predicts position a+k) cannot be represented: our blocks predict from the anchor on"
            )
        aux = config.get("aux_hidden_state_layer_ids")
        heads = (
            _heads(config, source=source)
            if kind == "dspark"
            else {
                "kind": "dflash",
                "head": "none",
                "markov_rank": 0,
                "confidence": False,
                "confidence_with_markov": True,
            }
        )
        base = heads | {
            "depth": int(layer_config["num_hidden_layers"]),
            "block_size": int(config["block_size"]),
            "mask_token_id": int(config["mask_token_id"]),
        }
    else:
        raise ValueError(
            f"{source}: speculators_model_type={kind!r} is not one of {', '.join(SPECULATORS_ARCHITECTURES)}"
        )
    if not aux:
        raise ValueError(
            f"{source}: no aux hidden-state layer ids in config.json; they are needed to read the target's features"
        )
    # speculators ids index HF hidden_states (0 = embeddings); ours are layer-output ids
    return base | {
        "layout": "speculators",
        "feature_layers": [int(i) - 1 for i in aux],
        "num_target_layers": None,
        "layer_config": layer_config,
        "draft_vocab_size": config.get("draft_vocab_size"),
    }


def _heads(config: dict[str, Any], *, source: str) -> dict[str, Any]:
    rank = int(config.get("markov_rank", 0) or 0)
    confidence = bool(config.get("enable_confidence_head", False))
    head = "none"
    if rank > 0:
        kind_name = str(config.get("markov_head_type", "vanilla")).lower()
        if kind_name not in MARKOV_TYPE_TO_HEAD:
            raise ValueError(
                f"{source}: markov_head_type={kind_name!r} has no head here (known: {', '.join(MARKOV_TYPE_TO_HEAD)})"
            )
        head = MARKOV_TYPE_TO_HEAD[kind_name]
    with_markov = bool(config.get("confidence_head_with_markov", False)) if confidence else False
    if rank > 0 and not confidence:
        raise ValueError(
            f"{source}: a Markov/RNN head without a confidence head cannot be represented (our "
            "DSpark drafter always has one; DFlash has neither)"
        )
    kind = "dspark" if (rank > 0 or confidence) else "dflash"
    # without a W_1 table (rank 0) the flag means nothing: keep our default
    return {
        "kind": kind,
        "head": head,
        "markov_rank": rank,
        "confidence": confidence,
        "confidence_with_markov": with_markov if rank > 0 else True,
    }


# ---- checks against the loaded target ----

LAYER_FIELDS = (
    ("hidden_size", "hidden size"),
    ("num_attention_heads", "attention heads"),
    ("num_key_value_heads", "key/value heads"),
    ("head_dim", "head_dim"),
    ("intermediate_size", "MLP width (intermediate_size)"),
    ("vocab_size", "vocabulary size"),
)


def check_against_target(fields: dict[str, Any], target: Any, *, block_size: int | None, source: str) -> None:
    """ValueErrors that name the disagreement between the checkpoint and `target`, and the fix."""
    layer, ours = fields["layer_config"], target.layer_spec
    for key, label in LAYER_FIELDS:
        theirs = layer.get(key)
        if key == "head_dim" and theirs is None:
            theirs = layer["hidden_size"] // layer["num_attention_heads"]
        if theirs is not None and int(theirs) != int(getattr(ours, key)):
            raise ValueError(
                f"{source}: the drafter's {label} is {theirs} but target '{target.name}' has "
                f"{getattr(ours, key)}; load it with the target it was trained for (target=...)"
            )
    qk_norm = str(layer.get("model_type", "")).startswith("qwen3")
    if qk_norm != ours.qk_norm:
        raise ValueError(
            f"{source}: the drafter's layers are {layer.get('model_type')} layers (q/k norm "
            f"{'on' if qk_norm else 'off'}) but target '{target.name}' is "
            f"{'Qwen3' if ours.qk_norm else 'Llama'}-shaped; use the target it was trained for"
        )
    if fields["num_target_layers"] is not None and int(fields["num_target_layers"]) != target.num_layers:
        raise ValueError(
            f"{source}: the drafter was trained on a {fields['num_target_layers']}-layer target, "
            f"target '{target.name}' has {target.num_layers} layers"
        )
    ids = fields["feature_layers"]
    if any(i < 0 or i >= target.num_layers for i in ids):
        raise ValueError(
            f"{source}: target layer ids {ids} are outside target '{target.name}' (0..{target.num_layers - 1}); "
            "-1 (the embedding output) cannot be represented here"
        )
    if list(ids) != list(target.feature_layer_ids):
        raise ValueError(
            f"{source}: the drafter reads target layers {ids} but the target was loaded with "
            f"{target.feature_layer_ids}; set model.feature_layers={ids}"
        )
    if block_size is not None and int(fields["block_size"]) != int(block_size):
        raise ValueError(
            f"{source}: the drafter has block_size={fields['block_size']}, the run asks for "
            f"model.block_size={block_size}; set model.block_size={fields['block_size']}"
        )
    mask = fields["mask_token_id"]
    if mask is not None and not 0 <= mask < target.vocab_size:
        raise ValueError(f"{source}: mask_token_id={mask} is outside the vocabulary [0, {target.vocab_size})")
    vd = fields["draft_vocab_size"]
    if vd is not None and not 0 < int(vd) <= target.vocab_size:
        raise ValueError(f"{source}: draft_vocab_size={vd} is outside 1..{target.vocab_size} (the target vocabulary)")


def draft_vocab_from(tensors: dict[str, Tensor], fields: dict[str, Any], target: Any, *, source: str) -> Tensor | None:
    """The draft vocabulary's target ids [Vd] from `d2t` (offsets: id = j + d2t[j]), or None for the full one."""
    vd = fields["draft_vocab_size"]
    if vd is None or int(vd) >= target.vocab_size:
        return None
    if "d2t" not in tensors:
        raise ValueError(
            f"{source}: draft_vocab_size={vd} < {target.vocab_size} but model.safetensors has no d2t "
            "mapping, so the draft ids cannot be turned into target ids"
        )
    d2t = tensors["d2t"].long()
    if d2t.numel() != int(vd):
        raise ValueError(f"{source}: d2t has {d2t.numel()} entries, draft_vocab_size is {vd}")
    ids = torch.arange(d2t.numel()) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size or not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{source}: d2t does not map the draft ids to sorted, distinct target ids")
    if "t2d" in tensors and not torch.equal(tensors["t2d"].bool().nonzero().flatten(), ids):
        raise ValueError(f"{source}: t2d and d2t disagree on the draft vocabulary")
    return ids


def check_frozen_tables(
    tensors: dict[str, Tensor],
    target: Any,
    *,
    mask_token_id: int | None,
    draft_vocab_ids: Tensor | None = None,
    source: str,
) -> None:
    """The checkpoint's embedding and LM head (its draft-vocabulary rows) must be the target's, up to the
    checkpoint's rounding, except the MASK row; a drafter of another target with the same shapes is refused here."""
    lm_head = target.lm_head.weight.detach()
    if draft_vocab_ids is not None:
        lm_head = lm_head[draft_vocab_ids.to(lm_head.device)]
    for name, table in (("embed_tokens.weight", target.embed_tokens.weight), ("lm_head.weight", lm_head)):
        if name not in tensors:
            continue  # vLLM / speculators share the target's table when the checkpoint omits it
        theirs, ours = tensors[name].float(), table.detach().float().cpu()
        if theirs.shape != ours.shape:
            raise ValueError(
                f"{source}: {name} is {tuple(theirs.shape)}, target '{target.name}' has "
                f"{tuple(ours.shape)}; use the target the drafter was trained for"
            )
        keep = torch.ones(ours.shape[0], dtype=torch.bool)
        if name == "embed_tokens.weight" and mask_token_id is not None:
            keep[mask_token_id] = False
        error = (theirs[keep] - ours[keep]).norm() / ours[keep].norm().clamp_min(1e-12)
        if error > TABLE_RTOL:
            raise ValueError(
                f"{source}: {name} differs from target '{target.name}' (relative error "
                f"{float(error):.3g}); the drafter was trained for another target"
            )


# ---- tensors ----


def _drafter_spec(fields: dict[str, Any], target: Any, *, draft_vocab_size: int):
    from dspark.drafters.factory import DrafterSpec, checkpoint_fingerprint

    return DrafterSpec(
        kind=fields["kind"],
        head=fields["head"],
        depth=fields["depth"],
        block_size=fields["block_size"],
        markov_rank=fields["markov_rank"],
        feature_layers=tuple(fields["feature_layers"]),
        mask_token_id=target.mask_token_id if fields["mask_token_id"] is None else fields["mask_token_id"],
        target_fingerprint=checkpoint_fingerprint(target),
        draft_vocab_size=draft_vocab_size,
        confidence_with_markov=fields["confidence_with_markov"],
    )


def _our_state_dict(
    drafter: Any, tensors: dict[str, Tensor], *, kind: str, mask_token_id: int | None, source: str
) -> dict[str, Tensor]:
    ours = drafter.state_dict()
    names = [n for n in ours if n != "backbone.mask_embedding"]
    mapping = map_names(names, NAME_MAPS[kind])
    missing = [theirs for theirs in mapping.values() if theirs not in tensors]
    if missing:
        raise ValueError(
            f"{source}: model.safetensors lacks {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            "that this drafter needs"
        )
    extra = sorted(set(tensors) - set(mapping.values()) - set(FROZEN_TENSORS))
    if extra:
        raise ValueError(f"{source}: tensors {extra[:5]} have no equivalent in our drafter; it cannot be represented")
    state = {}
    for name, theirs in mapping.items():
        tensor = tensors[theirs]
        if tensor.shape != ours[name].shape:
            raise ValueError(f"{source}: {theirs} is {tuple(tensor.shape)}, expected {tuple(ours[name].shape)}")
        state[name] = tensor.to(ours[name].dtype)
    if "backbone.mask_embedding" in ours:
        if "embed_tokens.weight" not in tensors:
            raise ValueError(
                f"{source}: no embed_tokens.weight, so the MASK embedding (its row {mask_token_id}) is unknown"
            )
        state["backbone.mask_embedding"] = tensors["embed_tokens.weight"][mask_token_id].to(
            ours["backbone.mask_embedding"].dtype
        )
    for name in ours:  # buffers we own (the draft vocabulary's ids, from d2t) keep the values the builder gave them
        state.setdefault(name, ours[name])
    return state
