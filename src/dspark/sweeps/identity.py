"""What names a sweep, shared by the grid driver and the Optuna search: the config keys its hash leaves out, the
command-line key of an argument, the parent run's provenance tags and the sweep's output directory."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark.config import ResolvedConfig, repo_root, to_dict
from dspark.sweeps.spec import SweepSpec

#: where results go and how they are kept, not what they are: config groups, or dotted keys inside a group
HASH_EXCLUDED = ("paths", "tracking", "optuna", "sweep", "trainer.checkpoint_every_min")


def excluded_from_hash(dotted: str) -> bool:
    """Whether a dotted config key is left out of every sweep and search hash (`HASH_EXCLUDED`: its group or itself)."""
    return dotted.split(".")[0] in HASH_EXCLUDED or dotted in HASH_EXCLUDED


def arg_key(arg: str) -> str:
    """The key of a `key=value` command-line argument."""
    return arg.split("=", 1)[0].strip()


#: keys added after sweeps were recorded, with the value that does what the code did before each existed: left out
#: of the hash at that value, so every sweep run without them keeps its hash (its parent, its ledger) and resumes
HASH_NEUTRAL = {"sweep_tag": "", "serve.sps_forward": "plain"}


def hashable_config(rc: ResolvedConfig) -> dict[str, Any]:
    """The resolved config without what says where results go and how they are kept (`HASH_EXCLUDED`) and without
    the keys of `HASH_NEUTRAL` at their neutral value."""
    tree = {k: v for k, v in to_dict(rc.cfg).items() if k not in HASH_EXCLUDED}
    for dotted in (key for key in HASH_EXCLUDED if "." in key):
        _drop(tree, dotted, lambda value: True)
    for dotted, neutral in HASH_NEUTRAL.items():
        _drop(tree, dotted, lambda value, neutral=neutral: value == neutral)
    return tree


def _drop(tree: dict[str, Any], dotted: str, when: Any) -> None:
    """Delete the dotted key from the nested dict when `when(value)` (to_dict built the tree afresh: edit in place)."""
    *groups, leaf = dotted.split(".")
    node = tree
    for group in groups:
        node = node.get(group, {})
    if leaf in node and when(node[leaf]):
        del node[leaf]


def supervision_identity() -> dict[str, Any]:
    """What a sweep's results depend on beside its resolved config: the version of the training data's supervision.

    A fix that changes what cached features mean (`SUPERVISION_VERSION`, part of every training key) must start a
    new sweep parent and a new Optuna study: resuming the old ones would count cells trained on the old supervision
    as done, and a report would mix them with cells trained after the fix."""
    from dspark.stages.context import SUPERVISION_VERSION

    return {"supervision": SUPERVISION_VERSION}


def parent_tags(rc: ResolvedConfig, spec: SweepSpec, *, total: int) -> dict[str, str]:
    """Provenance of the parent run (the report header reads these)."""
    from dspark.tracking import git_provenance

    cfg = rc.cfg
    return {"sweep.kind": spec.kind, "paper.ref": spec.paper_ref, "sweep.description": spec.description,
            "sweep.cells": str(total), "budget": cfg.budget, "target": cfg.target,
            "command": "python experiments/run.py " + " ".join(rc.argv)} | git_provenance(repo_root())


def sweep_dir(rc: ResolvedConfig, spec: SweepSpec, sweep_hash: str) -> Path:
    """`<paths.root>/sweeps/<name>-<hash>`: the sweep file, cell configs, outcomes (and an Optuna study.json)."""
    return Path(rc.cfg.paths.root) / "sweeps" / f"{spec.name}-{sweep_hash}"
