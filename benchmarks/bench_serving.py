"""Batched serving step cost on this machine: how one engine step scales with the number of concurrent requests R.

For R in --concurrency, the `BatchedEngine` serves R·--waves requests (the first prompts of gsm8k, humaneval and
mt-bench, cycled) with policy `fixed` at temperature 1 and an *untrained* DSpark drafter of each head (timing does not
depend on the weights; τ ≈ 1, so every step verifies γ drafts per request and commits about one token). Reported per
(head, R), medians over steady steps (no joins): ms per step, split into the drafter's parallel forward, its sequential
loop, the one target verify forward and the rest (verifier, rollbacks, context updates), plus the sequential loop's
share of the step (Fig. 4 right, now at batch R), target forwards per step, and committed tokens per second.

    .venv/bin/python benchmarks/bench_serving.py                              # smollm2-135m, a few minutes
    .venv/bin/python benchmarks/bench_serving.py --target tiny --max-new-tokens 8   # seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from common import RESULTS, add_target_arguments, command_line, machine_line, untrained_drafter, write_result
from dspark.data.prompts import load_prompts
from dspark.decoding.drafting import resolve_precision
from dspark.serving import BatchedEngine, ServeRequest, build_serve_policy
from dspark.targets import load_target

SETS = ("gsm8k", "humaneval", "mt-bench")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--heads", nargs="+", default=["none", "markov"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--waves", type=int, default=1, help="requests served = waves × R")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--block-size", type=int, default=7)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="Vd of the untrained drafters (0 = full V)")
    parser.add_argument("--precision", default="auto", help="decode.drafter_precision: auto | fp32 | bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=RESULTS / "serving.md")
    return parser.parse_args(argv)


def make_requests(target, count: int, max_new_tokens: int) -> list[ServeRequest]:
    prompts = [r for name in SETS for r in load_prompts(name, limit=max(1, count // len(SETS) + 1))]
    return [
        ServeRequest(
            request_id=i,
            prompt_ids=target.chat_prompt_ids(prompts[i % len(prompts)].prompt),
            domain=prompts[i % len(prompts)].domain,
            max_new_tokens=max_new_tokens,
        )
        for i in range(count)
    ]


class ForwardCounter:
    """Counts calls of the target's forward (to show one verify forward per step whatever R)."""

    def __init__(self, target) -> None:
        self.target, self.calls, self._forward = target, 0, target.forward

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self._forward(*args, **kwargs)

        self.target.forward = counted
        return self

    def __exit__(self, *exc) -> None:
        self.target.forward = self._forward


def bench_cell(target, *, head: str, concurrency: int, args: argparse.Namespace) -> dict:
    # a random-weight DSpark drafter (timing does not depend on the weights) over the first --draft-vocab ids
    drafter = untrained_drafter(
        target, head=head, depth=args.depth, block_size=args.block_size, draft_vocab=args.draft_vocab
    )
    engine = BatchedEngine(
        target=target,
        drafter=drafter,
        policy=build_serve_policy("fixed"),
        temperature=1.0,
        max_new_tokens=args.max_new_tokens,
        precision=args.precision,
    )
    requests = make_requests(target, concurrency * args.waves, args.max_new_tokens)
    engine.serve(requests[:concurrency], concurrency=concurrency, seed=1, progress=False)  # warm-up
    with ForwardCounter(target) as counter:
        result = engine.serve(requests, concurrency=concurrency, seed=0, progress=False)
    steady = [s for s in result.steps if s.seconds_prefill == 0 and s.num_active == concurrency] or result.steps
    med = lambda values: 1000 * statistics.median(values)  # noqa: E731
    sequential = med([s.seconds_draft_sequential for s in steady])
    draft = med([s.seconds_draft for s in steady])
    step = med([s.seconds for s in steady])
    joins = sum(1 for s in result.steps if s.seconds_prefill > 0)
    return {
        "head": head,
        "R": concurrency,
        "steps": len(steady),
        "step_ms": step,
        "draft_parallel_ms": draft - sequential,
        "sequential_ms": sequential,
        "verify_ms": med([s.seconds_verify for s in steady]),
        "other_ms": med([s.seconds_other for s in steady]),
        "sequential_share": sequential / step,
        "verify_rows_ms": med([s.seconds_verify_rows for s in steady]),
        "extend_ms": med([s.seconds_extend for s in steady]),
        "bookkeeping_ms": med([s.seconds_bookkeeping for s in steady]),
        "forwards_per_step": (counter.calls - joins) / len(result.steps),
        "tok_s": sum(len(r.new_tokens) for r in result.requests) / result.wall_seconds,
    }


def w2_layouts(target, concurrency: list[int], *, rank: int = 256, repeats: int = 20) -> list[dict]:
    """The Markov/RNN W_2 product of the decoding loop, x [R, r] → [R, V], two weight layouts timed interleaved:
    nn.Linear's [V, r] (what the loop used before) and the contiguous [r, V] copy `DecodeProjection` caches."""
    layer = torch.nn.Linear(rank, target.vocab_size, bias=False)
    weight_t = layer.weight.detach().t().contiguous()
    out = []
    with torch.no_grad():
        for rows in concurrency:
            x = torch.randn(rows, rank)
            times = {"linear": [], "cached": []}
            for _ in range(repeats):
                for name, fn in (
                    ("linear", lambda: torch.nn.functional.linear(x, layer.weight)),
                    ("cached", lambda: x @ weight_t),
                ):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            linear, cached = (1000 * statistics.median(times[k]) for k in ("linear", "cached"))
            out.append({"R": rows, "linear_ms": linear, "cached_ms": cached})
    return out


def markdown(rows: list[dict], args: argparse.Namespace, argv: list[str], started: str) -> str:
    load = os.getloadavg()
    lines = [
        "# Batched serving step benchmark",
        "",
        f"Command: `{command_line('bench_serving.py', argv, prefix='.venv/bin/python')}`",
        "",
        f"Date: {started}. Machine: {machine_line()}; target fp32, drafter "
        f"parallel stage {str(resolve_precision(args.precision)).replace('torch.', '')} "
        f"(--precision {args.precision}). Load average after: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} "
        "(other jobs on the machine add noise; ratios within a row group are the point).",
        "",
        f"Target {args.target}; untrained DSpark drafters (depth {args.depth}, γ = {args.block_size}, rank 256, "
        f"draft vocabulary {args.draft_vocab or 'full'}), "
        f"policy fixed (every step verifies γ drafts per request), temperature 1, {args.max_new_tokens} new "
        f"tokens per request, {args.waves} × R requests. Medians over steady steps (R active, no joins).",
        "",
        '"Other" is split into the per-row verifier (p_t rows, rejection sampling, commit), the context '
        "updates (target KV store and drafter context) and the rest, the engine's Python bookkeeping (policy, "
        'block assembly, leaves, compaction; the single-request engine\'s "other").',
        "",
        "| head | R | steps | step ms | draft parallel ms | sequential loop ms | verify ms | other ms "
        "(verifier rows / context updates / bookkeeping) | sequential share | target forwards / step | tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['head']} | {r['R']} | {r['steps']} | {r['step_ms']:.1f} | {r['draft_parallel_ms']:.1f} | "
            f"{r['sequential_ms']:.1f} | {r['verify_ms']:.1f} | {r['other_ms']:.1f} ({r['verify_rows_ms']:.2f} / "
            f"{r['extend_ms']:.2f} / {r['bookkeeping_ms']:.2f}) | "
            f"{100 * r['sequential_share']:.1f}% | {r['forwards_per_step']:.2f} | {r['tok_s']:.1f} |"
        )
    base = {r["head"]: r for r in rows if r["R"] == min(args.concurrency)}
    lines.insert(6, "The sequential loop's W₂ product uses the cached contiguous [r, V] copy (`DecodeProjection`).")
    lines.insert(7, "")
    lines += [
        "",
        "Step cost relative to the smallest R (same head): "
        + "; ".join(
            f"{r['head']} R={r['R']}: {r['step_ms'] / base[r['head']]['step_ms']:.2f}×"
            for r in rows
            if r["head"] in base
        ),
    ]
    if args.w2_rows:
        lines += [
            "",
            f"W₂ product of one decoding slot, rank 256 × V = {args.vocab}, medians of 20 interleaved calls "
            "(the sequential loop does γ of these per step):",
            "",
            "| R | nn.Linear [V, r] ms | cached contiguous [r, V] ms | ratio |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['R']} | {r['linear_ms']:.2f} | {r['cached_ms']:.2f} | {r['linear_ms'] / r['cached_ms']:.2f}× |"
            for r in args.w2_rows
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.strftime("%Y-%m-%d %H:%M")
    target = load_target(args.target, cache_dir=args.cache_dir)
    rows = []
    for concurrency in args.concurrency:
        for head in args.heads:
            rows.append(bench_cell(target, head=head, concurrency=concurrency, args=args))
            print(rows[-1], flush=True)
    args.w2_rows, args.vocab = w2_layouts(target, args.concurrency), target.vocab_size
    write_result(markdown(rows, args, argv, started), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
