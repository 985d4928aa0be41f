"""Resolve a run's configuration: defaults < default.yaml < budget overlay < sweep cell < command line.

Semantic validation runs after the final merge and reports every problem at once, before any work starts: each
numeric key against the range its schema field declares (`dspark.config.ranges`), then names, and the rules that
relate one key to another (drafter/head compatibility, list lengths, fractions that must leave a training split).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.config.loader import ConfigError, apply_overrides, load_yaml, parse_overrides
from dspark.config.ranges import quote, range_errors, shorten
from dspark.config.schema import (
    BUDGETS,
    BYPASS_MODES,
    CONFIDENCE_HEAD,
    CONFIDENCE_POLICIES,
    CONFIDENCE_SOURCES,
    DRAFTERS,
    EXPORT_DTYPES,
    EXPORT_LAYOUTS,
    FIXED_HEAD,
    HEADS,
    LOSS_KINDS,
    MAX_TREE_NODES,
    POLICIES,
    POSITION_WEIGHTS,
    PRECISIONS,
    RESPONSE_MODES,
    SCHEDULER_COSTS,
    SCHEDULER_STOPS,
    SERVE_CONFIDENCE_POLICIES,
    SERVE_POLICIES,
    SPS_FORWARDS,
    STAGES,
    STEP_COSTS,
    STEP_OVERHEADS,
    TARGET_DTYPES,
    TREE_SCHEMES,
    TREE_SHAPES,
    VERIFIERS,
    RunConfig,
)
from dspark.registry import unknown_name_message


def repo_root() -> Path:
    """The checkout holding `experiments/` (editable installs), else the working directory."""
    env = os.environ.get("DSPARK_REPO_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "experiments" / "default.yaml").exists():
            return parent
    return Path.cwd().resolve()


def experiments_dir() -> Path:
    return repo_root() / "experiments"


def sweeps_dir() -> Path:
    return repo_root() / "sweeps"


def available_sweeps() -> list[str]:
    return sorted(p.stem for p in sweeps_dir().glob("*.yaml"))


@dataclass
class ResolvedConfig:
    """The final config plus what produced it (for provenance)."""

    cfg: RunConfig
    explicit_keys: set[str] = field(default_factory=set)  # keys set by a sweep cell or the command line
    argv: list[str] = field(default_factory=list)
    #: the sweep's own arguments (`sweep.axes.<key>=[...]`, `sweep.seeds=[...]`), read by the sweep driver
    sweep_args: dict[str, Any] = field(default_factory=dict)

    @property
    def root(self) -> Path:
        return Path(self.cfg.paths.root)

    @property
    def reports_dir(self) -> Path:
        return Path(self.cfg.paths.reports)


#: command-line keys that belong to the sweep driver, not to the config schema (`sweep.axes.*`, `sweep.seeds`)
SWEEP_ARG_PREFIX = "sweep."


def resolve_config(argv: list[str], *, cell_overrides: dict[str, Any] | None = None) -> ResolvedConfig:
    """Parse argv (`key=value ...`) into a validated config. `cell_overrides` come from a sweep cell."""
    overrides = parse_overrides(argv)
    sweep_args = {k: overrides.pop(k) for k in list(overrides) if k.startswith(SWEEP_ARG_PREFIX)}
    if sweep_args and not overrides.get("sweep"):
        keys = shorten(", ".join(sweep_args))
        raise ConfigError(f"{keys}: these change a sweep's axes; add sweep=NAME (sweeps/NAME.yaml).")
    cell = dict(cell_overrides or {})
    budget = overrides.get("budget", cell.get("budget"))
    cfg = apply_overrides(RunConfig(), load_yaml(experiments_dir() / "default.yaml"), source="experiments/default.yaml")
    budget = budget if budget is not None else cfg.budget
    if budget not in BUDGETS:
        raise ConfigError(unknown_name_message("budget", shorten(str(budget)), list(BUDGETS)))
    cfg = apply_overrides(cfg, load_yaml(experiments_dir() / "budgets" / f"{budget}.yaml"), source=f"budget {budget}")
    cfg = apply_overrides(cfg, cell, source="sweep cell")
    cfg = apply_overrides(cfg, overrides, source="command line")
    explicit = set(cell) | set(overrides)
    apply_drafter_defaults(cfg, explicit)
    if "data.train_sets" in explicit and "data.train_weights" not in explicit:
        cfg.data.train_weights = []  # a budget's per-set weights belong to its own train_sets: equal shares instead
    resolve_paths(cfg)
    validate_config(cfg, explicit_keys=explicit)
    return ResolvedConfig(cfg=cfg, explicit_keys=explicit, argv=list(argv), sweep_args=sweep_args)


def apply_drafter_defaults(cfg: RunConfig, explicit: set[str]) -> None:
    """The head a drafter kind fixes (`FIXED_HEAD`: dflash and eagle3 have none) unless model.head was given (then
    validation explains the clash); DFlash trains with CE only (DeepSpec's baseline, METHOD §3)."""
    fixed = FIXED_HEAD.get(cfg.drafter)
    if fixed is not None and "model.head" not in explicit:
        cfg.model.head = fixed
    if cfg.drafter == "dflash":
        for key, value in (("alpha_ce", 1.0), ("alpha_tv", 0.0), ("alpha_conf", 0.0)):
            if f"loss.{key}" not in explicit:
                setattr(cfg.loss, key, value)


def resolve_paths(cfg: RunConfig) -> None:
    """Make paths absolute; the default root is <repo>/outputs (git-ignored), reports go to <root>/reports: a run
    writes nothing into the tracked tree (results/ is curated by `make results`, never by a run)."""
    root = repo_root() / "outputs" if not cfg.paths.root else Path(cfg.paths.root).expanduser()
    cfg.paths.root = str(root.resolve())
    if not cfg.paths.reports:
        cfg.paths.reports = str(root.resolve() / "reports")


def validate_config(cfg: RunConfig, *, explicit_keys: set[str] = frozenset()) -> None:
    """Range, name and cross-key checks on the merged config; all problems reported together."""
    errors = [
        e
        for e in range_errors(cfg)
        + _name_errors(cfg)
        + _cross_key_errors(cfg)
        + _drafter_errors(cfg, explicit_keys)
        + _policy_errors(cfg)
        + _tree_errors(cfg)
        if e
    ]
    if errors:
        raise ConfigError("Invalid configuration:\n  - " + "\n  - ".join(errors))


def _name_errors(cfg: RunConfig) -> list[str]:
    checks = [
        ("drafter", cfg.drafter, DRAFTERS),
        ("model.head", cfg.model.head, HEADS),
        ("stage", cfg.stage, STAGES),
        ("budget", cfg.budget, BUDGETS),
        ("decode.policy", cfg.decode.policy, POLICIES),
        ("serve.policy", cfg.serve.policy, SERVE_POLICIES),
        ("data.responses", cfg.data.responses, RESPONSE_MODES),
        ("data.feature_precision", cfg.data.feature_precision, ("auto", "bf16", "fp32")),
        ("data.regen_precision", cfg.data.regen_precision, ("auto", "bf16", "fp32")),
        ("data.multi_turn", cfg.data.multi_turn, ("off", "dataset", "followup")),
        ("data.regen_backend", cfg.data.regen_backend, ("hf", "openai")),
        ("data.regen_api", cfg.data.regen_api, ("chat", "completions")),
        ("loss.kind", cfg.loss.kind, LOSS_KINDS),
        ("loss.position_weights", cfg.loss.position_weights, POSITION_WEIGHTS),
        ("export.layout", cfg.export.layout, EXPORT_LAYOUTS),
        ("export.dtype", cfg.export.dtype, EXPORT_DTYPES),
        ("target_options.dtype", cfg.target_options.dtype, TARGET_DTYPES),
        ("serve.target_dtype", cfg.serve.target_dtype or cfg.target_options.dtype, TARGET_DTYPES),
        ("serve.step_overhead", cfg.serve.step_overhead, STEP_OVERHEADS),
        ("decode.step_costs", cfg.decode.step_costs, STEP_COSTS),
        ("serve.scheduler_cost", cfg.serve.scheduler_cost, SCHEDULER_COSTS),
        ("serve.sps_forward", cfg.serve.sps_forward, SPS_FORWARDS),
        ("decode.drafter_precision", cfg.decode.drafter_precision, PRECISIONS),
        ("decode.tree.shape", cfg.decode.tree.shape, TREE_SHAPES),
        ("decode.tree.scheme", cfg.decode.tree.scheme, TREE_SCHEMES),
        ("decode.verifier", cfg.decode.verifier, VERIFIERS),
        ("serve.verifier", cfg.serve.verifier, VERIFIERS),
        ("decode.scheduler_stop", cfg.decode.scheduler_stop, SCHEDULER_STOPS),
        ("serve.scheduler_stop", cfg.serve.scheduler_stop, SCHEDULER_STOPS),
        ("decode.bypass", cfg.decode.bypass, BYPASS_MODES),
        ("decode.confidence", cfg.decode.confidence, CONFIDENCE_SOURCES),
        ("serve.confidence", cfg.serve.confidence, CONFIDENCE_SOURCES),
    ]
    errors = [
        unknown_name_message(key, shorten(str(value)), list(valid))
        for key, value, valid in checks
        if value not in valid
    ]
    if cfg.sweep and cfg.sweep not in available_sweeps():
        errors.append(unknown_name_message("sweep", shorten(cfg.sweep), available_sweeps()))
    return errors


def _cross_key_errors(cfg: RunConfig) -> list[str]:
    """The rules that relate keys to each other; each key's own range is its schema field's (`range_errors`), and
    a rule here stays silent on values that break those (they are reported once, by the range check)."""
    m, loss, data = cfg.model, cfg.loss, cfg.data
    alphas, weights = (loss.alpha_ce, loss.alpha_tv, loss.alpha_conf), data.train_weights
    split = data.val_fraction + data.calib_fraction
    rules = [
        (
            loss.kind != "paper" or not _non_negative(*alphas) or sum(alphas) > 0,
            "at least one of loss.alpha_ce/alpha_tv/alpha_conf must be > 0.",
        ),
        (
            not (0 < data.val_fraction < 1 and 0 <= data.calib_fraction < 1) or split < 1,
            f"data.val_fraction + data.calib_fraction = {split:g} leaves no sequence to train on; keep the sum "
            "below 1, e.g. data.val_fraction=0.05 data.calib_fraction=0.05.",
        ),
        (
            len(set(m.feature_layers)) == len(m.feature_layers),
            f"model.feature_layers={quote(m.feature_layers)} names a layer twice; give distinct target layer ids, "
            "or [] for the default layers.",
        ),
        (
            not m.init_layers or len(m.init_layers) == m.depth,
            f"model.init_layers names {len(m.init_layers)} target layers for model.depth={m.depth} draft layers; give one "
            "target layer id per draft layer (e.g. model.init_layers=[0,1] for depth 2) or [] for random weights.",
        ),
        (
            not m.init_layers or cfg.drafter != "eagle3",
            "model.init_layers copies target decoder layers into DSpark/DFlash draft layers; EAGLE-3's layer reads "
            "[embedding; hidden] (2d inputs) and cannot take them: leave model.init_layers=[] with drafter=eagle3.",
        ),
        (
            not weights or len(weights) == len(data.train_sets),
            f"data.train_weights has {len(weights)} weights for {len(data.train_sets)} "
            "data.train_sets; give one weight per set (in order) or [] for equal shares.",
        ),
        (
            not weights or not _non_negative(*weights) or sum(weights) > 0,
            f"data.train_weights must have a positive sum (got {quote(weights)}); e.g. data.train_weights=[] for "
            "equal shares.",
        ),
        (
            data.responses != "mix" or data.num_regen_prompts >= 1,
            "data.responses=mix needs data.num_regen_prompts ≥ 1 (how many prompts the target regenerates).",
        ),
        (
            data.regen_backend != "openai" or bool(data.regen_url),
            "data.regen_backend=openai needs data.regen_url, the server's API base (e.g. http://127.0.0.1:8000/v1).",
        ),
        (  # the value is never quoted: a key pasted here by mistake must not reach the terminal or a log
            not data.regen_api_key_env or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", data.regen_api_key_env),
            "data.regen_api_key_env must be the NAME of an environment variable holding the API key (letters, "
            "digits, _), never the key itself; e.g. export REGEN_KEY=... and data.regen_api_key_env=REGEN_KEY.",
        ),
        *_serve_rules(cfg),
    ]
    return [msg for ok, msg in rules if not ok]


def _non_negative(*values: float) -> bool:
    """Whether every value passes a `ge=0` range (so a sum over them means what the rule says)."""
    return all(math.isfinite(v) and v >= 0 for v in values)


def _serve_rules(cfg: RunConfig) -> list[tuple[bool, str]]:
    return [
        (
            bool(cfg.serve.prompt_sets),
            "serve.prompt_sets must name at least one prompt set, e.g. [gsm8k, humaneval, mt-bench].",
        ),
        (
            cfg.stage != "serve" or cfg.drafter != "eagle3",
            "stage=serve batches DSpark-style drafters (drafter=dspark or dflash); EAGLE-3 drafts autoregressively and "
            "is evaluated offline with stage=all.",
        ),
    ]


def _drafter_errors(cfg: RunConfig, explicit: set[str]) -> list[str]:
    fixed, head = FIXED_HEAD.get(cfg.drafter), cfg.model.head
    if fixed is not None and head != fixed and cfg.drafter == "eagle3":
        return [f"drafter=eagle3 is autoregressive and takes no sequential head (model.head={head}); drop model.head."]
    if fixed is not None and head != fixed:
        return [
            f"drafter={cfg.drafter} has no sequential head (model.head={head}); use drafter=dspark "
            f"model.head={head}, or drop model.head."
        ]
    if cfg.drafter == "dflash" and cfg.loss.alpha_conf > 0:  # EAGLE-3's loss has no confidence term to weigh
        return ["drafter=dflash has no confidence head: loss.alpha_conf must be 0."]
    if cfg.drafter == "eagle3" and cfg.loss.kind != "paper":
        return [
            f"loss.kind={cfg.loss.kind} is a block-drafter objective (drafter=dspark or dflash); EAGLE-3 trains "
            "with its TTT loss: drop loss.kind."
        ]
    if cfg.loss.position_weights != "decay" and (cfg.drafter == "eagle3" or cfg.loss.kind != "paper"):
        trainer = "EAGLE-3's TTT loss" if cfg.drafter == "eagle3" else f"loss.kind={cfg.loss.kind}"
        return [
            f"loss.position_weights={cfg.loss.position_weights} weighs the paper objective's slots; {trainer} has "
            "its own weights: drop loss.position_weights, or use drafter=dspark/dflash with loss.kind=paper."
        ]
    return []


def _tree_errors(cfg: RunConfig) -> list[str]:
    """decode.tree: sizes in range, a scheme that is exact for the shape, and no chain policy on a tree."""
    tree, decode = cfg.decode.tree, cfg.decode
    if tree.shape not in TREE_SHAPES or tree.scheme not in TREE_SCHEMES:
        return []  # reported by the name check
    errors = [
        f"decode.tree.{key}=[] names no depth; give one count ≥ 1 per depth, e.g. decode.tree.{key}={example}"
        for key, values, example in (
            ("widths", tree.widths, "[4,2,2,1,1,1,1]"),
            ("branching", tree.branching, "[2,2,1,1]"),
        )
        if not values
    ]
    nodes = _tree_nodes(tree.shape, tree.widths if tree.shape == "widths" else tree.branching, cfg.model.block_size)
    if nodes > MAX_TREE_NODES:
        errors.append(
            f"decode.tree.{tree.shape} grows more than {MAX_TREE_NODES} nodes per round over γ = "
            f"{cfg.model.block_size} depths; one verify forward scores at most {MAX_TREE_NODES}: use smaller counts, "
            "e.g. decode.tree.branching=[2,2,1,1] or decode.tree.widths=[4,2,2,1,1,1,1]."
        )
    if tree.shape == "chain":
        return errors
    if decode.verifier != VERIFIERS[0]:  # the tree engine accepts by decode.tree.scheme, never a chain verifier
        errors.append(
            f"decode.verifier={decode.verifier} verifies a chain; with decode.tree.shape={tree.shape} the tree is "
            "accepted by decode.tree.scheme (descent | rrsw): use decode.verifier=token, or decode.tree.shape=chain."
        )
    if decode.bypass != BYPASS_MODES[0]:
        errors.append(
            f"decode.bypass={decode.bypass} is the chain engine's per-round plain step; with decode.tree.shape="
            f"{tree.shape} the tree engine sizes its own rounds: use decode.bypass=off, or decode.tree.shape=chain."
        )
    if decode.policy != "fixed":
        errors.append(
            f"decode.policy={decode.policy} chooses how much of a chain to verify; with decode.tree.shape="
            f"{tree.shape} the tree's shape decides (dynamic sizes it on SPS(B)): use decode.policy=fixed, or "
            "decode.tree.shape=chain."
        )
    return errors


def _tree_nodes(shape: str, counts: list[int], block_size: int) -> int:
    """Nodes a widths / branching tree drafts over its first γ depths (0 for the other shapes), counted only up to
    MAX_TREE_NODES + 1: branching multiplies per depth, and [1000]*7 must not build a 10²¹ integer first."""
    if shape not in ("widths", "branching"):
        return 0
    total, level = 0, 1
    for count in counts[: max(0, block_size)]:
        level = count if shape == "widths" else level * count
        total += level
        if total > MAX_TREE_NODES:
            break
    return total


def _policy_errors(cfg: RunConfig) -> list[str]:
    """A policy that reads c_k needs a drafter with a confidence head; without this the run failed after
    prepare and training, when the evaluation built the policy."""
    errors = []
    if cfg.stage in ("eval", "all") and cfg.decode.policy == "calibrated_threshold" and not cfg.decode.calibrate:
        errors.append(
            "decode.policy=calibrated_threshold reads the STS-calibrated c̃_k, but decode.calibrate=false fits no "
            "calibration; set decode.calibrate=true, or use decode.policy=threshold (raw c_k)."
        )
    if CONFIDENCE_HEAD.get(cfg.drafter, True):  # an unknown drafter is reported by the name check
        return errors
    if (
        cfg.stage in ("eval", "all")
        and cfg.decode.policy in CONFIDENCE_POLICIES
        and cfg.decode.confidence == CONFIDENCE_SOURCES[0]
    ):
        errors.append(
            f"decode.policy={cfg.decode.policy} reads the confidence head's c_k (decode.confidence=head), but "
            f"drafter={cfg.drafter} has no confidence head; use decode.confidence=draft_max_prob or online (no head "
            "needed), decode.policy=fixed, or drafter=dspark."
        )
    if (
        cfg.stage == "serve"
        and cfg.serve.policy in SERVE_CONFIDENCE_POLICIES
        and cfg.serve.confidence == CONFIDENCE_SOURCES[0]
    ):
        errors.append(
            f"serve.policy={cfg.serve.policy} reads the confidence head's c_k (serve.confidence=head), but "
            f"drafter={cfg.drafter} has no confidence head; use serve.confidence=draft_max_prob or online, "
            "serve.policy=mtp1, static or fixed, or drafter=dspark."
        )
    return errors
