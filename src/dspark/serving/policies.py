"""The serving names of the one policy family (`dspark.decoding.policies`): `serve.policy` reads the same registry
as `decode.policy`, with the same batched contract and the same meaning of every name (`threshold` compares raw
c_k in both; `calibrated_threshold` and `scheduler` read the STS-calibrated c̃_k the engine gives them)."""

from __future__ import annotations

from dspark.decoding.policies import (
    POLICIES,
    AsyncPolicy,
    SchedulerPolicy,
    StaticPolicy,
    ThresholdPolicy,
    VerificationPolicy,
    build_policy,
)
from dspark.scheduling.sps import SPSTable

SERVE_POLICIES = POLICIES
ServePolicy = VerificationPolicy


def build_serve_policy(
    name: str, *, static_k: int = 2, threshold: float = 0.5, sps: SPSTable | None = None, scheduler_cost: str = "tokens"
) -> VerificationPolicy:
    """The policy named by `serve.policy` (errors name the serve.* keys); `scheduler_cost` is serve.scheduler_cost."""
    return build_policy(
        name, static_k=static_k, threshold=threshold, sps=sps, key="serve", scheduler_cost=scheduler_cost
    )


__all__ = [
    "SERVE_POLICIES",
    "AsyncPolicy",
    "SchedulerPolicy",
    "ServePolicy",
    "StaticPolicy",
    "ThresholdPolicy",
    "build_serve_policy",
]
