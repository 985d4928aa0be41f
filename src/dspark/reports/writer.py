"""Markdown report writer: a provenance header, then the builder's sections (tables, figures, notes)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from dspark.config.secrets import mask_url
from dspark.reports.collect import counted

if TYPE_CHECKING:
    from dspark.tracking import TrackingStore


@dataclass
class Section:
    title: str
    body: str


@dataclass
class Provenance:
    """Where the numbers of a report come from (every field is shown in the header)."""

    git_commit: str = "–"  # of the runs (parent tag), with '(dirty)' when the tree had local changes
    date: str = "–"  # when the report was generated
    machine: str = "–"
    target: str = "–"
    budget: str = "–"
    command: str = "–"  # the command that ran the sweep
    tracking_uri: str = "–"
    experiment: str = "–"
    parent_run_id: str = "–"
    sweep_hash: str = "–"
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_runs(
        cls,
        runs: Any,
        *,
        store: TrackingStore,
        experiment: str,
        now: datetime.datetime | None = None,
        fallback: dict[str, str] | None = None,
        selection_keys: Iterable[str] = (),
    ) -> "Provenance":
        """Read the parent run's tags (`fallback` tags when there is no parent); `now` = generation time; the
        machine is that of the completed cells (`SweepRuns.machines`) where they carry it, else the parent's.

        The command is the sweep's, without the `selection_keys` arguments (a sweep's axis keys: the process that
        created the parent may have selected some cells with them, `model.block_size=3`, which leaves the sweep and
        its report the same). Cells that ran at other commits than the parent's are listed beside it."""
        fallback = fallback or {}

        def tag(name: str, default: str = "–") -> str:
            return runs.parent_tag(name, fallback.get(name, default))

        commit = tag("git.commit")
        if tag("git.dirty", "False") == "True":
            commit += " (dirty)"
        stamp = (now or datetime.datetime.now()).strftime("%Y-%m-%d %H:%M")
        extra = {}
        cell_commits = runs.tag_counts("git.commit")
        if cell_commits and {c for c, _ in cell_commits} != {tag("git.commit")}:
            commit += " (the parent run)"
            extra["cells ran at"] = counted([(c[:12], n) for c, n in cell_commits])
        imported = runs.from_ledger()
        if imported:
            extra["imported from the sweep ledger"] = imported
        return cls(
            git_commit=commit,
            date=stamp,
            machine=runs.machines() or tag("machine"),
            target=tag("target"),
            budget=tag("budget"),
            command=without_arguments(tag("command"), selection_keys),
            tracking_uri=shown_uri(store.uri),
            experiment=experiment,
            parent_run_id=runs.parent.info.run_id if runs.parent is not None else "–",
            sweep_hash=tag("sweep.hash"),
            extra=extra,
        )

    def lines(self) -> list[str]:
        rows = [
            ("git commit", self.git_commit),
            ("generated", self.date),
            ("machine", self.machine),
            ("target", self.target),
            ("budget", self.budget),
            ("command", f"`{self.command}`"),
            (
                "MLflow",
                f"{self.tracking_uri}, experiment {self.experiment}, parent run tagged "
                f"`sweep.hash = {self.sweep_hash}`",
            ),
        ]
        rows += list(self.extra.items())
        return [f"- {name}: {value}" for name, value in rows]


def shown_uri(uri: str) -> str:
    """The store as a report shows it: a local store by its place under paths.root (no machine's path), a server
    without credentials. The parent run's id is left out too: it differs in every store that imports the ledger."""
    if uri.startswith("sqlite:") or uri.startswith("file:") or "://" not in uri:
        return "the local store under paths.root (`mlflow.db`)"
    return mask_url(uri)


def render_report(
    *, name: str, description: str, paper_ref: str, provenance: Provenance, sections: list[Section], note: str = ""
) -> str:
    """The whole markdown document."""
    title = f"# Sweep `{name}`" + (f" — {description}" if description else "")
    lines = [title, ""]
    if paper_ref:
        lines += [f"Reproduces: {paper_ref}.", ""]
    lines += provenance.lines()
    regenerate = report_command(provenance.command, name=name)
    lines += [f"- regenerate: `{regenerate}` (reads the tracking store and the sweep's ledgers)", ""]
    if note:
        lines += [f"> {note}", ""]
    for section in sections:
        lines += [f"## {section.title}", "", section.body.rstrip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def without_arguments(command: str, keys: Iterable[str]) -> str:
    """`command` without its `key=value` words whose key is one of `keys`."""
    drop = set(keys)
    return " ".join(w for w in command.split() if w.split("=", 1)[0] not in drop) if drop else command


def report_command(command: str, *, name: str) -> str:
    """The sweep's own command with `stage=report` (so paths.root / tracking.uri / budget stay the same)."""
    if not command.startswith("python "):
        return f"python experiments/run.py sweep={name} stage=report"
    return f"{without_arguments(command, ['stage'])} stage=report"
