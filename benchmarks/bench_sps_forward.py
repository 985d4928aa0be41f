"""SPS(B) of the plain-cache verify forward against the batched engine's own (`serve.sps_forward`), side by side.

The serving scheduler plans with a table of step times by verify size B. `plain` times a forward on a plain cache
(the single-request engine's verify); `engine` times the `BatchedEngine`'s (a 2-D attention mask over a cache that
keeps hole columns, per-token positions, the LM head). This script profiles both for each `--rows` R, alternating
the two `--alternations` times (each profile itself interleaves its sizes, `dspark.scheduling.sps.profile_sps`),
and writes the median ms per forward by B and what the scheduler reads off them: the cost of verifying 1, 2 or 3
drafts per row relative to verifying none. Raw tables (no monotone cleaning).

It measures; it changes nothing in the library. Writes `--output` with the command, machine, load and commit.

    .venv/bin/python benchmarks/bench_sps_forward.py --rows 1 2 4 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from common import (
    RESULTS,
    add_target_arguments,
    command_line,
    machine_line,
    provenance_line,
    start_timing,
    write_result,
)

FORWARDS = ("plain", "engine")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="R rows verified in one forward")
    parser.add_argument("--block-size", type=int, default=7, help="γ: B runs up to R·(γ + 1)")
    parser.add_argument("--context", type=int, default=256, help="committed tokens per row (the tables' 256)")
    parser.add_argument("--alternations", type=int, default=3, help="profiles of each forward, alternated")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per size within one profile")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS / "sps-forward.md")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.block_size < 1 or args.context < 1 or args.alternations < 1 or args.repeats < 1:
        parser.error("--rows, --block-size, --context, --alternations and --repeats must be >= 1")
    return args


def main(argv: list[str]) -> int:
    from dspark.scheduling.profile import profile_serving_sps, serving_batch_grid
    from dspark.serving.profile import engine_forward
    from dspark.targets import load_target

    args = parse_args(argv)
    started, load_start = start_timing(args.threads)
    target = load_target(args.target, cache_dir=args.cache_dir)
    ms: dict[tuple[str, int], dict[int, list[float]]] = {}
    for rows in args.rows:
        sizes = serving_batch_grid(rows * (args.block_size + 1), num_rows=rows)
        for alternation in range(args.alternations):
            for name in FORWARDS:
                table = profile_serving_sps(
                    target,
                    max_batch_tokens=sizes[-1],
                    num_rows=rows,
                    context_length=args.context,
                    repeats=args.repeats,
                    monotone=False,
                    seed=alternation,
                    forward=engine_forward if name == "engine" else None,
                )
                for b, rate in zip(table.batch_tokens, table.steps_per_second):
                    ms.setdefault((name, rows), {}).setdefault(b, []).append(1000.0 / rate)
        print(f"R = {rows} done", file=sys.stderr)
    lines = report(args, ms, argv=argv, started=started, load_start=load_start, target=target)
    write_result("\n".join(lines) + "\n", args.output)
    return 0


def report(
    args: argparse.Namespace, ms: dict, *, argv: list[str], started: float, load_start: tuple, target
) -> list[str]:
    lines = [
        "# Verify-forward step time by size: plain cache vs the batched engine (`serve.sps_forward`)",
        "",
        f"Command: `{command_line('bench_sps_forward.py', argv)}` ({time.time() - started:.0f} s in all)  ",
        f"Machine: {machine_line()}; target {args.target} ({next(target.model.parameters()).dtype})  ",
        provenance_line(load_start, threads=args.threads),
        "",
        f"Median ms per forward over {args.alternations} alternated profiles × {args.repeats} timed calls "
        f"(R rows × ⌈B/R⌉ new tokens on {args.context} committed tokens per row, LM head included; plain also "
        "takes the softmax, as its table always has).",
        "",
    ]
    for rows in args.rows:
        sizes = sorted(ms[("plain", rows)])
        lines += [
            f"## R = {rows}",
            "",
            "| B | " + " | ".join(f"{name} ms" for name in FORWARDS) + " | engine / plain |",
            "|---|---|---|---|",
        ]
        median = {name: {b: statistics.median(ms[(name, rows)][b]) for b in sizes} for name in FORWARDS}
        for b in sizes:
            lines.append(
                f"| {b} | {median['plain'][b]:.1f} | {median['engine'][b]:.1f} | "
                f"{median['engine'][b] / median['plain'][b]:.2f} |"
            )
        base = rows  # one anchor per row, no drafts
        steps = [rows * (k + 1) for k in (1, 2, 3) if rows * (k + 1) in median["plain"]]
        lines += [
            "",
            "Cost of verifying k drafts per row relative to none (what the scheduler weighs against τ): "
            + "; ".join(
                f"k = {b // rows - 1}: plain {median['plain'][b] / median['plain'][base]:.2f}×, engine "
                f"{median['engine'][b] / median['engine'][base]:.2f}×"
                for b in steps
            ),
            "",
        ]
    return lines


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
