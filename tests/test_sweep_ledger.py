"""The sweep ledger (`dspark.tracking.ledger`) and the sweep's identity (`dspark.sweeps.identity`): finished cells
recorded under paths.root, imported into a store that lacks them — a sweep resumes, grows and regenerates its report
from another checkout or machine; a changed default keeps the sweep and lists the drifted cells."""

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

IDENTITY = {"sweep": "depth", "budget": "smoke", "overrides": [], "recipe": 1, "supervision": 1, "runner": "experiment"}

FAST = ["budget=smoke", "optim.epochs=1", "decode.prompts_per_set=1", "decode.max_new_tokens=8"]


def _store(root: Path, experiment: str = "ledger"):
    return open_store(resolve_config([f"paths.root={root}", f"tracking.experiment={experiment}"]).cfg)


def _parent(store, sweep: str = "depth", digest: str = "abc123") -> str:
    return open_parent(store, sweep=sweep, sweep_hash=digest, tags={"budget": "smoke"})[0]


def _cell(store, parent: str, index: int, *, done: bool = True, tau: float = 1.25) -> str:
    tags = cell_tags(
        sweep="depth",
        sweep_hash="abc123",
        paper_ref="Fig. 3",
        index=index,
        key=f"model.depth={index + 1} seed=0",
        axes={"model.depth": index + 1},
        attempt=f"a{index}",
    )
    run = store.create_run(
        run_name=f"dspark-markov-d{index + 1}", tags=tags | {"machine": f"box {index}"}, parent_run_id=parent
    )
    store.client.log_param(run, "model.depth", str(index + 1))
    store.client.log_param(run, "paths.root", "/somewhere/on/one/machine")
    store.log_metrics(run, {"summary/tau": tau + index, "val/tau_prob": 1.5})
    if done:
        store.client.set_tag(run, COMPLETE_TAG, "true")
    store.finish(run, status="FINISHED" if done else "FAILED")
    return run


def _record(store, parent: str, path: Path) -> int:
    done = set(done_cells(children(store, parent)).values())
    return cell_ledger.record_cells(
        [r for r in children(store, parent) if r.info.run_id in done],
        path,
        sweep="depth",
        sweep_hash="abc123",
        identity=IDENTITY,
    )


def test_record_then_import_into_an_empty_store_carries_tags_params_and_metrics(tmp_path):
    source = _store(tmp_path / "a")
    parent = _parent(source)
    first = _cell(source, parent, 0)
    _cell(source, parent, 1, done=False)  # a failed cell is not recorded
    path = cell_ledger.ledger_path(tmp_path / "outputs", experiment="ledger", sweep="depth", sweep_hash="abc123")
    assert path == tmp_path / "outputs" / "ledgers" / "ledger" / "depth-abc123.json"
    assert _record(source, parent, path) == 1
    data = json.loads(path.read_text())
    assert data["format"] == "dspark-sweep-ledger" and [c["cell"] for c in data["cells"]] == ["model.depth=1 seed=0"]
    assert data["identity"] == IDENTITY and "/somewhere" not in path.read_text()  # no machine's path recorded
    assert "sweep.attempt" not in data["cells"][0]["tags"] and data["cells"][0]["run_id"] == first

    target = _store(tmp_path / "b")
    new_parent = _parent(target)
    assert cell_ledger.import_cells(target, new_parent, path, sweep="depth", sweep_hash="abc123") == [
        "model.depth=1 seed=0"
    ]
    (run,) = children(target, new_parent)
    assert run.info.status == "FINISHED" and run.data.tags[COMPLETE_TAG] == "true"
    assert run.data.tags["machine"] == "box 0" and run.data.tags["axis.model.depth"] == "1"
    assert run.data.tags[cell_ledger.RUN_ID_TAG] == first and run.data.tags[cell_ledger.SOURCE_TAG] == path.name
    assert run.data.params == {"model.depth": "1"}
    assert run.data.metrics == {"summary/tau": 1.25, "val/tau_prob": 1.5}
    assert run.info.run_name == "dspark-markov-d1"
    # importing again adds nothing; recording from the importing store keeps the original run id
    assert cell_ledger.import_cells(target, new_parent, path, sweep="depth", sweep_hash="abc123") == []
    assert len(done_cells(children(target, new_parent))) == 1
    written = path.read_text()
    assert _record(target, new_parent, path) == 1
    assert path.read_text() == written  # an imported cell is recorded back unchanged (times, run id and all)


def test_record_merges_with_the_file_and_import_skips_cells_the_store_finished(tmp_path):
    path = tmp_path / "cells" / "depth-abc123.json"
    a = _store(tmp_path / "a")
    parent_a = _parent(a)
    _cell(a, parent_a, 0, tau=1.1)
    _record(a, parent_a, path)
    b = _store(tmp_path / "b")
    parent_b = _parent(b)
    _cell(b, parent_b, 1, tau=1.2)  # another machine finished the second cell
    assert _record(b, parent_b, path) == 2  # merged
    cells = json.loads(path.read_text())["cells"]
    assert [c["cell"] for c in cells] == ["model.depth=1 seed=0", "model.depth=2 seed=0"]  # by cell index
    assert cell_ledger.import_cells(b, parent_b, path, sweep="depth", sweep_hash="abc123") == ["model.depth=1 seed=0"]
    assert sorted(done_cells(children(b, parent_b))) == ["model.depth=1 seed=0", "model.depth=2 seed=0"]


V2 = '"format": "dspark-sweep-ledger", "version": 2, "identity": {}'


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{not json", "unreadable"),
        ('{"format": "other"}', "not a sweep ledger"),
        ('{"format": "dspark-sweep-ledger", "version": 99}', "version 99"),
        ('{"format": "dspark-sweep-ledger", "version": 1, "cells": []}', "python -m dspark.sweeps.migrate"),
        ("{" + V2 + ', "sweep": "head", "sweep_hash": "abc123", "cells": []}', "records sweep 'head'"),
        ("{" + V2 + ', "sweep": "depth", "sweep_hash": "abc123", "cells": [1]}', "must be a list"),
    ],
)
def test_a_file_that_is_not_this_sweeps_ledger_is_refused_with_the_fix(tmp_path, text, needle):
    path = tmp_path / "depth-abc123.json"
    path.write_text(text)
    with pytest.raises(cell_ledger.LedgerError, match=needle) as err:
        cell_ledger.read_ledger(path, sweep="depth", sweep_hash="abc123")
    assert str(path) in str(err.value)


@pytest.mark.slow
def test_a_sweep_goes_on_from_another_checkout_and_its_report_regenerates(tmp_path, monkeypatch, one_thread):
    """Checkout A runs the first cell; checkout B (an empty store, A's ledger committed as results/depth/ledger.json)
    imports it, runs only the second and reports both; the report regenerates from B's ledger alone, the same twice
    apart from its date line; `stage=report` on an empty store refuses and leaves an existing report untouched."""
    import dspark.sweeps.driver as driver

    committed = tmp_path / "results" / "depth" / "ledger.json"
    monkeypatch.setattr(driver, "results_ledger", lambda sweep: tmp_path / "results" / sweep / "ledger.json")
    argv = ["sweep=depth", *FAST, "tracking.experiment=ledger-e2e"]
    real_train, trained = train_stage.run_train, []

    def counting(ctx, data):
        trained.append(ctx.cfg.model.depth)
        return real_train(ctx, data)

    monkeypatch.setattr(train_stage, "run_train", counting)
    assert run_sweep(resolve_config([*argv, f"paths.root={tmp_path / 'a'}"]), max_cells=1) == 0
    digest = plan_grid(resolve_config(argv), load_sweep("depth")).sweep_hash
    path = cell_ledger.ledger_path(tmp_path / "a", experiment="ledger-e2e", sweep="depth", sweep_hash=digest)
    assert [c["cell"] for c in json.loads(path.read_text())["cells"]] == ["drafter=dspark model.depth=1 seed=0"]
    committed.parent.mkdir(parents=True)
    committed.write_text(path.read_text())

    assert run_sweep(resolve_config([*argv, f"paths.root={tmp_path / 'b'}"]), max_cells=2) == 0
    assert trained == [1, 2]  # checkout B trained only the second cell
    b_ledger = cell_ledger.ledger_path(tmp_path / "b", experiment="ledger-e2e", sweep="depth", sweep_hash=digest)
    assert len(json.loads(b_ledger.read_text())["cells"]) == 2
    text = (tmp_path / "b" / "reports" / "depth.md").read_text()
    assert "imported from the sweep ledger: 1 of 2 completed cells" in text and str(tmp_path) not in text

    first = driver.regenerate_from_ledger(b_ledger, out_dir=tmp_path / "r1", work_dir=tmp_path / "w1")
    second = driver.regenerate_from_ledger(b_ledger, out_dir=tmp_path / "r2", work_dir=tmp_path / "w2")
    undated = [[ln for ln in p.read_text().splitlines() if not ln.startswith("- generated:")] for p in (first, second)]
    assert undated[0] == undated[1] and "depth 2" in first.read_text() and str(tmp_path) not in first.read_text()
    assert (tmp_path / "r1" / "depth.claims.json").exists() and trained == [1, 2]

    reports = tmp_path / "kept"
    reports.mkdir()
    (reports / "depth.md").write_text("a report we must not lose\n")
    committed.unlink()
    code = main(
        [
            "sweep=depth",
            *FAST,
            "stage=report",
            "tracking.experiment=empty",
            f"paths.root={tmp_path / 'c'}",
            f"paths.reports={reports}",
        ]
    )
    assert code == 2 and (reports / "depth.md").read_text() == "a report we must not lose\n"


def test_a_changed_default_keeps_the_sweep_and_reruns_only_the_drifted_cells(tmp_path, monkeypatch, one_thread):
    """A default that is not an explicit override changes: the identity (hash, parent, ledger) stays; the report lists
    the finished cells as recorded under an older recipe with the key; a rerun redoes only those cells."""
    import shutil

    import dspark.config.resolve as resolve

    argv = [
        "sweep=head",
        "stage=train",
        *FAST,
        "sweep.seeds=[0]",
        "sweep.axes.model.head=[none,markov]",
        f"paths.root={tmp_path}",
        "tracking.experiment=drift",
    ]
    real_train, trained = train_stage.run_train, []
    monkeypatch.setattr(
        train_stage, "run_train", lambda ctx, data: trained.append(ctx.cfg.model.head) or real_train(ctx, data)
    )
    assert run_sweep(resolve_config(argv)) == 0 and trained == ["none", "markov"]
    before = plan_grid(resolve_config(argv), load_sweep("head")).sweep_hash

    experiments = tmp_path / "experiments"
    shutil.copytree(resolve.experiments_dir(), experiments)
    default = experiments / "default.yaml"
    default.write_text(default.read_text().replace("alpha_tv: 0.9", "alpha_tv: 0.8"))
    monkeypatch.setattr(resolve, "experiments_dir", lambda: experiments)
    assert plan_grid(resolve_config(argv), load_sweep("head")).sweep_hash == before

    assert main([*argv, "stage=report"]) == 0
    text = (tmp_path / "reports" / "head.md").read_text()
    assert "## Recorded under an older recipe" in text and "`loss.alpha_tv`" in text
    assert "model.head=markov seed=0" in text.split("## Recorded under an older recipe")[1]
    trained.clear()
    assert run_sweep(resolve_config(argv)) == 0
    assert trained == ["none", "markov"]  # both read loss.alpha_tv (none keeps DSpark's loss): both rerun, once
    assert run_sweep(resolve_config(argv)) == 0 and trained == ["none", "markov"]
    text = (tmp_path / "reports" / "head.md").read_text()
    assert "Recorded under an older recipe" not in text


def test_a_grown_axis_reuses_finished_cells_in_the_same_parent(tmp_path, monkeypatch, one_thread):
    from dspark.tracking.runs import search_all, tag_filter

    base = ["sweep=head", "stage=train", *FAST, "sweep.seeds=[0]", f"paths.root={tmp_path}", "tracking.experiment=grow"]
    real_train, trained = train_stage.run_train, []
    monkeypatch.setattr(
        train_stage, "run_train", lambda ctx, data: trained.append(ctx.cfg.model.head) or real_train(ctx, data)
    )
    assert run_sweep(resolve_config([*base, "sweep.axes.model.head=[none]"])) == 0
    assert run_sweep(resolve_config([*base, "sweep.axes.model.head=[none,rnn]"])) == 0
    assert trained == ["none", "rnn"]  # the finished cell was reused; only the new one ran
    store = open_store(resolve_config(base).cfg)
    parents = search_all(store, tag_filter(**{"sweep.name": "head", "sweep.role": "parent"}))
    assert len(parents) == 1 and len(children(store, parents[0].info.run_id)) == 2
    assert "rnn" in (tmp_path / "reports" / "head.md").read_text()


@pytest.mark.parametrize(
    "arg, needle",
    [
        ("sweep.axes.model.depth=[1]", "sweep=head has no axis 'model.depth'"),
        ("sweep.axes.model.head=[]", "at least one value"),
        ("sweep.axes.model.head=[nonsense]", "nonsense"),
        ("sweep.seeds=[]", "at least one seed"),
    ],
)
def test_a_bad_growth_argument_names_itself_and_the_fix(arg, needle):
    from dspark.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        plan_grid(resolve_config(["sweep=head", "budget=smoke", arg]), load_sweep("head"), check=False)


def test_growth_arguments_need_a_sweep(capsys):
    assert main(["budget=smoke", "sweep.axes.model.head=[none]"]) == 2
    assert "add sweep=NAME" in capsys.readouterr().err


def test_the_ledger_can_be_switched_off(tmp_path, monkeypatch, one_thread):
    argv = [
        "sweep=depth",
        "stage=train",
        *FAST,
        "tracking.experiment=ledger-off",
        "tracking.sweep_ledger=false",
        f"paths.root={tmp_path / 'a'}",
    ]
    assert run_sweep(resolve_config(argv), max_cells=1) == 0
    assert not (tmp_path / "a" / "ledgers").exists()


def test_a_broken_ledger_stops_the_sweep_before_any_work(tmp_path, monkeypatch, capsys):
    argv = ["sweep=depth", "stage=train", *FAST, "tracking.experiment=ledger-bad", f"paths.root={tmp_path / 'a'}"]
    digest = plan_grid(resolve_config(argv), load_sweep("depth")).sweep_hash
    path = cell_ledger.ledger_path(tmp_path / "a", experiment="ledger-bad", sweep="depth", sweep_hash=digest)
    path.parent.mkdir(parents=True)
    path.write_text("{broken")
    monkeypatch.setattr(train_stage, "run_train", lambda *a, **k: pytest.fail("trained despite a broken ledger"))
    assert run_sweep(resolve_config(argv), max_cells=1) == 2
    assert str(path) in capsys.readouterr().err
    assert not (tmp_path / "a" / "mlflow.db").exists()


def test_every_committed_ledger_names_the_identity_its_command_has_today():
    """A committed ledger is imported only under the identity it records: a code change that moved the identity of
    an unchanged command (say a default entering it) would orphan every recorded cell."""
    from dspark.config import repo_root

    ledgers = sorted((repo_root() / "results").glob("*/ledger.json"))
    assert ledgers, "the repository ships the reference sweeps' ledgers"
    for path in ledgers:
        payload = json.loads(path.read_text())
        identity = payload["identity"]
        argv = [f"sweep={payload['sweep']}", f"budget={identity['budget']}", *identity["overrides"]]
        plan = plan_grid(resolve_config(argv), load_sweep(payload["sweep"]), check=False)
        assert plan.identity == identity and plan.sweep_hash == payload["sweep_hash"], path


def test_the_identity_is_what_the_user_asked_for():
    """A default is not part of a sweep's identity; an explicit override, the budget and a recipe bump are; paths,
    tracking and axis selections are not."""
    import dspark.sweeps.identity as identity

    spec = load_sweep("depth")

    def digest(*args: str) -> str:
        return plan_grid(resolve_config(["sweep=depth", "budget=smoke", *args]), spec, check=False).sweep_hash

    base = digest()
    assert digest("paths.root=/elsewhere", "tracking.experiment=x", "drafter=dflash") == base
    assert digest("serve.sps_forward=plain") != base  # explicit, even at the default value: what the user asked for
    assert digest("model.block_size=3") != base and digest("sweep_tag=x") != base
    assert plan_grid(resolve_config(["sweep=depth", "budget=cpu"]), spec, check=False).sweep_hash != base
    bumped = identity.RECIPE_VERSION + 1
    try:
        identity.RECIPE_VERSION = bumped
        assert digest() != base
    finally:
        identity.RECIPE_VERSION = bumped - 1


def test_a_run_from_a_committed_tree_redoes_the_cells_recorded_from_a_dirty_one(tmp_path, monkeypatch):
    """Cells recorded from a tree with uncommitted changes stand in a report, but a sweep run from a committed tree
    redoes them (and only them), so the record becomes reproducible from a commit."""
    import dspark.sweeps.driver as driver

    argv = ["sweep=depth", "stage=train", *FAST, f"paths.root={tmp_path}", "tracking.experiment=dirty"]
    rc = resolve_config(argv)
    plan = plan_grid(rc, load_sweep("depth"))
    store = open_store(rc.cfg)
    parent, _ = open_parent(store, sweep="depth", sweep_hash=plan.sweep_hash, tags={"budget": "smoke"})
    for index, dirty in ((0, "True"), (1, "False")):
        cell = plan.cells[index].cell
        tags = cell_tags(
            sweep="depth",
            sweep_hash=plan.sweep_hash,
            paper_ref="Fig. 3",
            index=index,
            key=cell.key,
            axes=cell.axes,
            attempt=f"old{index}",
        )
        run = store.create_run(
            run_name="old", tags=tags | {COMPLETE_TAG: "true", "git.dirty": dirty}, parent_run_id=parent
        )
        store.finish(run)
    ran = []

    def runner(rc, *, parent_run_id, extra_tags):
        ran.append(int(extra_tags["cell.index"]))
        store.finish(store.create_run(run_name="new", tags=extra_tags, parent_run_id=parent_run_id))
        return 0

    monkeypatch.setattr(driver, "cell_runner", lambda spec: runner)
    monkeypatch.setattr(driver, "committed_tree", lambda: False)
    assert run_sweep(rc, max_cells=2) == 0 and ran == []  # a dirty tree keeps every record
    monkeypatch.setattr(driver, "committed_tree", lambda: True)
    assert run_sweep(rc, max_cells=2) == 0 and ran == [0]  # a committed tree redoes the dirty record only
