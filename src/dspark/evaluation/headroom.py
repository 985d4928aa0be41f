"""How far ahead of the best static ℓ any verify-length policy could be, from one fixed-ℓ = γ decoding run.

A policy only chooses how many of a round's drafts the target verifies. On rounds decoded with ℓ = γ (no prefix is
censored) each round's accepted count A is known, so the rate of every static ℓ and of the *hindsight* policy (each
round's ℓ chosen knowing A: not causal, an upper bound for the scheduler and every other policy) can be replayed
under one cost model: a round costs its own drafting and bookkeeping time plus the mean verify time of the target at
ℓ drafts, measured on the same machine (ℓ = 0: the plain target step). Static ℓ and hindsight are priced alike, so
machine noise that moves every round does not move their ratio. If the bound sits inside the paired CI of a measured
scheduler-vs-static ratio, no run of that size can show the scheduler ahead — the drafter must be accepted more
often, or the verify cost must climb more steeply with ℓ, before the scheduler has something to exploit.

Replaying a round under another ℓ keeps its drafts and its A; the text that follows would differ (another extra
token), which is why this compares per-round expectations, not generations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PolicyHeadroom:
    """Tokens per second of the replayed policies (from `policy_headroom`)."""

    static_rates: dict[int, float]  # ℓ → tokens/s of "always verify ℓ" on these rounds
    hindsight_rate: float  # the best per-round choice of ℓ knowing each round's A (an upper bound)

    @property
    def best_static(self) -> int:
        return max(self.static_rates, key=lambda ell: (self.static_rates[ell], -ell))

    @property
    def ratio(self) -> float:
        """Hindsight rate over the best static ℓ's: the most any verify-length policy can be ahead here (≥ 1)."""
        return self.hindsight_rate / self.static_rates[self.best_static]


def interpolate_costs(verify_seconds: Mapping[int, float], block_size: int) -> list[float]:
    """Verify seconds at ℓ = 0..γ from those measured at some ℓ (linear between them, flat beyond the ends).

    verify_seconds must hold ℓ = 0 (the plain step) and at least one ℓ ≥ 1."""
    points = sorted((int(ell), float(sec)) for ell, sec in verify_seconds.items())
    if not points or points[0][0] != 0 or len(points) < 2:
        raise ValueError(
            f"verify_seconds needs ℓ = 0 (the plain target step) and at least one ℓ ≥ 1, got {sorted(verify_seconds)}"
        )
    costs = []
    for ell in range(block_size + 1):
        below = max((p for p in points if p[0] <= ell), key=lambda p: p[0])
        above = min((p for p in points if p[0] >= ell), key=lambda p: p[0], default=below)
        if above[0] == below[0]:
            costs.append(below[1])
        else:
            weight = (ell - below[0]) / (above[0] - below[0])
            costs.append(below[1] + weight * (above[1] - below[1]))
    return costs


def policy_headroom(
    rounds: Sequence[Any], *, verify_seconds: Mapping[int, float], block_size: int, iterations: int = 50
) -> PolicyHeadroom:
    """Replay static ℓ = 1..γ and the hindsight policy on fixed-ℓ = γ rounds.

    rounds: `RoundRecord`s (or anything with num_verified, num_accepted, committed, seconds, seconds_verify) of a
    run that verified every draft; verify_seconds {ℓ: mean seconds of the verify step at ℓ drafts} (ℓ = 0 the plain
    target step). A round replayed at ℓ commits ℓ + 1 tokens if ℓ < A, else its own τ, and costs its non-verify time
    plus verify_seconds at min(ℓ, its ℓ_eff). The hindsight rate maximises Σ tokens / Σ seconds over per-round
    choices exactly (Dinkelbach's iteration: choose each round's ℓ maximising tokens − λ·seconds, update λ)."""
    if not rounds:
        raise ValueError("policy_headroom needs at least one round")
    costs = interpolate_costs(verify_seconds, block_size)
    options = []  # per round: [(tokens, seconds) at ℓ = 0..ℓ_eff]
    for r in rounds:
        base = r.seconds - r.seconds_verify
        options.append(
            [
                ((ell + 1) if ell < r.num_accepted else r.committed, base + costs[ell])
                for ell in range(min(r.num_verified, block_size) + 1)
            ]
        )
    static = {}
    for ell in range(1, block_size + 1):
        chosen = [opts[min(ell, len(opts) - 1)] for opts in options]
        static[ell] = sum(t for t, _ in chosen) / sum(s for _, s in chosen)
    rate = max(static.values())
    for _ in range(iterations):
        chosen = [max(opts, key=lambda o: o[0] - rate * o[1]) for opts in options]
        new_rate = sum(t for t, _ in chosen) / sum(s for _, s in chosen)
        if new_rate <= rate * (1 + 1e-12):
            break
        rate = new_rate
    return PolicyHeadroom(static_rates=static, hindsight_rate=rate)
