"""Calibration of the drafter's confidence head: Sequential Temperature Scaling (METHOD §6)."""

from dspark.calibration.sts import (
    CalibrationMetrics,
    ReliabilityCurves,
    STSCalibration,
    auroc,
    brier,
    calibration_metrics,
    default_grid,
    ece_cumulative,
    fit_sts,
    plot_reliability,
    reliability_curves,
    scale_confidence,
)

__all__ = [
    "CalibrationMetrics",
    "ReliabilityCurves",
    "STSCalibration",
    "auroc",
    "brier",
    "calibration_metrics",
    "default_grid",
    "ece_cumulative",
    "fit_sts",
    "plot_reliability",
    "reliability_curves",
    "scale_confidence",
]
