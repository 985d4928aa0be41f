"""`DrafterModule`: one LightningModule for every drafter (dspark, dflash, eagle3). It only orchestrates: the drafter
is a plain nn.Module, the batch→loss glue is a registered step function (`dspark.training.steps`), the metrics are
torchmetrics objects (one per split). The frozen target lives outside the module's registered submodules, so
checkpoints hold only the drafter's weights.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torchmetrics import MeanMetric

from dspark.config.schema import LossConfig, OptimConfig
from dspark.metrics import CumulativeCalibration, PositionCrossEntropy, TeacherForcedAcceptance
from dspark.training.optim import build_optimizer
from dspark.training.steps import TRAINING_STEPS, StepResult

if TYPE_CHECKING:
    from dspark.targets import Target


def pooled_weight_sum(local: torch.Tensor) -> torch.Tensor:
    """Σ w of every data-parallel rank over the world size (METHOD §3: the loss's sums are pooled across ranks).

    Each rank divides its Σ w·ℓ by this, so DDP's gradient average (the mean over ranks) is the gradient of
    Σ_all w·ℓ / Σ_all w; dividing by the rank's own Σ w weighted ranks with fewer supervised slots too much.
    One all_reduce per training step, in lockstep like DDP's own gradient all_reduce; identity on one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    total = local.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


# spec values the config leaves to training (model.feature_layers=[] → the target's default layer ids,
# target_options.mask_token_id=None → the reserved row chosen): logged once as `resolved/<key>`; the rest of the spec
# repeats model.* and is not logged
RESOLVED_SPEC_KEYS = ("feature_layers", "mask_token_id")


def resolved_params(drafter_config: dict[str, Any], *, target_fingerprint: str) -> dict[str, Any]:
    """The run params that only training knows: the spec's resolved values and the target's weights identity."""
    params = {f"resolved/{k}": drafter_config[k] for k in RESOLVED_SPEC_KEYS if k in drafter_config}
    return params | {"resolved/target_fingerprint": target_fingerprint}


class NonFiniteLossError(FloatingPointError):
    """Raised when the loss is NaN/inf; the run is marked FAILED and the last good checkpoint is kept."""


class DrafterModule(L.LightningModule):
    """Train `drafter` against the frozen `target` with the loss of METHOD §3 (or §4 for EAGLE-3)."""

    def __init__(
        self,
        *,
        drafter: nn.Module,
        target: Target,
        drafter_kind: str,
        block_size: int,
        loss: LossConfig,
        optim: OptimConfig,
        drafter_config: dict[str, Any],
    ) -> None:
        super().__init__()
        self.drafter = drafter
        self.__dict__["target"] = target  # plain attribute: never in state_dict, never trained
        self.step_fn = TRAINING_STEPS.resolve(drafter_kind)
        self.block_size = block_size
        self.loss_weights = asdict(loss)  # the step functions' keyword arguments (alpha_ce, ..., decay)
        self.optim_cfg = asdict(optim)
        # kept in checkpoints, not logged: the run's params are the flattened config (`TrackingStore.log_config`),
        # and these copy it under other names (loss_weights/alpha_tv = loss.alpha_tv); `on_fit_start` logs the rest
        self.save_hyperparameters(
            {
                "drafter_kind": drafter_kind,
                "block_size": block_size,
                "loss_weights": self.loss_weights,
                "optim": self.optim_cfg,
                "drafter_config": drafter_config,
                "target_fingerprint": target.fingerprint,
            },
            logger=False,
        )
        self.resolved_params = resolved_params(drafter_config, target_fingerprint=target.fingerprint)
        # keys are "<split>_metrics": a bare "train" would shadow nn.Module.train
        self.split_metrics = nn.ModuleDict({f"{s}_metrics": self._split_metrics() for s in ("train", "val")})
        self.validated_at_step = -1  # global step of the last validation (-1: none yet)

    def _split_metrics(self) -> nn.ModuleDict:
        g = self.block_size
        # coverage: p_t's mass inside the draft vocabulary, the ceiling of every slot's acceptance
        return nn.ModuleDict(
            {
                "accept": TeacherForcedAcceptance(g),
                "ce": PositionCrossEntropy(g),
                "calib": CumulativeCalibration(g),
                "vocab_coverage": MeanMetric(),
            }
        )

    def on_fit_start(self) -> None:
        self.target.model.to(self.device)  # the target follows the drafter's device (GPU runs)
        if self.logger is not None:  # rank zero only (Lightning's loggers)
            self.logger.log_hyperparams(self.resolved_params)

    def on_train_start(self) -> None:
        for metric in self.split_metrics["val_metrics"].values():
            metric.reset()

    def _run(self, batch: dict[str, torch.Tensor], split: str) -> torch.Tensor:
        # pooled denominators matter for the gradient only: validation's loss is a logged per-rank mean
        # (sync_dist averages it) and its metrics reduce exact sums, so it adds no collective per batch
        normalizer = pooled_weight_sum if split == "train" else None
        result: StepResult = self.step_fn(
            drafter=self.drafter,
            target=self.target,
            batch=batch,
            block_size=self.block_size,
            normalizer=normalizer,
            **self.loss_weights,
        )
        if not torch.isfinite(result.loss.total):
            raise NonFiniteLossError(
                f"{split} loss is {result.loss.total.item()} at step {self.global_step}: lower optim.lr, check the "
                "data cache (stage=prepare), or set trainer.precision=32-true. The last good checkpoint is kept."
            )
        self._update_metrics(result, split)
        parts = {
            f"{split}/loss": result.loss.total,
            f"{split}/loss_ce": result.loss.ce,
            f"{split}/loss_tv": result.loss.tv,
            f"{split}/loss_conf": result.loss.conf,
        }
        if result.loss.renyi is not None:  # loss.kind=dpard
            parts[f"{split}/loss_renyi"] = result.loss.renyi
        self.log_dict(
            {k: v.detach() for k, v in parts.items()},
            prog_bar=(split == "train"),
            on_step=(split == "train"),
            on_epoch=(split == "val"),
            batch_size=result.num_blocks,
            sync_dist=(split == "val"),
        )
        return result.loss.total

    def _update_metrics(self, result: StepResult, split: str) -> None:
        metrics = self.split_metrics[f"{split}_metrics"]
        metrics["accept"].update(result.c_star, result.label_valid)
        metrics["ce"].update(result.nll, result.label_valid if result.nll_valid is None else result.nll_valid)
        if result.coverage is not None and bool(result.label_valid.any()):
            metrics["vocab_coverage"].update(result.coverage[result.label_valid])
        if result.confidence is not None:
            soft_event = torch.cumprod(result.c_star.clamp(0, 1), dim=-1)
            metrics["calib"].update(result.confidence, soft_event, result.label_valid)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._run(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._run(batch, "val")

    def on_train_epoch_end(self) -> None:
        self._log_split("train")

    def on_validation_epoch_end(self) -> None:
        self._log_split("val")
        if not self.trainer.sanity_checking:
            self.validated_at_step = self.global_step  # the train stage validates once more if training went on

    def _log_split(self, split: str) -> None:
        values: dict[str, torch.Tensor] = {}
        for name, metric in self.split_metrics[f"{split}_metrics"].items():
            if name == "calib" and not metric.update_called:
                continue
            if metric.update_called:
                computed = metric.compute()
                if isinstance(computed, dict):
                    values.update({f"{split}/{k}": v for k, v in computed.items()})
                else:
                    values[f"{split}/{name}"] = computed
            metric.reset()
        finite = {k: v.float() for k, v in values.items() if torch.isfinite(v).all()}
        if finite:
            self.log_dict(finite, rank_zero_only=True)  # metric states are already reduced across ranks

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's clipping, except for the fused CPU AdamW (`build_optimizer`): Lightning's mixed-precision
        plugin refuses to clip for any optimizer that could unscale gradients itself, although bf16 autocast has no
        gradient scaler; there the gradients are plain, so torch's own norm/value clipping is the same operation."""
        scaled = getattr(self.trainer.precision_plugin, "scaler", None) is not None  # fp16 AMP: Lightning's rules
        if scaled or not (gradient_clip_val and getattr(optimizer, "defaults", {}).get("fused")):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

    def configure_optimizers(self):
        total = max(1, int(self.trainer.estimated_stepping_batches))
        optimizer, schedule = build_optimizer(
            self.drafter.parameters(),
            lr=self.optim_cfg["lr"],
            betas=(self.optim_cfg["beta1"], self.optim_cfg["beta2"]),
            weight_decay=self.optim_cfg["weight_decay"],
            total_steps=total,
            warmup_fraction=self.optim_cfg["warmup_fraction"],
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
