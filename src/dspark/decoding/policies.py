"""How many drafts to verify: the one policy family of `decode.policy` and `serve.policy` (METHOD §6, paper §5.2).

One batched contract. A policy maps the confidences of one engine step to ℓ_r for each of its R requests; the
single-request engine calls it with R = 1:

    confidences [R, γ] float   what the policy `reads` (below); columns k ≥ num_drafts[r] are ignored
    num_drafts  [R] long       γ'_r ≤ γ (drafting stopped early: a drafted stop id, a policy stop, a faulty slot)
    →           [R] long       ℓ_r ∈ [0, γ'_r]

    fixed                 ℓ_r = γ'_r                                  verify everything (the paper's offline setting)
    mtp1                  ℓ_r = min(1, γ'_r)                          the paper's production baseline
    static                ℓ_r = min(k, γ'_r)                          k = decode.static_k / serve.static_k
    threshold             prefix before the first RAW c_k < θ          METHOD §6, the paper's Fig. 5 sweep
    calibrated_threshold  prefix before the first calibrated c̃_k < θ  (serve.policy=threshold before the merge)
    scheduler             Algorithm 1 over all R requests with the early stop, on calibrated survival
                          a_{r,j} = Π_{i≤j} c̃_{r,i} and this machine's SPS(B) (cost "tokens"); cost "columns"
                          (serve.scheduler_cost) admits whole columns, ℓ_r = min(k, γ'_r), priced at
                          SPS(R·(k+1)) as the padded BatchedEngine verifies them (`plan_columns`)
    async                 capacity K = Σℓ of the full search on the calibrated confidences of two steps ago,
                          filled with the K best current candidates; the first two steps use `scheduler`

What a policy reads (`reads`): "raw" c_k = σ(confidence logit), or "calibrated" c̃_k. Calibration is applied in one
place, by the engine, before the policy (`policy_confidences`): a calibrated policy on an engine without an STS
calibration reads the raw c_k. So `threshold` compares the same numbers in `decode.*` and `serve.*`, and a θ means
the same thing in the Fig. 5 sweep, in evaluation and under load.

All are prefix rules whose decision on slot k depends on c_{≤k} only (or on stale confidences), so verification
stays lossless (METHOD §5, Appendix A) — with the token verifier and with block verification (`decoding.verify`).
The one exception is opt-in: `scheduler` with `scheduler_stop=global_argmax` (decode.scheduler_stop /
serve.scheduler_stop) searches the whole staircase, so slot k's fate reads c_{k+1..}, which depend on x_k: biased
(paper Appendix A; `scheduling.scheduler`). Every policy says which it is (`lossless`), and runs flag the lossy one. Drafts that will never be verified are not drafted (the lean round, issue 11):
- `max_drafts` (static k, mtp1 1; None otherwise): the proposers sample at most that many slots;
- `stop_drafting(c [R, k] or [k])` (threshold, calibrated_threshold, scheduler): True when no request's slot k or
  later will be verified whatever is drafted next, so the proposers stop before sampling x_{·,k}. The ℓ chosen on
  the shorter proposal is the one the full proposal would get (tested), and fewer random numbers are drawn.
Policies with history (`async`) are reset by the engines when a generation / a serve call starts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from dspark.calibration.sts import STSCalibration
from dspark.config.schema import SCHEDULER_COSTS, SCHEDULER_STOPS
from dspark.registry import Registry, unknown_name_message
from dspark.scheduling.scheduler import (
    GLOBAL_ARGMAX,
    async_capacity_schedule,
    check_stop,
    columns_drafting_done,
    drafting_done,
    plan_columns,
    schedule_single,
    schedule_verification,
    single_drafting_done,
)
from dspark.scheduling.sps import SPSTable

RAW, CALIBRATED = "raw", "calibrated"
TOKENS, COLUMNS = SCHEDULER_COSTS  # the scheduler's cost models (serve.scheduler_cost)
FIRST_NON_IMPROVEMENT = SCHEDULER_STOPS[0]  # the scheduler's default stop rule (decode.scheduler_stop)


class VerificationPolicy(Protocol):
    """ℓ_r [R] from confidences [R, γ] (what `reads` names) and γ'_r [R] (module docstring)."""

    name: str
    needs_confidences: bool
    reads: str  # "raw" | "calibrated"
    lossless: bool  # False only for the scheduler's opt-in global_argmax stop (module docstring)

    def choose(self, *, confidences: Tensor | None, num_drafts: Tensor) -> Tensor: ...

    def reset(self) -> None: ...


def as_counts(num_drafts: Tensor | int) -> Tensor:
    """γ'_r as [R] long on the CPU (an int is one request)."""
    return torch.as_tensor(num_drafts, dtype=torch.long).reshape(-1).cpu()


def _check(name: str, confidences: Tensor | None, num_drafts: Tensor, *, key: str) -> Tensor:
    """confidences [R, γ] float64 on the CPU with the ignored columns zeroed; clear errors otherwise."""
    if confidences is None:
        raise ValueError(
            f"{key}.policy={name} needs per-slot confidences, but this drafter has no confidence head "
            f"(dflash, eagle3); use {key}.policy=fixed, mtp1 or static, or drafter=dspark"
        )
    if confidences.dim() == 1:
        confidences = confidences.unsqueeze(0)
    if confidences.dim() != 2 or confidences.shape[0] != num_drafts.shape[0]:
        raise ValueError(
            f"{key}.policy={name}: confidences must be [R, γ] with R = {num_drafts.shape[0]}, got "
            f"{tuple(confidences.shape)}"
        )
    if bool((num_drafts > confidences.shape[1]).any()):
        raise ValueError(
            f"{key}.policy={name}: got {confidences.shape[1]} confidences for {int(num_drafts.max())} drafts"
        )
    values = torch.nan_to_num(confidences.detach().to(device="cpu", dtype=torch.float64), nan=0.0)
    drafted = torch.arange(values.shape[1]).unsqueeze(0) < num_drafts.unsqueeze(1)
    return torch.where(drafted, values, 0.0)


def _single_request_row(confidences: Tensor | None, num_drafts: Tensor | int) -> list[float] | None:
    """c_1..c_γ' of a well-formed one-request call as floats (NaN → 0, as `_check`), else None (the general path,
    which also raises the errors).

    Why: the single-request engine asks every round, and `_check`'s tensor plumbing cost ~0.1 ms of a ≤ 1 ms
    budget for a round's Python. The values are `_check`'s: float32 or float64 confidences widen exactly to Python
    floats, columns past γ' are dropped instead of zeroed (a zero survival ends the scheduler's scan either way),
    and ±inf stays out of range for the scheduler's check just as `nan_to_num`'s huge finite values do.
    """
    if confidences is None or confidences.dim() > 2 or (confidences.dim() == 2 and confidences.shape[0] != 1):
        return None
    if isinstance(num_drafts, Tensor):
        if num_drafts.numel() != 1:
            return None
        num_drafts = num_drafts.reshape(-1)[0]
    count = int(num_drafts)
    row = confidences.detach().reshape(-1).tolist()
    if not 0 <= count <= len(row):
        return None
    return [value if value == value else 0.0 for value in row[:count]]


def _cap(lengths: Tensor, num_drafts: Tensor) -> Tensor:
    return torch.minimum(lengths.to(torch.long).cpu(), num_drafts)


@dataclass
class StaticPolicy:
    """ℓ_r = min(k, γ'_r): `mtp1` is k = 1, `fixed` is k = None (γ'_r)."""

    k: int | None
    name: str = "static"
    key: str = "decode"
    needs_confidences = False
    reads = RAW
    lossless = True

    def __post_init__(self) -> None:
        if self.k is not None and int(self.k) < 0:
            raise ValueError(f"{self.key}.static_k={self.k} must be >= 0 (drafts verified per request)")

    @property
    def max_drafts(self) -> int | None:
        """No slot past k is ever verified, so none is drafted (None: every slot may be)."""
        return None if self.k is None else int(self.k)

    def choose(self, *, confidences: Tensor | None, num_drafts: Tensor | int) -> Tensor:
        num_drafts = as_counts(num_drafts)
        return num_drafts.clone() if self.k is None else num_drafts.clamp(max=int(self.k))

    def reset(self) -> None:
        pass


@dataclass
class ThresholdPolicy:
    """Per request, the prefix before the first c_k < θ; `reads` raw (`threshold`) or calibrated
    (`calibrated_threshold`). Per slot, not cumulative; c_k = θ is kept; ℓ = 0 allowed."""

    threshold: float
    name: str = "threshold"
    reads: str = RAW
    key: str = "decode"
    needs_confidences = True
    lossless = True

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(
                f"{self.key}.threshold={self.threshold} must lie in [0, 1] (it is compared with the "
                f"confidence c_k = σ(·)); e.g. {self.key}.threshold=0.5"
            )

    def choose(self, *, confidences: Tensor | None, num_drafts: Tensor | int) -> Tensor:
        num_drafts = as_counts(num_drafts)
        values = _check(self.name, confidences, num_drafts, key=self.key)
        passing = (values >= self.threshold).to(torch.long).cumprod(dim=1)  # 1 up to the first failure
        return _cap(passing.sum(dim=1), num_drafts)

    max_drafts = None

    def stop_drafting(self, confidences: Tensor) -> bool:
        """confidences [k] = c_1..c_k of one request, or [R, k] of R (what `reads` names, known before x_k is
        sampled; 0 for a request that stopped drafting) → True when no request's slot k will be verified."""
        failed = torch.nan_to_num(confidences, nan=0.0) < self.threshold
        return bool(failed.any(dim=-1).all())

    def reset(self) -> None:
        pass


def _require_sps(name: str, sps: SPSTable | None, key: str) -> None:
    if sps is None:
        raise ValueError(
            f"{key}.policy={name} needs the target's SPS(B) table (the forward rate per batch size); "
            "stage=eval / stage=profile profile it for decode.*, stage=serve for serve.* — or choose "
            f"{key}.policy=fixed, mtp1, static or threshold"
        )


def _check_scheduler_cost(cost: str, key: str) -> None:
    if cost not in SCHEDULER_COSTS:
        raise ValueError(
            f"{key}.scheduler_cost={cost!r}: choose one of {', '.join(SCHEDULER_COSTS)} (tokens: "
            "Algorithm 1 at B = Σ(1 + ℓ); columns: whole columns at B = R·(k + 1), a padded engine)"
        )


@dataclass
class SchedulerPolicy:
    """Early-stop (lossless) planning on calibrated survival: Algorithm 1 per token (cost "tokens"), or whole
    columns priced as the padded batched engine pays for them (cost "columns", `scheduler.plan_columns`).

    With one request a column is a candidate and both costs make Algorithm 1's decision (tested), so R = 1 takes the
    float fast path whatever the cost. `stop` (decode.scheduler_stop / serve.scheduler_stop): first_non_improvement
    (Algorithm 1) | global_argmax (the whole staircase's argmax: lossy, `lossless` is False; drafts every slot)."""

    sps: SPSTable | None
    key: str = "decode"
    cost: str = TOKENS
    stop: str = FIRST_NON_IMPROVEMENT
    name = "scheduler"
    needs_confidences = True
    reads = CALIBRATED
    _rate_cache: list[float] = field(default_factory=list, init=False, repr=False)  # SPS(1..n), see `_rates`

    def __post_init__(self) -> None:
        _require_sps(self.name, self.sps, self.key)
        _check_scheduler_cost(self.cost, self.key)
        check_stop(self.stop, key=self.key)

    @property
    def lossless(self) -> bool:
        """Whether slot k's fate depends on c_{≤k} only (Algorithm 1's stop), so the output is the target's."""
        return self.stop != GLOBAL_ARGMAX

    def choose(self, *, confidences: Tensor | None, num_drafts: Tensor | int) -> Tensor:
        row = _single_request_row(confidences, num_drafts)
        if row is not None:  # the single-request engine, every round: the same decision from plain floats
            return torch.tensor([schedule_single(row, rates=self._rates(len(row) + 1), stop=self.stop)])
        num_drafts = as_counts(num_drafts)
        values = _check(self.name, confidences, num_drafts, key=self.key)
        if values.numel() == 0:
            return torch.zeros(values.shape[0], dtype=torch.long)
        if self.cost == COLUMNS:
            return plan_columns(values, sps=self.sps, num_drafts=num_drafts, stop=self.stop).lengths
        search = {"early_stop": False, "allow_unsafe_full_search": True} if not self.lossless else {}
        return _cap(schedule_verification(values, sps=self.sps, **search), num_drafts)

    max_drafts = None

    def stop_drafting(self, confidences: Tensor) -> bool:
        """confidences [k] (one request) or [R, k]: c̃ of slots 1..k, known before x_{·,k} is sampled → True when
        the early-stop plan can admit no slot ≥ k whatever is drafted next (`scheduling.scheduler.drafting_done`,
        or `columns_drafting_done` for cost "columns"; for one request, `schedule_single` on c̃_1..c̃_k stops
        before k). Never with global_argmax: its decision on slot k reads the slots after it."""
        if not self.lossless:
            return False
        row = _single_request_row(confidences, confidences.shape[-1])
        if row is not None:
            return single_drafting_done(row, rates=self._rates(len(row) + 1))
        values = torch.nan_to_num(confidences.detach().to(device="cpu", dtype=torch.float64), nan=0.0)
        if self.cost == COLUMNS:
            return columns_drafting_done(values, sps=self.sps)
        return drafting_done(values, sps=self.sps)

    def reprice(self, sps: SPSTable) -> None:
        """Plan with `sps` from now on (measured whole-step rates: the serving engine's `serve.step_overhead`, the
        single-request engine's `decode.step_costs`); the cost model stays."""
        _require_sps(self.name, sps, self.key)
        self.sps, self._rate_cache = sps, []

    def _rates(self, count: int) -> list[float]:
        """SPS(1..count) as floats, evaluated once per table (the exact float64 values the tensor path uses)."""
        if len(self._rate_cache) < count:
            self._rate_cache = self.sps(torch.arange(1, count + 1, dtype=torch.float64)).tolist()
        return self._rate_cache

    def reset(self) -> None:
        pass


@dataclass
class AsyncPolicy:
    """Capacity from confidences two steps old, filled by the best current candidates (paper §5.2)."""

    sps: SPSTable | None
    key: str = "decode"
    name = "async"
    needs_confidences = True
    reads = CALIBRATED
    lossless = True  # the full search runs on confidences two steps old, fixed before these drafts
    max_drafts = None
    _history: deque = field(default_factory=lambda: deque(maxlen=2), repr=False)

    def __post_init__(self) -> None:
        _require_sps(self.name, self.sps, self.key)

    def choose(self, *, confidences: Tensor | None, num_drafts: Tensor | int) -> Tensor:
        num_drafts = as_counts(num_drafts)
        values = _check(self.name, confidences, num_drafts, key=self.key)
        if values.numel() == 0:
            lengths = torch.zeros(values.shape[0], dtype=torch.long)
        elif len(self._history) == 2 and self._history[0].shape == values.shape:
            lengths = async_capacity_schedule(self._history[0], values, sps=self.sps)
        else:  # no stale confidences of this shape yet: the synchronous scheduler is the safe fallback
            lengths = schedule_verification(values, sps=self.sps)
        self._history.append(values)
        return _cap(lengths, num_drafts)

    def reprice(self, sps: SPSTable) -> None:
        """Plan with `sps` from now on (measured whole-step rates: `serve.step_overhead`, `decode.step_costs`)."""
        _require_sps(self.name, sps, self.key)
        self.sps = sps

    def reset(self) -> None:
        self._history.clear()


# Every builder takes the same keywords (static_k, threshold, sps, key, cost, stop) and uses those it needs.
POLICIES: Registry = Registry("decode.policy / serve.policy")
POLICIES.add("fixed", lambda *, static_k, threshold, sps, key, cost, stop: StaticPolicy(None, name="fixed", key=key))
POLICIES.add("mtp1", lambda *, static_k, threshold, sps, key, cost, stop: StaticPolicy(1, name="mtp1", key=key))
POLICIES.add(
    "static", lambda *, static_k, threshold, sps, key, cost, stop: StaticPolicy(static_k, name="static", key=key)
)
POLICIES.add("threshold", lambda *, static_k, threshold, sps, key, cost, stop: ThresholdPolicy(threshold, key=key))
POLICIES.add(
    "calibrated_threshold",
    lambda *, static_k, threshold, sps, key, cost, stop: ThresholdPolicy(
        threshold, name="calibrated_threshold", reads=CALIBRATED, key=key
    ),
)
POLICIES.add(
    "scheduler",
    lambda *, static_k, threshold, sps, key, cost, stop: SchedulerPolicy(sps, key=key, cost=cost, stop=stop),
)
POLICIES.add("async", lambda *, static_k, threshold, sps, key, cost, stop: AsyncPolicy(sps, key=key))


def build_policy(
    name: str,
    *,
    threshold: float = 0.5,
    static_k: int = 2,
    sps: SPSTable | None = None,
    key: str = "decode",
    calibration: None = None,
    scheduler_cost: str = TOKENS,
    scheduler_stop: str = FIRST_NON_IMPROVEMENT,
) -> VerificationPolicy:
    """The policy named by `decode.policy` (key "decode") or `serve.policy` (key "serve"); errors name that key.

    scheduler_cost: the `scheduler`'s cost model, "tokens" (Algorithm 1) or "columns" (`serve.scheduler_cost`);
    checked for every name, used by the scheduler only. scheduler_stop: the scheduler's stop rule, first_non_improvement
    (Algorithm 1) or global_argmax (lossy; `decode.scheduler_stop`), likewise checked for every name.
    Policies never calibrate: pass the STS calibration to the engine (`SpeculativeEngine(calibration=...)`,
    `BatchedEngine(calibration=...)`), which applies it before the policy. `calibration` is accepted only as None
    (older callers passed it here).
    """
    if calibration is not None:
        raise ValueError(
            "build_policy(calibration=...) is gone: the engine applies the STS calibration before the "
            "policy; pass it as SpeculativeEngine(calibration=...) or BatchedEngine(calibration=...)"
        )
    if name not in POLICIES:
        raise ValueError(unknown_name_message(f"{key}.policy", name, POLICIES.names()))
    _check_scheduler_cost(scheduler_cost, key)
    check_stop(scheduler_stop, key=key)
    return POLICIES.resolve(name)(
        static_k=static_k, threshold=threshold, sps=sps, key=key, cost=scheduler_cost, stop=scheduler_stop
    )


def calibrate_confidences(calibration: STSCalibration, confidences: Tensor) -> Tensor:
    """c̃ [..., γ'] from raw c [..., γ'], γ' ≤ the γ the calibration was fitted for (a short proposal uses
    T_1..T_γ'; the padding columns of a batched proposal are calibrated and then ignored by every policy)."""
    block = len(calibration.temperatures)
    count = confidences.shape[-1]
    if count > block:
        raise ValueError(
            f"the STS calibration was fitted for block_size={block} but the drafter proposed {count} "
            "tokens; refit the calibration for this drafter"
        )
    if count == block:
        return calibration.apply(confidences)
    padded = torch.cat([confidences, confidences.new_zeros(*confidences.shape[:-1], block - count)], dim=-1)
    return calibration.apply(padded)[..., :count]


def policy_confidences(
    policy: VerificationPolicy | None, *, raw: Tensor | None, calibrated: Tensor | None
) -> Tensor | None:
    """What `policy` reads: the calibrated confidences when it `reads` them and the engine has a calibration,
    else the raw ones (the one place, shared by both engines, where the choice is made)."""
    if policy is not None and getattr(policy, "reads", RAW) == CALIBRATED and calibrated is not None:
        return calibrated
    return raw
