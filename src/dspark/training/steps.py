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

from dspark.data.blocks import build_blocks
from dspark.losses.dspark import compute_dspark_loss
from dspark.registry import Registry


@dataclass
class LossParts:
    total: Tensor
    ce: Tensor
    tv: Tensor
    conf: Tensor


@dataclass
class StepResult:
    loss: LossParts
    c_star: Tensor  # [B, N, γ] teacher-forced acceptance 1 − ½‖p_d − p_t‖₁ (detached)
    label_valid: Tensor  # [B, N, γ] bool
    nll: Tensor  # [B, N, γ] −log p_d(label) (detached)
    confidence: Tensor | None  # [B, N, γ] σ(confidence logits) (detached); None without a confidence head
    num_blocks: int


TRAINING_STEPS: Registry[Callable[..., StepResult]] = Registry("drafter")


def target_features(target: Any, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(features [B,T,m·d], final_hidden [B,T,d]) from the feature cache when the batch has them, else online."""
    if "features" in batch and "final_hidden" in batch:
        return batch["features"].float(), batch["final_hidden"].float()
    out = target.forward(batch["input_ids"], attention_mask=batch["attention_mask"])
    return out.features, out.final_hidden


def _gather_positions(hidden: Tensor, positions: Tensor) -> Tensor:
    """hidden [B,T,d], positions [B,N,γ] → [B,N,γ,d]."""
    b, n, g = positions.shape
    index = positions.reshape(b, n * g, 1).expand(-1, -1, hidden.shape[-1])
    return hidden.gather(1, index).reshape(b, n, g, hidden.shape[-1])


def _zero(like: Tensor) -> Tensor:
    return torch.zeros((), device=like.device, dtype=like.dtype)


def dspark_step(*, drafter, target, batch: dict[str, Tensor], block_size: int, alpha_ce: float, alpha_tv: float,
                alpha_conf: float, decay: float) -> StepResult:
    """DSpark / DFlash (METHOD §2.1 table, §3): blocks from anchors, p_t from the target's final-norm hidden."""
    features, final_hidden = target_features(target, batch)
    blocks = build_blocks(batch["input_ids"], batch["loss_mask"], batch["anchors"], batch["anchor_valid"],
                          block_size=block_size, mask_token_id=target.mask_token_id)
    out = drafter(context_features=features, context_valid=batch["attention_mask"].bool(),
                  block_input_ids=blocks.block_input_ids, anchor_positions=batch["anchors"],
                  prev_tokens=blocks.prev_tokens)
    with torch.no_grad():
        target_logits = target.lm_head(_gather_positions(final_hidden, blocks.target_positions)).float()
    loss = compute_dspark_loss(out, labels=blocks.labels, label_valid=blocks.label_valid, target_logits=target_logits,
                               alpha_ce=alpha_ce, alpha_tv=alpha_tv, alpha_conf=alpha_conf, decay=decay)
    with torch.no_grad():
        logp = torch.log_softmax(out.logits.float(), dim=-1)
        nll = -logp.gather(-1, blocks.labels.unsqueeze(-1)).squeeze(-1)
        conf = torch.sigmoid(out.confidence_logits.float()) if out.confidence_logits is not None else None
        c_star = loss.c_star if loss.c_star is not None else _analytic_acceptance(logp, target_logits)
    zero = _zero(loss.total)
    parts = LossParts(total=loss.total, ce=_or(loss.ce, zero), tv=_or(loss.tv, zero), conf=_or(loss.conf, zero))
    return StepResult(loss=parts, c_star=c_star.detach(), label_valid=blocks.label_valid, nll=nll,
                      confidence=conf, num_blocks=int(batch["anchor_valid"].sum()))


def _analytic_acceptance(draft_logp: Tensor, target_logits: Tensor) -> Tensor:
    """c* = Σ_v min(p_d, p_t) for metrics when the loss did not need it (DFlash trains on CE only)."""
    return torch.minimum(draft_logp.exp(), torch.softmax(target_logits, dim=-1)).sum(-1).clamp(0, 1)


def _or(value: Tensor | None, default: Tensor) -> Tensor:
    return default if value is None else value.detach()


TRAINING_STEPS.add("dspark", dspark_step)
TRAINING_STEPS.add("dflash", dspark_step)


def eagle3_step(*, drafter, target, batch: dict[str, Tensor], block_size: int, alpha_ce: float = 0.0,
                alpha_tv: float = 0.0, alpha_conf: float = 0.0, decay: float = 4.0) -> StepResult:
    """EAGLE-3 training-time test (METHOD §4): soft CE against p_t with step weights 0.8^k.

    The α weights do not apply (EAGLE-3 has its own loss); they are accepted so one config drives every drafter.
    Metrics treat each position as a "block" whose slot k is TTT step k−1.
    """
    from dspark.losses.eagle3 import compute_eagle3_acceptance_proxy, compute_eagle3_loss

    features, final_hidden = target_features(target, batch)
    out = drafter(features=features, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with torch.no_grad():
        target_logits = target.lm_head(final_hidden).float()
    loss = compute_eagle3_loss(out, loss_mask=batch["loss_mask"], attention_mask=batch["attention_mask"],
                               target_logits=target_logits)
    with torch.no_grad():
        proxy = compute_eagle3_acceptance_proxy(out, loss_mask=batch["loss_mask"],
                                                attention_mask=batch["attention_mask"], target_logits=target_logits)
        nll = _eagle3_nll(out.logits, batch["input_ids"])
    zero = _zero(loss.total)
    parts = LossParts(total=loss.total, ce=loss.total.detach(), tv=zero, conf=zero)
    return StepResult(loss=parts, c_star=proxy.c_star, label_valid=proxy.valid, nll=nll, confidence=None,
                      num_blocks=int(proxy.valid[..., 0].sum()))


def _eagle3_nll(step_logits: list[Tensor], input_ids: Tensor) -> Tensor:
    """−log p_d of the teacher token per (position, step): step k at position i predicts x_{i+k+2} → [B,T,γ]."""
    b, t = input_ids.shape
    out = torch.zeros(b, t, len(step_logits), device=input_ids.device)
    for k, logits in enumerate(step_logits):
        n = t - (k + 2)
        if n <= 0:
            continue
        logp = torch.log_softmax(logits[:, :n].float(), dim=-1)
        out[:, :n, k] = -logp.gather(-1, input_ids[:, k + 2:].unsqueeze(-1)).squeeze(-1)
    return out


TRAINING_STEPS.add("eagle3", eagle3_step)
