"""A real `mlflow server` on loopback: a 2-cell sweep logs to it over HTTP and the runs are read back over REST."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from process_group import free_port

from dspark.config import resolve_config
from dspark.sweeps.driver import run_sweep

MLFLOW = Path(sys.executable).parent / "mlflow"


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, socket.timeout):
            time.sleep(0.5)
    raise TimeoutError(f"mlflow server at {url} did not answer /health within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (it starts workers), then SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _rest(url: str, path: str, payload: dict | None = None) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(
        url + path,
        data=data,
        headers={"Content-Type": "application/json"},
        method="POST" if data is not None else "GET",
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.mark.skipif(not MLFLOW.exists(), reason="the venv has no mlflow executable")
@pytest.mark.slow
def test_two_cell_sweep_against_a_real_server(tmp_path, shared_root, monkeypatch, one_thread):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", os.environ.get("MLFLOW_TRACKING_URI", ""))  # restored afterwards
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [
            str(MLFLOW),
            "server",
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--artifacts-destination",
            str(tmp_path / "artifacts"),
        ],
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )  # no job-runner processes: starts faster
    try:
        _wait_healthy(url, proc)
        argv = [
            "sweep=depth",
            "stage=train",
            "budget=smoke",
            "optim.epochs=1",
            f"paths.root={shared_root}",
            f"tracking.uri={url}",
            "tracking.experiment=server-test",
        ]
        assert run_sweep(resolve_config(argv), max_cells=2) == 0
        exp = _rest(url, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=server-test")["experiment"]
        found = _rest(
            url,
            "/api/2.0/mlflow/runs/search",
            {"experiment_ids": [exp["experiment_id"]], "filter": "tags.`sweep.name` = 'depth'", "max_results": 100},
        )
        runs = found["runs"]
        tags = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
        parents = [r for r, t in zip(runs, tags) if t.get("sweep.role") == "parent"]
        cells = [(r, t) for r, t in zip(runs, tags) if t.get("sweep.role") == "cell"]
        assert len(parents) == 1 and len(cells) == 2
        parent_id = parents[0]["info"]["run_id"]
        assert all(t["mlflow.parentRunId"] == parent_id and r["info"]["status"] == "FINISHED" for r, t in cells)
        assert sorted(t["axis.model.depth"] for _, t in cells) == ["1", "2"]
        metrics = {m["key"] for r, _ in cells for m in r["data"].get("metrics", [])}
        assert "val/tau_prob" in metrics
        artifacts = _rest(url, f"/api/2.0/mlflow/artifacts/list?run_id={parent_id}&path=report")
        assert any(f["path"].endswith("depth.md") for f in artifacts.get("files", []))
    finally:
        _stop(proc)
        log.close()
