"""How many drafts to verify: the hardware-aware prefix scheduler (Algorithm 1) and SPS(B) profiling (METHOD §6)."""
from dspark.scheduling.scheduler import (
    SchedulePlan,
    admit_top_k,
    async_capacity_schedule,
    drafting_done,
    expected_throughput,
    plan_verification,
    schedule_verification,
    sorted_candidates,
)
from dspark.scheduling.sps import SPSTable, machine_fingerprint, profile_sps

__all__ = [
    "SPSTable",
    "SchedulePlan",
    "admit_top_k",
    "async_capacity_schedule",
    "drafting_done",
    "expected_throughput",
    "machine_fingerprint",
    "plan_verification",
    "profile_sps",
    "schedule_verification",
    "sorted_candidates",
]
