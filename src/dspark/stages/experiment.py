"""One experiment: the cheap checks before any work (`preflight`) and the stages of one config inside one MLflow
run (`run_experiment`). The CLI calls both for a plain run; the sweep driver calls them for every cell.

Exit codes of `run_experiment`: 0 success, 1 the run failed (its MLflow run is marked FAILED), 2 the tracking store
could not be opened (nothing ran). Ctrl-C marks the run KILLED and raises `RunInterrupted`, which says what was kept
(the caller, the CLI or the sweep driver, prints it and exits 130).

A run of its own (not a sweep's cell) prints where to see it in the MLflow UI when it starts and again at the end
(`dspark.tracking.ui`), and then, as its last line, the evaluation's headline: τ and the speed-up.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.config import ConfigError, ResolvedConfig
from dspark.config.secrets import mask_text, mask_url
from dspark.hardware import release_freed_memory

if TYPE_CHECKING:  # the CLI imports this module: torch and MLflow load only when a run starts
    from dspark.stages.context import StageContext

log = logging.getLogger("dspark")
RUN_ID_ENV = "DSPARK_MLFLOW_RUN_ID"  # hands the run to Lightning's DDP worker processes (they re-run this script)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run, after its MLflow run was marked KILLED; `kept` says what the next run reuses."""

    def __init__(self, kept: str) -> None:
        super().__init__(kept)
        self.kept = kept


def preflight(rc: ResolvedConfig, *, claim: bool = True) -> None:
    """Cheap checks of names and paths that would otherwise fail after minutes of work; once they pass, the tracking
    store is opened once (`dspark.tracking.probe`: a store that cannot be used fails in seconds) and, with `claim`,
    the output locations are created and marked. A sweep claims them itself, after its own checks."""
    from dspark.stages.outputs import claim_output_locations, output_location_errors

    cfg = rc.cfg
    errors = output_location_errors(cfg)  # new, empty or ours, and writable; claimed only once every check passed
    if cfg.stage == "report":  # reports read the tracking store only; skip imports of torch/transformers
        _raise(errors)
        _check_store(rc)
        if claim:
            claim_output_locations(cfg)
        return
    from dspark.data.prompts import prompt_set_errors
    from dspark.targets.checks import check_target

    if cfg.data.local_dir and not Path(cfg.data.local_dir).expanduser().is_dir():
        errors.append(
            f"data.local_dir={cfg.data.local_dir} does not exist; point it at a directory of JSONL prompt "
            "files (schema: id, domain, prompt, ...)."
        )
    else:  # every prompt set the run may read, resolved (not read) now rather than after regeneration and training
        errors += prompt_set_errors(
            {
                "data.train_sets": cfg.data.train_sets,
                "decode.eval_sets": cfg.decode.eval_sets,
                "serve.prompt_sets": cfg.serve.prompt_sets,
                "decode.calibration_set": [cfg.decode.calibration_set] if cfg.decode.calibration_set else [],
            },
            local_dir=cfg.data.local_dir,
            cache_dir=Path(cfg.paths.root) / "cache" / "datasets",
        )
    from dspark.stages.export import preflight_errors as interop_errors

    errors += interop_errors(cfg)  # export.* and model.import_from
    from dspark.data.feature_format import preflight_errors as feature_errors

    errors += feature_errors(cfg)  # data.features_from: manifest, target identity, shard headers, checksums
    if cfg.data.regen_backend == "openai":  # key variable set, server up with a model (≤ 5 s); imported only then
        from dspark.data.regen_server import preflight_errors as regen_server_errors

        errors += regen_server_errors(cfg)
    try:  # file headers only: a directory that is not a model or a cut-off .gguf fails here, not after loading
        check_target(cfg.target, cache_dir=Path(cfg.paths.root) / "cache")
    except ValueError as err:
        errors.append(str(err))
    if cfg.serve.sps_table and not Path(cfg.serve.sps_table).expanduser().is_file():
        errors.append(
            f"serve.sps_table={cfg.serve.sps_table}: no such file; give an SPS(B) JSON written by "
            "dspark.serving.profile (e.g. profiled on a GPU), or drop the key to use this machine's table."
        )
    elif cfg.serve.sps_table:  # parsed now (a small JSON), not after the drafter is trained
        from dspark.scheduling.profile import load_sps_table

        try:
            load_sps_table(Path(cfg.serve.sps_table).expanduser())
        except ValueError as err:
            errors.append(str(err))
    _raise(errors)
    _check_store(rc)
    if claim:
        claim_output_locations(cfg)  # every check passed: only now is anything created


def _check_store(rc: ResolvedConfig) -> None:
    """The store last: opening it imports MLflow (seconds), which a config with a typo need not wait for."""
    from dspark.tracking.probe import check_store

    check_store(rc.cfg)


def _raise(errors: list[str]) -> None:
    if errors:
        raise ConfigError("Invalid configuration:\n  - " + "\n  - ".join(errors))


def run_experiment(
    rc: ResolvedConfig,
    *,
    parent_run_id: str | None = None,
    extra_tags: dict | None = None,
    trainer_callbacks: list | None = None,
) -> int:
    """Run the stages of one config inside one MLflow run; returns an exit code. `trainer_callbacks` are added to
    the training stage's Lightning Trainer (the sweep driver's Optuna pruning uses it)."""
    from dspark.stages.context import RunPaths, StageContext, seed_everything
    from dspark.tracking import open_store

    ctx = StageContext(rc=rc, paths=RunPaths.from_config(rc.cfg), trainer_callbacks=list(trainer_callbacks or []))
    ctx.paths.make()
    seed_everything(rc.cfg.seed)
    try:
        ctx.store = open_store(rc.cfg)
    except ConfigError as err:
        print(f"error: {mask_text(str(err))}", file=sys.stderr)
        return 2
    worker = is_ddp_worker()
    standalone = not worker and parent_run_id is None  # a sweep prints its own links and summary
    if standalone:
        _close_dead_runs(ctx.store)
    if worker:
        ctx.run_id = os.environ[RUN_ID_ENV]
    else:
        tags = ctx.run_tags() | (extra_tags or {})
        ctx.run_id = ctx.store.create_run(run_name=mlflow_run_name(rc, tags), tags=tags, parent_run_id=parent_run_id)
        os.environ[RUN_ID_ENV] = ctx.run_id
        ctx.store.log_config(ctx.run_id, rc.cfg, run_dir=ctx.run_dir)
    links = print_ui_links(ctx) if standalone else []
    started = time.time()
    try:
        from dspark.tracking.system_metrics import system_metrics  # CPU / memory as system/* (tracking.system_metrics)

        with system_metrics(ctx.store, ctx.run_id, enabled=rc.cfg.tracking.system_metrics and not worker):
            headline = run_stages(ctx)
    except KeyboardInterrupt:  # Ctrl-C: KILLED, not FAILED; the next run of the same command resumes
        if not worker:
            ctx.store.finish(ctx.run_id, status="KILLED")
        raise RunInterrupted(kept_after_interrupt(ctx)) from None
    except Exception as err:  # the run is marked FAILED and the error is shown; the traceback goes to the log
        log.exception("run failed")
        if not worker:
            ctx.store.finish(ctx.run_id, status="FAILED")
        print(f"error: {type(err).__name__}: {mask_text(str(err))}", file=sys.stderr)
        return 1
    if not worker:
        ctx.store.log_metrics(ctx.run_id, {"summary/wall_seconds": time.time() - started})
        ctx.store.finish(ctx.run_id)
        log.info("done: MLflow run %s in %s; run directory %s", ctx.run_id, mask_url(ctx.store.uri), ctx.run_dir)
    if standalone:
        print("\n".join(links), flush=True)
        if headline:
            print(headline, flush=True)  # the run's last line: what it measured
    elif headline:
        log.info("%s", headline)
    return 0


def _close_dead_runs(store) -> None:
    """Close the plain runs that killed processes of this machine left RUNNING (`dspark.tracking.processes`); a
    failure to do so is logged, never the run's failure."""
    from dspark.tracking.processes import close_dead_runs as close

    try:
        closed = close(store)
    except Exception as err:  # noqa: BLE001 — housekeeping of earlier runs
        log.warning("could not close runs left RUNNING by killed processes: %s", mask_text(str(err)))
        return
    if closed:
        log.info("marked %d run(s) KILLED that a killed process left RUNNING: %s", len(closed), ", ".join(closed))


def mlflow_run_name(rc: ResolvedConfig, tags: dict) -> str:
    """The run's name in MLflow: `run_name` (what was trained), led by a sweep cell's axis values when it is one."""
    from dspark.stages.context import run_name
    from dspark.tracking.runs import cell_run_name

    name = run_name(rc.cfg)
    return cell_run_name(tags["cell"], name) if tags.get("cell") else name


UI_COLUMNS = (
    "params.drafter",
    "params.model.head",
    "params.model.depth",
    "params.model.block_size",
    "params.budget",
    "params.decode.policy",
    "metrics.summary/tau",
    "metrics.eval/all/tau_prompt_mean",
    "metrics.speed/speedup_prompt_mean",
    "metrics.summary/speedup",
    "metrics.val/tau_prob",
    "metrics.summary/wall_seconds",
)


def print_ui_links(ctx: StageContext) -> list[str]:
    """Print (and return, for the end of the run) where the run shows in the MLflow UI: the runs table of this run
    name (earlier runs of the same config beside it) with the columns a reader compares, and the command that serves
    a local store."""
    from dspark.stages.context import run_name
    from dspark.tracking.ui import run_url, runs_table_url, ui_lines

    name = run_name(ctx.cfg)
    filter_string = f"attributes.run_name = '{name}'" if "'" not in name else None
    url = runs_table_url(ctx.store, filter_string=filter_string, columns=UI_COLUMNS, view_name=f"runs named {name}")
    lines = ui_lines(ctx.store, url=url) + [f"  this run: {run_url(ctx.store, ctx.run_id)}"]
    print("\n".join(lines), flush=True)
    return lines


def run_stages(ctx: StageContext) -> str | None:
    """prepare → train → eval (or serve), stopping after `stage` (report/profile are their own entry points);
    returns the evaluation's headline, if the run evaluated."""
    from dspark.stages.prepare import run_prepare
    from dspark.stages.train import run_train

    stage = ctx.cfg.stage
    if stage == "report":
        from dspark.stages.evaluate import run_report

        run_report(ctx)
        return None
    if stage == "profile":
        from dspark.stages.evaluate import run_profile

        run_profile(ctx)
        return None
    if stage == "export":
        from dspark.stages.export import run_export

        run_export(ctx)
        return None
    if ctx.cfg.model.import_from and stage in ("eval", "all", "serve"):  # an exported drafter instead of training
        from dspark.stages.export import import_to_run_dir

        return _evaluate_or_serve(ctx, import_to_run_dir(ctx), prepared=None)
    data = run_prepare(ctx)
    if not is_ddp_worker():  # the training data as the run's dataset inputs: digest and source (MLflow lineage)
        from dspark.tracking.lineage import log_training_data

        log_training_data(ctx, data)
    ctx.store.log_metrics(
        ctx.run_id,
        {"data/sequences": data.num_sequences}
        | {f"data/{k}": float(v) for k, v in data.stats.items() if isinstance(v, (int, float))},
    )
    if stage == "prepare":
        return None
    drafter_path = run_train(ctx, data)
    if stage == "train" or is_ddp_worker():
        return None
    release_freed_memory()  # training's kept heap blocks are the wrong sizes for evaluation
    return _evaluate_or_serve(ctx, drafter_path, prepared=data)


def _evaluate_or_serve(ctx: StageContext, drafter_path, *, prepared) -> str | None:
    """Serve (no headline) or evaluate (its headline)."""
    if ctx.cfg.stage == "serve":
        from dspark.stages.serve import run_serve

        run_serve(ctx, drafter_path, prepared=prepared)
        return None
    from dspark.stages.evaluate import run_eval

    return run_eval(ctx, drafter_path, prepared=prepared).headline


def kept_after_interrupt(ctx: StageContext) -> str:
    """What an interrupted run leaves for the next one: the trained drafter or the last training checkpoint, and the
    caches (regenerated data and features are written resumably)."""
    from dspark.drafters.checkpoint import DRAFTER_FILE

    drafter, last = ctx.run_dir / DRAFTER_FILE, ctx.run_dir / "checkpoints" / "last.ckpt"
    kept = [
        f"the trained drafter {drafter}"
        if drafter.exists()
        else f"the training checkpoint {last}"
        if last.exists()
        else "no training checkpoint yet"
    ]
    return " and ".join(kept + [f"the caches under {ctx.paths.cache}"])


def is_ddp_worker() -> bool:
    """True in a DDP worker process that Lightning started (it attaches to the run of rank 0)."""
    return RUN_ID_ENV in os.environ and os.environ.get("LOCAL_RANK", "0") != "0"
