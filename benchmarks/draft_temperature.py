"""How far a drafter's own distribution is from the acceptance-optimal sharpness: held-out teacher-forced acceptance
with its draft logits divided by a temperature T_d.

At sampling temperature 1 a draft survives with probability c* = Σ_{v ∈ Vd} min(p_d(v), p_t(v)) (METHOD §2.3), which
is largest when p_d = p_t. A drafter trained on cross-entropy alone (DFlash here, α = (1, 0, 0): DeepSpec's
baseline) fits p_t in KL, which spreads mass over tokens it is unsure of; one trained on the TV term (DSpark: α_tv
0.9) fits c* itself. Re-running the run's own validation blocks (same split, same anchors; DSpark/DFlash drafters) with
p_d = softmax(logits / T_d) shows how much acceptance the drafter leaves to its calibration: per T_d, c*₁…c*_γ and
τ_prob = 1 + Σ_k mean Π_{j≤k} c*_j (what the run logs as `val/tau_prob` at T_d = 1). Sampling at T_d ≠ 1 would keep
decoding lossless (the verifier reads the q it sampled from); this script only measures.

    .venv/bin/python benchmarks/draft_temperature.py budget=cpu-ref seed=0
    .venv/bin/python benchmarks/draft_temperature.py budget=cpu-ref drafter=dflash --temperatures 0.5 0.6 0.8 1

The arguments are `experiments/run.py`'s overrides (they name the run by its training key); the data caches and
the drafter must exist. Writes `outputs/benchmarks/draft-temperature-<run name>.md`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch

from common import RESULTS, command_line, git_commit, heldout_steps, load_run, repo_path, write_result


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=None)
    args, overrides = parser.parse_known_args(argv)
    if any(t <= 0 for t in args.temperatures):
        parser.error(f"--temperatures must all be > 0, got {args.temperatures}")
    return args, overrides


def draft_logits_and_target(*, drafter, target, batch, block_size: int):
    """(draft logits [B, N, γ, Vd] fp32, p_t over the draft vocabulary [B, N, γ, Vd], label validity [B, N, γ]) of a
    batch's blocks: the teacher-forced forward of training (`training.steps.block_forward`, `target_distribution`)."""
    from dspark.training.steps import block_forward, target_distribution

    out, blocks, final_hidden = block_forward(drafter=drafter, target=target, batch=batch, block_size=block_size)
    p_t = target_distribution(drafter, target, batch, final_hidden, blocks.target_positions).probs
    return out.logits.float(), p_t, blocks.label_valid


def scan(ctx, drafter, datamodule, temperatures: list[float]) -> dict[float, dict[str, float]]:
    """{T_d: {"accept/pos1"…, "tau_prob"}} over the run's validation blocks."""
    from dspark.metrics.acceptance import TeacherForcedAcceptance

    cfg = ctx.cfg
    if cfg.drafter not in ("dspark", "dflash"):
        raise SystemExit(f"error: drafter={cfg.drafter}: this probe runs the block drafters (dspark, dflash) only")
    metrics = {t: TeacherForcedAcceptance(cfg.model.block_size) for t in temperatures}
    for _, (logits, p_t, label_valid) in heldout_steps(ctx, drafter, datamodule, step=draft_logits_and_target):
        with torch.no_grad():
            for t in temperatures:
                c_star = torch.minimum(torch.softmax(logits / t, dim=-1), p_t).sum(-1).clamp(0.0, 1.0)
                metrics[t].update(c_star, label_valid)
    return {t: {k: float(v) for k, v in m.compute().items()} for t, m in metrics.items()}


def render(
    results: dict[float, dict[str, float]],
    *,
    gamma: int,
    argv: list[str],
    run_dir: Path,
    seconds: float,
    threads: int,
    load: float,
) -> str:
    base = results.get(1.0)
    best = max(results, key=lambda t: results[t]["tau_prob"])
    header = ["T_d", *[f"c*{k}" for k in range(1, gamma + 1)], "τ_prob", "vs T_d = 1"]
    rows = []
    for t in sorted(results):
        r = results[t]
        gain = f"{r['tau_prob'] / base['tau_prob'] - 1:+.1%}" if base else "–"
        mark = " **(best)**" if t == best else ""
        rows.append(
            f"| {t:g}{mark} | "
            + " | ".join(f"{r[f'accept/pos{k}']:.3f}" for k in range(1, gamma + 1))
            + f" | {r['tau_prob']:.4f} | {gain} |"
        )
    lines = [
        f"# Held-out acceptance against draft temperature — {run_dir.name}",
        "",
        f"Command: `{command_line('draft_temperature.py', argv)}` ({seconds:.0f} s)  ",
        f"Date {datetime.datetime.now():%Y-%m-%d %H:%M}, commit {git_commit()}; {os.cpu_count()} CPUs, "
        f"{threads} thread(s); load average at start {load:.1f}.  ",
        f"Drafter: `{repo_path(run_dir)}/drafter.pt`, its validation blocks; p_d = softmax(logits / T_d), "
        "c*k = Σ_{v ∈ Vd} min(p_d, p_t) per slot, τ_prob = 1 + Σ_k mean Π_{j≤k} c*_j.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *rows,
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    torch.set_num_threads(args.threads)
    started, load = time.time(), os.getloadavg()[0]
    ctx, _, datamodule, drafter, _ = load_run(overrides)
    results = scan(ctx, drafter, datamodule, sorted(set(args.temperatures)))
    text = render(
        results,
        gamma=ctx.cfg.model.block_size,
        argv=argv,
        run_dir=ctx.run_dir,
        seconds=time.time() - started,
        threads=args.threads,
        load=load,
    )
    write_result(text, args.output or RESULTS / f"draft-temperature-{ctx.run_dir.name}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
