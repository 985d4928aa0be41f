"""Lossless speculative decoding (METHOD §5): the one verifier (`verify`), the engine and truncation policies."""
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.policies import (
    POLICIES,
    FixedPolicy,
    SchedulerPolicy,
    ThresholdPolicy,
    VerificationPolicy,
    build_policy,
    calibrate_confidences,
)
from dspark.decoding.proposers import DSparkProposer, Eagle3Proposer, Proposal, Proposer, build_proposer
from dspark.decoding.records import GenerationResult, RoundRecord

__all__ = [
    "POLICIES",
    "DSparkProposer",
    "Eagle3Proposer",
    "FixedPolicy",
    "GenerationResult",
    "Proposal",
    "Proposer",
    "RoundRecord",
    "SchedulerPolicy",
    "SpeculativeEngine",
    "ThresholdPolicy",
    "VerificationPolicy",
    "build_policy",
    "build_proposer",
    "calibrate_confidences",
]
