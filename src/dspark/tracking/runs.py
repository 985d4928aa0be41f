"""The run tree of a sweep in MLflow: one parent per (sweep name, sweep-config hash), one child per cell or trial.

Nesting is the `mlflow.parentRunId` tag (PLATFORM_NOTES "MLflow"); everything else is a flat tag so that the UI
groups and `search_runs` filters stay trivial:

    parent: sweep.name, sweep.hash, sweep.role=parent, sweep.kind, paper.ref, budget, target, command, git.*
    child:  sweep.name, sweep.hash, sweep.role=cell, cell, cell.index, axis.<key>, seed, paper.ref,
            sweep.attempt (unique per attempt, to find the run the stages created), sweep.complete=true when
            every stage of the cell returned successfully.

Names lead with what tells runs apart, since the UI's name column shows a name's start: a parent is
`sweep-<name> <budget> <hash>`, a child `<axis values> · <run name>` (`model.depth=3 seed=1 · dspark-markov-d3-g7-s1`).

A cell counts as done only with status FINISHED *and* `sweep.complete=true`: Lightning's MLFlowLogger marks a run
FINISHED when training ends, so a process killed during evaluation would otherwise look finished. The sweep driver
writes this tree and reports read it; neither needs the other.
"""

from __future__ import annotations

from typing import Any, Iterable

from dspark.tracking.store import TrackingStore

PARENT, CELL = "parent", "cell"
COMPLETE_TAG = "sweep.complete"
ACTIVE = ("RUNNING", "SCHEDULED")


def _quote(value: str) -> str:
    return "'" + str(value).replace("'", "\\'") + "'"


def tag_filter(**tags: str) -> str:
    """An MLflow filter string matching every `key=value` tag (keys may contain dots)."""
    return " and ".join(f"tags.`{k}` = {_quote(v)}" for k, v in tags.items())


def search_all(store: TrackingStore, filter_string: str, *, order_by: list[str] | None = None) -> list[Any]:
    """Every run of the store's experiment matching the filter (all result pages)."""
    runs, token = [], None
    while True:
        page = store.client.search_runs(
            [store.experiment_id], filter_string=filter_string, max_results=1000, order_by=order_by, page_token=token
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def find_parent(store: TrackingStore, *, sweep: str, sweep_hash: str | None = None) -> Any | None:
    """The newest parent run of `sweep` (with this config hash when given), or None."""
    tags = {"sweep.name": sweep, "sweep.role": PARENT} | ({"sweep.hash": sweep_hash} if sweep_hash else {})
    runs = search_all(store, tag_filter(**tags), order_by=["attributes.start_time DESC"])
    return runs[0] if runs else None


def parent_name(*, sweep: str, sweep_hash: str, budget: str | None) -> str:
    """`sweep-depth cpu-ref 1a2b3c4d5e6f`: the sweep, its budget and its config hash, what tells parents apart."""
    return " ".join(part for part in (f"sweep-{sweep}", budget, sweep_hash) if part)


def cell_run_name(label: str, name: str) -> str:
    """`model.depth=3 seed=1 · dspark-markov-d3-g7-s1`: a cell's axis values first, where the UI column shows them."""
    return f"{label} · {name}" if name else label


def open_parent(store: TrackingStore, *, sweep: str, sweep_hash: str, tags: dict[str, str]) -> tuple[str, bool]:
    """Reuse the parent of this sweep + hash (set RUNNING again) or create it; returns (run id, reused). Its name is
    `parent_name` (budget from tags["budget"]); a reused parent of an older naming is renamed."""
    name = parent_name(sweep=sweep, sweep_hash=sweep_hash, budget=tags.get("budget"))
    parent = find_parent(store, sweep=sweep, sweep_hash=sweep_hash)
    if parent is not None:
        rename = {"name": name} if parent.info.run_name != name else {}
        store.client.update_run(parent.info.run_id, status="RUNNING", **rename)
        return parent.info.run_id, True
    tags = tags | {"sweep.name": sweep, "sweep.hash": sweep_hash, "sweep.role": PARENT}
    return store.create_run(run_name=name, tags=tags), False


def children(store: TrackingStore, parent_id: str) -> list[Any]:
    return search_all(store, tag_filter(**{"mlflow.parentRunId": parent_id}))


def done_cells(runs: Iterable[Any]) -> dict[str, str]:
    """cell key → run id of the children that completed (FINISHED and tagged complete)."""
    return {
        r.data.tags["cell"]: r.info.run_id
        for r in runs
        if r.info.status == "FINISHED" and r.data.tags.get(COMPLETE_TAG) == "true" and "cell" in r.data.tags
    }


def find_attempt(store: TrackingStore, attempt: str) -> Any | None:
    runs = search_all(store, tag_filter(**{"sweep.attempt": attempt}))
    return runs[0] if runs else None


def close_stale(store: TrackingStore, runs: Iterable[Any], *, cell: str) -> None:
    """Mark earlier attempts of `cell` that were left RUNNING (an interrupted process) as KILLED."""
    for run in runs:
        if run.data.tags.get("cell") == cell and run.info.status in ACTIVE:
            store.finish(run.info.run_id, status="KILLED")


def cell_tags(
    *, sweep: str, sweep_hash: str, paper_ref: str, index: int, key: str, axes: dict[str, Any], attempt: str
) -> dict[str, str]:
    """The flat tags of one cell's child run."""
    tags = {
        "sweep.name": sweep,
        "sweep.hash": sweep_hash,
        "sweep.role": CELL,
        "cell": key,
        "cell.index": str(index),
        "paper.ref": paper_ref,
        "sweep.attempt": attempt,
    }
    return tags | {f"axis.{k}": str(v) for k, v in axes.items()}


def settle_attempt(store: TrackingStore, attempt: str, *, ok: bool, label: str | None = None) -> str | None:
    """After a cell returned: tag its run complete, or make sure it is FAILED; returns its run id.

    `label` (the cell's axis values) leads the run name (`cell_run_name`) unless it already does: the UI's name
    column shows a name's start, and cells differing only in decode.* would otherwise share one name."""
    run = find_attempt(store, attempt)
    if run is None:
        return None
    run_id = run.info.run_id
    if label and not (run.info.run_name or "").startswith(label):
        store.client.update_run(run_id, name=cell_run_name(label, run.info.run_name or ""))
    if ok:
        store.client.set_tag(run_id, COMPLETE_TAG, "true")
        if run.info.status != "FINISHED":
            store.finish(run_id)
    elif run.info.status in ACTIVE or run.info.status == "FINISHED":
        store.finish(run_id, status="FAILED")
    return run_id
