"""Round costs re-measured while decoding: the SPS(B) a scheduler plans with, corrected by what the rounds paid.

Why. The single-request engine plans on a table profiled once, at the start of a run (`profile_sps`). On a shared
or noisy machine that profile can be wrong in its *shape*: on an AVX2-only EPYC it read 1, 2 and 3 tokens as one
cost (120 ms) while the rounds then paid 114 / 141 / 124 ms for ℓ = 1 / 2 / 3, so the scheduler verified ℓ ≈ 2, the
dearest of the three (benchmarks/results/decoding-zen3-few-row.md). And the profile prices the verify forward
alone, while a round also pays the drafter (~20% of a plain step there), which makes every extra verified token
relatively cheaper than the profile says.

`MeasuredRoundCosts` keeps, per B = ℓ + 1 tokens, the last `window` verify times the engine measured, and an EMA of
each round's cost outside the verify forward (drafting, calibration, policy, commit). Its `table()` prices a round at
B tokens as

    t(B) = median of the measured verify times at B          (B measured at least `min_samples` times)
         = the profile's 1 / SPS(B) · level                 (otherwise; level = the median, over measured B, of
                                                              measured / profiled time: the machine's load now)
    SPS_round(B) = 1 / (t(B) + overhead)

so a B that was never chosen keeps the profile's *shape* at today's *level* (a uniformly slower machine does not
make the untried sizes look cheap), and a B that was chosen is priced by what it cost. A B not measured for
`stale_rounds` rounds forgets its measurements, so a size priced dear by a few slow rounds is tried again. With one
request this is the exact throughput objective of a round: (1 + Σ a) / (t(B) + overhead) (`scheduling.scheduler.schedule_single`).
Decisions then depend on measured time, so a fixed seed no longer fixes the ℓ sequence (the output distribution stays
the target's: every ℓ is verified losslessly); `decode.step_costs=profile` keeps the profile for reproducible runs.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from dspark.scheduling.sps import SPSTable

#: verify times kept per B (the median of the most recent ones prices B)
MEASURED_WINDOW = 16
#: measurements of B before they replace the profile's value at B
MEASURED_MIN_SAMPLES = 3
#: weight of the newest round (or serving step) in a measured overhead's EMA: ~5-round memory
MEASURED_OVERHEAD_EMA = 0.2
#: rounds after which a size that was not chosen again forgets its measurements (back to the profile's shape at
#: today's level), so a size priced dear by a few slow rounds — first calls of a new shape, a burst of load — is
#: tried again instead of being avoided for the rest of the run
MEASURED_STALE_ROUNDS = 64


class MeasuredRoundCosts:
    """Per-B verify times and the per-round overhead measured by an engine, over a profiled `SPSTable` prior."""

    def __init__(
        self,
        profile: SPSTable,
        *,
        window: int = MEASURED_WINDOW,
        min_samples: int = MEASURED_MIN_SAMPLES,
        overhead_ema: float = MEASURED_OVERHEAD_EMA,
        stale_rounds: int = MEASURED_STALE_ROUNDS,
    ) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(
                f"MeasuredRoundCosts: need window >= 1 and 1 <= min_samples <= window, got "
                f"window={window}, min_samples={min_samples}"
            )
        if not 0.0 < overhead_ema <= 1.0:
            raise ValueError(f"MeasuredRoundCosts: overhead_ema must lie in (0, 1], got {overhead_ema}")
        if stale_rounds < 1:
            raise ValueError(f"MeasuredRoundCosts: stale_rounds must be >= 1, got {stale_rounds}")
        self.profile = profile
        self.window, self.min_samples, self.overhead_ema = int(window), int(min_samples), float(overhead_ema)
        self.stale_rounds = int(stale_rounds)
        self._verify: dict[int, deque[float]] = {}
        self._last_round: dict[int, int] = {}  # the round that last measured each size
        self._prior: dict[int, float] = {}  # the profile's verify seconds 1 / SPS(B), evaluated once per B
        self.overhead: float | None = None  # seconds per round outside the verify forward (EMA); None until observed
        self.rounds = 0

    def observe(self, batch_tokens: int, verify_seconds: float, overhead_seconds: float) -> None:
        """One round: B = ℓ + 1 tokens verified in `verify_seconds`; `overhead_seconds` spent outside the verify
        forward (drafting and the engine's own work). Non-finite or negative times are ignored (a clock glitch must
        not price a size at 0)."""
        batch_tokens = int(batch_tokens)
        if batch_tokens < 1:
            raise ValueError(f"MeasuredRoundCosts.observe: batch_tokens must be >= 1, got {batch_tokens}")
        self.rounds += 1
        if _usable(verify_seconds) and verify_seconds > 0.0:
            self._verify.setdefault(batch_tokens, deque(maxlen=self.window)).append(float(verify_seconds))
            self._last_round[batch_tokens] = self.rounds
        for size in [b for b, last in self._last_round.items() if self.rounds - last > self.stale_rounds]:
            del self._verify[size], self._last_round[size]  # not chosen for a while: price it afresh, retry it
        if _usable(overhead_seconds):
            self.overhead = ema(self.overhead, float(overhead_seconds), self.overhead_ema)

    def samples(self, batch_tokens: int) -> int:
        """Verify times held for B (at most `window`)."""
        return len(self._verify.get(int(batch_tokens), ()))

    def measured(self) -> dict[int, float]:
        """{B: median measured verify seconds} for every B measured at least `min_samples` times."""
        return {
            b: statistics.median(times) for b, times in sorted(self._verify.items()) if len(times) >= self.min_samples
        }

    def level(self) -> float:
        """Measured / profiled verify time, the median over the measured B (1.0 before any): today's load."""
        return self._level(self.measured())

    def _level(self, measured: dict[int, float]) -> float:
        ratios = [seconds / self.prior_seconds(b) for b, seconds in measured.items()]
        return statistics.median(ratios) if ratios else 1.0

    def prior_seconds(self, batch_tokens: int) -> float:
        """The profile's verify time at B, 1 / SPS(B) (cached: the engine asks every round)."""
        if batch_tokens not in self._prior:
            self._prior[batch_tokens] = 1.0 / self.profile(batch_tokens)
        return self._prior[batch_tokens]

    def verify_seconds(self, batch_tokens: int) -> float:
        """t(B): the measured median at B, else the profile's time at B scaled to today's level."""
        measured = self.measured()
        if batch_tokens in measured:
            return measured[batch_tokens]
        return self._level(measured) * self.prior_seconds(batch_tokens)

    def table(self) -> SPSTable:
        """Round rates SPS_round(B) = 1 / (t(B) + overhead) at the profile's sizes and every measured B."""
        measured = self.measured()
        level = self._level(measured)
        overhead = self.overhead or 0.0
        sizes = sorted(set(self.profile.batch_tokens) | set(measured))
        times = [measured[b] if b in measured else level * self.prior_seconds(b) for b in sizes]
        return SPSTable(
            batch_tokens=sizes,
            steps_per_second=[1.0 / (t + overhead) for t in times],
            target_fingerprint=self.profile.target_fingerprint,
            machine=self.profile.machine,
            created=self.profile.created,
        )


def ema(previous: float | None, value: float, weight: float = MEASURED_OVERHEAD_EMA) -> float:
    """The exponential moving average after `value` (the value itself when there is no `previous`)."""
    return value if previous is None else (1.0 - weight) * previous + weight * value


def _usable(seconds: float) -> bool:
    return math.isfinite(seconds) and seconds >= 0.0
