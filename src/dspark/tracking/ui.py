"""Where to look at runs in the MLflow UI: the URL of an experiment's runs table in the model-training view, and, for
a sqlite / file store (which has no server of its own), the `mlflow ui` command that serves it.

The URL format is MLflow 3's (checked against the UI bundle of the installed 3.17, `mlflow/server/js/build`):

    <server>/#/experiments/<experiment id>/runs?workflowType=machine_learning[&searchFilter=<filter>]
    <server>/#/experiments/<experiment id>/runs?workflowType=machine_learning&viewStateShareKey=<key>

- `/runs` is the runs-table tab (`Routes.getExperimentPageTabRoute(id, "runs")`);
- `workflowType=machine_learning` is the model-training view; without it the UI takes the browser's last choice,
  "genai" at first, whose experiment page opens on the GenAI overview;
- `searchFilter` is one of the search facets the page reads from the URL (an MLflow `search_runs` filter);
- `viewStateShareKey=K` loads a view (search facets and table columns) saved in the experiment tag
  `mlflow.sharedViewState.K` as a saved-view envelope `{name, createdAt, updatedAt, state: "<JSON>"}`. It is the
  only way a link can choose columns (the table shows none of the params or metrics by default), and the UI lists
  the view by name among the experiment's saved views. The page ignores it when the URL carries a search facet too,
  so a shared view keeps its filter inside.

Credentials never leave here: a link to a server loses `user:password@`, any other URI shown has its credentials
masked (`dspark.config.secrets`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from dspark.config.secrets import mask_arg, mask_url, split_credentials

# `store` arguments are `dspark.tracking.store.TrackingStore`s (uri, experiment_id, client); store.py imports this
# module, so the type stays a name here
TrackingStore = Any

LOCAL_UI = "http://127.0.0.1:5000"  # what `mlflow ui` serves by default (--host 127.0.0.1 --port 5000)
TRAINING_VIEW = "machine_learning"  # workflowType of the model-training view ("genai" is the other)
SHARED_VIEW_TAG = "mlflow.sharedViewState."
COLUMN_KINDS = ("attributes", "params", "metrics", "tags")


def public_uri(uri: str) -> str:
    """`uri` as printed or written: its credentials masked (`dspark.config.secrets.mask_url`)."""
    return mask_url(uri)


def public_command(argv: Sequence[str]) -> str:
    """A command line as runs, ledgers and reports record it: without `paths.*` (a machine's directories: what runs
    write is relative to paths.root) and with every argument's credentials masked (`mask_arg`)."""
    kept = [mask_arg(arg) for arg in argv if not ("=" in arg and arg.partition("=")[0].strip().startswith("paths."))]
    return " ".join(["python experiments/run.py", *kept])


def is_server_uri(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def ui_base(uri: str) -> str:
    """The UI's address: the tracking server itself for an http(s) URI (without credentials), else the local
    `mlflow ui` that `ui_command` starts."""
    if is_server_uri(uri):
        return split_credentials(uri)[0].rstrip("/")
    return LOCAL_UI


def ui_command(uri: str) -> str:
    """`mlflow ui --backend-store-uri <uri>` with the mlflow of this interpreter's environment (a database password
    shown as ***)."""
    mlflow = Path(sys.executable).parent / "mlflow"
    exe = "mlflow"
    if mlflow.exists():
        relative = os.path.relpath(mlflow)
        exe = relative if not relative.startswith("..") else str(mlflow)
    return f"{exe} ui --backend-store-uri {shlex.quote(public_uri(uri))}"


def ui_column(name: str) -> str:
    """`params.model.depth` → the runs table's column id ``params.`model.depth` ``; kinds: attributes, params,
    metrics, tags."""
    kind, _, key = name.partition(".")
    if kind not in COLUMN_KINDS or not key:
        raise ValueError(
            f"column {name!r}: write KIND.KEY with KIND one of {', '.join(COLUMN_KINDS)} "
            "(e.g. params.model.depth, metrics.summary/tau)"
        )
    return f"{kind}.`{key}`"


def _fragment(store: TrackingStore, params: dict[str, str]) -> str:
    query = urlencode({"workflowType": TRAINING_VIEW} | params, quote_via=quote)
    return f"{ui_base(store.uri)}/#/experiments/{store.experiment_id}/runs?{query}"


def runs_table_url(
    store: TrackingStore,
    *,
    filter_string: str | None = None,
    columns: Sequence[str] | None = None,
    view_name: str | None = None,
) -> str:
    """The URL of the store's runs table in the model-training view, filtered by `filter_string` (an MLflow
    search filter, e.g. ``tags.`sweep.name` = 'depth'``). With `columns` (`params.…`, `metrics.…`, `tags.…`),
    the filter and those columns are saved as a shared view of the experiment (named `view_name`, default the
    filter) and the URL opens it; if the store refuses the tag, the URL carries the filter alone."""
    if columns:
        key = share_view(
            store, filter_string=filter_string or "", columns=columns, name=view_name or filter_string or "dspark runs"
        )
        if key:
            return _fragment(store, {"viewStateShareKey": key})
    return _fragment(store, {"searchFilter": filter_string} if filter_string else {})


def run_url(store: TrackingStore, run_id: str) -> str:
    """The URL of one run's page (`#/experiments/<id>/runs/<run id>`) in the model-training view."""
    query = urlencode({"workflowType": TRAINING_VIEW})
    return f"{ui_base(store.uri)}/#/experiments/{store.experiment_id}/runs/{run_id}?{query}"


def view_state(*, filter_string: str, columns: Sequence[str]) -> dict:
    """The view the UI restores from a share key: search facets and runs-table state (the UI's own key names)."""
    return {
        "searchFilter": filter_string,
        "orderByKey": "attributes.start_time",
        "orderByAsc": False,
        "selectedColumns": [ui_column(c) for c in columns],
        "runsHiddenMode": "SHOW_ALL",
    }


def share_view(store: TrackingStore, *, filter_string: str, columns: Sequence[str], name: str) -> str | None:
    """Save the view as the experiment tag `mlflow.sharedViewState.<key>` (once: the key is a digest of the view)
    and return the key; None when the store refuses (e.g. no permission on a shared server)."""
    state = json.dumps(view_state(filter_string=filter_string, columns=columns), sort_keys=True)
    key = "dspark-" + hashlib.sha1(f"{name}\n{state}".encode()).hexdigest()[:12]
    tag = SHARED_VIEW_TAG + key
    try:
        if tag in store.client.get_experiment(store.experiment_id).tags:
            return key
        now = int(time.time() * 1000)
        envelope = {"name": name, "createdAt": now, "updatedAt": now, "state": state}
        store.client.set_experiment_tag(store.experiment_id, tag, json.dumps(envelope))
    except Exception:  # noqa: BLE001 — a link without columns is still a link; never fail a run for it
        return None
    return key


def ui_lines(store: TrackingStore, *, url: str) -> list[str]:
    """What to print for `url`: the URL and, for a local store, the command that serves it first."""
    if is_server_uri(store.uri):
        return [f"MLflow runs table: {url}"]
    return [f"MLflow runs table: {url}", f"  (start the UI first: {ui_command(store.uri)})"]
