"""How many drafts to verify: the hardware-aware prefix scheduler (Algorithm 1) and SPS(B) profiling (METHOD §6)."""

from dspark.scheduling.scheduler import (
    ColumnPlan,
    SchedulePlan,
    admit_top_k,
    async_capacity_schedule,
    columns_drafting_done,
    drafting_done,
    expected_throughput,
    plan_columns,
    plan_verification,
    schedule_verification,
    sorted_candidates,
)
from dspark.scheduling.sps import SPSTable, machine_fingerprint, profile_sps

__all__ = [
    "ColumnPlan",
    "SPSTable",
    "SchedulePlan",
    "admit_top_k",
    "async_capacity_schedule",
    "columns_drafting_done",
    "drafting_done",
    "expected_throughput",
    "machine_fingerprint",
    "plan_columns",
    "plan_verification",
    "profile_sps",
    "schedule_verification",
    "sorted_candidates",
]
