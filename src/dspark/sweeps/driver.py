"""The sweep driver: `python experiments/run.py sweep=NAME [key=value ...]`.

1. Load and validate `sweeps/NAME.yaml` (`dspark.sweeps.spec`); resolve every cell's full config (defaults <
   default.yaml < budget < sweep cell < command line) before anything runs. Bad keys or values → exit code 2.
2. A command-line key that is also an axis of the sweep selects the cells with that value
   (`sweep=block_size drafter=dflash` runs the DFlash cells only); any other key applies to every cell.
3. Find this sweep's parent run by its identity (`dspark.sweeps.identity`: sweep name, budget, explicit overrides,
   recipe version — not the grid, so `sweep.axes.KEY=[...]` / `sweep.seeds=[...]` grow the same parent) and reuse
   it, or create it; attach the sweep file and every resolved cell config to it.
4. Import the finished cells recorded in the sweep's ledgers (`<paths.root>/ledgers/<experiment>/NAME-<hash>.json`,
   and the committed `results/NAME/ledger.json` when its identity is this sweep's; `dspark.tracking.ledger`) that
   this store lacks, so a sweep goes on from another checkout or machine. A finished cell whose recorded config
   differs from today's resolution on a key its stages read is *drifted*: it is run again, and until then the
   report lists it as recorded under an older recipe.
5. Run the cells one after another in this process (one device; no DDP inside a sweep), each in its own child
   run; cells whose child already completed are skipped (resume), cells that fail are marked FAILED and the
   sweep goes on. Each cell is claimed (a file lock under `<paths.root>/cache/locks`) while it runs, so the same
   command started in N processes sharing a store (one per core) splits the cells between them. Cells that
   differ only in decode.* share one trained drafter (`training_key`). Every finished cell is recorded in the
   ledger at once (`tracking.sweep_ledger=false` neither reads nor writes it).
6. Write `<paths.reports>/NAME.md` from the tracking store and attach it to the parent.

Exit code: 0 every cell passed, 1 some cell failed, 2 bad configuration (or, for `stage=report`, no finished cell to
report), 130 interrupted (rerun to resume). `stage=report` only regenerates the report; it never overwrites a report
with an empty one. `regenerate_from_ledger` rebuilds a committed report from its ledger alone (`make results`). `max_cells=` (or the environment variable DSPARK_SWEEP_MAX_CELLS)
runs only the first cells: a debugging aid, kept out of the config schema.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from dspark.config import ConfigError, ResolvedConfig, parse_overrides, repo_root, resolve_config, to_dict
from dspark.config.secrets import mask_text, mask_tree
from dspark.hardware import release_freed_memory
from dspark.sweeps import runs as sweep_runs
from dspark.sweeps.identity import (
    arg_key,
    drifted_keys,
    identity_hash,
    parent_tags,
    recorded_config,
    sweep_command,
    sweep_dir,
    sweep_identity,
)
from dspark.sweeps.spec import Cell, SweepSpec, coerce_value, load_sweep
from dspark.tracking import ledger as cell_ledger
from dspark.tracking import runs as run_tree
from dspark.tracking.claims import StoreClaim, oldest_run, worker_id

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
    sweep_hash: str  # the identity's hash (selection and grid excluded: a subset or a growth shares the parent)
    total: int  # cells in the whole sweep
    identity: dict[str, Any] = field(default_factory=dict)
    every_cell: list[PlannedCell] = field(
        default_factory=list
    )  # the whole grid, resolved today (drift is judged on it)


@dataclass
class CellStates:
    """What the store holds for a sweep's cells, judged against today's resolution of each cell."""

    done: dict[str, str]  # cell → run id of its run under today's recipe
    drifted: dict[str, tuple[str, list[str]]]  # cell → (run id of its newest record, the keys that differ)

    @property
    def drift(self) -> dict[str, list[str]]:
        """cell → the keys on which its reported record differs from today's recipe (cells with a current run: none)."""
        return {cell: keys for cell, (_, keys) in self.drifted.items()}

    @property
    def run_ids(self) -> set[str]:
        """The runs a report shows: each cell's current run, else its newest record under an older recipe."""
        return set(self.done.values()) | {run_id for run_id, _ in self.drifted.values()}


def run_sweep(rc: ResolvedConfig, *, max_cells: int | None = None) -> int:
    """Run (or resume, or report) the sweep named by `rc.cfg.sweep`; returns the exit code."""
    from dspark.stages.outputs import claim_output_locations

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
        claim_output_locations(rc.cfg)  # every check passed: only now is anything created
        from dspark.tracking import open_store

        store = open_store(rc.cfg)
    except (ConfigError, cell_ledger.LedgerError) as err:
        print(f"error: {mask_text(str(err))}", file=sys.stderr)
        return 2
    return execute_grid(plan, rc=rc, store=store, max_cells=limit)


def ledger_of(rc: ResolvedConfig, spec: SweepSpec, sweep_hash: str, *, check: bool = False) -> Path | None:
    """The ledger this run writes (`<paths.root>/ledgers/...`, `dspark.tracking.ledger`), or None under
    `tracking.sweep_ledger=false`; `check` reads it once so that a file that is not this sweep's ledger raises
    `LedgerError` here, before any work."""
    if not rc.cfg.tracking.sweep_ledger:
        return None
    path = cell_ledger.ledger_path(
        rc.cfg.paths.root, experiment=rc.cfg.tracking.experiment, sweep=spec.name, sweep_hash=sweep_hash
    )
    if check:
        cell_ledger.read_ledger(path, sweep=spec.name, sweep_hash=sweep_hash)
        committed_ledger(rc, spec, sweep_hash)
    return path


def results_ledger(sweep: str) -> Path:
    """`results/<sweep>/ledger.json`: the committed record of the sweep's current answer (`make results`)."""
    return repo_root() / "results" / sweep / "ledger.json"


def committed_ledger(rc: ResolvedConfig, spec: SweepSpec, sweep_hash: str) -> Path | None:
    """The committed ledger when it records this very sweep identity (its cells are then imported, never written),
    else None; a committed ledger of another identity is left alone with one line saying why."""
    if not rc.cfg.tracking.sweep_ledger:
        return None
    path = results_ledger(spec.name)
    data = cell_ledger.load_ledger(path)
    if data is None:
        return None
    if data.get("sweep") == spec.name and data.get("sweep_hash") == sweep_hash:
        return path
    log.info(
        "sweep %s: %s records another identity (%s), not this command's (hash %s): its cells are not imported",
        spec.name,
        path.relative_to(repo_root()),
        _identity_text(data.get("identity") or {}),
        sweep_hash,
    )
    return None


def _identity_text(identity: dict[str, Any]) -> str:
    overrides = " ".join(identity.get("overrides") or []) or "no overrides"
    return f"budget={identity.get('budget')}, {overrides}, recipe {identity.get('recipe')}"


def import_ledger(store: TrackingStore, parent_id: str, path: Path | None, *, sweep: str, sweep_hash: str) -> int:
    """Import the ledger's finished cells that the parent lacks; logs and returns how many."""
    if path is None:
        return 0
    imported = cell_ledger.import_cells(store, parent_id, path, sweep=sweep, sweep_hash=sweep_hash)
    if imported:
        log.info(
            "sweep %s: %d finished cell(s) imported from %s (they are not run again; pass "
            "tracking.sweep_ledger=false to rerun them): %s",
            sweep,
            len(imported),
            path,
            "; ".join(imported),
        )
    return len(imported)


def record_ledger(store: TrackingStore, parent_id: str, path: Path | None, *, plan: SweepPlan) -> None:
    """Write each cell's current run (or newest record) to the ledger; a failure is logged, never the end of the
    sweep."""
    if path is None:
        return
    kids = run_tree.children(store, parent_id)
    keep = cell_states(plan, kids).run_ids
    try:
        count = cell_ledger.record_cells(
            [r for r in kids if r.info.run_id in keep],
            path,
            sweep=plan.spec.name,
            sweep_hash=plan.sweep_hash,
            identity=plan.identity,
        )
    except (OSError, cell_ledger.LedgerError) as err:
        log.warning("sweep %s: could not record finished cells in %s (%s)", plan.spec.name, path, err)
        return
    if count:
        log.info("sweep %s: %d finished cell(s) recorded in %s", plan.spec.name, count, path)


#: the drift "key" of a cell recorded from a tree with uncommitted changes, redone by a run from a committed tree
DIRTY_RECORD = "(ran from a tree with uncommitted changes)"


def cell_states(plan: SweepPlan, kids: list[Any], *, redo_dirty: bool = False) -> CellStates:
    """Per cell, its completed run under today's recipe (newest first), else its newest record and the keys on which
    that record differs from today's resolution (`identity.drifted_keys`). Cells outside today's grid keep their
    newest completed run (nothing to judge them against). `redo_dirty` (a sweep run from a committed tree): a record
    made from a tree with uncommitted changes counts as drifted too, so the committed tree replaces it."""
    today = {pc.cell.key: recorded_config(pc.rc) for pc in plan.every_cell or plan.cells}
    complete = [
        r
        for r in kids
        if r.info.status == "FINISHED" and r.data.tags.get(run_tree.COMPLETE_TAG) == "true" and "cell" in r.data.tags
    ]
    done: dict[str, str] = {}
    drifted: dict[str, tuple[str, list[str]]] = {}
    for run in sorted(complete, key=lambda r: r.info.start_time or 0, reverse=True):
        cell = run.data.tags["cell"]
        if cell in done:
            continue
        keys = drifted_keys(dict(run.data.params), today[cell]) if cell in today else []
        if redo_dirty and run.data.tags.get("git.dirty") == "True" and cell in today:
            keys.append(DIRTY_RECORD)
        if not keys:
            done[cell] = run.info.run_id
        elif cell not in drifted:
            drifted[cell] = (run.info.run_id, keys)
    return CellStates(done=done, drifted={c: v for c, v in drifted.items() if c not in done})


def _max_cells(value: int | None) -> int | None:
    raw = value if value is not None else os.environ.get(MAX_CELLS_ENV)
    if raw in (None, ""):
        return None
    try:
        limit = int(raw)
    except ValueError:
        raise ConfigError(f"{MAX_CELLS_ENV}={raw!r}: expected a positive integer (cells to run).") from None
    return max(1, limit)


def plan_grid(rc: ResolvedConfig, spec: SweepSpec, *, ignore: tuple[str, ...] = (), check: bool = True) -> SweepPlan:
    """Resolve every cell (the sweep grown by `sweep.axes.*` / `sweep.seeds`); select by command-line axis values;
    name the sweep by its identity (keys in `ignore` dropped from the command line).

    `check` runs the CLI's name/path checks on every cell (skipped when only the identity is wanted, for reports)."""
    spec = spec.with_args(rc.sweep_args)
    axis_keys = set(spec.axis_keys())
    argv = [
        a
        for a in rc.argv
        if arg_key(a) not in axis_keys and arg_key(a) not in ignore and not arg_key(a).startswith("sweep.")
    ]
    planned = [PlannedCell(cell, _resolve_cell(spec, cell, argv, check=check)) for cell in spec.cells(rc.cfg.budget)]
    for pc in planned:
        check_one_device(spec, pc)
    identity = sweep_identity(rc, spec, ignore=ignore)
    cli = parse_overrides(a for a in rc.argv if arg_key(a) not in ignore and not arg_key(a).startswith("sweep."))
    selected = select_cells(spec, planned, cli)
    return SweepPlan(
        spec=spec,
        cells=selected,
        sweep_hash=identity_hash(identity),
        total=len(planned),
        identity=identity,
        every_cell=planned,
    )


def _resolve_cell(spec: SweepSpec, cell: Cell, argv: list[str], *, check: bool) -> ResolvedConfig:
    """The cell's full config, with the CLI's name and path checks (e.g. a misspelt prompt set in the cell)."""
    try:
        rc = resolve_config(argv, cell_overrides=cell.overrides)
        if check:
            from dspark.stages.experiment import preflight

            preflight(rc, claim=False)
        return rc
    except ConfigError as err:
        raise ConfigError(f"sweeps/{spec.name}.yaml cell '{cell.key}': {err}") from None


def check_one_device(spec: SweepSpec, pc: PlannedCell) -> None:
    """Cells run one by one in the sweep process: DDP would relaunch the whole sweep in every worker."""
    t = pc.rc.cfg.trainer
    if t.devices != 1 or t.num_nodes != 1 or "ddp" in t.strategy or "fsdp" in t.strategy:
        raise ConfigError(
            f"sweep={spec.name}: cells run one at a time on one device, but trainer.devices="
            f"{t.devices}, trainer.num_nodes={t.num_nodes}, trainer.strategy={t.strategy}. Drop "
            "those keys, or run a multi-device experiment without sweep=."
        )


def select_cells(spec: SweepSpec, planned: list[PlannedCell], cli: dict[str, Any]) -> list[PlannedCell]:
    """Keep the cells whose axis values agree with command-line values of axis keys."""
    kept = planned
    for key in [k for k in spec.axis_keys() if k in cli]:
        value = coerce_value(key, cli[key], where="command line")
        kept = [pc for pc in kept if key not in pc.cell.axes or pc.cell.axes[key] == value]
        if not kept:
            values = sorted({str(pc.cell.axes[key]) for pc in planned if key in pc.cell.axes})
            raise ConfigError(
                f"{key}={value} selects no cell of sweep {spec.name}: its {key} values are {', '.join(values)}."
            )
    return kept


def cell_record(pc: PlannedCell) -> dict[str, Any]:
    from dspark.stages.context import run_name, training_key

    return {
        "index": pc.cell.index,
        "cell": pc.cell.key,
        "axes": pc.cell.axes,
        "run_name": run_name(pc.rc.cfg),
        "training_key": training_key(pc.rc.cfg),
        "config": mask_tree(to_dict(pc.rc.cfg)),  # cells.yaml is recorded: no credential in it
    }


def execute_grid(plan: SweepPlan, *, rc: ResolvedConfig, store: TrackingStore, max_cells: int | None = None) -> int:
    """Run the plan's cells under one parent run (resuming it); write the report; return the exit code."""
    spec = plan.spec
    shared = sweep_lock(rc, plan.sweep_hash)
    with shared:  # a second process of this sweep finds the parent this one created, and imports nothing twice
        parent_id, reused = run_tree.open_parent(
            store,
            sweep=spec.name,
            sweep_hash=plan.sweep_hash,
            tags=parent_tags(rc, spec, total=plan.total, identity=plan.identity),
        )
        parent_id = settle_parent(store, parent_id, sweep=spec.name, sweep_hash=plan.sweep_hash, created=not reused)
        store.client.set_tag(parent_id, "sweep.cells", str(plan.total))  # a grown sweep has more cells
        out_dir = sweep_dir(rc, spec, plan.sweep_hash)
        sweep_runs.log_parent_record(
            store, parent_id, spec_text=spec.text, out_dir=out_dir, cells=[cell_record(pc) for pc in plan.cells]
        )
        ledger = ledger_of(rc, spec, plan.sweep_hash)
        import_ledger(
            store, parent_id, committed_ledger(rc, spec, plan.sweep_hash), sweep=spec.name, sweep_hash=plan.sweep_hash
        )
        import_ledger(store, parent_id, ledger, sweep=spec.name, sweep_hash=plan.sweep_hash)
    redo_dirty = committed_tree()
    states = cell_states(plan, run_tree.children(store, parent_id), redo_dirty=redo_dirty)
    done = states.done
    todo = plan.cells[:max_cells] if max_cells else plan.cells
    redo = [pc.cell.key for pc in todo if pc.cell.key in states.drifted]
    log.info(
        "sweep %s: %d of %d cells selected, %d already done, %d recorded under an older recipe (run again); "
        "parent run %s (%s)",
        spec.name,
        len(todo),
        plan.total,
        sum(pc.cell.key in done for pc in todo),
        len(redo),
        parent_id,
        "resumed" if reused else "new",
    )
    for key in redo:
        log.info(
            "sweep %s: cell %s was recorded under an older recipe (%s differ from today's): running it again",
            spec.name,
            key,
            ", ".join(states.drifted[key][1]),
        )
    print_runs_table(store, plan, budget=rc.cfg.budget)
    outcomes: list[sweep_runs.CellOutcome] = []
    attempt, current = "", ""
    try:
        for pc, claim in claimed_in_turn(rc, plan, todo, done, store=store, parent_id=parent_id):
            if claim is None:
                outcomes.append(sweep_runs.CellOutcome(key=pc.cell.key, status="SKIPPED", run_id=done[pc.cell.key]))
                continue
            attempt, current = uuid.uuid4().hex, pc.cell.key
            outcomes.append(
                run_claimed(
                    pc,
                    claim,
                    plan=plan,
                    store=store,
                    parent_id=parent_id,
                    attempt=attempt,
                    ledger=ledger,
                    shared=shared,
                    redo_dirty=redo_dirty,
                )
            )
            current = ""
    except (KeyboardInterrupt, SystemExit) as err:  # SystemExit: a cell that called sys.exit
        return interrupted(
            store,
            parent_id,
            attempt=attempt,
            cell=current,
            name=spec.name,
            outcomes=outcomes,
            kept=getattr(err, "kept", ""),
            out_dir=out_dir,
        )
    with shared:
        code = finish_sweep(rc, plan, store=store, parent_id=parent_id, outcomes=outcomes, out_dir=out_dir)
    print_runs_table(store, plan, budget=rc.cfg.budget)
    return code


#: the columns a sweep's runs table shows besides its axes (README: comparing a sweep in the MLflow UI)
SWEEP_COLUMNS = (
    "metrics.summary/tau",
    "metrics.eval/all/tau_prompt_mean",
    "metrics.val/tau_prob",
    "metrics.speed/speedup_prompt_mean",
)


def print_runs_table(store: TrackingStore, plan: SweepPlan, *, budget: str) -> None:
    """Print the URL of the sweep's cells in MLflow's runs table, with its axes and headline metrics as columns."""
    from dspark.tracking.ui import runs_table_url, ui_lines

    cells = run_tree.tag_filter(
        **{"sweep.name": plan.spec.name, "sweep.hash": plan.sweep_hash, "sweep.role": run_tree.CELL}
    )
    try:
        url = runs_table_url(
            store,
            filter_string=cells,
            columns=[f"params.{k}" for k in plan.spec.axis_keys()] + list(SWEEP_COLUMNS),
            view_name=f"sweep {plan.spec.name} {budget} {plan.sweep_hash}",
        )
    except Exception as err:  # a link is a convenience: never the end of a sweep
        log.warning("sweep %s: no MLflow link (%s)", plan.spec.name, err)
        return
    print("\n".join(ui_lines(store, url=url)))


def claimed_in_turn(
    rc: ResolvedConfig,
    plan: SweepPlan,
    todo: list[PlannedCell],
    done: dict[str, str],
    *,
    store: TrackingStore | None = None,
    parent_id: str | None = None,
) -> Iterator[tuple[PlannedCell, CellClaim | None]]:
    """The cells in the order this process runs them, each with its claim held (None: finished before we started).

    A cell another worker of this sweep holds is passed over, then waited for after the others: its claim is
    yielded once free, and `run_claimed` skips it if that worker finished it or runs it here if it died."""
    deferred = []
    worker = worker_id()
    for pc in todo:
        if pc.cell.key in done:
            yield pc, None
            continue
        claim = CellClaim(
            cell_claim(rc, plan.sweep_hash, pc.cell.index),
            StoreClaim(store.client, parent_id, pc.cell.index, worker) if store and parent_id else None,
        )
        if claim.try_acquire():
            yield pc, claim
            continue
        log.info(
            "sweep %s: cell %s is being run by another worker of this sweep; coming back to it",
            plan.spec.name,
            pc.cell.key,
        )
        deferred.append((pc, claim))
    for pc, claim in deferred:
        if not claim.try_acquire():
            log.info("sweep %s: waiting for another worker to finish cell %s", plan.spec.name, pc.cell.key)
            claim.acquire()
        yield pc, claim


class CellClaim:
    """The claim on one cell: a file lock for the processes of this machine (a dead process frees it at once) and a
    claim in the tracking store for workers on other machines sharing it (`dspark.tracking.claims`: a dead worker's
    claim goes stale)."""

    def __init__(self, lock: FileLock, shared: StoreClaim | None, *, poll: float = 5.0):
        self.lock, self.shared, self.poll = lock, shared, poll

    def try_acquire(self) -> bool:
        if not _try_acquire(self.lock):
            return False
        if self.shared is None or self.shared.try_acquire():
            return True
        self.lock.release()
        return False

    def acquire(self) -> None:
        while True:
            self.lock.acquire()
            if self.shared is None or self.shared.try_acquire():
                return
            self.lock.release()
            time.sleep(self.poll)

    def release(self) -> None:
        try:
            if self.shared is not None:
                self.shared.release()
        finally:
            self.lock.release()


def committed_tree() -> bool:
    """Whether this checkout has no uncommitted changes (then records made from a dirty tree are redone)."""
    from dspark.tracking import git_provenance

    state = git_provenance(repo_root())
    return state.get("git.dirty") == "False" and state.get("git.commit", "unknown") != "unknown"


def settle_parent(store: TrackingStore, parent_id: str, *, sweep: str, sweep_hash: str, created: bool) -> str:
    """Workers on two machines that created this sweep's parent at the same moment agree on the oldest; a parent
    this worker created and lost is deleted (it has no cells yet)."""
    parents = run_tree.search_all(
        store, run_tree.tag_filter(**{"sweep.name": sweep, "sweep.hash": sweep_hash, "sweep.role": run_tree.PARENT})
    )
    if len(parents) < 2:
        return parent_id
    keep = oldest_run(parents).info.run_id
    if created and keep != parent_id:
        store.client.delete_run(parent_id)
    return keep


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


def run_claimed(
    pc: PlannedCell,
    claim: CellClaim,
    *,
    plan: SweepPlan,
    store: TrackingStore,
    parent_id: str,
    attempt: str,
    ledger: Path | None,
    shared: FileLock,
    redo_dirty: bool = False,
) -> sweep_runs.CellOutcome:
    """Run a cell whose claim this process holds (and release it): skipped when another process finished it
    meanwhile; attempts left RUNNING by a dead process are closed first; a finished cell is recorded at once."""
    try:
        existing = run_tree.children(store, parent_id)
        done = cell_states(plan, existing, redo_dirty=redo_dirty).done
        if pc.cell.key in done:
            return sweep_runs.CellOutcome(key=pc.cell.key, status="SKIPPED", run_id=done[pc.cell.key])
        run_tree.close_stale(store, existing, cell=pc.cell.key)  # we hold the claim: any RUNNING attempt is dead
        outcome = run_cell(pc, plan=plan, store=store, parent_id=parent_id, attempt=attempt)
        if outcome.status == "FINISHED":  # recorded at once: a session that ends mid-sweep keeps it
            with shared:
                record_ledger(store, parent_id, ledger, plan=plan)
        release_freed_memory()  # the next cell starts from a trimmed heap (`dspark.hardware`)
        return outcome
    finally:
        claim.release()


def run_cell(
    pc: PlannedCell, *, plan: SweepPlan, store: TrackingStore, parent_id: str, attempt: str
) -> sweep_runs.CellOutcome:
    """One cell in its own child run; exceptions become a FAILED cell, never the end of the sweep."""
    spec, cell = plan.spec, pc.cell
    started = time.perf_counter()
    tags = run_tree.cell_tags(
        sweep=spec.name,
        sweep_hash=plan.sweep_hash,
        paper_ref=spec.paper_ref,
        index=cell.index,
        key=cell.key,
        axes=cell.axes,
        attempt=attempt,
    )
    runner = cell_runner(spec)
    log.info("sweep %s: cell %d/%d %s", spec.name, cell.index + 1, plan.total, cell.key)
    work_start = time.perf_counter()
    try:
        code = runner(pc.rc, parent_run_id=parent_id, extra_tags=tags)
    except Exception as err:  # the cell fails, the sweep goes on; the traceback goes to the log
        log.exception("sweep %s: cell %s raised", spec.name, cell.key)
        print(f"error: cell {cell.key}: {type(err).__name__}: {mask_text(str(err))}", file=sys.stderr)
        code = 1
    work = time.perf_counter() - work_start
    run_id = run_tree.settle_attempt(store, attempt, ok=code == 0, label=cell.key)
    if code == 0 and run_id and spec.runner == "experiment":
        backfill_training_metrics(store, run_id, pc.rc)
    status = "FINISHED" if code == 0 else "FAILED"
    return sweep_runs.CellOutcome(
        key=cell.key, status=status, run_id=run_id, seconds=time.perf_counter() - started, work_seconds=work
    )


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
            return run_latency_cell(
                rc, parent_run_id=parent_run_id, extra_tags=extra_tags, options=spec.latency_options(rc.cfg.budget)
            )

        return latency
    from dspark.stages.experiment import run_experiment

    return run_experiment


def interrupted(
    store: TrackingStore,
    parent_id: str,
    *,
    attempt: str,
    cell: str,
    name: str,
    outcomes: list[sweep_runs.CellOutcome],
    kept: str,
    out_dir: Path,
) -> int:
    """Ctrl-C: the running cell (unless it had completed) and the parent become KILLED, the outcomes so far are
    logged, one line says what was kept; the next run of the same command resumes."""
    if cell:
        run = run_tree.find_attempt(store, attempt)
        if run is not None and run.data.tags.get(run_tree.COMPLETE_TAG) != "true":
            store.finish(run.info.run_id, status="KILLED")  # whatever Lightning's logger set (FAILED) before
        outcomes = outcomes + [
            sweep_runs.CellOutcome(key=cell, status="KILLED", run_id=run.info.run_id if run is not None else None)
        ]
    sweep_runs.log_outcomes(store, parent_id, outcomes, out_dir=out_dir)
    store.finish(parent_id, status="KILLED")
    finished = sum(o.status in ("FINISHED", "SKIPPED") for o in outcomes)
    running = f"; cell {cell} is marked KILLED" + (f" (kept: {kept})" if kept else "") if cell else ""
    print(
        f"sweep {name} interrupted: {finished} finished cells are kept{running}. Rerun the same command to resume "
        "(finished cells are skipped).",
        file=sys.stderr,
    )
    return 130


def finish_sweep(
    rc: ResolvedConfig,
    plan: SweepPlan,
    *,
    store: TrackingStore,
    parent_id: str,
    outcomes: list[sweep_runs.CellOutcome],
    out_dir: Path,
) -> int:
    """Log outcomes, write the report, close the parent; 0 when every cell passed."""
    failed = [o.key for o in outcomes if o.status == "FAILED"]
    sweep_runs.log_outcomes(store, parent_id, outcomes, out_dir=out_dir)
    record_ledger(store, parent_id, ledger_of(rc, plan.spec, plan.sweep_hash), plan=plan)
    code = 1 if failed else 0
    try:
        from dspark.files import ForeignOutputError
        from dspark.reports import NoFinishedRuns, write_sweep_report

        states = cell_states(plan, run_tree.children(store, parent_id))
        path = write_sweep_report(
            rc, plan.spec, store=store, parent_id=parent_id, run_ids=states.run_ids, drift=states.drift
        )
        print(f"report: {path}")
    except (NoFinishedRuns, ForeignOutputError) as err:
        print(f"sweep {plan.spec.name}: no report written: {mask_text(str(err))}", file=sys.stderr)
        code = 1
    except Exception as err:  # a broken report must not hide the cells' results, but it fails the command
        log.exception("sweep %s: report failed", plan.spec.name)
        print(f"error: report for sweep {plan.spec.name}: {type(err).__name__}: {mask_text(str(err))}", file=sys.stderr)
        code = 1
    store.finish(parent_id, status="FAILED" if failed else "FINISHED")
    if failed:
        print(
            f"sweep {plan.spec.name}: {len(failed)} of {len(outcomes)} cells failed: {'; '.join(failed)}",
            file=sys.stderr,
        )
    return code


def sweep_hash_of(rc: ResolvedConfig, spec: SweepSpec) -> str:
    """The sweep hash this command line runs under (`stage=report` itself ignored): the parent a report reads."""
    if spec.kind == "optuna":
        from dspark.sweeps.optuna_search import search_hash

        return search_hash(rc, spec, ignore=("stage",))
    return plan_grid(rc, spec, ignore=("stage",), check=False).sweep_hash


def report_sweep(rc: ResolvedConfig, spec: SweepSpec) -> int:
    """`sweep=NAME stage=report`: regenerate the report without running anything.

    A grid sweep's ledgers are read first: cells the store lacks are imported (under the parent of this identity,
    created FINISHED if the store has none), so a fresh checkout regenerates the report from the record. Exit 2 when
    no cell has finished (nothing is written: an existing report is never replaced by an empty one)."""
    from dspark.files import ForeignOutputError
    from dspark.reports import NoFinishedRuns, write_sweep_report
    from dspark.tracking import open_store

    try:
        store = open_store(rc.cfg)
        if spec.kind == "optuna":
            digest, plan = sweep_hash_of(rc, spec), None
            parent_id = None
        else:
            plan = plan_grid(rc, spec, ignore=("stage",), check=False)
            digest = plan.sweep_hash
            parent_id = _report_parent(rc, spec, plan, store=store)
    except (ConfigError, cell_ledger.LedgerError) as err:
        print(f"error: {mask_text(str(err))}", file=sys.stderr)
        return 2
    try:
        if plan is None:
            path = write_sweep_report(rc, spec, store=store, sweep_hash=digest)
        else:
            states = cell_states(plan, run_tree.children(store, parent_id)) if parent_id else CellStates({}, {})
            path = write_sweep_report(
                rc,
                spec,
                store=store,
                parent_id=parent_id,
                run_ids=states.run_ids,
                drift=states.drift,
                sweep_hash=digest,
            )
    except (NoFinishedRuns, ForeignOutputError) as err:  # nothing to report, or a report file we did not write
        print(f"error: {mask_text(str(err))}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def _report_parent(rc: ResolvedConfig, spec: SweepSpec, plan: SweepPlan, *, store: TrackingStore) -> str | None:
    """The parent of this identity, with the cells of its ledgers imported (created when only a ledger has them)."""
    ledgers = [
        p
        for p in (committed_ledger(rc, spec, plan.sweep_hash), ledger_of(rc, spec, plan.sweep_hash, check=True))
        if p is not None and p.exists()
    ]
    parent = run_tree.find_parent(store, sweep=spec.name, sweep_hash=plan.sweep_hash)
    if parent is None and not ledgers:
        return None
    with sweep_lock(rc, plan.sweep_hash):
        if parent is None:
            parent_id, _ = run_tree.open_parent(
                store,
                sweep=spec.name,
                sweep_hash=plan.sweep_hash,
                tags=parent_tags(rc, spec, total=plan.total, identity=plan.identity) | ledger_provenance(ledgers[0]),
            )
            store.finish(parent_id)
        else:
            parent_id = parent.info.run_id
        for path in ledgers:
            import_ledger(store, parent_id, path, sweep=spec.name, sweep_hash=plan.sweep_hash)
        if rc.cfg.tracking.sweep_ledger:
            record_ledger(store, parent_id, ledger_of(rc, spec, plan.sweep_hash), plan=plan)
    return parent_id


def ledger_provenance(path: Path) -> dict[str, str]:
    """Parent tags that describe the recorded cells rather than this checkout: the command from the identity, the
    commit most cells ran at (dirty when any of them was). A report regenerated from a ledger then says the same on
    every machine and at every later commit."""
    data = cell_ledger.load_ledger(path) or {}
    identity = data.get("identity") or {}
    command = sweep_command(
        [f"sweep={data.get('sweep')}", f"budget={identity.get('budget')}", *(identity.get("overrides") or [])]
    )
    commits: dict[str, int] = {}
    for cell in data.get("cells") or []:
        commit = cell["tags"].get("git.commit", "–")
        commits[commit] = commits.get(commit, 0) + 1
    dirty = any(c["tags"].get("git.dirty") == "True" for c in data.get("cells") or [])
    commit = max(commits, key=lambda c: (commits[c], c)) if commits else "–"
    return {
        "command": command,
        "git.commit": commit,
        "git.dirty": str(dirty),
        "machine": "",
        "target": _first_tag(data, "target"),
        "budget": str(identity.get("budget", "–")),
    }


def _first_tag(data: dict[str, Any], name: str) -> str:
    return next((c["tags"][name] for c in data.get("cells") or [] if name in c["tags"]), "–")


def regenerate_from_ledger(
    ledger: Path, *, out_dir: Path, work_dir: Path, now: datetime.datetime | None = None
) -> Path:
    """Rebuild a sweep's report from its ledger alone: import the cells into a throwaway store under `work_dir`,
    write `<out_dir>/<sweep>.md`, its figures and `<sweep>.claims.json`; returns the report's path.

    The ledger's identity gives the command (sweep, budget, overrides); the report is deterministic apart from its
    `generated:` line, so a fresh clone regenerates the committed report byte for byte. LedgerError / ConfigError
    name the file and the fix."""
    from dspark.reports import write_sweep_report
    from dspark.tracking import open_store

    ledger = Path(ledger)
    data = cell_ledger.load_ledger(ledger)
    if data is None:
        raise cell_ledger.LedgerError(f"{ledger}: no such ledger")
    identity = data["identity"]
    argv = [
        f"sweep={data['sweep']}",
        f"budget={identity['budget']}",
        *identity.get("overrides", []),
        "stage=report",
        f"paths.root={Path(work_dir)}",
        f"paths.reports={Path(out_dir)}",
        "tracking.uri=",
        "tracking.sweep_ledger=true",
    ]
    rc = resolve_config(argv)
    spec = load_sweep(data["sweep"])
    plan = plan_grid(rc, spec, ignore=("stage",), check=False)
    store = open_store(rc.cfg)
    digest = data["sweep_hash"]  # the recorded identity's, even when today's recipe version names another
    parent_id, _ = run_tree.open_parent(
        store,
        sweep=spec.name,
        sweep_hash=digest,
        tags=parent_tags(rc, spec, total=plan.total, identity=identity) | ledger_provenance(ledger),
    )
    cell_ledger.import_cells(store, parent_id, ledger, sweep=spec.name, sweep_hash=digest)
    store.finish(parent_id)
    states = cell_states(plan, run_tree.children(store, parent_id))
    return write_sweep_report(
        rc,
        spec,
        store=store,
        parent_id=parent_id,
        run_ids=states.run_ids,
        drift=states.drift,
        now=now,
        attach=False,
        notes_dir=ledger.parent,
    )
