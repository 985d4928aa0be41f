"""Stage `prepare`: training prompts → target-regenerated responses (cached, resumable) → optional feature cache."""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

from dspark.data.prompts import PromptRecord, load_prompts
from dspark.data.regenerate import SamplingConfig, load_regenerated, read_manifest, regenerate_responses
from dspark.stages.context import StageContext

log = logging.getLogger("dspark")


@dataclass
class PreparedData:
    regen_dir: Path
    feature_dir: Path | None
    num_sequences: int
    stats: dict


def collect_train_prompts(ctx: StageContext) -> list[PromptRecord]:
    """`data.num_train_prompts` prompts, round-robin over `data.train_sets`, each set shuffled by `seed`."""
    data = ctx.cfg.data
    pools = []
    for name in data.train_sets:
        if name == "synthetic":
            pool = load_prompts(name, limit=data.num_train_prompts, seed=ctx.cfg.seed, local_dir=_local(ctx))
        else:
            pool = load_prompts(name, selection="all", local_dir=_local(ctx), cache_dir=ctx.paths.cache / "datasets")
            random.Random(ctx.cfg.seed).shuffle(pool)
        pools.append(pool)
    prompts: list[PromptRecord] = []
    for i in range(max(len(p) for p in pools)):
        prompts.extend(pool[i] for pool in pools if i < len(pool))
        if len(prompts) >= data.num_train_prompts:
            break
    return prompts[: data.num_train_prompts]


def _local(ctx: StageContext) -> Path | None:
    return Path(ctx.cfg.data.local_dir).expanduser() if ctx.cfg.data.local_dir else None


def sampling_config(ctx: StageContext) -> SamplingConfig:
    s = ctx.cfg.data.sampling
    return SamplingConfig(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                          batch_size=s.batch_size, system_prompt=s.system_prompt)


def run_prepare(ctx: StageContext) -> PreparedData:
    """Regenerate (or reuse) the training data and, if `data.cache_features`, the per-token target features."""
    target = ctx.load_target()
    prompts = collect_train_prompts(ctx)
    log.info("regenerating responses to %d prompts from %s", len(prompts), ", ".join(ctx.cfg.data.train_sets))
    regen_dir = regenerate_responses(target, prompts, sampling=sampling_config(ctx), cache_dir=ctx.paths.cache,
                                     seed=ctx.cfg.seed, max_length=ctx.cfg.data.max_length)
    dataset = load_regenerated(regen_dir)
    check_mask_token_absent(dataset["input_ids"], mask_token_id=target.mask_token_id)
    feature_dir = None
    if ctx.cfg.data.cache_features:
        from dspark.data.features import cache_features

        feature_dir = cache_features(target, regen_dir, cache_dir=ctx.paths.cache,
                                     batch_size=max(1, ctx.cfg.data.batch_size))
    stats = read_manifest(regen_dir).get("stats", {})
    log.info("prepared %d sequences under %s", len(dataset), regen_dir)
    return PreparedData(regen_dir=regen_dir, feature_dir=feature_dir, num_sequences=len(dataset), stats=stats)


def held_out_prompts(ctx: StageContext, prepared: PreparedData | None) -> list[PromptRecord]:
    """The training prompts of the regenerated data's calibration split (never trained on), for STS; none when
    this invocation did not prepare the data."""
    from dspark.evaluation.calibrate import regenerated_calibration_split

    if prepared is None or ctx.cfg.data.calib_fraction <= 0:
        return []
    return regenerated_calibration_split(collect_train_prompts(ctx), prepared.regen_dir, data=ctx.cfg.data,
                                         seed=ctx.cfg.seed)


def check_mask_token_absent(sequences, *, mask_token_id: int) -> None:
    """The MASK row must never occur in the data (METHOD §2.1); a scan proves it for this dataset."""
    for i, ids in enumerate(sequences):
        if mask_token_id in ids:
            raise ValueError(f"The reserved MASK id {mask_token_id} occurs in regenerated sequence {i}; choose "
                             "another unused token with target_options.mask_token_id=<id>.")
