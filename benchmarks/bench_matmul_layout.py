"""Why verifying 2+ tokens cost ~1.7 plain steps on some CPUs: the matrix-product layout of a few-token forward.

A verify forward pushes B = ℓ + 1 tokens through the target. `nn.Linear` computes x Wᵀ for x [B, K] and W [N, K]; at
B = 1 BLAS takes a matrix-vector path that streams W once, at B ≥ 2 a general product that (on some BLAS/CPU
pairs, e.g. MKL on an AVX2-only AMD EPYC Zen 3) costs ~2× that for weights that live in DRAM. The same product in
the other layout, (W xᵀ)ᵀ = `torch.mm(W, x.T).T`, gives the same numbers up to summation order. This script times,
interleaved round by round on this machine, with the real target (fp32, `--threads` threads):

1. the LM head alone (W [V, d]) at B = 1, 2, 3, 4, 8 in both layouts, and at B = 1 also as a two-row (W xᵀ)ᵀ product
   whose second row is zero (`few_row_product(..., pad_single_row=True)`: the matrix-vector kernel BLAS takes at one
   row can be slower than its two-row matrix product);
2. one target forward of B new tokens over a `--context`-token KV cache plus its LM head (what a verify round's
   target step does), with every `nn.Linear` of the target as `nn.Linear` ships it, with every one switched to the
   (W xᵀ)ᵀ layout for B ≤ 16 (`dspark.hardware.use_few_row_products`, undone after each cell), and at B = 1 with
   that layout's one-row products padded to two (`pad_single_row=True`).

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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_decoding import git_commit, load_verdict  # noqa: E402  (one provenance format for the benchmarks)

SIZES = (1, 2, 3, 4, 8)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--cache-dir", type=Path, default=REPO / "outputs" / "cache")
    parser.add_argument("--context", type=int, default=200, help="tokens in the KV cache before each forward")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each times every cell)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per cell and round (median kept)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "matmul-layout.md")
    return parser.parse_args(argv)


MODES = ("linear", "transposed", "padded")  # nn.Linear as shipped; (W xᵀ)ᵀ; (W xᵀ)ᵀ with one row padded to two


@contextlib.contextmanager
def layout(model: torch.nn.Module, mode: str):
    """Every nn.Linear of `model` in the chosen mode for the duration of the block: the library's own switch
    (`dspark.hardware.use_few_row_products`), undone on exit."""
    from dspark.hardware import use_few_row_products

    if mode != "linear":
        use_few_row_products(model, pad_single_row=mode == "padded")
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
    from dspark.hardware import FEW_ROW_LAYOUT_ENV, cpu_bf16_unit, cpu_model, few_row_product, keep_freed_memory
    from dspark.targets import load_target

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    started, load_start = time.time(), os.getloadavg()
    # the shipped nn.Linear layout at load: the target's own probe would otherwise already have switched it
    os.environ[FEW_ROW_LAYOUT_ENV] = "linear"
    target = load_target(args.target, cache_dir=args.cache_dir)
    weight = target.lm_head.weight.detach()
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(100, target.vocab_size - 100, (1, args.context), generator=gen)
    cache = target.new_cache()
    target(context, cache=cache, use_cache=True)

    def head(b: int, mode: str):
        x = torch.randn(b, weight.shape[1], generator=gen)
        if mode == "linear":
            return lambda: torch.nn.functional.linear(x, weight)
        return lambda: few_row_product(x, weight, pad_single_row=mode == "padded")

    def step(b: int):
        tokens = torch.randint(100, target.vocab_size - 100, (1, b), generator=gen)

        def run():
            forward = target(tokens, cache=cache, use_cache=True)
            target.logits_from_hidden(forward.final_hidden[0])
            target.rollback(cache, keep=args.context)
        return run

    results: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for b in SIZES:
            for mode in MODES if b == 1 else MODES[:2]:  # padding only changes one-row products
                results.setdefault(("head", b, mode), []).append(median_ms(head(b, mode), args.reps))
                with layout(target.model, mode):
                    results.setdefault(("step", b, mode), []).append(median_ms(step(b), args.reps))
    load_end = os.getloadavg()

    def cell(kind: str, b: int, mode: str) -> float:
        return statistics.median(results[(kind, b, mode)])

    lines = [f"# Matrix-product layout of a few-token forward — {args.target}", "",
             f"Command: `python benchmarks/bench_matmul_layout.py {' '.join(argv)}` ({time.time() - started:.0f} s "
             "in all)  ",
             f"Machine: {cpu_model()}, {os.cpu_count()} cores, bf16 instructions {cpu_bf16_unit() or 'none'}; torch "
             f"{torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads; target "
             f"float32  ",
             f"Git commit {git_commit()}; {time.strftime('%Y-%m-%d %H:%M %Z')}; 1-min load average "
             f"{load_start[0]:.1f} / {load_end[0]:.1f} at the start / end "
             f"({load_verdict(load_start[0], args.threads)}).", "",
             f"Each cell: the median over {args.rounds} interleaved rounds of the median of {args.reps} calls (after a "
             f"warm-up). Step = one target forward of B new tokens over a {args.context}-token KV cache plus the LM "
             "head on its B positions (a verify round's target work at ℓ = B − 1; B = 1 is a plain decoding step).",
             "", "| B tokens | LM head x Wᵀ (ms) | LM head (W xᵀ)ᵀ (ms) | ratio | step, nn.Linear (ms) | "
             "step, every Linear (W xᵀ)ᵀ (ms) | ratio | nn.Linear step / its B = 1 | (W xᵀ)ᵀ step / its B = 1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    plain = {mode: cell("step", 1, mode) for mode in MODES}
    for b in SIZES:
        h0, h1 = cell("head", b, "linear"), cell("head", b, "transposed")
        s0, s1 = cell("step", b, "linear"), cell("step", b, "transposed")
        lines.append(f"| {b} | {h0:.1f} | {h1:.1f} | {h1 / h0:.2f} | {s0:.1f} | {s1:.1f} | {s1 / s0:.2f} | "
                     f"{s0 / plain['linear']:.2f} | {s1 / plain['transposed']:.2f} |")
    padded_head, padded_step = cell("head", 1, "padded"), cell("step", 1, "padded")
    lines += ["", "Ratio < 1: the (W xᵀ)ᵀ layout is faster on this machine for that B. The last two columns are the "
              "cost of verifying B − 1 drafts in plain steps in each layout.", "",
              f"One row computed as two (the second zero), B = 1: LM head {padded_head:.1f} ms against "
              f"{cell('head', 1, 'transposed'):.1f} ms one-row (W xᵀ)ᵀ and {cell('head', 1, 'linear'):.1f} ms x Wᵀ; "
              f"the whole 1-token step {padded_step:.1f} ms against {plain['transposed']:.1f} and "
              f"{plain['linear']:.1f} ms. With it, verifying B − 1 drafts in (W xᵀ)ᵀ costs "
              + ", ".join(f"{cell('step', b, 'transposed') / padded_step:.2f}" for b in SIZES[1:])
              + f" plain steps at B = {', '.join(str(b) for b in SIZES[1:])} "
              "(the library's choice on a machine where `dspark.hardware.single_row_padding` measures it faster)."]
    args.output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
