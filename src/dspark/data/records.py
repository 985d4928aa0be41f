"""The prompt record every prompt source yields (files, the hub, the offline generator).

Its own module so that the loaders (`prompts.py`) and the generator (`synthetic.py`) both import it without
importing each other.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import Any

DOMAINS = ("math", "code", "chat", "instruction")  # what a record's `domain` may be


@dataclass
class PromptRecord:
    """One prompt: `prompt` is the first user turn (the only one the paper feeds), `turns` the later user turns.

    `reference` is the dataset's own reference response to `prompt` where the source has one (a worked solution,
    reference code, a human or model answer; None otherwise, e.g. for sets that hold final answers only).
    """

    id: str
    domain: str  # one of DOMAINS
    prompt: str
    turns: list[str] = field(default_factory=list)
    reference: str | None = None


# ---- the fields of a prompt file's row (prompt_sets/SOURCES.md), checked before a row becomes a record ----

QUOTE_LIMIT = 60  # characters of a field's value an error quotes
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 2, 4, 4
_REPR.maxstring = _REPR.maxother = QUOTE_LIMIT


def quote(value: Any) -> str:
    """A bounded repr of a row's value (a field may hold a megabyte string or a huge number)."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int past str()'s 4300 digits
        return "<a number too large to show>"
    return text if len(text) <= QUOTE_LIMIT else text[: QUOTE_LIMIT - 1] + "…"


def row_defect(row: dict[str, Any], *, domain_required: bool = False) -> str | None:
    """None when the row of a prompt file has a usable `prompt` (or `turns`) and every known field has its type,
    else what is wrong, naming the field and its value. `domain_required`: the set takes each row's domain (a mixed
    set), so it must be one of DOMAINS."""
    prompt, turns = row.get("prompt"), row.get("turns")
    if turns is not None and not (isinstance(turns, list) and all(isinstance(t, str) for t in turns)):
        return f"`turns` must be a list of strings (the later user turns), not {quote(turns)}"
    if prompt is None and not (turns and turns[0]):
        return "no `prompt` string (nor a `turns` list)"
    if prompt is not None and not (isinstance(prompt, str) and prompt):
        return f"`prompt` must be a non-empty string, not {quote(prompt)}"
    for name, ok, expected in _FIELD_TYPES:
        if row.get(name) is not None and not ok(row[name]):
            return f"`{name}` must be {expected}, not {quote(row[name])}"
    domain = row.get("domain")
    if domain_required and domain is not None and domain not in DOMAINS:
        return f"`domain` must be one of {', '.join(DOMAINS)}, not {quote(domain)}"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# (field, check, what it must be) of the optional fields a loader reads; null is always allowed
_FIELD_TYPES = (
    ("id", lambda v: isinstance(v, str) or _is_int(v), "a string or an integer"),
    ("domain", lambda v: isinstance(v, str), "a string"),
    (
        "reference",
        lambda v: isinstance(v, str) or _is_int(v) or isinstance(v, float),
        "a string (the reference answer)",
    ),
    ("paper_eval_rank", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
)
