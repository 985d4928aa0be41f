"""Stage `serve`: a trained drafter serving R concurrent requests on the real target (METHOD §6–§7, paper §7).

prepare → train (reused by training key) → `run_serve`:

1. load the target and the drafter; STS-calibrate it (stored in drafter.pt, shared with `stage=all`) when it has a
   confidence head;
2. the SPS(B) table of the batched verify forward (`dspark.serving.profile`, cached per target and machine);
3. `serve.num_requests` prompts, round-robin over `serve.prompt_sets` (the math / code / chat mix), served by the
   `BatchedEngine` with `serve.policy` at `serve.concurrency` (closed loop: a finished request is replaced at once;
   the scheduler plans with `serve.scheduler_cost`);
4. the simulator: a policy=fixed trace of the same requests (recorded once per drafter and setting, cached in the
   run directory) replayed with this policy at this concurrency (validation against step 3) and at every
   `serve.simulate_concurrency` level, against `serve.sps_table` or else this machine's SPS table profiled with
   that many rows (`simulation_sps`).

MLflow: `serve/{throughput,user_speed,budget,tau,num_requests,rejected,steps,wall_seconds}` (real engine),
`sim/R{R}/{throughput,user_speed,budget,tau}` (simulated) and `sim/validation/<metric>_rel_err`; the step records
are attached as JSONL. `reports/serving.md` (`sweep=serving`) is built from these metrics alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark.files import atomic_output, atomic_write_text
from dspark.stages.context import StageContext
from dspark.stages.drafter import TrainedDrafter, calibrate, confidence_source, open_trained_drafter
from dspark.stages.prepare import PreparedData

if TYPE_CHECKING:
    from dspark.targets import Target

log = logging.getLogger("dspark")
SERVE_DIR = "serve"
SUMMARY_FIELDS = ("throughput", "user_speed", "budget", "tau")


def serve_requests(ctx: StageContext, target: Target) -> list:
    """serve.num_requests chat-templated prompts, round-robin over serve.prompt_sets (request ids 0..n-1)."""
    from dspark.serving import ServeRequest

    serve = ctx.cfg.serve
    per_set = math.ceil(serve.num_requests / len(serve.prompt_sets))
    pools = {name: ctx.load_prompts(name, limit=per_set) for name in serve.prompt_sets}
    requests = []
    for index in range(serve.num_requests):
        name = serve.prompt_sets[index % len(serve.prompt_sets)]
        pool = pools[name]
        if not pool:
            raise ValueError(
                f"serve.prompt_sets: prompt set '{name}' is empty; drop it or point data.local_dir at "
                "a directory that has it"
            )
        record = pool[(index // len(serve.prompt_sets)) % len(pool)]
        requests.append(
            ServeRequest(
                request_id=index,
                prompt_ids=target.chat_prompt_ids(record.prompt),
                domain=record.domain,
                max_new_tokens=serve.max_new_tokens,
            )
        )
    return requests


def serve_calibration(ctx: StageContext, trained: TrainedDrafter, *, prepared: PreparedData | None) -> Any:
    """The drafter's STS at decode.temperature whenever it has a confidence head (None otherwise).

    Whatever this cell's policy: the policy=fixed trace the simulator replays is recorded once and shared by every
    cell, and the confidence policies replay its calibrated confidences, so it must carry them even when the cell
    that records it (say mtp1) reads none. The fit is cached in drafter.pt, so it runs once per drafter."""
    if not trained.has_confidences(ctx.cfg.serve.confidence):
        return None
    report, _ = calibrate(ctx, trained, prepared=prepared, key="serve")
    return report.sts


def serving_target(ctx: StageContext, target: Target) -> Target:
    """The target the engine serves with: `target` itself, or the same checkpoint loaded in serve.target_dtype.

    The drafter was trained (and is calibrated) against target_options.dtype; a bf16 load of the same files serves it
    (drafters record the checkpoint's fp32 fingerprint), and on CPUs with AMX-BF16 its verify forward is nearly flat
    from 1 to 5 tokens where fp32's is a staircase (benchmarks/results/decoding*.md)."""
    dtype = ctx.cfg.serve.target_dtype or ctx.cfg.target_options.dtype
    if dtype == ctx.cfg.target_options.dtype:
        return target
    log.info(
        "serving with the target in %s (serve.target_dtype; trained and calibrated in %s)",
        dtype,
        ctx.cfg.target_options.dtype,
    )
    return ctx.load_target_in(dtype)


def serving_sps(ctx: StageContext, target: Target, *, block_size: int, rows: int | None = None) -> Any:
    """SPS(B) of the batched verify forward of R = `rows` (default serve.concurrency) rows, up to R·(γ+1) tokens
    (what the scheduler plans with, and what the simulator times that concurrency with), timing the forward
    serve.sps_forward names; cached per target, machine, R and forward, and attached to the run."""
    from dspark.serving.profile import load_or_profile_sps_of

    rows = ctx.cfg.serve.concurrency if rows is None else int(rows)
    table, path = load_or_profile_sps_of(
        ctx.cfg.serve.sps_forward,
        target,
        cache_dir=ctx.paths.cache,
        num_rows=rows,
        max_batch_tokens=rows * (block_size + 1),
    )
    log.info("serving SPS(B) table: %s", path)
    if ctx.store is not None:
        ctx.store.client.log_artifact(ctx.run_id, str(path), artifact_path="serve")
    return table


def metrics_of(summary: Any, prefix: str) -> dict[str, float]:
    return {f"{prefix}/{name}": float(getattr(summary, name)) for name in SUMMARY_FIELDS}


def write_steps(path: Path, result: Any) -> Path:
    """The run's step records (one JSON object per line) and request results, written atomically."""
    from dataclasses import asdict

    with atomic_output(path, mode="w") as handle:
        for step in result.steps:
            handle.write(json.dumps(step.to_dict()) + "\n")
    atomic_write_text(path.with_name("requests.jsonl"), "".join(json.dumps(asdict(r)) + "\n" for r in result.requests))
    return path


def read_steps(path: Path) -> list:
    from dspark.serving.records import ServeStep

    return [ServeStep.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def run_serve(ctx: StageContext, drafter_path: str | Path, *, prepared: PreparedData | None = None) -> dict[str, float]:
    """Serve with the real engine, then simulate; logs and returns the metrics (module docstring). `prepared`
    (the data this invocation regenerated) supplies the held-out calibration prompts."""
    from dspark.decoding.policies import build_policy
    from dspark.serving import BatchedEngine

    cfg, serve = ctx.cfg, ctx.cfg.serve
    trained = open_trained_drafter(ctx, drafter_path)
    drafter, spec = trained.drafter, trained.spec
    calibration = serve_calibration(ctx, trained, prepared=prepared)  # against the training target (drafter.pt)
    target = serving_target(ctx, trained.target)
    sps = serving_sps(ctx, target, block_size=spec.block_size)
    requests = serve_requests(ctx, target)
    policy = build_policy(  # build_serve_policy's call, with the stop rule (serve.scheduler_stop)
        serve.policy,
        key="serve",
        static_k=serve.static_k,
        threshold=serve.threshold,
        sps=sps,
        scheduler_cost=serve.scheduler_cost,
        scheduler_stop=serve.scheduler_stop,
    )
    engine = BatchedEngine(
        target=target,
        drafter=drafter,
        policy=policy,
        temperature=cfg.decode.temperature,
        max_new_tokens=serve.max_new_tokens,
        calibration=calibration,
        precision=cfg.decode.drafter_precision,
        step_overhead=serve.step_overhead,
        confidence=confidence_source(ctx, trained, key="serve"),
        verifier=serve.verifier,
    )
    log.info(
        "serving %d requests (%s) with serve.policy=%s at concurrency %d",
        len(requests),
        ", ".join(serve.prompt_sets),
        serve.policy,
        serve.concurrency,
    )
    result = engine.serve(requests, concurrency=serve.concurrency, seed=cfg.seed)
    summary = result.summary(serve.policy)
    out_dir = ctx.run_dir / SERVE_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-{serve.policy}-R{serve.concurrency}"
    steps_path = write_steps(out_dir / "steps.jsonl", result)
    rejected = sum(1 for r in result.requests if r.stop_reason == "rejected")
    metrics = metrics_of(summary, "serve") | {
        "serve/num_requests": float(summary.num_requests),
        "serve/rejected": float(rejected),
        "serve/steps": float(summary.num_steps),
        "serve/wall_seconds": float(summary.wall_seconds),
    }
    if not policy.lossless:  # serve.scheduler_stop=global_argmax: allowed for study, never silently
        log.warning("LOSSY: serve.scheduler_stop=global_argmax, the output is not the target's (paper Appendix A)")
        metrics["serve/lossy"] = 1.0
    metrics |= simulate_levels(
        ctx,
        engine_args={
            "target": target,
            "drafter": drafter,
            "calibration": calibration,
            "precision": cfg.decode.drafter_precision,
            "confidence": confidence_source(ctx, trained, key="serve"),  # a fresh source for the trace
        },
        requests=requests,
        real=result,
        real_summary=summary,
        sps=sps,
    )
    if ctx.store is not None:
        ctx.store.log_metrics(ctx.run_id, metrics)
        ctx.store.client.log_artifact(ctx.run_id, str(steps_path), artifact_path="serve")
    log.info(
        "serve: %.2f tok/s aggregate, %.2f tok/s/user, budget %.2f, τ %.3f (%s, R=%d)",
        summary.throughput,
        summary.user_speed,
        summary.budget,
        summary.tau,
        serve.policy,
        serve.concurrency,
    )
    return metrics


def trace_key(ctx: StageContext) -> str:
    """What a policy=fixed trace depends on besides the drafter (whose run directory holds it)."""
    cfg = ctx.cfg
    payload = {
        "requests": cfg.serve.num_requests,
        "max_new_tokens": cfg.serve.max_new_tokens,
        "sets": cfg.serve.prompt_sets,
        "concurrency": cfg.serve.trace_concurrency,
        "temperature": cfg.decode.temperature,
        "seed": cfg.seed,
        "calibrated": True,
        "precision": cfg.decode.drafter_precision,  # older traces lacked c̃
        "target_dtype": cfg.serve.target_dtype or cfg.target_options.dtype,
    }
    if cfg.serve.confidence != "head":  # the head's traces keep their key
        payload["confidence"] = [cfg.serve.confidence, cfg.decode.online_lr, cfg.decode.online_l2]
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def fixed_trace_steps(ctx: StageContext, *, engine_args: dict, requests: list, real: Any) -> list:
    """Step records of a policy=fixed run (the simulator's trace): this run's own when it is one, else cached."""
    from dspark.serving import BatchedEngine, build_serve_policy

    serve = ctx.cfg.serve
    if serve.policy == "fixed" and serve.concurrency == serve.trace_concurrency:
        return real.steps
    path = ctx.run_dir / SERVE_DIR / f"trace-{trace_key(ctx)}" / "steps.jsonl"
    if path.exists():
        return read_steps(path)
    log.info("recording the simulator's trace: policy=fixed at concurrency %d → %s", serve.trace_concurrency, path)
    engine = BatchedEngine(
        policy=build_serve_policy("fixed"),
        temperature=ctx.cfg.decode.temperature,
        max_new_tokens=serve.max_new_tokens,
        **engine_args,
    )
    result = engine.serve(requests, concurrency=serve.trace_concurrency, seed=ctx.cfg.seed)
    write_steps(path, result)
    return result.steps


def simulation_sps(ctx: StageContext, target: Target, *, level: int, block_size: int) -> tuple[Any, str]:
    """The SPS table the simulator times R = `level` with: serve.sps_table when given, else this machine's batched
    verify forward profiled with `level` rows (`serving_sps`). A table profiled with fewer rows would have to be
    extrapolated beyond its largest batch, and a linear extrapolation of the memory-bound slope makes big batches
    look cheap."""
    from dspark.serving.profile import load_sps_table

    if ctx.cfg.serve.sps_table:
        return load_sps_table(ctx.cfg.serve.sps_table), ctx.cfg.serve.sps_table
    return serving_sps(ctx, target, block_size=block_size, rows=level), f"this machine's batched SPS(B) at R = {level}"


def simulate_levels(
    ctx: StageContext, *, engine_args: dict, requests: list, real: Any, real_summary: Any, sps: Any
) -> dict[str, float]:
    """Replay the policy=fixed trace with this cell's policy: at its own R (validation against the real engine,
    on this machine's SPS) and at every serve.simulate_concurrency level. Returns `sim/...` metrics."""
    from dspark.serving.simulator import fit_step_costs, simulate_serving, trace_from_steps, validate

    serve = ctx.cfg.serve
    trace_steps = fixed_trace_steps(ctx, engine_args=engine_args, requests=requests, real=real)
    trace = trace_from_steps(trace_steps)
    costs = fit_step_costs(list(real.steps) + ([] if trace_steps is real.steps else list(trace_steps)))
    options = {
        "policy": serve.policy,
        "costs": costs,
        "seed": ctx.cfg.seed,
        "static_k": serve.static_k,
        "threshold": serve.threshold,
        "pad_to_longest": True,
        "scheduler_cost": serve.scheduler_cost,
    }
    own = simulate_serving(
        trace, concurrency=serve.concurrency, sps=sps, num_requests=len(requests), **options
    ).summary()
    metrics = {f"sim/validation/{k}_rel_err": float(v) for k, v in validate(real_summary, own).items()}
    sources = []
    for level in serve.simulate_concurrency:
        table, source = simulation_sps(
            ctx, engine_args["target"], level=int(level), block_size=engine_args["drafter"].block_size
        )
        sources.append(source)
        summary = simulate_serving(
            trace, concurrency=int(level), sps=table, max_new_tokens=serve.max_new_tokens, **options
        ).summary()
        metrics |= metrics_of(summary, f"sim/R{int(level)}")
    log.info(
        "simulated %s at R = %s on %s; validation at R=%d: %s",
        serve.policy,
        serve.simulate_concurrency,
        "; ".join(sources) or "no level",
        serve.concurrency,
        ", ".join(f"{k.split('/')[-1]} {v:+.1%}" for k, v in metrics.items() if k.startswith("sim/validation/")),
    )
    return metrics
