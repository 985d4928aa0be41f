"""results/ is the curated record: one folder per question, one current answer each, an index regenerated from the
files. What must hold of the committed tree — links resolve, every sweep has a folder, no absolute path, no dirty
commit, verdicts agree with their intervals, the index and every sweep report regenerate identically — and, for
each check, a made-up tree that shows it can fail."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import pytest

from dspark.results import checks
from dspark.results.__main__ import main as results_main
from dspark.results.build import build, not_run_readme, question_of
from dspark.results.claims import Claim, agrees, interval_in, merged_claims
from dspark.results.discovery import discover
from dspark.results.frontmatter import split_front_matter, with_front_matter
from dspark.results.index import render_index, without_generated
from dspark.results.regenerate import (
    find_regenerate,
    ledger_provenance,
    regenerate_folder,
    regenerated_files,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
SWEEPS = ROOT / "sweeps"
T0 = datetime.datetime(2026, 12, 7, 9, 0)
T1 = datetime.datetime(2027, 1, 2, 23, 59)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def report(path: Path, **meta: str) -> Path:
    fields = {
        "question": "q?",
        "headline": "+1% [+0.5%, +1.5%]",
        "machine": "m",
        "commit": "abc1234",
        "date": "2026-12-07",
        "command": "python x.py",
        "kind": "measurement",
    } | meta
    return write(path, with_front_matter(fields, "# A report\n"))


# --- the committed tree ---------------------------------------------------------------------------------------


def test_every_link_under_results_resolves():
    assert checks.broken_links(RESULTS) == []


def test_a_broken_link_is_caught(tmp_path):
    write(tmp_path / "q" / "r.md", "[ok](../other.md) ![fig](r.png) [web](https://x.org) [gone](archive/old.md#top)")
    write(tmp_path / "other.md", "")
    (tmp_path / "q" / "r.png").write_bytes(b"\x89PNG")
    assert checks.broken_links(tmp_path) == ["q/r.md: archive/old.md"]


def test_every_sweep_file_has_a_results_folder():
    assert checks.missing_sweep_folders(RESULTS, SWEEPS) == []


def test_a_sweep_without_a_folder_is_caught(tmp_path):
    write(tmp_path / "sweeps" / "toy.yaml", "description: toy\n")
    (tmp_path / "results").mkdir()
    assert checks.missing_sweep_folders(tmp_path / "results", tmp_path / "sweeps") == ["toy"]


def test_no_file_under_results_holds_an_absolute_path():
    assert checks.absolute_paths(RESULTS) == []


def test_an_absolute_path_is_caught(tmp_path):
    write(tmp_path / "a.md", "- MLflow: sqlite:////work/main/outputs/mlflow.db\n")
    write(tmp_path / "b.md", "drafter at /tmp/s19/clone/outputs/runs/x (relative: exp/root/runs, $TMPDIR/s14/x)\n")
    (tmp_path / "c.png").write_bytes(b"\x89PNG\x00 /home/someone/fig \x00")
    write(tmp_path / "d.md", "paths.root=outputs, $TMPDIR/x/root/y, results/depth/ledger.json\n")
    assert checks.absolute_paths(tmp_path) == ["a.md: sqlite:////", "b.md: /tmp/", "c.png: /home/"]


def test_no_current_report_names_a_dirty_commit():
    """A report whose code had uncommitted changes is rerun from a committed tree, or says the rerun is pending (`rerun_pending`)."""
    assert checks.dirty_commits(RESULTS) == []


def test_a_dirty_commit_is_caught_unless_marked_rerun_pending(tmp_path):
    report(tmp_path / "a" / "a.md", commit="afd2c3a (dirty)")
    report(tmp_path / "b" / "b.md", commit="cfeeaba (dirty)", rerun_pending="cells 3-4 ran with local changes")
    report(tmp_path / "c" / "c.md", commit="9736b09")
    assert checks.dirty_commits(tmp_path) == ["a/a.md: afd2c3a (dirty)"]


def test_every_folder_has_a_current_report_with_its_front_matter():
    assert checks.incomplete_front_matter(RESULTS) == []


def test_a_folder_without_a_report_or_a_field_is_caught(tmp_path):
    report(tmp_path / "ok" / "ok.md")
    report(tmp_path / "half" / "half.md", headline="")
    write(tmp_path / "bare" / "notes.md", "---\nquestion: notes are not reports\n---\n")
    assert checks.incomplete_front_matter(tmp_path) == [
        "bare: no current report (a top-level .md with front matter)",
        "half/half.md: no headline",
    ]


def test_every_verdict_of_the_index_agrees_with_its_interval():
    text = (RESULTS / "INDEX.md").read_text(encoding="utf-8")
    rows = checks.table_rows(text, "The paper's claims")
    judged = [r for r in rows if r[3].startswith(("holds", "reversed", "not resolved")) and "(test)" not in r[3]]
    assert len(judged) >= 5, "the parser found too few interval verdicts to check"
    assert checks.verdict_mismatches(text) == []


def test_a_verdict_against_its_interval_is_caught():
    rows = [
        ("a", "+1.2% [−0.5%, +2.9%]", "holds"),
        ("b", "+3% [+1%, +5%]", "reversed"),
        ("c", "+0.1 [+0.05, +0.2]", "not resolved (the 95% CI spans 0)"),
        ("d", "no interval", "holds"),
        ("e", "−9.4% [−13.2%, −5.7%]", "reversed"),
        ("f", "+0.8% [−3.1%, +4.6%]", "not resolved"),
        ("g", "tests", "holds (test)"),
        ("h", "1.02× median", "not reproduced"),
    ]
    table = "\n".join(f"| {c} | paper | {o} | {v} | link |" for c, o, v in rows)
    text = f"## The paper's claims\n\n| claim | paper | ours | verdict | link |\n|---|---|---|---|---|\n{table}\n"
    assert [m.split(":")[0] for m in checks.verdict_mismatches(text)] == ["a", "b", "c", "d"]


def test_every_claims_file_verdict_agrees_with_its_data():
    """The committed claims files under the statistics rule (docs/STATISTICS.md): interval, paper effect, runs."""
    assert checks.claim_disagreements(RESULTS) == []


def test_a_claims_file_verdict_against_its_data_is_caught(tmp_path):
    def entry(id: str, verdict: str, low: float, high: float, runs: int, **more: float) -> dict:
        return {
            "id": id,
            "statement": "s",
            "paper": "p",
            "verdict": verdict,
            "low": low,
            "high": high,
            "runs": runs,
        } | more

    entries = [
        entry("toy.a", "holds", 0.1, 0.2, 2),
        entry("toy.b", "holds", 0.1, 0.2, 1),  # one seed cannot hold
        entry("toy.c", "not reproduced", -0.05, 0.12, 2, paper_effect=0.097),  # the paper's size is inside
        entry("toy.d", "not reproduced", -0.05, 0.066, 2, paper_effect=0.097),
    ]
    write(tmp_path / "toy" / "toy.claims.json", json.dumps(entries))
    report(tmp_path / "toy" / "toy.md")
    assert [m.split(":")[0] for m in checks.claim_disagreements(tmp_path)] == ["toy.b", "toy.c"]


def test_interval_parsing_and_agreement():
    assert interval_in("+11.3% [+6.8%, +15.8%]; runs 2 vs 2") == (6.8, 15.8)
    assert interval_in("−2.0% [−6.6%, +2.6%]") == (-6.6, 2.6)
    assert interval_in("1.02× median") is None
    assert agrees("holds", 0.1, 0.2) and agrees("reversed", -0.2, -0.1) and agrees("not resolved", 0.0, 0.1)
    assert not agrees("holds", 0.0, 0.1) and not agrees("not resolved", None, None)
    assert agrees("not run yet", None, None) and agrees("holds (test)", None, None)
    # a magnitude verdict reads the paper's effect size when it has one, and passes (a curated point) without
    assert agrees("not reproduced", -0.05, 0.066, 0.097) and not agrees("not reproduced", -0.05, 0.12, 0.097)
    assert agrees("not reproduced", None, None)


def test_the_index_is_regenerated_identically_from_the_files():
    committed = (RESULTS / "INDEX.md").read_text(encoding="utf-8")
    assert without_generated(render_index(RESULTS, now=T1)) == without_generated(committed), (
        "results/INDEX.md is stale: run `make results`"
    )


# --- the build on made-up trees ----------------------------------------------------------------------------------


def toy_repo(root: Path) -> Path:
    write(
        root / "sweeps" / "toy.yaml",
        "# Sweep `toy` — a toy.\n# Run:       python experiments/run.py sweep=toy\n"
        'paper_ref: "Fig. 9"\ndescription: "a toy sweep"\n',
    )
    report(root / "results" / "bench" / "bench.md", question="how fast?")
    return root


def test_build_writes_a_not_run_readme_and_an_index_that_a_change_makes_stale(tmp_path):
    repo = toy_repo(tmp_path)
    build(repo, regenerate=None, now=T0)
    readme = (repo / "results" / "toy" / "README.md").read_text(encoding="utf-8")
    meta, body = split_front_matter(readme)
    assert meta["headline"] == "not run yet" and meta["command"] == "python experiments/run.py sweep=toy"
    assert "not run yet" in body and "results/toy/ledger.json" in body
    index = (repo / "results" / "INDEX.md").read_text(encoding="utf-8")
    assert "[README.md](toy/README.md)" in index and "[bench.md](bench/bench.md)" in index
    assert checks.broken_links(repo / "results" / "toy") == [] and checks.verdict_mismatches(index) == []
    assert without_generated(render_index(repo / "results", now=T1)) == without_generated(index)
    report(repo / "results" / "bench" / "bench.md", question="how fast?", headline="+2% [+1%, +3%]")
    assert without_generated(render_index(repo / "results", now=T1)) != without_generated(index)


def test_the_command_line_builds_a_made_up_repo(tmp_path, capsys):
    repo = toy_repo(tmp_path)
    assert results_main(["--repo", str(repo), "--keep-reports"]) == 0
    assert "INDEX.md" in capsys.readouterr().out
    assert (repo / "results" / "INDEX.md").is_file()


def test_not_run_readme_names_the_sweep_file_and_its_command():
    text = not_run_readme("threshold", sweeps_dir=SWEEPS)
    assert "sweeps/threshold.yaml" in text and "python experiments/run.py sweep=threshold" in text


def test_a_folder_with_a_claims_file_replaces_its_curated_claims(tmp_path):
    write(
        tmp_path / "toy" / "toy.claims.json",
        json.dumps(
            [{"id": "toy/a", "statement": "ledger's", "paper": "+1%", "verdict": "holds", "low": 0.1, "high": 0.2}]
        ),
    )
    report(tmp_path / "toy" / "toy.md", kind="sweep")
    curated = [
        Claim(id="toy/old", statement="curated", paper="", verdict="not run yet", folder="toy"),
        Claim(id="other/x", statement="kept", paper="", verdict="not run yet", folder="other"),
    ]
    claims = merged_claims(discover(tmp_path), curated, results_dir=tmp_path)
    assert [(c.statement, c.link) for c in claims] == [("ledger's", "toy/toy.md"), ("kept", "")]


# --- regeneration from a ledger ----------------------------------------------------------------------------------


def toy_ledger(path: Path, *, dirty: bool = False) -> Path:
    cells = [
        {
            "cell": f"model.depth={d} seed=0",
            "end_time": str(1796551431611 + d * 60_000),
            "tags": {
                "git.commit": f"{d}" * 40,
                "git.dirty": str(dirty and d == 2),
                "machine": "vm: toy CPU",
                "command": f"python experiments/run.py sweep=toy budget=cpu-ref model.depth={d}",
                "axis.model.depth": str(d),
                "axis.seed": "0",
            },
        }
        for d in (1, 2)
    ]
    return write(path, json.dumps({"format": "dspark-sweep-ledger", "version": 1, "sweep": "toy", "cells": cells}))


def fake_regenerate(
    ledger: Path, *, out_dir: Path, work_dir: Path, now: datetime.datetime | None = None, extra: str = ""
) -> Path:
    """What regenerate_from_ledger writes, in miniature: a report naming the throwaway store, a figure, claims."""
    cells = json.loads(ledger.read_text())["cells"]
    (out_dir / "toy-tau.png").write_bytes(b"\x89PNG toy")
    claims = [
        {
            "id": "toy/gain",
            "statement": "toy gain",
            "paper": "+1%",
            "ours": "+2.0% [+1.0%, +3.0%]",
            "mean": 0.02,
            "low": 0.01,
            "high": 0.03,
            "runs": "1 vs 1",
            "seeds": [0],
            "verdict": "holds",
            "scope": "all",
        }
    ]
    (out_dir / "toy.claims.json").write_text(json.dumps(claims, indent=1))
    text = (
        f"# Sweep `toy`\n\n- generated: {(now or datetime.datetime.now()):%Y-%m-%d %H:%M}\n"
        f"- MLflow: sqlite:///{work_dir}/mlflow.db\n- ledger: {ledger}\n- cells: {len(cells)}\n{extra}\n"
        "![tau](toy-tau.png)\n"
    )
    return write(out_dir / "toy.md", text)


def test_a_sweep_regenerates_identically_apart_from_its_date_line(tmp_path):
    folder = tmp_path / "results" / "toy"
    toy_ledger(folder / "ledger.json", dirty=True)
    write(folder / "toy.md", "# the previous report\n![old](toy-stale.png)\n")
    write(folder / "toy-simulated.md", "# another report of the folder\n![sim](toy-simulated.png)\n")
    for figure in ("toy-stale.png", "toy-simulated.png"):
        (folder / figure).write_bytes(b"figure")
    regenerate_folder(folder, regenerate=fake_regenerate, question="toy?", repo=tmp_path, now=T0)
    first = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    assert "toy-stale.png" not in first and "toy-simulated.png" in first
    assert {"toy.md", "toy-tau.png", "toy.claims.json"} <= set(first)
    files = regenerated_files(
        folder / "ledger.json", regenerate=fake_regenerate, question="toy?", repo=tmp_path, now=T1
    )
    assert without_generated(files["toy.md"].decode()) == without_generated(first["toy.md"].decode())
    assert files["toy.claims.json"] == first["toy.claims.json"] and files["toy.md"] != first["toy.md"]
    assert checks.absolute_paths(tmp_path / "results") == []
    meta, body = split_front_matter(first["toy.md"].decode())
    assert "- ledger: results/toy/ledger.json" in body and "sqlite:///<work_dir>/mlflow.db" in body
    assert meta["headline"] == "toy gain: +2.0% [+1.0%, +3.0%] → holds" and meta["kind"] == "sweep"
    assert meta["command"] == "python experiments/run.py sweep=toy budget=cpu-ref"
    assert meta["commit"].endswith("(dirty)") and meta["dirty_cells"] == "1 of 2"
    assert meta["date"] == "2026-12-06 10:05 UTC"


def test_a_non_deterministic_regeneration_is_caught(tmp_path):
    folder = tmp_path / "results" / "toy"
    toy_ledger(folder / "ledger.json")

    def drifting(ledger, **kwargs):
        return fake_regenerate(ledger, extra=f"- took: {time.perf_counter_ns()} ns", **kwargs)

    one, two = (
        regenerated_files(folder / "ledger.json", regenerate=drifting, question="q", repo=tmp_path, now=T0)
        for _ in range(2)
    )
    assert without_generated(one["toy.md"].decode()) != without_generated(two["toy.md"].decode())


def test_ledger_provenance_of_a_clean_one_commit_sweep(tmp_path):
    ledger = json.loads(toy_ledger(tmp_path / "l.json").read_text())
    for cell in ledger["cells"]:
        cell["tags"]["git.commit"] = "a" * 40
    meta = ledger_provenance(ledger)
    assert meta == {
        "machine": "vm: toy CPU (2 cells)",
        "commit": "aaaaaaaaaaaa",
        "date": "2026-12-06 10:05 UTC",
        "command": "python experiments/run.py sweep=toy budget=cpu-ref",
    }


@pytest.mark.slow
def test_every_committed_sweep_report_regenerates_from_its_ledger():
    """Byte for byte apart from the `- generated:` line: report, claims and the same figures (≤ ~60 s in all)."""
    regenerate = find_regenerate()
    folders = [f for f in discover(RESULTS) if f.ledger is not None]
    assert folders, "no results/*/ledger.json"
    for folder in folders:
        files = regenerated_files(
            folder.ledger, regenerate=regenerate, question=question_of(folder.name, SWEEPS), repo=ROOT, now=T1
        )
        for name, content in files.items():
            committed = folder.path / name
            assert committed.is_file(), f"results/{folder.name}/{name} is not committed: run `make results`"
            if name.endswith(".md"):
                assert without_generated(content.decode()) == without_generated(committed.read_text()), name
            elif name.endswith(".json"):
                assert content == committed.read_bytes(), name
        shown = set(checks.markdown_links((folder.path / f"{folder.name}.md").read_text(encoding="utf-8")))
        assert {n for n in files if n.endswith(".png")} == {t for t in shown if t.endswith(".png")}
