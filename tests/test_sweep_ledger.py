"""The sweep ledger (`dspark.tracking.ledger`): finished cells recorded beside the report, imported into a store that
lacks them — a sweep resumes, and its report regenerates, from another checkout or machine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import dspark.stages.train as train_stage
from dspark.cli import main
from dspark.config import resolve_config
from dspark.sweeps import load_sweep
from dspark.sweeps.driver import plan_grid, run_sweep
from dspark.tracking import open_store
from dspark.tracking import ledger as cell_ledger
from dspark.tracking.runs import COMPLETE_TAG, cell_tags, children, done_cells, open_parent

FAST = ["budget=smoke", "optim.epochs=1", "decode.prompts_per_set=1", "decode.max_new_tokens=8"]


def _store(root: Path, experiment: str = "ledger"):
    return open_store(resolve_config([f"paths.root={root}", f"tracking.experiment={experiment}"]).cfg)


def _parent(store, sweep: str = "depth", digest: str = "abc123") -> str:
    return open_parent(store, sweep=sweep, sweep_hash=digest, tags={"budget": "smoke"})[0]


def _cell(store, parent: str, index: int, *, done: bool = True, tau: float = 1.25) -> str:
    tags = cell_tags(sweep="depth", sweep_hash="abc123", paper_ref="Fig. 3", index=index,
                     key=f"model.depth={index + 1} seed=0", axes={"model.depth": index + 1}, attempt=f"a{index}")
    run = store.create_run(run_name=f"dspark-markov-d{index + 1}", tags=tags | {"machine": f"box {index}"},
                           parent_run_id=parent)
    store.client.log_param(run, "model.depth", str(index + 1))
    store.log_metrics(run, {"summary/tau": tau + index, "val/tau_prob": 1.5})
    if done:
        store.client.set_tag(run, COMPLETE_TAG, "true")
    store.finish(run, status="FINISHED" if done else "FAILED")
    return run


def test_record_then_import_into_an_empty_store_carries_tags_params_and_metrics(tmp_path):
    source = _store(tmp_path / "a")
    parent = _parent(source)
    first = _cell(source, parent, 0)
    _cell(source, parent, 1, done=False)  # a failed cell is not recorded
    path = cell_ledger.ledger_path(tmp_path / "reports", experiment="ledger", sweep="depth", sweep_hash="abc123")
    assert path == tmp_path / "reports" / "cells" / "ledger" / "depth-abc123.json"
    assert cell_ledger.record_cells(source, parent, path, sweep="depth", sweep_hash="abc123") == 1
    data = json.loads(path.read_text())
    assert data["format"] == "dspark-sweep-ledger" and [c["cell"] for c in data["cells"]] == ["model.depth=1 seed=0"]
    assert "sweep.attempt" not in data["cells"][0]["tags"] and data["cells"][0]["run_id"] == first

    target = _store(tmp_path / "b")
    new_parent = _parent(target)
    assert cell_ledger.import_cells(target, new_parent, path, sweep="depth", sweep_hash="abc123") == [
        "model.depth=1 seed=0"]
    (run,) = children(target, new_parent)
    assert run.info.status == "FINISHED" and run.data.tags[COMPLETE_TAG] == "true"
    assert run.data.tags["machine"] == "box 0" and run.data.tags["axis.model.depth"] == "1"
    assert run.data.tags[cell_ledger.RUN_ID_TAG] == first and run.data.tags[cell_ledger.SOURCE_TAG] == str(path)
    assert run.data.params == {"model.depth": "1"}
    assert run.data.metrics == {"summary/tau": 1.25, "val/tau_prob": 1.5}
    assert run.info.run_name == "dspark-markov-d1"
    # importing again adds nothing; recording from the importing store keeps the original run id
    assert cell_ledger.import_cells(target, new_parent, path, sweep="depth", sweep_hash="abc123") == []
    assert len(done_cells(children(target, new_parent))) == 1
    written = path.read_text()
    assert cell_ledger.record_cells(target, new_parent, path, sweep="depth", sweep_hash="abc123") == 1
    assert path.read_text() == written  # an imported cell is recorded back unchanged (times, run id and all)


def test_record_merges_with_the_file_and_import_skips_cells_the_store_finished(tmp_path):
    path = tmp_path / "cells" / "depth-abc123.json"
    a = _store(tmp_path / "a")
    parent_a = _parent(a)
    _cell(a, parent_a, 0, tau=1.1)
    cell_ledger.record_cells(a, parent_a, path, sweep="depth", sweep_hash="abc123")
    b = _store(tmp_path / "b")
    parent_b = _parent(b)
    _cell(b, parent_b, 1, tau=1.2)  # another machine finished the second cell
    assert cell_ledger.record_cells(b, parent_b, path, sweep="depth", sweep_hash="abc123") == 2  # merged
    cells = json.loads(path.read_text())["cells"]
    assert [c["cell"] for c in cells] == ["model.depth=1 seed=0", "model.depth=2 seed=0"]  # by cell index
    assert cell_ledger.import_cells(b, parent_b, path, sweep="depth", sweep_hash="abc123") == ["model.depth=1 seed=0"]
    assert sorted(done_cells(children(b, parent_b))) == ["model.depth=1 seed=0", "model.depth=2 seed=0"]


@pytest.mark.parametrize("text, needle", [
    ("{not json", "unreadable"),
    ('{"format": "other"}', "not a sweep ledger"),
    ('{"format": "dspark-sweep-ledger", "version": 99}', "version 99"),
    ('{"format": "dspark-sweep-ledger", "version": 1, "sweep": "head", "sweep_hash": "abc123", "cells": []}',
     "records sweep 'head'"),
    ('{"format": "dspark-sweep-ledger", "version": 1, "sweep": "depth", "sweep_hash": "abc123", "cells": [1]}',
     "must be a list"),
])
def test_a_file_that_is_not_this_sweeps_ledger_is_refused_with_the_fix(tmp_path, text, needle):
    path = tmp_path / "depth-abc123.json"
    path.write_text(text)
    with pytest.raises(cell_ledger.LedgerError, match=needle) as err:
        cell_ledger.read_ledger(path, sweep="depth", sweep_hash="abc123")
    assert str(path) in str(err.value) and "delete" in str(err.value)


def test_a_sweep_goes_on_from_another_checkout_and_its_report_regenerates(tmp_path, monkeypatch, one_thread):
    """Checkout A runs the first cell; checkout B (an empty store, the same reports folder) imports it, runs only the
    second and reports both; checkout C regenerates the report from the ledger alone."""
    reports = tmp_path / "reports"
    argv = ["sweep=depth", *FAST, f"paths.reports={reports}", "tracking.experiment=ledger-e2e"]
    real_train, trained = train_stage.run_train, []

    def counting(ctx, data):
        trained.append(ctx.cfg.model.depth)
        return real_train(ctx, data)

    monkeypatch.setattr(train_stage, "run_train", counting)
    assert run_sweep(resolve_config([*argv, f"paths.root={tmp_path / 'a'}"]), max_cells=1) == 0
    digest = plan_grid(resolve_config(argv), load_sweep("depth")).sweep_hash
    path = cell_ledger.ledger_path(reports, experiment="ledger-e2e", sweep="depth", sweep_hash=digest)
    assert [c["cell"] for c in json.loads(path.read_text())["cells"]] == ["drafter=dspark model.depth=1 seed=0"]

    assert run_sweep(resolve_config([*argv, f"paths.root={tmp_path / 'b'}"]), max_cells=2) == 0
    assert trained == [1, 2]  # checkout B trained only the second cell
    assert len(json.loads(path.read_text())["cells"]) == 2
    text = (reports / "depth.md").read_text()
    assert "imported from the sweep ledger: 1 of 2 completed cells" in text

    (reports / "depth.md").unlink()
    assert main([*argv, "stage=report", f"paths.root={tmp_path / 'c'}"]) == 0
    text = (reports / "depth.md").read_text()
    assert "imported from the sweep ledger: 2 of 2 completed cells" in text and "depth 2" in text
    assert trained == [1, 2]


def test_the_ledger_can_be_switched_off(tmp_path, monkeypatch, one_thread):
    reports = tmp_path / "reports"
    argv = ["sweep=depth", "stage=train", *FAST, f"paths.reports={reports}", "tracking.experiment=ledger-off",
            "tracking.sweep_ledger=false", f"paths.root={tmp_path / 'a'}"]
    assert run_sweep(resolve_config(argv), max_cells=1) == 0
    assert not (reports / "cells").exists()


def test_a_broken_ledger_stops_the_sweep_before_any_work(tmp_path, monkeypatch, capsys):
    reports = tmp_path / "reports"
    argv = ["sweep=depth", "stage=train", *FAST, f"paths.reports={reports}", "tracking.experiment=ledger-bad",
            f"paths.root={tmp_path / 'a'}"]
    digest = plan_grid(resolve_config(argv), load_sweep("depth")).sweep_hash
    path = cell_ledger.ledger_path(reports, experiment="ledger-bad", sweep="depth", sweep_hash=digest)
    path.parent.mkdir(parents=True)
    path.write_text("{broken")
    monkeypatch.setattr(train_stage, "run_train", lambda *a, **k: pytest.fail("trained despite a broken ledger"))
    assert run_sweep(resolve_config(argv), max_cells=1) == 2
    assert str(path) in capsys.readouterr().err
    assert not (tmp_path / "a" / "mlflow.db").exists()


def test_every_committed_ledger_still_matches_the_command_that_wrote_it():
    """A committed ledger is only imported under the hash its file name carries: a code change that moves the hash
    of an unchanged command (a new config key, say — `identity.HASH_NEUTRAL`) would orphan every recorded cell."""
    import shlex

    from dspark.config import repo_root
    from dspark.sweeps.driver import sweep_hash_of

    ledgers = sorted((repo_root() / "reports" / "cells").glob("*/*.json"))
    assert ledgers, "the repository ships the reference sweeps' ledgers"
    for path in ledgers:
        payload = json.loads(path.read_text())
        command = payload["cells"][0]["tags"]["command"]
        argv = shlex.split(command)[2:]  # after `python experiments/run.py`
        rc = resolve_config(argv)
        assert sweep_hash_of(rc, load_sweep(rc.cfg.sweep)) == payload["sweep_hash"], (path.name, command)


def test_a_key_at_its_neutral_value_keeps_the_hash_and_any_other_value_moves_it():
    from dspark.sweeps.identity import HASH_NEUTRAL

    spec = load_sweep("depth")
    base = plan_grid(resolve_config(["sweep=depth", "budget=smoke"]), spec, check=False).sweep_hash
    for key, neutral in HASH_NEUTRAL.items():
        same = plan_grid(resolve_config(["sweep=depth", "budget=smoke", f"{key}={neutral}"]), spec, check=False)
        assert same.sweep_hash == base, key
    other = plan_grid(resolve_config(["sweep=depth", "budget=smoke", "serve.sps_forward=engine"]), spec, check=False)
    assert other.sweep_hash != base
