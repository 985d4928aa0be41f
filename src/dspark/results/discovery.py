"""What results/ holds: one folder per question; in each, the current report(s) — the top-level markdown files
with front matter — and, for a sweep, its ledger.json and `<sweep>.claims.json`. `archive/` (superseded versions a
current claim still cites) and `notes.md` (hand-written notes a sweep report embeds) are never current reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dspark.results.frontmatter import read_front_matter

ARCHIVE = "archive"
NOTES = "notes.md"
LEDGER = "ledger.json"
CLAIMS_SUFFIX = ".claims.json"
INDEX = "INDEX.md"


@dataclass(frozen=True)
class Report:
    """One current report: its path and front matter."""

    path: Path
    meta: dict[str, str]


@dataclass(frozen=True)
class Folder:
    """results/<name>/: the question's current report(s), the sweep ledger and claims files when there are any."""

    name: str
    path: Path
    reports: tuple[Report, ...]
    ledger: Path | None
    claims: tuple[Path, ...]


def sweep_names(sweeps_dir: Path) -> list[str]:
    """The sweeps of the platform: one per sweeps/*.yaml."""
    return sorted(p.stem for p in Path(sweeps_dir).glob("*.yaml"))


def current_reports(folder: Path) -> list[Report]:
    """The folder's top-level markdown files that carry front matter: a sweep report first, then the newest."""
    found = []
    for path in sorted(Path(folder).glob("*.md")):
        meta = read_front_matter(path) if path.name != NOTES else None
        if meta is not None:
            found.append(Report(path, meta))
    newest = sorted(found, key=lambda r: r.meta.get("date", ""), reverse=True)  # stable: ties stay by name
    return sorted(newest, key=lambda r: r.meta.get("kind") != "sweep")


def read_folder(path: Path) -> Folder:
    """One results/ folder."""
    ledger = path / LEDGER
    return Folder(
        name=path.name,
        path=path,
        reports=tuple(current_reports(path)),
        ledger=ledger if ledger.is_file() else None,
        claims=tuple(sorted(path.glob(f"*{CLAIMS_SUFFIX}"))),
    )


def discover(results_dir: Path) -> list[Folder]:
    """Every question folder under results/, by name."""
    return [read_folder(p) for p in sorted(Path(results_dir).iterdir()) if p.is_dir() and not p.name.startswith(".")]
