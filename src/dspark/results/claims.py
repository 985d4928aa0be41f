"""The paper's claims as results/ judges them: every `<sweep>.claims.json` a ledger regenerated, plus the curated
list of `dspark.results.paper` for what no ledger judges (a report without a ledger, a sweep never run, a test).

A claims file is a JSON list of dicts with the keys id, statement, paper, ours, low, high, mean, runs, seeds,
verdict, scope and paper_effect (`dspark.sweeps.driver.regenerate_from_ledger` writes it; the rule that makes the
verdicts is `dspark.reports.claims`, docs/STATISTICS.md). A verdict that reads an interval must agree with it:
holds ⇒ low > 0, reversed ⇒ high < 0, not resolved ⇒ low ≤ 0 ≤ high; *not reproduced* with the paper's effect
size on record ⇒ the interval lies on 0's side of it; *seed variance not measured* ⇒ one run per arm and an
interval that would otherwise decide (`claim_disagreement` checks a claim's data; `agrees` a row's text).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dspark.results.discovery import Folder

INTERVAL_VERDICTS = ("holds", "reversed", "not resolved")
NOT_RUN = "not run yet"
NOT_REPRODUCED = "not reproduced"  # an interval on 0's side of the paper's effect size (or, curated, a point)
ONE_SEED = "seed variance not measured"  # one run per arm: a deciding interval's verdict withheld
_NUMBER = r"[+\-−]?\d+(?:\.\d+)?"
_BRACKET = re.compile(rf"\[\s*({_NUMBER})\s*%?\s*,\s*({_NUMBER})\s*%?\s*\]")


@dataclass(frozen=True)
class Claim:
    """One paper claim and our judgement of it; `folder` is the results/ folder whose report judges it and `link`
    the file to read (relative to results/)."""

    id: str
    statement: str
    paper: str
    verdict: str
    ours: str = ""
    mean: float | None = None
    low: float | None = None
    high: float | None = None
    runs: Any = None
    seeds: Any = None
    scope: str = ""
    paper_effect: float | None = None
    folder: str = ""
    link: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, folder: str = "", link: str = "") -> Claim:
        """A claim from a claims.json entry (unknown keys kept in `extra`)."""
        known = {f.name for f in fields(cls)} - {"extra"}
        values = {k: v for k, v in data.items() if k in known}
        values.setdefault("folder", folder)
        values.setdefault("link", link)
        for key in ("id", "statement", "paper", "verdict"):
            values[key] = str(values.get(key, "") or "")
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})


def verdict_word(verdict: str) -> str:
    """The interval verdict a verdict text starts with ('holds', 'reversed', 'not resolved'), else the text."""
    text = verdict.strip().strip("*").lower()
    return next((w for w in INTERVAL_VERDICTS if text.startswith(w) and not text.startswith("holds (test)")), text)


def _finite(*values: float | None) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def agrees(verdict: str, low: float | None, high: float | None, paper_effect: float | None = None) -> bool:
    """Whether an interval verdict agrees with [low, high] (and, for *not reproduced*, the paper's effect size when
    one is given); verdicts that read no interval always agree."""
    word = verdict_word(verdict)
    if word == NOT_REPRODUCED and _finite(low, high, paper_effect):
        return high < paper_effect if paper_effect > 0 else low > paper_effect
    if word not in INTERVAL_VERDICTS:
        return True
    if not _finite(low, high):
        return False
    return {"holds": low > 0, "reversed": high < 0, "not resolved": low <= 0 <= high}[word]


def claim_disagreement(claim: Claim) -> str | None:
    """Why a judged claim's verdict disagrees with its own data (interval, paper effect, runs), else None: the
    rule of `dspark.reports.claims.verdict_of`, re-read from the claims file."""
    word, runs = verdict_word(claim.verdict), claim.runs if isinstance(claim.runs, int) else None
    if word == ONE_SEED:
        if runs is None or runs >= 2 or not _finite(claim.low, claim.high):
            return f"{claim.id}: '{ONE_SEED}' needs one run per arm and an interval"
        effect = claim.paper_effect
        # undecided: the interval spans 0 and (a magnitude claim) the paper's size — then it reads not resolved
        undecided = claim.low <= 0 <= claim.high and (not _finite(effect) or claim.low <= effect <= claim.high)
        if undecided:
            return f"{claim.id}: '{ONE_SEED}' needs one run per arm and an interval that decides"
        return None
    if word in ("holds", "reversed", NOT_REPRODUCED) and runs is not None and runs < 2 and _finite(claim.low):
        return f"{claim.id}: {word} on one run per arm (seed variance not measured)"
    if not agrees(claim.verdict, claim.low, claim.high, claim.paper_effect):
        return f"{claim.id}: {word} vs [{claim.low}, {claim.high}] (paper effect {claim.paper_effect})"
    return None


def interval_in(text: str) -> tuple[float, float] | None:
    """The first '[low, high]' in a cell's text (percent signs and the typographic minus allowed)."""
    found = _BRACKET.search(text)
    if found is None:
        return None
    low, high = (float(x.replace("−", "-")) for x in found.groups())
    return low, high


def load_claims(folder: Folder, *, results_dir: Path) -> list[Claim]:
    """The claims of a folder's claims.json files, each linked to the folder's report of the same sweep."""
    claims = []
    for path in folder.claims:
        report = path.with_name(path.name.removesuffix(".claims.json") + ".md")
        link = (report if report.is_file() else path).relative_to(results_dir).as_posix()
        entries = json.loads(path.read_text(encoding="utf-8"))
        claims += [Claim.from_dict(entry, folder=folder.name, link=link) for entry in entries]
    return claims


def merged_claims(folders: list[Folder], curated: list[Claim], *, results_dir: Path) -> list[Claim]:
    """Folder by folder (in the given order), the judged claims of its claims files, or else its curated claims;
    then the curated claims of no folder (tests).

    A folder with a claims file judges its own claims, so the curated entries that name it step aside (their
    numbers were transcribed from a committed report until its ledger regenerated it)."""
    names = {f.name for f in folders}
    ordered = []
    for folder in folders:
        own = load_claims(folder, results_dir=results_dir)
        ordered += own or [c for c in curated if c.folder == folder.name]
    return ordered + [c for c in curated if c.folder not in names]
