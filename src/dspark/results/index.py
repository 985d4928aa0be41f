"""results/INDEX.md: every paper claim with our judgement, then one row per current report of every question folder,
then the command behind each. A pure function of the files under results/, the sweep files and the curated claims
(`dspark.results.paper`), apart from its `- generated:` line.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from dspark.markdown import markdown_table
from dspark.results.claims import Claim, interval_in, merged_claims
from dspark.results.discovery import INDEX, LEDGER, Folder, Report, discover
from dspark.results.paper import PAPER_CLAIMS

#: Folder order in the index (the rest follow by name): the default run, the recipes, the paper's ablations, speed.
ORDER = (
    "default-run",
    "cpu-ref",
    "cpu-long",
    "main",
    "head",
    "depth",
    "block_size",
    "latency",
    "threshold",
    "calibration",
    "objective",
    "loss_weights",
    "rank",
    "serving",
    "decoding",
    "data",
    "training",
)
GENERATED = "- generated: "
INTRO = (
    "The record of what this platform measured, one folder per question. Each current report opens with front "
    "matter (question, headline with its interval, machine, commit, date, command); `archive/` keeps the "
    "superseded versions a current claim still cites, with a line each on what superseded it. Regenerate "
    "with `make results` (`python -m dspark.results`): it rebuilds every sweep report from its committed "
    "ledger, then this index. Runs write under `outputs/` only; nothing here is written by a run."
)
READING = (
    "Ours: SmolLM2-135M as the target on 2-core CPUs, rollouts at T = 1, per-prompt τ with intervals over "
    "prompts and seeds (each report names its budget); the paper's numbers are Qwen3 "
    "targets on GPUs (METHOD §9). Intervals are Student-t on the Welch–Satterthwaite df of their prompt and seed "
    "terms, and the domains (γs, slots) of one claim are Holm-adjusted together (docs/STATISTICS.md). Verdicts "
    "read the interval of a difference: **holds** (above 0), **reversed** (below 0), **not resolved** (spans 0); "
    "*not reproduced*: the interval excludes the paper's effect size on 0's side of it (a magnitude claim; a "
    "curated row without an interval: its point estimate does); *seed variance not measured*: an arm ran one seed, "
    "so an interval that would decide holds the prompt spread only and decides nothing; *no interval*: a point "
    "estimate only; *not run yet*: no ledger judges it; *holds (test)*: a test of the suite proves it. "
    "Rows come from each sweep's `<sweep>.claims.json` (regenerated from its ledger), else from the curated "
    "list of `dspark.results.paper` (transcribed from a report without a ledger)."
)
SOURCES = {
    "measurement": "measurement (rerun: its command below)",
    "evaluation": "evaluation of one run (rerun: its command below)",
    "not run yet": "not run yet (command below)",
}


def cell(text: object) -> str:
    """Text for one markdown table cell (pipes escaped, one line)."""
    return " ".join(str(text).split()).replace("|", "\\|") if text not in (None, "") else "–"


def link(target: str, label: str | None = None) -> str:
    """A markdown link relative to results/."""
    return f"[{label or Path(target).name}]({target})"


def ours_text(claim: Claim) -> str:
    """Our number with its interval, runs and seeds (the interval appended when the text lacks one)."""
    ours = claim.ours or ""
    if claim.low is not None and claim.high is not None and interval_in(ours) is None:
        ours = f"{ours} [{claim.low:+.3g}, {claim.high:+.3g}]".strip()
    parts = [ours or "–"]
    if claim.paper_effect is not None:
        parts.append(f"the paper's effect {claim.paper_effect:+.3g} on this scale")
    if claim.runs not in (None, ""):
        parts.append(f"runs {claim.runs}")
    if claim.seeds not in (None, "", []):
        seeds = ", ".join(map(str, claim.seeds)) if isinstance(claim.seeds, list) else claim.seeds
        parts.append(f"seeds {seeds}")
    if claim.scope:
        parts.append(claim.scope)
    return "; ".join(str(p) for p in parts)


def claims_table(claims: list[Claim]) -> str:
    rows = [
        [cell(c.statement), cell(c.paper), cell(ours_text(c)), cell(c.verdict), link(c.link) if c.link else "–"]
        for c in claims
    ]
    return markdown_table(["claim", "the paper's number", "ours with 95% CI, n runs, seeds", "verdict", "link"], rows)


def ordered(folders: list[Folder]) -> list[Folder]:
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(folders, key=lambda f: (rank.get(f.name, len(ORDER)), f.name))


def source_text(folder: Folder, report: Report) -> str:
    kind = report.meta.get("kind", "")
    if kind == "sweep":
        return (
            f"regenerated from {link(f'{folder.name}/{LEDGER}', 'its ledger')}"
            if folder.ledger
            else "committed sweep report (no ledger: cannot be regenerated)"
        )
    return SOURCES.get(kind, kind or "–")


def questions_table(folders: list[Folder], *, results_dir: Path) -> str:
    rows = []
    for folder in folders:
        if not folder.reports:
            rows.append([cell(folder.name), "no current report", "–", "–", "–", "–", "–"])
        for report in folder.reports:
            meta, target = report.meta, report.path.relative_to(results_dir).as_posix()
            rows.append(
                [
                    cell(meta.get("question")),
                    cell(meta.get("headline")),
                    cell(meta.get("machine")),
                    cell(meta.get("commit")),
                    cell(meta.get("date")),
                    cell(source_text(folder, report)),
                    link(target),
                ]
            )
    return markdown_table(["question", "headline", "machine", "commit", "date", "source", "link"], rows)


def pending_reruns(folders: list[Folder], *, results_dir: Path) -> str:
    """The current reports whose code had uncommitted changes (`rerun_pending`), each with what to rerun."""
    lines = [
        f"- {link(r.path.relative_to(results_dir).as_posix())}: {r.meta['rerun_pending']}"
        for folder in folders
        for r in folder.reports
        if r.meta.get("rerun_pending")
    ]
    return "\n".join(lines) or "None: every current report ran from a committed tree."


def commands(folders: list[Folder], *, results_dir: Path) -> str:
    lines = []
    for folder in folders:
        for report in folder.reports:
            command = report.meta.get("command")
            if command:
                target = report.path.relative_to(results_dir).as_posix()
                lines.append(f"- {link(target, target)}: `{command}`")
    return "\n".join(lines)


def render_index(results_dir: Path, *, now: datetime.datetime | None = None) -> str:
    """The whole of results/INDEX.md."""
    results_dir = Path(results_dir)
    folders = ordered(discover(results_dir))
    claims = merged_claims(folders, list(PAPER_CLAIMS), results_dir=results_dir)
    stamp = (now or datetime.datetime.now()).strftime("%Y-%m-%d %H:%M")
    parts = [
        "# Results — the current answer to each question",
        "",
        INTRO,
        "",
        f"{GENERATED}{stamp}",
        "",
        "## The paper's claims",
        "",
        READING,
        "",
        claims_table(claims),
        "",
        "## Questions and their current reports",
        "",
        questions_table(folders, results_dir=results_dir),
        "",
        "## Pending reruns",
        "",
        "Current reports whose code had uncommitted changes when it ran (their commit "
        "says `(dirty)`): the numbers stand, but they cannot be reproduced from a commit until rerun.",
        "",
        pending_reruns(folders, results_dir=results_dir),
        "",
        "## Commands",
        "",
        commands(folders, results_dir=results_dir),
    ]
    return "\n".join(parts).rstrip() + "\n"


def without_generated(text: str) -> str:
    """The text without its `- generated:` lines (the only lines a regeneration may change)."""
    return "\n".join(line for line in text.split("\n") if not line.startswith(GENERATED))


def index_path(results_dir: Path) -> Path:
    return Path(results_dir) / INDEX
