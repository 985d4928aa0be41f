"""`make results`: give every sweep a folder (a "not run yet" README where it has nothing), regenerate every sweep
report from its committed ledger, then write results/INDEX.md.

It replaces only files it wrote before: INDEX.md (its `# Results — ` title; another file of that name is refused
with `ForeignOutputError` before anything is written), a "not run yet" README (its front matter: a hand-written
README of a sweep that has not run is kept, and gets no generated one beside it), and what each sweep's ledger
reserves for its regeneration (`dspark.results.regenerate.is_regenerated`).
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import yaml

from dspark.files import ForeignOutputError, atomic_write_text, head_text, output_file_error
from dspark.results.discovery import discover, read_folder, sweep_names
from dspark.results.frontmatter import read_front_matter, with_front_matter
from dspark.results.index import index_path, render_index
from dspark.results.paper import QUESTIONS
from dspark.results.regenerate import RegenerateFn, regenerate_folder

log = logging.getLogger("dspark")
README = "README.md"
NOT_RUN = "not run yet"  # the front matter `kind` of a generated README
INDEX_TITLE = "# Results — "


def sweep_header(sweep_file: Path) -> dict[str, str]:
    """The sweep file's description, paper reference and `# Run:` command."""
    text = sweep_file.read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    run = next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("# Run:")),
        f"python experiments/run.py sweep={sweep_file.stem}",
    )
    return {"description": str(data.get("description", "")), "paper_ref": str(data.get("paper_ref", "")), "run": run}


def question_of(name: str, sweeps_dir: Path) -> str:
    """The question a folder answers (a sweep's description where the curated list has none)."""
    if name in QUESTIONS:
        return QUESTIONS[name]
    sweep_file = Path(sweeps_dir) / f"{name}.yaml"
    return sweep_header(sweep_file)["description"] if sweep_file.is_file() else name


def not_run_readme(name: str, *, sweeps_dir: Path) -> str:
    """The README of a sweep with no ledger and no report: not run yet, and how to run it."""
    head = sweep_header(Path(sweeps_dir) / f"{name}.yaml")
    meta = {
        "question": question_of(name, sweeps_dir),
        "headline": "not run yet",
        "machine": "–",
        "commit": "–",
        "date": "–",
        "command": head["run"],
        "kind": NOT_RUN,
    }
    body = (
        f"# `{name}` — not run yet\n\n"
        f"Sweep file: [sweeps/{name}.yaml](../../sweeps/{name}.yaml) — {head['description']}; reproduces "
        f"{head['paper_ref'] or 'no figure of the paper'}.\n\n"
        "No run of this sweep is on record (no ledger, no report). Run it with the sweep file's command\n\n"
        f"    {head['run']}\n\n"
        "(the reference sweeps of results/ add `budget=cpu-ref`), then publish its ledger "
        f"(`outputs/ledgers/<experiment>/{name}-<hash>.json`) with `make results PUBLISH={name}`, which copies it "
        f"to `results/{name}/ledger.json` and regenerates the report here from it.\n"
    )
    return with_front_matter(meta, body)


def is_not_run_readme(path: Path) -> bool:
    """A README this module generated (front matter `kind: not run yet`)."""
    return (read_front_matter(path) or {}).get("kind") == NOT_RUN


def is_index(path: Path) -> bool:
    return head_text(path, 64).startswith(INDEX_TITLE)


def ensure_sweep_folders(results_dir: Path, sweeps_dir: Path) -> list[Path]:
    """Write the "not run yet" README of every sweep that has neither a ledger nor a report of its own (a README
    someone wrote stays as it is)."""
    written = []
    for name in sweep_names(sweeps_dir):
        folder = read_folder(Path(results_dir) / name)
        others = [r for r in folder.reports if r.path.name != README]
        readme = folder.path / README
        if folder.ledger is None and not others and (not readme.exists() or is_not_run_readme(readme)):
            written.append(atomic_write_text(readme, not_run_readme(name, sweeps_dir=sweeps_dir), key="results/"))
    return written


def index_error(results_dir: Path) -> str | None:
    """A refusal when results/INDEX.md exists and is not an index this module wrote."""
    fix = "Move that file away (or rename it), then run `make results` again."
    return output_file_error(index_path(results_dir), key="results/", ours=is_index, fix=fix)


def build(repo: Path, *, regenerate: RegenerateFn | None, now: datetime.datetime | None = None) -> list[Path]:
    """Rebuild results/ under `repo`; `regenerate=None` keeps the committed sweep reports as they are."""
    repo = Path(repo)
    results_dir, sweeps_dir = repo / "results", repo / "sweeps"
    results_dir.mkdir(exist_ok=True)
    error = index_error(results_dir)
    if error:
        raise ForeignOutputError(error)
    written = ensure_sweep_folders(results_dir, sweeps_dir)
    for folder in discover(results_dir):
        if folder.ledger is None:
            continue
        if regenerate is None:
            log.info("results/%s: sweep report kept as committed (not regenerated from its ledger)", folder.name)
            continue
        written += regenerate_folder(
            folder.path, regenerate=regenerate, repo=repo, now=now, question=question_of(folder.name, sweeps_dir)
        )
    text = render_index(results_dir, now=now)
    written.append(atomic_write_text(index_path(results_dir), text, key="results/"))
    return written
