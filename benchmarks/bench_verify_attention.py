"""What a verify forward's attention costs: transformers' `sdpa` (the KV cache copied to every query head) against
grouped-query SDPA (`dspark.targets.attention`), side by side on this machine.

A verify round pushes B = ℓ + 1 tokens over the request's cache. With more than one query and a mask, transformers'
`sdpa` expands the cached keys/values of every layer to all query heads before calling SDPA; one query (a plain
step) never does. This script times, interleaved round by round, one target step — a forward of B new tokens over
a `--context`-token cache plus the LM head on its B positions — for each `--sizes` B and `--rows` R (R rows verify
B tokens each, one batched forward with a padding-style mask, as the serving engine's), in both attention
implementations, with the target exactly as the library loads it otherwise (its few-row layout and row padding).
Between calls it reads a `--evict-mb` buffer, as a drafter round and the verifier do between two target steps in
decoding, so the cache copies start from memory rather than from a warm cache (0: back to back).

It measures; it changes nothing in the library. Writes `--output` with the command, machine, load and commit.

    .venv/bin/python benchmarks/bench_verify_attention.py --cache-dir outputs/cache
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from common import (
    RESULTS,
    add_target_arguments,
    command_line,
    machine_line,
    provenance_line,
    start_timing,
    write_result,
)

MODES = ("sdpa", "grouped")  # transformers' own attention; dspark.targets.attention.GROUPED_SDPA


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--context", type=int, default=200, help="tokens in each row's KV cache before a step")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 8], help="B tokens per row and step")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="R rows verified in one forward")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each times every cell)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per cell and round (median kept)")
    parser.add_argument("--evict-mb", type=int, default=32, help="MB read between two timed calls (0: none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS / "verify-attention.md")
    args = parser.parse_args(argv)
    if min(args.sizes) < 1 or min(args.rows) < 1 or args.context < 1 or args.evict_mb < 0:
        parser.error("--sizes, --rows and --context must be >= 1 and --evict-mb >= 0")
    return args


def main(argv: list[str]) -> int:
    from dspark.targets.layout import format_row_padding
    from dspark.targets import load_target
    from dspark.targets.attention import GROUPED_SDPA

    args = parse_args(argv)
    started, load_start = start_timing(args.threads)
    target = load_target(args.target, cache_dir=args.cache_dir)
    if target.attention != GROUPED_SDPA:
        raise SystemExit(
            f"{args.target} runs {target.attention!r} attention here, not {GROUPED_SDPA}: nothing to "
            "compare (grouped-query heads and transformers' sdpa are both needed)"
        )
    gen = torch.Generator().manual_seed(0)
    evict = torch.ones(args.evict_mb * 2**18) if args.evict_mb else None  # float32: 4 bytes each
    caches = {}
    for rows in args.rows:  # one cache per R, filled once; each step drops its own block again
        context = torch.randint(100, target.vocab_size - 100, (rows, args.context), generator=gen)
        caches[rows] = target.new_cache()
        target(context, cache=caches[rows], use_cache=True)

    def step(rows: int, b: int):
        tokens = torch.randint(100, target.vocab_size - 100, (rows, b), generator=gen)
        # a 2-D mask over cache + block (all ones): what a padded batch passes; transformers builds the 4-D mask
        mask = torch.ones(rows, args.context + b, dtype=torch.long)

        def run() -> None:
            forward = target(tokens, attention_mask=mask, cache=caches[rows], use_cache=True)
            target.logits_from_hidden(forward.final_hidden)
            target.rollback(caches[rows], keep=args.context)

        return run

    def timed_ms(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(args.reps):
            if evict is not None:
                float(evict.sum())
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    results: dict[tuple[int, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for rows in args.rows:
            for b in args.sizes:
                for mode in MODES:
                    target.model.set_attn_implementation("sdpa" if mode == "sdpa" else GROUPED_SDPA)
                    results.setdefault((rows, b, mode), []).append(timed_ms(step(rows, b)))
    target.model.set_attn_implementation(GROUPED_SDPA)

    def cell(rows: int, b: int, mode: str) -> float:
        return statistics.median(results[(rows, b, mode)])

    padding = format_row_padding(target.row_padding) if target.row_padding else "none"
    lines = [
        f"# Verify-forward attention: transformers' sdpa vs grouped-query SDPA — {args.target}",
        "",
        f"Command: `{command_line('bench_verify_attention.py', argv)}` ({time.time() - started:.0f} s in all)  ",
        f"Machine: {machine_line()}; target {str(target.dtype).replace('torch.', '')}, few-token products "
        f"{target.few_row_layout} (row padding {padding})  ",
        provenance_line(load_start, threads=args.threads),
        "",
        f"Each cell: the median over {args.rounds} interleaved rounds of the median of {args.reps} calls (after a "
        f"warm-up; {args.evict_mb} MB read before each call). Step = one target forward of B new tokens per row "
        f"over a {args.context}-token KV cache per row, plus the LM head on those positions (a verify round's "
        "target work at ℓ = B − 1; R = 1, B = 1 is a plain decoding step, where both implementations run the "
        "same code).",
        "",
        "| R rows | B tokens | transformers sdpa (ms) | grouped SDPA (ms) | grouped / sdpa | sdpa step / plain "
        "| grouped step / plain |",
        "|---|---|---|---|---|---|---|",
    ]
    plain = {mode: cell(args.rows[0], 1, mode) if 1 in args.sizes else float("nan") for mode in MODES}
    for rows in args.rows:
        for b in args.sizes:
            hf, ours = cell(rows, b, "sdpa"), cell(rows, b, "grouped")
            lines.append(
                f"| {rows} | {b} | {hf:.1f} | {ours:.1f} | {ours / hf:.2f} | {hf / plain['sdpa']:.2f} | "
                f"{ours / plain['grouped']:.2f} |"
            )
    lines += [
        "",
        "The last two columns are the step's cost in plain steps (the first R's B = 1 cell of the same "
        "implementation): what verifying B − 1 drafts per row costs against plain decoding.",
    ]
    write_result("\n".join(lines) + "\n", args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
