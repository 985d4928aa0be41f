"""Data lineage in MLflow: every set a run trains or evaluates on is logged as a dataset input of its run, with a
digest of its content and where it came from, so the MLflow UI shows which data a run saw (issue 55).

What is logged: the training sequences (regenerated, reference, or both for data.responses=mix: one input per
part), the feature cache or the captured features of `data.features_from`, with context "training"; each
evaluation prompt set, with context "evaluation".

How: `mlflow.data.meta_dataset.MetaDataset`, which records a name, a digest and a source but no rows: the caches
are gigabytes of tensors that already sit under paths.root, and `from_pandas` / `from_polars` would compute their
digest over a frame we would first have to build in memory (and record its schema and profile as if the frame
were the data). The inputs go through the run's `MlflowClient.log_inputs` — what `mlflow.log_input` calls — because
our runs are created by the client and are not the fluent API's active run.

Digests name the content: for a sealed cache, the sha256 over its shards' recorded sha256s (the same data gives the
same digest whoever built it, and a rebuilt shard that differs changes it); for an evaluation set, the sha256 of its
prompt ids and templated token ids. 16 hex digits (MLflow keeps up to 36). Sources: a cache directory relative to
paths.root (nothing recorded names a machine's directories), a prompt set's file, hub id or generator, the
regeneration server's URL and `data.features_from` as given; every source and tag goes through
`dspark.config.secrets` first, so a URL's credentials never reach the store.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.config.secrets import mask_text, mask_url

log = logging.getLogger("dspark")
TRAINING, EVALUATION = "training", "evaluation"
DIGEST_CHARS = 16
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class DataInput:
    """One dataset input of a run: `source` is (MLflow source type, its JSON object)."""

    name: str
    digest: str
    source: tuple[str, dict[str, Any]]
    context: str
    tags: dict[str, str] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)


def log_data_inputs(store: Any, run_id: str, inputs: Sequence[DataInput]) -> None:
    """Log `inputs` to the run (masked)."""
    if store is not None and inputs:
        store.client.log_inputs(run_id, datasets=[_dataset_input(item) for item in inputs])


def _dataset_input(item: DataInput) -> Any:
    from mlflow.data.dataset_source_registry import get_dataset_source_from_json
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    kind, where = item.source  # MLflow's own source classes: local (uri), http (url), hugging_face (path), code
    source = get_dataset_source_from_json(json.dumps(where), source_type=kind)
    record = MetaDataset(source, name=item.name, digest=item.digest).to_dict()
    entity = Dataset(
        name=record["name"],
        digest=record["digest"],
        source_type=record["source_type"],
        source=mask_text(record["source"]),
        profile=json.dumps(item.profile) if item.profile else None,
    )
    tags = [InputTag(MLFLOW_DATASET_CONTEXT, item.context)]
    tags += [InputTag(key, mask_text(str(value))[:500]) for key, value in item.tags.items()]
    return DatasetInput(entity, tags)


# ---- training data -----------------------------------------------------------------------------------------------


def training_inputs(regen_dir: Path, feature_dir: Path | None, *, cfg: Any, root: Path) -> list[DataInput]:
    """The inputs of a prepared run: each response part of `regen_dir` (or the captured features of
    data.features_from) and the feature cache."""
    sets = "+".join(cfg.data.train_sets)
    if cfg.data.features_from and feature_dir is not None:
        manifest = _manifest(Path(feature_dir))
        target = manifest.get("target") or {}
        return [
            DataInput(
                name=f"captured-features:{Path(cfg.data.features_from).name}",
                digest=_cache_digest(manifest),
                source=("local", {"uri": mask_url(str(cfg.data.features_from))}),
                context=TRAINING,
                tags={
                    "dspark.kind": "features_from",
                    "dspark.format_version": str(manifest.get("format_version", 1)),
                    "dspark.writer": str(manifest.get("writer", "dspark.data.features")),
                    "dspark.target": str(target.get("name", manifest.get("target_fingerprint", ""))),
                },
                profile=_counts(manifest),
            )
        ]
    manifest = _manifest(Path(regen_dir))
    parts = [Path(regen_dir).parent / key for key in manifest.get("parts", [])] or [Path(regen_dir)]
    inputs = [_sequences_input(part, sets=sets, root=root) for part in parts]
    if feature_dir is not None:
        features = _manifest(Path(feature_dir))
        inputs.append(
            DataInput(
                name=f"target-features:{sets}",
                digest=_cache_digest(features),
                source=("local", {"uri": _portable(Path(feature_dir), root)}),
                context=TRAINING,
                tags={
                    "dspark.kind": "feature_cache",
                    "dspark.feature_layer_ids": json.dumps(features.get("feature_layer_ids")),
                    "dspark.precision": str(features.get("precision")),
                },
                profile=_counts(features),
            )
        )
    return inputs


def _sequences_input(part: Path, *, sets: str, root: Path) -> DataInput:
    manifest = _manifest(part)
    kind = manifest.get("responses", "regenerate")
    backend = manifest.get("backend") if isinstance(manifest.get("backend"), dict) else {}
    tags = {"dspark.kind": kind, "dspark.target": str(manifest.get("target", ""))}
    if backend:  # written by a server (data.regen_backend=openai): the source is its URL, masked
        source = ("http", {"url": mask_url(str(backend.get("url", "")))})
        tags |= {"dspark.backend": str(backend.get("backend")), "dspark.served_model": json.dumps(backend.get("model"))}
    else:
        source = ("local", {"uri": _portable(part, root)})
    if "sampling" in manifest:
        tags["dspark.sampling"] = json.dumps(manifest["sampling"], sort_keys=True)
    stats = manifest.get("stats") or {}
    profile = {k: stats[k] for k in ("sequences", "loss_tokens", "generated_tokens", "truncated") if k in stats}
    label = {"reference": "reference", "features_from": "captured-sequences"}.get(kind, "regenerated")
    return DataInput(f"{label}:{sets}", _cache_digest(manifest), source, TRAINING, tags, profile)


def _manifest(directory: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _cache_digest(manifest: dict[str, Any]) -> str:
    from dspark.data.feature_format import content_digest

    return (content_digest(manifest) or "unknown")[:DIGEST_CHARS]


def _counts(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: manifest[k] for k in ("num_sequences", "num_tokens", "num_shards") if k in manifest}


def _portable(path: Path, root: Path) -> str:
    """`path` relative to paths.root when inside it (no machine's directories in the store), else as given."""
    try:
        return str(Path(path).resolve().relative_to(Path(root).resolve()))
    except ValueError:
        return mask_url(str(path))


# ---- evaluation sets ---------------------------------------------------------------------------------------------


def eval_inputs(prompts: Sequence[Any], *, local_dir: str | None, max_new_tokens: int) -> list[DataInput]:
    """One input per evaluation set of `prompts` (`EvalPrompt`s: dataset, domain, prompt_id, input_ids)."""
    from dspark.data.prompts import resolve_prompt_source

    by_set: dict[str, list[Any]] = {}
    for prompt in prompts:
        by_set.setdefault(prompt.dataset, []).append(prompt)
    inputs = []
    for name, items in by_set.items():
        rows = [[p.prompt_id, list(p.input_ids)] for p in items]
        digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:DIGEST_CHARS]
        found = resolve_prompt_source(name, local_dir=local_dir)
        if found.kind == "hub":
            source = ("hugging_face", {"path": found.hub_id})
        elif found.kind == "file":
            source = ("local", {"uri": _package_relative(found.path)})
        else:
            source = ("code", {"tags": {"generator": f"dspark.data.prompts:{name}"}})
        tags = {"dspark.domain": ",".join(sorted({p.domain for p in items})), "dspark.max_new_tokens": max_new_tokens}
        profile = {"prompts": len(items), "prompt_tokens": sum(len(p.input_ids) for p in items)}
        inputs.append(DataInput(f"eval:{name}", digest, source, EVALUATION, tags, profile))
    return inputs


def _package_relative(path: Path) -> str:
    """A vendored prompt file as `dspark/data/prompt_sets/<file>` (the same on every checkout); others as given."""
    import dspark

    try:
        return str(Path(path).resolve().relative_to(Path(dspark.__file__).resolve().parent.parent))
    except ValueError:
        return mask_url(str(path))


def log_training_data(ctx: Any, prepared: Any) -> None:
    """The prepare stage's data as the run's training inputs (`ctx`: the StageContext; `prepared`: PreparedData)."""
    with _never_fatal():
        inputs = training_inputs(prepared.regen_dir, prepared.feature_dir, cfg=ctx.cfg, root=ctx.paths.root)
        log_data_inputs(ctx.store, ctx.run_id, inputs)


def log_eval_data(ctx: Any, prompts: Sequence[Any]) -> None:
    """The evaluation prompt sets as the run's evaluation inputs."""
    cfg = ctx.cfg
    with _never_fatal():
        inputs = eval_inputs(prompts, local_dir=cfg.data.local_dir, max_new_tokens=cfg.decode.max_new_tokens)
        log_data_inputs(ctx.store, ctx.run_id, inputs)


@contextmanager
def _never_fatal() -> Iterator[None]:
    """Lineage is a record of the run, not a step it needs: a failure to log it is a warning."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 — a store hiccup or an unreadable manifest
        log.warning("could not log the run's dataset inputs: %s", mask_text(str(err)))
