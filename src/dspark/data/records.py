"""The prompt record every prompt source yields (files, the hub, the offline generator).

Its own module so that the loaders (`prompts.py`) and the generator (`synthetic.py`) both import it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
