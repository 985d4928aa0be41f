"""The on-disk format of captured target features (docs/FEATURES.md): one definition for our feature cache
(`dspark.data.features.cache_features`), external capture jobs (`tools/write_features.py` shows one) and the
validation `data.features_from=DIR` runs before any work.

A feature directory holds `manifest.json`, shards `features-NNNNN.safetensors` (shard s holds global sequences
s·shard_size … s·shard_size + shard_size − 1) and an empty `COMPLETE` marker written last. Per sequence i, unpadded,
T_i tokens: `features.<i>` [T_i, m·d] (the m feature layers' raw outputs, concatenated in layer-id order),
`final_hidden.<i>` [T_i, d] (final-norm hidden state), `log_normalizer.<i>` [T_i] fp32 (log Σ_V exp lm_head(h) of
the *stored* h), `input_ids.<i>` [T_i] int32 and `loss_mask.<i>` [T_i] bool (1 on the tokens the drafter learns to
write); per shard, optionally, `target_mass` [V] fp32. The safetensors metadata may carry `prompt_ids` and `domains`
(JSON lists in sequence order). `features` and `final_hidden` share the manifest's `dtype`.

Versions: 1 = our caches before this module (no token ids, no target or tokenizer identity: reusable as
`data.features_from` only beside their own regenerated dataset, checked by our target fingerprint); 2 = this layout.
`FEATURE_FORMAT_VERSION` of features.py (the cache *key*'s recipe version) is a different number and did not move,
so caches written before version 2 keep their keys.

Checks and when (ValueErrors name `data.features_from`, the file, the field and the fix): preflight (before any work,
no model loaded) reads the manifest, the target's config.json where it is on disk (structure: model type, layers,
hidden size, vocabulary, feature layer ids, name), every shard's safetensors header (names, shapes, dtypes, index
ranges, counts) and size, and the sha256 of every shard when the directory holds at most `PREFLIGHT_HASH_BYTES`;
prepare (target loaded, before training) repeats them against the loaded target, adds the weights and tokenizer
digests and the sha256 of every shard not yet verified in this process, and the token ids' range.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.data.integrity import COMPLETE, MANIFEST, damaged_files, file_digest, seal_cache

FORMAT_NAME = "dspark-features"
FORMAT_VERSION = 2
KNOWN_VERSIONS = (1, 2)
KEY = "data.features_from"
#: a directory up to this size is hashed in preflight (~2.5 s at 0.4 GB/s on 2 busy cores); larger ones at prepare
PREFLIGHT_HASH_BYTES = 1 << 30
FEATURE_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}  # manifest name → safetensors name
PRECISIONS = ("fp32", "bf16", "fp16")
TOKEN_DTYPES = ("I32", "I64")
MASK_DTYPES = ("BOOL", "U8", "I8")
PER_SEQUENCE = ("features", "final_hidden", "log_normalizer", "input_ids", "loss_mask")
SHARD_TENSORS = ("target_mass",)
MAX_LISTED = 8  # errors listed per directory; the rest are counted
FIX = "rewrite it as docs/FEATURES.md describes (tools/write_features.py is a reference writer)"
_DIGEST_SAMPLES = 256


def shard_name(index: int) -> str:
    return f"features-{index:05d}.safetensors"


@dataclass(frozen=True)
class TargetIdentity:
    """What a feature directory must agree with: the target's structure and, where known, its weights and tokenizer.

    `weights_digest` / `tokenizer_digest` (`weights_digest`, `tokenizer_digest` below) are None where not known yet
    (preflight reads config.json only)."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    feature_layer_ids: tuple[int, ...]
    weights_digest: str | None = None
    tokenizer_digest: str | None = None
    revision: str | None = None

    @classmethod
    def of_target(cls, target: Any) -> TargetIdentity:
        """The identity of a loaded `dspark.targets.Target` (digests included)."""
        return cls(
            name=str(target.name),
            model_type=str(getattr(target.hf_config, "model_type", "")),
            num_layers=int(target.num_layers),
            hidden_size=int(target.hidden_size),
            vocab_size=int(target.vocab_size),
            feature_layer_ids=tuple(int(i) for i in target.feature_layer_ids),
            weights_digest=weights_digest(target.model),
            tokenizer_digest=tokenizer_digest(target.tokenizer),
            revision=getattr(target.hf_config, "_commit_hash", None),
        )

    def manifest_fields(self) -> dict[str, Any]:
        """The manifest's `target` object and `feature_layer_ids` (docs/FEATURES.md)."""
        target = {k: v for k, v in asdict(self).items() if k not in ("feature_layer_ids", "tokenizer_digest")}
        return {"target": target, "feature_layer_ids": list(self.feature_layer_ids)}


@torch.no_grad()
def weights_digest(model: Any) -> str:
    """sha256 of the model's config (load-time fields left out) and of a strided sample of 256 values of every
    parameter, rounded to bfloat16: a bf16 and an fp32 load of one checkpoint agree, any retrained matrix differs.
    Cheap at any size (no full-tensor pass); the names are the transformers parameter names."""
    digest = hashlib.sha256()
    config = {
        k: v
        for k, v in model.config.to_dict().items()
        if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype", "name_or_path")
    }
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _DIGEST_SAMPLES)][:_DIGEST_SAMPLES].to("cpu", torch.bfloat16)
        digest.update(f"{name}:{tuple(param.shape)}".encode())
        digest.update(sample.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary (token → id, added tokens included): what the stored ids mean."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def new_manifest(
    identity: TargetIdentity,
    *,
    tokenizer: Any,
    dtype: str,
    precision: str,
    shard_size: int,
    num_sequences: int,
    writer: str,
    end_of_turn_id: int | None = None,
) -> dict[str, Any]:
    """A version-2 manifest before sealing (`seal_feature_dir` adds the shard table, token count and checksums)."""
    if dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype {dtype!r}: choose one of {', '.join(FEATURE_DTYPES)}")
    return {
        "format_name": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **identity.manifest_fields(),
        "tokenizer": {
            "name": str(getattr(tokenizer, "name_or_path", "")),
            "size": len(tokenizer),
            "vocab_digest": tokenizer_digest(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "end_of_turn_id": end_of_turn_id,
        },
        "dtype": dtype,
        "precision": precision,
        "num_sequences": int(num_sequences),
        "shard_size": int(shard_size),
        "num_shards": -(-int(num_sequences) // int(shard_size)),
        "writer": writer,
    }


def seal_feature_dir(out_dir: Path, manifest: dict[str, Any]) -> None:
    """Add the shard table (from the shards' headers) and the token count, then the checksums and the COMPLETE
    marker (`dspark.data.integrity.seal_cache`): the last step of every writer."""
    out_dir = Path(out_dir)
    files = [shard_name(s) for s in range(int(manifest["num_shards"]))]
    table = []
    for s, name in enumerate(files):
        header = read_header(out_dir / name)
        lengths = {i: shape[0] for (kind, i), (_, shape) in header.items() if kind in ("input_ids", "features")}
        first = s * int(manifest["shard_size"])
        table.append(
            {"file": name, "first_index": first, "num_sequences": len(lengths), "num_tokens": sum(lengths.values())}
        )
    manifest["shards"] = table
    manifest["num_tokens"] = sum(entry["num_tokens"] for entry in table)
    seal_cache(out_dir, manifest, files)


def read_header(path: Path) -> dict[tuple[str, int | None], tuple[str, list[int]]]:
    """{(kind, sequence index or None): (safetensors dtype, shape)} of one shard, from its header only."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as handle:
        names = handle.keys()
        for name in names:
            piece = handle.get_slice(name)
            kind, _, index = name.partition(".")
            out[(kind, int(index) if index.isdigit() else None)] = (piece.get_dtype(), list(piece.get_shape()))
    return out


def read_metadata(path: Path) -> dict[str, str]:
    """A shard's safetensors metadata (`prompt_ids`, `domains`: JSON lists), {} when it has none."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return dict(handle.metadata() or {})


# ---- validation -------------------------------------------------------------------------------------------------


def format_version(manifest: dict[str, Any]) -> int | None:
    """2+ as declared; 1 for our caches written before the field existed; None when it is not a feature manifest."""
    if "format_version" in manifest:
        version = manifest["format_version"]
        return version if isinstance(version, int) else None
    return 1 if "target_fingerprint" in manifest and "feature_layer_ids" in manifest else None


def feature_dir_errors(
    path: Path, *, expected: TargetIdentity | None, verify_hashes: bool | None = None, fingerprint: str | None = None
) -> list[str]:
    """Every problem of the feature directory `path` against the run's target `expected` (None: the manifest's own
    declarations only), each naming the file and field; [] when it can be trained on.

    verify_hashes: True = sha256 of every shard (cached per process), None = only when the shards total at most
    `PREFLIGHT_HASH_BYTES`. `fingerprint`: the loaded target's `fingerprint`, which version-1 caches record."""
    where = f"{KEY}={path}"
    if not path.is_dir():
        return [f"{where}: no such directory; point it at a directory written in the format of docs/FEATURES.md"]
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        reason = "it is missing" if isinstance(err, FileNotFoundError) else f"it cannot be read ({err})"
        return [f"{where}: {MANIFEST}: {reason}; every feature directory starts with one ({FIX})"]
    if not isinstance(manifest, dict):
        return [f"{where}: {MANIFEST} is not a JSON object; {FIX}"]
    version = format_version(manifest)
    if version not in KNOWN_VERSIONS:
        found = manifest.get("format_version", "absent")
        known = ", ".join(map(str, KNOWN_VERSIONS))
        return [f"{where}: {MANIFEST}: format_version={found} is not one this dspark reads ({known}); {FIX}"]
    if not (path / COMPLETE).exists():
        return [f"{where}: no {COMPLETE} marker: the writer did not finish; write the marker (an empty file) last"]
    errors = _manifest_errors(manifest, version)
    if not errors and version == 1 and not (_v1_regen_dir(path, manifest) / COMPLETE).exists():
        regen = _v1_regen_dir(path, manifest)
        errors = [f"a version-1 cache holds no token ids and its regenerated dataset {regen} is missing; {FIX}"]
    if not errors:
        errors = _identity_errors(manifest, version, expected, fingerprint)
    if not errors:
        errors = _shard_errors(path, manifest, version)
    if not errors and (verify_hashes or (verify_hashes is None and _total_bytes(manifest) <= PREFLIGHT_HASH_BYTES)):
        errors = _hash_errors(path, manifest)
    shown = [f"{where}: {e}" for e in errors[:MAX_LISTED]]
    return shown + ([f"{where}: ... and {len(errors) - MAX_LISTED} more"] if len(errors) > MAX_LISTED else [])


def validate_feature_dir(
    path: Path, *, expected: TargetIdentity | None, verify_hashes: bool | None = None, fingerprint: str | None = None
) -> dict[str, Any]:
    """`feature_dir_errors` as one ValueError (all problems listed); returns the manifest when there are none."""
    errors = feature_dir_errors(Path(path), expected=expected, verify_hashes=verify_hashes, fingerprint=fingerprint)
    if errors:
        raise ValueError("\n  ".join(["the feature directory cannot be trained on:", *errors]))
    return json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8"))


_REQUIRED = {
    1: (
        "feature_layer_ids",
        "hidden_size",
        "num_sequences",
        "shard_size",
        "num_shards",
        "target_fingerprint",
        "regen_key",
    ),
    2: (
        "target",
        "tokenizer",
        "feature_layer_ids",
        "dtype",
        "precision",
        "num_sequences",
        "num_tokens",
        "shard_size",
        "num_shards",
        "shards",
        "checksums",
    ),
}
_TARGET_FIELDS = ("name", "model_type", "num_layers", "hidden_size", "vocab_size")


def _manifest_errors(manifest: dict[str, Any], version: int) -> list[str]:
    missing = [f for f in _REQUIRED[version] if f not in manifest]
    if version == 2:
        target, tokenizer = (
            m if isinstance(m, dict) else {} for m in (manifest.get("target"), manifest.get("tokenizer"))
        )
        missing += [f"target.{f}" for f in _TARGET_FIELDS if f not in target]
        missing += [f"tokenizer.{f}" for f in ("size", "vocab_digest") if f not in tokenizer]
    if missing:
        return [f"{MANIFEST}: field {f!r} is missing; {FIX}" for f in missing]
    ints = [manifest["feature_layer_ids"]] + (
        [[manifest["target"][f] for f in _TARGET_FIELDS[2:]]] if version == 2 else []
    )
    if not all(isinstance(v, list) and v and all(type(i) is int for i in v) for v in ints):
        return [f"{MANIFEST}: feature_layer_ids and target.num_layers / hidden_size / vocab_size must be integers"]
    if version == 2 and not (isinstance(manifest["shards"], list) and isinstance(manifest["checksums"], dict)):
        return [f"{MANIFEST}: shards must be a list and checksums an object; seal the directory (seal_feature_dir)"]
    errors = []
    for field in ("num_sequences", "shard_size", "num_shards"):
        if not isinstance(manifest[field], int) or manifest[field] < (0 if field == "num_sequences" else 1):
            errors.append(f"{MANIFEST}: {field}={manifest[field]!r} must be a positive integer")
    if not errors and manifest["num_shards"] != -(-manifest["num_sequences"] // manifest["shard_size"]):
        errors.append(
            f"{MANIFEST}: num_shards={manifest['num_shards']} but {manifest['num_sequences']} sequences in shards of "
            f"{manifest['shard_size']} need {-(-manifest['num_sequences'] // manifest['shard_size'])}"
        )
    if version == 2 and manifest["dtype"] not in FEATURE_DTYPES:
        errors.append(f"{MANIFEST}: dtype={manifest['dtype']!r} is not allowed; use one of {', '.join(FEATURE_DTYPES)}")
    if version == 2 and manifest["precision"] not in PRECISIONS:
        errors.append(f"{MANIFEST}: precision={manifest['precision']!r}: use one of {', '.join(PRECISIONS)}")
    return errors


def _identity_errors(
    manifest: dict[str, Any], version: int, expected: TargetIdentity | None, fingerprint: str | None
) -> list[str]:
    if expected is None:
        return []
    errors = []
    ids = [int(i) for i in manifest["feature_layer_ids"]]
    if ids != list(expected.feature_layer_ids):
        errors.append(
            f"{MANIFEST}: feature_layer_ids={ids} but the run's target uses {list(expected.feature_layer_ids)} "
            "(model.feature_layers); capture those layers or set model.feature_layers to the directory's"
        )
    if version == 1:
        if manifest["hidden_size"] != expected.hidden_size:
            errors.append(
                f"{MANIFEST}: hidden_size={manifest['hidden_size']} but the target's is {expected.hidden_size}"
            )
        if fingerprint is not None and manifest["target_fingerprint"] != fingerprint:
            errors.append(
                f"{MANIFEST}: target_fingerprint differs from the run's target: this version-1 cache was written for "
                "other weights (or another dtype); set target= to its target or capture features anew"
            )
        return errors
    target = manifest["target"]
    for field in ("num_layers", "hidden_size", "vocab_size"):
        if target[field] != getattr(expected, field):
            errors.append(
                f"{MANIFEST}: target.{field}={target[field]} but the run's target {expected.name} has "
                f"{getattr(expected, field)}; these features belong to another model: set target= to it"
            )
    if target["model_type"] and expected.model_type and target["model_type"] != expected.model_type:
        errors.append(f"{MANIFEST}: target.model_type={target['model_type']!r}, the run's is {expected.model_type!r}")
    weights = target.get("weights_digest")
    if weights and expected.weights_digest and weights != expected.weights_digest:
        errors.append(
            f"{MANIFEST}: target.weights_digest differs from the run's target {expected.name}: the features were "
            "captured from other weights; capture them from this checkpoint or set target= to the one used"
        )
    elif not weights and not _same_name(target["name"], expected.name):
        errors.append(
            f"{MANIFEST}: target.name={target['name']!r} but the run's target is {expected.name!r}, and no "
            "target.weights_digest proves they are the same weights; set target= to it or record the digest "
            "(dspark.data.feature_format.weights_digest)"
        )
    vocab = manifest["tokenizer"]["vocab_digest"]
    if expected.tokenizer_digest and vocab and vocab != expected.tokenizer_digest:
        errors.append(
            f"{MANIFEST}: tokenizer.vocab_digest differs from the run's target's tokenizer: the stored token ids mean "
            "other tokens; capture with the target's own tokenizer"
        )
    return errors


def _same_name(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def _shard_errors(path: Path, manifest: dict[str, Any], version: int) -> list[str]:
    shard_size, total = manifest["shard_size"], manifest["num_sequences"]
    m, d = len(manifest["feature_layer_ids"]), _hidden(manifest)
    dtype = FEATURE_DTYPES.get(manifest.get("dtype"), "F16")  # version 1 stored float16
    table = {e.get("file"): e for e in manifest.get("shards", []) if isinstance(e, dict)}
    checksums = manifest.get("checksums") or {}
    errors, tokens = [], 0
    for s in range(manifest["num_shards"]):
        name = shard_name(s)
        first, count = s * shard_size, min(shard_size, total - s * shard_size)
        file = path / name
        if not file.is_file():
            errors.append(f"{name}: missing (the manifest declares {manifest['num_shards']} shards)")
            continue
        if name in checksums and file.stat().st_size != checksums[name].get("bytes"):
            errors.append(
                f"{name}: {file.stat().st_size} bytes, the manifest's checksums say {checksums[name].get('bytes')}"
            )
            continue
        if version == 2 and name not in checksums:
            errors.append(
                f"{MANIFEST}: checksums has no entry for {name}; seal the directory after writing every shard"
            )
            continue
        try:
            header = read_header(file)
        except Exception as err:  # noqa: BLE001 — a cut-off or foreign file raises the parser's own error types
            errors.append(f"{name}: not a readable safetensors file ({type(err).__name__}: {err})")
            continue
        kinds = PER_SEQUENCE if version == 2 else PER_SEQUENCE[:2]
        shard_errors, shard_tokens = _sequence_errors(
            header, kinds=kinds, first=first, count=count, m=m, d=d, dtype=dtype
        )
        errors += [f"{name}: {e}" for e in shard_errors]
        tokens += shard_tokens
        entry = table.get(name)
        if version == 2 and not shard_errors:
            want = {"first_index": first, "num_sequences": count, "num_tokens": shard_tokens}
            if entry is None or any(entry.get(k) != v for k, v in want.items()):
                errors.append(f"{MANIFEST}: shards entry of {name} is {entry}, its header says {want}")
    if version == 2 and not errors and tokens != manifest["num_tokens"]:
        errors.append(f"{MANIFEST}: num_tokens={manifest['num_tokens']} but the shards hold {tokens}")
    return errors


def _hidden(manifest: dict[str, Any]) -> int:
    return int(manifest["target"]["hidden_size"] if "target" in manifest else manifest["hidden_size"])


def _sequence_errors(
    header: dict, *, kinds: tuple[str, ...], first: int, count: int, m: int, d: int, dtype: str
) -> tuple[list[str], int]:
    """Errors of one shard's tensors (names, index range, shapes, dtypes) and its token count."""
    errors = []
    indices = range(first, first + count)
    unknown = sorted(
        f"{k}.{i}" if i is not None else k
        for k, i in header
        if not ((k in PER_SEQUENCE and i is not None) or (k in SHARD_TENSORS and i is None))
    )
    if unknown:
        errors.append(f"tensor {unknown[0]!r} is not part of the format (names: {', '.join(PER_SEQUENCE)}.<i>)")
    stray = sorted(i for k, i in header if k in PER_SEQUENCE and i is not None and i not in indices)
    if stray:
        errors.append(f"holds sequence {stray[0]}, outside its range {first}..{first + count - 1} (shard_size)")
    tokens = 0
    for i in indices:
        length = None
        for kind in kinds:
            if (kind, i) not in header:
                errors.append(f'tensor "{kind}.{i}" is missing')
                continue
            got_dtype, shape = header[(kind, i)]
            length = shape[0] if length is None and shape else length
            want_shape, want_dtypes, what = _expected(kind, length, m=m, d=d, dtype=dtype)
            if shape != want_shape:
                errors.append(f'tensor "{kind}.{i}" has shape {shape}, expected {want_shape} ({what})')
            elif got_dtype not in want_dtypes:
                errors.append(f'tensor "{kind}.{i}" has dtype {got_dtype}, expected {" or ".join(want_dtypes)}')
        if length is not None and length < 2:
            errors.append(f"sequence {i} has {length} tokens; a training sequence needs at least 2")
        tokens += length or 0
    if ("target_mass", None) in header and header[("target_mass", None)][0] != "F32":
        errors.append(f'tensor "target_mass" has dtype {header[("target_mass", None)][0]}, expected F32')
    return errors, tokens


def _expected(kind: str, length: int | None, *, m: int, d: int, dtype: str) -> tuple[list[int], tuple[str, ...], str]:
    """(shape, allowed safetensors dtypes, what fixes the shape) of one per-sequence tensor of `length` tokens."""
    if kind == "features":
        return [length, m * d], (dtype,), f"m·d = {m}·{d}: the feature layers' outputs, concatenated"
    if kind == "final_hidden":
        return [length, d], (dtype,), f"target hidden_size {d}"
    if kind == "log_normalizer":
        return [length], ("F32",), "one fp32 value per token"
    if kind == "input_ids":
        return [length], TOKEN_DTYPES, "one id per token"
    return [length], MASK_DTYPES, "one flag per token"


def _total_bytes(manifest: dict[str, Any]) -> int:
    return sum(int(v.get("bytes", 0)) for v in (manifest.get("checksums") or {}).values())


def _hash_errors(path: Path, manifest: dict[str, Any]) -> list[str]:
    bad = damaged_files(path)  # cached per process: a directory verified in preflight is not read again
    if bad is None:
        return [] if format_version(manifest) == 1 else [f"{MANIFEST}: checksums are missing; seal the directory"]
    recorded = manifest["checksums"]
    return [
        f"{name}: sha256 {file_digest(path / name)['sha256'][:12]}… differs from the manifest's "
        f"{recorded[name]['sha256'][:12]}… (a damaged or rewritten shard); copy it again or recapture it"
        if (path / name).is_file()
        else f"{name}: missing"
        for name in bad
    ]


def content_digest(manifest: dict[str, Any]) -> str:
    """sha256 over a sealed directory's recorded (file, sha256) pairs: names the data itself, whoever wrote it
    (the manifest's `key`, where it has none)."""
    recorded = manifest.get("checksums") or {}
    if not recorded:
        return str(manifest.get("key", ""))
    pairs = sorted((name, entry.get("sha256", "")) for name, entry in recorded.items())
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()


# ---- data.features_from: preflight and prepare -----------------------------------------------------------------


def preflight_errors(cfg: Any) -> list[str]:
    """`data.features_from` checked before any work (`dspark.stages.experiment.preflight`): [] when unset or sound."""
    if not cfg.data.features_from:
        return []
    return feature_dir_errors(Path(cfg.data.features_from).expanduser(), expected=identity_from_config(cfg))


def identity_from_config(cfg: Any) -> TargetIdentity | None:
    """The run's target structure from its config.json, no weights loaded; None where that file is not on disk yet
    (a built-in target not built yet, an uncached hub id, a .gguf file): prepare checks against the loaded target."""
    path = _config_json(cfg.target)
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, ValueError):
        return None  # `dspark.targets.checks.check_target` reports a broken config.json
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    sizes = [text.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")]
    if not all(isinstance(v, int) for v in sizes):
        return None
    from dspark.targets.base import resolve_feature_layer_ids

    try:
        ids = resolve_feature_layer_ids(
            list(cfg.model.feature_layers) or None, num_layers=sizes[0], num_default=cfg.model.num_feature_layers
        )
    except ValueError:
        return None  # model.feature_layers is reported by the target's own checks
    local = Path(cfg.target).expanduser()
    return TargetIdentity(
        name=str(local.resolve()) if local.is_dir() else cfg.target,
        model_type=str(config.get("model_type", "")),
        num_layers=sizes[0],
        hidden_size=sizes[1],
        vocab_size=sizes[2],
        feature_layer_ids=tuple(ids),
    )


def _config_json(name: str) -> Path | None:
    from dspark.targets.builtin import TARGETS

    local = Path(name).expanduser()
    if local.is_dir():
        return local / "config.json" if (local / "config.json").is_file() else None
    if name in TARGETS.names() or local.suffix == ".gguf":
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 — not a valid hub id: the target's own checks say so
        return None
    return Path(hit) if isinstance(hit, str) else None


def load_external_features(target: Any, path: Path, *, cache_dir: Path) -> tuple[Path, Path]:
    """(training-sequence directory, feature directory) for `data.features_from=path`, after every check against the
    loaded `target` (weights and tokenizer digests, every shard's sha256). Version 1: our own cache beside its
    regenerated dataset; version 2: the token ids and loss masks copied out of the shards into the layout of
    `dspark.data.regenerate` (cached by the shards' content digest), so the DataModule and splits run unchanged."""
    path = Path(path).expanduser()
    manifest = validate_feature_dir(
        path, expected=TargetIdentity.of_target(target), verify_hashes=True, fingerprint=target.fingerprint
    )
    if format_version(manifest) == 1:
        return _v1_regen_dir(path, manifest), path
    return _sequences_from_shards(path, manifest, target=target, cache_dir=Path(cache_dir)), path


def _v1_regen_dir(path: Path, manifest: dict[str, Any]) -> Path:
    return path.parent.parent / "regen" / str(manifest.get("regen_key", ""))


def _sequences_from_shards(path: Path, manifest: dict[str, Any], *, target: Any, cache_dir: Path) -> Path:
    from safetensors import safe_open

    from dspark.data.integrity import building
    from dspark.data.regenerate import FORMAT_VERSION as SEQUENCE_FORMAT
    from dspark.data.regenerate import RegeneratedSequence, _pad_id, _write_shard, end_of_turn_id, shard_path

    digest = content_digest(manifest)
    key = hashlib.sha256(json.dumps(["features_from", SEQUENCE_FORMAT, digest, target.fingerprint]).encode())
    out_dir = cache_dir / "regen" / key.hexdigest()
    with building(out_dir) as whole:  # one builder at a time; a damaged finished copy comes back unfinished
        if whole:
            return out_dir
        totals = {"sequences": 0, "dropped": 0, "generated_tokens": 0, "truncated": 0, "clipped": 0, "loss_tokens": 0}
        for s, entry in enumerate(manifest["shards"]):
            meta = read_metadata(path / entry["file"])
            names = json.loads(meta.get("prompt_ids", "null")) or []
            domains = json.loads(meta.get("domains", "null")) or []
            rows = []
            with safe_open(str(path / entry["file"]), framework="pt") as handle:
                for j, i in enumerate(range(entry["first_index"], entry["first_index"] + entry["num_sequences"])):
                    ids, mask = handle.get_tensor(f"input_ids.{i}"), handle.get_tensor(f"loss_mask.{i}")
                    _check_token_ids(ids, target=target, where=f"{KEY}={path}: {entry['file']}: input_ids.{i}")
                    rows.append(
                        RegeneratedSequence(
                            input_ids=ids.tolist(),
                            loss_mask=mask.to(torch.int8).tolist(),
                            prompt_id=str(names[j]) if j < len(names) else f"features-{i}",
                            domain=str(domains[j]) if j < len(domains) else "",
                        )
                    )
            stats = {**dict.fromkeys(totals, 0), "sequences": len(rows)}
            stats["loss_tokens"] = sum(sum(r.loss_mask) for r in rows)
            _write_shard(shard_path(out_dir, s), rows, stats)
            totals = {k: totals[k] + stats[k] for k in totals}
        sequences = {
            "key": key.hexdigest(),
            "format": SEQUENCE_FORMAT,
            "responses": "features_from",
            "features_digest": digest,
            "target": target.name,
            "target_fingerprint": target.fingerprint,
            "num_prompts": manifest["num_sequences"],
            "num_shards": len(manifest["shards"]),
            "end_of_turn_id": end_of_turn_id(target),
            "pad_token_id": _pad_id(target),
            "stats": totals,
        }
        seal_cache(out_dir, sequences, [shard_path(out_dir, s).name for s in range(len(manifest["shards"]))])
    return out_dir


def _check_token_ids(ids: torch.Tensor, *, target: Any, where: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size):
        raise ValueError(
            f"{where}: token ids span [{int(ids.min())}, {int(ids.max())}], outside the target's vocabulary "
            f"[0, {target.vocab_size}); the shard was tokenized for another model"
        )
    if bool((ids == target.mask_token_id).any()):
        raise ValueError(
            f"{where}: holds the reserved MASK id {target.mask_token_id}, which must never occur in the data; choose "
            "another unused id with target_options.mask_token_id=<id>"
        )
