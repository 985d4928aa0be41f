"""What the batched serving engine records: one `ServeRound` per request per engine step, one `ServeStep` per step,
one `RequestResult` per finished request (METHOD §6–§7). The simulator replays these records.

Terms as in `dspark.decoding.records`: a round drafts γ' ≤ γ tokens for a request, verifies ℓ of them, accepts A and
commits τ = A + 1 (τ = A when an accepted draft is a stop id). `accept_if_all` is the number of leading drafts the
verifier accepted when *every* draft was verified (policy `fixed`): with that coupling, verifying only ℓ drafts
accepts exactly min(accept_if_all, ℓ), which is what the simulator needs to replay any policy (None when the step
verified fewer than γ' drafts for this request, so the full outcome is unknown).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class ServeRound:
    """One request's part of one engine step."""

    request_id: int
    step: int  # engine step index (0-based)
    anchor_position: int  # p of the anchor x_0
    num_drafted: int  # γ' (drafting stops after a drafted stop id)
    confidences: list[float] | None  # raw c_k of the drafted slots; None without a confidence head
    calibrated: list[float] | None  # STS c̃_k (what the policy read) when the engine has a calibration
    num_verified: int  # ℓ_eff
    num_accepted: int  # A
    committed: int  # τ
    accept_if_all: int | None = None  # A when ℓ_eff == γ' (see module docstring), else None


@dataclass
class ServeStep:
    """One engine step over the R active requests: one drafter forward, one target forward."""

    step: int
    num_active: int  # R
    batch_tokens: int  # B = Σ_r (1 + ℓ_r), tokens in the verify forward
    committed: int  # Σ_r τ_r
    seconds_draft: float  # drafter forward + sequential loop for all requests
    seconds_verify: float  # the one target forward and its logits
    seconds_other: float  # policy, verifier (p_t rows, sampling), rollback, context updates, joins, leaves
    seconds_prefill: float = 0.0  # prefill of requests that joined at this step (part of the step's wall time)
    seconds_draft_sequential: float = 0.0  # the sequential head's loop, part of seconds_draft (Fig. 4 right at R)
    # parts of seconds_other, so that its Python bookkeeping can be read apart (the single-request engine counts
    # the first in its verify time and the second in its drafting time):
    seconds_verify_rows: float = 0.0  # per-row verification (p_t rows, rejection sampling) and commit
    seconds_extend: float = 0.0  # the target KV store keeping the accepted columns + the drafter's context update
    rounds: list[ServeRound] = field(default_factory=list)

    @property
    def seconds_bookkeeping(self) -> float:
        """seconds_other less per-row verification and the context updates: policy, block assembly, leaves, KV
        compaction — the batched engine's Python overhead per step."""
        return max(0.0, self.seconds_other - self.seconds_verify_rows - self.seconds_extend)

    @property
    def seconds(self) -> float:
        return self.seconds_draft + self.seconds_verify + self.seconds_other + self.seconds_prefill

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ServeStep":
        rounds = [ServeRound(**r) for r in data.get("rounds", [])]
        return cls(**{**data, "rounds": rounds})


@dataclass
class RequestResult:
    """One finished (or rejected) request."""

    request_id: int
    prompt_ids: list[int]
    new_tokens: list[int]
    stop_reason: str  # "eos" | "max_new_tokens" | "rejected"
    error: str | None  # why a request was rejected (e.g. prompt longer than the context)
    joined_at: float  # seconds since the engine started serving
    finished_at: float
    num_rounds: int
    domain: str = ""  # the prompt's domain (math, code, chat) when known

    @property
    def latency(self) -> float:
        return self.finished_at - self.joined_at

    @property
    def tokens_per_second(self) -> float:
        """This user's speed: new tokens over its time in the system (NaN for a rejected request)."""
        return len(self.new_tokens) / self.latency if self.latency > 0 and self.new_tokens else float("nan")


@dataclass
class ServeSummary:
    """Aggregate load metrics of one serving run (real engine or simulator), the unit of the frontier (paper §7)."""

    policy: str
    concurrency: int  # R, requests kept active (closed loop)
    throughput: float  # Σ new tokens of finished requests / wall seconds (tokens/s)
    user_speed: float  # mean over finished requests of new tokens / latency (tokens/s/user)
    budget: float  # mean ℓ per request per step (drafts verified)
    tau: float  # Σ τ / #rounds (pooled acceptance length)
    num_requests: int  # finished requests (rejected ones excluded)
    num_steps: int
    wall_seconds: float
    simulated: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def summarize_serving(
    requests: list[RequestResult],
    steps: list[ServeStep],
    *,
    wall_seconds: float,
    policy: str,
    concurrency: int,
    simulated: bool = False,
) -> ServeSummary:
    """The `ServeSummary` of a run: definitions in its field comments (NaN where nothing finished)."""
    finished = [r for r in requests if r.stop_reason != "rejected"]
    rounds = [round_ for step in steps for round_ in step.rounds]
    tokens = sum(len(r.new_tokens) for r in finished)
    speeds = [r.tokens_per_second for r in finished if r.latency > 0 and r.new_tokens]
    nan = float("nan")
    return ServeSummary(
        policy=policy,
        concurrency=int(concurrency),
        throughput=tokens / wall_seconds if wall_seconds > 0 and finished else nan,
        user_speed=sum(speeds) / len(speeds) if speeds else nan,
        budget=sum(r.num_verified for r in rounds) / len(rounds) if rounds else nan,
        tau=sum(r.committed for r in rounds) / len(rounds) if rounds else nan,
        num_requests=len(finished),
        num_steps=len(steps),
        wall_seconds=float(wall_seconds),
        simulated=simulated,
    )
