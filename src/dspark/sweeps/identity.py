"""What names a sweep, shared by the grid driver and the Optuna search.

A sweep is named by what the user asked for, not by every default: its identity is the sweep's name, the budget,
the explicit command-line overrides that apply to every cell (axis selections, `sweep.axes.*` / `sweep.seeds`,
output paths and tracking excluded), the runner's options and the recorded recipe version. The grid is not part of
it: a sweep whose axis grows (`sweep.axes.model.head=[...,NEW]`) keeps its parent run and its finished cells.

What a default change does is judged per cell instead: every cell's resolved config is recorded with its run (the
flat params), and a finished cell whose record differs from what today's defaults resolve, on a key its stages read,
is *drifted*: the report lists it as "recorded under an older recipe" and a rerun redoes only those cells.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

from dspark.config import ResolvedConfig, parse_overrides, repo_root, to_dict
from dspark.config.secrets import mask_tree
from dspark.config.loader import flatten
from dspark.sweeps.spec import SweepSpec

#: bump when the code changes what every cell computes in a way no config key shows (a fix to the supervision has its
#: own version, `stages.context.SUPERVISION_VERSION`, which enters the identity too): a new recipe starts new parents
RECIPE_VERSION = 1

#: where results go and how they are kept, not what they are: config groups, or dotted keys inside a group
HASH_EXCLUDED = ("paths", "tracking", "optuna", "sweep", "trainer.checkpoint_every_min")

#: keys a cell's stages never read, by stage: a difference there is not drift (`drifted_keys`)
_UNREAD_BY_STAGE = {
    "prepare": ("decode.", "serve.", "export."),
    "train": ("decode.", "serve.", "export."),
    "eval": ("serve.", "export."),
    "all": ("serve.", "export."),
    "serve": ("export.",),
}
#: the keys that say how the cell ran, not what it computed
_NEVER_DRIFT = ("stage", "budget", "sweep_tag")


def excluded_from_hash(dotted: str) -> bool:
    """Whether a dotted config key is left out of every sweep identity (`HASH_EXCLUDED`: its group or itself)."""
    return dotted.split(".")[0] in HASH_EXCLUDED or dotted in HASH_EXCLUDED


def arg_key(arg: str) -> str:
    """The key of a `key=value` command-line argument."""
    return arg.split("=", 1)[0].strip()


def explicit_overrides(argv: Iterable[str], *, axis_keys: Iterable[str] = (), ignore: Iterable[str] = ()) -> list[str]:
    """The command line's `key=value` overrides that apply to every cell, normalised (`key=<JSON value>`, sorted):
    without `sweep=`, `budget=`, `stage=`, axis selections, the `sweep.*` grow arguments and excluded groups, and
    with credentials masked (they say how to reach data, not what it is; the identity is recorded)."""
    skip = set(axis_keys) | set(ignore) | {"budget", "stage", "seed"}
    parsed = parse_overrides(a for a in argv if "=" in a)
    kept = {k: mask_tree(v) for k, v in parsed.items() if k not in skip and not excluded_from_hash(k)}
    return [f"{k}={json.dumps(v, sort_keys=True, default=str)}" for k, v in sorted(kept.items())]


def supervision_identity() -> dict[str, Any]:
    """The version of the training data's supervision (`SUPERVISION_VERSION`, part of every training key): a fix
    that changes what cached features mean starts a new sweep parent and a new Optuna study, so that no report mixes
    cells trained before and after it."""
    from dspark.stages.context import SUPERVISION_VERSION

    return {"supervision": SUPERVISION_VERSION}


def sweep_identity(rc: ResolvedConfig, spec: SweepSpec, *, ignore: Iterable[str] = ()) -> dict[str, Any]:
    """What names this sweep: name, budget, explicit overrides, runner options, recipe and supervision versions."""
    axis_keys = spec.axis_keys() if spec.kind == "grid" else [p.key for p in spec.optuna.params]
    identity = {
        "sweep": spec.name,
        "budget": rc.cfg.budget,
        "runner": spec.runner,
        "overrides": explicit_overrides(rc.argv, axis_keys=axis_keys, ignore=ignore),
        "recipe": RECIPE_VERSION,
        **supervision_identity(),
    }
    if spec.runner == "latency":
        identity["latency"] = spec.latency_options(rc.cfg.budget)
    if spec.kind == "optuna":
        identity["search"] = spec.digest()  # the search space and objective: a new space is a new study
    return identity


def identity_hash(identity: dict[str, Any]) -> str:
    """The 12-hex-digit name of an identity (`sweep.hash` tag, ledger and study names)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:12]


def hashable_config(rc: ResolvedConfig) -> dict[str, Any]:
    """The resolved config without what says where results go and how they are kept (`HASH_EXCLUDED`), credentials
    masked as the run's params record them."""
    return {k: v for k, v in flatten(mask_tree(to_dict(rc.cfg))).items() if not excluded_from_hash(k)}


def recorded_config(rc: ResolvedConfig) -> dict[str, str]:
    """A cell's resolved config as its run records it (flat params, values as MLflow stores them: `str(value)`)."""
    return {k: str(v) for k, v in hashable_config(rc).items()}


def drifted_keys(recorded: dict[str, str], today: dict[str, str]) -> list[str]:
    """The keys on which a finished cell's recorded config differs from today's resolution of the same cell.

    Only keys the cell's stages read count (`_UNREAD_BY_STAGE`); a key the record lacks was added after the cell
    ran, and a new key's default is by rule what the code did before it existed, so it is not drift."""
    unread = _UNREAD_BY_STAGE.get(today.get("stage", "all"), ())
    return sorted(
        k
        for k, v in today.items()
        if k in recorded and recorded[k] != v and not k.startswith(unread) and k not in _NEVER_DRIFT
    )


def parent_tags(
    rc: ResolvedConfig, spec: SweepSpec, *, total: int, identity: dict[str, Any] | None = None
) -> dict[str, str]:
    """Provenance of the parent run (the report header reads these)."""
    from dspark.tracking import git_provenance

    cfg = rc.cfg
    tags = {
        "sweep.kind": spec.kind,
        "paper.ref": spec.paper_ref,
        "sweep.description": spec.description,
        "sweep.cells": str(total),
        "budget": cfg.budget,
        "target": cfg.target,
        "command": sweep_command(rc.argv),
    } | git_provenance(repo_root())
    if identity is not None:
        tags["sweep.identity"] = json.dumps(identity, sort_keys=True, default=str)
    return tags


def sweep_command(argv: Iterable[str]) -> str:
    """The command as recorded on runs, ledgers and reports (`tracking.ui.public_command`: no `paths.*`, no
    password)."""
    from dspark.tracking.ui import public_command

    return public_command(list(argv))


def sweep_dir(rc: ResolvedConfig, spec: SweepSpec, sweep_hash: str) -> Path:
    """`<paths.root>/sweeps/<name>-<hash>`: the sweep file, cell configs, outcomes (and an Optuna study.json)."""
    return Path(rc.cfg.paths.root) / "sweeps" / f"{spec.name}-{sweep_hash}"
