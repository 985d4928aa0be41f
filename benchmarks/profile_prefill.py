"""Where the feature-cache prefill spends its time: tok/s and torch.profiler's operator table on real sequences.

Runs `dspark.data.features._shard_tensors` — the prefill of one cache shard, exactly as `cache_features` runs it
(length-batched, bf16 with the linear weights cast once where the CPU has bf16 instructions, the log-normaliser
and token-mass pass included) — over `--sequences` sequences of a finished training dataset, timed after a warm-up,
then once more under the profiler. The matrix-product rate it prints (FLOP of the target body plus the lm-head
product for log Z, divided by the time inside `aten::mm`) says how close the prefill is to the machine's matmul
rate: compute-bound when that rate matches the large products of the training step (`bench_training.py`).

    .venv/bin/python benchmarks/profile_prefill.py --regen-dir outputs/cache/regen/<key> --start 700
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from common import add_target_arguments


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--regen-dir",
        type=Path,
        required=True,
        help="a finished dataset directory (outputs/cache/regen/<key>, one with a COMPLETE marker)",
    )
    add_target_arguments(parser)
    parser.add_argument("--start", type=int, default=0, help="first sequence of the dataset to prefill")
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="as cache_features: max(8, data.batch_size)")
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from torch.profiler import ProfilerActivity, profile

    from dspark.data import features
    from dspark.data.regenerate import load_regenerated
    from dspark.hardware import autocast_linear_weights, keep_freed_memory
    from dspark.targets import load_target

    keep_freed_memory()  # as the CLI does
    target = load_target(args.target, cache_dir=args.cache_dir)
    dataset = load_regenerated(args.regen_dir).with_format("torch", columns=["input_ids", "loss_mask"])
    stop = min(args.start + args.sequences, len(dataset))
    if stop <= args.start:
        raise SystemExit(f"--start {args.start} is past the dataset's {len(dataset)} sequences")
    items = [dataset[i] for i in range(args.start, stop)]
    rows, masks = [it["input_ids"] for it in items], [it["loss_mask"].bool() for it in items]
    precision = features.resolve_prefill_precision("auto", target)
    tokens = sum(len(r) for r in rows)

    def prefill(part: slice) -> None:
        features._shard_tensors(
            target,
            rows[part],
            first_index=0,
            batch_size=args.batch_size,
            token_budget=args.token_budget,
            precision=precision,
            loss_masks=masks[part],
        )

    with autocast_linear_weights(target.model, torch.bfloat16 if precision == "bf16" else None):
        prefill(slice(0, 16))  # warm-up
        started = time.perf_counter()
        prefill(slice(None))
        seconds = time.perf_counter() - started
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            prefill(slice(None))
    averages = prof.key_averages()
    mm_seconds = sum(e.self_cpu_time_total for e in averages if e.key == "aten::mm") / 1e6
    total_seconds = sum(e.self_cpu_time_total for e in averages) / 1e6
    body = sum(
        p.numel()
        for name, p in target.model.named_parameters()
        if p.dim() == 2 and "embed" not in name and "lm_head" not in name
    )  # the transformer's matrices
    head = target.lm_head.weight.numel()
    flop = 2 * tokens * (body + head)
    print(
        f"{tokens} tokens of {len(rows)} sequences (mean length {tokens / len(rows):.0f}), precision {precision}, "
        f"batch {args.batch_size}, token budget {args.token_budget}: {seconds:.2f} s = {tokens / seconds:.0f} tok/s"
    )
    print(
        f"under the profiler: aten::mm {mm_seconds:.2f} s of {total_seconds:.2f} s "
        f"({mm_seconds / total_seconds:.0%}); "
        f"matrix products at {flop / mm_seconds / 1e9:.0f} GFLOP/s ({(body + head) * 2 / 1e6:.0f} MFLOP per token: "
        f"target body {2 * body / 1e6:.0f}, lm head for log Z {2 * head / 1e6:.0f})"
    )
    print(averages.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=44))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
