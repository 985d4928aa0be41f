"""Lossless speculative decoding (METHOD §5): the one verifier (`verify`), the single-request engine, the proposers,
the one policy family shared with serving (`policies`) and what both engines share (`shared`, `drafting`)."""

from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.policies import (
    POLICIES,
    AsyncPolicy,
    SchedulerPolicy,
    StaticPolicy,
    ThresholdPolicy,
    VerificationPolicy,
    build_policy,
    calibrate_confidences,
    policy_confidences,
)
from dspark.decoding.proposers import DSparkProposer, Eagle3Proposer, Proposal, Proposer, build_proposer
from dspark.decoding.records import GenerationResult, RoundRecord

__all__ = [
    "POLICIES",
    "AsyncPolicy",
    "DSparkProposer",
    "Eagle3Proposer",
    "GenerationResult",
    "Proposal",
    "Proposer",
    "RoundRecord",
    "SchedulerPolicy",
    "SpeculativeEngine",
    "StaticPolicy",
    "ThresholdPolicy",
    "VerificationPolicy",
    "build_policy",
    "build_proposer",
    "calibrate_confidences",
    "policy_confidences",
]
