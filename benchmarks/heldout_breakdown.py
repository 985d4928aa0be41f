"""Where a drafter's held-out acceptance comes from: teacher-forced acceptance split by source, domain and position.

The held-out metrics of a run (`val/accept/posK`, `val/tau_prob`) average over every held-out block, whatever wrote
its text and wherever in the response it starts. Rollouts see one kind of text only: responses the target writes at
T = 1, from their first token, to prompts of the evaluation sets. This script re-runs the run's own validation
blocks (same split, same fixed anchors, same loss code) and splits them by

- source: `reference` (a dataset's own response) or `regenerated` (written by the target: the text rollouts see),
  read from the data cache's parts (`data.responses=mix` stores the reference part first);
- domain: the training set's domain (math / code / chat / instruction);
- position: the anchor's offset from the response's first token, in buckets (a 64-token rollout sees 0–63 only).

Per group: blocks, p_t's mass inside the draft vocabulary, c*₁…c*_γ (1 − ½‖p_d − p_t‖₁ per slot) and τ_prob =
1 + Σ_k Π_{j≤k} c*_j (the expected tokens per round of a fixed ℓ = γ round, slots treated as independent — the
quantity the run logs as `val/tau_prob`, here over the group's blocks).

    .venv/bin/python benchmarks/heldout_breakdown.py budget=cpu-ref seed=0        # the run of that config
    .venv/bin/python benchmarks/heldout_breakdown.py budget=cpu-ref model.depth=3 --threads 2

The arguments are `experiments/run.py`'s overrides: they name the run (its training key) and its data; the data
caches and the drafter must exist (run the experiment first); nothing is trained or written besides the report.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from common import RESULTS, command_line, git_commit, heldout_steps, load_run, reference_count, repo_path, write_result

POSITION_BUCKETS = ((0, 16), (16, 64), (64, 128), (128, 256), (256, 10**9))


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--output", type=Path, default=None, help="markdown file (default outputs/benchmarks/heldout-<run name>.md)"
    )
    return parser.parse_known_args(argv)


def bucket_label(offset: int) -> str:
    for low, high in POSITION_BUCKETS:
        if low <= offset < high:
            return f"{low}–{high - 1}" if high < 10**9 else f"≥ {low}"
    raise ValueError(f"negative response offset {offset}")


GROUPINGS = {
    "By source": (0,),
    "By source and domain": (0, 1),
    "By source and position": (0, 2),
    "Regenerated text by domain and position": (0, 1, 2),
}


class Groups:
    """One `TeacherForcedAcceptance` (the metric the run logs, so the same masking) per grouping and group, plus
    the mean coverage of slot 1."""

    def __init__(self, block_size: int) -> None:
        self.g = block_size
        self.metrics: dict[tuple[tuple[int, ...], tuple[str, ...]], object] = {}
        self.coverage: dict[tuple[tuple[int, ...], tuple[str, ...]], list[float]] = defaultdict(lambda: [0.0, 0.0])

    def add(
        self, keys: list[tuple[str, str, str]], c_star: torch.Tensor, valid: torch.Tensor, coverage: torch.Tensor
    ) -> None:
        """keys: one (source, domain, position) per block; c_star, valid [M, γ]; coverage [M] (slot 1)."""
        from dspark.metrics.acceptance import TeacherForcedAcceptance

        for by in (*GROUPINGS.values(), ()):
            labels = [tuple(key[i] for i in by) for key in keys]
            for label in dict.fromkeys(labels):
                rows = torch.tensor([lab == label for lab in labels])
                name = (by, label)
                if name not in self.metrics:
                    self.metrics[name] = TeacherForcedAcceptance(self.g)
                self.metrics[name].update(c_star[rows], valid[rows])
                self.coverage[name][0] += float(coverage[rows].sum())
                self.coverage[name][1] += int(rows.sum())

    def table(self, by: tuple[int, ...]) -> list[tuple[str, int, float, list[float], float]]:
        """Rows (label, blocks, coverage, c*_1..γ, τ_prob) of one grouping, positions in order."""
        names = sorted((n for n in self.metrics if n[0] == by), key=lambda n: [POSITION_ORDER.get(x, x) for x in n[1]])
        out = []
        for name in names:
            values = self.metrics[name].compute()
            total, count = self.coverage[name]
            out.append(
                (
                    " / ".join(name[1]) or "all",
                    int(count),
                    total / count,
                    [float(values[f"accept/pos{k}"]) for k in range(1, self.g + 1)],
                    float(values["tau_prob"]),
                )
            )
        return out


POSITION_ORDER = {bucket_label(low): f"{i:02d}" for i, (low, _) in enumerate(POSITION_BUCKETS)}


def collect(ctx, drafter, datamodule, n_reference: int, domains: list[str]) -> Groups:
    """The run's own validation step over its held-out batches (`common.heldout_steps`), grouped per block."""
    groups = Groups(ctx.cfg.model.block_size)
    for batch, result in heldout_steps(ctx, drafter, datamodule):
        starts = batch["loss_mask"].long().argmax(1)  # first response token of each sequence
        coverage = result.coverage if result.coverage is not None else torch.ones_like(result.c_star)
        keys, rows = [], []
        for b in range(batch["input_ids"].shape[0]):
            index = int(batch["sequence_index"][b])
            source = "reference" if index < n_reference else "regenerated"
            for n in range(batch["anchors"].shape[1]):
                if not batch["anchor_valid"][b, n]:
                    continue
                offset = int(batch["anchors"][b, n]) - int(starts[b]) + 1
                keys.append((source, domains[index], bucket_label(max(offset, 0))))
                rows.append((b, n))
        b_index, n_index = (torch.tensor(x) for x in zip(*rows))
        groups.add(
            keys,
            result.c_star[b_index, n_index].float(),
            result.label_valid[b_index, n_index],
            coverage[b_index, n_index, 0].float(),
        )
    return groups


def cell(value: float) -> str:
    """A slot no block of the group reaches (responses end there): '–', not nan."""
    return "–" if value != value else f"{value:.3f}"


def render(
    groups: Groups,
    *,
    argv: list[str],
    run_dir: Path,
    seconds: float,
    threads: int,
    load: float,
    logged: dict[str, float],
) -> str:
    g = groups.g
    header = ["group", "blocks", "coverage", *[f"c*{k}" for k in range(1, g + 1)], "τ_prob"]
    sep = "|" + "---|" * len(header)

    def rows(by: tuple[int, ...]) -> list[str]:
        return [
            f"| {label} | {n} | {cov:.3f} | " + " | ".join(cell(c) for c in cs) + f" | {tau:.3f} |"
            for label, n, cov, cs, tau in groups.table(by)
        ]

    overall = groups.table(())[0]
    lines = [
        f"# Held-out teacher-forced acceptance by source, domain and position — {run_dir.name}",
        "",
        f"Command: `{command_line('heldout_breakdown.py', argv)}` ({seconds:.0f} s)  ",
        f"Date {datetime.datetime.now():%Y-%m-%d %H:%M}, commit {git_commit()}; {os.cpu_count()} CPUs, "
        f"{threads} thread(s); load average at start {load:.1f}.  ",
        f"Drafter: `{repo_path(run_dir)}/drafter.pt`; the run's logged `val/accept/pos1` "
        f"{logged.get('val/accept/pos1', float('nan')):.3f} and `val/tau_prob` "
        f"{logged.get('val/tau_prob', float('nan')):.3f}; recomputed here over the same blocks: "
        f"{overall[3][0]:.3f} and {overall[4]:.3f}.",
        "",
        "c*k: mean teacher-forced acceptance of slot k (1 − ½‖p_d − p_t‖₁); coverage: p_t's mass inside the draft "
        "vocabulary at slot 1; τ_prob: 1 + Σ_k mean Π_{j≤k} c*_j. Position: the anchor's offset from the "
        "response's first token (a 64-token rollout sees 0–63).",
        "",
    ]
    for title, by in GROUPINGS.items():
        body = rows(by)
        if by == (0, 1, 2):
            body = [r for r in body if r.startswith("| regenerated")]
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", sep, *body, ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from dspark.data.regenerate import load_regenerated
    from dspark.drafters.checkpoint import read_checkpoint

    args, overrides = parse_args(argv)
    torch.set_num_threads(args.threads)
    started, load = time.time(), os.getloadavg()[0]
    ctx, prepared, datamodule, drafter, payload = load_run(overrides)
    drafter_path = ctx.run_dir / "drafter.pt"
    domains = load_regenerated(prepared.regen_dir)["domain"]
    groups = collect(ctx, drafter, datamodule, reference_count(prepared.regen_dir), list(domains))
    logged = {
        k: float(v)
        for k, v in (payload.get("metrics") or read_checkpoint(drafter_path).get("metrics") or {}).items()
        if k.startswith("val/")
    }
    text = render(
        groups,
        argv=argv,
        run_dir=ctx.run_dir,
        seconds=time.time() - started,
        threads=args.threads,
        load=load,
        logged=logged,
    )
    write_result(text, args.output or RESULTS / f"heldout-{ctx.run_dir.name}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
