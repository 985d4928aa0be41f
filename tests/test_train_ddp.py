"""Lightning DDP on two CPU processes (gloo): the training path runs, logs one MLflow run, and its loss curve has the
shape of the single-process one (the same data split over two ranks: half the steps per epoch, falling loss)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[1]


def _train(root: Path, *extra: str) -> list[float]:
    cmd = [
        sys.executable,
        str(REPO / "experiments" / "run.py"),
        "stage=train",
        "budget=smoke",
        f"paths.root={root}",
        "optim.epochs=3",
        "data.num_train_prompts=16",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "DSPARK_MLFLOW_RUN_ID")}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("dspark-lab").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # DDP workers share the parent's run
    history = client.get_metric_history(runs[0].info.run_id, "train/loss")
    return [m.value for m in sorted(history, key=lambda m: m.step)]


@pytest.mark.ddp
@pytest.mark.slow
def test_ddp_two_cpu_processes_match_single_process_curve(tmp_path):
    single = _train(tmp_path / "single")
    ddp = _train(tmp_path / "ddp", "trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu")
    assert len(single) >= 4 and len(ddp) >= 2
    assert abs(len(ddp) - len(single) / 2) <= 1.5  # each rank sees half the sequences per epoch
    assert single[-1] < single[0] and ddp[-1] < ddp[0]  # both fall
    assert abs(ddp[0] - single[0]) / single[0] < 0.25  # same starting point (same seed, same init)
