"""The sweep driver: `python experiments/run.py sweep=NAME [key=value ...]`.

1. Load and validate `sweeps/NAME.yaml` (`dspark.sweeps.spec`); resolve every cell's full config (defaults <
   default.yaml < budget < sweep cell < command line) before anything runs. Bad keys or values → exit code 2.
2. A command-line key that is also an axis of the sweep selects the cells with that value
   (`sweep=block_size drafter=dflash` runs the DFlash cells only); any other key applies to every cell.
3. Find this sweep's parent run by its tags (sweep name + a hash of every cell's resolved config, output paths and
   tracking excluded, and of the supervision version) and reuse it, or create it; attach the sweep file and every
   resolved cell config to it.
4. Import the finished cells recorded in the sweep's ledger (`<paths.reports>/cells/<experiment>/NAME-<hash>.json`,
   `dspark.tracking.ledger`) that this store lacks, so a sweep goes on from another checkout or machine.
5. Run the cells one after another in this process (one device; no DDP inside a sweep), each in its own child
   run; cells whose child already completed are skipped (resume), cells that fail are marked FAILED and the
   sweep goes on. Each cell is claimed (a file lock under `<paths.root>/cache/locks`) while it runs, so the same
   command started in N processes sharing a store (one per core) splits the cells between them. Cells that
   differ only in decode.* share one trained drafter (`training_key`). Every finished cell is recorded in the
   ledger at once (`tracking.sweep_ledger=false` neither reads nor writes it).
6. Write `<paths.reports>/NAME.md` from the tracking store and attach it to the parent.

Exit code: 0 every cell passed, 1 some cell failed, 2 bad configuration, 130 interrupted (rerun to resume).
`stage=report` only regenerates the report. `max_cells=` (or the environment variable DSPARK_SWEEP_MAX_CELLS)
runs only the first cells: a debugging aid, kept out of the config schema.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from dspark.config import ConfigError, ResolvedConfig, parse_overrides, resolve_config, to_dict
from dspark.hardware import release_freed_memory
from dspark.sweeps import runs as sweep_runs
from dspark.sweeps.identity import arg_key, hashable_config, parent_tags, supervision_identity, sweep_dir
from dspark.sweeps.spec import Cell, SweepSpec, coerce_value, load_sweep
from dspark.tracking import ledger as cell_ledger
from dspark.tracking import runs as run_tree

if TYPE_CHECKING:
    from filelock import FileLock

    from dspark.tracking import TrackingStore

log = logging.getLogger("dspark")
MAX_CELLS_ENV = "DSPARK_SWEEP_MAX_CELLS"


@dataclass
class PlannedCell:
    cell: Cell
    rc: ResolvedConfig


@dataclass
class SweepPlan:
    spec: SweepSpec
    cells: list[PlannedCell]  # the cells this invocation runs (after command-line selection), in order
    sweep_hash: str           # hash of every cell of the sweep (selection excluded, so a subset shares the parent)
    total: int                # cells in the whole sweep


def run_sweep(rc: ResolvedConfig, *, max_cells: int | None = None) -> int:
    """Run (or resume, or report) the sweep named by `rc.cfg.sweep`; returns the exit code."""
    try:
        limit = _max_cells(max_cells)
        spec = load_sweep(rc.cfg.sweep)
        if rc.cfg.stage == "report":
            return report_sweep(rc, spec)
        if spec.kind == "optuna":
            from dspark.sweeps.optuna_search import run_search

            return run_search(rc, spec, max_trials=limit)
        plan = plan_grid(rc, spec)
        ledger_of(rc, spec, plan.sweep_hash, check=True)  # a broken ledger is refused before any work
        from dspark.tracking import open_store

        store = open_store(rc.cfg)
    except (ConfigError, cell_ledger.LedgerError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return execute_grid(plan, rc=rc, store=store, max_cells=limit)


def ledger_of(rc: ResolvedConfig, spec: SweepSpec, sweep_hash: str, *, check: bool = False) -> Path | None:
    """The sweep's ledger file (`dspark.tracking.ledger`), or None under `tracking.sweep_ledger=false`; `check`
    reads it once so that a file that is not this sweep's ledger raises `LedgerError` here."""
    if not rc.cfg.tracking.sweep_ledger:
        return None
    path = cell_ledger.ledger_path(rc.cfg.paths.reports, experiment=rc.cfg.tracking.experiment, sweep=spec.name,
                                   sweep_hash=sweep_hash)
    if check:
        cell_ledger.read_ledger(path, sweep=spec.name, sweep_hash=sweep_hash)
    return path


def import_ledger(store: TrackingStore, parent_id: str, path: Path | None, *, sweep: str, sweep_hash: str) -> int:
    """Import the ledger's finished cells that the parent lacks; logs and returns how many."""
    if path is None:
        return 0
    imported = cell_ledger.import_cells(store, parent_id, path, sweep=sweep, sweep_hash=sweep_hash)
    if imported:
        log.info("sweep %s: %d finished cell(s) imported from %s (they are not run again; delete the file or pass "
                 "tracking.sweep_ledger=false to rerun them): %s", sweep, len(imported), path, "; ".join(imported))
    return len(imported)


def record_ledger(store: TrackingStore, parent_id: str, path: Path | None, *, sweep: str, sweep_hash: str) -> None:
    """Write the parent's finished cells to the ledger; a failure is logged, never the end of the sweep."""
    if path is None:
        return
    try:
        count = cell_ledger.record_cells(store, parent_id, path, sweep=sweep, sweep_hash=sweep_hash)
    except (OSError, cell_ledger.LedgerError) as err:
        log.warning("sweep %s: could not record finished cells in %s (%s)", sweep, path, err)
        return
    if count:
        log.info("sweep %s: %d finished cell(s) recorded in %s", sweep, count, path)


def _max_cells(value: int | None) -> int | None:
    raw = value if value is not None else os.environ.get(MAX_CELLS_ENV)
    if raw in (None, ""):
        return None
    try:
        limit = int(raw)
    except ValueError:
        raise ConfigError(f"{MAX_CELLS_ENV}={raw!r}: expected a positive integer (cells to run).") from None
    return max(1, limit)


def plan_grid(rc: ResolvedConfig, spec: SweepSpec, *, ignore: tuple[str, ...] = (), check: bool = True
              ) -> SweepPlan:
    """Resolve every cell; select by command-line axis values; hash the whole sweep (keys in `ignore` dropped).

    `check` runs the CLI's name/path checks on every cell (skipped when only the hash is wanted, for reports)."""
    axis_keys = set(spec.axis_keys())
    argv = [a for a in rc.argv if arg_key(a) not in axis_keys and arg_key(a) not in ignore]
    planned = [PlannedCell(cell, _resolve_cell(spec, cell, argv, check=check)) for cell in spec.cells(rc.cfg.budget)]
    for pc in planned:
        check_one_device(spec, pc)
    sweep_hash = config_hash(spec, planned)
    selected = select_cells(spec, planned, parse_overrides(a for a in rc.argv if arg_key(a) not in ignore))
    return SweepPlan(spec=spec, cells=selected, sweep_hash=sweep_hash, total=len(planned))


def _resolve_cell(spec: SweepSpec, cell: Cell, argv: list[str], *, check: bool) -> ResolvedConfig:
    """The cell's full config, with the CLI's name and path checks (e.g. a misspelt prompt set in the cell)."""
    try:
        rc = resolve_config(argv, cell_overrides=cell.overrides)
        if check:
            from dspark.stages.experiment import preflight

            preflight(rc)
        return rc
    except ConfigError as err:
        raise ConfigError(f"sweeps/{spec.name}.yaml cell '{cell.key}': {err}") from None


def check_one_device(spec: SweepSpec, pc: PlannedCell) -> None:
    """Cells run one by one in the sweep process: DDP would relaunch the whole sweep in every worker."""
    t = pc.rc.cfg.trainer
    if t.devices != 1 or t.num_nodes != 1 or "ddp" in t.strategy or "fsdp" in t.strategy:
        raise ConfigError(f"sweep={spec.name}: cells run one at a time on one device, but trainer.devices="
                          f"{t.devices}, trainer.num_nodes={t.num_nodes}, trainer.strategy={t.strategy}. Drop "
                          "those keys, or run a multi-device experiment without sweep=.")


def select_cells(spec: SweepSpec, planned: list[PlannedCell], cli: dict[str, Any]) -> list[PlannedCell]:
    """Keep the cells whose axis values agree with command-line values of axis keys."""
    kept = planned
    for key in [k for k in spec.axis_keys() if k in cli]:
        value = coerce_value(key, cli[key], where="command line")
        kept = [pc for pc in kept if key not in pc.cell.axes or pc.cell.axes[key] == value]
        if not kept:
            values = sorted({str(pc.cell.axes[key]) for pc in planned if key in pc.cell.axes})
            raise ConfigError(f"{key}={value} selects no cell of sweep {spec.name}: its {key} values are "
                              f"{', '.join(values)}.")
    return kept


def config_hash(spec: SweepSpec, planned: list[PlannedCell]) -> str:
    """Stable hash of what the sweep computes: every cell's key and resolved config, the runner options and the
    supervision version (a fix that moves every training key starts a new parent instead of resuming the old one)."""
    payload = {"runner": spec.runner, "latency": spec.latency, **supervision_identity(),
               "cells": [[pc.cell.key, hashable_config(pc.rc)] for pc in planned]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cell_record(pc: PlannedCell) -> dict[str, Any]:
    from dspark.stages.context import run_name, training_key

    return {"index": pc.cell.index, "cell": pc.cell.key, "axes": pc.cell.axes, "run_name": run_name(pc.rc.cfg),
            "training_key": training_key(pc.rc.cfg), "config": to_dict(pc.rc.cfg)}


def execute_grid(plan: SweepPlan, *, rc: ResolvedConfig, store: TrackingStore, max_cells: int | None = None) -> int:
    """Run the plan's cells under one parent run (resuming it); write the report; return the exit code."""
    spec = plan.spec
    shared = sweep_lock(rc, plan.sweep_hash)
    with shared:  # a second process of this sweep finds the parent this one created, and imports nothing twice
        parent_id, reused = run_tree.open_parent(store, sweep=spec.name, sweep_hash=plan.sweep_hash,
                                                   tags=parent_tags(rc, spec, total=plan.total))
        out_dir = sweep_dir(rc, spec, plan.sweep_hash)
        sweep_runs.log_parent_record(store, parent_id, spec_text=spec.text, out_dir=out_dir,
                                     cells=[cell_record(pc) for pc in plan.cells])
        ledger = ledger_of(rc, spec, plan.sweep_hash)
        import_ledger(store, parent_id, ledger, sweep=spec.name, sweep_hash=plan.sweep_hash)
    done = run_tree.done_cells(run_tree.children(store, parent_id))
    todo = plan.cells[:max_cells] if max_cells else plan.cells
    log.info("sweep %s: %d of %d cells selected, %d already done; parent run %s (%s)", spec.name, len(todo),
             plan.total, sum(pc.cell.key in done for pc in todo), parent_id, "resumed" if reused else "new")
    outcomes: list[sweep_runs.CellOutcome] = []
    attempt, current = "", ""
    try:
        for pc, claim in claimed_in_turn(rc, plan, todo, done):
            if claim is None:
                outcomes.append(sweep_runs.CellOutcome(key=pc.cell.key, status="SKIPPED", run_id=done[pc.cell.key]))
                continue
            attempt, current = uuid.uuid4().hex, pc.cell.key
            outcomes.append(run_claimed(pc, claim, plan=plan, store=store, parent_id=parent_id, attempt=attempt,
                                        ledger=ledger, shared=shared))
            current = ""
    except (KeyboardInterrupt, SystemExit) as err:  # SystemExit: a cell that called sys.exit
        return interrupted(store, parent_id, attempt=attempt, cell=current, name=spec.name, outcomes=outcomes,
                           kept=getattr(err, "kept", ""), out_dir=out_dir)
    with shared:
        return finish_sweep(rc, plan, store=store, parent_id=parent_id, outcomes=outcomes, out_dir=out_dir)


def claimed_in_turn(rc: ResolvedConfig, plan: SweepPlan, todo: list[PlannedCell], done: dict[str, str]
                    ) -> Iterator[tuple[PlannedCell, FileLock | None]]:
    """The cells in the order this process runs them, each with its claim held (None: finished before we started).

    A cell another process of this sweep holds is passed over, then waited for after the others: its claim is
    yielded once free, and `run_claimed` skips it if that process finished it or runs it here if it died."""
    deferred = []
    for pc in todo:
        if pc.cell.key in done:
            yield pc, None
            continue
        claim = cell_claim(rc, plan.sweep_hash, pc.cell.index)
        if _try_acquire(claim):
            yield pc, claim
            continue
        log.info("sweep %s: cell %s is being run by another process of this sweep; coming back to it",
                 plan.spec.name, pc.cell.key)
        deferred.append((pc, claim))
    for pc, claim in deferred:
        if not _try_acquire(claim):
            log.info("sweep %s: waiting for another process to finish cell %s", plan.spec.name, pc.cell.key)
            claim.acquire()
        yield pc, claim


def sweep_lock(rc: ResolvedConfig, sweep_hash: str) -> FileLock:
    """The lock that processes of one sweep (same store, same hash) take around the parent, the ledger and the
    report."""
    return _lock_file(rc, f"sweep-{sweep_hash}")


def cell_claim(rc: ResolvedConfig, sweep_hash: str, index: int) -> FileLock:
    """The claim on one cell: held while a process runs it, so that N processes of the same sweep command (one per
    core, sharing a store) split the cells instead of queueing on one. An OS file lock: a dead process frees it."""
    return _lock_file(rc, f"sweep-{sweep_hash}-cell{index}")


def _lock_file(rc: ResolvedConfig, name: str) -> FileLock:
    """`<paths.root>/cache/locks/NAME.lock`: beside the caches, never beside the committed reports."""
    from filelock import FileLock

    path = Path(rc.cfg.paths.root) / "cache" / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path))


def _try_acquire(lock: FileLock) -> bool:
    from filelock import Timeout

    try:
        lock.acquire(timeout=0)
    except Timeout:
        return False
    return True


def run_claimed(pc: PlannedCell, claim: FileLock, *, plan: SweepPlan, store: TrackingStore, parent_id: str,
                attempt: str, ledger: Path | None, shared: FileLock) -> sweep_runs.CellOutcome:
    """Run a cell whose claim this process holds (and release it): skipped when another process finished it
    meanwhile; attempts left RUNNING by a dead process are closed first; a finished cell is recorded at once."""
    spec = plan.spec
    try:
        existing = run_tree.children(store, parent_id)
        done = run_tree.done_cells(existing)
        if pc.cell.key in done:
            return sweep_runs.CellOutcome(key=pc.cell.key, status="SKIPPED", run_id=done[pc.cell.key])
        run_tree.close_stale(store, existing, cell=pc.cell.key)  # we hold the claim: any RUNNING attempt is dead
        outcome = run_cell(pc, plan=plan, store=store, parent_id=parent_id, attempt=attempt)
        if outcome.status == "FINISHED":  # recorded at once: a session that ends mid-sweep keeps it
            with shared:
                record_ledger(store, parent_id, ledger, sweep=spec.name, sweep_hash=plan.sweep_hash)
        release_freed_memory()  # the next cell starts from a trimmed heap (`dspark.hardware`)
        return outcome
    finally:
        claim.release()


def run_cell(pc: PlannedCell, *, plan: SweepPlan, store: TrackingStore, parent_id: str, attempt: str
             ) -> sweep_runs.CellOutcome:
    """One cell in its own child run; exceptions become a FAILED cell, never the end of the sweep."""
    spec, cell = plan.spec, pc.cell
    started = time.perf_counter()
    tags = run_tree.cell_tags(sweep=spec.name, sweep_hash=plan.sweep_hash, paper_ref=spec.paper_ref,
                                index=cell.index, key=cell.key, axes=cell.axes, attempt=attempt)
    runner = cell_runner(spec)
    log.info("sweep %s: cell %d/%d %s", spec.name, cell.index + 1, plan.total, cell.key)
    work_start = time.perf_counter()
    try:
        code = runner(pc.rc, parent_run_id=parent_id, extra_tags=tags)
    except Exception as err:  # the cell fails, the sweep goes on; the traceback goes to the log
        log.exception("sweep %s: cell %s raised", spec.name, cell.key)
        print(f"error: cell {cell.key}: {type(err).__name__}: {err}", file=sys.stderr)
        code = 1
    work = time.perf_counter() - work_start
    run_id = run_tree.settle_attempt(store, attempt, ok=code == 0, label=cell.key)
    if code == 0 and run_id and spec.runner == "experiment":
        backfill_training_metrics(store, run_id, pc.rc)
    status = "FINISHED" if code == 0 else "FAILED"
    return sweep_runs.CellOutcome(key=cell.key, status=status, run_id=run_id,
                                  seconds=time.perf_counter() - started, work_seconds=work)


def backfill_training_metrics(store: TrackingStore, run_id: str, rc: ResolvedConfig) -> None:
    """A cell that reused a drafter trained earlier logs no train/ val/ metrics: copy the recorded ones."""
    from dspark.stages.train import recorded_training_metrics

    if rc.cfg.stage == "prepare":
        return
    metrics = store.client.get_run(run_id).data.metrics
    if any(k.startswith("val/") for k in metrics):
        return
    recorded = {k: v for k, v in recorded_training_metrics(rc).items() if k.startswith(("val/", "train/"))}
    if recorded:
        store.log_metrics(run_id, recorded)
        store.client.set_tag(run_id, "training.reused", "true")


def cell_runner(spec: SweepSpec) -> Callable[..., int]:
    """The function that runs one cell: the normal stages, or the latency runner."""
    if spec.runner == "latency":
        from dspark.sweeps.latency import run_latency_cell

        def latency(rc: ResolvedConfig, *, parent_run_id: str, extra_tags: dict) -> int:
            return run_latency_cell(rc, parent_run_id=parent_run_id, extra_tags=extra_tags,
                                    options=spec.latency_options(rc.cfg.budget))

        return latency
    from dspark.stages.experiment import run_experiment

    return run_experiment


def interrupted(store: TrackingStore, parent_id: str, *, attempt: str, cell: str, name: str,
                outcomes: list[sweep_runs.CellOutcome], kept: str, out_dir: Path) -> int:
    """Ctrl-C: the running cell (unless it had completed) and the parent become KILLED, the outcomes so far are
    logged, one line says what was kept; the next run of the same command resumes."""
    if cell:
        run = run_tree.find_attempt(store, attempt)
        if run is not None and run.data.tags.get(run_tree.COMPLETE_TAG) != "true":
            store.finish(run.info.run_id, status="KILLED")  # whatever Lightning's logger set (FAILED) before
        outcomes = outcomes + [sweep_runs.CellOutcome(key=cell, status="KILLED",
                                                      run_id=run.info.run_id if run is not None else None)]
    sweep_runs.log_outcomes(store, parent_id, outcomes, out_dir=out_dir)
    store.finish(parent_id, status="KILLED")
    finished = sum(o.status in ("FINISHED", "SKIPPED") for o in outcomes)
    running = f"; cell {cell} is marked KILLED" + (f" (kept: {kept})" if kept else "") if cell else ""
    print(f"sweep {name} interrupted: {finished} finished cells are kept{running}. Rerun the same command to resume "
          "(finished cells are skipped).", file=sys.stderr)
    return 130


def finish_sweep(rc: ResolvedConfig, plan: SweepPlan, *, store: TrackingStore, parent_id: str,
                 outcomes: list[sweep_runs.CellOutcome], out_dir: Path) -> int:
    """Log outcomes, write the report, close the parent; 0 when every cell passed."""
    failed = [o.key for o in outcomes if o.status == "FAILED"]
    sweep_runs.log_outcomes(store, parent_id, outcomes, out_dir=out_dir)
    record_ledger(store, parent_id, ledger_of(rc, plan.spec, plan.sweep_hash), sweep=plan.spec.name,
                  sweep_hash=plan.sweep_hash)
    code = 1 if failed else 0
    try:
        from dspark.reports import write_sweep_report

        path = write_sweep_report(rc, plan.spec, store=store, parent_id=parent_id)
        print(f"report: {path}")
    except Exception as err:  # a broken report must not hide the cells' results, but it fails the command
        log.exception("sweep %s: report failed", plan.spec.name)
        print(f"error: report for sweep {plan.spec.name}: {type(err).__name__}: {err}", file=sys.stderr)
        code = 1
    store.finish(parent_id, status="FAILED" if failed else "FINISHED")
    if failed:
        print(f"sweep {plan.spec.name}: {len(failed)} of {len(outcomes)} cells failed: {'; '.join(failed)}",
              file=sys.stderr)
    return code


def sweep_hash_of(rc: ResolvedConfig, spec: SweepSpec) -> str:
    """The sweep hash this command line runs under (`stage=report` itself ignored): the parent a report reads."""
    if spec.kind == "optuna":
        from dspark.sweeps.optuna_search import search_hash

        return search_hash(rc, spec, ignore=("stage",))
    return plan_grid(rc, spec, ignore=("stage",), check=False).sweep_hash


def report_sweep(rc: ResolvedConfig, spec: SweepSpec) -> int:
    """`sweep=NAME stage=report`: regenerate the report without running anything; 0 unless the store fails.

    A grid sweep's ledger is read first: its cells that the store lacks are imported (under the parent of this hash,
    created FINISHED if the store has none), so a fresh checkout regenerates the committed report; the cells the
    store finished are recorded back."""
    from dspark.reports import write_sweep_report
    from dspark.tracking import open_store

    try:
        store = open_store(rc.cfg)
        digest = sweep_hash_of(rc, spec)
        ledger = ledger_of(rc, spec, digest, check=True) if spec.kind == "grid" else None
    except (ConfigError, cell_ledger.LedgerError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if ledger is not None:
        parent = run_tree.find_parent(store, sweep=spec.name, sweep_hash=digest)
        if parent is None and ledger.exists():
            total = plan_grid(rc, spec, ignore=("stage",), check=False).total
            parent_id, _ = run_tree.open_parent(store, sweep=spec.name, sweep_hash=digest,
                                                tags=parent_tags(rc, spec, total=total))
            store.finish(parent_id)
        else:
            parent_id = parent.info.run_id if parent is not None else None
        if parent_id is not None:
            with sweep_lock(rc, digest):
                import_ledger(store, parent_id, ledger, sweep=spec.name, sweep_hash=digest)
                record_ledger(store, parent_id, ledger, sweep=spec.name, sweep_hash=digest)
    path = write_sweep_report(rc, spec, store=store, sweep_hash=digest)
    print(f"report: {path}")
    return 0
