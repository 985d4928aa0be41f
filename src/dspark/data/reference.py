"""Training sequences from the prompt sets' own reference responses (EAGLE-1's fixed-data training).

`data.responses=reference` builds each sequence as `chat-template prompt ids + reference response ids +
end-of-turn` with `loss_mask = 1` on the response and the end-of-turn token, in exactly the layout of
`regenerate_responses` (manifest, parquet shards, COMPLETE marker), so the feature cache, the DataModule and the
splits work unchanged. No text is generated: building it costs one tokenisation per row. Supervision stays exact
(METHOD §3): every position is trained against the target's own next-token distribution p_t computed from its
features over this text, whatever wrote the text; only the *contexts* differ from what the target would write.

`data.responses=mix` concatenates a reference dataset and a regenerated one (`combine_datasets`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

import pyarrow.parquet as pq

from dspark.data.integrity import building, seal_cache
from dspark.data.regenerate import (
    FORMAT_VERSION,
    MANIFEST,
    RegeneratedSequence,
    _clip,
    _pad_id,
    _write_shard,
    end_of_turn_id,
    shard_path,
)
from dspark.files import atomic_path

RESPONSE_MODES = ("regenerate", "reference", "mix")
REFERENCE_FORMAT = 1
SHARD_ROWS = 512


def has_reference(prompt: Any) -> bool:
    """Whether a prompt record carries a usable reference response."""
    return bool((getattr(prompt, "reference", None) or "").strip())


def reference_cache_key(
    target: Any, prompts: Sequence[Any], *, max_length: int, min_loss_tokens: int, system_prompt: str | None
) -> str:
    """sha256 over everything that determines the reference dataset."""
    payload = {
        "kind": "reference",
        "format": [FORMAT_VERSION, REFERENCE_FORMAT],
        "target": target.fingerprint,
        "prompts": [[p.id, getattr(p, "domain", ""), p.prompt, p.reference] for p in prompts],
        "max_length": max_length,
        "min_loss_tokens": min_loss_tokens,
        "system_prompt": system_prompt,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def reference_sequence(
    target: Any, prompt: Any, *, eot: int, max_length: int, system_prompt: str | None = None
) -> RegeneratedSequence:
    """One sequence: templated prompt + the reference response's tokens + end-of-turn (loss on the response)."""
    prompt_ids = target.chat_prompt_ids(prompt.prompt, system_prompt=system_prompt)
    response = list(target.tokenizer(prompt.reference.strip(), add_special_tokens=False)["input_ids"]) + [eot]
    seq = RegeneratedSequence(
        input_ids=list(prompt_ids) + response,
        loss_mask=[0] * len(prompt_ids) + [1] * len(response),
        prompt_id=prompt.id,
        domain=getattr(prompt, "domain", ""),
    )
    return _clip(seq, max_length)


def build_reference_dataset(
    target: Any,
    prompts: Sequence[Any],
    *,
    cache_dir: Path,
    max_length: int,
    min_loss_tokens: int = 14,
    system_prompt: str | None = None,
) -> Path:
    """Write (or reuse) the reference-response dataset of `prompts`; returns its directory under `cache_dir/regen/`.

    Every prompt must carry a reference (`has_reference`); sequences with fewer than `min_loss_tokens` loss
    tokens after clipping at `max_length` are dropped, as in regeneration.
    """
    missing = [p.id for p in prompts if not has_reference(p)]
    if missing:
        raise ValueError(
            f"data.responses=reference: {len(missing)} prompts have no reference response (e.g. "
            f"{missing[0]!r}); use data.responses=regenerate or mix for such sets"
        )
    if max_length < 2:
        raise ValueError(f"data.max_length={max_length} must be >= 2; set the sequence length cap")
    key = reference_cache_key(
        target, prompts, max_length=max_length, min_loss_tokens=min_loss_tokens, system_prompt=system_prompt
    )
    out_dir = Path(cache_dir) / "regen" / key
    with building(out_dir) as whole:  # one builder at a time; a damaged finished cache comes back unfinished
        if whole:
            return out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        eot = end_of_turn_id(target)
        num_shards = max(1, -(-len(prompts) // SHARD_ROWS))
        totals = {"sequences": 0, "dropped": 0, "generated_tokens": 0, "truncated": 0, "clipped": 0, "loss_tokens": 0}
        for index in range(num_shards):
            rows = [
                reference_sequence(target, p, eot=eot, max_length=max_length, system_prompt=system_prompt)
                for p in prompts[index * SHARD_ROWS : (index + 1) * SHARD_ROWS]
            ]
            kept = [r for r in rows if sum(r.loss_mask) >= min_loss_tokens]
            stats = {
                "sequences": len(kept),
                "dropped": len(rows) - len(kept),
                "generated_tokens": 0,
                "truncated": 0,
                "clipped": sum(r.clipped for r in kept),
                "loss_tokens": sum(sum(r.loss_mask) for r in kept),
            }
            _write_shard(shard_path(out_dir, index), kept, stats)
            totals = {k: totals[k] + stats[k] for k in totals}
        manifest = {
            "key": key,
            "format": FORMAT_VERSION,
            "responses": "reference",
            "target": target.name,
            "target_fingerprint": target.fingerprint,
            "max_length": max_length,
            "min_loss_tokens": min_loss_tokens,
            "num_prompts": len(prompts),
            "num_shards": num_shards,
            "end_of_turn_id": eot,
            "pad_token_id": _pad_id(target),
            "stats": totals,
        }
        seal_cache(out_dir, manifest, [shard_path(out_dir, i).name for i in range(num_shards)])
    return out_dir


def combine_datasets(parts: Sequence[Path], *, cache_dir: Path) -> Path:
    """One dataset directory holding the sequences of `parts` in order (same layout; shards copied, not parsed).

    The parts must come from the same target (same end-of-turn and pad ids). A single part is returned as is.
    """
    parts = [Path(p) for p in parts]
    if len(parts) == 1:
        return parts[0]
    manifests = [json.loads((p / MANIFEST).read_text()) for p in parts]
    for field in ("target_fingerprint", "end_of_turn_id", "pad_token_id"):
        if len({json.dumps(m.get(field)) for m in manifests}) != 1:
            raise ValueError(f"data.responses=mix: the datasets disagree on {field}; they must come from one target")
    key = hashlib.sha256(json.dumps(["combined", [m["key"] for m in manifests]]).encode()).hexdigest()
    out_dir = Path(cache_dir) / "regen" / key
    with building(out_dir) as whole:  # one builder at a time; a damaged finished cache comes back unfinished
        if whole:
            return out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        index = 0
        for part, manifest in zip(parts, manifests):
            for shard in range(manifest["num_shards"]):
                table = pq.read_table(shard_path(part, shard))
                with atomic_path(shard_path(out_dir, index)) as tmp:  # a full disk leaves no half shard
                    pq.write_table(table, tmp)
                index += 1
        stats: dict[str, float] = {}
        for manifest in manifests:
            for name, value in manifest.get("stats", {}).items():
                stats[name] = stats.get(name, 0) + value
        combined = {
            **manifests[0],
            "key": key,
            "responses": "mix",
            "parts": [m["key"] for m in manifests],
            "part_responses": [m.get("responses", "regenerate") for m in manifests],
            "num_prompts": sum(m["num_prompts"] for m in manifests),
            "num_shards": index,
            "stats": stats,
        }
        seal_cache(out_dir, combined, [shard_path(out_dir, i).name for i in range(index)])
    return out_dir
