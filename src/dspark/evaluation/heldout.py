"""Teacher-forced passes of a trained drafter outside training: its run's validation blocks, or any blocks.

A run's held-out metrics (`val/accept/posK`, `val/tau_prob`) come from its registered training step
(`training.steps.TRAINING_STEPS`, with the run's loss weights) over the validation batches. Analyses that split,
pair or rescale those numbers must re-run exactly that step on exactly those batches: `validation_step` binds it,
`teacher_forced_steps` runs it (or another step of the same contract, e.g. `training.steps.block_forward` for the
raw drafter output) batch by batch without gradients. Callers pick the batches: a datamodule's `val_dataloader()`
for the held-out blocks, or hand-built batches of decoded text (input_ids, attention_mask, loss_mask, anchors,
anchor_valid; `data.blocks` conventions).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from dspark.config.schema import LossConfig
from dspark.training.steps import TRAINING_STEPS, StepResult, block_forward

Step = Callable[..., Any]  # step(*, drafter, target, batch, block_size) -> anything


def validation_step(drafter_kind: str, loss: LossConfig) -> Callable[..., StepResult]:
    """The run's training step (`drafter=` kind) bound to its `loss.*` weights, as the LightningModule calls it for
    `val/` metrics: c*, label validity, coverage [B, N, γ] per batch (`StepResult`)."""
    return functools.partial(TRAINING_STEPS.resolve(drafter_kind), **asdict(loss))


def teacher_forced_steps(
    batches: Iterable[dict[str, torch.Tensor]],
    *,
    drafter: Any,
    target: Any,
    block_size: int,
    step: Step | None = None,
    desc: str = "held-out blocks",
    show_progress: bool = True,
) -> Iterator[tuple[dict[str, torch.Tensor], Any]]:
    """(batch, `step(drafter=, target=, batch=, block_size=)`) for every batch, without gradients.

    step: `validation_step(...)` for the run's own numbers; by default `training.steps.block_forward` — (drafter
    output with logits [B, N, γ, Vd], the blocks of `build_blocks`, the target's final hidden [B, T, d])."""
    step = block_forward if step is None else step
    for batch in tqdm(batches, desc=desc, unit="batch", disable=not show_progress):
        with torch.no_grad():  # left before the yield: the caller's code runs in its own grad mode
            result = step(drafter=drafter, target=target, batch=batch, block_size=block_size)
        yield batch, result
