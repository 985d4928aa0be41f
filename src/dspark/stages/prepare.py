"""Stage `prepare`: training prompts → target-regenerated responses (cached, resumable) → optional feature cache."""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass
from pathlib import Path

from dspark.data.prompts import PromptRecord
from dspark.config.schema import SamplingConfig
from dspark.data.regenerate import load_regenerated, read_manifest, regenerate_responses
from dspark.stages.context import StageContext

log = logging.getLogger("dspark")


@dataclass
class PreparedData:
    regen_dir: Path
    feature_dir: Path | None
    num_sequences: int
    stats: dict


def collect_train_prompts(ctx: StageContext) -> list[PromptRecord]:
    """`data.num_train_prompts` prompts over `data.train_sets`, each set shuffled by the data seed (`data.seed`,
    else `seed`).

    Shares follow `data.train_weights` (one per set, like Open-PerfectBlend's domain weights; [] = equal): set i
    gets round(N·w_i/Σw) prompts, capped by its size, and what a small set cannot fill goes to the others in
    proportion. The result interleaves the chosen prompts round-robin, one per set in turn, so a prefix (mix's
    regenerated part) holds the sets in about *equal* shares until the smaller ones run out, not in the weights'
    (budget=cpu-long's first 1,200 of 3,600: ~340 each of gsm8k / mbpp / alpaca-5k and all 175 alpaca-seed rows).
    Changing the order would change every cache key built on it.
    """
    data = ctx.cfg.data
    pools = []
    for name in data.train_sets:
        if name == "synthetic":
            pool = ctx.load_prompts(name, limit=data.num_train_prompts, seed=ctx.cfg.data_seed)
        else:
            pool = ctx.load_prompts(name, selection="all")
            random.Random(ctx.cfg.data_seed).shuffle(pool)
        pools.append(pool)
    weights = list(data.train_weights) or [1.0] * len(pools)
    counts = allocate_counts([len(p) for p in pools], weights, total=data.num_train_prompts)
    chosen = [pool[:n] for pool, n in zip(pools, counts)]
    prompts: list[PromptRecord] = []
    for i in range(max((len(c) for c in chosen), default=0)):
        prompts.extend(c[i] for c in chosen if i < len(c))
    return prompts


def allocate_counts(sizes: list[int], weights: list[float], *, total: int) -> list[int]:
    """Integer shares of `total` proportional to `weights`, each capped by `sizes` (leftovers redistributed)."""
    counts = [0] * len(sizes)
    remaining = min(total, sum(s for s, w in zip(sizes, weights) if w > 0))
    open_sets = [i for i, w in enumerate(weights) if w > 0 and sizes[i] > 0]
    while remaining > 0 and open_sets:
        weight_sum = sum(weights[i] for i in open_sets)
        shares = {i: remaining * weights[i] / weight_sum for i in open_sets}
        grant = {i: min(sizes[i] - counts[i], int(shares[i])) for i in open_sets}
        # hand out the rounding remainder by largest fractional part (deterministic tie-break by index)
        leftover = remaining - sum(grant.values())
        for i in sorted(open_sets, key=lambda i: (-(shares[i] - int(shares[i])), i)):
            if leftover <= 0:
                break
            if counts[i] + grant[i] < sizes[i]:
                grant[i] += 1
                leftover -= 1
        for i, g in grant.items():
            counts[i] += g
        remaining = min(total, sum(sizes[i] for i in range(len(sizes)) if weights[i] > 0)) - sum(counts)
        open_sets = [i for i in open_sets if counts[i] < sizes[i]]
        if not any(grant.values()):
            break
    return counts


def sampling_config(ctx: StageContext) -> SamplingConfig:
    """`data.sampling`, copied and range-checked (a command-line override sets fields without the check)."""
    return dataclasses.replace(ctx.cfg.data.sampling)


def run_prepare(ctx: StageContext) -> PreparedData:
    """Build (or reuse) the training data by `data.responses` and, if `data.cache_features`, the target features.

    regenerate: the target writes every response (the paper); reference: the sets' own responses (prefill only);
    mix: the first `data.num_regen_prompts` prompts (round-robin over the sets: `collect_train_prompts`)
    regenerated, the rest reference. Regeneration answers the turns `data.multi_turn` says, in this process
    (`data.regen_backend=hf`) or through the server at `data.regen_url` (openai: `dspark.data.regen_server`).
    """
    from dspark.data.features import resolve_prefill_precision
    from dspark.data.reference import build_reference_dataset, combine_datasets, has_reference

    target = ctx.load_target()
    data = ctx.cfg.data
    if data.features_from:  # an external capture job's shards (docs/FEATURES.md): no regeneration, no prefill here
        from dspark.data.feature_format import load_external_features

        regen_dir, feature_dir = load_external_features(target, Path(data.features_from), cache_dir=ctx.paths.cache)
        num_sequences = len(load_regenerated(regen_dir))
        log.info("training on %d sequences of captured features from %s", num_sequences, data.features_from)
        return PreparedData(regen_dir, feature_dir, num_sequences, read_manifest(regen_dir).get("stats", {}))
    prompts = collect_train_prompts(ctx)
    regen_prompts, reference_prompts = _split_by_mode(
        prompts, mode=data.responses, num_regen=data.num_regen_prompts, has_reference=has_reference
    )
    parts = []
    if reference_prompts:
        log.info(
            "building %d sequences from the reference responses of %s",
            len(reference_prompts),
            ", ".join(data.train_sets),
        )
        parts.append(
            build_reference_dataset(
                target,
                reference_prompts,
                cache_dir=ctx.paths.cache,
                max_length=data.max_length,
                system_prompt=data.sampling.system_prompt,
            )
        )
    if regen_prompts:
        log.info("regenerating responses to %d prompts from %s", len(regen_prompts), ", ".join(data.train_sets))
        # batched by prompt length: left padding to a batch's longest prompt is wasted work
        regen_prompts = sorted(regen_prompts, key=lambda p: (len(p.prompt), p.id))
        sampling, backend, precision = sampling_config(ctx), None, "fp32"
        if data.regen_backend == "openai":  # the server's model writes; the tokenizer check runs before any work
            from dspark.data.regen_server import open_server

            backend = open_server(data, target=target, sampling=sampling)
        else:
            precision = resolve_prefill_precision(data.regen_precision, target, key="data.regen_precision")
        parts.append(
            regenerate_responses(
                target,
                regen_prompts,
                sampling=sampling,
                cache_dir=ctx.paths.cache,
                seed=ctx.cfg.data_seed,
                max_length=data.max_length,
                precision=precision,
                multi_turn=data.multi_turn,
                backend=backend,
            )
        )
    regen_dir = combine_datasets(parts, cache_dir=ctx.paths.cache)
    dataset = load_regenerated(regen_dir)
    check_mask_token_absent(dataset["input_ids"], mask_token_id=target.mask_token_id)
    feature_dir = None
    if data.cache_features:
        from dspark.data.features import cache_features

        feature_dir = cache_features(
            target,
            regen_dir,
            cache_dir=ctx.paths.cache,
            batch_size=max(8, data.batch_size),
            precision=data.feature_precision,
        )
    stats = read_manifest(regen_dir).get("stats", {})
    log.info("prepared %d sequences under %s", len(dataset), regen_dir)
    return PreparedData(regen_dir=regen_dir, feature_dir=feature_dir, num_sequences=len(dataset), stats=stats)


def _split_by_mode(
    prompts: list[PromptRecord], *, mode: str, num_regen: int, has_reference
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(prompts to regenerate, prompts to take with their reference response) for `data.responses`."""
    if mode == "regenerate":
        return prompts, []
    if mode == "reference":
        missing = sorted({p.domain + ":" + p.id.split("-")[0] for p in prompts if not has_reference(p)})
        if missing:
            raise ValueError(
                f"data.responses=reference: {sum(not has_reference(p) for p in prompts)} of the "
                f"{len(prompts)} training prompts have no reference response (e.g. {missing[0]}); drop "
                "those sets from data.train_sets (math-train and synthetic hold none) or use "
                "data.responses=mix / regenerate"
            )
        return [], prompts
    regen = prompts[:num_regen]
    reference = [p for p in prompts[num_regen:] if has_reference(p)]
    return regen, reference


def held_out_prompts(ctx: StageContext, prepared: PreparedData | None) -> list[PromptRecord]:
    """The training prompts of the regenerated data's calibration split (never trained on), for STS; none when
    this invocation did not prepare the data."""
    from dspark.evaluation.calibrate import regenerated_calibration_split

    if prepared is None or ctx.cfg.data.calib_fraction <= 0:
        return []
    return regenerated_calibration_split(
        collect_train_prompts(ctx), prepared.regen_dir, data=ctx.cfg.data, seed=ctx.cfg.data_seed
    )


def check_mask_token_absent(sequences, *, mask_token_id: int) -> None:
    """The MASK row must never occur in the data (METHOD §2.1); a scan proves it for this dataset."""
    for i, ids in enumerate(sequences):
        if mask_token_id in ids:
            raise ValueError(
                f"The reserved MASK id {mask_token_id} occurs in regenerated sequence {i}; choose "
                "another unused token with target_options.mask_token_id=<id>."
            )
