"""The tracking store under faults (issue 14): concurrent writers and a SIGKILL mid-training.

- processes opening one new sqlite store at the same moment all succeed (fast);
the slow ones run the real command line (`experiments/run.py`) in subprocesses on the tiny target (budget=smoke,
~1 min each):
- two grid sweeps writing to one sqlite MLflow store at once: every cell FINISHED exactly once, no metric lost;
- two Optuna workers on one journal file (and the same MLflow store): every trial once, its objective equal to the
  metric stored in its run;
- a sweep killed with SIGKILL while a cell trains: `stage=report` reads the store that is left, and the rerun
  resumes the cell from its last checkpoint and finishes it once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[1]
FAST = ["budget=smoke", "optim.epochs=1", "decode.prompts_per_set=1", "decode.max_new_tokens=8"]
OPENER = """
import pathlib, sys, time
from dspark.config import resolve_config
from dspark.tracking import open_store
root, barrier = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
cfg = resolve_config([f"paths.root={root}"]).cfg
import mlflow.tracking  # imported before the barrier, so the openers really start together
(barrier / sys.argv[3]).touch()
while len(list(barrier.iterdir())) < int(sys.argv[4]):
    time.sleep(0.01)
store = open_store(cfg)
store.finish(store.create_run(run_name=f"opener-{sys.argv[3]}", tags={}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO / "src"),
        OMP_NUM_THREADS="1",
        MLFLOW_ENABLE_ASYNC_LOGGING="false",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("DSPARK_MLFLOW_RUN_ID", None)
    return env | extra


def _start(argv: list[str], *, log: Path, **env: str) -> subprocess.Popen:
    handle = open(log, "w")
    return subprocess.Popen(
        [sys.executable, str(REPO / "experiments" / "run.py"), *argv],
        cwd=REPO,
        env=_env(**env),
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait(procs: list[subprocess.Popen], logs: list[Path], *, timeout: float = 900) -> None:
    for proc, log in zip(procs, logs):
        proc.wait(timeout=timeout)
        assert proc.returncode == 0, f"{log.name} exited {proc.returncode}:\n{log.read_text()[-3000:]}"


def _store(root: Path, experiment: str = "dspark-lab") -> tuple[MlflowClient, list]:
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id], max_results=1000)


def _cells(runs: list, sweep: str) -> list:
    return [r for r in runs if r.data.tags.get("sweep.name") == sweep and r.data.tags.get("sweep.role") == "cell"]


def _complete(run) -> bool:
    return run.info.status == "FINISHED" and run.data.tags.get("sweep.complete") == "true"


def _trained_here(client: MlflowClient, run) -> bool:
    """Whether this cell trained its drafter (a train/loss history) rather than reusing another cell's."""
    return len(client.get_metric_history(run.info.run_id, "train/loss")) > 1


def _assert_no_lost_metric(client: MlflowClient, run, *, steps: int, trained: bool = True) -> None:
    """A finished cell holds its evaluation summary, its validation metrics and, if it trained, one train/loss
    point per step (a cell that reused a drafter logs the recorded training metrics once)."""
    metrics = run.data.metrics
    for key in ("summary/tau", "summary/wall_seconds", "val/tau_prob", "data/sequences"):
        assert key in metrics, (run.data.tags.get("cell"), key, sorted(metrics))
    history = client.get_metric_history(run.info.run_id, "train/loss")
    if trained:
        assert sorted(m.step for m in history) == list(range(steps)), [m.step for m in history]


def _train_steps(root: Path) -> int:
    """Optimiser steps of one smoke epoch, read from a finished run's config (batches per epoch vary with the data)."""
    client, runs = _store(root)
    finished = [r for r in runs if r.data.tags.get("sweep.role") == "cell" and _complete(r)]
    # the longest history: a cell that reused another cell's drafter logged one point
    return max(len(client.get_metric_history(r.info.run_id, "train/loss")) for r in finished)


@pytest.mark.slow
def test_processes_opening_a_new_sqlite_store_at_once_all_succeed(tmp_path):
    """Without the lock in open_store, MLflow's schema migration raced: "Online migration expected to match one
    row when updating ... in 'alembic_version'; 0 found", or a duplicate create_experiment."""
    root, barrier, n = tmp_path / "root", tmp_path / "barrier", 3
    barrier.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, str(root), str(barrier), str(i), str(n)],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(n)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [o[-1500:] for o in outputs]
    _, runs = _store(root)
    assert sorted(r.info.run_name for r in runs) == [f"opener-{i}" for i in range(n)]
    assert all(r.info.status == "FINISHED" for r in runs)


@pytest.mark.slow
def test_two_sweeps_write_one_sqlite_store_at_once(tmp_path):
    root = tmp_path / "root"
    logs = [tmp_path / "depth.log", tmp_path / "head.log"]
    procs = [
        _start(["sweep=depth", *FAST, f"paths.root={root}"], log=logs[0], DSPARK_SWEEP_MAX_CELLS="2"),
        _start(["sweep=head", *FAST, f"paths.root={root}"], log=logs[1], DSPARK_SWEEP_MAX_CELLS="2"),
    ]
    _wait(procs, logs)
    client, runs = _store(root)
    steps = _train_steps(root)
    for sweep in ("depth", "head"):
        parents = [
            r for r in runs if r.data.tags.get("sweep.name") == sweep and r.data.tags.get("sweep.role") == "parent"
        ]
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        cells = _cells(runs, sweep)
        keys = [r.data.tags["cell"] for r in cells if _complete(r)]
        assert len(keys) == len(set(keys)) == 2 and len(cells) == 2, [
            (r.data.tags["cell"], r.info.status) for r in cells
        ]
        for run in cells:
            _assert_no_lost_metric(client, run, steps=steps, trained=_trained_here(client, run))
    # depth's 2-layer cell and head's markov cell share a training key and reach it at about the same time: one
    # process trains (one train/loss point per step), the other waits on the run directory's lock and reuses the
    # drafter (before the lock it "resumed" from the first one's checkpoint and overwrote drafter.pt without
    # validation metrics)
    by_key: dict[str, list] = {}
    for run in _cells(runs, "depth") + _cells(runs, "head"):
        by_key.setdefault(run.data.tags["training.key"], []).append(_trained_here(client, run))
    assert all(sum(trained) == 1 for trained in by_key.values()), by_key
    assert any(len(trained) == 2 for trained in by_key.values()), by_key


@pytest.mark.slow
def test_two_optuna_workers_share_one_journal_and_one_store(tmp_path):
    import optuna

    root, journal = tmp_path / "root", tmp_path / "study.journal"
    argv = [
        "sweep=rank",
        *FAST,
        f"paths.root={root}",
        f"optuna.storage={journal}",
        "optuna.n_trials=4",
        "optuna.prune=false",
    ]  # a pruned trial is a legitimate outcome, not what this test is about
    logs = [tmp_path / "w0.log", tmp_path / "w1.log"]
    procs = [_start(argv, log=log) for log in logs]
    _wait(procs, logs)
    study = optuna.load_study(
        study_name=None,
        storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal))),
    )
    trials = study.get_trials()
    assert len(trials) == 4 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    client, runs = _store(root)
    cells = _cells(runs, "rank")
    by_trial = {}
    for run in cells:
        by_trial.setdefault(int(run.data.tags["optuna.trial"]), []).append(run)
    assert sorted(by_trial) == [t.number for t in trials], sorted(by_trial)
    steps = _train_steps(root)
    for trial in trials:
        (run,) = by_trial[trial.number]  # exactly one run per trial, and it finished
        assert _complete(run), run.info.status
        assert run.data.metrics["summary/tau"] == pytest.approx(trial.value)  # the objective was not lost
        _assert_no_lost_metric(client, run, steps=steps)
    parents = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    assert len(parents) == 1  # both workers attached to one parent


def _wait_for(predicate, *, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"run ended before the kill ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.mark.slow
def test_sigkill_mid_training_leaves_a_readable_store_and_the_rerun_resumes(tmp_path):
    root = tmp_path / "root"
    argv = ["sweep=depth", "stage=train", "budget=smoke", "optim.epochs=12", f"paths.root={root}"]
    first = tmp_path / "killed.log"
    proc = _start(argv, log=first, DSPARK_SWEEP_MAX_CELLS="1")
    epoch_checkpoints = lambda: [p for p in root.glob("runs/*/checkpoints/epoch=*.ckpt") if "epoch=0-" not in p.name]
    _wait_for(lambda: bool(epoch_checkpoints()), timeout=600, proc=proc, log=first)  # at least two epochs saved
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    saved = max(int(p.name.split("-")[0].split("=")[1]) for p in root.glob("runs/*/checkpoints/epoch=*.ckpt"))
    assert saved < 11, "the kill came after training ended"
    client, runs = _store(root)
    (killed,) = _cells(runs, "depth")
    assert killed.info.status == "RUNNING"  # nobody could close it: the store says so, and stays readable

    report_log = tmp_path / "report.log"
    proc = _start(argv + ["stage=report"], log=report_log)
    proc.wait(timeout=900)
    text = report_log.read_text()
    assert proc.returncode == 2 and "RUNNING 1" in text  # the killed cell, counted, not tabulated: no report
    assert not (root / "reports" / "depth.md").exists()

    rerun_log = tmp_path / "rerun.log"
    _wait([_start(argv, log=rerun_log, DSPARK_SWEEP_MAX_CELLS="1")], [rerun_log])
    client, runs = _store(root)
    cells = _cells(runs, "depth")
    assert sorted(r.info.status for r in cells) == ["FINISHED", "KILLED"]  # the stale attempt closed, the cell once
    (done,) = [r for r in cells if _complete(r)]
    epochs = sorted({int(m.value) for m in client.get_metric_history(done.info.run_id, "epoch")})
    assert epochs == list(range(saved + 1, 12))  # the rerun trained only the epochs after the last checkpoint
    report = (root / "reports" / "depth.md").read_text()  # the sweep's own report after the rerun
    assert "DSpark (markov) depth 1" in report and "FINISHED 1, KILLED 1" in report
