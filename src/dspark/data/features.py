"""Optional per-token cache of the frozen target's outputs over the regenerated sequences (METHOD §2.1, §3).

Training needs, per token, the concatenated feature-layer outputs `[H_l1; …; H_lm]` (`features` [T, m·d]) and
the final-norm hidden state (`final_hidden` [T, d], whose LM-head image is `p_t`). The target is frozen, so these
never change: computing them once and reading them back trades disk (2·(m+1)·d bytes per token in float16) for
target forwards. `benchmarks/bench_data.py` measures which is faster on a given machine.

Layout: `cache_dir/features/<key>/` with `manifest.json`, safetensors shards `features-NNNNN.safetensors` holding
`features.<i>` and `final_hidden.<i>` for global sequence index `i` (load order of `load_regenerated`), each
written atomically, and a `COMPLETE` marker. `key` hashes the regeneration key, the target fingerprint and the
feature layer ids; a rerun skips finished shards.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm

from dspark.data.regenerate import COMPLETE, MANIFEST, load_regenerated, read_manifest

FEATURE_FORMAT_VERSION = 1
STORE_DTYPE = torch.float16


def feature_cache_key(regen_key: str, *, target: Any) -> str:
    """sha256 of what determines the cached tensors: the data, the target weights and the feature layers."""
    payload = [FEATURE_FORMAT_VERSION, regen_key, target.fingerprint, list(target.feature_layer_ids), str(STORE_DTYPE)]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def compute_features(target: Any, input_ids: Tensor, *, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Online path: one target forward over right-padded `input_ids` [B, T] with `attention_mask` [B, T] bool.

    Returns (features [B, T, m·d], final_hidden [B, T, d]) in the target's dtype; padded positions hold whatever
    the model computes there (causal attention keeps real positions exact) and must be masked by the caller.
    """
    out = target.forward(input_ids.to(target.device), attention_mask=attention_mask.to(target.device).long())
    return out.features, out.final_hidden


def cache_features(
    target: Any,
    regen_dir: Path,
    *,
    cache_dir: Path,
    batch_size: int = 8,
    shard_size: int = 64,
    show_progress: bool = True,
) -> Path:
    """Run the target once over every regenerated sequence and store float16 features; return the cache dir."""
    if batch_size < 1 or shard_size < 1:
        raise ValueError(f"data.feature_cache: batch_size={batch_size} and shard_size={shard_size} must be >= 1")
    manifest = read_manifest(regen_dir)
    key = feature_cache_key(manifest["key"], target=target)
    out_dir = Path(cache_dir) / "features" / key
    if (out_dir / COMPLETE).exists():
        return out_dir
    dataset = load_regenerated(regen_dir).with_format("torch", columns=["input_ids"])
    num_shards = -(-len(dataset) // shard_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {"key": key, "regen_key": manifest["key"], "target_fingerprint": target.fingerprint,
            "feature_layer_ids": list(target.feature_layer_ids), "hidden_size": target.hidden_size,
            "dtype": str(STORE_DTYPE), "num_sequences": len(dataset), "shard_size": shard_size,
            "num_shards": num_shards}
    _atomic_write(out_dir / MANIFEST, lambda tmp: tmp.write_text(json.dumps(info, indent=2)))
    todo = [s for s in range(num_shards) if not _shard_path(out_dir, s).exists()]
    for shard in tqdm(todo, desc="features", unit="shard", disable=not show_progress):
        start = shard * shard_size
        rows = [dataset[i]["input_ids"] for i in range(start, min(start + shard_size, len(dataset)))]
        tensors = _shard_tensors(target, rows, first_index=start, batch_size=batch_size)
        _atomic_write(_shard_path(out_dir, shard), lambda tmp: save_file(tensors, str(tmp)))
    _atomic_write(out_dir / COMPLETE, lambda tmp: tmp.write_bytes(b""))
    return out_dir


def _shard_tensors(target: Any, rows: list[Tensor], *, first_index: int, batch_size: int) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    for offset in range(0, len(rows), batch_size):
        chunk = rows[offset : offset + batch_size]
        input_ids, attention_mask = pad_right([r.long() for r in chunk], pad_id=0)
        features, final_hidden = compute_features(target, input_ids, attention_mask=attention_mask)
        for j, row in enumerate(chunk):
            index = first_index + offset + j
            tensors[f"features.{index}"] = features[j, : len(row)].to("cpu", STORE_DTYPE).contiguous()
            tensors[f"final_hidden.{index}"] = final_hidden[j, : len(row)].to("cpu", STORE_DTYPE).contiguous()
    return tensors


def pad_right(rows: list[Tensor], *, pad_id: int) -> tuple[Tensor, Tensor]:
    """Stack 1-D long rows into ([B, T_max] right-padded with pad_id, attention_mask [B, T_max] bool)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = True
    return ids, mask


def _shard_path(out_dir: Path, shard: int) -> Path:
    return out_dir / f"features-{shard:05d}.safetensors"


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


class FeatureCache:
    """Read-only view of a finished feature cache: `cache[i] -> (features [T_i, m·d], final_hidden [T_i, d])`.

    Shards are memory-mapped lazily per process (handles are dropped when pickled into DataLoader workers).
    """

    def __init__(self, feature_dir: Path) -> None:
        self.dir = Path(feature_dir)
        if not (self.dir / COMPLETE).exists():
            raise ValueError(
                f"data.feature_cache: {self.dir} is not a complete feature cache; rerun cache_features to finish it"
            )
        self.manifest = json.loads((self.dir / MANIFEST).read_text())
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return int(self.manifest["num_sequences"])

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"feature cache index {index} out of range [0, {len(self)})")
        shard = index // int(self.manifest["shard_size"])
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(_shard_path(self.dir, shard)), framework="pt")
        handle = self._handles[shard]
        return handle.get_tensor(f"features.{index}"), handle.get_tensor(f"final_hidden.{index}")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}
