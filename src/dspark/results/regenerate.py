"""Rebuild a sweep's folder from its committed ledger: `regenerate_from_ledger` (the sweep driver's) writes the
report, its figures and `<sweep>.claims.json` into a throwaway directory; they are copied into results/<sweep>/
with the front matter on top and the throwaway paths replaced by fixed names, so that the copy is the same on
every machine apart from the report's `- generated:` line.

The front matter comes from the ledger (machine, commit, date of the last cell, command) and the claims (headline):
a commit field carries `(dirty)` when any cell ran from a tree with uncommitted changes (`dirty_cells` counts them).

What a regeneration replaces is reserved by the folder's ledger, its sibling manifest (`is_regenerated`): the
report, claims and figures named after the sweep the ledger records (`<sweep>.md`, `<sweep>.claims.json`,
`<sweep>-*.png`). Any other file is never written over: `write_files` refuses (`ForeignOutputError`) before
writing any file of the folder.
"""

from __future__ import annotations

import datetime
import json
import re
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dspark.files import atomic_output, check_output_file
from dspark.results.claims import INTERVAL_VERDICTS, verdict_word
from dspark.results.discovery import CLAIMS_SUFFIX, LEDGER
from dspark.results.frontmatter import DIRTY, read_front_matter, with_front_matter

RegenerateFn = Callable[..., Path]
#: The claim a sweep's headline quotes (ids of the driver's claims files); other sweeps quote their first judged one.
HEADLINE_CLAIMS = {
    "depth": "depth.dspark2_vs_dflash5.all",
    "block_size": "block_size.dspark_markov_vs_dflash_growth_vs_paper.all",
    "serving": "serving.scheduler_vs_mtp1.user_speed",
}


def find_regenerate() -> RegenerateFn:
    """The sweep driver's `regenerate_from_ledger` (imported on demand: the index alone needs neither torch nor
    MLflow)."""
    from dspark.sweeps.driver import regenerate_from_ledger

    return regenerate_from_ledger


def scrub(text: str, roots: dict[str, str]) -> str:
    """`text` with each root directory replaced by its fixed name (longest first, so nested roots win)."""
    for root in sorted(roots, key=len, reverse=True):
        text = text.replace(root, roots[root])
    return text


def _counted(counter: Counter) -> str:
    items = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))
    return "; ".join(f"{value} ({n} cell{'s' * (n != 1)})" for value, n in items)


def _without_axes(command: str, axes: set[str]) -> str:
    return " ".join(w for w in command.split() if w.split("=", 1)[0] not in axes)


def ledger_provenance(ledger: dict[str, Any]) -> dict[str, str]:
    """machine, commit (with `(dirty)`), date of the last finished cell (UTC) and the sweep's command, from the
    tags of a ledger's cells."""
    cells = ledger.get("cells", [])
    tags = [c.get("tags", {}) for c in cells]
    axes = {k.removeprefix("axis.") for t in tags for k in t if k.startswith("axis.")}
    commits = Counter(str(t.get("git.commit", "–"))[:12] for t in tags)
    dirty = sum(str(t.get("git.dirty", "")).lower() == "true" for t in tags)
    commit = next(iter(commits)) if len(commits) == 1 else f"cells at {len(commits)} commits: {_counted(commits)}"
    ends = [int(c["end_time"]) for c in cells if str(c.get("end_time", "")).isdigit()]
    date = (
        datetime.datetime.fromtimestamp(max(ends) / 1000, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        if ends
        else "–"
    )
    commands = Counter(_without_axes(str(t.get("command", "")), axes) for t in tags if t.get("command"))
    meta = {
        "machine": _counted(Counter(str(t.get("machine", "–")) for t in tags)) or "–",
        "commit": f"{commit} {DIRTY}" if dirty else commit,
        "date": date,
        "command": commands.most_common(1)[0][0] if commands else "–",
    }
    if dirty:
        meta["dirty_cells"] = f"{dirty} of {len(cells)}"
        meta["rerun_pending"] = (
            f"{dirty} of {len(cells)} cells ran from a tree with uncommitted changes: the sweep "
            "run from a committed tree redoes only these cells"
        )
    return meta


def headline_of(claims: list[dict[str, Any]], *, prefer: str | None = None) -> str | None:
    """One claim as a line, statement: ours → verdict: the `prefer`red id when there is one, else the first claim
    judged on an interval, else the first with the paper's number, else the first."""

    def rank(claim: dict[str, Any]) -> tuple[bool, bool, bool]:
        return (
            claim.get("id") != prefer,
            verdict_word(str(claim.get("verdict", ""))) not in INTERVAL_VERDICTS,
            str(claim.get("paper", "–")) in ("", "–"),
        )

    if not claims:
        return None
    best = min(claims, key=rank)  # min keeps the first of equals
    ours = best.get("ours") or f"[{best.get('low')}, {best.get('high')}]"
    statement = str(best.get("statement") or best.get("id", "")).rstrip(".")
    return f"{statement}: {ours} → {best.get('verdict', '–')}"


def sweep_front_matter(
    ledger: dict[str, Any], *, claims: list[dict[str, Any]], question: str, previous: dict[str, str] | None = None
) -> dict[str, str]:
    """The front matter of a regenerated sweep report (the previous headline stays when no claim gives one)."""
    previous = previous or {}
    prefer = HEADLINE_CLAIMS.get(str(ledger.get("sweep")))
    headline = headline_of(claims, prefer=prefer) or previous.get("headline", "–")
    return {"question": question, "headline": headline, **ledger_provenance(ledger), "kind": "sweep"}


def regenerated_files(
    ledger: Path, *, regenerate: RegenerateFn, question: str, repo: Path, now: datetime.datetime | None = None
) -> dict[str, bytes]:
    """{file name: content} of a sweep regenerated from `ledger`: report (front matter on top), figures, claims."""
    folder = ledger.parent
    with tempfile.TemporaryDirectory(prefix="dspark-results-") as tmp:
        out, work = Path(tmp) / "out", Path(tmp) / "work"
        out.mkdir()
        work.mkdir()
        report = Path(regenerate(ledger, out_dir=out, work_dir=work, now=now))
        roots = {str(work): "<work_dir>", str(out): "<out_dir>", tmp: "<tmp>", f"{Path(repo).resolve()}/": ""}
        name = report.stem
        claims_path = out / f"{name}{CLAIMS_SUFFIX}"
        claims_text = scrub(claims_path.read_text(encoding="utf-8"), roots) if claims_path.is_file() else None
        meta = sweep_front_matter(
            json.loads(ledger.read_text(encoding="utf-8")),
            claims=json.loads(claims_text) if claims_text else [],
            question=question,
            previous=_front_matter(folder / report.name),
        )
        files = {report.name: with_front_matter(meta, scrub(report.read_text(encoding="utf-8"), roots)).encode()}
        files.update({png.name: png.read_bytes() for png in sorted(out.glob(f"{name}-*.png"))})
        if claims_text is not None:
            files[claims_path.name] = claims_text.encode()
    return files


def _front_matter(path: Path) -> dict[str, str] | None:
    return read_front_matter(path) if path.is_file() else None


def is_regenerated(path: Path) -> bool:
    """A file the folder's ledger reserves for its sweep's regeneration: `<sweep>.md`, `<sweep>.claims.json` or
    `<sweep>-*.png`, with `<sweep>` as the ledger beside it records it."""
    try:
        sweep = json.loads((path.parent / LEDGER).read_text(encoding="utf-8")).get("sweep")
    except (OSError, ValueError, AttributeError):
        return False
    name = path.name
    return bool(sweep) and (
        name in (f"{sweep}.md", f"{sweep}{CLAIMS_SUFFIX}") or (name.startswith(f"{sweep}-") and name.endswith(".png"))
    )


REGENERATED_FIX = "Move it out of the way (the folder's archive/), or fix the sweep its ledger.json names."


def write_files(folder: Path, files: dict[str, bytes], *, report: str) -> list[Path]:
    """Write the regenerated files into `folder`; the figures the previous `report` showed and the new one no longer
    makes go (other reports' figures in the folder stay). ForeignOutputError before any write when one of the
    files would replace one a regeneration did not write."""
    for name in files:
        check_output_file(folder / name, key="results/", ours=is_regenerated, fix=REGENERATED_FIX)
    previous = folder / report
    if previous.is_file():
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s/]+\.png)\)", previous.read_text(encoding="utf-8")):
            if target not in files and (folder / target).is_file() and is_regenerated(folder / target):
                (folder / target).unlink()
    written = []
    for name, content in files.items():
        with atomic_output(folder / name, mode="wb", key="results/") as handle:
            handle.write(content)
        written.append(folder / name)
    return written


def regenerate_folder(
    folder: Path, *, regenerate: RegenerateFn, question: str, repo: Path, now: datetime.datetime | None = None
) -> list[Path]:
    """Regenerate results/<sweep>/ from its ledger.json; returns the files written."""
    files = regenerated_files(folder / LEDGER, regenerate=regenerate, question=question, repo=repo, now=now)
    return write_files(folder, files, report=next(n for n in files if n.endswith(".md")))
