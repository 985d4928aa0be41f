"""The README stays the front door: short, every relative link resolves, nothing outside the repository, every sweep."""

from __future__ import annotations

import re

from dspark.config.resolve import available_sweeps, repo_root

README = repo_root() / "README.md"
MAX_LINES = 200
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(text: str) -> list[str]:
    """The link targets of `text` that point into the repository (no scheme, no bare #anchor), anchors dropped."""
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t.split("#")[0] for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_readme_is_at_most_200_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; keep it ≤ {MAX_LINES} (history: docs/LOG.md)"


def test_every_relative_link_resolves():
    links = relative_links(README.read_text(encoding="utf-8"))
    assert links, "no relative links found: the link pattern is broken"
    missing = [link for link in links if not (repo_root() / link).exists()]
    assert not missing, f"README.md links to paths that do not exist: {missing}"


def test_link_check_catches_a_missing_file():
    """The control: a link to a file that does not exist is reported, external links and anchors are skipped."""
    text = "[a](docs/NO_SUCH_FILE.md) [b](https://example.org/x.md) [c](#section) ![d](docs/LOG.md#top)"
    links = relative_links(text)
    assert links == ["docs/NO_SUCH_FILE.md", "docs/LOG.md"]
    assert not (repo_root() / links[0]).exists()


def test_readme_does_not_reach_outside_the_repository():
    assert "../shared" not in README.read_text(encoding="utf-8")


def test_every_sweep_has_its_command():
    text = README.read_text(encoding="utf-8")
    missing = [name for name in available_sweeps() if f"`{name}`" not in text]
    assert not missing, f"sweeps/ has files the README does not list: {missing}"
