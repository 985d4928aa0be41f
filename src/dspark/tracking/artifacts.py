"""Reports as MLflow artifacts that read well in the UI: the markdown file, an HTML rendering of it with its figures
embedded, and the figures themselves.

Why HTML with data URIs: MLflow's artifact view shows an `.html` artifact in a sandboxed iframe loaded from a blob
URL (MLflow 3.17, `ShowArtifactHtmlView`), so a relative `<img src="x.png">` resolves against nothing there, and its
markdown view cannot reach the figures beside the file either; an image inlined as `data:image/png;base64,…` shows.
The PNGs are logged too: the artifact view shows each one as an image.

`markdown_to_html` converts the subset our reports are written in (`dspark.markdown`, the report writers): ATX
headings, paragraphs, `-`/`*`/`1.` lists (nested by indentation, items continued on the next lines), pipe tables,
fenced code blocks, block quotes, and inline images, links, code spans, **bold** and *italic*. Everything else is
escaped text, never raw HTML.
"""

from __future__ import annotations

import base64
import html
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dspark.tracking.store import TrackingStore

IMAGE_TYPES = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".svg": "image/svg+xml",
}
STYLE = (
    "body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;font-size:14px;line-height:1.45;"
    "margin:16px;max-width:1200px}table{border-collapse:collapse;margin:8px 0}th,td{border:1px solid #ccc;"
    "padding:3px 8px;text-align:left}th{background:#f4f4f4}code{background:#f4f4f4;padding:0 3px}"
    "pre{background:#f4f4f4;padding:8px;overflow-x:auto}img{max-width:100%}blockquote{color:#555;"
    "border-left:3px solid #ccc;margin:0;padding-left:12px}"
)

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_ITEM = re.compile(r"^(\s*)([-*+]|\d+[.)])\s+(.*)$")
_RULE = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")
_INLINE = re.compile(
    r"`([^`]+)`|!\[([^\]]*)\]\(([^)\s]+)\)|\[([^\]]+)\]\(([^)\s]+)\)|\*\*(.+?)\*\*"
    r"|(?<![\w*])\*(?![\s*])(.+?)(?<![\s*])\*(?![\w*])"
)


def log_report(
    store: TrackingStore,
    run_id: str,
    markdown_path: str | Path,
    figures: Iterable[str | Path] = (),
    *,
    artifact_path: str,
) -> list[str]:
    """Log `markdown_path`, its HTML rendering (`<stem>.html`, figures inlined) and each existing figure under
    `artifact_path` of the run; returns the artifact paths logged. Figures are found by the name the markdown
    uses (`![..](name.png)`), so pass the files the report refers to."""
    markdown_path = Path(markdown_path)
    figures = [Path(f) for f in figures if Path(f).is_file()]
    images = {f.name: data_uri(f) for f in figures}
    page = markdown_to_html(
        markdown_path.read_text(encoding="utf-8"),
        title=markdown_path.stem,
        image_src=lambda src: images.get(Path(src).name, src),
    )
    with tempfile.TemporaryDirectory(prefix="dspark-report-") as tmp:  # the HTML exists only as an artifact
        rendered = Path(tmp) / f"{markdown_path.stem}.html"
        rendered.write_text(page, encoding="utf-8")
        return log_files(store, run_id, [markdown_path, rendered, *figures], artifact_path=artifact_path)


def log_files(store: TrackingStore, run_id: str, files: Iterable[str | Path], *, artifact_path: str) -> list[str]:
    """Log exactly `files` (each must exist) under `artifact_path` of the run, never the rest of their folder;
    returns the artifact paths logged."""
    logged = []
    for path in map(Path, files):
        store.client.log_artifact(run_id, str(path), artifact_path=artifact_path)
        logged.append(f"{artifact_path}/{path.name}")
    return logged


def data_uri(path: Path) -> str:
    """The file as a `data:` URI (its type from the suffix)."""
    kind = IMAGE_TYPES.get(path.suffix.lower(), "application/octet-stream")
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def markdown_to_html(text: str, *, title: str = "", image_src: Callable[[str], str] = lambda src: src) -> str:
    """A standalone HTML page of `text` (the subset of the module docstring); `image_src` maps each image's
    markdown target to its `src` (e.g. to a data URI)."""
    body = _Blocks(text.splitlines(), image_src=image_src).render()
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def inline_html(text: str, *, image_src: Callable[[str], str] = lambda src: src) -> str:
    """One line of markdown → HTML: code spans, images, links, **bold**, *italic*; the rest escaped."""
    out, last = [], 0
    for match in _INLINE.finditer(text):
        out.append(html.escape(text[last : match.start()], quote=False))
        code, alt, src, label, href, bold, italic = match.groups()
        if code is not None:
            out.append(f"<code>{html.escape(code, quote=False)}</code>")
        elif src is not None:
            out.append(f'<img alt="{html.escape(alt)}" src="{html.escape(image_src(src))}">')
        elif href is not None:
            out.append(f'<a href="{html.escape(href)}">{inline_html(label, image_src=image_src)}</a>')
        elif bold is not None:
            out.append(f"<strong>{inline_html(bold, image_src=image_src)}</strong>")
        else:
            out.append(f"<em>{inline_html(italic, image_src=image_src)}</em>")
        last = match.end()
    out.append(html.escape(text[last:], quote=False))
    return "".join(out)


def _cells(line: str) -> list[str]:
    """The cells of a pipe-table row (`\\|` is a literal bar)."""
    row = line.strip().removeprefix("|")
    row = row[:-1] if row.endswith("|") and not row.endswith("\\|") else row
    return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", row)]


class _Blocks:
    """Block structure of the markdown subset, rendered line by line."""

    def __init__(self, lines: list[str], *, image_src: Callable[[str], str]) -> None:
        self.lines, self.i, self.image_src = lines, 0, image_src

    def inline(self, text: str) -> str:
        return inline_html(text, image_src=self.image_src)

    def render(self) -> str:
        out = []
        while self.i < len(self.lines):
            line = self.lines[self.i]
            if not line.strip():
                self.i += 1
            elif line.lstrip().startswith("```"):
                out.append(self.fence())
            elif heading := _HEADING.match(line):
                level = len(heading.group(1))
                out.append(f"<h{level}>{self.inline(heading.group(2))}</h{level}>")
                self.i += 1
            elif self.is_table(self.i):
                out.append(self.table())
            elif _ITEM.match(line):
                out.append(self.items(len(_ITEM.match(line).group(1))))
            elif line.lstrip().startswith(">"):
                out.append(self.quote())
            else:
                out.append(self.paragraph())
        return "\n".join(out)

    def is_table(self, i: int) -> bool:
        return (
            self.lines[i].lstrip().startswith("|") and i + 1 < len(self.lines) and bool(_RULE.match(self.lines[i + 1]))
        )

    def starts_block(self, line: str) -> bool:
        return (
            not line.strip()
            or bool(_HEADING.match(line))
            or bool(_ITEM.match(line))
            or line.lstrip().startswith(("```", ">", "|"))
        )

    def paragraph(self) -> str:
        parts = [self.lines[self.i].strip()]
        self.i += 1
        while self.i < len(self.lines) and not self.starts_block(self.lines[self.i]):
            parts.append(self.lines[self.i].strip())
            self.i += 1
        return f"<p>{self.inline(' '.join(parts))}</p>"

    def fence(self) -> str:
        self.i += 1
        code = []
        while self.i < len(self.lines) and not self.lines[self.i].lstrip().startswith("```"):
            code.append(self.lines[self.i])
            self.i += 1
        self.i += 1  # the closing fence
        return f"<pre><code>{html.escape(chr(10).join(code), quote=False)}</code></pre>"

    def quote(self) -> str:
        inner = []
        while self.i < len(self.lines) and self.lines[self.i].lstrip().startswith(">"):
            inner.append(self.lines[self.i].lstrip()[1:].removeprefix(" "))
            self.i += 1
        return f"<blockquote>{_Blocks(inner, image_src=self.image_src).render()}</blockquote>"

    def table(self) -> str:
        header = _cells(self.lines[self.i])
        self.i += 2
        rows = []
        while self.i < len(self.lines) and self.lines[self.i].lstrip().startswith("|"):
            rows.append(_cells(self.lines[self.i]))
            self.i += 1
        head = "".join(f"<th>{self.inline(c)}</th>" for c in header)
        body = "".join("<tr>" + "".join(f"<td>{self.inline(c)}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def items(self, indent: int) -> str:
        """A list whose items start at `indent` spaces; deeper items nest, continuation lines join their item."""
        ordered = _ITEM.match(self.lines[self.i]).group(2)[0].isdigit()
        entries: list[list[str]] = []
        while self.i < len(self.lines):
            line = self.lines[self.i]
            item = _ITEM.match(line)
            if item and len(item.group(1)) == indent:
                if item.group(2)[0].isdigit() != ordered:  # `1.` after `-` items: a new list
                    break
                entries.append([self.inline(item.group(3))])
                self.i += 1
            elif item and len(item.group(1)) > indent and entries:
                entries[-1].append(self.items(len(item.group(1))))
            elif entries and line.strip() and not item and line.startswith(" ") and not self.is_table(self.i):
                entries[-1][-1] += " " + self.inline(line.strip())  # a wrapped item
                self.i += 1
            elif entries and line.strip() and not self.starts_block(line) and indent == 0:
                entries[-1][-1] += " " + self.inline(line.strip())  # a lazy continuation
                self.i += 1
            else:
                break
        tag = "ol" if ordered else "ul"
        return f"<{tag}>" + "".join(f"<li>{''.join(parts)}</li>" for parts in entries) + f"</{tag}>"
