"""A NaN loss stops the run, marks it FAILED in MLflow and keeps the last good checkpoint; rerunning resumes from it."""

from __future__ import annotations

from pathlib import Path

import torch
from mlflow.tracking import MlflowClient

import dspark.training.steps as steps
from dspark.cli import main


def _runs(root: Path):
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dspark-lab")
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def test_nan_loss_fails_run_keeps_checkpoint_then_resume(tmp_path, monkeypatch, capsys, one_thread):
    argv = ["stage=train", "budget=smoke", f"paths.root={tmp_path}", "optim.epochs=3", "data.num_train_prompts=12"]
    real_loss = steps.compute_dspark_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] > 4:  # after the first epoch (2 train + 1 val batches) has been checkpointed
            out.total = out.total * float("nan")
        return out

    monkeypatch.setattr(steps, "compute_dspark_loss", poisoned)
    assert main(argv) == 1
    assert "NonFiniteLossError" in capsys.readouterr().err
    runs = _runs(tmp_path)
    assert [r.info.status for r in runs] == ["FAILED"]
    run_dir = next((tmp_path / "runs").iterdir())
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.exists() and not (run_dir / "drafter.pt").exists()
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert all(torch.isfinite(v).all() for v in saved["state_dict"].values() if v.is_floating_point())
    resumed_from = saved["global_step"]

    monkeypatch.setattr(steps, "compute_dspark_loss", real_loss)
    assert main(argv) == 0
    runs = _runs(tmp_path)
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
    assert (run_dir / "drafter.pt").exists()
    final = torch.load(last, map_location="cpu", weights_only=False)
    assert final["epoch"] == 2 and final["global_step"] > resumed_from  # epoch is 0-based: the third one
    history = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(runs[1].info.run_id, "train/loss")
    assert min(m.step for m in history) >= resumed_from - 1  # the resumed run continued, it did not restart
