"""Trace-replay simulator of the batched serving engine: the throughput–interactivity frontier at concurrency
levels the machine cannot run (METHOD §6–§7, paper §5.4 Fig. 7/8).

Trace. The rounds the real engine recorded under policy `fixed` (every drafted slot verified), grouped by request
in step order (`trace_from_steps`). For each round it keeps the drafted count γ', the (raw and calibrated)
confidences the policy would read, `accept_if_all` = A_all and the committed count τ_all.

Replay at concurrency R (closed loop). R slots; whenever one is free the next simulated request joins (its prefill
gives its first token, as in the engine) and walks through one recorded request's rounds (requests taken in a
seeded permutation of the trace, cycling), wrapping its round sequence if it needs more tokens than were
recorded. A simulated request lasts `max_new_tokens` new tokens (None: as many as its recorded request produced).
Each step the policy picks ℓ_r from the recorded confidences of the R current rounds, and

    accepted_r  = min(A_all, ℓ_r)
    committed_r = τ_all if accepted_r == A_all else accepted_r + 1

which is exact under the rejection sampler's coupling: whether slot k is accepted depends only on slots ≤ k, so
verifying fewer drafts only truncates the outcome (τ_all = A_all when an accepted draft was a stop id; that can
only be the last drafted slot). The step takes

    seconds = 1 / SPS(B) + draft(R, K) + other(R) + joins · prefill,   B = Σ_r (1 + ℓ_r)

where K is the number of slots the proposer draws at that step, as the engine's lean step does: γ, or fewer when
the policy's `max_drafts` or `stop_drafting` ends drafting early (replayed on the recorded confidences), and
draft(R, K) = parallel(R) + K · per_slot(R) (the sequential loop costs per drawn slot; `StepCosts`).

with SPS from any `SPSTable` (e.g. one profiled on the machine being modelled, `serving.profile`) and the other
costs fitted from the real engine's `ServeStep` timings (`fit_step_costs`) or given by hand. Requests finish at the
end of the step that brings them to their length. The output has the real engine's record types, so
`summarize_serving(..., simulated=True)` applies (`SimResult.summary`). Deterministic for a seed.

B = Σ_r (1 + ℓ_r) is the cost of an engine that packs the verify tokens without padding (paper §5.3). The
`BatchedEngine` of this package right-pads every row to max_r ℓ_r + 1 tokens, and the profiled table's entry at
R·q is exactly an R-row forward of q tokens per row (`serving.profile`), so `pad_to_longest=True` times its steps
at SPS(R·(max_r ℓ_r + 1)) instead; `ServeStep.batch_tokens` stays B either way. A scheduler built here by name plans
with `scheduler_cost` (serve.scheduler_cost), as the engine's does: "columns" prices exactly that padded forward.

Hindsight (`simulate_hindsight`, `benchmarks/serving_headroom.py`): the same replay with a chooser that knows each
round's outcome, so its speed bounds what any verify-length policy could reach on the trace at that R — where it
falls short of a target, the drafter must improve before any policy can meet it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import torch

from dspark.scheduling.sps import SPSTable
from dspark.serving.policies import ServePolicy, build_serve_policy
from dspark.serving.records import RequestResult, ServeRound, ServeStep, ServeSummary, summarize_serving

TRACE_KEY = "serve.policy"


@dataclass(frozen=True)
class TraceRound:
    """One recorded round with every drafted slot verified."""

    num_drafted: int  # γ'
    accept_if_all: int  # A_all
    committed_if_all: int  # τ_all (A_all + 1, or A_all when an accepted draft was a stop id)
    confidences: tuple[float, ...] | None  # raw c_k of the drafted slots
    calibrated: tuple[float, ...] | None  # STS c̃_k of the drafted slots

    def outcome(self, verified: int) -> tuple[int, int]:
        """(accepted, committed) when only the first `verified` drafts are verified (module docstring)."""
        accepted = min(self.accept_if_all, max(0, int(verified)))
        return accepted, self.committed_if_all if accepted == self.accept_if_all else accepted + 1


@dataclass
class TraceRequest:
    """One recorded request's rounds in step order."""

    request_id: int
    rounds: list[TraceRound]

    @property
    def num_tokens(self) -> int:
        """New tokens it produced: the prefill's first token plus Σ τ_all."""
        return 1 + sum(r.committed_if_all for r in self.rounds)


@dataclass
class ServeTrace:
    """Recorded requests (each with at least one round) and the block size γ = the largest γ' seen."""

    requests: list[TraceRequest]

    @property
    def block_size(self) -> int:
        return max(r.num_drafted for q in self.requests for r in q.rounds)

    @property
    def rounds(self) -> list[TraceRound]:
        return [r for q in self.requests for r in q.rounds]

    @property
    def tau(self) -> float:
        """Pooled τ = Σ τ_all / #rounds of the trace (what `fixed` replays exactly)."""
        rounds = self.rounds
        return sum(r.committed_if_all for r in rounds) / len(rounds)

    def has(self, source: str) -> bool:
        """Whether every round carries `source` ("confidences" or "calibrated")."""
        return all(getattr(r, source) is not None for r in self.rounds)


def trace_from_steps(steps: Sequence[ServeStep]) -> ServeTrace:
    """The replayable trace of one run: rounds with `accept_if_all` set, grouped by request id in step order."""
    grouped: dict[int, list[tuple[int, ServeRound]]] = defaultdict(list)
    seen: set[tuple[int, int]] = set()
    for step in steps:
        for round_ in step.rounds:
            if (round_.request_id, round_.step) in seen:
                raise ValueError(
                    f"request {round_.request_id} has two rounds at step {round_.step}: these steps "
                    "come from several runs; build one trace per run's steps"
                )
            seen.add((round_.request_id, round_.step))
            if round_.accept_if_all is not None:
                grouped[round_.request_id].append((round_.step, round_))
    if not grouped:
        raise ValueError(
            f"no recorded round has accept_if_all: record the trace with {TRACE_KEY}=fixed (every draft "
            "verified), so that any shorter verification can be replayed from it"
        )
    requests = [
        TraceRequest(rid, [_trace_round(r) for _, r in sorted(rounds, key=lambda item: item[0])])
        for rid, rounds in sorted(grouped.items())
    ]
    return ServeTrace(requests)


def _trace_round(round_: ServeRound) -> TraceRound:
    drafted, accepted = int(round_.num_drafted), int(round_.accept_if_all)
    if not 0 <= accepted <= drafted or round_.committed not in (accepted, accepted + 1):
        raise ValueError(
            f"request {round_.request_id} step {round_.step}: accept_if_all={accepted}, "
            f"num_drafted={drafted}, committed={round_.committed} are inconsistent (need 0 <= A <= γ' "
            "and τ in {A, A+1}); was the trace recorded with serve.policy=fixed?"
        )

    def cut(values: list[float] | None) -> tuple[float, ...] | None:
        return None if values is None else tuple(float(v) for v in values[:drafted])

    return TraceRound(drafted, accepted, int(round_.committed), cut(round_.confidences), cut(round_.calibrated))


# ---- step costs besides the verify forward ----


@dataclass
class StepCosts:
    """Seconds per engine step outside the verify forward, linear in the number of active requests R."""

    draft_intercept: float = 0.0  # drafter forward + sequential loop at the trace's slots: a + b·R
    draft_per_request: float = 0.0
    other_intercept: float = 0.0  # policy, verifier, rollback, context updates: a + b·R
    other_per_request: float = 0.0
    prefill_per_request: float = 0.0  # prefill of one joining request
    slot_intercept: float = 0.0  # the sequential loop per drawn slot: a + b·R (0 and 0: drafting is not
    slot_per_request: float = 0.0  #   split, draft_seconds is the same whatever the slots)
    trace_slots: float = 0.0  # mean slots drawn per step in the fitted trace

    def draft_seconds(self, num_active: int, slots: int | None = None) -> float:
        """Drafting seconds of a step with R = num_active rows drawing `slots` slots (None: as in the trace)."""
        total = max(0.0, self.draft_intercept + self.draft_per_request * num_active)
        if slots is None:
            return total
        return max(0.0, total + (slots - self.trace_slots) * self.slot_seconds(num_active))

    def slot_seconds(self, num_active: int) -> float:
        return max(0.0, self.slot_intercept + self.slot_per_request * num_active)

    def other_seconds(self, num_active: int) -> float:
        return max(0.0, self.other_intercept + self.other_per_request * num_active)

    def to_dict(self) -> dict:
        return asdict(self)


def _linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope); slope 0 when every x is the same."""
    if not xs:
        return 0.0, 0.0
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return mean_y, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
    return mean_y - slope * mean_x, slope


def fit_step_costs(steps: Sequence[ServeStep]) -> StepCosts:
    """Fit `StepCosts` to the real engine's steps (any mix of runs and concurrency levels).

    Draft and other seconds: least squares on R = num_active (one R only → a constant). Prefill: total prefill
    seconds over the number of joins (a request joins at the step where its id first appears after a step
    without it).
    """
    steps = [s for s in steps if s.num_active > 0]
    if not steps:
        raise ValueError(
            "fit_step_costs: no engine step with active requests; run the serving engine first "
            "(stage=serve) or give StepCosts by hand"
        )
    active = [float(s.num_active) for s in steps]
    draft = _linear_fit(active, [s.seconds_draft for s in steps])
    other = _linear_fit(active, [s.seconds_other for s in steps])
    slots = [max((r.num_drafted for r in s.rounds), default=0) for s in steps]
    per_slot = _linear_fit(
        [a for a, k in zip(active, slots) if k > 0],
        [s.seconds_draft_sequential / k for s, k in zip(steps, slots) if k > 0],
    )
    joins, previous = 0, set()
    for step in steps:
        ids = {r.request_id for r in step.rounds}
        joins, previous = joins + len(ids - previous), ids
    prefill = sum(s.seconds_prefill for s in steps) / joins if joins else 0.0
    return StepCosts(
        draft_intercept=draft[0],
        draft_per_request=draft[1],
        other_intercept=other[0],
        other_per_request=other[1],
        prefill_per_request=prefill,
        slot_intercept=per_slot[0],
        slot_per_request=per_slot[1],
        trace_slots=sum(slots) / len(slots),
    )


# ---- replay ----


@dataclass
class SimResult:
    """A simulated run in the real engine's records. Token ids and anchor positions are not simulated (zeros and
    -1); counts, ℓ, A, τ and times are."""

    requests: list[RequestResult]
    steps: list[ServeStep]
    wall_seconds: float
    policy: str = ""
    concurrency: int = 0

    def summary(self) -> ServeSummary:
        return summarize_serving(
            self.requests,
            self.steps,
            wall_seconds=self.wall_seconds,
            policy=self.policy,
            concurrency=self.concurrency,
            simulated=True,
        )


@dataclass
class _Active:
    """A simulated request in flight."""

    request_id: int
    source: TraceRequest
    length: int  # new tokens it lasts
    joined_at: float
    tokens: int = 1  # the prefill's first token
    rounds: int = 0

    def next_round(self) -> TraceRound:
        return self.source.rounds[self.rounds % len(self.source.rounds)]


def _confidence_source(trace: ServeTrace, policy: ServePolicy, calibrated: bool | None) -> str | None:
    """Which recorded confidences the policy reads: raw for policies that read raw c_k (`threshold`), else the
    calibrated ones when every round has them (as the engine does: `decoding.policies.policy_confidences`)."""
    if getattr(policy, "reads", "raw") != "calibrated":
        calibrated = False
    elif calibrated is None:
        calibrated = trace.has("calibrated")
    source = "calibrated" if calibrated else "confidences"
    if trace.has(source):
        return source
    if calibrated:
        raise ValueError(
            "simulate_serving(calibrated=True): the trace has rounds without calibrated confidences; "
            "record it with a calibrated drafter or pass calibrated=False"
        )
    if policy.needs_confidences:
        raise ValueError(
            f"{TRACE_KEY}={policy.name} needs confidences, but the trace has rounds without them "
            "(a drafter without a confidence head); simulate mtp1, static or fixed instead"
        )
    return None


def _policy_inputs(rounds: list[TraceRound], *, block_size: int, source: str | None):
    """(confidences [R, γ] float or None, num_drafts [R] long) for one step."""
    num_drafts = torch.tensor([r.num_drafted for r in rounds], dtype=torch.long)
    if source is None:
        return None, num_drafts
    rows = [list(getattr(r, source)) + [0.0] * (block_size - r.num_drafted) for r in rounds]
    return torch.tensor(rows, dtype=torch.float64).reshape(len(rounds), block_size), num_drafts


def simulate_serving(
    trace: ServeTrace,
    *,
    policy: str | ServePolicy,
    concurrency: int,
    sps: SPSTable,
    costs: StepCosts | None = None,
    max_new_tokens: int | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    calibrated: bool | None = None,
    static_k: int = 2,
    threshold: float = 0.5,
    pad_to_longest: bool = False,
    scheduler_cost: str = "tokens",
) -> SimResult:
    """Replay `trace` at concurrency R under `policy` (module docstring).

    policy: a `ServePolicy` (it keeps its own SPS table, if any; `sps` still times the steps) or its name (built
    with `sps`, `static_k`, `threshold` and `scheduler_cost`, serve.scheduler_cost). num_requests: simulated requests
    (default: the smallest multiple of the trace's request count that is >= 4R, so every recorded request is
    replayed equally often). calibrated: which recorded confidences the policy reads (None: calibrated when every
    round has them, else raw).
    pad_to_longest: time the verify forward as R rows of max ℓ_r + 1 tokens (module docstring).
    """
    count = len(trace.requests)
    total = num_requests if num_requests is not None else count * math.ceil(4 * concurrency / count)
    if concurrency < 1 or total < 1:
        raise ValueError(f"serve.concurrency={concurrency} and num_requests={total} must be >= 1")
    if max_new_tokens is not None and max_new_tokens < 2:
        raise ValueError(
            f"serve.max_new_tokens={max_new_tokens} must be >= 2 to simulate rounds (the first token "
            "comes from the prefill)"
        )
    if isinstance(policy, str):
        policy = build_serve_policy(
            policy, static_k=static_k, threshold=threshold, sps=sps, scheduler_cost=scheduler_cost
        )
    costs = costs if costs is not None else StepCosts()
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    queue = [trace.requests[order[i % count]] for i in range(total)]
    source, block_size = _confidence_source(trace, policy, calibrated), trace.block_size
    policy.reset()
    slots: list[_Active | None] = [None] * concurrency
    requests: list[RequestResult] = []
    steps: list[ServeStep] = []
    clock = 0.0
    while True:
        joins = _join(
            slots,
            queue=queue,
            started=len(requests) + sum(a is not None for a in slots),
            max_new_tokens=max_new_tokens,
            clock=clock,
        )
        active = [a for a in slots if a is not None]
        if not active:
            break
        steps.append(
            _step(
                active,
                policy=policy,
                sps=sps,
                costs=costs,
                joins=joins,
                index=len(steps),
                block_size=block_size,
                source=source,
                pad_to_longest=pad_to_longest,
            )
        )
        clock += steps[-1].seconds
        requests += _leave(slots, clock=clock)
    return SimResult(requests, steps, clock, policy=policy.name, concurrency=concurrency)


def _join(
    slots: list[_Active | None], *, queue: list[TraceRequest], started: int, max_new_tokens: int | None, clock: float
) -> int:
    """Fill free slots with the next queued requests (closed loop); returns how many joined."""
    joins = 0
    for index, item in enumerate(slots):
        if item is None and started < len(queue):
            recorded = queue[started]
            length = recorded.num_tokens if max_new_tokens is None else max_new_tokens
            slots[index] = _Active(started, recorded, length, joined_at=clock)
            started, joins = started + 1, joins + 1
    return joins


def _leave(slots: list[_Active | None], *, clock: float) -> list[RequestResult]:
    """Free the slots of requests that reached their length at the end of this step."""
    finished = []
    for index, item in enumerate(slots):
        if item is not None and item.tokens >= item.length:
            finished.append(
                RequestResult(
                    item.request_id,
                    [],
                    [0] * item.length,
                    "max_new_tokens",
                    None,
                    joined_at=item.joined_at,
                    finished_at=clock,
                    num_rounds=item.rounds,
                )
            )
            slots[index] = None
    return finished


def _step(
    active: list[_Active],
    *,
    policy: ServePolicy,
    sps: SPSTable,
    costs: StepCosts,
    joins: int,
    index: int,
    block_size: int,
    source: str | None,
    pad_to_longest: bool,
) -> ServeStep:
    """One engine step over the active requests: choose ℓ, apply the coupling, advance them, time it."""
    rounds = [a.next_round() for a in active]
    confidences, num_drafts = _policy_inputs(rounds, block_size=block_size, source=source)
    if isinstance(policy, HindsightChooser):  # sees the outcomes: draws exactly the columns it verifies
        slots = policy.columns_for(active)
    else:
        slots = drawn_slots(policy, confidences, num_drafts, block_size=block_size)
    num_drafts = num_drafts.clamp(max=slots)  # what the lean proposer would have drawn
    lengths = policy.choose(confidences=confidences, num_drafts=num_drafts).tolist()
    records = []
    for item, round_, verified, drafted in zip(active, rounds, lengths, num_drafts.tolist()):
        accepted, committed = round_.outcome(verified)
        cut = drafted < round_.num_drafted
        records.append(
            ServeRound(
                item.request_id,
                index,
                anchor_position=-1,
                num_drafted=drafted,
                confidences=_cut(round_.confidences, drafted),
                calibrated=_cut(round_.calibrated, drafted),
                num_verified=int(verified),
                num_accepted=accepted,
                committed=committed,
                accept_if_all=round_.accept_if_all if verified == drafted and not cut else None,
            )
        )
        item.tokens, item.rounds = item.tokens + committed, item.rounds + 1
    batch_tokens = len(active) + sum(int(v) for v in lengths)
    forward_tokens = len(active) * (1 + max(int(v) for v in lengths)) if pad_to_longest else batch_tokens
    return ServeStep(
        step=index,
        num_active=len(active),
        batch_tokens=batch_tokens,
        committed=sum(r.committed for r in records),
        seconds_draft=costs.draft_seconds(len(active), slots),
        seconds_verify=1.0 / sps(forward_tokens),
        seconds_other=costs.other_seconds(len(active)),
        seconds_prefill=joins * costs.prefill_per_request,
        seconds_draft_sequential=slots * costs.slot_seconds(len(active)),
        rounds=records,
    )


# ---- the hindsight bound ----

HINDSIGHT = "hindsight"


class HindsightChooser:
    """A simulator-only chooser that sees every round's outcome (A_all) and every request's remaining length: not a
    `VerificationPolicy`, no engine can run it. Each step it verifies k columns, every row min(k, γ'_r) drafts, and
    draws only those k slots. One mode per instance:

    - `columns`: k fixed (a static policy drawn the hindsight way);
    - `rate`: k maximises useful tokens(k) − rate·seconds(k), tokens past a request's length counting nothing
      (ties: the smaller k); `simulate_hindsight` searches the rate;
    - `exact` (R = 1 only): each request follows the plan that reaches its length in the least time, found by
      dynamic programming over (rounds used, tokens) — at R = 1 requests never share a step, so this is optimal.
    """

    needs_confidences = False
    reads = "raw"
    max_drafts = None

    def __init__(
        self,
        *,
        sps: SPSTable,
        costs: StepCosts,
        pad_to_longest: bool,
        rate: float | None = None,
        columns: int | None = None,
        exact: bool = False,
    ) -> None:
        if sum((rate is not None, columns is not None, bool(exact))) != 1:
            raise ValueError(
                "HindsightChooser: give exactly one of rate (tokens per second), columns (a fixed k) "
                "or exact=True (R = 1)"
            )
        self.sps, self.costs, self.pad = sps, costs, bool(pad_to_longest)
        self.rate, self.columns, self.exact = rate, columns, bool(exact)
        self.name = HINDSIGHT if columns is None else f"{HINDSIGHT}-k{columns}"
        self._chosen = 0
        self._plans: dict[int, tuple[int, list[int]]] = {}  # request id → (first round, k per step)

    def reset(self) -> None:
        self._chosen = 0
        self._plans = {}

    def step_value(
        self, rounds: Sequence[TraceRound], k: int, remaining: Sequence[int] | None = None
    ) -> tuple[int, float]:
        """(tokens, seconds besides prefill) of a step over `rounds` verifying k columns; with `remaining`, tokens
        past each request's remaining length are not counted."""
        rows, longest = len(rounds), max(r.num_drafted for r in rounds)
        verified = [min(k, r.num_drafted) for r in rounds]
        gained = [r.outcome(v)[1] for r, v in zip(rounds, verified)]
        if remaining is not None:
            gained = [min(g, max(0, int(left))) for g, left in zip(gained, remaining)]
        forward = rows * (1 + max(verified)) if self.pad else rows + sum(verified)
        seconds = (
            1.0 / self.sps(forward) + self.costs.draft_seconds(rows, min(k, longest)) + self.costs.other_seconds(rows)
        )
        return sum(gained), seconds

    def columns_for(self, active: Sequence[_Active]) -> int:
        """k for this step over the `active` requests (kept for `choose`, which the step calls next)."""
        rounds = [a.next_round() for a in active]
        longest = max(r.num_drafted for r in rounds)
        if self.columns is not None:
            self._chosen = min(int(self.columns), longest)
        elif self.exact:
            if len(active) != 1:
                raise ValueError("HindsightChooser(exact=True) plans one request at a time: use it at R = 1")
            item = active[0]
            if item.request_id not in self._plans:
                self._plans[item.request_id] = (
                    item.rounds,
                    self.plan(item.source.rounds, start=item.rounds, tokens=item.tokens, length=item.length),
                )
            start, plan = self._plans[item.request_id]
            self._chosen = min(plan[item.rounds - start], longest)
        else:
            remaining = [a.length - a.tokens for a in active]
            values = [self.step_value(rounds, k, remaining) for k in range(longest + 1)]
            self._chosen = max(range(longest + 1), key=lambda k: (values[k][0] - self.rate * values[k][1], -k))
        return self._chosen

    def plan(self, rounds: Sequence[TraceRound], *, start: int, tokens: int, length: int) -> list[int]:
        """The k per step that takes one request from `tokens` to `length` tokens in the least time, walking
        `rounds` (cycled) from round `start` (dynamic programming over (steps taken, tokens so far))."""
        frontier: dict[int, tuple[float, list[int]]] = {tokens: (0.0, [])}  # tokens → (least seconds, its plan)
        finished: tuple[float, list[int]] | None = None
        step = 0
        while frontier:
            round_ = rounds[(start + step) % len(rounds)]
            values = [self.step_value([round_], k) for k in range(round_.num_drafted + 1)]  # the same for every state
            following: dict[int, tuple[float, list[int]]] = {}
            for have, (seconds, ks) in frontier.items():
                for k, (gained, cost) in enumerate(values):
                    total, reached = seconds + cost, have + gained
                    if reached >= length:
                        if finished is None or total < finished[0]:
                            finished = (total, ks + [k])
                    elif reached not in following or total < following[reached][0]:
                        following[reached] = (total, ks + [k])
            # a partial plan already slower than a finished one cannot win (steps only add time)
            frontier = {t: v for t, v in following.items() if finished is None or v[0] < finished[0]}
            step += 1
        if finished is None:
            raise ValueError(f"HindsightChooser.plan: a request of length {length} cannot finish")
        return finished[1]

    def choose(self, *, confidences, num_drafts) -> torch.Tensor:
        return torch.as_tensor(num_drafts, dtype=torch.long).clamp(max=self._chosen)


def simulate_hindsight(
    trace: ServeTrace,
    *,
    concurrency: int,
    sps: SPSTable,
    costs: StepCosts | None = None,
    max_new_tokens: int | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    pad_to_longest: bool = True,
    iterations: int = 20,
) -> SimResult:
    """The hindsight policy at concurrency R: how fast a verify-length policy that knew every round's outcome could
    serve this trace here — an upper estimate for the scheduler and every causal policy (`HindsightChooser`).

    R = 1: each request follows its fastest plan (exact: requests never share a step). R > 1: each step verifies the
    column count that maximises useful tokens − λ·seconds, λ by Dinkelbach's iteration from the best fixed column
    count k = 0..γ; for a fixed set of steps that is the optimum of Σ tokens / Σ seconds (`evaluation.headroom`),
    but here a choice also moves which rounds share later steps, so R > 1 gives the best such policy found, not a
    proof. The run with the highest throughput is returned, labelled `hindsight`. Steps are timed as
    `simulate_serving` times them (pad_to_longest: R rows of k + 1 tokens, the BatchedEngine's forward).
    """
    costs = costs if costs is not None else StepCosts()
    options = {
        "concurrency": concurrency,
        "sps": sps,
        "costs": costs,
        "max_new_tokens": max_new_tokens,
        "num_requests": num_requests,
        "seed": seed,
        "pad_to_longest": pad_to_longest,
    }
    chooser = {"sps": sps, "costs": costs, "pad_to_longest": pad_to_longest}
    if concurrency == 1:
        best = simulate_serving(trace, policy=HindsightChooser(exact=True, **chooser), **options)
        best.policy = HINDSIGHT
        return best

    def step_rate(result: SimResult) -> float:
        seconds = sum(s.seconds - s.seconds_prefill for s in result.steps)
        return sum(s.committed for s in result.steps) / seconds if seconds > 0 else 0.0

    candidates = [
        simulate_serving(trace, policy=HindsightChooser(columns=k, **chooser), **options)
        for k in range(trace.block_size + 1)
    ]
    scored = [(r.summary().throughput, r) for r in candidates]
    best_throughput, best = max(scored, key=lambda item: item[0])
    rate = max(step_rate(r) for r in candidates)
    for _ in range(iterations):
        result = simulate_serving(trace, policy=HindsightChooser(rate=rate, **chooser), **options)
        throughput = result.summary().throughput
        if throughput > best_throughput:
            best_throughput, best = throughput, result
        new_rate = step_rate(result)
        if new_rate <= rate * (1 + 1e-9):
            break
        rate = new_rate
    best.policy = HINDSIGHT
    return best


def drawn_slots(policy: ServePolicy, confidences, num_drafts, *, block_size: int) -> int:
    """Slots the engine's lean proposer draws at a step (`BatchedDSparkProposer`, step 4): up to the policy's
    `max_drafts`, before the first slot k at which `stop_drafting(c[:, :k])` holds, and no more than the longest
    recorded row (a drafted stop id ends a row). `confidences` [R, γ] are what the policy reads, 0 past each row's
    γ' (`_policy_inputs`), as the engine's stopped rows read."""
    longest = int(num_drafts.max()) if num_drafts.numel() else 0
    limit = getattr(policy, "max_drafts", None)
    count = min(longest, block_size if limit is None else int(limit))
    stop = getattr(policy, "stop_drafting", None)
    if stop is None or confidences is None:
        return count
    return next((k - 1 for k in range(1, count + 1) if stop(confidences[:, :k])), count)


def _cut(values: tuple[float, ...] | None, count: int) -> list[float] | None:
    return None if values is None else list(values[:count])


def simulate_frontier(
    trace: ServeTrace,
    *,
    policies: Sequence[str],
    concurrency_levels: Sequence[int],
    sps: SPSTable | Mapping[int, SPSTable],
    costs: StepCosts | None = None,
    max_new_tokens: int | None = None,
    seed: int = 0,
    static_k: int = 2,
    threshold: float = 0.5,
    calibrated: bool | None = None,
    pad_to_longest: bool = False,
    scheduler_cost: str = "tokens",
) -> list[ServeSummary]:
    """Simulated `ServeSummary` for every (policy, R); `sps` may map R to the table profiled with R rows (the
    closest R is used when a level has no table of its own)."""
    summaries = []
    for concurrency in concurrency_levels:
        table = _table_for(sps, concurrency)
        for name in policies:
            result = simulate_serving(
                trace,
                policy=name,
                concurrency=concurrency,
                sps=table,
                costs=costs,
                max_new_tokens=max_new_tokens,
                seed=seed,
                static_k=static_k,
                threshold=threshold,
                calibrated=calibrated,
                pad_to_longest=pad_to_longest,
                scheduler_cost=scheduler_cost,
            )
            summaries.append(result.summary())
    return summaries


def _table_for(sps: SPSTable | Mapping[int, SPSTable], concurrency: int) -> SPSTable:
    if isinstance(sps, SPSTable):
        return sps
    if not sps:
        raise ValueError("simulate_frontier: the mapping of concurrency → SPS table is empty")
    return sps[min(sps, key=lambda rows: (abs(rows - concurrency), rows))]


def validate(real: ServeSummary, simulated: ServeSummary) -> dict[str, float]:
    """Relative errors (simulated − real) / real of throughput, user speed, budget and τ (NaN where real is 0/NaN)."""
    errors = {}
    for name in ("throughput", "user_speed", "budget", "tau"):
        truth, guess = float(getattr(real, name)), float(getattr(simulated, name))
        errors[name] = (guess - truth) / truth if math.isfinite(truth) and truth != 0 else float("nan")
    return errors
