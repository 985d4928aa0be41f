"""Teacher-forced acceptance proxies: per-slot mean c*_k, τ_prob and per-slot cross-entropy (METHOD §8, §2.3).

With `c*_k = Σ_v min(p_d_k(v), p_t_k(v))` the probability that draft k survives verification given that every
earlier draft was accepted (§2.3), a block of γ slots yields

    accept/pos{k} = Σ_blocks c*_k / #blocks with slot k supervised
    τ_prob        = mean over blocks of (1 + Σ_{k ≤ L} Π_{i ≤ k} c*_i),   L = the block's valid-prefix length.

These are *training* proxies: DeepSpec's training `accept_rate@i` is `accept/pos{i+1}` here, a different quantity
from the decoding-time `survival/pos{k}` of `dspark.metrics.rollout` (§8: never put the two in one column).

Every metric keeps numerators and denominators as float64/int64 sum states with `dist_reduce_fx="sum"`, so the
ratio is taken once, after the all-reduce: exact under DDP, never an average of per-rank ratios.

Masking. A slot is supervised iff it lies in the block's contiguous valid prefix: slots after the first invalid
one are ignored even if flagged valid (METHOD §3, "supervise only a contiguous prefix"). Values in ignored slots
may be anything, NaN included. A block whose valid prefix is shorter than γ (the tail of a sequence) contributes
to τ_prob only the terms of its valid slots, `1 + Σ_{k ≤ L} Π_{i ≤ k} c*_i`, i.e. a truncated τ (never more than
L + 1); blocks with no valid slot (padded anchors) are not counted at all.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torchmetrics import Metric


def prefix_mask(valid: Tensor) -> Tensor:
    """[..., γ] bool: True on the contiguous valid prefix of each block (slots before the first False)."""
    return valid.bool().long().cumprod(dim=-1).bool()


def check_block_tensor(name: str, value: Tensor, *, reference: Tensor, block_size: int) -> None:
    """Raise ValueError unless `value` has `reference`'s shape and a last dimension equal to `block_size` (γ)."""
    if value.shape != reference.shape:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)} but the mask has {tuple(reference.shape)}; "
            "pass per-slot tensors of one shape [..., block_size]"
        )
    if value.dim() == 0 or value.shape[-1] != block_size:
        raise ValueError(
            f"{name} has last dimension {tuple(value.shape)[-1:]} but block_size={block_size}; "
            "build the metric with the block_size the drafter was configured with"
        )


class ExactSumMetric(Metric):
    """A `Metric` whose states are sums (float64/int64, `dist_reduce_fx="sum"`) that keep their dtype.

    torchmetrics converts float states when a module is cast with `.to(dtype)` (e.g. Lightning's "bf16-true"
    precision); here casts only move states between devices, so a bf16 run still accumulates exact sums
    (`set_dtype` has no effect either). Inputs are detached: updating never builds an autograd graph.
    """

    full_state_update = False
    is_differentiable = False

    def add_sum_state(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Register a zero-initialised sum state of `shape` and `dtype`."""
        self.add_state(name, default=torch.zeros(shape, dtype=dtype), dist_reduce_fx="sum")

    def _apply(self, fn: Callable, exclude_state: str = "") -> "ExactSumMetric":
        def keep_dtype(tensor: Tensor) -> Tensor:
            out = fn(tensor)
            return out if out.dtype == tensor.dtype else tensor.to(device=out.device)

        return super()._apply(keep_dtype, exclude_state)


def ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / denominator in float64; NaN where the denominator is 0 (an undefined ratio, not 0)."""
    num, den = numerator.double(), denominator.double()
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(num, float("nan")))


def _teacher_forced_acceptance_update(c_star: Tensor, label_valid: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sums for one batch: (Σ c*_k [γ] f64, #supervised slot k [γ] i64, Σ_blocks τ_prob f64, #blocks i64).

    c_star [..., γ] in [0, 1]; label_valid [..., γ] bool (only its contiguous prefix counts).
    """
    gamma = c_star.shape[-1]
    valid = prefix_mask(label_valid).reshape(-1, gamma)
    # where() rather than a product so NaN/garbage in ignored slots cannot leak into the sums
    c = torch.where(valid, c_star.detach().reshape(-1, gamma).double(), 0.0)
    # c is 0 from the first invalid slot on, so the running product vanishes there: Σ over the valid prefix only
    tau = 1.0 + torch.cumprod(c, dim=-1).sum(dim=-1)
    has_block = valid[:, 0]
    tau_sum = torch.where(has_block, tau, 0.0).sum()
    return c.sum(dim=0), valid.sum(dim=0), tau_sum, has_block.sum()


def _teacher_forced_acceptance_compute(
    *, accept_sum: Tensor, accept_count: Tensor, tau_sum: Tensor, blocks: Tensor
) -> dict[str, Tensor]:
    """{"accept/pos{k}" (k = 1..γ), "tau_prob"} as float64 scalars; NaN where nothing was counted."""
    means = ratio(accept_sum, accept_count)
    out = {f"accept/pos{k + 1}": means[k] for k in range(means.shape[0])}
    out["tau_prob"] = ratio(tau_sum, blocks)
    return out


class TeacherForcedAcceptance(ExactSumMetric):
    """Mean teacher-forced c*_k per slot and τ_prob = 1 + Σ_k Π_{i≤k} c*_i averaged over blocks (METHOD §8).

    update(c_star [..., γ] float in [0, 1], label_valid [..., γ] bool), typically [B, N, γ] from the loss.
    compute() → {"accept/pos1" … "accept/pos{γ}", "tau_prob"} (float64). See the module docstring for masking
    and for blocks whose valid prefix is shorter than γ.
    """

    higher_is_better = True

    def __init__(self, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.add_sum_state("accept_sum", (block_size,), torch.float64)
        self.add_sum_state("accept_count", (block_size,), torch.int64)
        self.add_sum_state("tau_sum", (), torch.float64)
        self.add_sum_state("blocks", (), torch.int64)

    def update(self, c_star: Tensor, label_valid: Tensor) -> None:
        check_block_tensor("c_star", c_star, reference=label_valid, block_size=self.block_size)
        accept_sum, accept_count, tau_sum, blocks = _teacher_forced_acceptance_update(c_star, label_valid)
        self.accept_sum += accept_sum
        self.accept_count += accept_count
        self.tau_sum += tau_sum
        self.blocks += blocks

    def compute(self) -> dict[str, Tensor]:
        return _teacher_forced_acceptance_compute(
            accept_sum=self.accept_sum, accept_count=self.accept_count, tau_sum=self.tau_sum, blocks=self.blocks
        )


def _position_cross_entropy_update(nll: Tensor, label_valid: Tensor) -> tuple[Tensor, Tensor]:
    """Sums for one batch: (Σ nll per slot [γ] f64, #supervised slots [γ] i64); nll, label_valid [..., γ]."""
    gamma = nll.shape[-1]
    valid = prefix_mask(label_valid).reshape(-1, gamma)
    values = torch.where(valid, nll.detach().reshape(-1, gamma).double(), 0.0)
    return values.sum(dim=0), valid.sum(dim=0)


def _position_cross_entropy_compute(*, nll_sum: Tensor, count: Tensor) -> dict[str, Tensor]:
    """{"ce/pos{k}", "ce/mean"}: per-slot mean NLL and the mean over all supervised slots (unweighted)."""
    per_slot = ratio(nll_sum, count)
    out = {f"ce/pos{k + 1}": per_slot[k] for k in range(per_slot.shape[0])}
    out["ce/mean"] = ratio(nll_sum.sum(), count.sum())
    return out


class PositionCrossEntropy(ExactSumMetric):
    """Mean negative log-likelihood of the label per slot, −log p_d_k(x*_k) (unweighted; METHOD §3's L_ce terms).

    update(nll [..., γ] float, label_valid [..., γ] bool) → compute() {"ce/pos1" … "ce/pos{γ}", "ce/mean"} where
    "ce/mean" pools every supervised slot (it is not the position-weighted training loss).
    """

    higher_is_better = False

    def __init__(self, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.add_sum_state("nll_sum", (block_size,), torch.float64)
        self.add_sum_state("count", (block_size,), torch.int64)

    def update(self, nll: Tensor, label_valid: Tensor) -> None:
        check_block_tensor("nll", nll, reference=label_valid, block_size=self.block_size)
        nll_sum, count = _position_cross_entropy_update(nll, label_valid)
        self.nll_sum += nll_sum
        self.count += count

    def compute(self) -> dict[str, Tensor]:
        return _position_cross_entropy_compute(nll_sum=self.nll_sum, count=self.count)
