"""The paper's claims judged with 95% confidence intervals: differences between two configurations of a sweep.

A configuration's estimate pools its replicate runs (seeds). Two sources of uncertainty are added, which is
conservative (the between-seed spread already contains some of the prompt-level noise):

    SE² = Σ_i se_i² / n²  +  s² / n        se_i: run i's within-run standard error, s²: between-run variance (n ≥ 2)

Within-run standard errors come from what the evaluation logged:

- τ: the per-prompt mean `…/tau_prompt_mean` with its Student-t half-width `…/tau_prompt_ci95` over `…/prompts`
  prompts (se = half-width / t quantile);
- cond@k: binomial over the n_k = rounds · survival@(k−1) rounds that reached slot k (exact for decode.policy=fixed,
  which verifies every draft), Agresti–Coull so that 0/n and n/n keep an interval; a run whose n_k < MIN_ROUNDS
  gives no estimate; rounds of one prompt are correlated, so this se is optimistic — the between-seed term is not;
- teacher-forced metrics (`val/…`): no within-run se (thousands of blocks); only the between-seed term, widened
  to the Student-t interval of n runs (one run: no interval).

A difference a − b has SE = √(SE_a² + SE_b²) and the normal 95% interval ± 1.96·SE; the relative gain divides it
by b's mean. The verdict reads the interval: above 0 → holds, below 0 → reversed, else not resolved.
The change of a relative gain between two block sizes (`gain_change`) adds the two relative standard errors: the
gains come from different drafter pairs evaluated on the same prompts, which ignores a positive correlation and so
errs wide.

Every judgement a report prints is also recorded as a `Claim` (the results index reads them as data): `mean`, `low`
and `high` are the effect whose sign the claim is about (a gain or a difference; 0 = no effect), and its verdict is
always `verdict_of(low, high, runs=runs)` (`VERDICTS`), so data and text cannot disagree. Our interval is never
compared with the paper's number: our target and budget differ, so only directions are judged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import polars as pl

from dspark.intervals import t_quantile

Z95 = 1.959964
MIN_ROUNDS = 20  #: a run's cond@k counts only when at least this many rounds reached slot k


NOT_RESOLVED = "not resolved (the 95% CI spans 0)"

# A Claim's verdict, read from its 95% interval of the effect (never chosen by hand).
VERDICTS = {
    "holds": "the 95% interval lies above 0: the claimed direction",
    "reversed": "the 95% interval lies below 0: the opposite direction",
    "not resolved": "the 95% interval spans 0",
    "no interval": "both arms ran, but there is a point estimate only (one run of a metric with no within-run "
    "standard error, or a statistic the report has no interval for)",
    "not run yet": "no run measured one of the arms (runs = 0)",
}


def read_interval(low: float, high: float, *, up: str = "holds", down: str = "reversed") -> str:
    """The verdict of a 95% interval of a difference: above 0 → `up`, below 0 → `down`, else not resolved."""
    return up if low > 0 else down if high < 0 else NOT_RESOLVED


class NormalInterval:
    """The normal 95% interval mean ± 1.96·se of anything with a `mean` and an `se`."""

    mean: float
    se: float

    @property
    def low(self) -> float:
        return self.mean - Z95 * self.se

    @property
    def high(self) -> float:
        return self.mean + Z95 * self.se


@dataclass(frozen=True)
class Pooled:
    """One configuration's estimate over its runs: mean, standard error, number of runs."""

    mean: float
    se: float
    runs: int

    @property
    def ok(self) -> bool:
        return self.runs > 0 and math.isfinite(self.mean)


@dataclass(frozen=True)
class Difference(NormalInterval):
    """a − b with its 95% interval, absolute and relative to b."""

    a: Pooled
    b: Pooled

    @property
    def ok(self) -> bool:
        return self.a.ok and self.b.ok and math.isfinite(self.se)

    @property
    def mean(self) -> float:
        return self.a.mean - self.b.mean

    @property
    def se(self) -> float:
        return math.sqrt(self.a.se**2 + self.b.se**2)

    def relative(self) -> tuple[float, float, float]:
        """(gain, low, high) as fractions of b's mean."""
        base = self.b.mean
        if not self.ok or base == 0:
            return (float("nan"),) * 3
        return self.mean / base, self.low / base, self.high / base

    @property
    def verdict(self) -> str:
        return read_interval(self.low, self.high) if self.ok else "not measured"

    def text(self, *, relative: bool = True, digits: int = 3) -> str:
        """'+12.3% [+4.1%, +20.5%]' (relative) or '+0.041 [+0.012, +0.070]'."""
        if not self.ok:
            return "–"
        if relative:
            gain, low, high = self.relative()
            return f"{gain:+.1%} [{low:+.1%}, {high:+.1%}]"
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


@dataclass(frozen=True)
class GainChange(NormalInterval):
    """The change of a relative gain between two block sizes, with its normal 95% interval (the two gains come
    from different drafters, so their errors add)."""

    mean: float
    se: float

    @property
    def verdict(self) -> str:
        return read_interval(self.low, self.high, up="grows", down="shrinks")

    def text(self) -> str:
        return f"{self.mean:+.1%} [{self.low:+.1%}, {self.high:+.1%}]"


def gain_change(first: Difference, last: Difference) -> GainChange | None:
    """Relative gain at the last γ minus that at the first (None when either is missing)."""
    if not (first.ok and last.ok) or first.b.mean == 0 or last.b.mean == 0:
        return None
    return GainChange(
        last.relative()[0] - first.relative()[0], math.hypot(last.se / last.b.mean, first.se / first.b.mean)
    )


def _column(rows: pl.DataFrame, name: str) -> list[float | None]:
    return rows[name].to_list() if name in rows.columns else [None] * rows.height


def pool(values: list[float | None], ses: list[float | None]) -> Pooled:
    """Pool runs with finite values (a missing se counts as 0: the between-run term still applies)."""
    pairs = [
        (float(v), float(s) if s is not None and math.isfinite(float(s)) else 0.0)
        for v, s in zip(values, ses)
        if v is not None and math.isfinite(float(v))
    ]
    n = len(pairs)
    if n == 0:
        return Pooled(float("nan"), float("nan"), 0)
    mean = sum(v for v, _ in pairs) / n
    within = sum(s**2 for _, s in pairs) / n**2
    between = sum((v - mean) ** 2 for v, _ in pairs) / (n - 1) / n if n >= 2 else 0.0
    return Pooled(mean, math.sqrt(within + between), n)


def tau_scope(scope: str) -> str:
    """'all' → 'eval/all', a domain → 'eval/domain/<d>', a prompt set → 'eval/<set>'."""
    return (
        "eval/all"
        if scope == "all"
        else (f"eval/domain/{scope}" if scope in ("math", "code", "chat") else f"eval/{scope}")
    )


def pooled_tau(rows: pl.DataFrame, scope: str = "all") -> Pooled:
    """Per-prompt mean τ of a scope, with its within-run se from the logged prompt interval."""
    prefix = tau_scope(scope)
    ses = []
    for half, prompts in zip(_column(rows, f"{prefix}/tau_prompt_ci95"), _column(rows, f"{prefix}/prompts")):
        n = int(prompts) if prompts is not None and math.isfinite(float(prompts)) else 0
        ses.append(float(half) / t_quantile(n) if half is not None and n >= 2 and math.isfinite(float(half)) else None)
    return pool(_column(rows, f"{prefix}/tau_prompt_mean"), ses)


def pooled_cond(rows: pl.DataFrame, k: int, scope: str = "all") -> Pooled:
    """cond@k of a scope with the binomial se over the rounds that reached slot k (module docstring)."""
    prefix = tau_scope(scope)
    values = _column(rows, f"{prefix}/cond/pos{k}")
    rounds = _column(rows, f"{prefix}/rounds")
    reached = _column(rows, f"{prefix}/survival/pos{k - 1}") if k > 1 else [1.0] * rows.height
    kept, ses = [], []
    for c, r, s in zip(values, rounds, reached):
        if None in (c, r, s) or not all(math.isfinite(float(x)) for x in (c, r, s)):
            continue
        n = float(r) * float(s)
        if n < MIN_ROUNDS:  # a handful of rounds reached slot k: no estimate (a 1/1 would read as certainty)
            continue
        # Agresti–Coull: stays honest near 0 and 1, where c(1 − c)/n would claim zero uncertainty
        shrunk = (float(c) * n + 2.0) / (n + 4.0)
        kept.append(float(c))
        ses.append(math.sqrt(shrunk * (1.0 - shrunk) / (n + 4.0)))
    return pool(kept, ses)


def pooled_plain(rows: pl.DataFrame, column: str) -> Pooled:
    """A metric with no within-run se (teacher-forced validation values): between-run spread only."""
    values = _column(rows, column)
    pooled = pool(values, [None] * len(values))
    if pooled.runs < 2:
        return Pooled(pooled.mean, float("nan"), pooled.runs)  # one run: no interval at all
    # few seeds: widen to the Student-t interval (1.96·se then spans the t half-width)
    return Pooled(pooled.mean, pooled.se * t_quantile(pooled.runs) / Z95, pooled.runs)


def judged(label: str, diff: Difference, *, relative: bool = True) -> str:
    """One claim line: '<label>: +12.3% [+4.1%, +20.5%] (runs 2 vs 2) → holds'."""
    runs = f"runs {diff.a.runs} vs {diff.b.runs}"
    return f"{label}: {diff.text(relative=relative)} ({runs}) → **{diff.verdict}**"


def verdict_of(low: float, high: float, *, runs: int) -> str:
    """A Claim's verdict (`VERDICTS`) from the 95% interval [low, high] of its effect and the runs per arm."""
    if runs <= 0:
        return "not run yet"
    if not (math.isfinite(low) and math.isfinite(high)):
        return "no interval"
    return "holds" if low > 0 else "reversed" if high < 0 else "not resolved"


@dataclass(frozen=True)
class Claim:
    """One paper claim as judged by one report, as data (`<report>.claims.json`).

    id: stable slug '<report>.<comparison>.<scope>' (e.g. 'main.dspark_vs_dflash.all'); statement: the claim in one
    line; paper: the paper's number as text ('–' when it has none); ours: our estimate as the report prints it,
    with its 95% interval ('+9.1% [+4.0%, +14.2%]'); mean, low, high: that effect and interval as floats (NaN when
    none; a relative gain is a fraction); runs: runs per arm (the smaller arm); seeds: the arms' seeds ('0,1');
    verdict: `verdict_of(low, high, runs=runs)`, checked on construction; scope: what was compared, over what.
    """

    id: str
    statement: str
    paper: str
    ours: str
    low: float
    high: float
    mean: float
    runs: int
    seeds: str
    verdict: str
    scope: str

    def __post_init__(self) -> None:
        derived = verdict_of(self.low, self.high, runs=self.runs)
        if self.verdict != derived:
            raise ValueError(
                f"claim {self.id}: verdict {self.verdict!r} disagrees with its interval "
                f"[{self.low}, {self.high}] over {self.runs} runs ({derived!r})"
            )

    @classmethod
    def judge(
        cls,
        *,
        id: str,
        statement: str,
        paper: str,
        ours: str,
        mean: float,
        low: float = math.nan,
        high: float = math.nan,
        runs: int,
        seeds: str,
        scope: str,
    ) -> "Claim":
        """A Claim whose verdict is read from [low, high] (no interval given: a point estimate)."""
        return cls(
            id=id,
            statement=statement,
            paper=paper,
            ours=ours,
            low=low,
            high=high,
            mean=mean,
            runs=runs,
            seeds=seeds,
            verdict=verdict_of(low, high, runs=runs),
            scope=scope,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields, with NaN floats as None."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def point_text(diff: Difference, *, relative: bool = True, digits: int = 3) -> str:
    """The point estimate of a difference without an interval: '+1.2% (no interval)', or '–'."""
    if not (diff.a.ok and diff.b.ok) or (relative and diff.b.mean == 0):
        return "–"
    value = f"{diff.a.mean / diff.b.mean - 1:+.1%}" if relative else f"{diff.mean:+.{digits}f}"
    return f"{value} (no interval)"


def difference_claim(
    diff: Difference, *, id: str, statement: str, paper: str, scope: str, seeds: str, relative: bool = True
) -> Claim:
    """The Claim of a judged difference a − b (relative to b, or absolute): the numbers `judged` prints."""
    runs = min(diff.a.runs, diff.b.runs)
    if diff.ok:
        mean, low, high = diff.relative() if relative else (diff.mean, diff.low, diff.high)
        return Claim.judge(
            id=id,
            statement=statement,
            paper=paper,
            ours=diff.text(relative=relative),
            mean=mean,
            low=low,
            high=high,
            runs=runs,
            seeds=seeds,
            scope=scope,
        )
    point = (diff.a.mean / diff.b.mean - 1 if relative and diff.b.mean else diff.mean) if runs else math.nan
    return Claim.judge(
        id=id,
        statement=statement,
        paper=paper,
        ours=point_text(diff, relative=relative),
        mean=point,
        runs=runs,
        seeds=seeds,
        scope=scope,
    )


def interval_claim(
    interval: NormalInterval, *, id: str, statement: str, paper: str, ours: str, runs: int, seeds: str, scope: str
) -> Claim:
    """The Claim of any normal interval (a `GainChange`)."""
    return Claim.judge(
        id=id,
        statement=statement,
        paper=paper,
        ours=ours,
        mean=interval.mean,
        low=interval.low,
        high=interval.high,
        runs=runs,
        seeds=seeds,
        scope=scope,
    )
