"""What `stage=eval` and `stage=serve` open with: the target and the trained drafter on its device, and the
drafter's STS calibration at `decode.temperature` (fitted once on held-out prompts, then reused from drafter.pt)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from dspark.drafters.checkpoint import load_drafter
from dspark.drafters.factory import DrafterSpec
from dspark.stages.context import StageContext
from dspark.stages.prepare import PreparedData, held_out_prompts

if TYPE_CHECKING:
    from dspark.evaluation.calibrate import CalibrationReport
    from dspark.targets import Target

log = logging.getLogger("dspark")


@dataclass
class TrainedDrafter:
    """A trained drafter around its loaded target (eval mode, on the target's device)."""

    target: Target
    drafter: nn.Module
    spec: DrafterSpec
    payload: dict[str, Any]  # the whole drafter.pt (`dspark.drafters.checkpoint`)
    path: Path

    @property
    def has_confidence(self) -> bool:
        """Whether the drafter has a trained confidence head."""
        return getattr(self.drafter, "confidence_head", None) is not None

    def has_confidences(self, source: str) -> bool:
        """Whether rounds carry c_k under the confidence source `source` (the head needs a head; the others don't)."""
        return self.has_confidence or source != "head"


def confidence_source(ctx: StageContext, trained: TrainedDrafter, *, key: str = "decode") -> Any:
    """The `<key>.confidence` source for this drafter's proposer (`dspark.decoding.confidence`); None for `head`
    (the proposers' own default: the head's c_k)."""
    from dspark.decoding.confidence import HEAD, build_confidence_source

    name = ctx.cfg.decode.confidence if key == "decode" else ctx.cfg.serve.confidence
    if name == HEAD:
        return None
    decode = ctx.cfg.decode
    return build_confidence_source(
        name, block_size=trained.spec.block_size, lr=decode.online_lr, l2=decode.online_l2, key=key
    )


def open_trained_drafter(ctx: StageContext, drafter_path: str | Path) -> TrainedDrafter:
    """Load the target (once) and the drafter at `drafter_path`, checked against the target and model.block_size."""
    target = ctx.load_target()
    path = Path(drafter_path)
    drafter, spec, payload = load_drafter(path, target, block_size=ctx.cfg.model.block_size)
    return TrainedDrafter(target=target, drafter=drafter.to(target.device), spec=spec, payload=payload, path=path)


def calibrate(
    ctx: StageContext,
    trained: TrainedDrafter,
    *,
    prepared: PreparedData | None,
    proposer: Any = None,
    plot_path: Path | None = None,
    key: str = "decode",
) -> tuple[CalibrationReport, str]:
    """STS at decode.temperature of the `<key>.confidence` source's c_k on decode.prompts_per_set ×
    len(decode.eval_sets) held-out prompts (the calibration split of `prepared`, topped up with unseen synthetic
    ones; fitted on one half of them, scored on the other); returns the fit and where its prompts came from.
    `proposer` (built with that source) is reused when given: an online source starts learning on these rounds."""
    from dspark.decoding.proposers import build_proposer
    from dspark.evaluation.calibrate import calibrate_drafter, calibration_prompt_ids

    decode = ctx.cfg.decode
    limit = decode.prompts_per_set * len(decode.eval_sets)
    if decode.calibration_set:  # a named prompt set (the paper calibrates on Alpaca)
        records = ctx.load_prompts(decode.calibration_set, limit=limit)
        prompt_ids = [trained.target.chat_prompt_ids(r.prompt) for r in records]
        where = f"{len(records)} prompts of {decode.calibration_set} (decode.calibration_set)"
    else:
        prompt_ids, where = calibration_prompt_ids(
            trained.target,
            held_out=held_out_prompts(ctx, prepared),
            limit=limit,
            seed=ctx.cfg.data_seed,
            data=ctx.cfg.data,
        )
    source = ctx.cfg.decode.confidence if key == "decode" else ctx.cfg.serve.confidence
    if proposer is None:
        proposer = build_proposer(trained.drafter, confidence=confidence_source(ctx, trained, key=key))
    report = calibrate_drafter(
        target=trained.target,
        proposer=proposer,
        source=source,
        drafter_path=trained.path,
        payload=trained.payload,
        prompt_ids=prompt_ids,
        temperature=decode.temperature,
        max_new_tokens=decode.max_new_tokens,
        seed=ctx.cfg.seed,
        block_size=trained.spec.block_size,
        plot_path=plot_path,
        prompt_set=decode.calibration_set,
    )
    return report, where
