"""Publish a sweep's ledger into results/: the one step that writes a run's record into the tracked tree, taken by a
person (`make results PUBLISH=<sweep>`), never by a run.

The newest ledger of the sweep under `<paths.root>/ledgers/<experiment>/` (or the one named) becomes
`results/<sweep>/ledger.json`. A committed ledger of another identity is not overwritten: it moves into the folder's
`archive/` with one line in `archive/README.md` saying what superseded it. The same identity is replaced in place
(it is the same sweep, grown or resumed: git history keeps the earlier file). Only a sweep ledger is replaced or
archived: another file named `ledger.json` (or the archived name) is refused before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.files import atomic_write_text, check_output_file


class PublishError(ValueError):
    """Nothing to publish, or an ambiguous choice: the message names the files and the fix."""


def find_ledger(root: Path, sweep: str, *, experiment: str = "dspark-lab", name: str | None = None) -> Path:
    """The ledger to publish: `name` (a file or a file name under the experiment's folder), else the newest."""
    folder = Path(root) / "ledgers" / experiment
    if name:
        path = Path(name) if Path(name).is_file() else folder / name
        if not path.is_file():
            raise PublishError(f"no ledger {name} (looked at {path}); list them with `ls {folder}`")
        return path
    found = sorted(folder.glob(f"{sweep}-*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise PublishError(
            f"no ledger of sweep {sweep} under {folder}: run `python experiments/run.py sweep={sweep} "
            "...` first (same paths.root and tracking.experiment)"
        )
    return found[-1]


def is_ledger(path: Path) -> bool:
    """A sweep ledger: a JSON object naming its sweep and identity hash."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "sweep" in data and "sweep_hash" in data


def publish(ledger: Path, *, results_dir: Path) -> Path:
    """Copy `ledger` to `results/<sweep>/ledger.json`, archiving a committed ledger of another identity."""
    data = json.loads(Path(ledger).read_text(encoding="utf-8"))
    sweep, digest = data.get("sweep"), data.get("sweep_hash")
    if not sweep or not digest or data.get("version") != 2:
        raise PublishError(
            f"{ledger} is not a version-2 sweep ledger (convert a version-1 file with "
            "`python -m dspark.sweeps.migrate FILE`)"
        )
    target = Path(results_dir) / sweep / "ledger.json"
    fix = "Move that file away, then publish again."
    check_output_file(target, key="results/", ours=is_ledger, fix=fix)
    if target.is_file():
        old = json.loads(target.read_text(encoding="utf-8"))
        if old.get("sweep_hash") != digest:
            archived = target.parent / "archive" / f"ledger-{old.get('sweep_hash')}.json"
            check_output_file(archived, key="results/", ours=is_ledger, fix=fix)
            archived.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(archived, target.read_text(encoding="utf-8"), key="results/")
            readme = archived.parent / "README.md"
            line = (
                f"- `{archived.name}`: the {sweep} ledger of identity {old.get('sweep_hash')} "
                f"({json.dumps(old.get('identity'), sort_keys=True)}), superseded by identity {digest}.\n"
            )
            previous = readme.read_text(encoding="utf-8") if readme.is_file() else "# Superseded records\n\n"
            atomic_write_text(readme, previous + line, key="results/")
    target.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(target, Path(ledger).read_text(encoding="utf-8"), key="results/")
