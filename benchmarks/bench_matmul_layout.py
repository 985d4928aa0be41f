"""Why verifying 2+ tokens costs ~1.7 plain steps on some CPUs: the matrix-product layout of a few-token forward.

A verify forward pushes B = ℓ + 1 tokens through the target. `nn.Linear` computes x Wᵀ for x [B, K] and W [N, K]; at
B = 1 BLAS takes a matrix-vector path that streams W once, at B ≥ 2 a general product that (on some BLAS/CPU
pairs, e.g. MKL on an AVX2-only AMD EPYC Zen 3) costs ~2× that for weights that live in DRAM. The same product in
the other layout, (W xᵀ)ᵀ = `torch.mm(W, x.T).T`, gives the same numbers up to summation order. This script times,
interleaved round by round on this machine, with the real target (fp32, `--threads` threads):

1. the LM head alone (W [V, d]) at B = 1, 2, 3, 4, 8 in both layouts;
2. one target forward of B new tokens over a `--context`-token KV cache plus its LM head (what a verify round's
   target step does), with every `nn.Linear` of the target as shipped and with every one switched to the (W xᵀ)ᵀ
   layout for B ≤ 16 (`dspark.hardware.use_few_row_products`, undone after each cell).

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


@contextlib.contextmanager
def layout(model: torch.nn.Module, transposed: bool):
    """Every nn.Linear of `model` in the chosen layout for the duration of the block: the library's own switch
    (`dspark.hardware.use_few_row_products`), undone on exit."""
    from dspark.hardware import use_few_row_products

    if transposed:
        use_few_row_products(model)
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

    def head(b: int, transposed: bool):
        x = torch.randn(b, weight.shape[1], generator=gen)
        return (lambda: few_row_product(x, weight)) if transposed else (lambda: torch.nn.functional.linear(x, weight))

    def step(b: int):
        tokens = torch.randint(100, target.vocab_size - 100, (1, b), generator=gen)

        def run():
            forward = target(tokens, cache=cache, use_cache=True)
            target.logits_from_hidden(forward.final_hidden[0])
            target.rollback(cache, keep=args.context)
        return run

    results: dict[tuple[str, int, bool], list[float]] = {}
    for _ in range(args.rounds):
        for b in SIZES:
            for transposed in (False, True):
                results.setdefault(("head", b, transposed), []).append(median_ms(head(b, transposed), args.reps))
                with layout(target.model, transposed):
                    results.setdefault(("step", b, transposed), []).append(median_ms(step(b), args.reps))
    load_end = os.getloadavg()

    def cell(kind: str, b: int, transposed: bool) -> float:
        return statistics.median(results[(kind, b, transposed)])

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
             "", "| B tokens | LM head x Wᵀ (ms) | LM head (W xᵀ)ᵀ (ms) | ratio | step, shipped nn.Linear (ms) | "
             "step, every Linear (W xᵀ)ᵀ (ms) | ratio | shipped step / its B = 1 |",
             "|---|---|---|---|---|---|---|---|"]
    plain = cell("step", 1, False)
    for b in SIZES:
        h0, h1, s0, s1 = cell("head", b, False), cell("head", b, True), cell("step", b, False), cell("step", b, True)
        lines.append(f"| {b} | {h0:.1f} | {h1:.1f} | {h1 / h0:.2f} | {s0:.1f} | {s1:.1f} | {s1 / s0:.2f} | "
                     f"{s0 / plain:.2f} |")
    lines += ["", "Ratio < 1: the (W xᵀ)ᵀ layout is faster on this machine for that B. The last column is the cost of "
              "verifying B − 1 drafts in plain steps, as the library ships today."]
    args.output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
