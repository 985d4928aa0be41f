"""D-PARD (`loss.kind=dpard`): the block-drafter objective of vllm-project/speculators PR #1078 and SpecForge #827.

Per supervised slot k of a block, with p_t the target's and q_k the (sequentially corrected) draft distribution:

    R_k   = D_½(p_t ‖ q_k) = −2 log Σ_v √(p_t(v) q_k(v))          Rényi-½ divergence: the actor term
    a_k   = Σ_v min(p_t(v), q_k(v)) = 1 − TV(p_t, q_k)              exact acceptance of slot k (detached)
    s_k   = (1 − α) a_k + α,  P_k = Π_{i ≤ k} s_i                   the D-PACE recurrence on a_k (α = loss.dpard_alpha)
    w_k   = Σ_{j ≥ k} P_j                                           position credit: what slot k can still unlock
    r_k   = Π_{i < k} a_i                                           reach: the chance slot k is verified at all
    L     = [Σ w_k R_k + α_conf Σ r_k BCE(c_k, a_k)] / (number of blocks with a supervised slot)

w, r and a are detached (no gradient through the credit), so the actor gradient is the Rényi-½ gradient at each
slot scaled by how much expected accepted length that slot controls. Sums run over each block's contiguous prefix
of supervised slots. With a draft vocabulary q is zero outside Vd, so both sums over v are exact over Vd.

Shape symbols: B sequences, N blocks, γ block size, Vd draft vocabulary (V without one).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from dspark.drafters.dspark import DSparkOutput
from dspark.losses.dspark import DSparkLoss, dpace_position_weights


def dpard_position_weights(acceptance: Tensor, label_valid: Tensor, *, alpha: float) -> Tensor:
    """w_k = Σ_{j ≥ k} Π_{i ≤ j} ((1 − α) a_i + α) over each block's supervised slots: [B, N, γ] (0 elsewhere) —
    D-PACE's recurrence (`losses.dspark.dpace_position_weights`) on the exact acceptance a_k.

    acceptance [B, N, γ] in [0, 1], label_valid [B, N, γ] bool (a contiguous prefix per block).
    """
    return dpace_position_weights(acceptance, label_valid, alpha=alpha, key="loss.dpard_alpha")


def reach_weights(acceptance: Tensor, label_valid: Tensor) -> Tensor:
    """r_k = Π_{i < k} a_i (r_1 = 1) on the supervised slots: [B, N, γ] (0 elsewhere)."""
    shifted = torch.cat([torch.ones_like(acceptance[..., :1]), acceptance[..., :-1]], dim=-1)
    return torch.cumprod(shifted, dim=-1) * label_valid.to(acceptance.dtype)


def renyi_half(log_q: Tensor, p_t: Tensor) -> Tensor:
    """D_½(p_t ‖ q) = −2 log Σ_v √(p_t q) per row: log_q [M, Vd] (draft log-probabilities), p_t [M, Vd] → [M].

    In the log domain (a logsumexp of ½(log p_t + log q)), so rows where p_t or q underflow stay finite."""
    log_p = torch.log(p_t.clamp_min(0.0))  # -inf where p_t = 0 drops out of the logsumexp
    # a row with no overlap at all (p_t's mass entirely outside the draft vocabulary) is capped, not infinite
    return -2.0 * torch.logsumexp(0.5 * (log_p + log_q), dim=-1).clamp_min(-60.0)


def compute_dpard_loss(
    output: DSparkOutput, *, label_valid: Tensor, target_probs: Tensor, alpha_conf: float, dpard_alpha: float, **_unused
) -> DSparkLoss:
    """D-PARD over the supervised slots; `total` is the quantity to backpropagate, `renyi` the actor term.

    target_probs [B, N, γ, Vd] p_t on the draft ids (summing to the covered mass when Vd < V). `ce`/`tv` are zero
    (this objective has neither); `c_star` is the detached acceptance a_k, 0 on unsupervised slots. Extra loss
    settings of the paper objective (alpha_ce, alpha_tv, decay) are accepted and unused.
    """
    if alpha_conf < 0:
        raise ValueError(f"loss.alpha_conf must be >= 0 (got {alpha_conf})")
    if alpha_conf > 0 and output.confidence_logits is None:
        raise ValueError("loss.alpha_conf > 0 but the drafter has no confidence head: set loss.alpha_conf=0")
    log_q = F.log_softmax(output.logits.float(), dim=-1)  # [B, N, γ, Vd]
    p_t = target_probs.float()
    with torch.no_grad():
        acceptance = torch.minimum(log_q.exp(), p_t).sum(-1).clamp(0.0, 1.0) * label_valid  # [B, N, γ]
        credit = dpard_position_weights(acceptance, label_valid, alpha=dpard_alpha)
        reach = reach_weights(acceptance, label_valid)
    num_blocks = label_valid.any(dim=-1).sum().clamp_min(1)  # blocks with at least one supervised slot
    renyi = (credit[label_valid] * renyi_half(log_q[label_valid], p_t[label_valid])).sum() / num_blocks
    conf = renyi.new_zeros(())
    if alpha_conf > 0:
        bce = F.binary_cross_entropy_with_logits(
            output.confidence_logits[label_valid].float(), acceptance[label_valid], reduction="none"
        )
        conf = (reach[label_valid] * bce).sum() / num_blocks
    zero = renyi.new_zeros(())
    return DSparkLoss(total=renyi + alpha_conf * conf, ce=zero, tv=zero, conf=conf, c_star=acceptance, renyi=renyi)
