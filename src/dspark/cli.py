"""`main(argv)`: the command line of DSpark Lab (`python experiments/run.py [sweep=NAME] [key=value ...]`).

Exit codes: 0 success, 1 the run failed (the MLflow run is marked FAILED), 2 bad configuration (nothing ran).
"""
from __future__ import annotations

import logging
import os
import sys
import time

from dspark.config import ConfigError, ResolvedConfig, resolve_config

log = logging.getLogger("dspark")
RUN_ID_ENV = "DSPARK_MLFLOW_RUN_ID"  # hands the run to Lightning's DDP worker processes (they re-run this script)


def main(argv: list[str] | None = None) -> int:
    """Resolve the config, then run one experiment or a whole sweep."""
    _setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rc = resolve_config(argv)
        preflight(rc)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if rc.cfg.sweep:
        from dspark.sweeps.driver import run_sweep

        return run_sweep(rc)
    return run_experiment(rc)


def preflight(rc: ResolvedConfig) -> None:
    """Cheap checks of names and paths that would otherwise fail after minutes of work."""
    from pathlib import Path

    cfg, errors = rc.cfg, []
    if cfg.stage == "report":  # reports read the tracking store only; skip imports of torch/transformers
        return
    from dspark.data.prompts import prompt_set_errors
    from dspark.targets import TARGETS

    if cfg.data.local_dir and not Path(cfg.data.local_dir).expanduser().is_dir():
        errors.append(f"data.local_dir={cfg.data.local_dir} does not exist; point it at a directory of JSONL prompt "
                      "files (schema: id, domain, prompt, ...).")
    else:  # every prompt set the run may read, resolved (not read) now rather than after regeneration and training
        errors += prompt_set_errors(
            {"data.train_sets": cfg.data.train_sets, "decode.eval_sets": cfg.decode.eval_sets,
             "serve.prompt_sets": cfg.serve.prompt_sets},
            local_dir=cfg.data.local_dir, cache_dir=Path(cfg.paths.root) / "cache" / "datasets")
    looks_local = cfg.target.startswith(("/", ".", "~")) or cfg.target.endswith(".gguf")
    if cfg.target not in TARGETS and looks_local and not Path(cfg.target).expanduser().exists():
        errors.append(f"target={cfg.target}: no such file or directory; give a local model directory, a .gguf "
                      f"file, a hub id, or a built-in name ({', '.join(TARGETS.names())}).")
    if cfg.serve.sps_table and not Path(cfg.serve.sps_table).expanduser().is_file():
        errors.append(f"serve.sps_table={cfg.serve.sps_table}: no such file; give an SPS(B) JSON written by "
                      "dspark.serving.profile (e.g. profiled on a GPU), or drop the key to use this machine's table.")
    if errors:
        raise ConfigError("Invalid configuration:\n  - " + "\n  - ".join(errors))


def run_experiment(rc: ResolvedConfig, *, parent_run_id: str | None = None, extra_tags: dict | None = None,
                   trainer_callbacks: list | None = None) -> int:
    """Run the stages of one config inside one MLflow run; returns an exit code. `trainer_callbacks` are added to
    the training stage's Lightning Trainer (the sweep driver's Optuna pruning uses it)."""
    from dspark.stages.context import RunPaths, StageContext, run_name, seed_everything
    from dspark.tracking import open_store

    ctx = StageContext(rc=rc, paths=RunPaths.from_config(rc.cfg), trainer_callbacks=list(trainer_callbacks or []))
    ctx.paths.make()
    seed_everything(rc.cfg.seed)
    try:
        ctx.store = open_store(rc.cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    worker = _is_ddp_worker()
    if worker:
        ctx.run_id = os.environ[RUN_ID_ENV]
    else:
        tags = ctx.run_tags() | (extra_tags or {})
        ctx.run_id = ctx.store.create_run(run_name=run_name(rc.cfg), tags=tags, parent_run_id=parent_run_id)
        os.environ[RUN_ID_ENV] = ctx.run_id
        ctx.store.log_config(ctx.run_id, rc.cfg, run_dir=ctx.run_dir)
    started = time.time()
    try:
        run_stages(ctx)
    except Exception as err:  # the run is marked FAILED and the error is shown; the traceback goes to the log
        log.exception("run failed")
        if not worker:
            ctx.store.finish(ctx.run_id, status="FAILED")
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if not worker:
        ctx.store.log_metrics(ctx.run_id, {"summary/wall_seconds": time.time() - started})
        ctx.store.finish(ctx.run_id)
        log.info("done: MLflow run %s in %s; run directory %s", ctx.run_id, ctx.store.uri, ctx.run_dir)
    return 0


def run_stages(ctx) -> None:
    """prepare → train → eval (or serve), stopping after `stage` (report/profile are their own entry points)."""
    from dspark.stages.prepare import run_prepare
    from dspark.stages.train import run_train

    stage = ctx.cfg.stage
    if stage == "report":
        from dspark.stages.evaluate import run_report

        run_report(ctx)
        return
    if stage == "profile":
        from dspark.stages.evaluate import run_profile

        run_profile(ctx)
        return
    data = run_prepare(ctx)
    ctx.results["prepared"] = data
    ctx.store.log_metrics(ctx.run_id, {"data/sequences": data.num_sequences} | {
        f"data/{k}": float(v) for k, v in data.stats.items() if isinstance(v, (int, float))})
    if stage == "prepare":
        return
    drafter_path = run_train(ctx, data)
    if stage == "train" or _is_ddp_worker():
        return
    if stage == "serve":
        from dspark.stages.serve import run_serve

        run_serve(ctx, drafter_path)
        return
    from dspark.stages.evaluate import run_eval

    run_eval(ctx, drafter_path)


def _is_ddp_worker() -> bool:
    return RUN_ID_ENV in os.environ and os.environ.get("LOCAL_RANK", "0") != "0"


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
    logging.getLogger("lightning.pytorch").propagate = False  # Lightning prints its own lines
    for noisy in ("mlflow", "alembic", "urllib3", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
