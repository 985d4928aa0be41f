"""EAGLE-3 training-time-test loss and its teacher-forced acceptance proxy (METHOD §4, §2.3, §8).

Indexing (0-based, sequence x_0..x_{T-1}; the target's logits z_j = lm_head(final_hidden_j) predict x_{j+1}).
Step k (k = 0..γ-1) at position i predicts x_{i+k+2} (see `dspark.drafters.eagle3`), so its target is

    p_t = softmax(z_{i+k+1})                    temperature 1

and it is supervised iff

    i+k+1 < T  and  loss_mask[i+k]  and  attention_mask[i+k+1]

— METHOD §4's "loss_mask[i+k] and i+k is not the last token", "last" meaning the last real token of the
right-padded row: z_{i+k+1} must exist and be real (the step's input token x_{i+1+k} is then real too).

    L_k        = Σ_{b, i supervised} −Σ_v p_t(v) log p_d_k(v) / (B·T)      B·T of the padded local batch
    L          = Σ_{k=0}^{γ-1} step_weight^k · L_k                        weights not renormalised
    accuracy_k = #{supervised: argmax p_d_k = argmax p_t} / #supervised    (0 when nothing is supervised)

Acceptance proxy: position i is read as an anchor whose slot k+1 is step k, with
c*_{k+1} = Σ_v min(p_d_k(v), p_t(v)) = 1 − ½‖p_d_k − p_t‖₁ at temperature 1, valid on the contiguous prefix of
supervised steps: the [..., γ] tensors `dspark.metrics.acceptance` takes for DSpark blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from dspark.drafters.eagle3 import Eagle3Output


@dataclass
class Eagle3Loss:
    """γ = number of TTT steps."""

    total: Tensor  # []   Σ_k step_weight^k · L_k, differentiable
    per_step: Tensor  # [γ]  L_k (unweighted), differentiable
    accuracy: Tensor  # [γ]  top-1 agreement with the target on supervised positions, detached
    num_supervised: Tensor  # [γ]  long, supervised positions per step (to pool accuracy across batches)


@dataclass
class Eagle3AcceptanceProxy:
    """Per-position, per-slot teacher-forced acceptance of the TTT chain (slot k+1 = step k)."""

    c_star: Tensor  # [B, T, γ] float in [0, 1], detached; 0 outside `valid`
    valid: Tensor  # [B, T, γ] bool, contiguous prefix of supervised steps


def create_eagle3_loss_mask(loss_mask: Tensor, attention_mask: Tensor, *, num_steps: int) -> Tensor:
    """[B, T] masks → bool [B, T, γ]: step k at position i supervised iff i+k+1 < T, loss_mask[i+k] and
    attention_mask[i+k+1] (module docstring)."""
    if loss_mask.shape != attention_mask.shape or loss_mask.dim() != 2:
        raise ValueError(
            f"loss_mask {tuple(loss_mask.shape)} and attention_mask {tuple(attention_mask.shape)} must both be [B, T]"
        )
    batch, seq_len = loss_mask.shape
    loss_mask, attention_mask = loss_mask.bool(), attention_mask.bool()
    out = torch.zeros(batch, seq_len, num_steps, dtype=torch.bool, device=loss_mask.device)
    for step in range(num_steps):
        n = max(seq_len - step - 1, 0)
        out[:, :n, step] = loss_mask[:, step : step + n] & attention_mask[:, step + 1 : step + 1 + n]
    return out


def compute_eagle3_loss(
    output: Eagle3Output,
    *,
    loss_mask: Tensor,
    attention_mask: Tensor,
    target_logits: Tensor | None = None,
    target_probs: Tensor | None = None,
    step_weight: float = 0.8,
) -> Eagle3Loss:
    """Soft cross-entropy TTT loss (METHOD §4; indexing and normalisation in the module docstring).

    output.logits: γ × [B, T, V]; loss_mask, attention_mask [B, T]; exactly one of target_logits [B, T, V]
    (z_j, softmaxed here at T = 1) or target_probs [B, T, V] (softmax(z_j) already), both at the *same*
    positions as the inputs — the shift by k+1 happens here.
    """
    p_target = _target_distribution(output, target_logits=target_logits, target_probs=target_probs)
    batch, seq_len = p_target.shape[:2]
    supervised = create_eagle3_loss_mask(loss_mask, attention_mask, num_steps=len(output.logits))
    return _soft_ce(_aligned_steps(output, p_target, supervised), normaliser=batch * seq_len, step_weight=step_weight)


def _soft_ce(steps: Iterator[tuple[int, Tensor, Tensor, Tensor]], *, normaliser: int, step_weight: float) -> Eagle3Loss:
    """The TTT loss from per-step (k, draft logits [..., V], p_t [..., V], mask [...]) triplets."""
    per_step, correct, counts = [], [], []
    for _, logits, p_t, mask in steps:
        ce = -(p_t * F.log_softmax(logits.float(), dim=-1)).sum(-1)
        per_step.append(torch.where(mask, ce, 0.0).sum() / normaliser)
        agree = logits.detach().argmax(-1) == p_t.argmax(-1)
        correct.append((agree & mask).sum())
        counts.append(mask.sum())
    per_step_t = torch.stack(per_step)
    weights = step_weight ** torch.arange(len(per_step), dtype=per_step_t.dtype, device=per_step_t.device)
    counts_t = torch.stack(counts)
    accuracy = torch.stack(correct).float() / counts_t.clamp_min(1).float()
    return Eagle3Loss(
        total=(weights * per_step_t).sum(), per_step=per_step_t, accuracy=accuracy, num_supervised=counts_t
    )


def sampled_step_targets(
    positions: Tensor, position_valid: Tensor, *, loss_mask: Tensor, attention_mask: Tensor, num_steps: int
) -> tuple[Tensor, Tensor]:
    """For TTT logits computed only at `positions` [B, N] (`Eagle3Drafter.forward(logit_positions=...)`):
    (target_index [B, N, γ] long = i+k+1 clamped to T-1, the z_j each step is compared with; supervised
    [B, N, γ] bool = the full-sequence rule of `create_eagle3_loss_mask` at those positions, and position_valid)."""
    seq_len = loss_mask.shape[1]
    steps = torch.arange(num_steps, device=positions.device)
    target_index = (positions.unsqueeze(-1) + steps + 1).clamp(max=seq_len - 1)
    full = create_eagle3_loss_mask(loss_mask, attention_mask, num_steps=num_steps)  # [B, T, γ]
    gathered = full.gather(1, positions.clamp(0, seq_len - 1).unsqueeze(-1).expand(-1, -1, num_steps))
    return target_index, gathered & position_valid.bool().unsqueeze(-1)


def compute_eagle3_sampled_loss(
    step_logits: list[Tensor],
    *,
    target_logits: Tensor | None = None,
    target_probs: Tensor | None = None,
    supervised: Tensor,
    step_weight: float = 0.8,
) -> Eagle3Loss:
    """The TTT soft CE at sampled positions: step_logits γ × [B, N, Vd]; target_logits [B, N, γ, V] (z at
    `sampled_step_targets`' index, softmaxed here at T = 1) or target_probs [B, N, γ, Vd] (p_t of the draft
    vocabulary's ids, summing to its covered mass: the CE −Σ_{Vd} p_t log p_d ignores p_t's mass outside Vd,
    where p_d is 0 by construction); supervised [B, N, γ]. L_k is normalised by B·N."""
    p_target = _sampled_target(target_logits, target_probs)
    batch, num = supervised.shape[:2]
    steps = ((k, logits, p_target[:, :, k], supervised[:, :, k]) for k, logits in enumerate(step_logits))
    return _soft_ce(steps, normaliser=batch * num, step_weight=step_weight)


@torch.no_grad()
def compute_eagle3_sampled_acceptance(
    step_logits: list[Tensor],
    *,
    target_logits: Tensor | None = None,
    target_probs: Tensor | None = None,
    supervised: Tensor,
) -> Eagle3AcceptanceProxy:
    """`compute_eagle3_acceptance_proxy` at sampled positions (arguments as `compute_eagle3_sampled_loss`)."""
    p_target = _sampled_target(target_logits, target_probs)
    valid = supervised.long().cumprod(dim=-1).bool()
    overlap = torch.stack(
        [
            torch.minimum(torch.softmax(logits.float(), dim=-1), p_target[:, :, k]).sum(-1)
            for k, logits in enumerate(step_logits)
        ],
        dim=-1,
    ).clamp(0.0, 1.0)
    return Eagle3AcceptanceProxy(c_star=torch.where(valid, overlap, 0.0), valid=valid)


def _sampled_target(target_logits: Tensor | None, target_probs: Tensor | None) -> Tensor:
    """p_t fp32 (detached) from exactly one of logits (softmaxed over the full V) or probabilities."""
    if (target_logits is None) == (target_probs is None):
        raise ValueError("pass exactly one of target_logits or target_probs to the EAGLE-3 loss")
    if target_probs is not None:
        return target_probs.detach().float()
    return torch.softmax(target_logits.detach().float(), dim=-1)


@torch.no_grad()
def compute_eagle3_acceptance_proxy(
    output: Eagle3Output,
    *,
    loss_mask: Tensor,
    attention_mask: Tensor,
    target_logits: Tensor | None = None,
    target_probs: Tensor | None = None,
) -> Eagle3AcceptanceProxy:
    """c*_{k+1} = Σ_v min(softmax(logits_k), p_t) per position and step, for DSpark-style teacher-forced
    acceptance metrics (METHOD §8: a proxy, not a decoding rollout). Arguments as `compute_eagle3_loss`."""
    p_target = _target_distribution(output, target_logits=target_logits, target_probs=target_probs)
    supervised = create_eagle3_loss_mask(loss_mask, attention_mask, num_steps=len(output.logits))
    valid = supervised.long().cumprod(dim=-1).bool()
    c_star = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    for step, logits, p_t, _ in _aligned_steps(output, p_target, supervised):
        overlap = torch.minimum(torch.softmax(logits.float(), dim=-1), p_t).sum(-1).clamp(0.0, 1.0)
        n = overlap.shape[1]
        c_star[:, :n, step] = torch.where(valid[:, :n, step], overlap, 0.0)
    return Eagle3AcceptanceProxy(c_star=c_star, valid=valid)


def _aligned_steps(
    output: Eagle3Output, p_target: Tensor, supervised: Tensor
) -> Iterator[tuple[int, Tensor, Tensor, Tensor]]:
    """Per step k: (k, draft logits [B, n, V], p_t [B, n, V], mask [B, n]) over positions i < n = T-k-1.

    Slices, not shifted copies, so no [B, T, V] tensor is allocated per step.
    """
    seq_len = p_target.shape[1]
    for step, logits in enumerate(output.logits):
        n = max(seq_len - step - 1, 0)
        yield step, logits[:, :n], p_target[:, step + 1 : step + 1 + n], supervised[:, :n, step]


def _target_distribution(output: Eagle3Output, *, target_logits: Tensor | None, target_probs: Tensor | None) -> Tensor:
    """The target's T = 1 next-token distribution at every position, fp32 [B, T, V]."""
    if (target_logits is None) == (target_probs is None):
        raise ValueError("pass exactly one of target_logits or target_probs to the EAGLE-3 loss")
    if not output.logits:
        raise ValueError("Eagle3Output has no steps: block_size (the TTT horizon) must be >= 1")
    target = target_logits if target_logits is not None else target_probs
    if target.shape != output.logits[0].shape:
        raise ValueError(
            f"target tensor {tuple(target.shape)} must match the draft logits "
            f"{tuple(output.logits[0].shape)} ([B, T, V], same positions as the drafter's inputs)"
        )
    if target_logits is not None:
        return torch.softmax(target_logits.detach().float(), dim=-1)
    return target_probs.detach().float()
