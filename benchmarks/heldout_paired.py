"""Two drafters on the same held-out sequences: teacher-forced τ_prob, the gain of one over the other, and how that
gain changes along an axis, with paired bootstrap 95% CIs over sequences.

A sweep evaluated with one seed gives its teacher-forced `val/tau_prob` no interval (one run, thousands of blocks,
no spread logged), and its rollouts sample 20 prompts per set, so a gain that grows by a few percent between two
block sizes is hidden in their noise. Cells of one sweep share the data cache, the data seed and so the held-out
split: this script re-runs each cell's validation blocks (same split, same fixed anchors, same loss code as the
run's own `val/` metrics; `benchmarks/heldout_breakdown.py` explains them), keeps per held-out *sequence* the sum
of per-block τ and the block count, and resamples sequences — the same resample for every cell — so that

- τ_prob of a cell = Σ_blocks τ_block / #blocks (the run's `val/tau_prob`, recomputed; a check against the log);
- gain at axis value v = τ_prob(A, v) / τ_prob(B, v) − 1, A and B evaluated on the same blocks;
- change of the gain from the first axis value to v = gain(v) − gain(first): the question "does DSpark's gain over
  DFlash grow with γ" (paper Fig. 4 left), answered on the same sequences with every correlation kept.

Scopes: every held-out sequence, the target-written ones (`regenerated`: the text rollouts see), and each training
domain. Percentile intervals from `--resamples` bootstrap draws (seeded). They say how much the comparison depends
on *which held-out sequences* were drawn, not on which training seed made each drafter: a one-seed sweep cannot
measure that, and the output says so (the depth sweep's seed pairs measure it: quote them beside these intervals).

    .venv/bin/python benchmarks/heldout_paired.py --axis model.block_size=3,7,11,15 \
        --a model.head=markov --b drafter=dflash -- budget=cpu-ref

Arguments after `--` are `experiments/run.py`'s overrides shared by every cell; `--a` / `--b` add the two sides'
own. The drafters and data caches must exist (run the sweep first). Per-sequence sums are cached beside each
drafter (`<run dir>/heldout-sequences.pt`, tensors only, keyed by the drafter file's size and mtime), so a rerun
that adds an axis value evaluates only the new cells.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common import (
    RESULTS,
    command_line,
    git_commit,
    heldout_steps,
    load_validation,
    locate_run,
    reference_count,
    write_result,
)

CACHE_NAME = "heldout-sequences.pt"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--axis", default=None, help="KEY=V1,V2,…: one pair of cells per value (omit for a single pair)"
    )
    parser.add_argument("--a", nargs="*", default=[], help="overrides of side A (the variant)")
    parser.add_argument("--b", nargs="*", default=[], help="overrides of side B (the baseline)")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=None, help="markdown file (default under outputs/benchmarks)")
    parser.add_argument("overrides", nargs="*", help="overrides shared by every cell (after --)")
    args = parser.parse_args(argv)
    if args.resamples < 100:
        parser.error(f"--resamples must be at least 100 for a 95% interval (got {args.resamples})")
    if not args.a and not args.b:
        parser.error(
            "give --a and/or --b: the two sides' own overrides (e.g. --a model.head=markov --b drafter=dflash)"
        )
    return args


def axis_values(axis: str | None) -> tuple[str | None, list[str]]:
    """'model.block_size=3,7' → ('model.block_size', ['3', '7']); None → (None, [''])."""
    if axis is None:
        return None, [""]
    key, sep, values = axis.partition("=")
    items = [v for v in values.split(",") if v]
    if not sep or not key or not items:
        raise SystemExit(f"error: --axis must read KEY=V1,V2,… (got {axis!r})")
    return key, items


@dataclass
class SequenceSums:
    """Per held-out sequence (indexed by the dataset's sequence index): Σ τ_block and #blocks."""

    index: torch.Tensor  # [S] long
    tau_sum: torch.Tensor  # [S] float64
    blocks: torch.Tensor  # [S] float64

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"index": self.index, "tau_sum": self.tau_sum, "blocks": self.blocks}


def block_tau(c_star: torch.Tensor, label_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block (τ_block, counted) exactly as `TeacherForcedAcceptance`: 1 + Σ over the valid prefix of Π c*."""
    from dspark.metrics.acceptance import prefix_mask

    valid = prefix_mask(label_valid)
    c = torch.where(valid, c_star.double(), 0.0)
    return 1.0 + torch.cumprod(c, dim=-1).sum(dim=-1), valid[..., 0]


def sequence_sums(ctx, drafter, datamodule) -> SequenceSums:
    """Σ τ_block and #blocks per held-out sequence, from the run's own validation step (`common.heldout_steps`)."""
    sums: dict[int, list[float]] = {}
    for batch, result in heldout_steps(ctx, drafter, datamodule, desc=f"held-out {ctx.run_dir.name}"):
        tau, counted = block_tau(result.c_star.float(), result.label_valid)
        counted = counted & batch["anchor_valid"].bool()
        for b in range(tau.shape[0]):
            entry = sums.setdefault(int(batch["sequence_index"][b]), [0.0, 0.0])
            entry[0] += float(tau[b][counted[b]].sum())
            entry[1] += float(counted[b].sum())
    index = sorted(sums)
    return SequenceSums(
        torch.tensor(index),
        torch.tensor([sums[i][0] for i in index], dtype=torch.float64),
        torch.tensor([sums[i][1] for i in index], dtype=torch.float64),
    )


def cell_sums(overrides: list[str]) -> tuple[SequenceSums, dict, Path, list[str], int]:
    """(per-sequence sums, logged val/ metrics, run dir, domain per sequence index, reference rows) of one cell,
    from the cache beside its drafter when that drafter has not changed since."""
    from dspark.data.regenerate import load_regenerated
    from dspark.drafters.checkpoint import load_weights_only, read_checkpoint

    ctx, prepared = locate_run(overrides)
    drafter_path = ctx.run_dir / "drafter.pt"
    stamp = torch.tensor([drafter_path.stat().st_size, drafter_path.stat().st_mtime_ns], dtype=torch.float64)
    cache = ctx.run_dir / CACHE_NAME
    sums, payload = None, None
    if cache.exists():
        # tensors only: a file holding anything else is refused (never unpickled) and named
        saved = load_weights_only(cache, fix=f"Delete {cache}: this benchmark recomputes it from the run's drafter.")
        if torch.equal(saved["stamp"], stamp):
            sums = SequenceSums(saved["index"], saved["tau_sum"], saved["blocks"])
    if sums is None:  # only now load the drafter, the target and the held-out data
        datamodule, drafter, payload = load_validation(ctx, prepared)
        sums = sequence_sums(ctx, drafter, datamodule)
        partial = cache.with_suffix(".tmp")
        torch.save({**sums.as_dict(), "stamp": stamp}, partial)
        partial.replace(cache)  # never a half-written cache
    if payload is None:  # a cache hit: the checkpoint's metrics only (the drafter was never loaded)
        payload = read_checkpoint(drafter_path)
    logged = {k: float(v) for k, v in (payload.get("metrics") or {}).items() if k.startswith("val/")}
    domains = list(load_regenerated(prepared.regen_dir)["domain"])
    return sums, logged, ctx.run_dir, domains, reference_count(prepared.regen_dir)


def aligned(cells: list[SequenceSums]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence indices common to every cell [S], Σ τ [C, S], #blocks [C, S]); a cell missing a sequence (no
    valid block at its γ) contributes zeros there, which the ratio estimator handles."""
    index = sorted(set().union(*(set(c.index.tolist()) for c in cells)))
    position = {s: i for i, s in enumerate(index)}
    tau = torch.zeros(len(cells), len(index), dtype=torch.float64)
    blocks = torch.zeros_like(tau)
    for row, cell in enumerate(cells):
        cols = torch.tensor([position[int(s)] for s in cell.index])
        tau[row, cols] = cell.tau_sum
        blocks[row, cols] = cell.blocks
    return torch.tensor(index), tau, blocks


def bootstrap_tau(
    tau: torch.Tensor, blocks: torch.Tensor, columns: torch.Tensor, *, resamples: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """τ_prob per cell on the scope's sequences `columns` [S'] (point [C]) and on `resamples` joint resamples of
    them ([R, C]: every cell sees the same resampled sequences)."""
    t, n = tau[:, columns], blocks[:, columns]
    point = t.sum(1) / n.sum(1)
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, columns.numel(), (resamples, columns.numel()), generator=generator)
    counts = torch.zeros(resamples, columns.numel(), dtype=torch.float64)
    counts.scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64))
    return point, (counts @ t.T) / (counts @ n.T)


def interval(samples: torch.Tensor) -> tuple[float, float]:
    low, high = torch.quantile(samples, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return low, high


def percent(value: float, low: float, high: float) -> str:
    return f"{value:+.1%} [{low:+.1%}, {high:+.1%}]"


def scope_columns(index: torch.Tensor, domains: list[str], n_reference: int) -> dict[str, torch.Tensor]:
    scopes = {"all held-out": torch.arange(index.numel())}
    regen = [i for i, s in enumerate(index.tolist()) if s >= n_reference]
    if regen and len(regen) < index.numel():
        scopes["target-written"] = torch.tensor(regen)
    for domain in dict.fromkeys(domains[s] for s in index.tolist()):
        cols = [i for i, s in enumerate(index.tolist()) if domains[s] == domain]
        if len(cols) >= 10:  # fewer sequences make a bootstrap interval meaningless
            scopes[f"domain {domain}"] = torch.tensor(cols)
    return scopes


def render(
    args: argparse.Namespace,
    key: str | None,
    values: list[str],
    runs: list[tuple[Path, Path]],
    logged: list[tuple[dict, dict]],
    index: torch.Tensor,
    tau: torch.Tensor,
    blocks: torch.Tensor,
    scopes: dict[str, torch.Tensor],
    *,
    seconds: float,
    load: float,
    argv: list[str],
) -> str:
    from dspark.reports.claims import read_interval

    label = (lambda v: f"{key}={v}") if key else (lambda v: "pair")
    lines = [
        "# Held-out τ_prob, paired: " + " ".join(args.a) + " vs " + " ".join(args.b) + (f" along {key}" if key else ""),
        "",
        f"Command: `{command_line('heldout_paired.py', argv)}` ({seconds:.0f} s)  ",
        f"Date {datetime.datetime.now():%Y-%m-%d %H:%M}, commit {git_commit()}; {os.cpu_count()} CPUs, "
        f"{args.threads} thread(s); load average at start {load:.1f}.  ",
        f"{index.numel()} held-out sequences, {int(blocks[0].sum())} blocks in the first cell; "
        f"{args.resamples} joint bootstrap resamples of sequences (seed {args.seed}), percentile 95% CIs.",
        "",
        "| cell | A run | B run | A τ_prob (logged) | B τ_prob (logged) |",
        "|---|---|---|---|---|",
    ]
    nan = float("nan")
    for i, (v, (a_dir, b_dir), (a_log, b_log)) in enumerate(zip(values, runs, logged)):
        a_tau = float(tau[2 * i].sum() / blocks[2 * i].sum())
        b_tau = float(tau[2 * i + 1].sum() / blocks[2 * i + 1].sum())
        lines.append(
            f"| {label(v)} | `{a_dir.name}` | `{b_dir.name}` | "
            f"{a_tau:.3f} ({a_log.get('val/tau_prob', nan):.3f}) | "
            f"{b_tau:.3f} ({b_log.get('val/tau_prob', nan):.3f}) |"
        )
    lines += [
        "",
        "Recomputed τ_prob equals the run's logged `val/tau_prob` when the held-out blocks are the run's "
        "own. "
        "The intervals resample held-out sequences (every cell the same draw); they do not contain the spread "
        "between training seeds, which one drafter per cell cannot show.",
        "",
    ]
    for scope, columns in scopes.items():
        point, draws = bootstrap_tau(tau, blocks, columns, resamples=args.resamples, seed=args.seed)
        gains = point[0::2] / point[1::2] - 1
        gain_draws = draws[:, 0::2] / draws[:, 1::2] - 1
        lines += [
            f"## {scope} ({columns.numel()} sequences)",
            "",
            "| cell | A τ_prob | B τ_prob | gain A/B − 1 [95% CI] | verdict |"
            + (f" change of the gain from {label(values[0])} [95% CI] | verdict |" if len(values) > 1 else ""),
            "|---|---|---|---|---|" + ("---|---|" if len(values) > 1 else ""),
        ]
        for i, v in enumerate(values):
            low, high = interval(gain_draws[:, i])
            row = (
                f"| {label(v)} | {point[2 * i]:.3f} | {point[2 * i + 1]:.3f} | {percent(float(gains[i]), low, high)}"
                f" | {read_interval(low, high)} |"
            )
            if len(values) > 1:
                if i == 0:
                    row += " – | – |"
                else:
                    change = gain_draws[:, i] - gain_draws[:, 0]
                    c_low, c_high = interval(change)
                    row += (
                        f" {percent(float(gains[i] - gains[0]), c_low, c_high)} | "
                        f"{read_interval(c_low, c_high, up='grows', down='shrinks')} |"
                    )
            lines.append(row)
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started, load = time.time(), os.getloadavg()[0]
    key, values = axis_values(args.axis)
    sums, runs, logged = [], [], []
    domains, n_reference = None, None
    for v in values:
        axis = [f"{key}={v}"] if key else []
        pair = []
        for side in (args.a, args.b):
            cell, log, run_dir, cell_domains, cell_reference = cell_sums([*args.overrides, *axis, *side])
            if domains is not None and (cell_domains != domains or cell_reference != n_reference):
                raise SystemExit(
                    f"error: {run_dir.name} was trained on other data than the first cell; paired "
                    "comparisons need one data cache (keep data.* and seed-independent keys shared)"
                )
            domains, n_reference = cell_domains, cell_reference
            sums.append(cell)
            pair.append((run_dir, log))
        runs.append((pair[0][0], pair[1][0]))
        logged.append((pair[0][1], pair[1][1]))
    index, tau, blocks = aligned(sums)
    scopes = scope_columns(index, domains, n_reference)
    text = render(
        args, key, values, runs, logged, index, tau, blocks, scopes, seconds=time.time() - started, load=load, argv=argv
    )
    name = f"heldout-paired-{runs[0][0].name.rsplit('-', 2)[0]}-vs-{runs[0][1].name.rsplit('-', 2)[0]}"
    write_result(text, args.output or RESULTS / f"{name}{'-' + key.split('.')[-1] if key else ''}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
