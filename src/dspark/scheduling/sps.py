"""Steps-per-second of the target as a function of the tokens in one forward: the `SPS(B)` of METHOD §6–§7.

The scheduler values a verification plan as `Θ = τ·SPS(B)` with `B = Σ_r (1 + ℓ_r)` tokens, so it needs the
target's forward rate at every `B` it might choose. `profile_sps` measures it once at start-up on the serving
machine (the engine passes a closure that runs the target on B tokens) and `SPSTable` answers in between:

- between profiled sizes: linear interpolation of SPS;
- below the smallest size: SPS of the smallest (a forward never gets faster than with the fewest tokens measured);
- above the largest size: the step time keeps growing at a constant number of seconds per extra token, namely the
  last segment's slope of `1/SPS` (floored at 0; with one entry, time ∝ B). Profile up to `R·(γ+1)` to avoid
  relying on it.

A table is only valid for the target and machine it was measured on: `matches` checks both before reuse.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from dspark.hardware import machine_fingerprint  # noqa: F401  (re-exported: SPS tables record it)
from dspark.timing import synchronize


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class SPSTable:
    """Profiled forward rates: `steps_per_second[i]` target forwards per second at `batch_tokens[i]` tokens."""

    batch_tokens: list[int]  # strictly increasing, >= 1
    steps_per_second: list[float]  # > 0, same length
    target_fingerprint: str = ""  # Target.fingerprint of the profiled model
    machine: str = ""  # machine_fingerprint() where it was profiled
    created: str = field(default_factory=_now)  # ISO-8601 UTC

    def __post_init__(self) -> None:
        self.batch_tokens = [int(b) for b in self.batch_tokens]
        self.steps_per_second = [float(s) for s in self.steps_per_second]
        sizes, rates = self.batch_tokens, self.steps_per_second
        if not sizes or len(sizes) != len(rates):
            raise ValueError("SPSTable: batch_tokens and steps_per_second must be non-empty and of equal length")
        if sizes[0] < 1 or any(b >= c for b, c in zip(sizes, sizes[1:])):
            raise ValueError(f"SPSTable: batch_tokens must be strictly increasing positive ints, got {sizes}")
        if any(not (s > 0 and s != float("inf")) for s in rates):
            raise ValueError(f"SPSTable: steps_per_second must be finite and positive, got {rates}")

    def __call__(self, batch_tokens: int | float | Tensor) -> float | Tensor:
        """SPS at `batch_tokens` (a number → float, a tensor → float64 tensor of the same shape)."""
        if isinstance(batch_tokens, Tensor):
            return self._evaluate(batch_tokens.to(torch.float64))
        return float(self._evaluate(torch.tensor([float(batch_tokens)], dtype=torch.float64))[0])

    def _evaluate(self, query: Tensor) -> Tensor:
        sizes = torch.tensor(self.batch_tokens, dtype=torch.float64, device=query.device)
        rates = torch.tensor(self.steps_per_second, dtype=torch.float64, device=query.device)
        if len(sizes) == 1:
            inside = rates[0].expand_as(query)
        else:
            right = torch.searchsorted(sizes, query.clamp(sizes[0], sizes[-1]).contiguous()).clamp(1, len(sizes) - 1)
            left = right - 1
            weight = (query.clamp(sizes[0], sizes[-1]) - sizes[left]) / (sizes[right] - sizes[left])
            inside = rates[left] + weight * (rates[right] - rates[left])
        return torch.where(query > sizes[-1], self._extrapolate(query, sizes, rates), inside)

    @staticmethod
    def _extrapolate(query: Tensor, sizes: Tensor, rates: Tensor) -> Tensor:
        last_time = 1.0 / rates[-1]
        if len(sizes) == 1:
            per_token = last_time / sizes[-1]
        else:
            per_token = ((last_time - 1.0 / rates[-2]) / (sizes[-1] - sizes[-2])).clamp_min(0.0)
        return 1.0 / (last_time + per_token * (query - sizes[-1]).clamp_min(0.0))

    def with_step_overhead(self, seconds: float) -> "SPSTable":
        """The rates of a whole step that spends `seconds` outside this forward besides it: 1 / (1 / SPS(B) + seconds)
        at every profiled B (the serving engine's drafting, per-row verification and bookkeeping, which the verify
        profile does not see). seconds 0 returns the same rates; a copy either way."""
        seconds = float(seconds)
        if not (seconds >= 0.0 and seconds != float("inf")):
            raise ValueError(f"SPSTable.with_step_overhead: seconds must be finite and >= 0, got {seconds}")
        return SPSTable(
            batch_tokens=list(self.batch_tokens),
            steps_per_second=[1.0 / (1.0 / rate + seconds) for rate in self.steps_per_second],
            target_fingerprint=self.target_fingerprint,
            machine=self.machine,
            created=self.created,
        )

    def matches(self, target_fingerprint: str, machine: str) -> bool:
        """Whether this table was profiled for this target on this machine (else re-profile)."""
        return self.target_fingerprint == target_fingerprint and self.machine == machine

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "SPSTable":
        known = {"batch_tokens", "steps_per_second", "target_fingerprint", "machine", "created"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"SPSTable: unknown keys {sorted(unknown)}; expected {sorted(known)}")
        return cls(**data)

    def save(self, path: str | Path) -> Path:
        """Write JSON atomically (temp file in the same directory, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(self.to_dict(), handle, indent=2)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SPSTable":
        return cls.from_dict(json.loads(Path(path).read_text()))


def profile_sps(
    forward_fn: Callable[[int], None],
    *,
    batch_tokens: Sequence[int],
    repeats: int = 5,
    warmup: int = 1,
    target_fingerprint: str = "",
    machine: str | None = None,
) -> SPSTable:
    """Time `forward_fn(B)` for each B in `batch_tokens`: SPS = 1 / median of `repeats` timed calls.

    `forward_fn(B)` must run one target forward over B new tokens (e.g. R requests' verify blocks on their caches)
    and leave no state behind that changes later calls; CUDA work is synchronised before each clock read. The
    calls are interleaved — `warmup` calls of every size, then `repeats` rounds that time every size once — so a
    drift of the machine's speed while profiling (load, clock) moves every size alike instead of the sizes timed
    last: on a 2-core VM a size-by-size profile priced a 4-token verify 15% above a 2-token one that decoding then
    paid alike (56.9 vs 57.8 ms, `benchmarks/results/decoding-zen3-gqa-t1.md`), and the scheduler avoided it.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"profile_sps: repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    sizes = sorted({int(b) for b in batch_tokens})
    for _ in range(warmup):
        for size in sizes:
            forward_fn(size)
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(repeats):
        for size in sizes:
            synchronize()
            start = time.perf_counter()
            forward_fn(size)
            synchronize()
            times[size].append(time.perf_counter() - start)
    rates = [1.0 / max(statistics.median(times[size]), 1e-9) for size in sizes]
    return SPSTable(
        sizes,
        rates,
        target_fingerprint=target_fingerprint,
        machine=machine if machine is not None else machine_fingerprint(),
    )
