"""Optional per-token cache of the frozen target's outputs over the regenerated sequences (METHOD §2.1, §3).

Training needs, per token, the concatenated feature-layer outputs `[H_l1; …; H_lm]` (`features` [T, m·d]) and
the final-norm hidden state (`final_hidden` [T, d], whose LM-head image is `p_t`). The target is frozen, so these
never change: computing them once and reading them back trades disk (2·(m+1)·d bytes per token in float16) for
target forwards. `benchmarks/bench_data.py` measures which is faster on a given machine.

Layout: `cache_dir/features/<key>/` in the feature format of `dspark.data.feature_format` (docs/FEATURES.md, version
2, shared with external capture jobs): `manifest.json` (target and tokenizer identity, layer ids, dtype, counts, the
shard table), safetensors shards `features-NNNNN.safetensors` holding `features.<i>`, `final_hidden.<i>`,
`log_normalizer.<i>`, `input_ids.<i>` and `loss_mask.<i>` for global sequence index `i` (load order of
`load_regenerated`; prompt ids and domains in the shard metadata), each written atomically, and a `COMPLETE` marker;
the manifest records every shard's sha256, so a damaged shard is found on reuse and recomputed, and concurrent
builders take turns (`dspark.data.integrity`). `key` hashes the regeneration key, the target fingerprint, the feature
layer ids and the prefill precision (not the format version: version-1 caches, without token ids, keep their keys
and are read as they are); a rerun skips finished shards.

`log_normalizer` [T] fp32 is log Σ_V exp(z) of the target's full-vocabulary logits z = lm_head(final_hidden), computed
from the *stored* (fp16-rounded) final hidden state, so a training step with a draft vocabulary gets exact p_t over
its Vd ids (exp(z_Vd − log Z)) without any full-vocabulary product (a bf16 prefill takes the product in bf16 and
recomputes the logits that carry Z in fp32: `refine_top_logits`). Each shard also holds `target_mass` [V] fp32,
Σ p_t over the positions that predict a supervised token: the target's *expected* token counts, from which the draft
vocabulary is chosen (what the target would write there, not what the reference text wrote: on SmolLM2 an 8k
vocabulary counted on reference tokens covered only 0.83 of p_t on the target's own chat generations).

Prefill runs batched by length (sequences of a shard sorted by length, batches capped by a token budget, so padding
is small) and, on CPUs with bf16 matrix instructions (AMX-BF16 or AVX512-BF16: `dspark.hardware`), under bf16
autocast (~2.5× faster on AMX, ~1.8× on an EPYC Zen 4 with AVX512-BF16; features are stored in fp16 anyway;
measured mean TV of p_t against fp32 0.006, CPU_RECIPE.md). `precision="fp32"` forces the target's own dtype.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm

from dspark.data.feature_format import TargetIdentity, new_manifest, seal_feature_dir, shard_name
from dspark.data.integrity import building, read_cache_manifest, resumable
from dspark.data.regenerate import COMPLETE, MANIFEST, load_regenerated, read_manifest
from dspark.files import atomic_path, atomic_write_text
from dspark.hardware import autocast_linear_weights, uncast_weight

FEATURE_FORMAT_VERSION = 3  # 2: log_normalizer per position, length-batched (optionally bf16) prefill; 3: target_mass
# bf16 caches only (fp32 ones were exact and keep their keys): 1 = log Z and the mass from the logits of a bf16
# lm-head product refined in fp32 near each row's maximum. Before it, a bf16 product's rounded logits (bf16 keeps 8
# bits: ±0.06 at |z| ≈ 20) moved log Z by 0.037 (std; up to 0.2) on SmolLM2, so the training step's fp32 p_t over
# the draft vocabulary summed to more than 1 at a third of the positions (docs/LOG.md).
BF16_LOG_Z_VERSION = 2  # 2: the refinement's fp32 head taken outside the bf16 weight swap (1 used its bf16 copy)
#: logits within this many nats of their row's maximum are recomputed in fp32 after a low-precision product: they
#: carry nearly all of Z (the rest are < e^-6 each, with unbiased rounding); on SmolLM2 ~15–40 per row, log Z error
#: 0.0008 std / 0.008 max against an fp32 product (0.037 / 0.165 unrefined) for ~40% of the bf16 product's time
REFINE_NATS = 6.0
STORE_DTYPE = torch.float16
CACHE_KEY = "paths.root"  # the caches live under <paths.root>/cache: the key a write failure's fix names
PREFILL_PRECISIONS = ("auto", "bf16", "fp32")


def feature_cache_key(regen_key: str, *, target: Any, precision: str = "fp32") -> str:
    """sha256 of what determines the cached tensors: the data, the target weights, the feature layers and the
    prefill precision."""
    payload = [
        FEATURE_FORMAT_VERSION,
        regen_key,
        target.fingerprint,
        list(target.feature_layer_ids),
        str(STORE_DTYPE),
        precision,
    ] + ([BF16_LOG_Z_VERSION] if precision == "bf16" else [])
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def resolve_prefill_precision(precision: str, target: Any, *, key: str = "data.feature_precision") -> str:
    """ "auto" → "bf16" on CPUs with bf16 matrix instructions (and bf16-capable GPUs) when the target is fp32, else
    "fp32". `key` names the config key in the error (feature prefill or regeneration)."""
    if precision not in PREFILL_PRECISIONS:
        raise ValueError(f"{key}={precision!r}: choose one of {', '.join(PREFILL_PRECISIONS)}")
    if precision != "auto":
        return precision
    from dspark.hardware import autocast_dtype

    fp32_target = next(target.model.parameters()).dtype == torch.float32
    return "bf16" if fp32_target and autocast_dtype(target.device) == torch.bfloat16 else "fp32"


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
    token_budget: int = 8192,
    precision: str = "auto",
) -> Path:
    """Run the target once over every sequence and store fp16 features (+ fp32 log-normalisers); return the dir.

    A batch holds at most `batch_size` sequences and `token_budget` padded tokens (length-sorted within a shard).
    """
    if batch_size < 1 or shard_size < 1 or token_budget < 1:
        raise ValueError(
            f"data.feature_cache: batch_size={batch_size}, shard_size={shard_size} and "
            f"token_budget={token_budget} must be >= 1"
        )
    precision = resolve_prefill_precision(precision, target)
    manifest = read_manifest(regen_dir)
    key = feature_cache_key(manifest["key"], target=target, precision=precision)
    out_dir = Path(cache_dir) / "features" / key
    with building(out_dir) as whole:  # one builder at a time; a damaged finished cache comes back unfinished
        if whole:
            return out_dir
        sequences = load_regenerated(regen_dir)
        names, domains = list(sequences["prompt_id"]), list(sequences["domain"])
        dataset = sequences.with_format("torch", columns=["input_ids", "loss_mask"])
        num_shards = -(-len(dataset) // shard_size)
        out_dir.mkdir(parents=True, exist_ok=True)
        info = new_manifest(
            TargetIdentity.of_target(target),
            tokenizer=target.tokenizer,
            dtype=str(STORE_DTYPE).removeprefix("torch."),
            precision=precision,
            shard_size=shard_size,
            num_sequences=len(dataset),
            writer="dspark.data.features",
            end_of_turn_id=manifest.get("end_of_turn_id"),
        ) | {  # our cache's own fields: what its key hashes
            "key": key,
            "regen_key": manifest["key"],
            "target_fingerprint": target.fingerprint,
            "hidden_size": target.hidden_size,
            "format": FEATURE_FORMAT_VERSION,
        }
        atomic_write_text(out_dir / MANIFEST, json.dumps(info, indent=2), key=CACHE_KEY)
        todo = [s for s in range(num_shards) if not _shard_path(out_dir, s).exists()]
        lengths = [len(ids) for ids in dataset["input_ids"]]
        total = sum(sum(lengths[s * shard_size : (s + 1) * shard_size]) for s in todo)
        bar = tqdm(total=total, desc=f"features ({precision})", unit="tok", unit_scale=True, disable=not show_progress)
        started, done = time.perf_counter(), 0
        # bf16: the linear weights cast once for every shard, not by autocast at every layer of every batch
        with autocast_linear_weights(target.model, torch.bfloat16 if precision == "bf16" else None):
            for shard in todo:
                start = shard * shard_size
                items = [dataset[i] for i in range(start, min(start + shard_size, len(dataset)))]
                rows = [item["input_ids"] for item in items]
                tensors = _shard_tensors(
                    target,
                    rows,
                    first_index=start,
                    batch_size=batch_size,
                    token_budget=token_budget,
                    precision=precision,
                    loss_masks=[item["loss_mask"].bool() for item in items],
                )
                part = slice(start, start + len(rows))
                metadata = {"prompt_ids": json.dumps(names[part]), "domains": json.dumps(domains[part])}
                write_shard(_shard_path(out_dir, shard), tensors, metadata=metadata)
                tokens = sum(len(r) for r in rows)
                done += tokens
                bar.update(tokens)
                bar.set_postfix(tok_s=f"{done / max(time.perf_counter() - started, 1e-9):.0f}")
        bar.close()
        info["tokens_per_second"] = done / max(time.perf_counter() - started, 1e-9) if done else None
        seal_feature_dir(out_dir, info)
    return out_dir


def length_batches(lengths: list[int], *, batch_size: int, token_budget: int) -> list[list[int]]:
    """Indices grouped into batches of similar length: ≤ batch_size rows and ≤ token_budget padded tokens
    (a single longer row still gets a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = max([lengths[j] for j in current] + [lengths[i]])
        if current and (len(current) >= batch_size or width * (len(current) + 1) > token_budget):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _shard_tensors(
    target: Any,
    rows: list[Tensor],
    *,
    first_index: int,
    batch_size: int,
    token_budget: int,
    precision: str,
    loss_masks: list[Tensor] | None = None,
) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    mass = torch.zeros(target.vocab_size, dtype=torch.float32)
    device = target.device
    use_bf16 = precision == "bf16"
    # The full-vocabulary product behind log Z and the mass was half of a bf16 prefill's time in fp32 (1.3 ms of
    # 2.9 ms per token on one AMX core); in bf16 it costs a third of that, and the logits that carry Z are then
    # recomputed in fp32 (`refine_top_logits`): the training step reads p_t's draft-vocabulary rows in fp32.
    head_dtype = torch.bfloat16 if use_bf16 else torch.float32
    head_weight = target.lm_head.weight.to(head_dtype)
    for chunk_index in length_batches([len(r) for r in rows], batch_size=batch_size, token_budget=token_budget):
        chunk = [rows[i] for i in chunk_index]
        input_ids, attention_mask = pad_right([r.long() for r in chunk], pad_id=0)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16):
            features, final_hidden = compute_features(target, input_ids, attention_mask=attention_mask)
        stored = [final_hidden[b, : len(row)].to("cpu", STORE_DTYPE).contiguous() for b, row in enumerate(chunk)]
        predicts = []
        for b, (j, row) in enumerate(zip(chunk_index, chunk)):
            index = first_index + j
            tensors[f"features.{index}"] = features[b, : len(row)].to("cpu", STORE_DTYPE).contiguous()
            tensors[f"final_hidden.{index}"] = stored[b]
            tensors[f"input_ids.{index}"] = row.to(torch.int32).contiguous()
            predicts_label = torch.zeros(len(row), dtype=torch.bool)
            if loss_masks is not None:  # position i predicts token i + 1: count where that token is supervised
                predicts_label[:-1] = loss_masks[j][1:]
                tensors[f"loss_mask.{index}"] = loss_masks[j].bool().contiguous()
            predicts.append(predicts_label)
        # one product for the whole batch: its rows are the real positions of every sequence, concatenated
        log_z, batch_mass = log_normalizer_and_mass(
            target, torch.cat(stored), mass_rows=torch.cat(predicts), weight=head_weight
        )
        for j, part in zip(chunk_index, log_z.split([len(r) for r in chunk])):
            tensors[f"log_normalizer.{first_index + j}"] = part.clone()
        mass += batch_mass
    tensors["target_mass"] = mass
    return tensors


@torch.no_grad()
def log_normalizer(target: Any, final_hidden: Tensor, *, chunk: int = 1024) -> Tensor:
    """log Σ_V exp(lm_head(h)) per row of final_hidden [T, d], fp32, in chunks (a [T, V] fp32 block is large)."""
    return log_normalizer_and_mass(target, final_hidden, chunk=chunk)[0]


@torch.no_grad()
def log_normalizer_and_mass(
    target: Any,
    final_hidden: Tensor,
    *,
    mass_rows: Tensor | None = None,
    chunk: int = 1024,
    weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(log Σ_V exp z per row [T] fp32, Σ_{rows in mass_rows} softmax(z) [V] fp32) from final_hidden [T, d].

    mass_rows [T] bool selects the rows whose p_t is summed (None: none, a zero vector). `weight` [V, d] is the
    lm-head weight in the dtype of the product (default: the target's, in fp32); a lower-precision product's logits
    near each row's maximum are recomputed in fp32 (`refine_top_logits`) with the target's head in fp32 (its
    original weights inside `autocast_linear_weights`: `uncast_weight`), so log Z stays within ~1e-2."""
    exact_weight = uncast_weight(target.lm_head).float()
    if weight is None:
        weight = exact_weight
    bias = getattr(target.lm_head, "bias", None)
    out, mass = [], torch.zeros(weight.shape[0], dtype=torch.float32)
    for start in range(0, final_hidden.shape[0], chunk):
        h = final_hidden[start : start + chunk].to(weight.device, weight.dtype)
        logits = torch.nn.functional.linear(h, weight).float()
        if weight.dtype != torch.float32:
            refine_top_logits(
                logits, final_hidden[start : start + chunk].to(weight.device, torch.float32), exact_weight
            )
        if bias is not None:
            logits = logits + bias.float()
        # log Z and the mass from one exp pass, in place: exp(z - max) is both log Z's sum and (divided by it) p_t;
        # each pass over a [T, V] block is memory-bound, and this takes half the passes of logsumexp + softmax
        top = logits.amax(dim=-1, keepdim=True)
        exp_shifted = logits.sub_(top).exp_()
        total = exp_shifted.sum(dim=-1)
        out.append((top.squeeze(-1) + total.log()).cpu())
        if mass_rows is not None:
            keep = mass_rows[start : start + chunk].to(exp_shifted.device)
            if bool(keep.any()):
                mass += ((keep.float() / total) @ exp_shifted).cpu()  # Σ_kept rows exp(z - max) / Σ_V exp(z - max)
    return (torch.cat(out) if out else torch.zeros(0)), mass


@torch.no_grad()
def refine_top_logits(logits: Tensor, hidden: Tensor, weight: Tensor, *, nats: float = REFINE_NATS) -> Tensor:
    """In place: the entries of `logits` [T, V] (fp32 values of a low-precision product, bias not added) within
    `nats` of their row's maximum, recomputed as fp32 dot products of `hidden` [T, d] fp32 and `weight` [V, d] fp32.

    A bf16 product rounds each logit to 8 significant bits (±0.06 at |z| ≈ 20) and its inputs to bf16: summed into
    Z, that moved log Z by up to 0.2 on SmolLM2. The entries near the maximum carry nearly all of Z; the others
    are < e^-nats each and their rounding is unbiased. Returns `logits`."""
    top = logits.amax(dim=-1, keepdim=True)
    rows, cols = (logits > top - nats).nonzero(as_tuple=True)  # row-major: each row's entries are contiguous
    exact = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
    start = 0
    # one [n, d] @ [d] per row: ~7× faster on a CPU than one [P, d] gather of every pair (measured, SmolLM2)
    for row, count in enumerate(torch.bincount(rows, minlength=logits.shape[0]).tolist()):
        if count:
            exact[start : start + count] = weight.index_select(0, cols[start : start + count]) @ hidden[row]
            start += count
    logits[rows, cols] = exact
    return logits


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
    return out_dir / shard_name(shard)


def write_shard(path: Path, tensors: dict[str, Tensor], *, metadata: dict[str, str] | None = None) -> None:
    """Write one shard all-or-nothing (`dspark.files.atomic_path`): a full disk or a read-only cache leaves no
    shard (finished shards stay, so the same command resumes) and raises `OutputError` naming the file, the fix and
    that a rerun resumes (`integrity.resumable`). `metadata`: the safetensors header's string map."""
    with resumable(), atomic_path(path, key=CACHE_KEY) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


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
        self.manifest = read_cache_manifest(self.dir)
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return int(self.manifest["num_sequences"])

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        handle = self._handle(index)
        return handle.get_tensor(f"features.{index}"), handle.get_tensor(f"final_hidden.{index}")

    def target_mass(self) -> Tensor | None:
        """Σ p_t over every supervised position of the cache [V] fp32 (None in caches before format 3)."""
        total = None
        for shard in range(int(self.manifest["num_shards"])):
            with safe_open(str(_shard_path(self.dir, shard)), framework="pt") as handle:
                if "target_mass" not in handle.keys():
                    return None
                part = handle.get_tensor("target_mass")
            total = part if total is None else total + part
        return total

    def log_normalizer(self, index: int) -> Tensor | None:
        """log Σ_V exp(z) per position [T_i] fp32 (None in caches written before format 2)."""
        handle = self._handle(index)
        name = f"log_normalizer.{index}"
        return handle.get_tensor(name) if name in handle.keys() else None

    def _handle(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"feature cache index {index} out of range [0, {len(self)})")
        shard = index // int(self.manifest["shard_size"])
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(_shard_path(self.dir, shard)), framework="pt")
        return self._handles[shard]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}
