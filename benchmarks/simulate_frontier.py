"""Simulated throughput–interactivity frontier at concurrency levels the real engine did not run, with SPS(B) profiled
at each simulated R (no extrapolation of a table beyond its batch sizes).

Inputs: a drafter's run directory after `sweep=serving` (its `serve/trace-*/steps.jsonl`, the policy=fixed trace the
simulator replays, and every cell's `serve/*/steps.jsonl`, whose timings fit the per-step draft and bookkeeping
costs). For each R in --concurrency the batched verify forward of R rows is profiled up to R·(γ+1) tokens on this
machine (cached under `<--cache-dir>/sps/` like `stage=serve`'s tables; default <repo>/outputs/cache), then every
policy is replayed at that R (`dspark.serving.simulator.simulate_frontier`, padded verify blocks as in the real
engine). Writes a markdown table,
the scheduler-vs-MTP-1 comparison and a frontier plot, all labelled simulated.

Beside the policies, the *hindsight* policy (`simulate_hindsight`: each step's verify length chosen knowing every
round's accepted count and each request's remaining length; exact at R = 1, the best found at R > 1): how fast any
verify-length policy could serve this trace at each R. Where its per-user speed at matched throughput is below a
target against MTP-1 (issue 11: 1.3×), no policy reaches that target with this drafter on this machine.

    .venv/bin/python benchmarks/simulate_frontier.py --run-dir outputs/runs/dspark-markov-d5-g7-s0-<hash>
    .venv/bin/python benchmarks/simulate_frontier.py --run-dir ... --sps-table gpu.json   # another machine's SPS(B)
    .venv/bin/python benchmarks/simulate_frontier.py --run-dir ... --cells 20261207-04 --concurrency 1 2 4 8 16 32 64
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from common import RESULTS, add_target_arguments, command_line, repo_path, write_result

POLICIES = ("mtp1", "static", "fixed", "threshold", "calibrated_threshold", "scheduler", "async")
HINDSIGHT = "hindsight"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="the served drafter's run directory")
    add_target_arguments(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--block-size", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--sps-table", type=Path, default=None, help="use this SPS(B) JSON for every R instead")
    parser.add_argument(
        "--cells",
        default="",
        help="fit step costs to the real cells whose folder under <run dir>/serve starts with this "
        "(e.g. 20261207-04: one sweep's cells); default every cell",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's, i.e. OMP_NUM_THREADS): give the serving run's count — "
        "the target's few-row choices and so its SPS tables are kept per thread count",
    )
    parser.add_argument(
        "--scheduler-cost",
        default="columns",
        choices=("columns", "tokens"),
        help="serve.scheduler_cost of the replayed scheduler (columns: what the padded engine pays)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "serving-simulated.md")
    return parser.parse_args(argv)


def load_steps(run_dir: Path, prefix: str = "") -> tuple[list, list]:
    """(the policy=fixed trace's steps, the real engine's recorded steps of the cells named `prefix*`) from
    `<run dir>/serve/`."""
    from dspark.stages.serve import read_steps

    traces = sorted((run_dir / "serve").glob("trace-*/steps.jsonl"))
    if not traces:
        raise SystemExit(f"no serve/trace-*/steps.jsonl under {run_dir}: run sweep=serving (or stage=serve) first")
    cells = sorted((run_dir / "serve").glob(f"{prefix}*-R*/steps.jsonl"))
    if not cells:
        raise SystemExit(f"no serve/{prefix}*-R*/steps.jsonl under {run_dir}: no real cell to fit step costs to")
    steps = [step for path in cells for step in read_steps(path)]
    return read_steps(traces[-1]), steps


def tables(args: argparse.Namespace) -> dict:
    from dspark.serving.profile import load_or_profile_serving_sps, load_sps_table
    from dspark.targets import load_target

    if args.sps_table is not None:
        table = load_sps_table(args.sps_table)
        return {r: table for r in args.concurrency}
    target = load_target(args.target, cache_dir=args.cache_dir)
    out = {}
    for rows in args.concurrency:
        print(f"profiling SPS(B) for {rows} rows up to {rows * (args.block_size + 1)} tokens", flush=True)
        out[rows], _ = load_or_profile_serving_sps(
            target, cache_dir=args.cache_dir, num_rows=rows, max_batch_tokens=rows * (args.block_size + 1)
        )
    return out


def markdown(summaries: list, sps: dict, args: argparse.Namespace, argv: list[str], started: str, plot: Path) -> str:
    import torch

    from dspark.serving.load import speedup_at_matched_throughput

    load = os.getloadavg()
    lines = [
        "# Simulated serving frontier (trace replay)",
        "",
        f"Command: `{command_line('simulate_frontier.py', argv, prefix='.venv/bin/python')}`",
        "",
        f"Date: {started}; load average after {load[0]:.2f}. SPS(B) "
        + (
            "from " + repo_path(args.sps_table)
            if args.sps_table
            else "profiled on this machine for each R "
            f"(rows × 256 cached tokens, up to R·(γ+1) tokens, {torch.get_num_threads()} threads)"
        )
        + f"; trace and step costs from `{repo_path(args.run_dir)}`; {args.max_new_tokens} tokens per simulated "
        "request. All numbers are simulated.",
        "",
        f"![frontier]({plot.name})",
        "",
        "| policy | R | throughput (tok/s) | per-user speed (tok/s/user) | mean ℓ | τ |",
        "|---|---|---|---|---|---|",
    ]
    order = (*POLICIES, HINDSIGHT)
    for s in sorted(summaries, key=lambda s: (order.index(s.policy), s.concurrency)):
        lines.append(
            f"| {s.policy} | {s.concurrency} | {s.throughput:.2f} | {s.user_speed:.3f} | {s.budget:.2f} | {s.tau:.3f} |"
        )
    mtp1 = {s.concurrency: s.throughput for s in summaries if s.policy == "mtp1"}
    lines += [
        "",
        "Throughput over MTP-1's at the same R: "
        + "; ".join(
            f"R={r}: scheduler {by['scheduler'] / mtp1[r]:.3f}×, hindsight {by[HINDSIGHT] / mtp1[r]:.3f}×"
            for r, by in sorted(_by_level(summaries).items())
            if r in mtp1
        ),
    ]
    lines += [
        "",
        "SPS(B) per R (ms per verify forward at the smallest and largest profiled B): "
        + "; ".join(
            f"R={r}: {1000 / t.steps_per_second[0]:.0f} ms at B={t.batch_tokens[0]}, "
            f"{1000 / t.steps_per_second[-1]:.0f} ms at B={t.batch_tokens[-1]}"
            for r, t in sps.items()
        ),
    ]
    for policy in ("scheduler", "async", HINDSIGHT):
        result = speedup_at_matched_throughput(summaries, policy, "mtp1", simulated=True)
        lines.append("")
        points = ", ".join(
            f"{p.ratio:.2f}× at {p.throughput:.1f} tok/s (mtp1 R={p.concurrency})" for p in result.points
        )
        lines.append(
            f"{policy} vs mtp1: "
            + (
                result.reason
                if result.reason
                else f"per-user speed at matched throughput {result.median:.2f}× median (min {result.min:.2f}×, "
                f"max {result.max:.2f}×): {points}"
            )
        )
    lines += [
        "",
        f"{HINDSIGHT} is not causal (it knows each round's accepted count): its ratio is the most any "
        "verify-length policy could reach here with this drafter and these costs.",
    ]
    return "\n".join(lines) + "\n"


def _by_level(summaries: list) -> dict[int, dict[str, float]]:
    levels: dict[int, dict[str, float]] = {}
    for s in summaries:
        levels.setdefault(s.concurrency, {})[s.policy] = s.throughput
    return levels


def main(argv: list[str]) -> int:
    import torch

    from dspark.serving.plots import plot_frontier
    from dspark.serving.simulator import fit_step_costs, simulate_frontier, simulate_hindsight, trace_from_steps

    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.strftime("%Y-%m-%d %H:%M")
    trace_steps, real_steps = load_steps(args.run_dir, args.cells)
    costs = fit_step_costs(real_steps + trace_steps)  # as stage=serve fits them: the cells and the trace
    sps = tables(args)
    trace = trace_from_steps(trace_steps)
    summaries = simulate_frontier(
        trace,
        policies=POLICIES,
        concurrency_levels=args.concurrency,
        sps=sps,
        costs=costs,
        max_new_tokens=args.max_new_tokens,
        pad_to_longest=True,
        scheduler_cost=args.scheduler_cost,
    )
    summaries += [
        simulate_hindsight(
            trace, concurrency=rows, sps=sps[rows], costs=costs, max_new_tokens=args.max_new_tokens
        ).summary()
        for rows in args.concurrency
    ]
    plot = plot_frontier(summaries, args.output.with_suffix(".png"), title="Simulated frontier (trace replay)")
    write_result(markdown(summaries, sps, args, argv, started, plot), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
