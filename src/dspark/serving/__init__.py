"""Serving under load (METHOD §5–§7, paper §5.2, §7): continuous batching of R requests with one drafter and one
target forward per step (`engine`), the target's batched KV store with holes (`kv`), batched DSpark/DFlash
drafting (`proposer`), per-request verification lengths (`policies`) and the records a simulator replays
(`records`)."""

from dspark.serving.engine import BatchedEngine, ServeRequest, ServeResult, request_generator
from dspark.serving.kv import (
    BatchedKVCache,
    KVBudget,
    Prefill,
    available_memory_bytes,
    check_concurrency,
    kv_budget,
    prefill,
)
from dspark.serving.policies import (
    SERVE_POLICIES,
    AsyncPolicy,
    SchedulerPolicy,
    ServePolicy,
    StaticPolicy,
    ThresholdPolicy,
    build_serve_policy,
)
from dspark.serving.proposer import BatchedDSparkProposer, BatchProposal, check_serving_drafter
from dspark.serving.records import RequestResult, ServeRound, ServeStep, ServeSummary, summarize_serving

__all__ = [
    "SERVE_POLICIES",
    "AsyncPolicy",
    "BatchProposal",
    "BatchedDSparkProposer",
    "BatchedEngine",
    "BatchedKVCache",
    "KVBudget",
    "Prefill",
    "RequestResult",
    "SchedulerPolicy",
    "ServePolicy",
    "ServeRequest",
    "ServeResult",
    "ServeRound",
    "ServeStep",
    "ServeSummary",
    "StaticPolicy",
    "ThresholdPolicy",
    "available_memory_bytes",
    "build_serve_policy",
    "check_concurrency",
    "check_serving_drafter",
    "kv_budget",
    "prefill",
    "request_generator",
    "summarize_serving",
]
