"""What one single-request drafter round costs at each `decode.drafter_precision`, side by side on this machine.

A DSpark/DFlash round is three pieces of drafter work around the target's verify forward: the parallel stage (one
block forward over the cached context plus the LM head over the draft vocabulary), the sequential loop (the Markov
/ RNN head, confidences and sampling, slot by slot) and the context update (the newly committed positions fused and
projected to every layer's keys/values). This script times the three, interleaved round by round, for every
`--precisions` value of the same drafter (a trained one with `--drafter`, else a random-weight DSpark of `--depth`
layers and `--draft-vocab` ids: timing does not depend on the weights), over a `--context`-token context of real
target features, with a `--evict-mb` read between rounds as the target's forward does in decoding. It also times the
target's plain one-token step on the same context, so each precision's round reads as a share of it (issue 11's
target: the whole drafter round ≤ 20% of one plain step). The sequential loop runs every slot (no policy stop).

It measures; it changes nothing in the library. Writes `--output` with the command, machine, load and commit.

    .venv/bin/python benchmarks/bench_drafter_round.py --output outputs/benchmarks/drafter-round.md
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
    trained_drafters,
    untrained_drafters,
    write_result,
)

PIECES = ("parallel", "sequential", "extend")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument(
        "--drafter",
        default=None,
        metavar="NAME=PATH",
        help="a trained DSpark/DFlash drafter (run directory or drafter.pt); default: random weights",
    )
    parser.add_argument("--depth", type=int, default=2, help="draft layers of the random-weight drafter")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="Vd of the random-weight drafter (0 = full V)")
    parser.add_argument(
        "--precisions",
        nargs="+",
        default=["fp32", "bf16", "int8"],
        help="decode.drafter_precision values to compare (auto | fp32 | bf16 | int8)",
    )
    parser.add_argument("--context", type=int, default=256, help="positions in the drafter's cached context")
    parser.add_argument("--committed", type=int, default=2, help="positions committed per round (context update)")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds (the first 5 are warm-up)")
    parser.add_argument("--evict-mb", type=int, default=32, help="MB read before each round (0: none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS / "drafter-round.md")
    args = parser.parse_args(argv)
    if args.context < 16 or args.committed < 1 or args.rounds < 6 or args.evict_mb < 0:
        parser.error("--context must be >= 16, --committed >= 1, --rounds >= 6 and --evict-mb >= 0")
    return args


def main(argv: list[str]) -> int:
    from dspark.decoding.proposers import DSparkProposer
    from dspark.targets import load_target

    args = parse_args(argv)
    started, load_start = start_timing(args.threads)
    target = load_target(args.target, cache_dir=args.cache_dir)
    if args.drafter:
        found = trained_drafters(target, [args.drafter])[0]
    else:  # bench_decoding's random-weight stand-ins (γ = 7, seed 0); the first is the DSpark-Markov one
        found = untrained_drafters(target, depth=args.depth, block_size=7, draft_vocab=args.draft_vocab, seed=0)[0]
    name, module = found.name, found.module
    if not hasattr(module, "backbone"):
        raise SystemExit(
            f"--drafter {args.drafter}: a DSpark or DFlash drafter is needed (this script times the "
            "parallel stage, the sequential loop and the context update of DSparkProposer)"
        )
    gen = torch.Generator().manual_seed(0)
    span = args.context + args.committed * args.rounds
    ids = torch.randint(100, target.vocab_size - 100, (1, span + 1), generator=gen)
    with torch.no_grad():
        features = target.forward(ids, cache=target.new_cache()).features  # [1, span + 1, m·d]
        plain_cache = target.new_cache()
        target.forward(ids[:, : args.context], cache=plain_cache)
    proposers = {p: DSparkProposer(module, precision=p) for p in args.precisions}
    for proposer in proposers.values():
        proposer.start(features=features[:, : args.context])
    evict = torch.ones(args.evict_mb * 2**18) if args.evict_mb else None
    times: dict[tuple[str, str], list[float]] = {}
    plain: list[float] = []

    def read_evict() -> None:
        if evict is not None:
            float(evict.sum())

    with torch.no_grad():
        for round_ in range(args.rounds):
            read_evict()
            start = time.perf_counter()
            forward = target.forward(ids[:, args.context : args.context + 1], cache=plain_cache)
            target.logits_from_hidden(forward.final_hidden)
            if round_ >= 5:
                plain.append(time.perf_counter() - start)
            target.rollback(plain_cache, keep=args.context)
            for precision, proposer in proposers.items():
                read_evict()
                position = proposer.context_length
                proposal = proposer.propose(
                    anchor_token=int(ids[0, position]),
                    anchor_position=position,
                    temperature=1.0,
                    generator=gen,
                    stop_ids=(),
                )
                start = time.perf_counter()
                proposer.extend(features=features[:, position : position + args.committed])
                extend = time.perf_counter() - start
                if round_ >= 5:
                    for piece, seconds in zip(PIECES, (proposal.seconds_parallel, proposal.seconds_sequential, extend)):
                        times.setdefault((precision, piece), []).append(seconds)
    plain_ms = statistics.median(plain) * 1e3

    def cell(precision: str, piece: str) -> float:
        return statistics.median(times[(precision, piece)]) * 1e3

    lines = [
        f"# One drafter round by decode.drafter_precision — {args.target}",
        "",
        f"Command: `{command_line('bench_drafter_round.py', argv)}` ({time.time() - started:.0f} s in all)  ",
        f"Machine: {machine_line()}; target {str(target.dtype).replace('torch.', '')}  ",
        provenance_line(load_start, threads=args.threads),
        "",
        f"Drafter: {name}. Context {args.context} positions of real target features (random prompt tokens), "
        f"{args.committed} positions committed per round, γ = {module.block_size} slots sampled at T = 1 every "
        f"round (no policy stop), {args.evict_mb} MB read before each round. Medians over {args.rounds - 5} "
        f"interleaved rounds after 5 warm-up rounds. The target's plain one-token step on the same context: "
        f"**{plain_ms:.1f} ms**.",
        "",
        "| precision | parallel stage (ms) | sequential loop (ms) | context update (ms) | round (ms) | "
        "round / plain step |",
        "|---|---|---|---|---|---|",
    ]
    for precision in args.precisions:
        parts = [cell(precision, piece) for piece in PIECES]
        lines.append(
            f"| {precision} | {parts[0]:.2f} | {parts[1]:.2f} | {parts[2]:.2f} | {sum(parts):.2f} | "
            f"{sum(parts) / plain_ms:.1%} |"
        )
    lines += [
        "",
        "The sequential loop stays fp32 at every precision (one-row products over W₂; "
        "`dspark.decoding.drafting`); its differences between rows are noise and the sampled ids. A policy "
        "that stops drafting early (the scheduler) pays less of it.",
    ]
    write_result("\n".join(lines) + "\n", args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
