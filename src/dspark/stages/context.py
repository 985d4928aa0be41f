"""What every stage shares: the resolved config, output paths, the tracking run and the loaded target."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dspark.config import ResolvedConfig, RunConfig, repo_root, to_dict
from dspark.config.secrets import mask_tree
from dspark.tracking import TrackingStore, git_provenance
from dspark.tracking.processes import process_tags
from dspark.tracking.ui import public_command

if TYPE_CHECKING:
    from dspark.targets import Target

log = logging.getLogger("dspark")

# Keys that change what a trained drafter is; everything else (decode.*, stage, tracking, paths) does not.
TRAINING_GROUPS = ("target", "drafter", "seed", "model", "loss", "data", "optim", "target_options")
# What the training data's supervision is, beside the config: 2 = the bf16 feature caches' log-normaliser refined in
# fp32 (`dspark.data.features.BF16_LOG_Z_VERSION`). Drafters trained on older supervision are not reused, so a
# resumed sweep never mixes them with cells trained on the fixed caches (docs/LOG.md has the measurement).
SUPERVISION_VERSION = 2
# (group, key, default) of training keys added after runs were cached: left out of the hash at their default
HASH_NEUTRAL_DEFAULTS = (
    ("model", "confidence_with_markov", True),
    ("model", "import_from", ""),
    ("loss", "kind", "paper"),
    ("loss", "dpard_alpha", 0.5),
    ("data", "regen_precision", "auto"),
    ("data", "seed", None),
    ("data", "sampling.sampler", "generate"),
    ("model", "init_layers", []),
    ("model", "match_params", False),
    ("loss", "position_weights", "decay"),
    ("loss", "dpace_alpha", 0.5),
    ("data", "features_from", None),
    ("data", "multi_turn", "dataset"),
    ("data", "regen_backend", "hf"),
    ("data", "regen_url", ""),
    ("data", "regen_api", "chat"),
    ("data", "regen_model", None),
)
# data.* keys that say how to reach a regeneration server, not what it writes: never part of the training key
OPERATIONAL_DATA_KEYS = ("regen_api_key_env", "regen_concurrency", "regen_timeout_s", "regen_retries")


@dataclass
class RunPaths:
    root: Path
    cache: Path  # targets, regenerated data, feature caches, SPS tables
    runs: Path  # one directory per trained drafter (config.yaml, checkpoints/, drafter.pt)
    reports: Path

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "RunPaths":
        root = Path(cfg.paths.root)
        return cls(root=root, cache=root / "cache", runs=root / "runs", reports=Path(cfg.paths.reports))

    def make(self) -> None:
        for path in (self.root, self.cache, self.runs):
            path.mkdir(parents=True, exist_ok=True)


def training_key(cfg: RunConfig) -> str:
    """Hash of everything that determines a trained drafter: equal keys share one run directory and checkpoint.
    Credentials in a value are masked first: they change where data comes from, not what it is, and no hash of
    one is recorded."""
    tree = mask_tree(to_dict(cfg))
    payload = {k: tree[k] for k in TRAINING_GROUPS}
    for group, key, default in HASH_NEUTRAL_DEFAULTS:  # keys added later: at their default, old run dirs stay valid
        *parents, leaf = key.split(".")  # a dotted key names a nested field (data.sampling.sampler)
        node = payload[group]
        for parent in parents:
            node = node.get(parent, {})
        if node.get(leaf) == default:
            node.pop(leaf)
    for key in OPERATIONAL_DATA_KEYS:
        payload["data"].pop(key, None)
    payload["trainer"] = {k: tree["trainer"][k] for k in ("precision",)}
    payload["supervision"] = SUPERVISION_VERSION
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def run_name(cfg: RunConfig) -> str:
    m = cfg.model
    if m.import_from:  # the drafter's own kind/head/depth come from the checkpoint, not from model.*
        return f"imported-{Path(m.import_from).name or 'drafter'}-g{m.block_size}-s{cfg.seed}"
    head = f"-{m.head}" if cfg.drafter == "dspark" else ""
    return f"{cfg.drafter}{head}-d{m.depth}-g{m.block_size}-s{cfg.seed}"


@dataclass
class StageContext:
    """Shared state of one invocation (one MLflow run)."""

    rc: ResolvedConfig
    paths: RunPaths
    store: TrackingStore | None = None
    run_id: str | None = None
    target: Target | None = None
    trainer_callbacks: list = field(default_factory=list)  # extra Lightning callbacks (e.g. Optuna pruning)

    @property
    def cfg(self) -> RunConfig:
        return self.rc.cfg

    @property
    def run_dir(self) -> Path:
        return self.paths.runs / f"{run_name(self.cfg)}-{training_key(self.cfg)}"

    def load_target(self) -> Target:
        """Load (once) the frozen target named by `target=`."""
        if self.target is None:
            self.target = self.load_target_in(self.cfg.target_options.dtype)
            log.info(
                "target %s: %d layers, d=%d, V=%d, feature layers %s, MASK id %d",
                self.target.name,
                self.target.num_layers,
                self.target.hidden_size,
                self.target.vocab_size,
                self.target.feature_layer_ids,
                self.target.mask_token_id,
            )
        return self.target

    def load_target_in(self, dtype: str) -> Target:
        """A fresh load of the `target=` checkpoint in `dtype`, with the run's options (not cached; `load_target`
        keeps the run's own, and `serve.target_dtype` serves with another)."""
        from dspark.targets import load_target

        cfg = self.cfg
        return load_target(
            cfg.target,
            cache_dir=self.paths.cache,
            feature_layers=cfg.model.feature_layers or None,
            trust_remote_code=cfg.target_options.trust_remote_code,
            dtype=dtype,
            seed=cfg.seed,
            mask_token_id=cfg.target_options.mask_token_id,
            num_feature_layers=cfg.model.num_feature_layers,
        )

    def load_prompts(self, name: str, **options: Any) -> list:
        """The prompt set `name` (`dspark.data.prompts.load_prompts` options): from data.local_dir when it has the
        set, else the staged data or the hub (its Arrow cache under <cache>/datasets)."""
        from dspark.data.prompts import load_prompts

        local = self.cfg.data.local_dir
        return load_prompts(
            name,
            local_dir=Path(local).expanduser() if local else None,
            cache_dir=self.paths.cache / "datasets",
            **options,
        )

    def run_tags(self) -> dict[str, str]:
        """What a run is tagged with: what it trains, its command (`public_command`: credentials masked), its
        provenance and its process (`dspark.tracking.processes`, so that a killed run is closed later)."""
        cfg = self.cfg
        tags = {
            "drafter": cfg.drafter,
            "model.head": cfg.model.head,
            "target": cfg.target,
            "budget": cfg.budget,
            "seed": str(cfg.seed),
            "stage": cfg.stage,
            "training.key": training_key(cfg),
            "command": public_command(self.rc.argv),
        }
        return tags | git_provenance(repo_root()) | process_tags()


def seed_everything(seed: int) -> None:
    import lightning as L

    L.seed_everything(seed, workers=True, verbose=False)
    torch.use_deterministic_algorithms(False)
