"""Import a drafter exported in the DeepSpec / vLLM or the speculators layout, as one of our drafters.

    drafter, spec = import_drafter(path, target, block_size=7)

`path` is a directory with `config.json` + `model.safetensors` (ours from `export_drafter`, an official DeepSpec
checkpoint such as deepseek-ai/dspark_qwen3_4b_block7, or a speculators DSpark/DFlash/EAGLE-3 checkpoint). Every
disagreement with `target` is a ValueError that names it and the fix: hidden size, vocabulary, the draft-layer
shapes, the number of target layers, the target layer ids (`model.feature_layers`), the block size
(`model.block_size`), and an embedding / LM head that are not the target's (another target of the same shape).

Nothing is built and no tensor is read before the config, the safetensors header and the target agree
(`dspark.interop.bounds`): a config that claims more layers, a larger rank or vocabulary than the file holds is
refused with the field named, instead of allocating what it asks for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dspark.interop.bounds import (
    REEXPORT,
    ConfigReader,
    TensorInfo,
    check_header_shapes,
    check_header_sizes,
    clip,
    read_json_object,
    read_safetensors_header,
)
from dspark.interop.export import CONFIG_FILE, WEIGHTS_FILE
from dspark.interop.layouts import MARKOV_TYPE_TO_HEAD, NAME_MAPS, SPECULATORS_ARCHITECTURES, map_names

# Relative tolerance of the embedding / LM-head check: bf16 checkpoints round the target's fp32 tables by ~2^-8.
TABLE_RTOL = 2e-2


def is_exported_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def read_export_config(path: str | Path) -> dict[str, Any]:
    """The config.json object of an import directory; ValueErrors name the file and the fix (`read_json_object`)."""
    path = Path(path)
    if not is_exported_dir(path):
        raise ValueError(
            f"model.import_from={path}: needs a directory with {CONFIG_FILE} and {WEIGHTS_FILE} (a "
            "DeepSpec, vLLM or speculators drafter checkpoint, or one written by stage=export)"
        )
    return read_json_object(path / CONFIG_FILE)


def check_import_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """(describe's fields, the weights' header) of an import directory once its config and header agree; reads no
    tensor and needs no target, so preflight can run it. ValueErrors name the file, the field and the fix."""
    path = Path(path)
    config = path / CONFIG_FILE
    fields = describe(read_export_config(path), source=str(config))
    header = read_safetensors_header(path / WEIGHTS_FILE)
    check_header_sizes(fields, header, config=str(config), weights=str(path / WEIGHTS_FILE))
    return fields, header


def import_drafter(path: str | Path, target: Any, *, block_size: int | None = None) -> tuple[Any, Any]:
    """(drafter in eval mode, DrafterSpec) for `target`; `block_size` (the run's model.block_size) must match.

    Order: the config and the header (`check_import_dir`), the config against the target, the header's every shape
    against the drafter that config and target describe (built on the meta device), and only then the weights are
    read and the drafter built."""
    from dspark.drafters.factory import build_drafter

    path = Path(path)
    fields, header = check_import_dir(path)
    check_against_target(fields, target, block_size=block_size, source=str(path))
    vd = fields["draft_vocab_size"]
    spec = _drafter_spec(fields, target, draft_vocab_size=int(vd) if vd is not None and vd < target.vocab_size else 0)
    check_header_shapes(
        expected_tensors(spec, target),
        header,
        optional=_optional_tensors(fields["kind"]),
        weights=str(path / WEIGHTS_FILE),
        target_name=target.name,
    )
    tensors = _read_tensors(path / WEIGHTS_FILE)
    ids = draft_vocab_from(tensors, fields, target, source=str(path))
    drafter = build_drafter(spec, target, draft_vocab_ids=ids)
    check_frozen_tables(tensors, target, mask_token_id=fields["mask_token_id"], draft_vocab_ids=ids, source=str(path))
    state = _our_state_dict(drafter, tensors, kind=fields["kind"], mask_token_id=fields["mask_token_id"])
    drafter.load_state_dict(state, strict=True)
    drafter.eval()
    return drafter, spec


def expected_tensors(spec: Any, target: Any) -> dict[str, tuple[int, ...]]:
    """Their name -> shape of every tensor the checkpoint of `spec` holds: the drafter's state (from a build on the
    meta device, `state_shapes`) under their names, and the target's tables the layout carries (embedding, LM-head
    rows, and d2t / t2d for a draft vocabulary)."""
    from dspark.drafters.factory import state_shapes

    ours = state_shapes(spec, target)
    ours.pop("backbone.mask_embedding", None)  # their MASK input is a row of embed_tokens
    shapes = {theirs: ours[name] for name, theirs in map_names(list(ours), NAME_MAPS[spec.kind]).items()}
    vocab, hidden = target.vocab_size, target.layer_spec.hidden_size
    vd = spec.draft_vocab_size or vocab
    shapes |= {"embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vd, hidden)}
    if vd < vocab:
        shapes |= {"d2t": (vd,), "t2d": (vocab,)}
    return shapes


def _optional_tensors(kind: str) -> set[str]:
    """Frozen tables a checkpoint may omit (vLLM / speculators share the target's); DSpark / DFlash read their MASK
    embedding from embed_tokens, and a draft vocabulary needs d2t."""
    optional = {"lm_head.weight", "t2d"}
    return optional if kind in ("dspark", "dflash") else optional | {"embed_tokens.weight"}


def _read_tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of `path` (its header already checked); what safetensors still refuses is named with the file."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # SafetensorError (a Rust error type), OSError while reading
        raise ValueError(f"{path} cannot be read ({clip(str(err))}); {REEXPORT}") from None


# ---- the config, read once into layout-independent fields ----


def describe(config: dict[str, Any], *, source: str) -> dict[str, Any]:
    """Layout-independent fields: kind, head, rank, confidence, depth, block size, mask id, layer ids (ours:
    layer-output ids), layer config, draft vocabulary size, and `keys` (the config key of depth, block size and
    layer ids, for messages). Raises ValueError naming `source` (the config file) and the key for a missing or
    ill-typed field, and for what we cannot represent."""
    reader = ConfigReader(config, source=source)
    if "speculators_model_type" in config:
        return _describe_speculators(reader)
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        raise reader.error("architectures", "a list of model class names")
    names = [a for a in architectures if isinstance(a, str)]
    if any(a.endswith("Eagle3Model") for a in names) and "target_layer_ids" in config:
        return _describe_deepspec_eagle3(reader)
    if not any(a.endswith("DSparkModel") for a in names) or "target_layer_ids" not in config:
        raise ValueError(
            f"{source} is neither a DeepSpec DSpark/DFlash/EAGLE-3 config (architectures *DSparkModel or "
            "*Eagle3Model with target_layer_ids) nor a speculators one (speculators_model_type); point "
            "model.import_from at a drafter checkpoint directory"
        )
    return _heads(reader) | {
        "layout": "deepspec",
        "depth": reader.integer("num_hidden_layers", minimum=1),
        "block_size": reader.integer("block_size", minimum=1),
        "mask_token_id": reader.integer("mask_token_id"),
        "feature_layers": reader.integers("target_layer_ids"),
        "num_target_layers": reader.integer("num_target_layers", minimum=1, default=None),
        "layer_config": _layer_fields(reader),
        "draft_vocab_size": reader.integer("draft_vocab_size", minimum=1, default=None),
        "keys": {"depth": "num_hidden_layers", "block_size": "block_size", "feature_layers": "target_layer_ids"},
    }


def _describe_deepspec_eagle3(reader: ConfigReader) -> dict[str, Any]:
    """deepspec/modeling/eagle3/qwen3 `Qwen3Eagle3Model`: ttt_length drafts, target_layer_ids as DSpark's."""
    depth = reader.integer("num_hidden_layers", minimum=1, default=1)
    if depth != 1:
        raise ValueError(
            f"{reader.source}: a {clip(depth)}-layer EAGLE-3 drafter cannot be represented (ours has one layer)"
        )
    return _NO_HEADS | {
        "kind": "eagle3",
        "layout": "deepspec",
        "depth": 1,
        "block_size": reader.integer("ttt_length", minimum=1),
        "mask_token_id": None,
        "feature_layers": reader.integers("target_layer_ids"),
        "num_target_layers": reader.integer("num_target_layers", minimum=1, default=None),
        "layer_config": _layer_fields(reader),
        "draft_vocab_size": None,
        "keys": {"depth": "num_hidden_layers", "block_size": "ttt_length", "feature_layers": "target_layer_ids"},
    }


def _describe_speculators(reader: ConfigReader) -> dict[str, Any]:
    kind = reader.text("speculators_model_type")
    layer = reader.section("transformer_layer_config", optional=True)
    if kind == "eagle3":
        base, aux_key, block_key = _speculators_eagle3(reader, layer)
    elif kind in ("dspark", "dflash"):
        base, aux_key, block_key = _speculators_block_drafter(reader, layer, kind=kind)
    else:
        raise ValueError(
            f"{reader.source}: speculators_model_type={clip(kind)} is not one of {', '.join(SPECULATORS_ARCHITECTURES)}"
        )
    if not reader.has(aux_key):
        raise ValueError(
            f"{reader.source}: no aux hidden-state layer ids ({aux_key}) in config.json; they are needed to read "
            "the target's features"
        )
    # speculators ids index HF hidden_states (0 = embeddings); ours are layer-output ids
    return base | {
        "layout": "speculators",
        "feature_layers": [i - 1 for i in reader.integers(aux_key)],
        "num_target_layers": None,
        "layer_config": _layer_fields(layer),
        "draft_vocab_size": reader.integer("draft_vocab_size", minimum=1, default=None),
        "keys": {"depth": layer.path("num_hidden_layers"), "block_size": block_key, "feature_layers": aux_key},
    }


def _speculators_eagle3(reader: ConfigReader, layer: ConfigReader) -> tuple[dict[str, Any], str, str]:
    """(fields, aux-ids key, block-size key) of a speculators EAGLE-3 config (one layer, none of the norm options)."""
    extras = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if reader.data.get(k)]
    if extras:
        raise ValueError(
            f"{reader.source}: speculators EAGLE-3 option(s) {extras} are on; our EAGLE-3 layer has "
            "none of them, so this drafter cannot be represented"
        )
    depth = layer.integer("num_hidden_layers", minimum=1, default=1)
    if depth != 1:
        raise ValueError(
            f"{reader.source}: a {clip(depth)}-layer EAGLE-3 drafter cannot be represented (ours has one layer)"
        )
    proposal = reader.section("speculators_config").first_section("proposal_methods")
    block_size = proposal.integer("speculative_tokens", minimum=1)
    base = _NO_HEADS | {"kind": "eagle3", "depth": 1, "block_size": block_size, "mask_token_id": None}
    return base, "eagle_aux_hidden_state_layer_ids", proposal.path("speculative_tokens")


def _speculators_block_drafter(
    reader: ConfigReader, layer: ConfigReader, *, kind: str
) -> tuple[dict[str, Any], str, str]:
    """(fields, aux-ids key, block-size key) of a speculators DSpark / DFlash config."""
    if not reader.flag("sample_from_anchor", default=kind == "dspark"):
        raise ValueError(
            f"{reader.source}: sample_from_anchor=false (the anchor is the bonus token and slot k "
            "predicts position a+k) cannot be represented: our blocks predict from the anchor on"
        )
    heads = _heads(reader) if kind == "dspark" else _NO_HEADS | {"kind": "dflash"}
    base = heads | {
        "depth": layer.integer("num_hidden_layers", minimum=1),
        "block_size": reader.integer("block_size", minimum=1),
        "mask_token_id": reader.integer("mask_token_id"),
    }
    return base, "aux_hidden_state_layer_ids", "block_size"


# a drafter without a Markov head or a confidence head (DFlash, EAGLE-3)
_NO_HEADS = {"head": "none", "markov_rank": 0, "confidence": False, "confidence_with_markov": True}


def _heads(reader: ConfigReader) -> dict[str, Any]:
    rank = reader.integer("markov_rank", default=0)
    confidence = reader.flag("enable_confidence_head", default=False)
    head = "none"
    if rank > 0:
        kind_name = reader.text("markov_head_type", default="vanilla").lower()
        if kind_name not in MARKOV_TYPE_TO_HEAD:
            raise ValueError(
                f"{reader.source}: markov_head_type={clip(kind_name)} has no head here "
                f"(known: {', '.join(MARKOV_TYPE_TO_HEAD)})"
            )
        head = MARKOV_TYPE_TO_HEAD[kind_name]
    with_markov = reader.flag("confidence_head_with_markov", default=False) if confidence else False
    if rank > 0 and not confidence:
        raise ValueError(
            f"{reader.source}: a Markov/RNN head without a confidence head cannot be represented (our "
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


LAYER_FIELDS = (
    ("hidden_size", "hidden size"),
    ("num_attention_heads", "attention heads"),
    ("num_key_value_heads", "key/value heads"),
    ("head_dim", "head_dim"),
    ("intermediate_size", "MLP width (intermediate_size)"),
    ("vocab_size", "vocabulary size"),
)


def _layer_fields(reader: ConfigReader) -> dict[str, Any]:
    """The draft layers' shape fields (`LAYER_FIELDS`, each a positive integer or absent) and model_type."""
    fields = {key: reader.integer(key, minimum=1, default=None) for key, _ in LAYER_FIELDS}
    return fields | {"model_type": reader.text("model_type", default="")}


# ---- checks against the loaded target ----


def check_against_target(fields: dict[str, Any], target: Any, *, block_size: int | None, source: str) -> None:
    """ValueErrors that name the disagreement between the checkpoint and `target`, and the fix."""
    layer, ours = fields["layer_config"], target.layer_spec
    for key, label in LAYER_FIELDS:
        theirs = layer.get(key)
        if key == "head_dim" and theirs is None and layer["hidden_size"] and layer["num_attention_heads"]:
            theirs = layer["hidden_size"] // layer["num_attention_heads"]
        if theirs is not None and theirs != int(getattr(ours, key)):
            raise ValueError(
                f"{source}: the drafter's {label} is {clip(theirs)} but target '{target.name}' has "
                f"{getattr(ours, key)}; load it with the target it was trained for (target=...)"
            )
    qk_norm = layer["model_type"].startswith("qwen3")
    if qk_norm != ours.qk_norm:
        raise ValueError(
            f"{source}: the drafter's layers are {clip(layer['model_type'])} layers (q/k norm "
            f"{'on' if qk_norm else 'off'}) but target '{target.name}' is "
            f"{'Qwen3' if ours.qk_norm else 'Llama'}-shaped; use the target it was trained for"
        )
    if fields["num_target_layers"] is not None and fields["num_target_layers"] != target.num_layers:
        raise ValueError(
            f"{source}: the drafter was trained on a {clip(fields['num_target_layers'])}-layer target, "
            f"target '{target.name}' has {target.num_layers} layers"
        )
    _check_feature_layers(fields, target, source=source)
    claimed = fields["block_size"]
    if block_size is not None and claimed != int(block_size):
        fix = f"set model.block_size={claimed}" if claimed <= 1024 else "use a drafter with a sensible block size"
        raise ValueError(
            f"{source}: the drafter has {fields['keys']['block_size']}={clip(claimed)}, the run asks for "
            f"model.block_size={block_size}; {fix}"
        )
    mask = fields["mask_token_id"]
    if mask is not None and not 0 <= mask < target.vocab_size:
        raise ValueError(f"{source}: mask_token_id={clip(mask)} is outside the vocabulary [0, {target.vocab_size})")
    vd = fields["draft_vocab_size"]
    if vd is not None and not 0 < vd <= target.vocab_size:
        raise ValueError(
            f"{source}: draft_vocab_size={clip(vd)} is outside 1..{target.vocab_size} (the target vocabulary)"
        )


def _check_feature_layers(fields: dict[str, Any], target: Any, *, source: str) -> None:
    ids, key = fields["feature_layers"], fields["keys"]["feature_layers"]
    if any(i < 0 or i >= target.num_layers for i in ids):
        raise ValueError(
            f"{source}: target layer ids {clip(ids)} ({key}) are outside target '{target.name}' "
            f"(0..{target.num_layers - 1}); -1 (the embedding output) cannot be represented here"
        )
    if list(ids) != list(target.feature_layer_ids):
        raise ValueError(
            f"{source}: the drafter reads target layers {clip(ids)} ({key}) but the target was loaded with "
            f"{target.feature_layer_ids}; set model.feature_layers={clip(ids)}"
        )


def draft_vocab_from(tensors: dict[str, Tensor], fields: dict[str, Any], target: Any, *, source: str) -> Tensor | None:
    """The draft vocabulary's target ids [Vd] from `d2t` (offsets: id = j + d2t[j]), or None for the full one; the
    header check has made d2t [Vd] present."""
    vd = fields["draft_vocab_size"]
    if vd is None or vd >= target.vocab_size:
        return None
    ids = torch.arange(vd) + tensors["d2t"].long()
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
        theirs, ours = tensors[name].float(), table.detach().float().cpu()  # shapes: checked on the header
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
    drafter: Any, tensors: dict[str, Tensor], *, kind: str, mask_token_id: int | None
) -> dict[str, Tensor]:
    """Our state dict from their tensors (every name and shape was checked on the header before they were read)."""
    ours = drafter.state_dict()
    mapping = map_names([n for n in ours if n != "backbone.mask_embedding"], NAME_MAPS[kind])
    state = {name: tensors[theirs].to(ours[name].dtype) for name, theirs in mapping.items()}
    if "backbone.mask_embedding" in ours:  # their MASK input is its row of the drafter's embedding copy
        state["backbone.mask_embedding"] = tensors["embed_tokens.weight"][mask_token_id].to(
            ours["backbone.mask_embedding"].dtype
        )
    for name in ours:  # buffers we own (the draft vocabulary's ids, from d2t) keep the values the builder gave them
        state.setdefault(name, ours[name])
    return state
