"""Sweep files and the sweep driver: validation before anything runs, a smoke run of every sweep file's first cell
(tiny target, MLflow on), resume after a rerun and after an interruption, failed cells, command-line selection."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import dspark.stages.train as train_stage
from dspark.cli import main
from dspark.config import ConfigError, resolve_config
from dspark.config.resolve import available_sweeps
from dspark.sweeps import load_sweep, parse_sweep
from dspark.sweeps.driver import plan_grid, run_sweep

ALL_SWEEPS = [
    "main",
    "depth",
    "block_size",
    "head",
    "threshold",
    "calibration",
    "latency",
    "loss_weights",
    "rank",
    "serving",
    "objective",
    "tree",
    "confidence",
    "verifier",
    "scheduler_arms",
]
# optim.epochs=1: faster, and a training key of its own (drafters of other test files are never reused here)
FAST = ["budget=smoke", "optim.epochs=1", "decode.prompts_per_set=1", "decode.max_new_tokens=8"]


def _client(root: str) -> MlflowClient:
    return MlflowClient(f"sqlite:///{Path(root) / 'mlflow.db'}")


def _sweep_runs(root: str, experiment: str, sweep: str):
    client = _client(root)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], f"tags.`sweep.name` = '{sweep}'", max_results=1000)
    parents = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    cells = [r for r in runs if r.data.tags.get("sweep.role") == "cell"]
    return parents, cells


def _finished(cells) -> list[str]:
    return sorted(
        r.data.tags["cell"]
        for r in cells
        if r.info.status == "FINISHED" and r.data.tags.get("sweep.complete") == "true"
    )


def test_every_sweep_file_is_listed():
    assert available_sweeps() == sorted(ALL_SWEEPS)


@pytest.mark.parametrize("name", ALL_SWEEPS)
def test_sweep_file_validates_and_explains_itself(name):
    spec = load_sweep(name)
    first_lines = spec.text.splitlines()[:12]
    assert first_lines[0].startswith(f"# Sweep `{name}`")
    assert any(f"python experiments/run.py sweep={name}" in line for line in first_lines)
    assert any("Override" in line for line in first_lines)
    if spec.kind == "grid":
        rc = resolve_config(["budget=smoke", f"sweep={name}"])
        plan = plan_grid(rc, spec)
        assert plan.cells and len({pc.cell.key for pc in plan.cells}) == plan.total
    else:
        assert spec.optuna.defaults, "the paper's defaults must be enqueued"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("grid: [{model.depthh: [1, 2]}]", "model.depthh"),
        ("grid: [{model.depth: [1, two]}]", "model.depth"),
        ("grid: [{decode.threshold: [0.5, yes]}]", "decode.threshold"),
        ("fixed: {loss.alpha_cee: 1.0}\ngrid: [{model.depth: [1]}]", "loss.alpha_cee"),
        ("grid: [{paths.root: [/tmp]}]", "paths.root"),
        ("grid: [{model.depth: [1]}]\noptuna: {params: {}}", "exactly one"),
        ("optuna: {params: {loss.alpha_ce: {low: 0, high: 1}}, defaults: {loss.alpha_ce: 2.0}}", "outside"),
        ("grids: [{model.depth: [1]}]", "grids"),
    ],
)
def test_bad_sweep_files_name_the_problem(text, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        parse_sweep("bad", text)


def test_cell_configs_get_the_cli_checks_before_anything_runs():
    spec = parse_sweep("bad", "fixed: {decode.eval_sets: [gsm8kk]}\ngrid: [{model.depth: [1, 2]}]")
    with pytest.raises(ConfigError, match="(?s)cell 'model.depth=1 seed=0'.*gsm8kk"):
        plan_grid(resolve_config(["budget=smoke"]), spec)
    spec = parse_sweep("bad", "grid: [{drafter: [dflash], model.head: [markov]}]")
    with pytest.raises(ConfigError, match="drafter=dflash has no sequential head"):
        plan_grid(resolve_config(["budget=smoke"]), spec)


def test_unknown_sweep_exits_2(capsys, tmp_path):
    assert main(["sweep=no_such", f"paths.root={tmp_path}"]) == 2
    assert "no_such" in capsys.readouterr().err and not (tmp_path / "mlflow.db").exists()


def test_unreachable_tracking_server_fails_before_training(capsys, tmp_path):
    argv = ["sweep=depth", "budget=smoke", f"paths.root={tmp_path}", "tracking.uri=http://127.0.0.1:9"]
    assert main(argv) == 2
    assert "unreachable" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_multi_device_cells_are_refused(capsys, tmp_path):
    assert main(["sweep=head", "budget=smoke", f"paths.root={tmp_path}", "trainer.devices=2"]) == 2
    assert "one device" in capsys.readouterr().err


def test_command_line_axis_value_selects_cells_and_keeps_the_hash():
    spec = load_sweep("depth")
    full = plan_grid(resolve_config(["budget=smoke", "sweep=depth"]), spec)
    dflash = plan_grid(resolve_config(["budget=smoke", "sweep=depth", "drafter=dflash"]), spec)
    assert [pc.cell.axes["drafter"] for pc in dflash.cells] == ["dflash"] * len(spec.seeds)  # one per seed
    assert len(full.cells) == 6 * len(spec.seeds)
    assert dflash.sweep_hash == full.sweep_hash  # a subset resumes into the same parent
    other = plan_grid(resolve_config(["budget=smoke", "sweep=depth", "model.block_size=3"]), spec)
    assert other.sweep_hash != full.sweep_hash and all(pc.rc.cfg.model.block_size == 3 for pc in other.cells)
    with pytest.raises(ConfigError, match="model.depth=9"):
        plan_grid(resolve_config(["budget=smoke", "sweep=depth", "model.depth=9"]), spec)


def test_a_sweep_tag_starts_a_new_parent_and_an_empty_one_keeps_the_old_hash():
    """sweep_tag=NAME enters the sweep's identity and nothing else (re-measuring a timing sweep after a code change
    starts a fresh parent instead of resuming); the cells' training keys never see it."""
    from dspark.stages.context import training_key

    spec = load_sweep("depth")
    plain = plan_grid(resolve_config(["budget=smoke", "sweep=depth"]), spec)
    tagged = plan_grid(resolve_config(["budget=smoke", "sweep=depth", "sweep_tag=after-the-fix"]), spec)
    again = plan_grid(resolve_config(["budget=smoke", "sweep=depth", "sweep_tag=after-the-fix"]), spec)
    assert tagged.sweep_hash != plain.sweep_hash and again.sweep_hash == tagged.sweep_hash
    assert [training_key(pc.rc.cfg) for pc in tagged.cells] == [training_key(pc.rc.cfg) for pc in plain.cells]


@pytest.mark.parametrize("name", ALL_SWEEPS)
def test_smoke_first_cell_of_every_sweep(name, shared_root, one_thread):
    """First cell (first trial) of each sweep on the tiny target, MLflow on; a report is written."""
    experiment = f"smoke-{name}"
    argv = [f"sweep={name}", *FAST, f"paths.root={shared_root}", f"tracking.experiment={experiment}"]
    spec = load_sweep(name)
    argv += ["optuna.n_trials=1"] if spec.kind == "optuna" else []
    rc = resolve_config(argv)
    assert run_sweep(rc, max_cells=1) == 0
    parents, cells = _sweep_runs(shared_root, experiment, name)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(_finished(cells)) == 1
    child = cells[0]
    assert child.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
    assert child.data.tags["paper.ref"] == spec.paper_ref and "seed" in child.data.tags
    assert any(k.startswith("axis.") for k in child.data.tags)
    client = _client(shared_root)
    assert "config.yaml" in [a.path for a in client.list_artifacts(child.info.run_id)]
    assert {"sweep/cells.yaml", "sweep/sweep.yaml"} <= {
        a.path for a in client.list_artifacts(parents[0].info.run_id, "sweep")
    }
    report = Path(rc.cfg.paths.reports) / f"{name}.md"
    assert report.exists() and "parent run" in report.read_text()
    assert f"report/{name}.md" in [a.path for a in client.list_artifacts(parents[0].info.run_id, "report")]
    metrics = child.data.metrics
    expected = {"latency": "summary/round_ms", "serving": "serve/throughput"}.get(name, "summary/tau")
    assert expected in metrics, sorted(metrics)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit], ids=["ctrl-c", "lightning-exit"])
def test_rerun_and_interrupted_sweep_resume_without_duplicates(interrupt, shared_root, monkeypatch, one_thread, capsys):
    experiment = f"resume-{interrupt.__name__}"
    argv = ["sweep=depth", "stage=train", *FAST, f"paths.root={shared_root}", f"tracking.experiment={experiment}"]
    real_train, calls = train_stage.run_train, []

    def interrupt_second(ctx, data):
        calls.append(ctx.cfg.model.depth)
        if len(calls) == 2:
            raise interrupt()
        return real_train(ctx, data)

    monkeypatch.setattr(train_stage, "run_train", interrupt_second)
    assert run_sweep(resolve_config(argv), max_cells=3) == 130
    assert "resume" in capsys.readouterr().err
    parents, cells = _sweep_runs(shared_root, experiment, "depth")
    assert parents[0].info.status == "KILLED" and _finished(cells) == ["drafter=dspark model.depth=1 seed=0"]
    assert sorted(r.info.status for r in cells) == ["FINISHED", "KILLED"]

    monkeypatch.setattr(train_stage, "run_train", real_train)
    assert run_sweep(resolve_config(argv), max_cells=3) == 0
    assert run_sweep(resolve_config(argv), max_cells=3) == 0  # a plain rerun: nothing new
    parents, cells = _sweep_runs(shared_root, experiment, "depth")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    done = _finished(cells)
    assert len(done) == len(set(done)) == 3
    assert sum(r.info.status == "FINISHED" for r in cells) == 3


def test_a_supervision_fix_starts_a_new_sweep_instead_of_resuming_cells_trained_before_it(
    shared_root, monkeypatch, one_thread, tmp_path
):
    """Bumping SUPERVISION_VERSION moves every training key; the sweep must retrain under a new parent (and the
    report read it), not count the old parent's cells as done."""
    import dspark.stages.context as context

    experiment = "supervision-bump"
    argv = ["sweep=depth", "stage=train", *FAST, f"paths.root={shared_root}", f"tracking.experiment={experiment}"]
    real_train, trained = train_stage.run_train, []

    def counting(ctx, data):
        trained.append(context.training_key(ctx.cfg))
        return real_train(ctx, data)

    monkeypatch.setattr(train_stage, "run_train", counting)
    assert run_sweep(resolve_config(argv), max_cells=1) == 0
    assert run_sweep(resolve_config(argv), max_cells=1) == 0  # same supervision: resumed, nothing retrained
    assert len(trained) == 1
    old_hash = plan_grid(resolve_config(argv), load_sweep("depth")).sweep_hash

    monkeypatch.setattr(context, "SUPERVISION_VERSION", context.SUPERVISION_VERSION + 1)
    new_hash = plan_grid(resolve_config(argv), load_sweep("depth")).sweep_hash
    assert new_hash != old_hash
    assert run_sweep(resolve_config(argv), max_cells=1) == 0
    assert len(trained) == 2 and trained[1] != trained[0]  # the cell was trained again, under its new key
    parents, cells = _sweep_runs(shared_root, experiment, "depth")
    assert sorted(p.data.tags["sweep.hash"] for p in parents) == sorted([old_hash, new_hash])
    new_parent = next(p for p in parents if p.data.tags["sweep.hash"] == new_hash).info.run_id
    assert [c.data.tags["training.key"] for c in cells if c.data.tags["mlflow.parentRunId"] == new_parent] == [
        trained[1]
    ]

    report = [
        "sweep=depth",
        "stage=report",
        *FAST,
        f"paths.root={shared_root}",
        f"paths.reports={tmp_path}",
        f"tracking.experiment={experiment}",
    ]
    assert main(report) == 0
    assert f"sweep.hash = {new_hash}" in (tmp_path / "depth.md").read_text()


def test_a_supervision_fix_starts_a_new_optuna_study(monkeypatch):
    import dspark.stages.context as context
    from dspark.sweeps.optuna_search import search_hash

    rc, spec = resolve_config(["sweep=rank", "budget=smoke"]), load_sweep("rank")
    before = search_hash(rc, spec)
    assert search_hash(rc, spec) == before
    monkeypatch.setattr(context, "SUPERVISION_VERSION", context.SUPERVISION_VERSION + 1)
    assert search_hash(rc, spec) != before


def test_failed_cell_is_marked_and_the_sweep_goes_on(shared_root, monkeypatch, one_thread, capsys):
    experiment = "failing"
    argv = ["sweep=head", "stage=train", *FAST, f"paths.root={shared_root}", f"tracking.experiment={experiment}"]
    real_train = train_stage.run_train

    def fail_markov(ctx, data):
        if ctx.cfg.model.head == "markov":
            raise RuntimeError("boom in the markov cell")
        return real_train(ctx, data)

    monkeypatch.setattr(train_stage, "run_train", fail_markov)
    assert run_sweep(resolve_config(argv), max_cells=4) == 1  # the first seed's four heads
    assert "boom in the markov cell" in capsys.readouterr().err
    _, cells = _sweep_runs(shared_root, experiment, "head")
    status = {r.data.tags["cell"]: r.info.status for r in cells}
    assert status == {
        "model.head=none seed=0": "FINISHED",
        "model.head=markov seed=0": "FAILED",
        "model.head=gated seed=0": "FINISHED",
        "model.head=rnn seed=0": "FINISHED",
    }
    monkeypatch.setattr(train_stage, "run_train", real_train)
    assert run_sweep(resolve_config(argv), max_cells=4) == 0  # only the failed cell runs again
    _, cells = _sweep_runs(shared_root, experiment, "head")
    assert len(_finished(cells)) == 4 and len(cells) == 5


def test_report_of_a_sweep_without_finished_runs_refuses_and_writes_nothing(shared_root, tmp_path, capsys):
    argv = [
        "sweep=threshold",
        "stage=report",
        "budget=smoke",
        f"paths.root={shared_root}",
        f"paths.reports={tmp_path}",
        "tracking.experiment=empty",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "sweep `threshold` has no finished cell" in err and "python experiments/run.py sweep=threshold" in err
    assert not (tmp_path / "threshold.md").exists()
    client = _client(shared_root)
    assert not client.search_runs([client.get_experiment_by_name("empty").experiment_id])  # nothing ran


def _fake_cells(monkeypatch, store, on_run):
    """Replace the cell runner by one that only opens the cell's child run (what `run_experiment` does first) and
    calls `on_run(cell_index)`: the claim protocol is tested without training anything."""
    import dspark.sweeps.driver as driver

    def runner(rc, *, parent_run_id, extra_tags):
        run = store.create_run(run_name="fake", tags=extra_tags, parent_run_id=parent_run_id)
        on_run(int(extra_tags["cell.index"]))
        store.finish(run)
        return 0

    monkeypatch.setattr(driver, "cell_runner", lambda spec: runner)


@pytest.mark.parametrize("other_finishes", [True, False], ids=["other-process-finishes", "other-process-dies"])
def test_processes_of_one_sweep_split_the_cells_by_claims(other_finishes, tmp_path, monkeypatch):
    """A cell claimed by another process is passed over, then waited for: skipped when that process finished it,
    run here when it let go without finishing (it died). Two FileLock objects conflict like two processes (flock)."""
    from dspark.sweeps.driver import cell_claim
    from dspark.tracking import open_store
    from dspark.tracking.runs import COMPLETE_TAG, cell_tags, find_parent

    argv = ["sweep=depth", "stage=train", *FAST, f"paths.root={tmp_path}", "tracking.experiment=claims"]
    rc = resolve_config(argv)
    plan = plan_grid(rc, load_sweep("depth"))
    store = open_store(rc.cfg)
    other = cell_claim(rc, plan.sweep_hash, 0)
    other.acquire()  # "the other process" is running cell 0
    ran = []

    def on_run(index):
        ran.append(index)
        if index == 2:  # the last cell here: the other process now finishes (or dies) and lets go of cell 0
            if other_finishes:
                parent = find_parent(store, sweep="depth", sweep_hash=plan.sweep_hash).info.run_id
                cell = plan.cells[0].cell
                tags = cell_tags(
                    sweep="depth",
                    sweep_hash=plan.sweep_hash,
                    paper_ref="Fig. 3",
                    index=0,
                    key=cell.key,
                    axes=cell.axes,
                    attempt="other",
                )
                run = store.create_run(run_name="other", tags=tags | {COMPLETE_TAG: "true"}, parent_run_id=parent)
                store.finish(run)
            other.release()

    _fake_cells(monkeypatch, store, on_run)
    assert run_sweep(rc, max_cells=3) == 0
    assert ran == ([1, 2] if other_finishes else [1, 2, 0])  # cell 0 passed over first, never run twice
    parents, cells = _sweep_runs(str(tmp_path), "claims", "depth")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(_finished(cells)) == 3 == len(cells)


@pytest.mark.slow
def test_two_processes_of_one_sweep_command_run_each_cell_once(tmp_path):
    """Two real processes started with the same sweep command on one store split its cells: every cell finishes once,
    no cell is run by both."""
    import os
    import subprocess
    import sys

    argv = [
        "sweep=head",
        "stage=train",
        *FAST,
        "sweep.seeds=[0]",
        "sweep.axes.model.head=[none,markov,rnn]",
        f"paths.root={tmp_path}",
        "tracking.experiment=spread",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = "import sys; from dspark.cli import main; sys.exit(main(sys.argv[1:]))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    parents, cells = _sweep_runs(str(tmp_path), "spread", "head")
    assert len(parents) == 1
    assert _finished(cells) == ["model.head=markov seed=0", "model.head=none seed=0", "model.head=rnn seed=0"]
    assert len(cells) == 3  # no cell was attempted twice


@pytest.mark.slow
def test_workers_on_two_machines_sharing_one_store_run_each_cell_once(tmp_path):
    """Two workers with their own paths.root (two machines: no shared file locks, caches or ledgers) and one shared
    tracking store: the store claims split the cells, one parent run, every cell finished once."""
    import os
    import subprocess
    import sys

    shared = f"sqlite:///{tmp_path / 'server.db'}"
    argv = [
        "sweep=head",
        "stage=train",
        *FAST,
        "sweep.seeds=[0]",
        "sweep.axes.model.head=[none,markov,rnn]",
        f"tracking.uri={shared}",
        "tracking.experiment=machines",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = "import sys; from dspark.cli import main; sys.exit(main(sys.argv[1:]))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *argv, f"paths.root={tmp_path / f'machine{i}'}"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    client = MlflowClient(shared)
    runs = client.search_runs(
        [client.get_experiment_by_name("machines").experiment_id], "tags.`sweep.name` = 'head'", max_results=100
    )
    assert len([r for r in runs if r.data.tags.get("sweep.role") == "parent"]) == 1
    cells = [r for r in runs if r.data.tags.get("sweep.role") == "cell"]
    assert _finished(cells) == ["model.head=markov seed=0", "model.head=none seed=0", "model.head=rnn seed=0"]
    assert len(cells) == 3
