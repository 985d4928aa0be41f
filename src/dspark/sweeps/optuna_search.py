"""Optuna searches (`sweep=loss_weights`, `sweep=rank`): one study per search, one MLflow child per trial.

A worker (`python experiments/run.py sweep=loss_weights`, started on as many processes or machines as wanted, all
pointing at one `optuna.storage`) does:
1. resolve the fixed config (sweep file + budget + command line; searched keys may not be on the command line) and
   set up the study (`dspark.sweeps.optuna_study.setup_study`: storage checked, paper defaults enqueued once);
2. reuse or create the sweep's parent run (tags `sweep.name`, `sweep.hash`, `optuna.study`);
3. claim trials until the study holds `optuna.n_trials`: each trial's params become cell overrides, the cell runs
   with `run_experiment` in a child run tagged `optuna.trial`, and its objective is a metric of that run
   (`summary/tau` after evaluation, `val/tau_prob` for stage=train; a missing metric fails the trial loudly);
   with `optuna.prune`, `PruningCallback` reports the validation metric after every epoch and stops the trial
   when the median rule says so (the child is tagged `optuna.state=PRUNED`, its MLflow status stays FAILED);
4. log the best params, best value and parameter importances (≥ 2 completed trials) to the parent; write the report.
"""

from __future__ import annotations

import json
import logging
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L

from dspark.config import ConfigError, ResolvedConfig, resolve_config
from dspark.config.secrets import mask_text, mask_url
from dspark.files import atomic_write_text
from dspark.stages.train import recorded_training_metrics
from dspark.sweeps import runs as sweep_runs
from dspark.sweeps.identity import arg_key, identity_hash, parent_tags, sweep_dir, sweep_identity
from dspark.sweeps.optuna_study import StudyHandle, claim_trial, default_storage, setup_study, trial_is_default
from dspark.sweeps.spec import SweepSpec
from dspark.tracking import runs as run_tree

if TYPE_CHECKING:
    from dspark.tracking import TrackingStore

log = logging.getLogger("dspark")


class PruningCallback(L.Callback):
    """Report `monitor` to the trial after each validation epoch; raise TrialPruned when the pruner says so."""

    def __init__(self, trial: Any, monitor: str) -> None:
        self.trial, self.monitor, self.pruned = trial, monitor, False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Report the monitored value for this epoch; prune or fail loudly."""
        import optuna

        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            raise ValueError(
                f"Optuna pruning monitors '{self.monitor}' (optuna.prune_on in the sweep file), but the "
                f"run logged no such metric; logged: {', '.join(sorted(trainer.callback_metrics))}. "
                "Fix prune_on or set optuna.prune=false."
            )
        self.trial.report(float(value), step=trainer.current_epoch)
        if self.trial.should_prune():
            self.pruned = True
            raise optuna.TrialPruned(
                f"trial {self.trial.number} pruned at epoch {trainer.current_epoch} ({self.monitor}={float(value):.4f})"
            )


def searched_keys(spec: SweepSpec) -> list[str]:
    return [p.key for p in spec.optuna.params]


def fixed_argv(rc: ResolvedConfig, spec: SweepSpec, *, ignore: tuple[str, ...] = ()) -> list[str]:
    """The command line minus keys to ignore; a searched key on the command line is an error."""
    clash = [a for a in rc.argv if arg_key(a) in searched_keys(spec)]
    if clash:
        raise ConfigError(
            f"sweep={spec.name} searches {', '.join(searched_keys(spec))}: remove {', '.join(clash)} "
            "from the command line (or run without sweep= to set them)."
        )
    return [a for a in rc.argv if arg_key(a) not in ignore]


def search_hash(rc: ResolvedConfig, spec: SweepSpec, *, ignore: tuple[str, ...] = ()) -> str:
    """The search's identity hash (`dspark.sweeps.identity`: name, budget, explicit overrides, search space, recipe
    and supervision versions): a study of drafters trained on superseded supervision is not resumed, and a changed
    default does not orphan a study."""
    fixed_argv(rc, spec, ignore=ignore)  # a searched key on the command line is refused here
    return identity_hash(sweep_identity(rc, spec, ignore=ignore))


def open_search(rc: ResolvedConfig, spec: SweepSpec) -> tuple[StudyHandle, str]:
    """Set up the study of this search; returns it and the search hash."""
    digest = search_hash(rc, spec)
    opt = rc.cfg.optuna
    name = opt.study or f"{spec.name}-{digest}"
    handle = setup_study(
        storage=opt.storage or default_storage(rc.cfg.paths.root),
        name=name,
        direction=spec.optuna.direction,
        seed=rc.cfg.seed,
        startup_trials=opt.startup_trials,
        prune=opt.prune,
        defaults=spec.optuna.defaults,
        root=rc.cfg.paths.root,
    )
    return handle, digest


def run_search(rc: ResolvedConfig, spec: SweepSpec, *, max_trials: int | None = None) -> int:
    """One worker of the search; returns 0 when every trial it ran completed or was pruned, 1 otherwise."""
    from dspark.stages.outputs import claim_output_locations
    from dspark.tracking import open_store

    if rc.cfg.optuna.n_trials < 1:
        raise ConfigError(f"optuna.n_trials={rc.cfg.optuna.n_trials}: give the total number of trials (≥ 1).")
    spec.optuna.objective_metric(rc.cfg.stage)  # a stage without an objective fails here, before training
    handle, digest = open_search(rc, spec)  # the study storage first: a bad one fails before anything is created
    claim_output_locations(rc.cfg)
    store = open_store(rc.cfg)
    with handle.locked():  # racing workers on one machine share one parent
        tags = parent_tags(rc, spec, total=rc.cfg.optuna.n_trials) | {
            "optuna.study": handle.study.study_name,
            "optuna.storage": mask_url(handle.storage),
        }
        parent_id, _ = run_tree.open_parent(store, sweep=spec.name, sweep_hash=digest, tags=tags)
    sweep_runs.log_parent_record(
        store,
        parent_id,
        spec_text=spec.text,
        out_dir=sweep_dir(rc, spec, digest),
        cells=[
            {
                "index": -1,
                "cell": "optuna search",
                "run_name": "-",
                "training_key": "-",
                "study": handle.study.study_name,
                "fixed_argv": fixed_argv(rc, spec),
            }
        ],
    )
    states = []
    try:
        while max_trials is None or len(states) < max_trials:
            trial = claim_trial(handle, n_trials=rc.cfg.optuna.n_trials)
            if trial is None:
                break
            states.append(
                run_trial(trial, rc=rc, spec=spec, handle=handle, store=store, parent_id=parent_id, digest=digest)
            )
    except (KeyboardInterrupt, SystemExit) as err:  # SystemExit: a trial that called sys.exit
        store.finish(parent_id, status="KILLED")
        kept = f" (kept: {err.kept})" if getattr(err, "kept", "") else ""
        print(
            f"search {spec.name} interrupted: the study {handle.study.study_name} keeps every finished trial "
            f"({len(states)} of this worker); the running trial is marked KILLED{kept}. Rerun the same command "
            "to continue the study.",
            file=sys.stderr,
        )
        return 130
    return finish_search(rc, spec, handle=handle, store=store, parent_id=parent_id, states=states)


def run_trial(
    trial: Any,
    *,
    rc: ResolvedConfig,
    spec: SweepSpec,
    handle: StudyHandle,
    store: TrackingStore,
    parent_id: str,
    digest: str,
) -> str:
    """Run one trial as a sweep cell and tell the study how it ended; returns the Optuna state name."""
    from optuna.trial import TrialState

    params = {p.key: p.suggest(trial) for p in spec.optuna.params}
    attempt = uuid.uuid4().hex
    tags = run_tree.cell_tags(
        sweep=spec.name,
        sweep_hash=digest,
        paper_ref=spec.paper_ref,
        index=trial.number,
        key=f"trial-{trial.number}",
        axes=params,
        attempt=attempt,
    ) | {
        "optuna.trial": str(trial.number),
        "optuna.study": handle.study.study_name,
        "optuna.defaults": str(trial_is_default(trial)).lower(),
    }
    log.info("search %s: trial %d %s", spec.name, trial.number, params)
    try:
        state, value = evaluate_trial(
            trial, rc=rc, spec=spec, params=params, tags=tags, store=store, parent_id=parent_id, attempt=attempt
        )
    except (KeyboardInterrupt, SystemExit):
        handle.study.tell(trial, state=TrialState.FAIL)
        run = run_tree.find_attempt(store, attempt)
        if run is not None:
            store.finish(run.info.run_id, status="KILLED")
        raise
    run = run_tree.find_attempt(store, attempt)
    if run is not None:
        store.client.set_tag(run.info.run_id, "optuna.state", state)
        if value is not None:
            store.log_metrics(run.info.run_id, {"optuna/objective": value})
    handle.study.tell(trial, value if state == "COMPLETE" else None, state=TrialState[state])
    return state


def evaluate_trial(
    trial: Any,
    *,
    rc: ResolvedConfig,
    spec: SweepSpec,
    params: dict,
    tags: dict,
    store: TrackingStore,
    parent_id: str,
    attempt: str,
) -> tuple[str, float | None]:
    """Run the trial's cell; (COMPLETE, objective) | (PRUNED, None) | (FAIL, None)."""
    from dspark.stages.experiment import run_experiment

    try:
        cell = resolve_config(fixed_argv(rc, spec), cell_overrides=spec.base_overrides(rc.cfg.budget) | params)
    except ConfigError as err:
        print(f"error: trial {trial.number} {params}: {mask_text(str(err))}", file=sys.stderr)
        return "FAIL", None
    callbacks = [PruningCallback(trial, spec.optuna.prune_on)] if rc.cfg.optuna.prune and spec.optuna.prune_on else []
    code = run_experiment(cell, parent_run_id=parent_id, extra_tags=tags, trainer_callbacks=callbacks)
    if callbacks and callbacks[0].pruned:
        run_tree.settle_attempt(store, attempt, ok=False, label=tags["cell"])
        return "PRUNED", None
    if code != 0:
        run_tree.settle_attempt(store, attempt, ok=False, label=tags["cell"])
        return "FAIL", None
    metric = spec.optuna.objective_metric(cell.cfg.stage)
    value = objective_value(store, attempt=attempt, metric=metric, rc=cell)
    run_tree.settle_attempt(store, attempt, ok=value is not None, label=tags["cell"])
    return ("COMPLETE", value) if value is not None else ("FAIL", None)


def objective_value(store: TrackingStore, *, attempt: str, metric: str, rc: ResolvedConfig) -> float | None:
    """The trial run's `metric`; a reused drafter's recorded training metrics count too; else a loud error."""
    run = run_tree.find_attempt(store, attempt)
    metrics = dict(run.data.metrics) if run is not None else {}
    if metric not in metrics:
        metrics.update(recorded_training_metrics(rc))
    if metric in metrics:
        return float(metrics[metric])
    log.error(
        "objective metric '%s' is missing from trial run %s; it logged: %s. Fix `objective` in "
        "sweeps/%s.yaml or run a stage that produces it.",
        metric,
        run.info.run_id if run else "?",
        ", ".join(sorted(metrics)) or "nothing",
        rc.cfg.sweep,
    )
    print(f"error: objective metric '{metric}' missing from the trial's run (see the log)", file=sys.stderr)
    return None


def log_study_summary(store: TrackingStore, parent_id: str, handle: StudyHandle, *, out_dir: Path) -> None:
    """Best value / trial / params and parameter importances → parent metrics, tags and `study.json`."""
    import optuna
    from optuna.trial import TrialState

    study = handle.study
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    summary: dict[str, Any] = {
        "study": study.study_name,
        "storage": mask_url(handle.storage),
        "trials": [
            {
                "number": t.number,
                "state": t.state.name,
                "params": t.params,
                "value": t.value,
                "paper_defaults": bool(t.user_attrs.get("paper_defaults")),
            }
            for t in study.get_trials(deepcopy=False)
        ],
    }
    metrics: dict[str, float] = {"optuna/trials_complete": float(len(complete))}
    if complete:
        best = study.best_trial
        summary["best"] = {"number": best.number, "value": best.value, "params": best.params}
        metrics |= {"best/value": float(best.value), "best/trial": float(best.number)}
        metrics |= {f"best/{k}": float(v) for k, v in best.params.items() if isinstance(v, (int, float))}
        store.client.set_tag(parent_id, "optuna.best_params", json.dumps(best.params, sort_keys=True))
    if len(complete) >= 2:
        try:
            importances = optuna.importance.get_param_importances(study)
        except (RuntimeError, ValueError) as err:  # e.g. every completed trial had the same params
            log.warning("parameter importances unavailable: %s", err)
            importances = {}
        summary["importances"] = importances
        metrics |= {f"importance/{k}": float(v) for k, v in importances.items()}
    store.log_metrics(parent_id, metrics)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "study.json", json.dumps(summary, indent=1, default=str))
    store.client.log_artifact(parent_id, str(out_dir / "study.json"), artifact_path="sweep")


def finish_search(
    rc: ResolvedConfig, spec: SweepSpec, *, handle: StudyHandle, store: TrackingStore, parent_id: str, states: list[str]
) -> int:
    """Summaries, report, parent status; 1 when a trial of this worker failed."""
    digest = store.client.get_run(parent_id).data.tags.get("sweep.hash", "")
    log_study_summary(store, parent_id, handle, out_dir=sweep_dir(rc, spec, digest))
    failed = states.count("FAIL")
    code = 1 if failed else 0
    try:
        from dspark.reports import write_sweep_report

        print(f"report: {write_sweep_report(rc, spec, store=store, parent_id=parent_id)}")
    except Exception as err:  # the study is safe in its storage; the command still fails
        log.exception("search %s: report failed", spec.name)
        print(f"error: report for sweep {spec.name}: {type(err).__name__}: {mask_text(str(err))}", file=sys.stderr)
        code = 1
    store.finish(parent_id, status="FAILED" if failed else "FINISHED")
    log.info(
        "search %s: this worker ran %d trials (%s); study %s",
        spec.name,
        len(states),
        ", ".join(f"{s} {states.count(s)}" for s in sorted(set(states))) or "none",
        handle.study.study_name,
    )
    return code
