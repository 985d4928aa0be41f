"""A tracking store that cannot be used fails fast, in seconds, with one error naming `tracking.uri` (or `paths.root`
for the default store), the cause and the fix (`dspark.tracking.probe`); and a plain run that a killed process left
RUNNING is closed at the next start, never a live one (`dspark.tracking.processes`)."""

from __future__ import annotations

import http.server
import os
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dspark.config import ConfigError, resolve_config
from dspark.tracking import probe
from dspark.tracking.probe import check_store


def _cfg(root: Path, *args: str):
    return resolve_config([f"paths.root={root}", "budget=smoke", *args]).cfg


def _refused(root: Path, *args: str) -> str:
    """The ConfigError of resolving and probing (config validation may refuse a value first)."""
    probe._probed.clear()  # each case probes afresh
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        check_store(_cfg(root, *args))
    assert time.monotonic() - started < 20, "the probe must fail in seconds"
    return str(err.value)


def _sqlite_file(path: Path, *, rows: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (x TEXT)")
        db.executemany("INSERT INTO t VALUES (?)", [("x" * 500,)] * rows)
    return path


def test_a_read_only_store_is_refused_naming_tracking_uri_and_the_fix(tmp_path):
    database = _sqlite_file(tmp_path / "ro" / "mlflow.db")
    database.chmod(0o444)
    try:
        message = _refused(tmp_path / "root", f"tracking.uri=sqlite:///{database}")
    finally:
        database.chmod(0o644)
    assert f"tracking.uri=sqlite:///{database}" in message and "read-only" in message
    assert "writable" in message


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda db: db.write_bytes(b"this is not an sqlite database\n" * 64), "not a database"),
        (lambda db: db.write_bytes(_sqlite_file(db.with_suffix(".src"), rows=400).read_bytes()[:40_000]), "cut short"),
        (lambda db: db.mkdir(), "not a file"),
    ],
    ids=["garbage", "half-copied", "a-directory"],
)
def test_a_damaged_default_store_is_refused_naming_paths_root(tmp_path, damage, needle):
    root = tmp_path / "root"
    root.mkdir()
    damage(root / "mlflow.db")
    before = sorted(p.name for p in root.iterdir())
    message = _refused(root)
    assert f"paths.root={root}" in message and needle in message
    assert "move it aside" in message and "set paths.root to a new directory" in message
    assert sorted(p.name for p in root.iterdir()) == before  # nothing created beside it


@pytest.mark.parametrize(
    "args, needle",
    [
        (["tracking.experiment="], "tracking.experiment='' is empty"),
        (["tracking.experiment=' '"], "is empty"),
        (["tracking.experiment=" + "x" * 600], "is 600 characters long (at most 255)"),
        (["tracking.experiment=a\tb"], "control character"),
        (["tracking.uri=ftp://127.0.0.1/mlruns"], "tracking.uri=ftp://127.0.0.1/mlruns is not a tracking store"),
        (["tracking.uri=mlruns"], "tracking.uri=mlruns is not a tracking store"),
        (["tracking.uri=sqlite:////no/such/dir/mlflow.db"], "no such directory: /no/such/dir"),
        (["tracking.uri=http://u:Pw-999@127.0.0.1:9"], "tracking.uri=http://u:***@127.0.0.1:9 is unreachable"),
    ],
)
def test_names_and_uris_the_store_cannot_take_are_refused_with_the_key(tmp_path, args, needle):
    message = _refused(tmp_path / "root", *args)
    assert needle in message and "Pw-999" not in message
    assert not Path("/no/such/dir").exists()


class _HalfServer(http.server.BaseHTTPRequestHandler):
    """/health answers 200; every API call answers 500 (a server whose backend store is broken)."""

    calls = 0

    def _answer(self) -> None:
        ok = self.path.startswith("/health")
        _HalfServer.calls += not ok
        body = b"OK" if ok else b'{"error_code": "INTERNAL_ERROR", "message": "broken backend"}'
        self.send_response(200 if ok else 500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


def test_a_server_that_answers_health_but_fails_its_api_is_refused_in_seconds(tmp_path):
    """MLflow's client retries a 500 seven times with backoff (minutes of silence); the probe turns retries off."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HalfServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        message = _refused(tmp_path / "root", f"tracking.uri={url}")
    finally:
        server.shutdown()
        server.server_close()
    assert f"tracking.uri={url}" in message and "answers /health but its API failed" in message
    assert _HalfServer.calls == 1  # no retry
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ or os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] != "0"


@pytest.fixture(scope="module")
def store_root(tmp_path_factory) -> Path:
    """A real sqlite store (MLflow's migrations take seconds: made once for the module)."""
    from dspark.tracking import open_store

    root = tmp_path_factory.mktemp("store")
    open_store(_cfg(root))
    return root


def test_a_good_store_is_probed_once_and_a_new_one_is_not_created(store_root, tmp_path):
    probe._probed.clear()
    check_store(_cfg(store_root))
    assert (f"sqlite:///{store_root.resolve() / 'mlflow.db'}", "dspark-lab") in probe._probed
    check_store(_cfg(tmp_path / "fresh"))  # nothing to open yet: the run creates it
    assert not (tmp_path / "fresh" / "mlflow.db").exists()


def test_a_deleted_experiment_is_refused_with_the_restore_command(store_root):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{store_root / 'mlflow.db'}")
    client.delete_experiment(client.create_experiment("gone"))
    message = _refused(store_root, "tracking.experiment=gone")
    assert "tracking.experiment=gone was deleted" in message and "mlflow experiments restore" in message


# ---- a plain run left RUNNING by a killed process ----


def _run(store, name: str, **tags: str) -> str:
    from dspark.tracking.processes import process_tags

    return store.create_run(run_name=name, tags=process_tags() | tags)


def _status(store, run_id: str) -> str:
    return store.client.get_run(run_id).info.status


def test_runs_of_dead_processes_are_closed_and_live_ones_are_left_running(store_root):
    """Dead: a reaped pid, a zombie, a pid now held by another process (start time differs). Left alone: a live
    process, a run from another machine or container (its pid means nothing here), a sweep's cell (its driver
    closes it), and a finished run."""
    from dspark.tracking import open_store
    from dspark.tracking.processes import NOTE_TAG, close_dead_runs, process_started

    store = open_store(_cfg(store_root, "tracking.experiment=stale"))
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    zombie = subprocess.Popen(["true"])
    live = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.5)  # the zombie has exited
        dead = {
            "reaped": _run(store, "reaped", **{"process.pid": str(reaped.pid), "process.started": ""}),
            "zombie": _run(store, "zombie", **{"process.pid": str(zombie.pid)}),
            "reused": _run(store, "reused", **{"process.pid": str(live.pid), "process.started": "1"}),
        }
        alive = {
            "live": _run(store, "live", **{"process.pid": str(live.pid), "process.started": process_started(live.pid)}),
            "elsewhere": _run(store, "elsewhere", **{"process.pid": str(reaped.pid), "process.space": "other host"}),
            "cell": _run(store, "cell", **{"process.pid": str(reaped.pid), "sweep.role": "cell"}),
        }
        finished = _run(store, "finished", **{"process.pid": str(reaped.pid)})
        store.finish(finished)
        assert sorted(close_dead_runs(store)) == sorted(dead.values())
    finally:
        live.kill()
        live.wait()
        zombie.wait()
    for run_id in dead.values():
        assert _status(store, run_id) == "KILLED"
        note = store.client.get_run(run_id).data.tags[NOTE_TAG]
        assert "ended without closing the run" in note
    assert {name: _status(store, run_id) for name, run_id in alive.items()} == dict.fromkeys(alive, "RUNNING")
    assert _status(store, finished) == "FINISHED"


def test_the_next_plain_run_closes_a_killed_one(store_root, monkeypatch, capsys):
    """run_experiment's start does it: a run tagged with a pid that is gone is KILLED before the new run is made."""
    import dspark.stages.experiment as experiment
    from dspark.tracking import open_store

    cfg_args = ["tracking.experiment=next-start", "stage=prepare"]
    store = open_store(_cfg(store_root, *cfg_args))
    gone = subprocess.Popen(["true"])
    gone.wait()
    killed = _run(store, "killed", **{"process.pid": str(gone.pid)})
    monkeypatch.setattr(experiment, "run_stages", lambda ctx: None)  # the start is what is tested
    assert experiment.run_experiment(resolve_config([f"paths.root={store_root}", "budget=smoke", *cfg_args])) == 0
    assert _status(store, killed) == "KILLED"
    runs = store.client.search_runs([store.experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "KILLED"]
    assert {r.data.tags["process.pid"] for r in runs if r.info.status == "FINISHED"} == {str(os.getpid())}
