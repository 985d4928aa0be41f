"""What keeps results/ trustworthy, as functions that return the offending items (empty = fine), so that a test can
run each on the real tree and on a made-up one that must fail:

- every markdown link of every results/**/*.md resolves to a file;
- every sweep file has a folder;
- no file holds an absolute path (they differ per machine and leak the author's layout);
- no front matter names a dirty commit unless it says a rerun from a committed tree is pending (`rerun_pending: <why>`): the record shows it instead of hiding it;
- every verdict of the index agrees with the interval in its row, and every judged claim of a claims file with its
  own data (interval, the paper's effect size, runs per arm: `claims.claim_disagreement`);
- every question folder has a current report whose front matter fills every field.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

from dspark.results.claims import agrees, claim_disagreement, interval_in, load_claims, verdict_word
from dspark.results.discovery import discover, sweep_names
from dspark.results.frontmatter import DIRTY, FIELDS, split_front_matter

#: an absolute path starts a word: `exp/root/runs` and `$TMPDIR/x` are relative, `sqlite:////` is always absolute
_ABSOLUTE = re.compile(rb"sqlite:////|(?<![\w.$/~-])(?:/work/|/home/|/root/|/tmp/)")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = ("http://", "https://", "mailto:", "#")


def markdown_links(text: str) -> list[str]:
    """The local targets of the markdown links and images of a text (anchors dropped, external links skipped)."""
    targets = []
    for target in _LINK.findall(text):
        if not target.startswith(_EXTERNAL):
            targets.append(unquote(target.split("#", 1)[0]))
    return [t for t in targets if t]


def broken_links(root: Path) -> list[str]:
    """'file: target' for every link under `root`'s markdown files whose target does not exist."""
    broken = []
    for path in sorted(Path(root).rglob("*.md")):
        for target in markdown_links(path.read_text(encoding="utf-8")):
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(root)}: {target}")
    return broken


def missing_sweep_folders(results_dir: Path, sweeps_dir: Path) -> list[str]:
    """The sweeps (sweeps/*.yaml) with no folder under results/."""
    return [name for name in sweep_names(sweeps_dir) if not (Path(results_dir) / name).is_dir()]


def absolute_paths(root: Path) -> list[str]:
    """'file: pattern' for every file under `root` (binary files too) that holds an absolute path."""
    found = []
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        hits = sorted({m.group(0).decode() for m in _ABSOLUTE.finditer(path.read_bytes())})
        found += [f"{path.relative_to(root)}: {hit}" for hit in hits]
    return found


def dirty_commits(root: Path) -> list[str]:
    """'file: commit' for every front matter under `root` whose commit is dirty and not marked `rerun_pending`."""
    dirty = []
    for path in sorted(Path(root).rglob("*.md")):
        meta, _ = split_front_matter(path.read_text(encoding="utf-8"))
        if meta and DIRTY in meta.get("commit", "") and not meta.get("rerun_pending"):
            dirty.append(f"{path.relative_to(root)}: {meta['commit']}")
    return dirty


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The body rows of the first table under `## heading`, as lists of cells."""
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.strip() == f"## {heading}"), None)
    if start is None:
        return []
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))])
    return rows[1:]  # the header row


def verdict_mismatches(index_text: str, *, heading: str = "The paper's claims") -> list[str]:
    """'claim: verdict vs [low, high]' for every claims row whose interval verdict disagrees with its interval."""
    wrong = []
    for row in table_rows(index_text, heading):
        if len(row) < 4:
            continue
        claim, ours, verdict = row[0], row[2], row[3]
        interval = interval_in(ours)
        low, high = interval if interval else (None, None)
        if not agrees(verdict, low, high):
            wrong.append(f"{claim}: {verdict_word(verdict)} vs {interval}")
    return wrong


def claim_disagreements(results_dir: Path) -> list[str]:
    """'id: why' for every claim of every claims file under `results_dir` whose verdict its own data contradicts."""
    found = []
    for folder in discover(results_dir):
        for claim in load_claims(folder, results_dir=Path(results_dir)):
            why = claim_disagreement(claim)
            if why:
                found.append(why)
    return found


def incomplete_front_matter(results_dir: Path) -> list[str]:
    """'folder: why' for every folder without a current report and every report missing a front matter field."""
    problems = []
    for folder in discover(results_dir):
        if not folder.reports:
            problems.append(f"{folder.name}: no current report (a top-level .md with front matter)")
        for report in folder.reports:
            missing = [f for f in FIELDS if not report.meta.get(f, "").strip()]
            if missing:
                problems.append(f"{report.path.relative_to(results_dir)}: no {', '.join(missing)}")
    return problems
