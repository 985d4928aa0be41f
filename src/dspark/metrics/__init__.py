"""torchmetrics `Metric`s with float64/int64 sum states, exact under DDP (METHOD §8).

- `TeacherForcedAcceptance`, `PositionCrossEntropy`: training-time proxies from teacher-forced blocks.
- `CumulativeCalibration`: ECE / AUROC / Brier of a_k = Π_{i≤k} c_i against the prefix-accept event.
- `RolloutAcceptance`: survival, conditional acceptance, verify rate and pooled τ from decoding rounds.

Every `compute()` returns a dict of float64 scalar tensors keyed by MLflow-safe names (`accept/pos3`, `tau`).
"""

from dspark.metrics.acceptance import PositionCrossEntropy, TeacherForcedAcceptance
from dspark.metrics.calibration import (
    CumulativeCalibration,
    ReliabilityBins,
    binned_auroc,
    cumulative_confidence,
    reliability_bins,
    rollout_prefix_events,
    soft_prefix_events,
)
from dspark.metrics.rollout import RolloutAcceptance

__all__ = [
    "CumulativeCalibration",
    "PositionCrossEntropy",
    "ReliabilityBins",
    "RolloutAcceptance",
    "TeacherForcedAcceptance",
    "binned_auroc",
    "cumulative_confidence",
    "reliability_bins",
    "rollout_prefix_events",
    "soft_prefix_events",
]
