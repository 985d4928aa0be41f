"""Does drafting pay? The per-round bypass of the single-request engine (`decode.bypass=cost`).

Before each round the engine asks `DraftingGate.draft()`, which compares the expected tokens per second of

    a drafting round    τ̂ tokens in t̂_round seconds    (draft + verify ℓ + 1 tokens + the engine's work)
    a plain step        1 token  in t̂_plain seconds    (the target alone on the anchor)

and drafts iff τ̂ · t̂_plain ≥ t̂_round (a tie drafts). Otherwise the round is a plain target step: nothing is drafted,
ℓ = 0, the verify forward runs on the anchor alone and the verifier samples the extra token from p_t with one uniform
— exactly a target-only round. The decision reads past rounds only, so the output is the target's whichever way it
goes (METHOD §5): the bypass is lossless without any argument about the drafts.

The estimates, and why:
- τ̂ is an EMA of the observed τ (tokens committed per drafting round), not the previous round's confidences: it
  serves every drafter (DFlash and EAGLE-3 have no confidence head), every policy and either verifier, and it is what
  rounds really commit under this policy's ℓ. Before any drafting round τ̂ is the most a round can commit (γ' + 1):
  optimistic, so the gate drafts first unless drafting cannot pay even with every draft accepted.
- t̂_round is an EMA of drafting rounds' measured seconds and t̂_plain of plain steps' — the round costs the engine
  records (`RoundRecord` seconds). Before the first plain step t̂_plain is the EMA of drafting rounds' verify
  seconds: a target forward over ℓ + 1 ≥ 1 tokens, which on a memory-bound machine costs about what one token does.
- `BypassCosts` (a drafting cost and an SPS(B) table) replaces the measured seconds when given: decisions that do not
  follow the clock (tests; studies that must reproduce from a seed). Then t̂_round = draft_seconds + 1/SPS(ℓ̂ + 1),
  ℓ̂ an EMA of the drafts verified, and t̂_plain = 1/SPS(1).
- Probing: after `probe_every` plain steps in a row the gate drafts once more, so that τ̂ and t̂_round follow the
  text (a stretch where drafting stopped paying may end). With a cost table under which even γ' + 1 tokens cannot
  pay for a round, the gate never drafts and never probes.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.scheduling.measured import MEASURED_OVERHEAD_EMA, ema
from dspark.scheduling.sps import SPSTable

#: plain steps in a row after which the gate drafts once to refresh its estimates
BYPASS_PROBE_EVERY = 8


@dataclass(frozen=True)
class BypassCosts:
    """A fixed cost table for the gate: `draft_seconds` per drafting round (the drafter's forward and sampling loop)
    and the target's forward rate `sps` at B tokens."""

    draft_seconds: float
    sps: SPSTable

    def __post_init__(self) -> None:
        if not self.draft_seconds >= 0.0:  # NaN fails too
            raise ValueError(f"BypassCosts: draft_seconds must be >= 0, got {self.draft_seconds}")

    def round_seconds(self, verified: float) -> float:
        """Seconds of a drafting round that verifies `verified` drafts: drafting plus a forward over ℓ + 1 tokens."""
        return self.draft_seconds + 1.0 / float(self.sps(float(verified) + 1.0))

    def plain_seconds(self) -> float:
        """Seconds of a plain target step: a forward over the anchor alone."""
        return 1.0 / float(self.sps(1))


class DraftingGate:
    """`draft()` before a round, `observe(...)` after it (module docstring). `max_tokens` = γ' + 1, the most a round
    can commit (γ' = the drafts the policy may verify)."""

    def __init__(
        self,
        *,
        max_tokens: int,
        costs: BypassCosts | None = None,
        probe_every: int = BYPASS_PROBE_EVERY,
        weight: float = MEASURED_OVERHEAD_EMA,
    ) -> None:
        if int(max_tokens) < 1 or int(probe_every) < 1 or not 0.0 < weight <= 1.0:
            raise ValueError(
                f"DraftingGate: need max_tokens >= 1, probe_every >= 1 and weight in (0, 1], got {max_tokens}, "
                f"{probe_every}, {weight}"
            )
        self.max_tokens, self.costs, self.probe_every, self.weight = int(max_tokens), costs, int(probe_every), weight
        self.tau: float | None = None  # EMA of τ over drafting rounds
        self.verified: float | None = None  # EMA of ℓ over drafting rounds
        self.round_seconds: float | None = None  # EMA of drafting rounds' seconds
        self.verify_seconds: float | None = None  # EMA of drafting rounds' verify seconds
        self.plain_seconds: float | None = None  # EMA of plain steps' seconds
        self.streak = 0  # plain steps since the last drafting round
        self.drafted = self.bypassed = 0  # rounds of each kind so far

    def draft(self) -> bool:
        """Whether the next round should draft (else: a plain target step)."""
        if self.costs is not None and self.max_tokens * self.costs.plain_seconds() < self.costs.round_seconds(
            self.max_tokens - 1
        ):
            return False  # not even a round that commits every draft pays: never draft, never probe
        if self.tau is None or self.streak >= self.probe_every:
            return True  # nothing observed yet (optimistic prior γ' + 1), or time to re-measure
        return self.tau * self._plain() >= self._round()

    def observe(self, *, drafted: bool, committed: int, verified: int, seconds: float, verify_seconds: float) -> None:
        """One finished round: whether it drafted, the tokens it committed (τ), drafts verified (ℓ) and its measured
        seconds (all of it, and its verify forward's)."""
        if drafted:
            self.drafted += 1
            self.streak = 0
            self.tau = ema(self.tau, float(committed), self.weight)
            self.verified = ema(self.verified, float(verified), self.weight)
            self.round_seconds = ema(self.round_seconds, float(seconds), self.weight)
            self.verify_seconds = ema(self.verify_seconds, float(verify_seconds), self.weight)
        else:
            self.bypassed += 1
            self.streak += 1
            self.plain_seconds = ema(self.plain_seconds, float(seconds), self.weight)

    def _plain(self) -> float:
        if self.costs is not None:
            return self.costs.plain_seconds()
        return self.plain_seconds if self.plain_seconds is not None else float(self.verify_seconds or 0.0)

    def _round(self) -> float:
        if self.costs is not None:
            return self.costs.round_seconds(self.verified or 0.0)
        return float(self.round_seconds or 0.0)
