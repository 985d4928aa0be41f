"""The front matter of a results/ report: YAML between two `---` lines at the top, the few facts a reader (and
results/INDEX.md) needs before the body — the question it answers, its headline number with the interval, where
(machine), from what code (commit), when, and the command that reproduces it.

`kind` says how the report is kept current: `sweep` (regenerated from the folder's ledger.json by
`python -m dspark.results`), `measurement` (a benchmark's markdown, rerun with its command), `evaluation` (one run's
evaluation report) or `not run yet`. A commit with `(dirty)` (uncommitted changes in the tree that ran it) fails
tests/test_results.py unless it says a rerun is pending: `rerun_pending: <which cells and why>`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

FENCE = "---"
FIELDS = ("question", "headline", "machine", "commit", "date", "command", "kind")
DIRTY = "(dirty)"  #: marks a commit field whose code had uncommitted changes


def split_front_matter(text: str) -> tuple[dict[str, str] | None, str]:
    """(front matter as a dict of strings, the body after it); (None, text) when the text opens without one."""
    lines = text.split("\n")
    if not lines or lines[0].strip() != FENCE:
        return None, text
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == FENCE)
    except StopIteration:
        return None, text
    loaded = yaml.safe_load("\n".join(lines[1:end])) or {}
    if not isinstance(loaded, dict):
        return None, text
    body = "\n".join(lines[end + 1 :])
    return {str(k): "" if v is None else str(v) for k, v in loaded.items()}, body.lstrip("\n")


def render_front_matter(meta: dict[str, Any]) -> str:
    """The `---` block: the standard FIELDS first, in their order, then any other keys as given."""
    ordered = {k: str(meta[k]) for k in FIELDS if k in meta}
    ordered.update({k: str(v) for k, v in meta.items() if k not in ordered})
    dumped = yaml.safe_dump(ordered, sort_keys=False, allow_unicode=True, width=1_000_000, default_flow_style=False)
    return f"{FENCE}\n{dumped}{FENCE}\n"


def with_front_matter(meta: dict[str, Any], body: str) -> str:
    """`body` (any front matter it had removed) under the front matter `meta`, one blank line between."""
    _, rest = split_front_matter(body)
    return render_front_matter(meta) + "\n" + rest.lstrip("\n")


def read_front_matter(path: Path) -> dict[str, str] | None:
    """The front matter of a markdown file, or None."""
    return split_front_matter(Path(path).read_text(encoding="utf-8"))[0]
