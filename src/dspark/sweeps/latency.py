"""The `latency` sweep's cell runner (paper Fig. 4 right): time one (head, γ) drafter per cell, no training.

Timing does not depend on the weights, so each cell builds an untrained DSpark drafter of its head and block size
around the target and lets `dspark.evaluation.diagnostics.latency_breakdown` run the speculative engine with
ℓ = γ on random contexts of each length in the sweep's `latency.context_lengths`. Logged per context length L:
`latency/ctx{L}/{verify_ms,draft_parallel_ms,draft_sequential_ms,other_ms,round_ms,sequential_share}`, and the means
over context lengths as `summary/round_ms`, `summary/sequential_share` — for one request (the single-request engine);
for each R > 1 in the sweep's `latency.concurrency`, the same per BatchedEngine step as `latency/r{R}/ctx{L}/…` and
`summary/r{R}/…` (R requests decoded together: the paper measures its +0.2–1.3% at a batch).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from dspark.config import ConfigError, ResolvedConfig
from dspark.config.secrets import mask_text

log = logging.getLogger("dspark")
PHASES = ("verify_ms", "draft_parallel_ms", "draft_sequential_ms", "other_ms", "round_ms", "sequential_share")
DEFAULT_OPTIONS = {"context_lengths": [512, 1024], "rounds": 8, "concurrency": [1]}


def latency_prefix(concurrency: int) -> str:
    """'' for one request (the metric names before R existed), 'r4/' for R = 4."""
    return "" if int(concurrency) == 1 else f"r{int(concurrency)}/"


def latency_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Rows of `latency_breakdown` (one head and γ, any R) → flat MLflow metrics."""
    out: dict[str, float] = {}
    by_r: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        r = int(row.get("concurrency", 1))
        by_r.setdefault(r, []).append(row)
        prefix = f"latency/{latency_prefix(r)}ctx{row['context_length']}"
        out.update({f"{prefix}/{p}": float(row[p]) for p in PHASES})
        out[f"{prefix}/rounds"] = float(row["rounds"])
    for r, group in by_r.items():
        for name in ("round_ms", "sequential_share"):
            values = [float(x[name]) for x in group]
            out[f"summary/{latency_prefix(r)}{name}"] = sum(values) / len(values) if values else float("nan")
    return out


def run_latency_cell(
    rc: ResolvedConfig, *, parent_run_id: str, extra_tags: dict[str, str], options: dict[str, Any]
) -> int:
    """Create the cell's child run, time the drafter, log the metrics; returns an exit code (0 ok, 1 failed)."""
    from dspark.evaluation.diagnostics import latency_breakdown
    from dspark.stages.context import RunPaths, StageContext, seed_everything
    from dspark.tracking import open_store

    cfg, opts = rc.cfg, DEFAULT_OPTIONS | dict(options)
    ctx = StageContext(rc=rc, paths=RunPaths.from_config(cfg))
    ctx.paths.make()
    seed_everything(cfg.seed)
    try:
        ctx.store = open_store(cfg)
    except ConfigError as err:
        print(f"error: {mask_text(str(err))}", file=sys.stderr)
        return 2
    name = f"latency-{cfg.model.head}-d{cfg.model.depth}-g{cfg.model.block_size}-s{cfg.seed}"
    ctx.run_id = ctx.store.create_run(run_name=name, tags=ctx.run_tags() | extra_tags, parent_run_id=parent_run_id)
    ctx.store.log_config(ctx.run_id, cfg, run_dir=ctx.paths.root / "latency" / name)
    started = time.time()
    try:
        rows = latency_breakdown(
            target=ctx.load_target(),
            heads=[cfg.model.head],
            block_sizes=[cfg.model.block_size],
            context_lengths=[int(c) for c in opts["context_lengths"]],
            rounds=int(opts["rounds"]),
            concurrency=[int(r) for r in opts.get("concurrency", [1])],
            depth=cfg.model.depth,
            markov_rank=cfg.model.markov_rank,
            seed=cfg.seed,
            show_progress=False,
        )
        ctx.store.log_metrics(ctx.run_id, latency_metrics(rows) | {"summary/wall_seconds": time.time() - started})
    except Exception as err:  # the cell is FAILED; the sweep goes on
        log.exception("latency cell failed")
        ctx.store.finish(ctx.run_id, status="FAILED")
        print(f"error: {type(err).__name__}: {mask_text(str(err))}", file=sys.stderr)
        return 1
    ctx.store.finish(ctx.run_id)
    return 0
