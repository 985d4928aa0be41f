"""Serving's SPS(B) profile: the one cached profile of the verify forward lives in `dspark.scheduling.profile`
(shared with the single-request engine's scheduler, which uses its R = 1 case)."""
from dspark.scheduling.profile import (
    SERVING_CONTEXT_TOKENS,
    load_or_profile_serving_sps,
    load_sps_table,
    monotone_table,
    profile_serving_sps,
    serving_batch_grid,
    serving_sps_path,
    sps_milliseconds,
)

__all__ = ["SERVING_CONTEXT_TOKENS", "load_or_profile_serving_sps", "load_sps_table", "monotone_table",
           "profile_serving_sps", "serving_batch_grid", "serving_sps_path", "sps_milliseconds"]
