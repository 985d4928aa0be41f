"""How many drafts to verify per round: fixed, threshold and the hardware-aware scheduler (METHOD §6).

A policy maps the raw per-slot confidences c_1..c_γ' of one proposal to ℓ ∈ [0, γ']. Losslessness (METHOD §5)
needs the decision "verify slot k" to depend only on what was known before x_k was sampled, i.e. on c_1..c_k
(c_k depends on x_<k, never on x_k). All three policies here are prefix rules of that kind:

    fixed       ℓ = γ'
    threshold   ℓ = number of slots before the first raw c_k < θ (not cumulative, not calibrated; ℓ = 0 allowed)
    scheduler   Algorithm 1 for R = 1 request with the early stop, on calibrated c̃_k (raw c_k without a
                calibration): admit slot j while Θ_j = (1 + Σ_{i≤j} a_i)·SPS(1 + j) improves, a_j = Π_{i≤j} c̃_i

The threshold policy also offers `stop_drafting(c_1..c_k)`: slot k will not be verified whatever comes later,
so the proposer stops before sampling x_k (the rule gives the same ℓ on the shorter proposal). The scheduler
has none on purpose: re-running Algorithm 1 per slot costs more than the sampling it would save.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from dspark.calibration.sts import STSCalibration
from dspark.registry import Registry
from dspark.scheduling.scheduler import schedule_verification
from dspark.scheduling.sps import SPSTable

POLICY_KEY = "decode.policy"


class VerificationPolicy(Protocol):
    """Chooses ℓ from a proposal's raw confidences [γ'] (None for drafters without a confidence head)."""

    name: str
    needs_confidences: bool

    def choose(self, *, confidences: Tensor | None, num_drafts: int) -> int: ...


def _require_confidences(policy: str, confidences: Tensor | None, num_drafts: int) -> Tensor:
    if confidences is None:
        raise ValueError(f"{POLICY_KEY}={policy} needs per-slot confidences, but this drafter has no confidence "
                         f"head (dflash, eagle3); use {POLICY_KEY}=fixed or drafter=dspark")
    confidences = confidences.detach().reshape(-1)
    if confidences.numel() != num_drafts:
        raise ValueError(f"{POLICY_KEY}={policy}: got {confidences.numel()} confidences for {num_drafts} drafts")
    return confidences


def calibrate_confidences(calibration: STSCalibration, confidences: Tensor) -> Tensor:
    """c̃ [γ'] from raw c [γ'], γ' ≤ the γ the calibration was fitted for (a short proposal uses T_1..T_γ')."""
    block = len(calibration.temperatures)
    count = confidences.shape[-1]
    if count > block:
        raise ValueError(f"the STS calibration was fitted for block_size={block} but the drafter proposed {count} "
                         "tokens; refit the calibration for this drafter")
    padded = torch.cat([confidences, confidences.new_zeros(block - count)]) if count < block else confidences
    return calibration.apply(padded)[:count]


@dataclass
class FixedPolicy:
    """ℓ = γ': verify every draft (the paper's offline evaluation)."""

    name = "fixed"
    needs_confidences = False

    def choose(self, *, confidences: Tensor | None, num_drafts: int) -> int:
        return num_drafts


@dataclass
class ThresholdPolicy:
    """Verify the prefix before the first raw c_k < θ (diagnostic; METHOD §6)."""

    threshold: float
    name = "threshold"
    needs_confidences = True

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"decode.threshold={self.threshold} must lie in [0, 1] (it is compared with the "
                             "confidence c_k = σ(·)); e.g. decode.threshold=0.5")

    def choose(self, *, confidences: Tensor | None, num_drafts: int) -> int:
        confidences = _require_confidences(self.name, confidences, num_drafts)
        below = torch.nonzero(confidences < self.threshold)
        return int(below[0, 0]) if below.numel() else num_drafts

    def stop_drafting(self, confidences: Tensor) -> bool:
        """confidences [k] = c_1..c_k (known before x_k is sampled) → True when slot k will not be verified."""
        return bool((confidences < self.threshold).any())


@dataclass
class SchedulerPolicy:
    """Algorithm 1 for one request with the early stop (lossless); `calibration` None uses raw c_k."""

    sps: SPSTable | None
    calibration: STSCalibration | None = None
    name = "scheduler"
    needs_confidences = True

    def __post_init__(self) -> None:
        if self.sps is None:
            raise ValueError(f"{POLICY_KEY}=scheduler needs the target's SPS(B) table; run stage=profile first "
                             "(it measures the forward rate per batch size) or choose another decode.policy")

    def choose(self, *, confidences: Tensor | None, num_drafts: int) -> int:
        confidences = _require_confidences(self.name, confidences, num_drafts)
        if num_drafts == 0:
            return 0
        if self.calibration is not None:
            confidences = calibrate_confidences(self.calibration, confidences)
        return int(schedule_verification(confidences.unsqueeze(0), sps=self.sps)[0])


POLICIES: Registry = Registry(POLICY_KEY)
POLICIES.add("fixed", lambda *, threshold, sps, calibration: FixedPolicy())
POLICIES.add("threshold", lambda *, threshold, sps, calibration: ThresholdPolicy(threshold))
POLICIES.add("scheduler", lambda *, threshold, sps, calibration: SchedulerPolicy(sps, calibration))


def build_policy(name: str, *, threshold: float = 0.5, sps: SPSTable | None = None,
                 calibration: STSCalibration | None = None) -> VerificationPolicy:
    """The policy named by `decode.policy` (unknown names list the valid ones)."""
    return POLICIES.resolve(name)(threshold=threshold, sps=sps, calibration=calibration)
