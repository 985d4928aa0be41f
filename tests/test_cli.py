"""The command line in-process: exit codes, messages, prepare/train stages on the tiny target with MLflow on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from dspark.cli import main
from dspark.config.schema import FIXED_HEAD
from dspark.drafters.factory import DRAFTER_BUILDERS
from dspark.drafters.heads import SEQUENTIAL_HEADS


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory) -> str:
    """This module's own root: its training tests assert fresh training metrics, so no other file may have trained
    the same configs there first."""
    return str(tmp_path_factory.mktemp("cli-root"))


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["no_such_key=1"], "no_such_key"),
        (["sweep=no_such_sweep"], "no_such_sweep"),
        (["data.train_sets=[gsm8kk]"], "gsm8k"),
        (["decode.eval_sets=[nope]"], "prompt set"),
        (["target=/no/such/model"], "/no/such/model"),
        (["data.local_dir=/no/such/dir"], "data.local_dir"),
    ],
)
def test_bad_input_exits_2_with_message(argv, needle, capsys, tmp_path):
    assert main(argv + [f"paths.root={tmp_path}"]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()  # nothing ran


def test_missing_eval_set_fails_in_seconds_before_any_work(capsys, tmp_path, monkeypatch):
    """No local copy of an eval set and no hub: preflight stops the run (exit 2) before regeneration or training."""
    import time

    from dspark.data import prompts

    monkeypatch.setattr(prompts, "VENDORED_DIR", tmp_path / "no_vendored_sets")
    monkeypatch.delenv("DSPARK_DATA_DIR", raising=False)
    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("HF_HUB_CACHE", str(tmp_path / "hub")),
        ("HF_DATASETS_CACHE", str(tmp_path / "datasets")),
    ):
        monkeypatch.setenv(key, value)
    started = time.perf_counter()
    assert (
        main(["budget=smoke", "data.train_sets=[synthetic]", "decode.eval_sets=[gsm8k]", f"paths.root={tmp_path}"]) == 2
    )
    assert time.perf_counter() - started < 10
    err = capsys.readouterr().err
    assert "decode.eval_sets: prompt set 'gsm8k'" in err and "Fix:" in err and "data.local_dir=DIR" in err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache" / "regen").exists()


def _runs(root: str):
    client = MlflowClient(f"sqlite:///{Path(root) / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dspark-lab")
    return client, client.search_runs([exp.experiment_id])


def test_prepare_stage_caches_regenerated_data(shared_root):
    assert main(["stage=prepare", "budget=smoke", f"paths.root={shared_root}"]) == 0
    regen = list((Path(shared_root) / "cache" / "regen").glob("*/COMPLETE"))
    assert regen, "no finished regeneration cache"
    client, runs = _runs(shared_root)
    run = [r for r in runs if r.data.tags.get("stage") == "prepare"][0]
    assert run.info.status == "FINISHED" and run.data.metrics["data/sequences"] > 0
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "config.yaml" in artifacts


# Every registered drafter: with each registered head where model.head chooses it, else with the head it fixes.
TRAIN_ARGVS = {
    f"{kind}-{head}" if FIXED_HEAD.get(kind) is None else kind: [
        f"drafter={kind}",
        *([f"model.head={head}"] if FIXED_HEAD.get(kind) is None else []),
    ]
    for kind in DRAFTER_BUILDERS.ordered()
    for head in (SEQUENTIAL_HEADS.ordered() if FIXED_HEAD.get(kind) is None else [FIXED_HEAD[kind]])
}


@pytest.mark.parametrize("argv", list(TRAIN_ARGVS.values()), ids=list(TRAIN_ARGVS))
def test_train_stage_each_drafter(argv, shared_root, capsys):
    assert main(["stage=train", "budget=smoke", f"paths.root={shared_root}", *argv]) == 0
    # tqdm's training bar reaches a stream that is not a terminal; rich's (Lightning's default when rich is
    # installed) draws nothing there until the end ("Epoch 0/0 ━━━…"), so a redirected log showed no progress
    assert re.search(r"Epoch 0: +\d+%\|", capsys.readouterr().out)
    client, runs = _runs(shared_root)
    run = next(
        r
        for r in runs
        if r.data.tags.get("stage") == "train"
        and r.data.tags["drafter"] == argv[0].split("=")[1]
        and r.data.tags["model.head"] == client.get_run(r.info.run_id).data.params["model.head"]
    )
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert "train/loss" in metrics and "val/accept/pos1" in metrics and "val/tau_prob" in metrics
    run_dirs = list((Path(shared_root) / "runs").glob("*/drafter.pt"))
    assert run_dirs


def test_the_training_bar_refreshes_every_step_on_a_terminal_and_every_log_interval_in_a_file(tmp_path):
    import io

    from lightning.pytorch.callbacks import TQDMProgressBar

    from dspark.stages.train import training_progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    with open(tmp_path / "log", "w") as log:
        assert training_progress_bar(10, stream=log).refresh_rate == 10
    assert training_progress_bar(10, stream=Terminal()).refresh_rate == 1
    assert isinstance(training_progress_bar(0, stream=io.StringIO()), TQDMProgressBar)
    assert training_progress_bar(0, stream=io.StringIO()).refresh_rate == 1


def test_rerun_reuses_trained_drafter(shared_root, caplog):
    argv = ["stage=train", "budget=smoke", f"paths.root={shared_root}", "drafter=dflash"]
    assert main(argv) == 0
    with caplog.at_level("INFO", logger="dspark"):
        assert main(argv) == 0
    assert "reusing the trained drafter" in caplog.text


def test_max_steps_mid_epoch_still_stores_held_out_metrics(shared_root):
    """optim.max_steps ends training before the epoch's validation (budget=cpu-ref does): the train stage validates
    the final drafter, so drafter.pt and the run carry its held-out metrics, not none (or an older step's)."""
    from dspark.drafters.checkpoint import read_checkpoint

    argv = [
        "stage=train",
        "budget=smoke",
        f"paths.root={shared_root}",
        "drafter=dflash",
        "optim.max_steps=1",
        "trainer.val_check_interval=1.0",
    ]
    assert main(argv) == 0
    client, runs = _runs(shared_root)
    run = next(r for r in runs if r.data.params.get("optim.max_steps") == "1")
    history = client.get_metric_history(run.info.run_id, "val/tau_prob")
    assert [m.step for m in history] == [1]
    path = next(
        p
        for p in (Path(shared_root) / "runs").glob("dflash-*/drafter.pt")
        if "max_steps: 1" in (p.parent / "config.yaml").read_text()
    )
    assert "val/tau_prob" in read_checkpoint(path)["metrics"]
