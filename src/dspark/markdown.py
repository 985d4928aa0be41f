"""Markdown for reports: number cells and tables, one format everywhere (evaluation reports, sweep reports)."""

from __future__ import annotations

import math
from typing import Any, Sequence

MISSING = "–"  # a cell without a finite value


def num(value: float | None, digits: int = 2) -> str:
    """A number for a markdown cell with `digits` decimals; '–' for missing or non-finite values."""
    if value is None or not math.isfinite(value):
        return MISSING
    return f"{value:.{digits}f}"


def pct(value: float | None, digits: int = 1, *, signed: bool = True) -> str:
    """A fraction as a percentage cell ('+12.3%'); '–' for missing or non-finite values."""
    if value is None or not math.isfinite(value):
        return MISSING
    return f"{100 * value:+.{digits}f}%" if signed else f"{100 * value:.{digits}f}%"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells are str()-ed."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])
