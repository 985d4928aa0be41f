"""Why verifying 2+ tokens cost ~1.7 plain steps on some CPUs: the matrix-product layout of a few-token forward.

A verify forward pushes B = ℓ + 1 tokens through the target. `nn.Linear` computes x Wᵀ for x [B, K] and W [N, K]; at
B = 1 BLAS takes a matrix-vector path that streams W once, at B ≥ 2 a general product that (on some BLAS/CPU
pairs, e.g. MKL on an AVX2-only AMD EPYC Zen 3) costs ~2× that for weights that live in DRAM. The same product in
the other layout, (W xᵀ)ᵀ = `torch.mm(W, x.T).T`, gives the same numbers up to summation order. This script times,
interleaved round by round on this machine, with the real target (fp32, `--threads` threads):

1. the LM head alone (W [V, d]) at each `--sizes` B in both layouts, and in the (W xᵀ)ᵀ layout with the row-padding
   table the library would choose here (`dspark.targets.layout.row_padding`, probed at the start, or
   `--padding n:m,...`): BLAS picks its kernel by shape, so e.g. one row (matrix-vector) or three can cost more than
   two or four;
2. one target forward of B new tokens over a `--context`-token KV cache plus its LM head (what a verify round's
   target step does), with every `nn.Linear` of the target as `nn.Linear` ships it, with every one switched to the
   (W xᵀ)ᵀ layout for B ≤ 16 (`dspark.targets.layout.use_few_row_products`, undone after each cell), and in that
   layout with the padding table (padded B only: the others compute exactly as unpadded).

It measures; it changes nothing in the library. Writes `--output` with the command, machine, load and commit.

    .venv/bin/python benchmarks/bench_matmul_layout.py --cache-dir outputs/cache
"""

from __future__ import annotations

import argparse
import contextlib
import os
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


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--context", type=int, default=200, help="tokens in the KV cache before each forward")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each times every cell)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per cell and round (median kept)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16],
        help="B tokens per forward (each at most dspark.targets.layout.FEW_ROWS)",
    )
    parser.add_argument(
        "--padding",
        default="auto",
        help="the row-padding table of the padded cells: auto (probe as the library does) or n:m,...",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "matmul-layout.md")
    return parser.parse_args(argv)


MODES = ("linear", "transposed", "padded")  # nn.Linear as shipped; (W xᵀ)ᵀ; (W xᵀ)ᵀ with the row-padding table


@contextlib.contextmanager
def layout(model: torch.nn.Module, mode: str, padding: dict[int, int]):
    """Every nn.Linear of `model` in the chosen mode for the duration of the block: the library's own switch
    (`dspark.targets.layout.use_few_row_products`, with `padding` in the padded mode), undone on exit."""
    from dspark.targets.layout import use_few_row_products

    if mode != "linear":
        use_few_row_products(model, row_padding=padding if mode == "padded" else None)
    try:
        yield
    finally:
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.__dict__.pop("forward", None)


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    from dspark.targets.layout import (
        FEW_ROW_LAYOUT_ENV,
        FEW_ROWS,
        ROW_PAD_ENV,
        few_row_product,
        format_row_padding,
        parse_row_padding,
        row_padding,
    )
    from dspark.targets import load_target

    args = parse_args(argv)
    if not all(1 <= b <= FEW_ROWS for b in args.sizes):
        raise SystemExit(f"--sizes: each B must be in 1..{FEW_ROWS} (the few-row range), got {args.sizes}")
    padding_given = parse_row_padding(args.padding) if args.padding != "auto" else None
    started, load_start = start_timing(args.threads)
    # the shipped nn.Linear layout at load: the target's own probe would otherwise already have switched it
    os.environ[FEW_ROW_LAYOUT_ENV] = "linear"
    target = load_target(args.target, cache_dir=args.cache_dir)
    weight = target.lm_head.weight.detach()
    probe_costs: dict[int, float] = {}
    if padding_given is None:
        os.environ.pop(ROW_PAD_ENV, None)
        padding, probe_costs = row_padding(weight)
    else:
        padding = padding_given
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(100, target.vocab_size - 100, (1, args.context), generator=gen)
    cache = target.new_cache()
    target(context, cache=cache, use_cache=True)

    def head(b: int, mode: str):
        x = torch.randn(b, weight.shape[1], generator=gen)
        if mode == "linear":
            return lambda: torch.nn.functional.linear(x, weight)
        return lambda: few_row_product(x, weight, row_padding=padding if mode == "padded" else None)

    def step(b: int):
        tokens = torch.randint(100, target.vocab_size - 100, (1, b), generator=gen)

        def run():
            forward = target(tokens, cache=cache, use_cache=True)
            target.logits_from_hidden(forward.final_hidden[0])
            target.rollback(cache, keep=args.context)

        return run

    results: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for b in args.sizes:
            for mode in MODES if b in padding else MODES[:2]:  # padding only changes the padded row counts
                results.setdefault(("head", b, mode), []).append(median_ms(head(b, mode), args.reps))
                with layout(target.model, mode, padding):
                    results.setdefault(("step", b, mode), []).append(median_ms(step(b), args.reps))

    def cell(kind: str, b: int, mode: str) -> float:
        return statistics.median(results[(kind, b, mode)])

    lines = [
        f"# Matrix-product layout of a few-token forward — {args.target}",
        "",
        f"Command: `{command_line('bench_matmul_layout.py', argv)}` ({time.time() - started:.0f} s in all)  ",
        f"Machine: {machine_line()}; target float32  ",
        provenance_line(load_start, threads=args.threads),
        "",
        f"Each cell: the median over {args.rounds} interleaved rounds of the median of {args.reps} calls (after a "
        f"warm-up). Step = one target forward of B new tokens over a {args.context}-token KV cache plus the LM "
        "head on its B positions (a verify round's target work at ℓ = B − 1; B = 1 is a plain decoding step).",
        "",
        f"Row-padding table of the padded cells: `{format_row_padding(padding)}` ("
        + (
            "probed on the LM head as `dspark.targets.layout.row_padding` does at target load: "
            + ", ".join(f"{n} {c:.1f}" for n, c in sorted(probe_costs.items()))
            + " ms by rows"
            if padding_given is None
            else "given by --padding"
        )
        + ").",
        "",
        "| B tokens | LM head x Wᵀ (ms) | LM head (W xᵀ)ᵀ (ms) | padded (ms) | step, nn.Linear (ms) | "
        "step, every Linear (W xᵀ)ᵀ (ms) | padded step (ms) | nn.Linear step / its B = 1 | (W xᵀ)ᵀ step / its "
        "B = 1 | padded step / its B = 1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def library(kind: str, b: int) -> float:
        """The padded layout's cost at B: the padded cell where B is padded, the (W xᵀ)ᵀ one otherwise."""
        return cell(kind, b, "padded" if b in padding else "transposed")

    plain = {
        "linear": cell("step", 1, "linear"),
        "transposed": cell("step", 1, "transposed"),
        "padded": library("step", 1),
    }
    for b in args.sizes:
        h0, h1, s0, s1 = (
            cell("head", b, "linear"),
            cell("head", b, "transposed"),
            cell("step", b, "linear"),
            cell("step", b, "transposed"),
        )
        padded_cells = (
            (f"{library('head', b):.1f} (→ {padding[b]})", f"{library('step', b):.1f} (→ {padding[b]})")
            if b in padding
            else ("same", "same")
        )
        lines.append(
            f"| {b} | {h0:.1f} | {h1:.1f} | {padded_cells[0]} | {s0:.1f} | {s1:.1f} | {padded_cells[1]} | "
            f"{s0 / plain['linear']:.2f} | {s1 / plain['transposed']:.2f} | "
            f"{library('step', b) / plain['padded']:.2f} |"
        )
    lines += [
        "",
        "The last three columns are the cost of verifying B − 1 drafts in plain steps in each layout (the "
        "padded one is the library's choice on a machine where `few_row_layout` picks (W xᵀ)ᵀ). A padded B "
        "computes its products with the table's rows, the extra ones zero; the target sees B tokens.",
    ]
    write_result("\n".join(lines) + "\n", args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
