"""Decoding-time acceptance metrics from real rounds (METHOD §8, terms in §1).

Per round r: ℓ_eff = drafts actually verified (after EOS truncation), A = drafts accepted, τ = tokens committed
(normally A + 1; A when an accepted draft is EOS). With k = 1..γ:

    survival/pos{k}   = #rounds(A ≥ k) / #rounds(ℓ_eff ≥ k)                  unconditional prefix survival
    cond/pos{k}       = #rounds(A ≥ k) / #rounds(A ≥ k−1 and ℓ_eff ≥ k)       paper Fig. 2, its own counters
    verify_rate       = Σ τ / Σ (ℓ_eff + 1)     the anchor slot counts as one verified token that is always kept
    draft_accept_rate = Σ A / Σ ℓ_eff           drafts only
    tau               = Σ τ / #rounds           pooled over rounds (DeepSpec), not a per-prompt mean
    rounds            = #rounds

DeepSpec's evaluation `accept_rate@i` (0-based) is `survival/pos{i+1}`. cond/pos{k} is not survival/pos{k} divided
by survival/pos{k−1} unless every round verifies ≥ k drafts, hence separate counters. All counters are int64 sum
states (`dist_reduce_fx="sum"`): ratios are formed after the all-reduce, so the values are exact under DDP.
A ratio whose denominator is 0 (e.g. no round verified k drafts, or no round at all) is NaN, not 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspark.metrics.acceptance import ExactSumMetric, ratio


def _check_round_shapes(*, num_verified: Tensor, num_accepted: Tensor, committed: Tensor) -> None:
    """ValueError unless the three inputs are 1-D tensors of one length [R]."""
    if not (num_verified.shape == num_accepted.shape == committed.shape) or num_verified.dim() != 1:
        raise ValueError(
            "num_verified, num_accepted and committed must be 1-D tensors of one length [R] (one entry "
            f"per round), got {tuple(num_verified.shape)}, {tuple(num_accepted.shape)}, "
            f"{tuple(committed.shape)}"
        )


def _check_round_values(*, num_verified: Tensor, num_accepted: Tensor, committed: Tensor, block_size: int) -> None:
    """ValueError unless 0 ≤ A ≤ ℓ_eff ≤ γ and A ≤ τ ≤ A + 1, τ ≥ 1 for every round (METHOD §1)."""
    ell, acc, tau = num_verified.long(), num_accepted.long(), committed.long()
    if bool(((ell < 0) | (ell > block_size)).any()):
        raise ValueError(
            f"num_verified must lie in [0, block_size={block_size}]; build the metric with the "
            "block_size used for decoding"
        )
    if bool(((acc < 0) | (acc > ell)).any()):
        raise ValueError("num_accepted must lie in [0, num_verified] for every round")
    if bool(((tau < acc) | (tau > acc + 1) | (tau < 1)).any()):
        raise ValueError("committed (τ) must be num_accepted or num_accepted + 1 and at least 1 for every round")


def _rollout_update(
    *, num_verified: Tensor, num_accepted: Tensor, committed: Tensor, block_size: int
) -> dict[str, Tensor]:
    """int64 counters of one batch of rounds; inputs [R] int → [γ] per-slot counters and scalar totals."""
    ell = num_verified.long().reshape(-1, 1)
    acc = num_accepted.long().reshape(-1, 1)
    slots = torch.arange(1, block_size + 1, device=ell.device)
    return {
        "survive_num": (acc >= slots).sum(dim=0),
        "survive_den": (ell >= slots).sum(dim=0),
        "cond_num": ((acc >= slots) & (ell >= slots)).sum(dim=0),
        "cond_den": ((acc >= slots - 1) & (ell >= slots)).sum(dim=0),
        "committed_sum": committed.long().sum(),
        "sent_sum": (ell + 1).sum(),
        "accepted_sum": acc.sum(),
        "verified_sum": ell.sum(),
        "rounds": torch.tensor(ell.shape[0], dtype=torch.int64, device=ell.device),
    }


def _rollout_compute(
    *,
    survive_num: Tensor,
    survive_den: Tensor,
    cond_num: Tensor,
    cond_den: Tensor,
    committed_sum: Tensor,
    sent_sum: Tensor,
    accepted_sum: Tensor,
    verified_sum: Tensor,
    rounds: Tensor,
) -> dict[str, Tensor]:
    """{"survival/pos{k}", "cond/pos{k}", "verify_rate", "draft_accept_rate", "tau", "rounds"} (float64)."""
    survival, cond = ratio(survive_num, survive_den), ratio(cond_num, cond_den)
    out = {f"survival/pos{k + 1}": survival[k] for k in range(survival.shape[0])}
    out.update({f"cond/pos{k + 1}": cond[k] for k in range(cond.shape[0])})
    out["verify_rate"] = ratio(committed_sum, sent_sum)
    out["draft_accept_rate"] = ratio(accepted_sum, verified_sum)
    out["tau"] = ratio(committed_sum, rounds)
    out["rounds"] = rounds.double()
    return out


class RolloutAcceptance(ExactSumMetric):
    """Survival, conditional acceptance, verify rate and pooled τ over decoding rounds (METHOD §8).

    update(*, num_verified [R] int ℓ_eff, num_accepted [R] int A, committed [R] int τ), one entry per round.
    compute() → {"survival/pos{k}", "cond/pos{k}" (k = 1..γ), "verify_rate", "draft_accept_rate", "tau",
    "rounds"} as float64 scalars; NaN for a ratio with a zero denominator.
    `validate_args=False` skips the round-consistency checks (which need a device sync).
    """

    higher_is_better = True

    def __init__(self, block_size: int, validate_args: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.validate_args = validate_args
        for name in ("survive_num", "survive_den", "cond_num", "cond_den"):
            self.add_sum_state(name, (block_size,), torch.int64)
        for name in ("committed_sum", "sent_sum", "accepted_sum", "verified_sum", "rounds"):
            self.add_sum_state(name, (), torch.int64)

    def update(self, *, num_verified: Tensor, num_accepted: Tensor, committed: Tensor) -> None:
        rounds = dict(num_verified=num_verified, num_accepted=num_accepted, committed=committed)
        _check_round_shapes(**rounds)
        if self.validate_args:
            _check_round_values(**rounds, block_size=self.block_size)
        for name, value in _rollout_update(**rounds, block_size=self.block_size).items():
            setattr(self, name, getattr(self, name) + value)

    def compute(self) -> dict[str, Tensor]:
        return _rollout_compute(**self.metric_state)
