"""DSpark training loss (METHOD §3), a pure function of the drafter's teacher-forced output.

    L = α_ce·L_ce + α_tv·L_tv + α_conf·L_conf,     w_k = exp(-(k-1)/γ_w)  (k = 1..γ, `loss.decay` = γ_w)
    L_ce   = Σ w_k · (-log p_d_k(x*_k))      / Σ w_k
    L_tv   = Σ w_k · ‖p_d_k − p_t_k‖₁        / Σ w_k      (full vocabulary, fp32 softmax, unhalved L1)
    L_conf = Σ w_k · BCE(c_k logit, c*_k)    / Σ w_k,     c*_k = clamp(1 − ½‖p_d_k − p_t_k‖₁, 0, 1)

With a draft vocabulary (Vd < V, `dspark.drafters.vocab`) p_d is zero outside Vd, so the L1 distance splits
exactly into Σ_{x ∈ Vd} |p_d − p_t| + (1 − Σ_{x ∈ Vd} p_t): `target_probs` are the target's full-vocabulary
probabilities of the Vd draft ids (summing to the covered mass, not 1), and labels outside Vd carry no CE term.

Sums run over the supervised (block, slot) pairs of the whole batch (DeepSpec's pooled normalisation, not per
block), and under data parallelism over every rank: `normalizer` maps this batch's Σ w to the denominator (the
training module passes the all-reduced Σ w over the world size, so DDP's gradient average is ∇ Σ_all w·ℓ / Σ_all w).
`p_d_k` is the sequentially corrected (teacher-forced) draft distribution softmax(U_k + B_k). Only c* is
detached: the confidence loss also trains the backbone and W_1. Terms with α = 0 are not computed.

`loss.position_weights=dpace` replaces w_k by D-PACE's confidence-adaptive weights (`dpace_position_weights`), per
block and detached, from the drafter's own confidence in each label, q_k = p_d_k(x*_k) (0 for a label outside Vd):

    q̃_k = (1 − α) q_k + α,     w_k = Σ_{j ≥ k} Π_{i ≤ j} q̃_i      (α = `loss.dpace_alpha`)

w_k is the derivative of the smoothed expected accepted length Σ_j Π_{i ≤ j} q̃_i with respect to log q̃_k: the credit
slot k controls (it needs every earlier slot accepted and unlocks every later one). The normalisation stays the pooled
Σ w·ℓ / Σ w above, so only the batch-wide scale of the credit is divided out (METHOD §3 says why).

Shape symbols: B sequences, N blocks, γ block size, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.nn import functional as F

from dspark.drafters.dspark import DSparkOutput


@dataclass
class DSparkLoss:
    """Scalar loss terms (zero tensors for terms with α = 0) and the per-slot acceptance target."""

    total: Tensor  # [] α-weighted sum, the quantity to backpropagate
    ce: Tensor  # [] weighted-mean cross-entropy against the labels
    tv: Tensor  # [] weighted-mean unhalved L1 distance to p_t
    conf: Tensor  # [] weighted-mean BCE of the confidence logits against c*
    c_star: Tensor | None  # [B, N, γ] detached c*_k (0 on unsupervised slots); None without a target distribution
    renyi: Tensor | None = None  # [] D-PARD's credit-weighted Rényi-½ actor term (loss.kind=dpard, losses/dpard.py)
    nll: Tensor | None = None  # [B, N, γ] detached −log p_d(x*_k) on supervised slots (0 elsewhere), for the metrics


#: `loss.position_weights`: the paper's fixed decay, or D-PACE's confidence-adaptive credit
POSITION_WEIGHTS = ("decay", "dpace")


def position_weights(block_size: int, decay: float) -> Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..block_size: [γ] fp32 (METHOD §3, default decay γ_w = 4)."""
    if not (decay > 0 and math.isfinite(decay)):
        raise ValueError(f"loss.decay must be a positive finite number (got {decay}); the paper's default is 4")
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / decay)


def dpace_position_weights(confidence: Tensor, label_valid: Tensor, *, alpha: float, key: str = "loss.dpace_alpha"):
    """w_k = Σ_{j ≥ k} Π_{i ≤ j} ((1 − α) q_i + α) over each block's supervised slots: [B, N, γ] (0 elsewhere).

    confidence q [B, N, γ] in [0, 1] (D-PACE: p_d(x*_k); D-PARD: the exact acceptance a_k), label_valid [B, N, γ]
    bool (a contiguous prefix per block). `key` names the config key of α in the error (D-PARD shares the recurrence).
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"{key} must lie in (0, 1] (got {alpha}); D-PACE and D-PARD use 0.5")
    mask = label_valid.to(confidence.dtype)
    smooth = torch.where(label_valid, (1 - alpha) * confidence + alpha, torch.ones_like(confidence))
    prefix = torch.cumprod(smooth, dim=-1) * mask
    return torch.flip(torch.cumsum(torch.flip(prefix, dims=[-1]), dim=-1), dims=[-1]) * mask


def supervised_weights(
    scheme: str,
    *,
    label_valid: Tensor,
    nll: Tensor,
    label_in_vocab: Tensor | None,
    decay: float,
    dpace_alpha: float,
) -> Tensor:
    """The position weight of every supervised slot, [M] in `[label_valid]` order (`loss.position_weights`).

    label_valid [B, N, γ] bool; nll [M] −log p_d(x*) of the supervised slots (read detached, by dpace only);
    label_in_vocab [B, N, γ] bool or None (a label outside the draft vocabulary has q = 0)."""
    if scheme == "decay":
        return position_weights(label_valid.shape[-1], decay).to(nll.device).expand(label_valid.shape)[label_valid]
    if scheme != "dpace":
        raise ValueError(f"loss.position_weights={scheme!r} is not one of {', '.join(POSITION_WEIGHTS)}")
    with torch.no_grad():
        q = torch.exp(-nll.detach().float())
        if label_in_vocab is not None:
            q = torch.where(label_in_vocab[label_valid], q, 0.0)
        confidence = q.new_zeros(label_valid.shape).masked_scatter(label_valid, q)
        return dpace_position_weights(confidence, label_valid, alpha=dpace_alpha)[label_valid]


def compute_dspark_loss(
    output: DSparkOutput,
    *,
    labels: Tensor,
    label_valid: Tensor,
    target_probs: Tensor | None = None,
    target_logits: Tensor | None = None,
    label_in_vocab: Tensor | None = None,
    normalizer: Callable[[Tensor], Tensor] | None = None,
    alpha_ce: float,
    alpha_tv: float,
    alpha_conf: float,
    decay: float,
    position_weights: str = "decay",
    dpace_alpha: float = 0.5,
) -> DSparkLoss:
    """Weighted DSpark loss over the supervised slots; `position_weights` (decay | dpace) and `dpace_alpha` choose
    the slot weights (module docstring).

    labels [B, N, γ] long (x*_k, as draft ids); label_valid [B, N, γ] bool (a contiguous prefix per block);
    label_in_vocab [B, N, γ] bool (default all True): False where x*_k lies outside the draft vocabulary (no CE
    term there); exactly one of target_probs [B, N, γ, Vd] (p_t at temperature 1 on the draft ids, possibly
    summing to less than 1; or [M, Vd], already at the M supervised slots in `[label_valid]` order) /
    target_logits [B, N, γ, V] (full vocabulary only), needed when α_tv or α_conf > 0 and used for `c_star` whenever given. normalizer: Σ w [] of this batch → the denominator of every term
    (default: itself). With no supervised slot every term is 0, still attached to the graph (the
    selections are empty), so a rank without labels still takes part in a data-parallel backward.
    """
    _validate(
        output,
        target_probs=target_probs,
        target_logits=target_logits,
        alphas={"alpha_ce": alpha_ce, "alpha_tv": alpha_tv, "alpha_conf": alpha_conf},
    )
    p_t = None
    if target_probs is not None or target_logits is not None:
        p_t = _selected_target_probs(target_probs, target_logits, label_valid)
    rows = label_valid.flatten().nonzero().squeeze(-1)  # the supervised slots, in `[label_valid]` order
    l1, nll = _DraftRowTerms.apply(
        output.logits.reshape(-1, output.logits.shape[-1]), rows, labels[label_valid], p_t
    )  # [M], [M]
    weights = supervised_weights(
        position_weights,
        label_valid=label_valid,
        nll=nll,
        label_in_vocab=label_in_vocab,
        decay=decay,
        dpace_alpha=dpace_alpha,
    )
    weight_sum = weights.sum() if normalizer is None else normalizer(weights.sum())
    weight_sum = weight_sum.clamp_min(torch.finfo(torch.float32).tiny)  # avoid 0/0 on an empty batch
    zero = weights.new_zeros(())

    ce = tv = conf = zero
    if alpha_ce > 0:
        ce_terms = nll if label_in_vocab is None else torch.where(label_in_vocab[label_valid], nll, 0.0)
        ce = (weights * ce_terms).sum() / weight_sum  # a label outside Vd has p_d = 0: no gradient can reach it
    c_star = None
    if p_t is not None:
        l1 = l1 + (1.0 - p_t.sum(-1)).clamp_min(0.0)  # + p_t's mass outside the draft vocabulary: ‖p_d − p_t‖₁ over V
        if alpha_tv > 0:
            tv = (weights * l1).sum() / weight_sum
        c_star = (1 - 0.5 * l1.detach()).clamp(0.0, 1.0)  # [M]
    if alpha_conf > 0:
        bce = F.binary_cross_entropy_with_logits(
            output.confidence_logits[label_valid].float(), c_star, reduction="none"
        )
        conf = (weights * bce).sum() / weight_sum
    total = alpha_ce * ce + alpha_tv * tv + alpha_conf * conf
    c_star_full = None if c_star is None else c_star.new_zeros(labels.shape).masked_scatter(label_valid, c_star)
    nll_full = nll.detach().new_zeros(labels.shape).masked_scatter(label_valid, nll.detach())
    return DSparkLoss(total=total, ce=ce, tv=tv, conf=conf, c_star=c_star_full, nll=nll_full)


class _DraftRowTerms(torch.autograd.Function):
    """Per supervised slot: the unhalved L1 distance Σ_{x ∈ Vd} |p_d − p_t| and −log p_d(x*), p_d = softmax(logits),
    with the backward written out — the step's largest elementwise cost on the CPU: autograd through
    log_softmax → exp → sub → abs made ~16 passes over [M, Vd] fp32 plus a boolean-index scatter of the gradient;
    this makes ~5 forward and ~7 backward passes and copies the gradient rows back by index.

    forward(logits [R, Vd] (any float dtype; R = B·N·γ rows), rows [M] long (the supervised rows), labels [M] long
    (draft ids), target_probs [M, Vd] fp32 or None) → (l1 [M] fp32 (zeros without target_probs), nll [M] fp32).
    Gradients (p = p_d, s = sign(p − p_t)):  ∂l1/∂z = p ⊙ (s − ⟨p, s⟩),  ∂nll/∂z = p − onehot(x*);  sign(0) = 0, as
    autograd's |·| has it. Tested against autograd through the plain formula (tests/test_dspark_loss.py).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, rows: Tensor, labels: Tensor, target_probs: Tensor | None):
        ctx.set_materialize_grads(False)
        z = logits.index_select(0, rows).float()  # a fresh fp32 [M, Vd]: safe to overwrite below
        log_norm = torch.logsumexp(z, dim=-1, keepdim=True)
        nll = (log_norm - z.gather(-1, labels.unsqueeze(-1))).squeeze(-1)
        probs = z.sub_(log_norm).exp_()  # p_d, in place of z
        if target_probs is None:
            diff, l1 = None, probs.new_zeros(rows.shape)
            ctx.mark_non_differentiable(l1)
        else:
            diff = probs - target_probs
            l1 = torch.linalg.vector_norm(diff, ord=1, dim=-1)
        ctx.save_for_backward(rows, labels, probs, diff)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return l1, nll

    @staticmethod
    def backward(ctx, grad_l1: Tensor | None, grad_nll: Tensor | None):
        rows, labels, probs, diff = ctx.saved_tensors
        use_l1 = grad_l1 is not None and diff is not None
        if not use_l1 and grad_nll is None:
            return None, None, None, None
        if use_l1:
            grad = torch.sign(diff)  # s, then g_l1·(s − ⟨p, s⟩) [+ g_nll], then ⊙ p
            inner = torch.bmm(probs.unsqueeze(1), grad.unsqueeze(2)).view(-1, 1)  # ⟨p, s⟩ per row, one pass
            grad.sub_(inner).mul_(grad_l1.unsqueeze(-1))
            if grad_nll is not None:
                grad.add_(grad_nll.unsqueeze(-1))
            grad.mul_(probs)
        else:
            grad = probs * grad_nll.unsqueeze(-1)
        if grad_nll is not None:
            grad.scatter_add_(-1, labels.unsqueeze(-1), -grad_nll.unsqueeze(-1))
        full = grad.new_zeros(ctx.logits_shape, dtype=ctx.logits_dtype)
        full.index_copy_(0, rows, grad.to(ctx.logits_dtype))
        return full, None, None, None


def _selected_target_probs(target_probs: Tensor | None, target_logits: Tensor | None, label_valid: Tensor) -> Tensor:
    """p_t on the supervised slots, fp32: [M, V]."""
    if target_probs is not None:
        return (target_probs if target_probs.dim() == 2 else target_probs[label_valid]).float()
    return F.softmax(target_logits[label_valid].float(), dim=-1)


def _validate(
    output: DSparkOutput, *, target_probs: Tensor | None, target_logits: Tensor | None, alphas: dict[str, float]
) -> None:
    """Raise ValueError naming the `loss.*` key whose value cannot be used with these inputs."""
    for key, value in alphas.items():
        if not value >= 0:
            raise ValueError(f"loss.{key} must be >= 0 (got {value})")
    if not any(value > 0 for value in alphas.values()):
        raise ValueError(
            "loss.alpha_ce, loss.alpha_tv and loss.alpha_conf are all 0: nothing would train; "
            "use e.g. (0.1, 0.9, 1.0) for DSpark or (1, 0, 0) for DFlash"
        )
    if target_probs is not None and target_logits is not None:
        raise ValueError("compute_dspark_loss: pass target_probs or target_logits, not both")
    needs_target = alphas["alpha_tv"] > 0 or alphas["alpha_conf"] > 0
    if needs_target and target_probs is None and target_logits is None:
        raise ValueError(
            "loss.alpha_tv / loss.alpha_conf > 0 need the target distribution: pass target_probs "
            "or target_logits, or set both alphas to 0"
        )
    if alphas["alpha_conf"] > 0 and output.confidence_logits is None:
        raise ValueError(
            "loss.alpha_conf > 0 but the drafter has no confidence head: set model.confidence=true or loss.alpha_conf=0"
        )
