"""Sweep driver overhead per cell and `stage=report` over a large tracking store (issue 5, "Performance").

1. Driver overhead: `sweep=depth budget=smoke stage=train` (6 cells) on the tiny target, run twice in one temporary
   root — a cold run (data regeneration and training inside the cells) and a resumed run (every cell skipped).
   Overhead per cell = (wall time of run_sweep − time inside the cell runner) / cells, and the largest per-cell
   overhead (time around one cell's runner: tags, resume lookup, settling the child run, metric back-fill); the
   resumed run is all overhead (planning, parent lookup, records, report).
2. Reports: a sqlite store with one `depth` parent and N child runs (default 1,000; 6 configurations × N/6 seeds,
   ~30 metrics and ~15 tags each, written with MlflowClient.log_batch), then
   `python experiments/run.py sweep=depth stage=report` timed as a fresh process (imports included) and in-process.

Prints a markdown table and writes outputs/benchmarks/sweeps.md with the command that produced it.

    .venv/bin/python benchmarks/bench_sweeps.py                  # ~2-4 minutes on 2 cores
    .venv/bin/python benchmarks/bench_sweeps.py --runs 200       # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, RESULTS, command_line, write_result

DOMAINS = ("math", "code", "chat")
DEPTH_CELLS = [("dspark", d) for d in (1, 2, 3, 4, 5)] + [("dflash", 5)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000, help="child runs in the report benchmark's store")
    parser.add_argument("--skip-driver", action="store_true", help="only the report benchmark")
    return parser.parse_args(argv)


def driver_overhead(root: Path) -> list[dict]:
    """Cold and resumed depth sweeps; per-cell overhead from the driver's own outcome records."""
    from dspark.config import resolve_config
    from dspark.sweeps.driver import plan_grid, run_sweep
    from dspark.sweeps.identity import sweep_dir
    from dspark.sweeps.spec import load_sweep

    argv = ["sweep=depth", "budget=smoke", "stage=train", f"paths.root={root}", "tracking.experiment=bench"]
    rows = []
    for label in ("cold (trains 6 cells)", "resumed (6 cells skipped)"):
        rc = resolve_config(argv)
        started = time.perf_counter()
        code = run_sweep(rc)
        wall = time.perf_counter() - started
        plan = plan_grid(rc, load_sweep("depth"))
        outcomes = json.loads((sweep_dir(rc, plan.spec, plan.sweep_hash) / "outcomes.json").read_text())["cells"]
        work = sum(o["work_seconds"] for o in outcomes)
        around = max((o["seconds"] - o["work_seconds"] for o in outcomes if o["status"] != "SKIPPED"), default=0.0)
        rows.append(
            {
                "label": label,
                "exit": code,
                "cells": len(outcomes),
                "wall": wall,
                "work": work,
                "per_cell": (wall - work) / len(outcomes),
                "max_around": around,
            }
        )
    return rows


def build_store(root: Path, *, runs: int) -> float:
    """A depth parent with `runs` finished, complete children; returns the seconds it took."""
    from mlflow.entities import Metric, Param, RunTag

    from dspark.config import resolve_config
    from dspark.sweeps.driver import plan_grid
    from dspark.sweeps.spec import load_sweep
    from dspark.tracking import open_store

    started = time.perf_counter()
    rc = resolve_config(["sweep=depth", "budget=smoke", f"paths.root={root}"])
    store = open_store(rc.cfg)
    digest = plan_grid(rc, load_sweep("depth")).sweep_hash
    parent = store.create_run(
        run_name="sweep-depth",
        tags={"sweep.name": "depth", "sweep.role": "parent", "sweep.hash": digest, "budget": "smoke"},
    )
    now = int(time.time() * 1000)
    for i in range(runs):
        drafter, depth = DEPTH_CELLS[i % len(DEPTH_CELLS)]
        seed = i // len(DEPTH_CELLS)
        key = f"drafter={drafter} model.depth={depth} seed={seed}"
        tags = {
            "mlflow.parentRunId": parent,
            "sweep.name": "depth",
            "sweep.role": "cell",
            "sweep.hash": digest,
            "cell": key,
            "cell.index": str(i),
            "seed": str(seed),
            "drafter": drafter,
            "model.head": "markov",
            "sweep.complete": "true",
            "axis.drafter": drafter,
            "axis.model.depth": str(depth),
            "axis.seed": str(seed),
            "paper.ref": "Fig. 3",
            "target": "tiny",
        }
        run = store.client.create_run(store.experiment_id, run_name=key, tags=tags).info.run_id
        tau = 2.0 + 0.2 * depth + (0.3 if drafter == "dspark" else 0.0) + 0.01 * (seed % 7)
        values = {"summary/tau": tau, "eval/all/tau": tau, "summary/speedup": 1 + tau / 10, "val/tau_prob": tau - 0.5}
        values |= {f"eval/domain/{d}/tau": tau + j * 0.1 for j, d in enumerate(DOMAINS)}
        values |= {f"eval/domain/{d}/cond/pos{k}": 0.9 - 0.02 * k for d in DOMAINS for k in range(1, 8)}
        store.client.log_batch(
            run,
            metrics=[Metric(k, v, now, 0) for k, v in values.items()],
            params=[Param("model.depth", str(depth))],
            tags=[RunTag("stage", "all")],
        )
        store.client.set_terminated(run, "FINISHED")
    store.finish(parent)
    return time.perf_counter() - started


def report_times(root: Path) -> dict[str, float]:
    """Seconds of `sweep=depth stage=report` over the store: fresh process via the CLI, fresh process calling
    run_sweep directly (no CLI preflight, which imports transformers for its target-name check), in-process."""
    argv = ["sweep=depth", "stage=report", "budget=smoke", f"paths.root={root}"]
    out = {}
    started = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "experiments" / "run.py"), *argv], check=True, capture_output=True)
    out["process"] = time.perf_counter() - started
    direct = (
        "import sys; from dspark.config import resolve_config; from dspark.sweeps.driver import run_sweep; "
        "sys.exit(run_sweep(resolve_config(sys.argv[1:])))"
    )
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", direct, *argv], check=True, capture_output=True)
    out["direct"] = time.perf_counter() - started
    from dspark.cli import main

    started = time.perf_counter()
    assert main(argv) == 0
    out["inprocess"] = time.perf_counter() - started
    return out


def verdicts(driver: list[dict], report: dict) -> list[str]:
    """One line per target: the measured number and whether it meets the issue's limit."""
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    lines = []
    if driver:
        worst = max(max(r["per_cell"], r["max_around"]) for r in driver)
        lines.append(f"- Driver overhead per cell: at most {worst:.2f} s (≤ 5 s): {met(worst <= 5)}.")
    for key, label in (
        ("process", "via the CLI"),
        ("direct", "without the CLI preflight"),
        ("inprocess", "in-process"),
    ):
        lines.append(
            f"- `stage=report` over {report['runs']} runs {label}: {report[key]:.2f} s (≤ 10 s): "
            f"{met(report[key] <= 10)}."
        )
    return lines


def write_results(driver: list[dict], report: dict, *, argv: list[str]) -> str:
    """Markdown table of both measurements, written to outputs/benchmarks/sweeps.md."""
    load = os.getloadavg()[0]
    lines = [
        "# Sweep driver and report benchmark",
        "",
        f"Command: `{command_line('bench_sweeps.py', argv, prefix='.venv/bin/python')}`",
        "",
        f"Machine: {os.cpu_count()} CPUs; 1-minute load average at the end {load:.1f} (shared machine: ±50%).",
        "Targets (issue 5): driver overhead ≤ 5 s per cell beyond the cell's own work; `stage=report` over "
        "1,000 runs ≤ 10 s.",
        "",
    ]
    if driver:
        lines += [
            "## Driver overhead (`sweep=depth budget=smoke stage=train`, 6 cells, tiny target)",
            "",
            "| run | exit | cells | wall s | inside cells s | overhead / cell s | max around one cell s |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['label']} | {r['exit']} | {r['cells']} | {r['wall']:.2f} | {r['work']:.2f} | "
            f"{r['per_cell']:.2f} | {r['max_around']:.2f} |"
            for r in driver
        ]
        lines += [
            "",
            "Overhead / cell = (wall − time inside the cell runner) / cells: planning (resolving every "
            "cell), the parent run and its records, the resume lookup, settling each child, and the report, "
            "spread over the cells.",
            "",
        ]
    lines += [
        f"## `stage=report` over {report['runs']} runs",
        "",
        "| step | seconds |",
        "|---|---|",
        f"| build the store (create_run + log_batch + set_terminated per run) | {report['build']:.1f} |",
        f"| `python experiments/run.py sweep=depth stage=report` (fresh process, imports included) | "
        f"{report['process']:.2f} |",
        f"| fresh process calling `run_sweep` directly (no CLI preflight) | {report['direct']:.2f} |",
        f"| in-process (`dspark.cli.main`, modules already imported) | {report['inprocess']:.2f} |",
        "",
        "The fresh-process rows include Python start-up and imports; the CLI's preflight (target-name check) "
        "imports `dspark.targets`, hence torch and transformers, which the report itself never needs.",
        "",
    ]
    lines += ["## Against the targets", ""] + verdicts(driver, report) + [""]
    text = "\n".join(lines)
    write_result(text, RESULTS / "sweeps.md")
    return text


def main(argv: list[str]) -> int:
    """Run both benchmarks in a temporary directory and write the results."""
    args = parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    import torch

    torch.set_num_threads(1)
    driver = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_driver:
            driver = driver_overhead(Path(tmp) / "driver")
        store_root = Path(tmp) / "store"
        build = build_store(store_root, runs=args.runs)
        times = report_times(store_root)
    write_results(driver, {"runs": args.runs, "build": build, **times}, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
