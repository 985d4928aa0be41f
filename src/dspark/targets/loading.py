"""`load_target`: resolve a name or path, load model + tokenizer, check they agree, pick MASK and stop ids.

Resolution order: a built-in name (`TARGETS`), else a local `.gguf` file (converted once into the cache), a
local `save_pretrained` directory, or a hub id. Anything that looks like a path but does not exist is refused
before any loading work.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspark.targets.base import Target, resolve_feature_layer_ids
from dspark.targets.builtin import TARGET_KEY, TARGETS, TargetSource
from dspark.targets.checks import check_gguf_file, check_model_dir, looks_like_path
from dspark.targets.layout import few_row_decision_path
from dspark.targets.storage import convert_gguf, gguf_cache_name, materialize, targets_cache_root

MASK_KEY = "target_options.mask_token_id"
END_OF_TURN = "<|im_end|>"


def load_target(
    name_or_path: str,
    *,
    cache_dir: Path,
    feature_layers: list[int] | None = None,
    trust_remote_code: bool = False,
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    mask_token_id: int | None = None,
    num_feature_layers: int = 5,
) -> Target:
    """Load a frozen `Target` (METHOD §2.1 feature ids by default; `seed` only shapes the `tiny` weights).

    cache_dir: root for converted/generated targets (`<cache_dir>/targets/...`; the CLI passes
    `<paths.root>/cache`). mask_token_id: explicit MASK row, overriding the built-in / automatic choice.
    """
    source = resolve_source(name_or_path, cache_dir=cache_dir, seed=seed)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    # The checkpoint's identity is the fp32 load's fingerprint (what drafters record): another dtype is loaded in
    # fp32 first, fingerprinted, then cast — so a drafter trained against the fp32 target serves a bf16 load of the
    # same files (target.dtype=bfloat16 flattens the verification cost on AMX CPUs), while `fingerprint`, the key
    # of caches whose contents depend on the dtype (SPS tables, regenerated text), keeps the dtype.
    model, tokenizer = _load_pretrained(source, dtype=torch.float32, trust_remote_code=trust_remote_code)
    checkpoint_fingerprint = compute_fingerprint(source.name, model)
    if dtype != torch.float32:
        model = model.to(dtype)
    check_vocab_agreement(model, tokenizer)
    num_layers = len(model.get_decoder().layers)
    fingerprint = compute_fingerprint(source.name, model) if dtype != torch.float32 else checkpoint_fingerprint
    return Target(
        name=source.name,
        model=model,
        tokenizer=tokenizer,
        feature_layer_ids=resolve_feature_layer_ids(
            feature_layers, num_layers=num_layers, num_default=num_feature_layers
        ),
        mask_token_id=choose_mask_token_id(model, tokenizer, explicit=mask_token_id, token=source.mask_token),
        stop_token_ids=collect_stop_token_ids(model, tokenizer),
        fingerprint=fingerprint,
        checkpoint_fingerprint=checkpoint_fingerprint,
        few_row_decision=few_row_decision_path(cache_dir, fingerprint),
    )


def resolve_source(name_or_path: str, *, cache_dir: Path, seed: int) -> TargetSource:
    """Map a built-in name, local path or hub id to a loadable `TargetSource` (converting a .gguf once)."""
    if name_or_path in TARGETS:
        return TARGETS.resolve(name_or_path)(cache_dir=cache_dir, seed=seed)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        if looks_like_path(name_or_path):
            raise ValueError(
                f"{TARGET_KEY}: local path '{name_or_path}' does not exist; give an existing save_pretrained "
                f"directory or .gguf file, a hub id, or a built-in name ({', '.join(TARGETS.names())})"
            )
        return TargetSource(name=name_or_path, location=name_or_path, is_hub=True, load_hint=_hub_hint(name_or_path))
    path = path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        converted = materialize(targets_cache_root(cache_dir) / gguf_cache_name(path), lambda t: _convert(path, t))
        return TargetSource(name=str(path), location=str(converted))
    if not path.is_dir():
        raise ValueError(
            f"{TARGET_KEY}: '{path}' is neither a .gguf file nor a model directory; point it at a "
            "save_pretrained directory (config.json, safetensors, tokenizer files) or a .gguf file"
        )
    check_model_dir(path)
    return TargetSource(name=str(path), location=str(path))


def _convert(gguf_path: Path, out_dir: Path) -> None:
    check_gguf_file(gguf_path)  # a cut-off file fails here with its name, not deep in the GGUF parser
    convert_gguf(gguf_path, out_dir)


def _hub_hint(hub_id: str) -> str:
    return (
        f"'{hub_id}' is not a built-in name ({', '.join(TARGETS.names())}) nor a local path, and loading it from "
        "the hub failed (offline?); pass a local directory or .gguf file"
    )


def _load_pretrained(source: TargetSource, *, dtype: torch.dtype, trust_remote_code: bool) -> tuple[Any, Any]:
    """AutoTokenizer + AutoModelForCausalLM from the source; load failures become a ValueError with a hint."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.location, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, trust_remote_code=trust_remote_code)
    except Exception as err:  # hub/network and file errors come in many types; keep the cause chained
        if not source.is_hub and not isinstance(err, OSError):
            raise
        hint = source.load_hint or "check the directory holds config.json, weights and tokenizer files"
        problem = f"{type(err).__name__}: {err}"
        raise ValueError(f"{TARGET_KEY}: could not load '{source.location}' ({problem}); {hint}") from err
    return model, tokenizer


def check_vocab_agreement(model: Any, tokenizer: Any) -> None:
    """Raise unless every id the tokenizer can produce has a row in the embedding and the LM head."""
    rows = min(model.get_input_embeddings().weight.shape[0], model.get_output_embeddings().weight.shape[0])
    max_id = max([*tokenizer.get_vocab().values(), *getattr(tokenizer, "added_tokens_decoder", {})])
    if len(tokenizer) > model.config.vocab_size or max_id >= rows:
        raise ValueError(
            f"model/tokenizer mismatch: the tokenizer has {len(tokenizer)} tokens (largest id {max_id}) but the model "
            f"has vocab_size={model.config.vocab_size} and {rows} embedding/LM-head rows; load the tokenizer that "
            f"belongs to this model ({TARGET_KEY})"
        )


def choose_mask_token_id(model: Any, tokenizer: Any, *, explicit: int | None, token: str | None) -> int:
    """The MASK row (METHOD §2.1), first that applies: explicit id; the built-in's reserved token; the tokenizer's
    own mask token; a spare padding row (embedding rows beyond len(tokenizer)); unk, then pad, if not a stop id."""
    rows = model.get_input_embeddings().weight.shape[0]
    if explicit is not None:
        if not 0 <= int(explicit) < rows:
            raise ValueError(f"{MASK_KEY}={explicit} is outside the embedding rows [0, {rows - 1}]; pick a valid id")
        return int(explicit)
    if token is not None:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token not in tokenizer.get_vocab():
            raise ValueError(f"{MASK_KEY}: the reserved MASK token {token!r} is not in this tokenizer; set {MASK_KEY}")
        return int(token_id)
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    if rows > len(tokenizer):
        return len(tokenizer)  # first row no tokenizer id maps to: it can never occur in data
    stops = set(collect_stop_token_ids(model, tokenizer))
    for candidate in (tokenizer.unk_token_id, tokenizer.pad_token_id):
        if candidate is not None and candidate not in stops:
            return int(candidate)
    raise ValueError(
        f"{MASK_KEY}: this target has no spare embedding row and no unk/pad token distinct from end-of-sequence, "
        f"so no MASK token can be chosen automatically; set {MASK_KEY}=<id> (load_target(mask_token_id=...)) to a "
        "token id that never occurs in your data"
    )


def collect_stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Generation-config eos id(s), then the tokenizer's eos and `<|im_end|>` if present; deduplicated, in order."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    candidates = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    candidates.append(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    if END_OF_TURN in vocab:
        candidates.append(vocab[END_OF_TURN])
    return list(dict.fromkeys(int(i) for i in candidates if i is not None))


def compute_fingerprint(name: str, model: Any, *, samples_per_tensor: int = 256) -> str:
    """sha256 over the name, the config (minus load-path fields) and a strided byte sample of every parameter.

    Exact and cheap (no full-tensor reductions, no float rounding), so it is identical across loads of the same
    files and changes with any retrained weight matrix or with the dtype.
    """
    digest = hashlib.sha256(name.encode())
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for param_name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // samples_per_tensor)].contiguous().cpu()
        digest.update(f"{param_name}:{tuple(param.shape)}:{param.dtype}".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
