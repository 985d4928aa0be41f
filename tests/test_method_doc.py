"""docs/METHOD.md: it exists, every `METHOD §N` / `METHOD §N.M` citation in the repository resolves to one of its
headings, and nothing the repository ships points at files outside it (`../shared`, `shared/docs`).

The checkers are plain functions of text, so the controls at the bottom can show them failing on made-up input.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METHOD_DOC = ROOT / "docs" / "METHOD.md"

# Where citations are looked for (tests/ too, minus this file, whose controls cite missing sections on purpose).
CITATION_PLACES = ("src", "docs", "benchmarks", "experiments", "sweeps", "tests", "README.md")
# What must not point outside the repository.
SELF_CONTAINED_PLACES = ("src", "docs", "benchmarks", "experiments", "sweeps", "README.md")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".sh", ".json"}
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".git", ".venv", "outputs", "mlruns", "lightning_logs"}

SECTION = r"§\s?\d+(?:\.\d+)?"
# "METHOD §3", "METHOD.md §2.1", and lists / ranges that follow it: "METHOD §1, §2.1", "METHOD §6–§7", "§2.2–§2.3".
CITATION = re.compile(rf"METHOD(?:\.md)?\s?{SECTION}(?:\s*(?:,|–|—|-|/|&|and|or)\s*{SECTION})*")
SECTION_NUMBER = re.compile(r"§\s?(\d+(?:\.\d+)?)")
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)
OUTSIDE_REFERENCE = re.compile(r"\.\./shared\b|\bshared/docs\b")


# ----------------------------------------------------------------------------------------------------- checkers
def headings(markdown: str) -> set[str]:
    """Section numbers of the numbered headings of a markdown text ("## 1. Terms" → "1", "### 2.1 …" → "2.1")."""
    return {match.group(1) for match in HEADING.finditer(markdown)}


def citations(text: str) -> list[tuple[int, str]]:
    """(line number, section) of every METHOD citation of `text`, lists and ranges expanded."""
    found = []
    for match in CITATION.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        found += [(line, number) for number in SECTION_NUMBER.findall(match.group(0))]
    return found


def unresolved_citations(texts: dict[str, str], sections: set[str]) -> list[str]:
    """ "file:line cites METHOD §N, which docs/METHOD.md has no heading for" for every citation not in `sections`."""
    return [
        f"{name}:{line} cites METHOD §{number}, which docs/METHOD.md has no heading for"
        for name, text in sorted(texts.items())
        for line, number in citations(text)
        if number not in sections
    ]


def outside_references(texts: dict[str, str]) -> list[str]:
    """ "file:line: the line" for every line that refers to files outside the repository."""
    return [
        f"{name}:{number}: {line.strip()}"
        for name, text in sorted(texts.items())
        for number, line in enumerate(text.splitlines(), start=1)
        if OUTSIDE_REFERENCE.search(line)
    ]


def repository_texts(places, *, exclude=()) -> dict[str, str]:
    """{path relative to the repository: text} of the text files under `places` (build outputs skipped)."""
    excluded = {Path(path).resolve() for path in exclude}
    files = []
    for place in places:
        path = ROOT / place
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [
                p
                for p in path.rglob("*")
                if p.is_file()
                and p.suffix in TEXT_SUFFIXES
                and not any(
                    part in SKIPPED_DIRS or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts[:-1]
                )
            ]
    texts = {}
    for path in sorted(set(files)):
        if path.resolve() in excluded:
            continue
        try:
            texts[path.relative_to(ROOT).as_posix()] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return texts


# ------------------------------------------------------------------------------------------------------- checks
def test_method_doc_exists_with_the_cited_numbering():
    assert METHOD_DOC.is_file(), "docs/METHOD.md is missing: the code cites it ~125 times as METHOD §N"
    sections = headings(METHOD_DOC.read_text(encoding="utf-8"))
    expected = {str(n) for n in range(1, 11)} | {"2.1", "2.2", "2.3"}
    assert expected <= sections, f"docs/METHOD.md lacks the numbered headings {sorted(expected - sections)}"


def test_every_method_citation_resolves():
    texts = repository_texts(CITATION_PLACES, exclude=[__file__])
    found = [c for text in texts.values() for c in citations(text)]
    assert len(found) > 100, f"only {len(found)} METHOD citations found: is the scan looking in the right places?"
    problems = unresolved_citations(texts, headings(METHOD_DOC.read_text(encoding="utf-8")))
    assert not problems, "unresolved METHOD citations:\n" + "\n".join(problems)


def test_nothing_refers_to_files_outside_the_repository():
    problems = outside_references(repository_texts(SELF_CONTAINED_PLACES))
    assert not problems, (
        "references to files outside the repository (cite docs/METHOD.md, or say what the file "
        "said):\n" + "\n".join(problems)
    )


# ----------------------------------------------------------------------------------------------------- controls
MADE_UP_DOC = "# Doc\n\n## 1. Terms\n\n### 1.1 Words\n\n## 2. More\n"


def test_control_headings_are_parsed():
    assert headings(MADE_UP_DOC) == {"1", "1.1", "2"}


def test_control_a_missing_section_is_reported_with_file_and_line():
    text = "x = 1  # METHOD §1\n\n# see METHOD §1.1, §7 and METHOD.md §2.3\n"
    assert citations(text) == [(1, "1"), (3, "1.1"), (3, "7"), (3, "2.3")]
    problems = unresolved_citations({"src/fake.py": text}, headings(MADE_UP_DOC))
    assert problems == [
        "src/fake.py:3 cites METHOD §7, which docs/METHOD.md has no heading for",
        "src/fake.py:3 cites METHOD §2.3, which docs/METHOD.md has no heading for",
    ]


def test_control_ranges_and_trailing_punctuation():
    assert [n for _, n in citations("(METHOD §6–§7, paper §5.2)")] == ["6", "7"]
    assert [n for _, n in citations("the loss (METHOD §3).")] == ["3"]
    assert citations("no citation: paper §4.1, METHODS") == []


def test_control_outside_references_are_reported():
    text = "ok\nread `../shared/docs/METHOD.md`\nalso shared/docs/CPU_RECIPE.md\nshared.py is fine\n"
    assert outside_references({"README.md": text}) == [
        "README.md:2: read `../shared/docs/METHOD.md`",
        "README.md:3: also shared/docs/CPU_RECIPE.md",
    ]


@pytest.mark.parametrize("line", ["docs/METHOD.md §3", "src/dspark/decoding/shared.py", "/shared/path/study.journal"])
def test_control_no_false_outside_reference(line):
    assert outside_references({"x.md": line}) == []
