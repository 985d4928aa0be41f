"""Hardware-aware prefix scheduler: how many drafts each request verifies (paper Algorithm 1, METHOD §6).

For R requests with calibrated per-slot confidences `c̃_{r,j}` the survival of slot j is
`a_{r,j} = Π_{i≤j} c̃_{r,i}`. Candidates `(r, j)` with `a_{r,j} > 0` are sorted by `a` descending, ties by smaller
`j` then smaller `r`; since `a_{r,j+1} ≤ a_{r,j}`, every prefix of that order admits a prefix of each request's
drafts. Starting from `B = R` tokens (the anchors), `τ* = R`, `Θ_0 = R·SPS(R)`, candidate n of the order gives

    B_n = R + n,    τ*_n = R + Σ_{m≤n} a_(m),    Θ_n = τ*_n · SPS(B_n)      (expected tokens per second, §7)

and the scheduler admits candidates while `Θ_n > Θ_{n-1}`, stopping at the first non-improvement.

Why the early stop (paper Appendix A): `a_{r,k+1}` depends on the sampled `x_{r,k}`. Whether `(r, k)` is admitted
under the early stop depends only on the candidates ranked before it — never on `(r, j > k)` — so the decision
to verify `x_{r,k}` is made from information available before it was sampled, and verification stays lossless.
The full search (argmax of Θ over all prefixes) lets `x_{r,k}` influence its own verification and biases the
output; it exists only behind an explicit flag for reproducing that appendix.

Stop rules (`decode.scheduler_stop`, `serve.scheduler_stop`; `SCHEDULER_STOPS`):
- `first_non_improvement` — Algorithm 1 above: lossless.
- `global_argmax` — the argmax of Θ over the whole staircase, the shortest plan among equal maxima (TensorRT-LLM's
  DSpark PR). NOT lossless. What the exact test shows (tests/test_scheduler.py, paper Appendix A: one request, γ = 2,
  SPS(1..3) = 1.0, 0.5, 0.45, p_t = (0.7, 0.3), p_d = (0.5, 0.5), c_1 = 0.8, c_2 = 0.9 after A and 0 after B):
  enumerating x_1, x_2 and the verifier's outcomes exactly, the first committed token is A with probability 0.7 =
  p_t(A) under `first_non_improvement` (ℓ = 0 whatever is drafted) and 0.85 under `global_argmax` (ℓ = 2 after A,
  0 after B) — with the token verifier and with block verification alike (after x_1 = A both keep x_1 for sure).
  The platform allows it for study; runs flag it "lossy" (stages: headline, report, `eval/lossy`, `serve/lossy`).
  It also cannot stop drafting early: whether slot k is verified reads slots after k.

`async_capacity_schedule` is the paper's production variant (§5.2): a token budget from stale confidences, filled
with the best current candidates.

Column planner (`plan_columns`, for a padded engine). The `BatchedEngine` verifies all R rows in one forward
right-padded to max_r ℓ_r + 1 tokens, so a step costs SPS(R·(max ℓ + 1)) whatever Σ ℓ_r is, and the first draft of
any row costs a whole column. Algorithm 1 prices one candidate per token and so refuses that column one c̃ at a
time at low confidences (docs/LOG.md). The planner admits whole columns instead: with k columns every row
verifies ℓ_r = min(k, n_r) drafts (n_r = drafted slots) and

    E(k) = R + Σ_r Σ_{j≤min(k, n_r)} S_{r,j},    S_{r,j} = Π_{i≤j} c̃_{r,i},    Θ(k) = E(k)·SPS(R·(k+1)),

admitting column k while Θ(k) > Θ(k-1), stopping at the first non-improvement — the same early stop, for the same
reason: column k's fate depends on c̃_{·,≤k} only, known before any x_{·,k} is sampled. At R = 1 a column is a
candidate and the planner is Algorithm 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspark.config.schema import SCHEDULER_STOPS
from dspark.scheduling.sps import SPSTable

FIRST_NON_IMPROVEMENT, GLOBAL_ARGMAX = SCHEDULER_STOPS
CONFIDENCE_RANGE_MESSAGE = (
    "scheduler: confidences must be calibrated per-slot probabilities in [0, 1]; apply the drafter's STS calibration "
    "(dspark.calibration.sts) to the confidence head's sigmoid output"
)
UNSAFE_SEARCH_MESSAGE = (
    "schedule_verification(early_stop=False) runs the full search over all prefixes, which lets a sampled draft "
    "x_k decide whether x_k itself is verified (a_(k+1) depends on x_k) and biases the output distribution away "
    "from the target's (METHOD §6, paper Appendix A: P(A) = 0.85 instead of 0.7). Keep early_stop=True; pass "
    "allow_unsafe_full_search=True only to reproduce that bias."
)


@dataclass
class SchedulePlan:
    """A scheduling decision with its trace (N candidates with a > 0, in admission order)."""

    lengths: Tensor  # [R] long, ℓ_r
    requests: Tensor  # [N] long, r of each sorted candidate
    slots: Tensor  # [N] long, j of each sorted candidate (1-based)
    survival: Tensor  # [N] float64, a_{r,j} of each sorted candidate
    throughput: Tensor  # [N+1] float64, Θ_0..Θ_N (Θ_n after admitting the first n candidates)
    num_admitted: int  # n*, the admitted prefix of the order


@dataclass
class ColumnPlan:
    """A column decision (`plan_columns`) with its trace over all γ columns; only Θ(0..k*+1) decided it."""

    lengths: Tensor  # [R] long, ℓ_r = min(k*, n_r)
    mass: Tensor  # [γ] float64, Σ_r S_{r,k} of column k (S = 0 past n_r)
    expected: Tensor  # [γ+1] float64, E(0)..E(γ)
    throughput: Tensor  # [γ+1] float64, Θ(0)..Θ(γ), Θ(k) = E(k)·SPS(R·(k+1))
    num_columns: int  # k*, the admitted columns


def _check_confidences(confidences: Tensor) -> Tensor:
    if confidences.dim() != 2:
        raise ValueError(f"scheduler: confidences must be [R, γ], got shape {tuple(confidences.shape)}")
    values = confidences.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()) or bool((values > 1).any()):
        raise ValueError(CONFIDENCE_RANGE_MESSAGE)
    return values


def sorted_candidates(confidences: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Candidates with a > 0 in admission order → (requests [N], slots [N] 1-based, survival [N] float64).

    confidences [R, γ] per-slot c̃ in [0, 1]. Order: a descending, ties by smaller j, then smaller r.
    """
    values = _check_confidences(confidences)
    num_requests, block = values.shape
    survival = values.cumprod(dim=1)
    # Flatten slot-major (index j·R + r) so a stable descending sort breaks ties by j, then r.
    flat = survival.t().reshape(-1)
    index = torch.nonzero(flat > 0).squeeze(-1)
    order = torch.sort(flat[index], descending=True, stable=True).indices
    index = index[order]
    return index % num_requests, index // num_requests + 1, flat[index]


def _lengths_from_prefix(requests: Tensor, num_admitted: int, num_requests: int) -> Tensor:
    # Admitted sets are prefixes, so ℓ_r is the number of request r's admitted candidates.
    lengths = torch.zeros(num_requests, dtype=torch.long)
    return lengths.scatter_add_(0, requests[:num_admitted], torch.ones(num_admitted, dtype=torch.long))


def plan_verification(
    confidences: Tensor, *, sps: SPSTable, early_stop: bool = True, allow_unsafe_full_search: bool = False
) -> SchedulePlan:
    """Algorithm 1 with its trace; see `schedule_verification`."""
    if not early_stop and not allow_unsafe_full_search:
        raise ValueError(UNSAFE_SEARCH_MESSAGE)
    num_requests = confidences.shape[0] if confidences.dim() == 2 else -1
    requests, slots, survival = sorted_candidates(confidences)
    count = survival.shape[0]
    batch = num_requests + torch.arange(count + 1, dtype=torch.float64)
    expected = num_requests + torch.cat([torch.zeros(1, dtype=torch.float64), survival.cumsum(0)])
    throughput = expected * sps(batch)
    if early_stop:
        # Leading run of strict improvements Θ_n > Θ_{n-1}.
        improved = throughput[1:] > throughput[:-1]
        num_admitted = int(improved.to(torch.long).cumprod(0).sum())
    else:
        num_admitted = int(torch.argmax(throughput))  # first maximum: a tie keeps the shorter plan
    lengths = _lengths_from_prefix(requests, num_admitted, num_requests)
    return SchedulePlan(lengths, requests, slots, survival, throughput, num_admitted)


def schedule_verification(
    confidences: Tensor, *, sps: SPSTable, early_stop: bool = True, allow_unsafe_full_search: bool = False
) -> Tensor:
    """Verification lengths ℓ_r ([R] long, CPU) for R requests (paper Algorithm 1, METHOD §6).

    confidences [R, γ]: calibrated per-slot c̃_{r,j} in [0, 1] (slot j 1-based → column j-1). `sps` is the
    target's profiled steps-per-second table. `early_stop=False` (the biased full search) raises unless
    `allow_unsafe_full_search=True`.
    """
    return plan_verification(
        confidences, sps=sps, early_stop=early_stop, allow_unsafe_full_search=allow_unsafe_full_search
    ).lengths


def check_stop(stop: str, *, key: str = "decode") -> str:
    """`stop` when it names a stop rule, else a ValueError naming `<key>.scheduler_stop` and the choices."""
    if stop not in SCHEDULER_STOPS:
        raise ValueError(
            f"{key}.scheduler_stop={stop!r}: choose one of {', '.join(SCHEDULER_STOPS)} (first_non_improvement: "
            "Algorithm 1, lossless; global_argmax: the argmax of Θ over the staircase, biased — paper Appendix A)"
        )
    return stop


def schedule_single(confidences: list[float], *, rates: list[float], stop: str = FIRST_NON_IMPROVEMENT) -> int:
    """ℓ for one request (R = 1) from plain floats: the decision `schedule_verification` takes on a [1, γ] row, in
    the same float64 arithmetic and order, without tensors (the single-request engine asks every round, and the
    tensor path cost ~1 ms a round there, against a ≤ 1 ms budget for all of a round's Python).

    confidences: c̃_1..c̃_γ in [0, 1]; rates: SPS(1), SPS(2), …, at least γ + 1 of them (the table at
    B = 1..γ+1).
    With one request the survival a_j is non-increasing in j, so the admission order is j = 1, 2, … up to the
    first a_j = 0, and the early stop admits slots while Θ_j = (1 + Σ_{m≤j} a_m)·SPS(1 + j) strictly improves;
    `stop=global_argmax` (lossy, module docstring) takes the first maximum of Θ_j over every j with a_j > 0 instead.
    """
    if any(not 0.0 <= c <= 1.0 for c in confidences):  # NaN fails too
        raise ValueError(CONFIDENCE_RANGE_MESSAGE)
    search = check_stop(stop) == GLOBAL_ARGMAX
    survival, total, admitted = 1.0, 0.0, 0
    best = 1.0 * rates[0]
    for slot, confidence in enumerate(confidences, start=1):
        survival *= confidence
        if survival <= 0.0:
            break
        total += survival
        value = (1.0 + total) * rates[slot]
        if value > best:
            best, admitted = value, slot
        elif not search:
            break
    return admitted


def single_drafting_done(confidences: list[float], *, rates: list[float]) -> bool:
    """True when slot k = len(confidences) will not be verified for the one request of `schedule_single`, whatever
    is drafted after it: c̃_1..c̃_k are known before x_k is sampled, and `schedule_single`'s decision on slot k
    depends on them only, so the proposer may stop before sampling x_k and the chosen ℓ is unchanged."""
    return schedule_single(confidences, rates=rates) < len(confidences)


def drafting_done(confidences: Tensor, *, sps: SPSTable) -> bool:
    """True when no request's slot k or later can be admitted by `schedule_verification` (with the early stop),
    whatever is drafted from slot k on; confidences [R, k] hold c̃ of slots 1..k of every request, known before the
    x_{·,k} are sampled (0 for a request that stopped drafting).

    Why it is exact. Every candidate (r, j > k) has survival a_{r,j} ≤ a_{r,k} ≤ U = max_r a_{r,k}, and ranks after
    every known candidate (r', j' ≤ k) with a ≥ U (ties go to the smaller j). So the known candidates with a ≥ U,
    in the scheduler's order, are a prefix of the full order, fixed before x_{·,k} is drawn. If the early stop ends
    inside that prefix and has admitted no slot-k candidate, no slot ≥ k is ever admitted and the plan on the
    shorter proposal is the same plan; otherwise the answer is False (keep drafting), which is always safe.
    """
    values = _check_confidences(confidences)
    num_requests, block = values.shape
    if block == 0:
        return False
    bound = float(values.cumprod(dim=1)[:, -1].max()) if num_requests else 0.0
    if bound <= 0.0:
        return True  # no slot-≥k candidate has positive survival: none is ever admitted
    requests, slots, survival = sorted_candidates(values)
    known = int((survival >= bound).sum())  # sorted descending: the known prefix of the full order
    batch = num_requests + torch.arange(known + 1, dtype=torch.float64)
    expected = num_requests + torch.cat([torch.zeros(1, dtype=torch.float64), survival[:known].cumsum(0)])
    throughput = expected * sps(batch)
    improved = throughput[1:] > throughput[:-1]
    if bool(improved.all()):
        return False  # the early stop lies beyond the known prefix: later slots may still be admitted
    admitted = int(improved.to(torch.long).cumprod(0).sum())
    return not bool((slots[:admitted] == block).any())


def _draft_counts(num_drafts: Tensor | None, num_requests: int, block: int) -> Tensor:
    if num_drafts is None:
        return torch.full((num_requests,), block, dtype=torch.long)
    counts = torch.as_tensor(num_drafts).to(device="cpu", dtype=torch.long).reshape(-1)
    if counts.shape[0] != num_requests or bool((counts < 0).any()) or bool((counts > block).any()):
        raise ValueError(
            f"plan_columns: num_drafts must be [R] = [{num_requests}] counts in [0, γ = {block}], got {counts.tolist()}"
        )
    return counts


def plan_columns(
    confidences: Tensor, *, sps: SPSTable, num_drafts: Tensor | None = None, stop: str = FIRST_NON_IMPROVEMENT
) -> ColumnPlan:
    """Column plan for an engine that pads every row to max ℓ + 1 (module docstring): ℓ_r = min(k*, n_r).

    confidences [R, γ]: calibrated c̃_{r,j} in [0, 1] (slot j → column j-1). num_drafts [R] long: n_r ≤ γ drafted
    slots per row (None: all γ); slots past n_r count as S = 0. `sps` prices a forward of R·(k+1) tokens.
    Early stop: column k is admitted iff Θ(j) > Θ(j-1) and column j has positive mass for every j ≤ k, so the plan
    is a function of the columns up to the first refused one and never of a column past it (lossless, as
    Algorithm 1). A column with no mass is refused even on a table where SPS grows: it adds no expected token,
    Algorithm 1 admits no a = 0 candidate either, and so at R = 1 both decide alike. `stop=global_argmax` (lossy,
    module docstring): the first maximum of Θ(k) over the leading run of columns with positive mass.
    """
    values = _check_confidences(confidences)
    num_requests, block = values.shape
    counts = _draft_counts(num_drafts, num_requests, block)
    drafted = torch.arange(block).unsqueeze(0) < counts.unsqueeze(1)
    survival = torch.where(drafted, values.cumprod(dim=1), 0.0)
    mass = survival.sum(dim=0)
    expected = num_requests + torch.cat([torch.zeros(1, dtype=torch.float64), mass.cumsum(0)])
    # Every row is padded to k + 1 tokens, so the forward has R·(k+1) tokens whatever the rows' ℓ_r.
    columns = torch.arange(block + 1, dtype=torch.float64)
    throughput = expected * sps(num_requests * (columns + 1))
    if check_stop(stop) == GLOBAL_ARGMAX:
        reachable = int((mass > 0).to(torch.long).cumprod(0).sum())  # columns up to the first one with no mass
        num_columns = int(torch.argmax(throughput[: reachable + 1]))  # the first maximum: a tie keeps fewer columns
    else:
        improved = (throughput[1:] > throughput[:-1]) & (mass > 0)
        num_columns = int(improved.to(torch.long).cumprod(0).sum())  # the leading run of admitted columns
    return ColumnPlan(counts.clamp(max=num_columns), mass, expected, throughput, num_columns)


def columns_drafting_done(confidences: Tensor, *, sps: SPSTable) -> bool:
    """True when slot k = confidences.shape[1] will never be verified under `plan_columns`, whatever is drafted
    from slot k on; confidences [R, k] hold c̃ of slots 1..k of every row, known before the x_{·,k} are sampled (0
    for a row that stopped drafting, which `plan_columns` reads as S = 0, like a cap n_r).

    Why it is exact: the plan over the k known columns is the full plan's whenever it refuses a column ≤ k (the
    early stop never looks past the first refused column), so if it admits fewer than k columns no slot ≥ k is ever
    verified and stopping changes nothing; if it admits all k, slot k will be verified and must be drafted.
    """
    values = _check_confidences(confidences)
    return plan_columns(values, sps=sps).num_columns < values.shape[1]


def expected_throughput(confidences: Tensor, lengths: Tensor, *, sps: SPSTable) -> float:
    """Θ = τ·SPS(B) of a plan (METHOD §7): τ = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}), B = Σ_r (1 + ℓ_r)."""
    values = _check_confidences(confidences)
    survival = values.cumprod(dim=1)
    lengths = lengths.to(device="cpu", dtype=torch.long)
    admitted = torch.arange(values.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    expected = values.shape[0] + float((survival * admitted).sum())
    return expected * sps(int(values.shape[0] + lengths.sum()))


def admit_top_k(confidences: Tensor, *, capacity: int) -> Tensor:
    """ℓ_r ([R] long) admitting the `capacity` best candidates (a > 0) in the scheduler's order; prefix-closed."""
    if capacity < 0:
        raise ValueError(f"admit_top_k: capacity must be >= 0, got {capacity}")
    requests, _, _ = sorted_candidates(confidences)
    return _lengths_from_prefix(requests, min(capacity, requests.shape[0]), confidences.shape[0])


def async_capacity_schedule(stale_confidences: Tensor, current_confidences: Tensor, *, sps: SPSTable) -> Tensor:
    """Production variant (paper §5.2, METHOD §6): ℓ_r ([R] long) under a capacity fixed two steps ahead.

    stale_confidences [R', γ']: calibrated c̃ from two scheduling steps ago (any request set). The full search
    (no early stop) on them gives the token budget K = Σ ℓ; this is causal because those confidences were fixed
    before the current drafts were sampled. current_confidences [R, γ]: the K best current candidates are admitted
    (`admit_top_k`). Whether (r, k) is admitted depends only on candidates ranked before it, never on a_{r,j>k},
    so the current drafts cannot influence their own verification.
    """
    stale = plan_verification(stale_confidences, sps=sps, early_stop=False, allow_unsafe_full_search=True)
    return admit_top_k(current_confidences, capacity=int(stale.lengths.sum()))
