"""Credentials are never recorded (`dspark.config.secrets`): the masking rules on their own, the probe that must
send the real credentials, and a smoke sweep against MLflow's tracking server whose URL carries a password, after
which no file, no MLflow param, tag or artifact, and nothing on the console holds it."""

from __future__ import annotations

import base64
import contextlib
import http.server
import logging
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dspark.config import ConfigError
from dspark.config.secrets import credentials, mask_arg, mask_text, mask_tree, mask_url, remember, split_credentials
from dspark.tracking.store import check_reachable
from dspark.tracking.ui import public_command, ui_base


@pytest.mark.parametrize(
    "value, masked",
    [
        ("http://u:pw@h:5000", "http://u:***@h:5000"),
        ("https://alice:s3cret@mlflow.example.org:8443/prefix/", "https://alice:***@mlflow.example.org:8443/prefix/"),
        ("postgresql://me:hunter2@db.example/optuna", "postgresql://me:***@db.example/optuna"),
        ("postgresql+psycopg2://u:p@ss@host:5432/db", "postgresql+psycopg2://u:***@host:5432/db"),  # '@' unencoded
        ("postgresql://u:pa/ss@host/db", "postgresql://u:***@host/db"),  # '/' unencoded
        ("mysql://u:p?x#y@host/db", "mysql://u:***@host/db"),  # '?' and '#' unencoded
        ("postgresql://u:pa ss@host/db", "postgresql://u:***@host/db"),  # a space: the value is one address
        ("redis://:pw@host:6379", "redis://:***@host:6379"),
        ("https://TOKEN@github.com/org/repo", "https://***@github.com/org/repo"),  # a token as the user name
        ("http://u:p@[::1]:5000/", "http://u:***@[::1]:5000/"),
        ("http://h/?token=abc&x=1#sig=q", "http://h/?token=***&x=1#sig=***"),
        ("http://h:1/x?api_key=Q&apiKey=R&sslpassword=S", "http://h:1/x?api_key=***&apiKey=***&sslpassword=***"),
        ("http://a/?next=http://u:pp@h", "http://a/?next=http://u:***@h"),  # a URL inside a URL
        ("me:hunter2@db.example:5432/optuna", "me:***@db.example:5432/optuna"),  # no scheme, one whole address
    ],
)
def test_credentials_are_masked_wherever_they_sit_in_a_url(value, masked):
    assert mask_url(value) == masked
    if "://" in value and " " not in value:  # free text: an address ends at a space and needs its scheme
        assert mask_text(f"error: x={value} failed") == f"error: x={masked} failed"
    assert credentials(value) and not any(c in masked for c in credentials(value) if len(c) > 3)


@pytest.mark.parametrize(
    "value",
    [
        "sqlite:////data/x/mlflow.db",
        "http://host:8080/a@b",  # an '@' in a path after a port
        "git+https://github.com/org/repo.git@v1.0",
        "http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning&viewStateShareKey=dspark-ab",
        "model@rev",
        "org/model@rev",
        "/data/a:b@c",
        "decode.max_new_tokens",
        "",
    ],
)
def test_values_without_credentials_are_unchanged(value):
    assert mask_url(value) == value and mask_text(value) == value and credentials(value) == []


def test_command_lines_and_config_trees_are_masked_by_the_same_rules():
    argv = ["budget=smoke", "paths.root=/x", "tracking.uri=http://u:pw@h:5000", "data.regen_url=u:pw2@gen:80/v1"]
    assert public_command(argv) == (
        "python experiments/run.py budget=smoke tracking.uri=http://u:***@h:5000 data.regen_url=u:***@gen:80/v1"
    )
    assert mask_arg("decode.max_new_tokens=8") == "decode.max_new_tokens=8"
    tree = {"tracking": {"uri": "http://u:pw@h"}, "data": {"sets": ["a", "x:y@z"]}, "seed": 1}
    assert mask_tree(tree) == {"tracking": {"uri": "http://u:***@h"}, "data": {"sets": ["a", "x:***@z"]}, "seed": 1}
    assert tree["tracking"]["uri"] == "http://u:pw@h"  # the input is left alone
    assert ui_base("https://alice:s3cret@mlflow.example.org:8443/p/") == "https://mlflow.example.org:8443/p"


def test_remembered_credentials_are_masked_in_any_shape_of_text():
    password = "Pw-" + secrets.token_hex(6)
    remember([f"optuna.storage=postgresql://me:{password.replace('-', '%2D')}@db/x"])
    decoded = f'FATAL: password authentication failed ("{password}")'  # a driver quoting it decoded
    assert password not in mask_text(decoded) and "***" in mask_text(decoded)


class _AuthServer(http.server.BaseHTTPRequestHandler):
    """/health answers 200 only with the expected basic-auth header, 401 otherwise."""

    expected = ""

    def do_GET(self) -> None:
        ok = self.headers.get("Authorization") == self.expected
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"OK" if ok else b"no")

    def log_message(self, *args) -> None:
        pass


def test_the_reachability_probe_sends_the_real_credentials():
    """urllib refuses `user:password@` in a host ("nonnumeric port"), which called a live server unreachable and
    printed the password: the probe strips them and sends them as basic auth, percent-decoded."""
    _AuthServer.expected = "Basic " + base64.b64encode(b"me:p@ss word").decode()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AuthServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        check_reachable(f"http://me:p%40ss%20word@127.0.0.1:{port}/")  # no error: the server saw the credentials
        with pytest.raises(ConfigError) as refused:
            check_reachable(f"http://me:Wrong-{port}-pw@127.0.0.1:{port}")
        assert "401" in str(refused.value) and f"Wrong-{port}-pw" not in str(refused.value)
        assert split_credentials("http://u%3A:p%40ss@h:5000/x") == ("http://h:5000/x", "u:", "p@ss")
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ConfigError) as dead:
        check_reachable(f"http://me:Dead-{port}-pw@127.0.0.1:{port}")
    assert "unreachable" in str(dead.value) and f"Dead-{port}-pw" not in str(dead.value)


@contextlib.contextmanager
def _mlflow_server(workdir: Path, monkeypatch) -> Iterator[str]:
    """http://127.0.0.1:PORT of MLflow's own tracking server app (the Flask app `mlflow server` runs, with its REST
    handlers) over a fresh sqlite store, served by werkzeug in a thread of this process: it starts in seconds where
    the `mlflow server` command takes most of a minute on a loaded 2-core machine (tests/test_mlflow_server.py runs
    that one). Its handlers ignore basic auth, which the client sends."""
    from mlflow.server import app, handlers
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from werkzeug.serving import make_server

    store = SqlAlchemyStore(f"sqlite:///{workdir / 'server.db'}", str(workdir / "artifacts"))
    monkeypatch.setattr(handlers, "_tracking_store", store)  # what `mlflow server --backend-store-uri` builds
    monkeypatch.setattr(logging.getLogger("werkzeug"), "level", logging.WARNING)  # no line per request
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        store.engine.dispose()


def _files_holding(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_a_smoke_sweep_with_credentials_in_its_urls_records_them_nowhere(
    tmp_path, shared_root, capfd, caplog, monkeypatch, one_thread
):
    """tracking.uri carries user:password@ (the server ignores basic auth, the client sends it) and optuna.storage
    one too (a grid sweep records it without opening it): the sweep runs, and the password is in no file under
    paths.root, not in the server's store or artifacts, not on the console or in the log."""
    from dspark.cli import main
    from dspark.sweeps.driver import MAX_CELLS_ENV

    password = "Sec-" + secrets.token_hex(8)
    monkeypatch.setenv(MAX_CELLS_ENV, "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", os.environ.get("MLFLOW_TRACKING_URI", ""))  # restored afterwards
    (tmp_path / "server").mkdir()
    with _mlflow_server(tmp_path / "server", monkeypatch) as url:
        argv = [
            "sweep=depth",
            "stage=prepare",
            "budget=smoke",
            f"paths.root={shared_root}",
            f"paths.reports={tmp_path / 'reports'}",
            f"tracking.uri={url.replace('://', f'://dspark:{password}@')}",
            "tracking.experiment=secrets-test",
            f"optuna.storage=postgresql://me:{password}@db.invalid:5432/optuna?password={password}",
        ]
        code = main(argv)
    console = capfd.readouterr()
    assert code == 0, console.err[-3000:]
    assert "dspark:***@127.0.0.1" in console.out + console.err + caplog.text  # recorded, masked
    for text in (console.out, console.err, caplog.text):
        assert password not in text
    for where in (Path(shared_root), tmp_path):
        assert _files_holding(where, password.encode()) == []
    database = (tmp_path / "server" / "server.db").read_bytes()
    assert b"postgresql://me:***@db.invalid:5432/optuna" in database  # the params hold the masked value
