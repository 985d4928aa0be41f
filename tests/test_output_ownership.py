"""Never destroy what we did not write (issue 57): every output location a user can point somewhere is new, empty or
holds our own earlier output, else it is refused before any work, naming the location, what is in it and the fix;
and what export logs to MLflow is exactly the files it wrote.

One test (or pair) per writer: the export (CLI and library), the sweep and evaluation reports, paths.root, the
stores named by path, results/ (index, READMEs, regenerated files, published ledgers) and the benchmarks' --output /
--cache-dir. Each refusal leaves the foreign files byte for byte; each has a control where our own earlier output
(marked, or from before markers) and a fresh directory are accepted.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from dspark.cli import main
from dspark.config import repo_root, resolve_config
from dspark.files import (
    OUTPUT_MARKER,
    ForeignOutputError,
    claim_output_dir,
    is_report_entry,
    output_dir_error,
    output_file_error,
    read_marker,
)
from dspark.interop import export_drafter
from dspark.reports import build_report
from dspark.results.__main__ import main as results_main
from dspark.results.build import build
from dspark.results.publish import publish
from dspark.results.regenerate import write_files
from dspark.stages.context import RunPaths, StageContext
from dspark.stages.evaluate import claimed_report_paths, report_paths
from dspark.stages.outputs import claim_output_locations, in_default_root, output_location_errors, store_file_errors
from dspark.sweeps import load_sweep

BENCHMARKS = repo_root() / "benchmarks"
TRAIN = ["budget=smoke", "optim.epochs=1"]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (names relative to it) → sha256 of its bytes."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def foreign_model(path: Path) -> Path:
    """Someone's model directory: a config, weights and a README."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (path / "model.safetensors").write_bytes(b"their weights" * 100)
    (path / "README.md").write_text("# Their model\n")
    return path


def foreign_notes(path: Path) -> Path:
    """Someone's notes, among them a `depth.md` (the name of a sweep report)."""
    path.mkdir(parents=True)
    (path / "depth.md").write_text("# my notes on depth\n")
    (path / "todo.txt").write_text("buy milk\n")
    return path


# --- the rule (dspark.files) --------------------------------------------------------------------------------------


def test_a_new_empty_or_marked_directory_is_claimed_and_a_foreign_one_refused(tmp_path):
    fresh = claim_output_dir(tmp_path / "new" / "dir", key="x.dir", kind="export")
    assert read_marker(fresh) == {"written_by": "dspark-lab", "kinds": ["export"]}
    (fresh / "anything.txt").write_text("added later by hand")
    assert claim_output_dir(fresh, key="x.dir", kind="reports") == fresh  # marked: what it holds now is ours
    assert read_marker(fresh)["kinds"] == ["export", "reports"]
    (tmp_path / "empty").mkdir()
    claim_output_dir(tmp_path / "empty", key="x.dir", kind="export")

    notes = foreign_notes(tmp_path / "notes")
    before = snapshot(notes)
    with pytest.raises(ForeignOutputError) as err:
        claim_output_dir(notes, key="x.dir", kind="export")
    message = str(err.value)
    assert f"x.dir={notes}" in message and "depth.md" in message and "todo.txt" in message
    assert "new or empty directory" in message and snapshot(notes) == before  # no marker either

    (tmp_path / "file").write_text("a file")
    assert "is a file, not a directory" in output_dir_error(tmp_path / "file", key="x.dir")


def test_output_from_before_markers_is_recognised_by_its_entries(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "ours.md").write_text("# Sweep `depth`\n")
    assert output_dir_error(old, key="x", ours=lambda p: p.name == "ours.md") is None
    assert output_dir_error(old, key="x") is not None


def test_a_single_file_is_overwritten_only_when_ours(tmp_path):
    ours, theirs = tmp_path / "ours.md", tmp_path / "theirs.md"
    ours.write_text("# Sweep `depth`\n")
    theirs.write_text("their text\n")

    def recognise(path: Path) -> bool:
        return path.read_text().startswith("# Sweep")

    assert output_file_error(tmp_path / "new.md", key="--output", ours=recognise) is None
    assert output_file_error(ours, key="--output", ours=recognise) is None
    message = output_file_error(theirs, key="--output", ours=recognise)
    assert f"--output={theirs}" in message and "did not write" in message and "new file" in message
    assert "is a directory" in output_file_error(tmp_path, key="--output", ours=recognise)


# --- stage=export ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(shared_root) -> Path:
    """A trained tiny run (shared with the other CLI tests of the session)."""
    root = Path(shared_root)
    assert main(["stage=train", *TRAIN, f"paths.root={root}"]) == 0
    return next(p.parent for p in (root / "runs").glob("*/drafter.pt") if (p.parent / "config.yaml").is_file())


def _export(shared_root, run_dir: Path, out: Path) -> int:
    return main(
        [
            "stage=export",
            "budget=smoke",
            f"paths.root={shared_root}",
            f"export.run_dir={run_dir}",
            f"export.out_dir={out}",
        ]
    )


def test_export_into_someones_model_directory_is_refused_before_loading(
    shared_root, trained_run, tmp_path, monkeypatch, capsys
):
    model = foreign_model(tmp_path / "their-model")
    before = snapshot(model)
    monkeypatch.setattr(StageContext, "load_target", lambda self: pytest.fail("the target was loaded"))
    assert _export(shared_root, trained_run, model) == 2
    err = capsys.readouterr().err
    assert f"export.out_dir={model}" in err and "config.json" in err and "holds no output of ours" in err
    assert snapshot(model) == before


def test_export_reruns_into_its_own_directory_and_logs_exactly_the_files_it_wrote(
    shared_root, trained_run, tmp_path, one_thread
):
    out = tmp_path / "export"
    assert _export(shared_root, trained_run, out) == 0
    assert read_marker(out)["kinds"] == ["export"]
    (out / "notes.txt").write_text("my notes beside the export\n")  # in a directory marked ours
    assert _export(shared_root, trained_run, out) == 0
    assert (out / "notes.txt").read_text() == "my notes beside the export\n"
    client = MlflowClient(f"sqlite:///{Path(shared_root) / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("dspark-lab")
    runs = client.search_runs(
        [experiment.experiment_id], filter_string="tags.stage = 'export'", order_by=["attributes.start_time DESC"]
    )
    logged = {a.path for a in client.list_artifacts(runs[0].info.run_id, "export/deepspec")}
    assert logged == {"export/deepspec/config.json", "export/deepspec/model.safetensors"}

    (out / OUTPUT_MARKER).unlink()  # an export from before markers: config.json + weights, nothing else
    (out / "notes.txt").unlink()
    assert _export(shared_root, trained_run, out) == 0


def test_the_export_library_call_refuses_a_foreign_directory_first(tmp_path):
    model = foreign_model(tmp_path / "their-model")
    before = snapshot(model)
    with pytest.raises(ForeignOutputError, match="export.out_dir"):
        export_drafter(None, None, None, model)  # refused before the drafter is even looked at
    assert snapshot(model) == before


# --- reports ----------------------------------------------------------------------------------------------------------


def test_a_sweep_report_never_replaces_someones_file(tmp_path):
    runs = SimpleNamespace(empty=False, every_child=None)  # the refusal comes before any builder reads the runs
    notes = foreign_notes(tmp_path / "notes")
    before = snapshot(notes)
    with pytest.raises(ForeignOutputError, match="paths.reports"):
        build_report(runs, spec=load_sweep("depth"), out_dir=notes, provenance=None)
    assert snapshot(notes) == before

    ours = claim_output_dir(tmp_path / "reports", key="paths.reports", kind="reports")
    (ours / "depth.md").write_text("# my own depth notes, in a directory of ours\n")
    with pytest.raises(ForeignOutputError, match="depth.md"):
        build_report(runs, spec=load_sweep("depth"), out_dir=ours, provenance=None)
    assert (ours / "depth.md").read_text() == "# my own depth notes, in a directory of ours\n"


def test_a_reports_directory_of_ours_from_before_markers_is_accepted(tmp_path):
    from matplotlib.figure import Figure

    from dspark.plotting import save_figure

    old = tmp_path / "reports"
    old.mkdir()
    (old / "depth.md").write_text("# Sweep `depth` — drafter depth\n")
    (old / "eval-x.md").write_text("# Evaluation — x\n")
    (old / "depth.claims.json").write_text("[]")
    (old / "depth.notes.md").write_text("hand-written notes the report embeds\n")
    figure = Figure()
    figure.add_subplot().plot([0, 1])
    save_figure(figure, old / "depth-depth.png")
    assert all(is_report_entry(p) for p in old.iterdir())
    assert output_dir_error(old, key="paths.reports", ours=is_report_entry) is None
    (old / "depth-depth.png").write_bytes(b"\x89PNG\r\n\x1a\n someone's picture")
    assert output_dir_error(old, key="paths.reports", ours=is_report_entry) is not None


def test_the_report_stage_refuses_someones_directory_in_preflight(shared_root, tmp_path, capsys):
    notes = foreign_notes(tmp_path / "notes")
    before = snapshot(notes)
    argv = ["sweep=depth", "stage=report", "budget=smoke", f"paths.root={shared_root}", f"paths.reports={notes}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"paths.reports={notes}" in err and "holds no output of ours" in err
    assert snapshot(notes) == before


def test_an_evaluation_report_is_claimed_before_decoding(tmp_path):
    rc = resolve_config(["budget=smoke", f"paths.root={tmp_path / 'root'}", f"paths.reports={tmp_path / 'notes'}"])
    ctx = StageContext(rc=rc, paths=RunPaths.from_config(rc.cfg))
    notes = foreign_notes(tmp_path / "notes")
    before = snapshot(notes)
    with pytest.raises(ForeignOutputError, match="paths.reports"):
        claimed_report_paths(ctx)
    assert snapshot(notes) == before

    (notes / "depth.md").unlink()
    (notes / "todo.txt").unlink()
    report = claimed_report_paths(ctx)["report"]  # now empty: claimed
    report.write_text("someone's file under the report's name\n")
    with pytest.raises(ForeignOutputError, match=report.name):
        claimed_report_paths(ctx)
    report.write_text("# Evaluation — an earlier report of ours\n")
    assert claimed_report_paths(ctx) == report_paths(ctx)


# --- paths.root and the stores ------------------------------------------------------------------------------------


def test_a_run_into_someones_directory_is_refused_and_nothing_runs(tmp_path, capsys):
    notes = foreign_notes(tmp_path / "notes")
    before = snapshot(notes)
    assert main(["stage=train", *TRAIN, f"paths.root={notes}"]) == 2
    err = capsys.readouterr().err
    assert f"paths.root={notes}" in err and "todo.txt" in err
    assert snapshot(notes) == before  # no mlflow.db, no cache/, no marker


def test_root_from_before_markers_is_claimed_and_the_repository_outputs_never_marked(tmp_path):
    root = tmp_path / "root"
    for name in ("cache", "runs", "mlartifacts", "ledgers"):
        (root / name).mkdir(parents=True)
    (root / "mlflow.db").write_bytes(b"")
    cfg = resolve_config(["budget=smoke", f"paths.root={root}"]).cfg
    assert output_location_errors(cfg) == []
    assert read_marker(root) is None and not (root / "reports").exists()  # checking creates nothing
    claim_output_locations(cfg)  # preflight's last step, once every check passed
    assert read_marker(root)["kinds"] == ["root"] and read_marker(root / "reports")["kinds"] == ["reports"]
    (root / "todo.txt").write_text("added later")  # marked: still ours
    assert output_location_errors(cfg) == []
    assert in_default_root(repo_root() / "outputs") and in_default_root(repo_root() / "outputs" / "reports")
    assert not in_default_root(tmp_path)


def test_a_store_file_of_something_else_is_refused(tmp_path):
    theirs = tmp_path / "app.db"
    with sqlite3.connect(theirs) as db:
        db.execute("CREATE TABLE notes (text TEXT)")
    journal = tmp_path / "journal.log"
    journal.write_text("their log line\n")
    cfg = resolve_config(
        ["sweep=rank", "budget=smoke", f"tracking.uri=sqlite:///{theirs}", f"optuna.storage={journal}"]
    ).cfg
    errors = store_file_errors(cfg)
    assert any(f"tracking.uri={theirs}" in e and "notes" in e for e in errors)
    assert any(f"optuna.storage={journal}" in e for e in errors)

    ours = tmp_path / "mlflow.db"
    with sqlite3.connect(ours) as db:
        db.execute("CREATE TABLE experiments (id INT)")
        db.execute("CREATE TABLE runs (id INT)")
    journal.write_text('{"op_code": 0, "worker_id": "w", "study_name": "s", "directions": [1]}\n')
    cfg = resolve_config(
        ["sweep=rank", "budget=smoke", f"tracking.uri=sqlite:///{ours}", f"optuna.storage={journal}"]
    ).cfg
    assert store_file_errors(cfg) == []


# --- results/ ---------------------------------------------------------------------------------------------------------


def _repo(root: Path) -> Path:
    (root / "sweeps").mkdir(parents=True)
    (root / "sweeps" / "toy.yaml").write_text('# Run: python experiments/run.py sweep=toy\ndescription: "a toy"\n')
    return root


def test_results_build_keeps_someones_index_and_readme(tmp_path, capsys):
    repo = _repo(tmp_path)
    index = repo / "results" / "INDEX.md"
    index.parent.mkdir()
    index.write_text("my own index\n")
    assert results_main(["--repo", str(repo), "--keep-reports"]) == 2
    assert "INDEX.md" in capsys.readouterr().err and index.read_text() == "my own index\n"
    assert not (repo / "results" / "toy").exists()  # refused before anything was written

    index.unlink()
    readme = repo / "results" / "toy" / "README.md"
    readme.parent.mkdir()
    readme.write_text("# toy\nHand-written: why this sweep is not run.\n")
    build(repo, regenerate=None)
    assert readme.read_text() == "# toy\nHand-written: why this sweep is not run.\n" and index.is_file()
    build(repo, regenerate=None)  # our own index is replaced


def test_a_regeneration_writes_only_what_its_ledger_reserves(tmp_path):
    folder = tmp_path / "toy"
    folder.mkdir()
    (folder / "ledger.json").write_text(json.dumps({"sweep": "toy", "cells": []}))
    (folder / "other.md").write_text("a hand-written report\n")
    with pytest.raises(ForeignOutputError, match="other.md"):
        write_files(folder, {"toy.md": b"# new\n", "other.md": b"# not ours to write\n"}, report="toy.md")
    assert (folder / "other.md").read_text() == "a hand-written report\n" and not (folder / "toy.md").exists()
    write_files(folder, {"toy.md": b"# new\n", "toy-tau.png": b"png"}, report="toy.md")


def test_publishing_never_replaces_a_file_that_is_not_a_ledger(tmp_path):
    ledger = tmp_path / "depth-aaa.json"
    ledger.write_text(json.dumps({"version": 2, "sweep": "depth", "sweep_hash": "aaa", "cells": []}))
    target = tmp_path / "results" / "depth" / "ledger.json"
    target.parent.mkdir(parents=True)
    target.write_text("not a ledger\n")
    with pytest.raises(ForeignOutputError, match="ledger.json"):
        publish(ledger, results_dir=tmp_path / "results")
    assert target.read_text() == "not a ledger\n"
    target.unlink()
    assert publish(ledger, results_dir=tmp_path / "results") == target
    assert publish(ledger, results_dir=tmp_path / "results") == target  # our own ledger is replaced


# --- benchmarks ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def common():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import common

        yield common
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_benchmark_outputs_are_checked_before_any_work(common, tmp_path):
    ours, theirs = tmp_path / "ours.md", tmp_path / "theirs.md"
    ours.write_text("# Decoding speed\n\nCommand: `python benchmarks/bench_decoding.py --output x.md`\n")
    theirs.write_text("# my notes\n")
    (tmp_path / "figure.png").write_bytes(b"\x89PNG\r\n\x1a\n someone's picture")
    cache = tmp_path / "cache"
    (cache / "targets").mkdir(parents=True)
    assert common.output_argument_errors(["--output", str(ours), f"--cache-dir={cache}"]) == []
    assert (
        common.output_argument_errors(["--output", str(tmp_path / "new.md"), "--cache-dir", str(tmp_path / "c2")]) == []
    )
    errors = common.output_argument_errors(
        [f"--output={theirs}", "--output", str(tmp_path / "figure.md"), "--cache-dir", str(tmp_path)]
    )
    assert len(errors) == 3 and any(str(theirs) in e for e in errors) and any("figure.png" in e for e in errors)
    with pytest.raises(ForeignOutputError):
        common.write_result("# result\n", theirs)
    assert theirs.read_text() == "# my notes\n"


def test_a_benchmark_script_exits_2_on_a_foreign_output(tmp_path):
    theirs = tmp_path / "theirs.md"
    theirs.write_text("# my notes\n")
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_sps_forward.py"), "--output", str(theirs)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    assert f"--output={theirs}" in proc.stderr and theirs.read_text() == "# my notes\n"
