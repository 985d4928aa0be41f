"""The paper's claims judged on intervals: differences between two configurations of a sweep — one statistics rule
for every report (docs/STATISTICS.md says it for readers).

**Pooling.** A configuration's estimate pools its replicate runs (seeds). Two sources of uncertainty add, each a
`Term` with its own degrees of freedom:

    SE² = Σ_i se_i² / n²  +  s² / n        se_i: run i's within-run standard error (df_i: its prompts − 1),
                                           s²: the between-run variance of the n run means (df n − 1; n ≥ 2)

This is conservative (the between-seed spread already holds some of the sampling noise of each run's prompts).
Within-run standard errors come from what the evaluation logged:

- τ: the per-prompt mean `…/tau_prompt_mean` with its Student-t half-width `…/tau_prompt_ci95` over `…/prompts`
  prompts (se = half-width / t quantile, df = prompts − 1);
- cond@k: binomial over the n_k = rounds · survival@(k−1) rounds that reached slot k (exact for decode.policy=fixed,
  which verifies every draft), Agresti–Coull so that 0/n and n/n keep an interval (df n_k − 1); a run whose
  n_k < MIN_ROUNDS gives no estimate; rounds of one prompt are correlated, so this se is optimistic — the
  between-seed term is not;
- teacher-forced metrics (`val/…`), verify rates, ECE: no within-run se; only the between-seed term (one run: no
  interval at all).

**Degrees of freedom.** An interval is mean ± t_{df}·SE, never ± 1.96·SE: df is the Welch–Satterthwaite df of its
terms, df = (Σ v_j)² / Σ (v_j² / df_j). A difference a − b (SE² = SE_a² + SE_b²) pools the terms of both arms, so
the df follows whichever term dominates: with 2 seeds per arm and the seed terms dominating, df → 1–2 and the
interval widens by t(1) = 12.7 (t(2) = 4.3) instead of 1.96; with the prompt terms dominating it stays near the
normal one. Satterthwaite rather than df = n − 1 outright because a 2-seed run whose seeds happened to agree has a
small seed term: charging it t(1) would make the prompt spread, measured on 60 prompts, pay for 1 df. (The known
weakness: a seed variance estimated on 1 df can be small by chance; the index says how many seeds each claim ran.)

**One seed.** With one run per arm the seed term is not measured, and the interval holds the within-run spread
only — too narrow. No report borrows a seed term from another sweep (a report reads its own sweep's runs), so the
rule is a cap: a claim with runs < 2 whose interval would decide (holds, reversed, not reproduced) reads **seed
variance not measured** instead, and its line says so; an interval spanning 0 stays *not resolved* (a seed term
could only widen it).

**Relative gains and changes of gains.** A relative gain divides the difference's mean, interval and terms by b's
mean. The change of a relative gain between two block sizes (`gain_change`) adds the terms of both gains, each
divided by its baseline² — the gains come from different drafter pairs on the same prompts, a positive
correlation this ignores, so it errs wide.

**Several tests of one claim (multiplicity).** A claim judged over several domains (or block sizes, slots,
depths, positions) is a *family*: its tests are Holm-adjusted together (`holm`), so the familywise error stays at
5%. Each test's p-value (two-sided, t with its df) is Holm-adjusted,
p̃_(i) = max_{j ≤ i} min(1, (m − j + 1)·p_(j));
its printed interval is widened to the confidence 1 − 0.05·p / p̃ (between 95% and the Bonferroni level 1 − 0.05/m;
the latter for the most significant test), which excludes 0 exactly when p̃ < 0.05 — so the interval, the verdict
and the claims file agree. A family of magnitude claims (below) is adjusted on the p-values of the hypothesis its
verdict is about, "the effect is the paper's" (`holm(…, magnitude=True)`). A single test (`all`, one γ change)
stays at 95%; tests of different claims are not adjusted against each other. `MULTIPLICITY` is the note every
report with families prints.

**Verdicts.** Every judgement a report prints is also recorded as a `Claim` (the results index reads them as
data): `mean`, `low` and `high` are the effect whose sign the claim is about (a gain or a difference; 0 = no
effect), and its verdict is always `verdict_of(low, high, runs=runs, paper_effect=…)` (`VERDICTS`), so data and
text cannot disagree. A *direction* claim reads the interval against 0: above → holds, below → reversed, else not
resolved. A *magnitude* claim also carries the paper's effect size on the same scale (`paper_effect`, only where
the paper gives a number for the same comparison): an interval on 0's side of it that excludes it reads **not
reproduced** (the paper's size is ruled out at this operating point, even when the interval lies above 0). The "A
≥ B in every domain" summaries (`every_scope`) read holds only when every domain holds; one unresolved domain
makes the claim not resolved.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

import polars as pl

from dspark.intervals import t_quantile, t_quantile_df, t_two_sided_p

ALPHA = 0.05  #: every interval is a (1 − ALPHA) interval before a multiplicity adjustment widens it
MIN_ROUNDS = 20  #: a run's cond@k counts only when at least this many rounds reached slot k
ONE_SEED = "seed variance not measured"
NOT_REPRODUCED = "not reproduced"
NOT_RESOLVED = "not resolved (the 95% CI spans 0)"

# A Claim's verdict, read from its interval of the effect (never chosen by hand): `verdict_of`.
VERDICTS = {
    "holds": "the interval lies above 0: the claimed direction",
    "reversed": "the interval lies below 0: the opposite direction",
    "not resolved": "the interval spans 0",
    NOT_REPRODUCED: "a magnitude claim whose interval excludes the paper's effect size on 0's side of it: the "
    "paper's size is ruled out at this operating point (the interval may still lie above 0)",
    ONE_SEED: "an arm ran one seed, so the interval holds the within-run (prompt) spread only: the verdict it would "
    "give (holds, reversed, not reproduced) is withheld until a second seed runs",
    "no interval": "both arms ran, but there is a point estimate only (one run of a metric with no within-run "
    "standard error, or a statistic the report has no interval for)",
    "not run yet": "no run measured one of the arms (runs = 0)",
}

MULTIPLICITY = (
    "Statistics (docs/STATISTICS.md): intervals are Student-t, mean ± t·SE, with the Welch–Satterthwaite df of "
    "their prompt and seed terms (printed as `df`); an arm with one seed has no seed term, so its verdict reads "
    f"*{ONE_SEED}* where the interval would decide. Multiplicity: the tests of one claim over several domains (or "
    "block sizes, slots, depths, positions) are one family, Holm-adjusted together (familywise 95%): each such "
    "interval is printed at its Holm level (`Holm 98.3%`), which excludes 0 exactly when the adjusted test rejects. "
    "A single test (`all`) is a plain 95% interval; tests of different claims are not adjusted against each other."
)


def read_interval(low: float, high: float, *, up: str = "holds", down: str = "reversed") -> str:
    """The verdict of a 95% interval of a difference: above 0 → `up`, below 0 → `down`, else not resolved."""
    return up if low > 0 else down if high < 0 else NOT_RESOLVED


@dataclass(frozen=True)
class Term:
    """One independent part of a squared standard error: its variance and its degrees of freedom (math.inf: a
    variance known or estimated from very many observations); `seed` marks the between-seed term."""

    variance: float
    df: float
    seed: bool = False


def satterthwaite(terms: Iterable[Term]) -> float:
    """The Welch–Satterthwaite df of a sum of variance terms, (Σ v)² / Σ (v² / df); math.inf when every term with
    variance has infinite df (or there is none)."""
    live = [t for t in terms if t.variance > 0]
    total = sum(t.variance for t in live)
    denominator = sum(t.variance**2 / t.df for t in live if math.isfinite(t.df))
    return total**2 / denominator if denominator > 0 else math.inf


def scaled(terms: Iterable[Term], factor: float) -> tuple[Term, ...]:
    """The terms of (a quantity × √factor): variances × factor, df unchanged (a relative gain: factor 1 / base²)."""
    return tuple(Term(t.variance * factor, t.df, t.seed) for t in terms)


class TInterval:
    """The Student-t interval mean ± t_{df, confidence}·se of anything with `mean`, `se`, `df` and `confidence`,
    with its two-sided p-value against 0 (what Holm reads)."""

    mean: float
    se: float
    df: float
    confidence: float

    @property
    def half_width(self) -> float:
        if not (math.isfinite(self.se) and math.isfinite(self.mean)):
            return math.nan
        return t_quantile_df(self.df, self.confidence) * self.se if self.se > 0 else 0.0

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    @property
    def p_value(self) -> float:
        """Two-sided p-value of the hypothesis 'the effect is 0'."""
        return self.p_value_at(0.0)

    def p_value_at(self, null: float) -> float:
        """Two-sided p-value of the hypothesis 'the effect is `null`' (t with this interval's df)."""
        if not (math.isfinite(self.se) and math.isfinite(self.mean)):
            return math.nan
        if self.se == 0:
            return 0.0 if self.mean != null else 1.0
        return t_two_sided_p((self.mean - null) / self.se, self.df)

    def stat_text(self) -> str:
        """How the interval was made: 'df 1.3' ('df ∞': normal), with ', Holm 98.3%' when it is not a 95% one."""
        df = "∞" if not math.isfinite(self.df) else f"{self.df:.3g}"
        level = "" if math.isclose(self.confidence, 1 - ALPHA) else f", Holm {self.confidence:.1%}"
        return f"df {df}{level}"


@dataclass(frozen=True)
class Pooled(TInterval):
    """One configuration's estimate over its runs: mean, standard error, number of runs, and the variance terms the
    se is made of (`pool`; none given: one term of infinite df), with its 95% t interval."""

    mean: float
    se: float
    runs: int
    terms: tuple[Term, ...] = ()
    confidence: float = 1 - ALPHA

    @property
    def parts(self) -> tuple[Term, ...]:
        if self.terms:
            return self.terms
        return (Term(self.se**2, math.inf),) if math.isfinite(self.se) and self.se > 0 else ()

    @property
    def df(self) -> float:
        return satterthwaite(self.parts)

    @property
    def ok(self) -> bool:
        return self.runs > 0 and math.isfinite(self.mean)


@dataclass(frozen=True)
class Difference(TInterval):
    """a − b with its t interval (df: Satterthwaite over both arms' terms), absolute and relative to b."""

    a: Pooled
    b: Pooled
    confidence: float = 1 - ALPHA

    @property
    def ok(self) -> bool:
        return self.a.ok and self.b.ok and math.isfinite(self.se)

    @property
    def mean(self) -> float:
        return self.a.mean - self.b.mean

    @property
    def terms(self) -> tuple[Term, ...]:
        return self.a.parts + self.b.parts

    @property
    def se(self) -> float:
        return math.sqrt(self.a.se**2 + self.b.se**2)

    @property
    def df(self) -> float:
        return satterthwaite(self.terms)

    @property
    def runs(self) -> int:
        return min(self.a.runs, self.b.runs)

    def relative(self) -> tuple[float, float, float]:
        """(gain, low, high) as fractions of b's mean."""
        base = self.b.mean
        if not self.ok or base == 0:
            return (float("nan"),) * 3
        return self.mean / base, self.low / base, self.high / base

    def relative_terms(self) -> tuple[Term, ...]:
        return scaled(self.terms, 1.0 / self.b.mean**2)

    @property
    def verdict(self) -> str:
        return verdict_of(self.low, self.high, runs=self.runs) if self.ok else "not measured"

    def text(self, *, relative: bool = True, digits: int = 3) -> str:
        """'+12.3% [+4.1%, +20.5%]' (relative) or '+0.041 [+0.012, +0.070]'."""
        if not self.ok:
            return "–"
        if relative:
            gain, low, high = self.relative()
            return f"{gain:+.1%} [{low:+.1%}, {high:+.1%}]"
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


@dataclass(frozen=True)
class GainChange(TInterval):
    """The change of a relative gain between two block sizes with its t interval (the two gains come from different
    drafters, so their terms add); `paper_effect`: the paper's change on the same scale (NaN: direction only)."""

    mean: float
    terms: tuple[Term, ...]
    runs: int
    confidence: float = 1 - ALPHA
    paper_effect: float = math.nan

    @property
    def se(self) -> float:
        return math.sqrt(sum(t.variance for t in self.terms))

    @property
    def df(self) -> float:
        return satterthwaite(self.terms)

    @property
    def ok(self) -> bool:
        return math.isfinite(self.mean) and math.isfinite(self.se)

    @property
    def claim_verdict(self) -> str:
        return verdict_of(self.low, self.high, runs=self.runs, paper_effect=self.paper_effect)

    @property
    def verdict(self) -> str:
        """The claim's verdict in the words of a change: grows / shrinks for holds / reversed."""
        return {"holds": "grows", "reversed": "shrinks"}.get(self.claim_verdict, self.claim_verdict)

    def text(self) -> str:
        return f"{self.mean:+.1%} [{self.low:+.1%}, {self.high:+.1%}]"


def gain_change(first: Difference, last: Difference, *, paper_effect: float = math.nan) -> GainChange | None:
    """Relative gain at the last γ minus that at the first (None when either is missing)."""
    if not (first.ok and last.ok) or first.b.mean == 0 or last.b.mean == 0:
        return None
    return GainChange(
        last.relative()[0] - first.relative()[0],
        last.relative_terms() + first.relative_terms(),
        min(first.runs, last.runs),
        paper_effect=paper_effect,
    )


Test = TypeVar("Test", Difference, GainChange)


def holm(tests: Mapping[Any, Test], *, magnitude: bool = False) -> dict[Any, Test]:
    """Holm's step-down adjustment of one family of tests (module docstring): each testable one (`ok`) comes back
    with its confidence widened to 1 − ALPHA·p / p̃ (p̃ its Holm-adjusted p-value), so its interval excludes 0
    exactly when Holm rejects; untestable ones and families of one come back as they are. `magnitude`: a family of
    magnitude claims (`GainChange` with `paper_effect`), adjusted for the hypothesis they are about — the effect
    is the paper's — so the interval excludes the paper's size exactly when Holm rejects that."""

    def p_of(test: Test) -> float:
        return test.p_value_at(test.paper_effect) if magnitude else test.p_value

    testable = sorted(((k, t) for k, t in tests.items() if t.ok), key=lambda kt: p_of(kt[1]))
    m = len(testable)
    if m < 2:
        return dict(tests)
    adjusted, running = {}, 0.0
    for rank, (key, test) in enumerate(testable):
        p = p_of(test)
        running = max(running, min(1.0, (m - rank) * p))
        factor = running / p if p > 0 else float(m - rank)
        adjusted[key] = replace(test, confidence=1 - ALPHA / factor)
    return {k: adjusted.get(k, t) for k, t in tests.items()}


def every_scope(verdicts: Mapping[str, str]) -> str:
    """The verdict of "A ≥ B (or A > B) in every scope" from the scopes' verdicts: **holds** only when each holds,
    **reversed** in the scopes reversed, else **not resolved** naming what each unresolved scope read."""
    held = [s for s, v in verdicts.items() if v == "holds"]
    reversed_ = [s for s, v in verdicts.items() if v == "reversed"]
    if reversed_:
        return "**reversed** in " + ", ".join(reversed_)
    if verdicts and len(held) == len(verdicts):
        return "**holds**"
    rest = ", ".join(f"{s} {v}" for s, v in verdicts.items() if v != "holds")
    return f"**not resolved** ({len(held)} of {len(verdicts)} hold; {rest})"


def _column(rows: pl.DataFrame, name: str) -> list[float | None]:
    return rows[name].to_list() if name in rows.columns else [None] * rows.height


def pool(values: list[float | None], ses: list[float | None], dfs: list[float] | None = None) -> Pooled:
    """Pool runs with finite values: one within-run term per run with an se (df from `dfs`, else ∞; a missing se
    adds none: the between-run term still applies) and the between-run term (df n − 1) when n ≥ 2."""
    dfs = dfs if dfs is not None else [math.inf] * len(values)
    kept = [
        (float(v), float(s) if s is not None and math.isfinite(float(s)) else 0.0, float(d))
        for v, s, d in zip(values, ses, dfs)
        if v is not None and math.isfinite(float(v))
    ]
    n = len(kept)
    if n == 0:
        return Pooled(float("nan"), float("nan"), 0)
    mean = sum(v for v, _, _ in kept) / n
    terms = [Term(s**2 / n**2, d) for _, s, d in kept if s > 0]
    if n >= 2:
        terms.append(Term(sum((v - mean) ** 2 for v, _, _ in kept) / (n - 1) / n, n - 1.0, seed=True))
    return Pooled(mean, math.sqrt(sum(t.variance for t in terms)), n, tuple(terms))


def tau_scope(scope: str) -> str:
    """'all' → 'eval/all', a domain → 'eval/domain/<d>', a prompt set → 'eval/<set>'."""
    return (
        "eval/all"
        if scope == "all"
        else (f"eval/domain/{scope}" if scope in ("math", "code", "chat") else f"eval/{scope}")
    )


def pooled_prompt_metric(rows: pl.DataFrame, name: str, scope: str = "all") -> Pooled:
    """A per-prompt mean of a scope (`<prefix>/<name>_prompt_mean` ± `_prompt_ci95` over `<prefix>/prompts`) pooled
    over runs, each run's within-run se = half-width / t quantile on prompts − 1 df."""
    prefix = tau_scope(scope)
    ses, dfs = [], []
    for half, prompts in zip(_column(rows, f"{prefix}/{name}_prompt_ci95"), _column(rows, f"{prefix}/prompts")):
        n = int(prompts) if prompts is not None and math.isfinite(float(prompts)) else 0
        usable = half is not None and n >= 2 and math.isfinite(float(half))
        ses.append(float(half) / t_quantile(n) if usable else None)
        dfs.append(n - 1.0 if usable else math.inf)
    return pool(_column(rows, f"{prefix}/{name}_prompt_mean"), ses, dfs)


def pooled_tau(rows: pl.DataFrame, scope: str = "all") -> Pooled:
    """Per-prompt mean τ of a scope, with its within-run se from the logged prompt interval."""
    return pooled_prompt_metric(rows, "tau", scope)


def pooled_cond(rows: pl.DataFrame, k: int, scope: str = "all") -> Pooled:
    """cond@k of a scope with the binomial se over the rounds that reached slot k (module docstring)."""
    prefix = tau_scope(scope)
    values = _column(rows, f"{prefix}/cond/pos{k}")
    rounds = _column(rows, f"{prefix}/rounds")
    reached = _column(rows, f"{prefix}/survival/pos{k - 1}") if k > 1 else [1.0] * rows.height
    kept, ses, dfs = [], [], []
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
        dfs.append(n - 1.0)
    return pool(kept, ses, dfs)


def pooled_plain(rows: pl.DataFrame, column: str) -> Pooled:
    """A metric with no within-run se (teacher-forced validation values, verify rates, ECE): the between-run term
    only, df n − 1 (so its 95% interval is the Student-t interval over runs); one run: no interval at all."""
    values = _column(rows, column)
    pooled = pool(values, [None] * len(values))
    return pooled if pooled.runs >= 2 else Pooled(pooled.mean, float("nan"), pooled.runs)


def stat_note(interval: TInterval, *, runs: int) -> str:
    """What an interval is, for a claim's line and scope: 'df 1.3' or 'df 4.1, Holm 98.3%', and 'seed variance not
    measured' when an arm ran one seed."""
    return interval.stat_text() + (f"; {ONE_SEED}" if 0 < runs < 2 else "")


def judged(label: str, diff: Difference, *, relative: bool = True) -> str:
    """One claim line: '<label>: +12.3% [+4.1%, +20.5%] (runs 2 vs 2; df 3.1) → **holds**'."""
    runs = f"runs {diff.a.runs} vs {diff.b.runs}"
    note = f"; {stat_note(diff, runs=diff.runs)}" if diff.ok else ""
    return f"{label}: {diff.text(relative=relative)} ({runs}{note}) → **{diff.verdict}**"


def verdict_of(low: float, high: float, *, runs: int, paper_effect: float = math.nan) -> str:
    """A Claim's verdict (`VERDICTS`) from the interval [low, high] of its effect, the runs per arm and, for a
    magnitude claim, the paper's effect size on the same scale (module docstring)."""
    if runs <= 0:
        return "not run yet"
    if not (math.isfinite(low) and math.isfinite(high)):
        return "no interval"
    direction = "holds" if low > 0 else "reversed" if high < 0 else "not resolved"
    excluded = math.isfinite(paper_effect) and (high < paper_effect if paper_effect > 0 else low > paper_effect)
    if runs < 2 and (direction != "not resolved" or excluded):
        return ONE_SEED
    if direction != "reversed" and excluded:
        return NOT_REPRODUCED
    return direction


@dataclass(frozen=True)
class Claim:
    """One paper claim as judged by one report, as data (`<report>.claims.json`).

    id: stable slug '<report>.<comparison>.<scope>' (e.g. 'main.dspark_vs_dflash.all'); statement: the claim in one
    line; paper: the paper's number as text ('–' when it has none); ours: our estimate as the report prints it,
    with its interval ('+9.1% [+4.0%, +14.2%]'); mean, low, high: that effect and interval as floats (NaN when
    none; a relative gain is a fraction); runs: runs per arm (the smaller arm); seeds: the arms' seeds ('0,1');
    verdict: `verdict_of(low, high, runs=runs, paper_effect=paper_effect)`, checked on construction; scope: what
    was compared, over what, and how the interval was made; paper_effect: the paper's effect size on the scale of
    `mean` for a magnitude claim (NaN: a direction claim).
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
    paper_effect: float = math.nan

    def __post_init__(self) -> None:
        derived = verdict_of(self.low, self.high, runs=self.runs, paper_effect=self.paper_effect)
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
        paper_effect: float = math.nan,
    ) -> Claim:
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
            verdict=verdict_of(low, high, runs=runs, paper_effect=paper_effect),
            scope=scope,
            paper_effect=paper_effect,
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
    """The Claim of a judged difference a − b (relative to b, or absolute): the numbers `judged` prints; the scope
    says how the interval was made (`stat_note`)."""
    runs = diff.runs
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
            scope=f"{scope}; {stat_note(diff, runs=runs)}",
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
    interval: GainChange, *, id: str, statement: str, paper: str, ours: str, runs: int, seeds: str, scope: str
) -> Claim:
    """The Claim of a `GainChange` (a magnitude claim when it carries the paper's change)."""
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
        scope=f"{scope}; {stat_note(interval, runs=runs)}",
        paper_effect=interval.paper_effect,
    )
