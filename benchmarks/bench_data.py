"""Data-pipeline speed on this machine: regeneration vs reference-response prefill, and cached vs online features.

Side by side in one run per target: regeneration tok/s of the same prompts in input order and batched by prompt
length (what `stage=prepare` does), regeneration at fp32 and bf16 autocast (`data.regen_precision`), with
transformers' `generate` and with the lean sampling loop (`data.sampling.sampler`), and the
feature-cache prefill of prompt + reference response (what
`data.responses=reference` costs per token) at fp32 and at bf16 autocast (CPUs with AMX-BF16 or AVX512-BF16 only).

For each target: regenerate a few synthetic prompts (fresh temporary cache, so nothing is reused) and report
generated tokens/s; build the float16 feature cache; then time one training batch's features both ways —
reading the cache (safetensors, memory-mapped, warm page cache) and padding, versus one target forward. The same
comparison is repeated at training length (random ids, T = --long-length). Prints a markdown table and writes
outputs/benchmarks/data.md with the command that produced it.

    .venv/bin/python benchmarks/bench_data.py                      # tiny + smollm2-135m
    .venv/bin/python benchmarks/bench_data.py --targets tiny       # seconds
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common import RESULTS, command_line, default_cache_dir, git_commit, machine_line, without_repo_root, write_result
from dspark.data.datamodule import collate_sequences
from dspark.data.features import FeatureCache, cache_features, compute_features, pad_right
from dspark.data.regenerate import SamplingConfig, load_regenerated, read_manifest, regenerate_responses
from dspark.data.synthetic import generate_synthetic_prompts
from dspark.targets import load_target


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["tiny", "smollm2-135m"])
    parser.add_argument("--num-prompts", type=int, default=6, help="prompts regenerated per target (one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per feature batch")
    parser.add_argument("--long-length", type=int, default=512, help="T of the training-length comparison")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference-prompts", type=int, default=48, help="reference sequences prefilled")
    parser.add_argument("--regen-prompts", type=int, default=16, help="prompts regenerated for the order comparison")
    parser.add_argument(
        "--precision-batch", type=int, default=32, help="prompts (one batch) regenerated for the fp32 / bf16 comparison"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="where targets are cached (converted targets are reused; default <repo>/outputs/cache)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "data.md", help="where the markdown table is written")
    return parser.parse_args(argv)


def median_seconds(fn, *, repeats: int) -> float:
    fn()  # warm-up (allocations, first mmap faults)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_regeneration(target, args, work: Path) -> tuple[Path, dict]:
    prompts = generate_synthetic_prompts(args.num_prompts, seed=0)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, batch_size=args.num_prompts)
    regen_dir = regenerate_responses(
        target, prompts, sampling=sampling, cache_dir=work, seed=0, min_loss_tokens=1, show_progress=False
    )
    return regen_dir, read_manifest(regen_dir)["stats"]


def bench_features_regenerated(target, regen_dir: Path, args, work: Path) -> dict:
    """Cached vs online features for the first batch of regenerated sequences."""
    start = time.perf_counter()
    feature_dir = cache_features(target, regen_dir, cache_dir=work, batch_size=args.batch_size, show_progress=False)
    build_s = time.perf_counter() - start
    cache = FeatureCache(feature_dir)
    data = load_regenerated(regen_dir).with_format("torch", columns=["input_ids", "loss_mask"])
    indices = list(range(min(args.batch_size, len(data))))
    rows = [data[i]["input_ids"].long() for i in indices]
    masks = [data[i]["loss_mask"].bool() for i in indices]

    def read_cached():  # what the DataModule adds per batch when a cache is used: read + pad
        items = []
        for i in indices:
            features, final_hidden = cache[i]
            items.append(
                {
                    "input_ids": rows[i],
                    "loss_mask": masks[i],
                    "index": i,
                    "features": features,
                    "anchors": torch.zeros(0, dtype=torch.long),
                    "final_hidden": final_hidden,
                }
            )
        return collate_sequences(items, pad_token_id=0)

    def compute_online():
        ids, mask = pad_right(rows, pad_id=0)
        return compute_features(target, ids, attention_mask=mask)

    tokens = sum(len(r) for r in rows)
    disk = sum(p.stat().st_size for p in feature_dir.glob("*.safetensors"))
    return {
        "tokens": tokens,
        "cached_s": median_seconds(read_cached, repeats=args.repeats),
        "online_s": median_seconds(compute_online, repeats=args.repeats),
        "build_s": build_s,
        "bytes_per_token": disk / max(1, sum(len(data[i]["input_ids"]) for i in range(len(data)))),
    }


def bench_features_long(target, args, work: Path) -> dict:
    """The same comparison at training length, on random ids (values do not matter for speed)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (args.batch_size, args.long_length), generator=gen)
    mask = torch.ones_like(ids, dtype=torch.bool)
    features, final_hidden = compute_features(target, ids, attention_mask=mask)
    path = work / "long.safetensors"
    save_file(
        {
            f"{name}.{b}": t[b].to(torch.float16).contiguous()
            for name, t in (("features", features), ("final_hidden", final_hidden))
            for b in range(len(ids))
        },
        str(path),
    )
    handle = safe_open(str(path), framework="pt")

    def read_cached():
        for name in ("features", "final_hidden"):
            torch.stack([handle.get_tensor(f"{name}.{b}") for b in range(len(ids))]).float()

    return {
        "tokens": ids.numel(),
        "cached_s": median_seconds(read_cached, repeats=args.repeats),
        "online_s": median_seconds(lambda: compute_features(target, ids, attention_mask=mask), repeats=args.repeats),
    }


def training_prompts(count: int):
    """Real training prompts with reference responses, mixed over math / code / chat (vendored sets)."""
    from dspark.data.prompts import load_prompts

    pools = [load_prompts(n, selection="all") for n in ("gsm8k-train", "mbpp-train", "alpaca-5k")]
    mixed = [p for group in zip(*pools) for p in group if p.reference]
    return mixed[:count]


def precisions_here() -> tuple[str, ...]:
    """The data-building precisions worth timing here: fp32, and bf16 where the CPU has bf16 instructions."""
    from dspark.hardware import cpu_has_fast_bf16

    return ("fp32", "bf16") if cpu_has_fast_bf16() else ("fp32",)


def bench_reference_prefill(target, args, work: Path) -> list[tuple[str, int, float]]:
    """(precision, tokens, seconds) of the feature-cache prefill over reference sequences, fp32 and bf16."""
    from dspark.data.reference import build_reference_dataset

    ref_dir = build_reference_dataset(target, training_prompts(args.reference_prompts), cache_dir=work, max_length=512)
    tokens = sum(len(r) for r in load_regenerated(ref_dir)["input_ids"])
    results = []
    for precision in precisions_here():
        start = time.perf_counter()
        cache_features(
            target, ref_dir, cache_dir=work / precision, batch_size=16, show_progress=False, precision=precision
        )
        results.append((precision, tokens, time.perf_counter() - start))
    return results


def bench_regeneration_order(target, args, work: Path) -> list[tuple[str, float, float]]:
    """(order, generated tokens, seconds) regenerating the same prompts in input order vs sorted by length."""
    prompts = training_prompts(args.regen_prompts)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, batch_size=8)
    out = []
    for label, ordered in (
        ("input order", prompts),
        ("batched by length", sorted(prompts, key=lambda p: len(p.prompt))),
    ):
        regen_dir = regenerate_responses(
            target,
            ordered,
            sampling=sampling,
            cache_dir=work / label.replace(" ", "_"),
            seed=0,
            min_loss_tokens=1,
            show_progress=False,
        )
        stats = read_manifest(regen_dir)["stats"]
        out.append((label, stats["generated_tokens"], stats["seconds"]))
    return out


def bench_regeneration_precision(target, args, work: Path) -> list[tuple[str, float, float]]:
    """(precision, generated tokens, seconds) regenerating the same prompts at T = 1 in one batch of
    --precision-batch, fp32 and (CPUs with bf16 instructions) bf16 autocast, as `data.regen_precision` does."""
    prompts = sorted(training_prompts(args.precision_batch), key=lambda p: len(p.prompt))
    sampling = SamplingConfig(
        temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens, batch_size=args.precision_batch
    )
    out = []
    for precision in precisions_here():
        regen_dir = regenerate_responses(
            target,
            prompts,
            sampling=sampling,
            cache_dir=work / f"regen_{precision}",
            seed=0,
            min_loss_tokens=1,
            show_progress=False,
            precision=precision,
        )
        stats = read_manifest(regen_dir)["stats"]
        out.append((precision, stats["generated_tokens"], stats["seconds"]))
    return out


def bench_precast(target, args, work: Path) -> list[tuple[str, str, float, float]]:
    """(stage, weights, tokens, seconds): bf16 regeneration (--precision-batch prompts, one batch) and bf16 reference
    prefill (--reference-prompts sequences), each with the linear weights cast once (`autocast_linear_weights`, what
    the pipeline does) and re-cast by autocast at every call (what autocast alone does), alternated twice so drift hits
    both alike; the outputs are bit-identical (tests/test_hardware.py), only the time differs."""
    import contextlib

    import dspark.data.features as features_module
    import dspark.data.regenerate as regenerate_module
    from dspark.data.reference import build_reference_dataset

    prompts = sorted(training_prompts(args.precision_batch), key=lambda p: len(p.prompt))
    sampling = SamplingConfig(
        temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens, batch_size=args.precision_batch
    )
    ref_dir = build_reference_dataset(
        target, training_prompts(args.reference_prompts), cache_dir=work, max_length=512
    )  # bench_reference_prefill's, reused from the same cache
    ref_tokens = sum(len(r) for r in load_regenerated(ref_dir)["input_ids"])
    out = []
    for rep in range(2):
        for weights in ("cast once", "autocast re-cast"):
            patch = contextlib.ExitStack()
            if weights != "cast once":
                for module in (features_module, regenerate_module):
                    original = module.autocast_linear_weights
                    module.autocast_linear_weights = lambda model, dtype=None: contextlib.nullcontext(model)
                    patch.callback(setattr, module, "autocast_linear_weights", original)
            with patch:
                tag = f"{weights.replace(' ', '_')}_{rep}"
                regen_dir = regenerate_responses(
                    target,
                    prompts,
                    sampling=sampling,
                    cache_dir=work / f"pc_{tag}",
                    seed=0,
                    min_loss_tokens=1,
                    show_progress=False,
                    precision="bf16",
                )
                stats = read_manifest(regen_dir)["stats"]
                out.append(("regeneration", weights, stats["generated_tokens"], stats["seconds"]))
                start = time.perf_counter()
                cache_features(
                    target, ref_dir, cache_dir=work / f"pcf_{tag}", batch_size=16, show_progress=False, precision="bf16"
                )
                out.append(("prefill", weights, ref_tokens, time.perf_counter() - start))
    return out


def bench_sampler(target, args, work: Path) -> list[tuple[str, float, float]]:
    """(sampler, generated tokens, seconds): regeneration at T = 1 of --precision-batch prompts in one batch with
    transformers' `generate` and with the lean loop (`data.sampling.sampler`), under the precision the pipeline
    picks here, alternated twice so drift hits both alike. The two draw different random streams, so their
    responses (and lengths) differ: tok/s counts generated tokens only."""
    import dataclasses

    from dspark.data.features import resolve_prefill_precision

    precision = resolve_prefill_precision("auto", target, key="data.regen_precision")
    prompts = sorted(training_prompts(args.precision_batch), key=lambda p: len(p.prompt))
    sampling = SamplingConfig(
        temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens, batch_size=args.precision_batch
    )
    out = []
    for rep in range(2):
        for sampler in ("generate", "lean"):
            regen_dir = regenerate_responses(
                target,
                prompts,
                sampling=dataclasses.replace(sampling, sampler=sampler),
                cache_dir=work / f"sampler_{sampler}_{rep}",
                seed=rep,
                min_loss_tokens=1,
                show_progress=False,
                precision=precision,
            )
            stats = read_manifest(regen_dir)["stats"]
            out.append((f"{sampler} ({precision})", stats["generated_tokens"], stats["seconds"]))
    return out


def sampler_rows(name: str, results: list[tuple[str, float, float]], args) -> list[list[str]]:
    """Summed over the two alternations, with the lean loop's tok/s over generate's."""
    totals = {}
    for label, tokens, seconds in results:
        done = totals.get(label, (0.0, 0.0))
        totals[label] = (done[0] + tokens, done[1] + seconds)
    base_label = next(label for label in totals if label.startswith("generate"))
    base = totals[base_label][0] / totals[base_label][1]
    return [
        [
            name,
            f"regeneration at T = 1 of {args.precision_batch} prompts in one batch, sampler {label}, 2 alternations",
            f"{tokens:.0f} tokens in {seconds:.1f} s",
            f"{tokens / seconds:.1f} tok/s",
            f"{tokens / seconds / base:.2f}× generate",
        ]
        for label, (tokens, seconds) in totals.items()
    ]


def precast_rows(name: str, results: list[tuple[str, str, float, float]], args) -> list[list[str]]:
    """Summed over the two alternations, with the ratio of cast-once to re-cast tok/s."""
    rows = []
    for stage in ("regeneration", "prefill"):
        totals = {
            w: (
                sum(t for s, ww, t, _ in results if s == stage and ww == w),
                sum(sec for s, ww, _, sec in results if s == stage and ww == w),
            )
            for w in ("autocast re-cast", "cast once")
        }
        base = totals["autocast re-cast"][0] / totals["autocast re-cast"][1]
        size = (
            f"{args.precision_batch} prompts in one batch"
            if stage == "regeneration"
            else f"{args.reference_prompts} reference sequences, batch 16"
        )
        for weights, (tokens, seconds) in totals.items():
            rate = tokens / seconds
            rows.append(
                [
                    name,
                    f"bf16 {stage} ({size}), linear weights {weights}, 2 alternations",
                    f"{tokens:.0f} tokens in {seconds:.1f} s",
                    f"{rate:.0f} tok/s",
                    f"{rate / base:.2f}× re-cast",
                ]
            )
    return rows


def run_target(name: str, args) -> list[list[str]]:
    target = load_target(name, cache_dir=args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        work = Path(tmp)
        regen_dir, stats = bench_regeneration(target, args, work)
        short = bench_features_regenerated(target, regen_dir, args, work)
        long = bench_features_long(target, args, work)
        prefill = bench_reference_prefill(target, args, work)
        order = bench_regeneration_order(target, args, work)
        by_precision = bench_regeneration_precision(target, args, work)
        precast = bench_precast(target, args, work) if "bf16" in precisions_here() else []
        samplers = bench_sampler(target, args, work)
    regen_tok_s = stats["generated_tokens"] / stats["seconds"]
    rows = [
        [
            name,
            "regeneration (sampling, batch %d)" % args.num_prompts,
            f"{stats['generated_tokens']:.0f} tokens in {stats['seconds']:.1f} s",
            f"{regen_tok_s:.1f} tok/s",
            "",
        ]
    ]
    base = None
    for label, tokens, seconds in order:
        rate = tokens / seconds
        base = base or rate
        rows.append(
            [
                name,
                f"regeneration of {args.regen_prompts} training prompts, {label} (batch 8)",
                f"{tokens:.0f} tokens in {seconds:.1f} s",
                f"{rate:.1f} tok/s",
                f"{rate / base:.2f}× input order",
            ]
        )
    for precision, tokens, seconds in by_precision:
        rate = tokens / seconds
        rows.append(
            [
                name,
                f"regeneration at T = 1 of {args.precision_batch} training prompts in one batch ({precision})",
                f"{tokens:.0f} tokens in {seconds:.1f} s",
                f"{rate:.1f} tok/s",
                f"{rate * by_precision[0][2] / by_precision[0][1]:.2f}× fp32",
            ]
        )
    for precision, tokens, seconds in prefill:
        rate = tokens / seconds
        rows.append(
            [
                name,
                f"reference prefill → feature cache ({precision}, length-batched)",
                f"{tokens} tokens in {seconds:.1f} s",
                f"{rate:.0f} tok/s",
                f"{rate / regen_tok_s:.0f}× regeneration",
            ]
        )
    rows += precast_rows(name, precast, args) if precast else []
    rows += sampler_rows(name, samplers, args)
    for label, r in (
        (f"features, regenerated batch (B={args.batch_size})", short),
        (f"features, B={args.batch_size} × T={args.long_length}", long),
    ):
        winner = "cached" if r["cached_s"] < r["online_s"] else "online"
        rows.append(
            [
                name,
                label,
                f"{r['tokens']} tokens",
                f"cached {1e3 * r['cached_s']:.1f} ms vs online {1e3 * r['online_s']:.1f} ms",
                f"{winner} ({max(r['online_s'], r['cached_s']) / min(r['online_s'], r['cached_s']):.1f}×)",
            ]
        )
    rows.append(
        [
            name,
            "feature cache build + size",
            "",
            f"{short['build_s']:.1f} s",
            f"{short['bytes_per_token']:.0f} bytes/token (fp16, m={len(target.feature_layer_ids)})",
        ]
    )
    return rows


def markdown(rows: list[list[str]]) -> str:
    header = ["target", "measurement", "work", "time / rate", "faster / note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from dspark.hardware import keep_freed_memory

    keep_freed_memory()  # as the CLI does (DSPARK_KEEP_FREED_MEMORY=0 measures glibc's default)
    load_before = os.getloadavg()
    started = datetime.datetime.now()
    rows = []
    for name in args.targets:
        try:
            rows += run_target(name, args)
        except (ValueError, OSError) as err:  # e.g. smollm2 not installed: report, keep the others
            rows.append([name, "unavailable", "", "", without_repo_root(str(err).splitlines()[0])[:120]])
    table = markdown(rows)
    command = command_line("bench_data.py", argv, prefix=".venv/bin/python")
    load_after = os.getloadavg()
    text = (
        f"# Data pipeline benchmark\n\nCommand: `{command}`\n\n"
        f"Date {started:%Y-%m-%d %H:%M}, commit {git_commit()}. Machine: {machine_line()}; targets in fp32 unless a "
        f"row says bf16 (autocast). "
        f"Load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}, after "
        f"{', '.join(f'{x:.2f}' for x in load_after)}. Cached reads hit a warm page cache.\n\n" + table + "\n"
    )
    write_result(text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
