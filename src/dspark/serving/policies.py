"""Per-request verification lengths for R concurrent requests: the serving policies (METHOD §6, paper §5.2, §7).

A policy maps the confidences of one engine step to ℓ_r for every active request:

    confidences [R, γ] float   c̃_{r,k} (STS-calibrated when the engine has a calibration, else raw c_k);
                               columns k ≥ num_drafts[r] are ignored (drafting stopped at a drafted stop id)
    num_drafts  [R] long       γ'_r ≤ γ
    →           [R] long       ℓ_r ∈ [0, γ'_r]

    mtp1       ℓ_r = min(1, γ'_r)            the paper's production baseline (one draft per request)
    static     ℓ_r = min(k, γ'_r)            serve.static_k
    fixed      ℓ_r = γ'_r                    verify everything
    threshold  prefix before the first c̃_{r,k} < θ   serve.threshold
    scheduler  Algorithm 1 over all R requests with the early stop on SPS(B) of the batched forward (lossless)
    async      capacity K = Σℓ of the full search on the confidences of two steps ago, filled with the K best
               current candidates (`async_capacity_schedule`); the first two steps use `scheduler`

All are prefix rules whose decision on slot k depends on c̃_{≤k} only (or on stale confidences), so verification
stays lossless (METHOD §5, Appendix A). Policies with history (`async`) are reset by the engine when serving starts.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from dspark.registry import Registry
from dspark.scheduling.scheduler import async_capacity_schedule, schedule_verification
from dspark.scheduling.sps import SPSTable

POLICY_KEY = "serve.policy"


class ServePolicy(Protocol):
    name: str
    needs_confidences: bool

    def choose(self, *, confidences: Tensor | None, num_drafts: Tensor) -> Tensor: ...

    def reset(self) -> None: ...


def _check(name: str, confidences: Tensor | None, num_drafts: Tensor, *, need: bool) -> Tensor | None:
    """Validate shapes; return confidences [R, γ] float64 on CPU with ignored columns zeroed (None if not needed)."""
    num_drafts = num_drafts.reshape(-1)
    if not need:
        return None
    if confidences is None:
        raise ValueError(f"{POLICY_KEY}={name} needs per-slot confidences, but this drafter has no confidence head "
                         f"(dflash); use {POLICY_KEY}=mtp1, static or fixed, or drafter=dspark")
    if confidences.dim() != 2 or confidences.shape[0] != num_drafts.shape[0]:
        raise ValueError(f"{POLICY_KEY}={name}: confidences must be [R, γ] with R = {num_drafts.shape[0]}, got "
                         f"{tuple(confidences.shape)}")
    values = confidences.detach().to(device="cpu", dtype=torch.float64)
    drafted = torch.arange(values.shape[1]).unsqueeze(0) < num_drafts.cpu().unsqueeze(1)
    return torch.where(drafted, values, 0.0)


def _cap(lengths: Tensor, num_drafts: Tensor) -> Tensor:
    return torch.minimum(lengths.to(torch.long).cpu(), num_drafts.reshape(-1).to(torch.long).cpu())


@dataclass
class StaticPolicy:
    """ℓ_r = min(k, γ'_r); `mtp1` is k = 1, `fixed` is k = γ (None)."""

    k: int | None
    name: str = "static"
    needs_confidences = False

    def __post_init__(self) -> None:
        if self.k is not None and int(self.k) < 0:
            raise ValueError(f"serve.static_k={self.k} must be >= 0 (drafts verified per request)")

    def choose(self, *, confidences: Tensor | None, num_drafts: Tensor) -> Tensor:
        num_drafts = num_drafts.reshape(-1).to(torch.long).cpu()
        return num_drafts.clone() if self.k is None else num_drafts.clamp(max=int(self.k))

    def reset(self) -> None:
        pass


@dataclass
class ThresholdPolicy:
    """Per request, the prefix before the first c̃_k < θ."""

    threshold: float
    name = "threshold"
    needs_confidences = True

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"serve.threshold={self.threshold} must lie in [0, 1], e.g. serve.threshold=0.5")

    def choose(self, *, confidences: Tensor | None, num_drafts: Tensor) -> Tensor:
        values = _check(self.name, confidences, num_drafts, need=True)
        passing = (values >= self.threshold).to(torch.long).cumprod(dim=1)  # 1 up to the first failure
        return _cap(passing.sum(dim=1), num_drafts)

    def reset(self) -> None:
        pass


def _require_sps(name: str, sps: SPSTable | None) -> None:
    if sps is None:
        raise ValueError(f"{POLICY_KEY}={name} needs the SPS(B) table of the batched target forward; it is profiled "
                         "by stage=serve (or choose serve.policy=mtp1/static/fixed/threshold)")


@dataclass
class SchedulerPolicy:
    """Algorithm 1 over all R requests with the early stop."""

    sps: SPSTable | None
    name = "scheduler"
    needs_confidences = True

    def __post_init__(self) -> None:
        _require_sps(self.name, self.sps)

    def choose(self, *, confidences: Tensor | None, num_drafts: Tensor) -> Tensor:
        values = _check(self.name, confidences, num_drafts, need=True)
        if values.numel() == 0:
            return torch.zeros(values.shape[0], dtype=torch.long)
        return _cap(schedule_verification(values, sps=self.sps), num_drafts)

    def reset(self) -> None:
        pass


@dataclass
class AsyncPolicy:
    """Capacity from confidences two steps old, filled by the best current candidates (paper §5.2)."""

    sps: SPSTable | None
    name = "async"
    needs_confidences = True
    _history: deque = field(default_factory=lambda: deque(maxlen=2), repr=False)

    def __post_init__(self) -> None:
        _require_sps(self.name, self.sps)

    def choose(self, *, confidences: Tensor | None, num_drafts: Tensor) -> Tensor:
        values = _check(self.name, confidences, num_drafts, need=True)
        if values.numel() == 0:
            lengths = torch.zeros(values.shape[0], dtype=torch.long)
        elif len(self._history) == 2:
            lengths = async_capacity_schedule(self._history[0], values, sps=self.sps)
        else:  # no stale confidences yet: the synchronous scheduler is the safe fallback
            lengths = schedule_verification(values, sps=self.sps)
        self._history.append(values)
        return _cap(lengths, num_drafts)

    def reset(self) -> None:
        self._history.clear()


SERVE_POLICIES: Registry = Registry(POLICY_KEY)
SERVE_POLICIES.add("mtp1", lambda *, static_k, threshold, sps: StaticPolicy(1, name="mtp1"))
SERVE_POLICIES.add("static", lambda *, static_k, threshold, sps: StaticPolicy(static_k, name="static"))
SERVE_POLICIES.add("fixed", lambda *, static_k, threshold, sps: StaticPolicy(None, name="fixed"))
SERVE_POLICIES.add("threshold", lambda *, static_k, threshold, sps: ThresholdPolicy(threshold))
SERVE_POLICIES.add("scheduler", lambda *, static_k, threshold, sps: SchedulerPolicy(sps))
SERVE_POLICIES.add("async", lambda *, static_k, threshold, sps: AsyncPolicy(sps))


def build_serve_policy(name: str, *, static_k: int = 2, threshold: float = 0.5,
                       sps: SPSTable | None = None) -> ServePolicy:
    """The policy named by `serve.policy` (unknown names list the valid ones)."""
    return SERVE_POLICIES.resolve(name)(static_k=static_k, threshold=threshold, sps=sps)
