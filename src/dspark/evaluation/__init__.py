"""Evaluation: decoding rollouts → metrics, reports, calibration and timing diagnostics (METHOD §5, §6, §8).

The engine-dependent pieces (`run_rollouts`, `collect_calibration_rounds`, `latency_breakdown`)
import `dspark.decoding` lazily, so summaries and plots work from saved round records alone.
"""

from dspark.evaluation.calibrate import (
    CalibrationReport,
    CalibrationRounds,
    calibrate_drafter,
    calibration_key,
    collect_calibration_rounds,
    fit_calibration,
    rounds_to_arrays,
)
from dspark.evaluation.diagnostics import latency_breakdown, load_or_profile_sps
from dspark.evaluation.plots import plot_conditional_acceptance, plot_latency_breakdown, plot_threshold_sweep
from dspark.evaluation.rollouts import (
    EvalPrompt,
    PromptRollout,
    encode_prompts,
    read_rollouts_jsonl,
    run_rollouts,
    write_rollouts_jsonl,
)
from dspark.evaluation.summary import EvalSummary, flatten_metrics, summarize
from dspark.intervals import mean_ci

__all__ = [
    "CalibrationReport",
    "CalibrationRounds",
    "EvalPrompt",
    "EvalSummary",
    "PromptRollout",
    "calibrate_drafter",
    "calibration_key",
    "collect_calibration_rounds",
    "encode_prompts",
    "fit_calibration",
    "flatten_metrics",
    "latency_breakdown",
    "load_or_profile_sps",
    "mean_ci",
    "plot_conditional_acceptance",
    "plot_latency_breakdown",
    "plot_threshold_sweep",
    "read_rollouts_jsonl",
    "rounds_to_arrays",
    "run_rollouts",
    "summarize",
    "write_rollouts_jsonl",
]
