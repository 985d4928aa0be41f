"""Optuna study set-up shared by workers: two processes optimise one journal-file study with a cheap objective and
neither duplicate nor lose trials; the paper's defaults are enqueued exactly once; bad storages fail before
training; the pruning callback fails loudly on a missing metric."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import optuna
import pytest
from optuna.trial import TrialState

from dspark.config import ConfigError, resolve_config
from dspark.sweeps.driver import run_sweep
from dspark.sweeps.optuna_search import PruningCallback
from dspark.sweeps.optuna_study import claim_trial, open_storage, setup_study

DEFAULTS = {"x": 0.1, "y": 0.9}
WORKER = textwrap.dedent("""
    import json, os, pathlib, sys, time
    from dspark.sweeps.optuna_study import claim_trial, setup_study
    storage, root, n_trials = sys.argv[1], sys.argv[2], int(sys.argv[3])
    handle = setup_study(storage=storage, name="race", direction="maximize", seed=0, startup_trials=2,
                         prune=False, defaults={"x": 0.1, "y": 0.9}, root=root)
    barrier = pathlib.Path(root) / "ready"
    barrier.mkdir(exist_ok=True)
    (barrier / str(os.getpid())).touch()
    deadline = time.time() + 60
    while len(list(barrier.iterdir())) < 2 and time.time() < deadline:  # start claiming together
        time.sleep(0.02)
    ran = []
    while True:
        trial = claim_trial(handle, n_trials=n_trials)
        if trial is None:
            break
        x, y = trial.suggest_float("x", 0.0, 1.0), trial.suggest_float("y", 0.0, 1.0)
        time.sleep(0.05)  # long enough for the two workers to interleave
        handle.study.tell(trial, -(x - 0.3) ** 2 - (y - 0.6) ** 2)
        ran.append(trial.number)
    print(json.dumps(ran))
""")


def _setup(storage: str, root, n: int = 0):
    return setup_study(
        storage=storage,
        name="race",
        direction="maximize",
        seed=0,
        startup_trials=2,
        prune=False,
        defaults=DEFAULTS,
        root=root,
    )


def test_two_processes_share_one_journal_study(tmp_path):
    storage, n_trials = str(tmp_path / "study.journal"), 12
    _setup(storage, tmp_path)  # the study exists before the workers start
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, storage, str(tmp_path), str(n_trials)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [w.communicate(timeout=120) for w in workers]
    assert all(w.returncode == 0 for w in workers), [err[-2000:] for _, err in outputs]
    ran = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    numbers = sorted(n for part in ran for n in part)
    assert all(ran), f"one worker ran no trial: {ran}"
    assert numbers == list(range(n_trials)), ran  # no trial run twice, none lost, none beyond n_trials
    study = optuna.load_study(study_name="race", storage=open_storage(storage))
    trials = study.get_trials()
    assert len(trials) == n_trials and all(t.state == TrialState.COMPLETE for t in trials)
    defaults = [t for t in trials if t.user_attrs.get("paper_defaults")]
    assert len(defaults) == 1 and defaults[0].params == DEFAULTS and defaults[0].number == 0
    assert len({tuple(sorted(t.params.items())) for t in trials}) == n_trials  # workers drew different points


def test_setup_is_idempotent_and_claims_stop_at_n_trials(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    handle = _setup(storage, tmp_path)
    handle = _setup(storage, tmp_path)  # a second worker: no second enqueued default
    waiting = handle.study.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 1
    first = claim_trial(handle, n_trials=2)
    assert first.params == DEFAULTS or first.number == 0
    handle.study.tell(first, 1.0)
    failed = claim_trial(handle, n_trials=2)
    failed.suggest_float("x", 0, 1)
    handle.study.tell(failed, state=TrialState.FAIL)  # failed trials do not count: a rerun retries them
    second = claim_trial(handle, n_trials=2)
    assert second is not None
    second.suggest_float("x", 0, 1)
    handle.study.tell(second, 0.5)
    assert claim_trial(handle, n_trials=2) is None
    _setup(storage, tmp_path)  # the defaults already ran: nothing is enqueued again
    assert not handle.study.get_trials(states=(TrialState.WAITING,))


@pytest.mark.parametrize("storage", ["postgresql://user:secret@127.0.0.1:9/optuna", "sqlite:////proc/no/such/db"])
def test_unusable_storage_is_a_config_error(storage, tmp_path):
    with pytest.raises(ConfigError, match="optuna.storage") as err:
        _setup(storage, tmp_path)
    assert "secret" not in str(err.value)


def test_unusable_storage_stops_the_sweep_before_training(tmp_path, capsys):
    argv = ["sweep=rank", "budget=smoke", f"paths.root={tmp_path}", "optuna.storage=postgresql://u@127.0.0.1:9/x"]
    assert run_sweep(resolve_config(argv)) == 2
    assert "optuna.storage" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_searched_key_on_the_command_line_is_refused(tmp_path, capsys):
    argv = ["sweep=rank", "budget=smoke", f"paths.root={tmp_path}", "model.markov_rank=64"]
    assert run_sweep(resolve_config(argv)) == 2
    assert "model.markov_rank" in capsys.readouterr().err


def test_pruning_callback_needs_its_metric_and_prunes():
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.ThresholdPruner(lower=0.5))
    trial = study.ask()
    trainer = SimpleNamespace(sanity_checking=False, current_epoch=0, callback_metrics={"val/loss": 1.0})
    callback = PruningCallback(trial, "val/tau_prob")
    with pytest.raises(ValueError, match="val/tau_prob.*val/loss"):
        callback.on_validation_end(trainer, None)
    trainer.callback_metrics["val/tau_prob"] = 0.2
    with pytest.raises(optuna.TrialPruned):
        callback.on_validation_end(trainer, None)
    assert callback.pruned
