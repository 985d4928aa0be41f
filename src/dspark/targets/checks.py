"""Cheap checks of a `target=` before anything is loaded: the files a load needs exist and are whole.

Loading a model takes seconds to minutes (a GGUF is dequantised once, ~18 s for SmolLM2-135M), and a broken input
used to fail only at the end of it, or deep inside a parser with no file name (`unpack_from requires a buffer of
at least 32 bytes`). These functions read headers and directory listings only, never weights, and raise a
`ValueError` naming `target`, the file and the fix. `check_target` is what preflight calls; `resolve_source`
calls the same checks before converting or loading.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from dspark.targets.builtin import TARGET_KEY, TARGETS
from dspark.targets.storage import gguf_cache_name, targets_cache_root

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "spiece.model")
MODEL_DIR_HINT = (
    "a save_pretrained directory holds config.json, model.safetensors (or shards + index) and tokenizer files"
)


def check_target(name_or_path: str, *, cache_dir: Path | None = None) -> None:
    """Refuse a `target=` that cannot load, from file headers only (seconds): a built-in name passes; a local
    directory must be a complete model directory; a `.gguf` must be a whole GGUF file of a supported
    architecture (skipped once `cache_dir` holds its conversion); a hub id must be cached when the hub is
    switched off (HF_HUB_OFFLINE)."""
    if name_or_path in TARGETS:
        return
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        if cache_dir is None or not (targets_cache_root(cache_dir) / gguf_cache_name(path)).is_dir():
            check_gguf_file(path)
    elif path.is_dir():
        check_model_dir(path)
    elif path.exists():
        raise ValueError(
            f"{TARGET_KEY}={name_or_path} is a file but not a .gguf; give a .gguf file or a model "
            f"directory ({MODEL_DIR_HINT})."
        )
    elif not looks_like_path(name_or_path):
        check_hub_id_reachable(name_or_path)
    else:
        raise ValueError(
            f"{TARGET_KEY}={name_or_path}: no such file or directory; give a local model directory, a "
            f".gguf file, a hub id, or a built-in name ({', '.join(TARGETS.names())})."
        )


def looks_like_path(text: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else that is not on disk was meant as a local path."""
    return text.startswith(("/", ".", "~")) or text.endswith(".gguf") or text.count("/") > 1 or "\\" in text


def check_model_dir(path: Path) -> None:
    """A `save_pretrained` directory: config.json (JSON with `model_type`), whole weights, a tokenizer."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(
            f"{TARGET_KEY}={path} is not a model directory: it has no config.json ({MODEL_DIR_HINT}); "
            "point target= at a save_pretrained directory or a .gguf file."
        )
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{TARGET_KEY}={path}: {config} is not valid JSON ({err}); restore it from the model's "
            "source (re-download or re-save the model)."
        ) from err
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(
            f"{TARGET_KEY}={path}: {config} has no `model_type`, so transformers cannot tell which "
            "architecture to build; save the model with save_pretrained (it writes model_type)."
        )
    weights = [path / name for name in WEIGHT_FILES if (path / name).is_file()] or sorted(path.glob("*.safetensors"))
    if not weights:
        raise ValueError(
            f"{TARGET_KEY}={path} has a config.json but no weights (none of {', '.join(WEIGHT_FILES)} "
            "or *.safetensors); copy the weight files next to config.json."
        )
    for shard in _weight_shards(weights[0]) if weights[0].name.endswith(".index.json") else weights:
        if shard.suffix == ".safetensors":
            check_safetensors_file(shard)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{TARGET_KEY}={path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save "
            "the tokenizer into the same directory (tokenizer.save_pretrained)."
        )


def _weight_shards(index: Path) -> list[Path]:
    """Every shard a weight index names (each must exist)."""
    first = index
    try:
        shards = sorted(set(json.loads(first.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"{TARGET_KEY}: {first} is not a valid weight index ({type(err).__name__}: {err}); "
            "re-save the model or remove the index if the weights are in one file."
        ) from err
    missing = [name for name in shards if not (first.parent / name).is_file()]
    if missing:
        raise ValueError(
            f"{TARGET_KEY}: {first} names {len(missing)} missing shard(s) ({', '.join(missing[:3])}); "
            "copy every shard the index lists next to it."
        )
    return [first.parent / name for name in shards]


def check_safetensors_file(path: Path) -> None:
    """A safetensors file is an 8-byte header length, a JSON header of tensor byte ranges, then the data: a
    truncated copy ends before the last range."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(handle.read(header_len))
        end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"{TARGET_KEY}: {path} is not a readable safetensors file ({err}); it is damaged or "
            "truncated: copy or download it again."
        ) from err
    if 8 + header_len + end > size:
        raise ValueError(
            f"{TARGET_KEY}: {path} is truncated ({size:,} bytes, its header needs "
            f"{8 + header_len + end:,}); copy or download it again."
        )


def check_gguf_file(path: Path) -> None:
    """Parse the GGUF header and tensor table (gguf's reader; a few seconds for a 100 MB file) and check that the
    file holds every tensor's bytes and an architecture transformers can convert."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    path = Path(path)
    size = path.stat().st_size
    fix = "the file is damaged or truncated (an interrupted download or copy?): copy or download it again"
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
        if magic != b"GGUF":
            raise ValueError(f"it starts with {magic!r}, not the GGUF magic b'GGUF'")
        reader = GGUFReader(str(path))
    except Exception as err:  # the reader fails with struct/index/reshape errors on a cut-off file
        raise ValueError(
            f"{TARGET_KEY}={path}: not a readable GGUF file ({type(err).__name__}: {err}); {fix}."
        ) from err
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if not reader.tensors or end > size:
        raise ValueError(
            f"{TARGET_KEY}={path}: truncated GGUF ({size:,} bytes, its tensor table needs {end:,}); {fix}."
        )
    field = reader.get_field("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "(none)"
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{TARGET_KEY}={path}: GGUF architecture '{arch}' cannot be converted by transformers "
            f"(supported: {', '.join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a != 'general')}); "
            "convert it to a save_pretrained directory another way and point target= at that."
        )


def check_hub_id_reachable(hub_id: str) -> None:
    """With the hub switched off (HF_HUB_OFFLINE=1), a hub id must already be in the local hub cache."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes", "on"):
        return  # online: only loading can tell; its error names the id (targets.loading._hub_hint)
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
        raise ValueError(
            f"{TARGET_KEY}={hub_id}: not a built-in name ({', '.join(TARGETS.names())}) or local path, "
            "and HF_HUB_OFFLINE=1 with no cached copy of it; download it once with the hub online, "
            "or give a local model directory or .gguf file."
        )
