"""Batch → drafter outputs → loss, one registered function per drafter kind (`drafter=` config name).

Each step returns a `StepResult` with the loss parts for logging and the teacher-forced quantities the metrics need
(c*, validity, per-slot NLL, confidence probabilities), all shaped [B, N, γ] ("blocks" × slots; for EAGLE-3 a
"block" is a sequence position and slot k is TTT step k-1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from torch.nn import functional as F

from dspark.data.blocks import build_blocks
from dspark.losses import BLOCK_OBJECTIVES
from dspark.losses.dspark import compute_dspark_loss
from dspark.registry import Registry


@dataclass
class LossParts:
    total: Tensor
    ce: Tensor
    tv: Tensor
    conf: Tensor
    renyi: Tensor | None = None  # loss.kind=dpard only


@dataclass
class StepResult:
    loss: LossParts
    c_star: Tensor  # [B, N, γ] teacher-forced acceptance 1 − ½‖p_d − p_t‖₁ (detached)
    label_valid: Tensor  # [B, N, γ] bool
    nll: Tensor  # [B, N, γ] −log p_d(label) (detached); meaningful where `nll_valid` (unspecified elsewhere)
    confidence: Tensor | None  # [B, N, γ] σ(confidence logits) (detached); None without a confidence head
    num_blocks: int
    nll_valid: Tensor | None = None  # [B, N, γ] bool: label_valid and the label inside the draft vocabulary
    coverage: Tensor | None = None  # [B, N, γ] mass of p_t inside the draft vocabulary (1 for the full one)


@dataclass
class TargetDistribution:
    """The target's T = 1 next-token distribution restricted to the draft vocabulary, at gathered positions."""

    probs: Tensor  # [..., Vd] fp32 p_t(x) for x in the draft vocabulary (sums to `coverage`, not 1, when Vd < V)
    coverage: Tensor  # [...] fp32 Σ_{x ∈ Vd} p_t(x)


def target_distribution(
    drafter,
    target: Any,
    batch: dict[str, Tensor],
    final_hidden: Tensor,
    positions: Tensor,
    select: Tensor | None = None,
) -> TargetDistribution:
    """p_t over the draft vocabulary at `positions` [B, N, γ] (indices into final_hidden [B, T, d]).

    `select` [B, N, γ] bool (optional): return `probs` only at the selected slots, [M, Vd] in `probs[select]`
    order (the loss's supervised slots) — gathered once from the per-position table instead of a [B, N, γ, Vd]
    copy that the loss would index again (two [N·γ, Vd] memory passes per step, 5% of a step on one core).
    `coverage` stays [B, N, γ].

    Exact against the full vocabulary: the logits of the Vd draft rows are normalised by the full-vocabulary
    log-normaliser log Σ_V exp(z), read from the feature cache (`log_normalizer` [B, T], computed once at
    prepare time from the same stored hidden states) so no full-vocabulary product runs in the step; without a
    cache (online features) it is computed here. Always fp32, outside any autocast: p_t is the supervision.
    """
    batch_size, length = final_hidden.shape[:2]
    # Blocks overlap (anchor a's slot k is position a+k-1): with many anchors there are more (block, slot) pairs
    # than positions, so compute p_t once per position and gather — else only at the gathered positions.
    per_position = batch_size * length < positions.numel()
    rows = positions if not per_position else torch.arange(length, device=positions.device).expand(batch_size, 1, -1)
    with torch.autocast(device_type=final_hidden.device.type, enabled=False):
        hidden = _gather_positions(final_hidden.float(), rows)
        head = drafter.draft_head
        bias = head.bias()
        logits = F.linear(hidden, head.weight().float(), None if bias is None else bias.float())  # [B, n, g, Vd]
        if "log_normalizer" in batch:
            b, n, g = rows.shape
            log_z = batch["log_normalizer"].float().gather(1, rows.reshape(b, n * g)).view(b, n, g)
        elif head.is_full:
            log_z = torch.logsumexp(logits, dim=-1)
        else:
            log_z = torch.logsumexp(target.lm_head(hidden.to(target.lm_head.weight.dtype)).float(), dim=-1)
        probs = torch.exp(logits - log_z.unsqueeze(-1))
    coverage = probs.sum(-1).clamp(0.0, 1.0)
    if not per_position:
        return TargetDistribution(probs=probs if select is None else probs[select], coverage=coverage)
    coverage = coverage[:, 0].gather(1, positions.flatten(1)).view_as(positions)  # [B, T] → [B, N, γ]
    if select is None:
        return TargetDistribution(probs=_gather_positions(probs[:, 0], positions), coverage=coverage)
    flat = (positions + torch.arange(batch_size, device=positions.device).view(-1, 1, 1) * length)[select]
    return TargetDistribution(probs=probs[:, 0].flatten(0, 1).index_select(0, flat), coverage=coverage)


TRAINING_STEPS: Registry[Callable[..., StepResult]] = Registry("drafter")


def target_features(target: Any, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(features [B,T,m·d], final_hidden [B,T,d]) from the feature cache when the batch has them, else online."""
    if "features" in batch and "final_hidden" in batch:
        # features stay in their stored dtype (fp16): the drafter's first projection casts them, which saves a
        # [B, T, m·d] fp32 copy per step
        return batch["features"], batch["final_hidden"].float()
    out = target.forward(batch["input_ids"], attention_mask=batch["attention_mask"])
    return out.features, out.final_hidden


def _gather_positions(hidden: Tensor, positions: Tensor) -> Tensor:
    """hidden [B,T,d], positions [B,N,γ] → [B,N,γ,d]."""
    b, n, g = positions.shape
    index = positions.reshape(b, n * g, 1).expand(-1, -1, hidden.shape[-1])
    return hidden.gather(1, index).reshape(b, n, g, hidden.shape[-1])


def _zero(like: Tensor) -> Tensor:
    return torch.zeros((), device=like.device, dtype=like.dtype)


def block_forward(*, drafter, target, batch: dict[str, Tensor], block_size: int) -> tuple[Any, Any, Tensor]:
    """The DSpark/DFlash drafter's teacher-forced forward over a batch's anchored blocks: (drafter output, the blocks
    of `build_blocks`, the target's final-norm hidden [B, T, d] whose LM-head image is p_t)."""
    features, final_hidden = target_features(target, batch)
    blocks = build_blocks(
        batch["input_ids"],
        batch["loss_mask"],
        batch["anchors"],
        batch["anchor_valid"],
        block_size=block_size,
        mask_token_id=target.mask_token_id,
    )
    out = drafter(
        context_features=features,
        context_valid=batch["attention_mask"].bool(),
        block_input_ids=blocks.block_input_ids,
        anchor_positions=batch["anchors"],
        prev_tokens=blocks.prev_tokens,
    )
    return out, blocks, final_hidden


def dspark_step(
    *,
    drafter,
    target,
    batch: dict[str, Tensor],
    block_size: int,
    alpha_ce: float,
    alpha_tv: float,
    alpha_conf: float,
    decay: float,
    kind: str = "paper",
    dpard_alpha: float = 0.5,
    position_weights: str = "decay",
    dpace_alpha: float = 0.5,
    normalizer: Callable[[Tensor], Tensor] | None = None,
) -> StepResult:
    """DSpark / DFlash (METHOD §2.1 table, §3): blocks from anchors, p_t from the target's final-norm hidden;
    `kind` picks the objective (`loss.kind`: paper | dpard), `position_weights` the paper objective's slot weights
    (`loss.position_weights`: decay | dpace); `normalizer` (Σ w → denominator) pools the paper objective's
    denominators across data-parallel ranks (D-PARD keeps its per-rank block count)."""
    out, blocks, final_hidden = block_forward(drafter=drafter, target=target, batch=batch, block_size=block_size)
    with torch.no_grad():  # the paper objective reads p_t at its supervised slots only: gather just those
        p_t = target_distribution(
            drafter,
            target,
            batch,
            final_hidden,
            blocks.target_positions,
            select=blocks.label_valid if kind == "paper" else None,
        )
    labels, in_vocab = drafter.draft_head.to_draft_ids(blocks.labels)
    extra = (
        {"dpard_alpha": dpard_alpha}
        if kind == "dpard"
        else {"normalizer": normalizer, "position_weights": position_weights, "dpace_alpha": dpace_alpha}
    )
    # the paper's objective through this module's name: tests (NaN loss, Ctrl-C) patch steps.compute_dspark_loss
    objective = compute_dspark_loss if kind == "paper" else BLOCK_OBJECTIVES.resolve(kind)
    loss = objective(
        out,
        labels=labels,
        label_valid=blocks.label_valid,
        target_probs=p_t.probs,
        label_in_vocab=in_vocab,
        alpha_ce=alpha_ce,
        alpha_tv=alpha_tv,
        alpha_conf=alpha_conf,
        decay=decay,
        **extra,
    )
    with torch.no_grad():
        nll = loss.nll  # the paper objective's own −log p_d(label) on the supervised slots (the metrics read no other)
        if nll is None or loss.c_star is None:
            logits = out.logits.float()
            # −log p_d(label) = logsumexp − the label's logit: one reduction pass, no [B, N, γ, Vd] log-softmax copy
            nll = torch.logsumexp(logits, dim=-1) - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        conf = torch.sigmoid(out.confidence_logits.float()) if out.confidence_logits is not None else None
        c_star = (
            loss.c_star
            if loss.c_star is not None
            else _analytic_acceptance(torch.log_softmax(logits, dim=-1), p_t.probs)
        )
    zero = _zero(loss.total)
    parts = LossParts(
        total=loss.total,
        ce=_or(loss.ce, zero),
        tv=_or(loss.tv, zero),
        conf=_or(loss.conf, zero),
        renyi=None if loss.renyi is None else loss.renyi.detach(),
    )
    return StepResult(
        loss=parts,
        c_star=c_star.detach(),
        label_valid=blocks.label_valid,
        nll=nll,
        confidence=conf,
        num_blocks=int(batch["anchor_valid"].sum()),
        nll_valid=blocks.label_valid & in_vocab,
        coverage=p_t.coverage,
    )


def _analytic_acceptance(draft_logp: Tensor, target_probs: Tensor) -> Tensor:
    """c* = Σ_{v ∈ Vd} min(p_d, p_t) for metrics when the loss did not need it (DFlash trains on CE only)."""
    return torch.minimum(draft_logp.exp(), target_probs).sum(-1).clamp(0, 1)


def _or(value: Tensor | None, default: Tensor) -> Tensor:
    return default if value is None else value.detach()


TRAINING_STEPS.add("dspark", dspark_step)
TRAINING_STEPS.add("dflash", dspark_step)


def eagle3_step(
    *,
    drafter,
    target,
    batch: dict[str, Tensor],
    block_size: int,
    alpha_ce: float = 0.0,
    alpha_tv: float = 0.0,
    alpha_conf: float = 0.0,
    decay: float = 4.0,
    kind: str = "paper",
    dpard_alpha: float = 0.5,
    position_weights: str = "decay",
    dpace_alpha: float = 0.5,
    normalizer: Callable[[Tensor], Tensor] | None = None,
) -> StepResult:
    """EAGLE-3 training-time test (METHOD §4): soft CE against p_t with step weights 0.8^k.

    Supervised at the batch's sampled anchors, like DSpark: anchor a (the last committed token x_a) is TTT
    position i = a − 1, whose step k predicts x_{a+1+k} — DSpark's slot k+1 of the block anchored at a. Both
    drafters then see the same K = data.max_anchors (context, block) pairs per sequence and epoch, and the LM head
    runs on N instead of T positions per step (the cost that dominates EAGLE-3 training; budget=paper's K = 512
    covers every position of typical sequences). The TTT layer itself still runs over every position.
    The α weights do not apply (EAGLE-3 has its own loss); they are accepted so one config drives every drafter,
    and so is `normalizer`: EAGLE-3's L_k keeps the local B·N denominator of its reference (METHOD §4).
    Metrics treat each sampled position as a "block" whose slot k is TTT step k−1.
    """
    if kind != "paper":  # loss.kind is the block drafters' objective; config validation refuses it for EAGLE-3
        raise ValueError(f"loss.kind={kind} is for drafter=dspark/dflash; EAGLE-3 trains with its TTT loss")
    from dspark.losses.eagle3 import (
        compute_eagle3_sampled_acceptance,
        compute_eagle3_sampled_loss,
        sampled_step_targets,
    )

    features, final_hidden = target_features(target, batch)
    positions = (batch["anchors"] - 1).clamp_min(0)
    position_valid = batch["anchor_valid"] & (batch["anchors"] >= 1)
    out = drafter(
        features=features,
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        logit_positions=positions,
    )
    target_index, supervised = sampled_step_targets(
        positions,
        position_valid,
        loss_mask=batch["loss_mask"],
        attention_mask=batch["attention_mask"],
        num_steps=block_size,
    )
    with torch.no_grad():
        p_t = target_distribution(drafter, target, batch, final_hidden, target_index)
    loss = compute_eagle3_sampled_loss(out.logits, target_probs=p_t.probs, supervised=supervised)
    with torch.no_grad():
        proxy = compute_eagle3_sampled_acceptance(out.logits, target_probs=p_t.probs, supervised=supervised)
        labels = (
            batch["input_ids"]
            .gather(1, (target_index + 1).clamp(max=batch["input_ids"].shape[1] - 1).flatten(1))
            .view_as(target_index)
        )
        labels, in_vocab = drafter.draft_head.to_draft_ids(labels)
        logp = torch.stack([torch.log_softmax(lg.float(), dim=-1) for lg in out.logits], dim=2)  # [B, N, γ, Vd]
        nll = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    zero = _zero(loss.total)
    parts = LossParts(total=loss.total, ce=loss.total.detach(), tv=zero, conf=zero)
    return StepResult(
        loss=parts,
        c_star=proxy.c_star,
        label_valid=proxy.valid,
        nll=nll,
        confidence=None,
        num_blocks=int(proxy.valid[..., 0].sum()),
        nll_valid=proxy.valid & in_vocab,
        coverage=p_t.coverage,
    )


TRAINING_STEPS.add("eagle3", eagle3_step)
