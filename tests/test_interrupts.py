"""Ctrl-C inside Lightning's fit (a KeyboardInterrupt raised from the loss): a plain run and a sweep cell end KILLED,
not FAILED; the command exits 130 with one line saying what was kept and that rerunning resumes, no traceback; the
report counts the cell as killed; the rerun resumes."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

import dspark.stages.train as train_stage
import dspark.training.steps as steps
from dspark.cli import main

FAST = ["budget=smoke", "data.num_train_prompts=12"]


def _runs(root: Path, experiment: str = "dspark-lab"):
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def _interrupting_loss(monkeypatch, *, after: int, when=lambda: True) -> dict:
    """Make the training loss raise KeyboardInterrupt (as Ctrl-C would, inside fit) on its call number `after`+1
    counted while `when()` holds."""
    real_loss = steps.compute_dspark_loss
    calls = {"n": 0, "real": real_loss}

    def loss(*args, **kwargs):
        if when():
            calls["n"] += 1
            if calls["n"] > after:
                raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(steps, "compute_dspark_loss", loss)
    return calls


def _one_line(err: str, needle: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if needle in line]
    assert len(lines) == 1, err
    assert "Rerun the same command" in lines[0]
    return lines[0]


@pytest.mark.slow
def test_ctrl_c_during_training_kills_the_run_and_the_rerun_resumes(tmp_path, monkeypatch, capsys, one_thread):
    argv = ["stage=train", *FAST, f"paths.root={tmp_path}", "optim.epochs=3"]
    handler = signal.getsignal(signal.SIGINT)
    _interrupting_loss(monkeypatch, after=4)  # after the first epoch (2 train + 1 val batches) was checkpointed
    assert main(argv) == 130
    line = _one_line(capsys.readouterr().err, "interrupted")
    run_dir = next((tmp_path / "runs").iterdir())
    last = run_dir / "checkpoints" / "last.ckpt"
    assert "marked KILLED" in line and str(last) in line
    assert [r.info.status for r in _runs(tmp_path)] == ["KILLED"]
    assert signal.getsignal(signal.SIGINT) == handler  # Lightning left SIGINT ignored; it is restored
    resumed_from = torch.load(last, map_location="cpu", weights_only=False)["global_step"]

    monkeypatch.undo()
    assert main(argv) == 0
    assert [r.info.status for r in _runs(tmp_path)] == ["KILLED", "FINISHED"]
    assert (run_dir / "drafter.pt").exists()
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] > resumed_from


@pytest.mark.slow
def test_ctrl_c_during_a_sweep_cell_kills_the_cell_not_fails_it(tmp_path, monkeypatch, capsys, one_thread):
    experiment = "interrupted"
    argv = [
        "sweep=depth",
        "stage=train",
        *FAST,
        "optim.epochs=1",
        f"paths.root={tmp_path}",
        f"tracking.experiment={experiment}",
    ]
    real_train, training = train_stage.run_train, {"depth": None}

    def tracked(ctx, data):
        training["depth"] = ctx.cfg.model.depth
        return real_train(ctx, data)

    monkeypatch.setattr(train_stage, "run_train", tracked)
    monkeypatch.setenv("DSPARK_SWEEP_MAX_CELLS", "2")
    calls = _interrupting_loss(monkeypatch, after=1, when=lambda: training["depth"] == 2)  # the second cell's fit
    assert main(argv) == 130
    line = _one_line(capsys.readouterr().err, "interrupted")
    assert "1 finished cells are kept" in line and "model.depth=2 seed=0 is marked KILLED" in line
    runs = _runs(tmp_path, experiment)
    parent = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    cells = {r.data.tags["cell"]: r.info.status for r in runs if r.data.tags.get("sweep.role") == "cell"}
    assert [p.info.status for p in parent] == ["KILLED"]
    assert cells == {"drafter=dspark model.depth=1 seed=0": "FINISHED", "drafter=dspark model.depth=2 seed=0": "KILLED"}
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(parent[0].info.run_id).data.metrics["sweep/cells_killed"] == 1

    reports = tmp_path / "reports"
    assert main([*argv[:1], "stage=report", *argv[2:], f"paths.reports={reports}"]) == 0
    text = (reports / "depth.md").read_text()
    assert "KILLED 1" in text and "FAILED" not in text

    monkeypatch.setattr(train_stage, "run_train", real_train)
    monkeypatch.setattr(steps, "compute_dspark_loss", calls["real"])
    assert main(argv) == 0  # resumes: the finished cell is skipped, the killed one runs again
    cells = [
        (r.data.tags["cell"], r.info.status)
        for r in _runs(tmp_path, experiment)
        if r.data.tags.get("sweep.role") == "cell"
    ]
    assert sorted(cells) == [
        ("drafter=dspark model.depth=1 seed=0", "FINISHED"),
        ("drafter=dspark model.depth=2 seed=0", "FINISHED"),
        ("drafter=dspark model.depth=2 seed=0", "KILLED"),
    ]


@pytest.fixture(autouse=True)
def _sigint_restored():
    """Whatever a test does, pytest's Ctrl-C handler is back afterwards."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)
