"""The statistics rule of `dspark.reports.claims` (docs/STATISTICS.md) against hand computations: Student-t
intervals on the Welch–Satterthwaite df (2 seeds: t(1)-scale where the seed term dominates), the one-seed cap
("seed variance not measured"), Holm within a family, the "≥ in every domain" summary, magnitude claims against the
paper's size, figure intervals clipped to [0, 1], and the checks the results index runs on a claims file. Each case
has a control that the same code must tell apart."""

from __future__ import annotations

import math

import polars as pl
import pytest

from dspark.intervals import t_quantile_df
from dspark.reports.claims import (
    NOT_REPRODUCED,
    ONE_SEED,
    Claim,
    Difference,
    GainChange,
    Pooled,
    Term,
    every_scope,
    holm,
    pooled_plain,
    pooled_tau,
    satterthwaite,
    verdict_of,
)
from dspark.reports.plots import Band, error_bars, plot_lines
from dspark.reports.stats import Estimate
from dspark.results.claims import Claim as IndexClaim
from dspark.results.claims import claim_disagreement

T1 = 12.706204736174694  # Student-t 97.5% quantile, 1 df (tables)
T2 = 4.302652729911275  # 2 df


def runs(values: list[float], half: float = 0.0, prompts: int = 60, scope: str = "eval/all") -> pl.DataFrame:
    """One row per run: a per-prompt τ and its 95% half-width over `prompts` prompts (0: no within-run spread)."""
    return pl.DataFrame(
        {
            f"{scope}/tau_prompt_mean": values,
            f"{scope}/tau_prompt_ci95": [half] * len(values),
            f"{scope}/prompts": [float(prompts)] * len(values),
        }
    )


# ---- degrees of freedom ----


def test_two_seeds_give_a_t1_interval_when_the_seed_term_dominates():
    """Seeds 2.0 and 2.2, no within-run spread: SE² = s²/n = 0.02/2, df = 1, so the half-width is t(1)·0.1 — 6.5×
    the 1.96·0.1 the normal interval used to print."""
    arm = pooled_tau(runs([2.0, 2.2]))
    assert arm.se == pytest.approx(0.1) and arm.df == pytest.approx(1.0)
    assert arm.high - arm.mean == pytest.approx(T1 * 0.1)
    assert arm.low == pytest.approx(2.1 - 1.27062, abs=1e-5)
    # control: the same spread measured on 40 seeds is a normal-scale interval (df 39)
    many = pooled_tau(runs([2.0, 2.2] * 20))
    assert many.df == pytest.approx(39.0) and many.high - many.mean < 2.1 * many.se


def test_a_difference_of_two_seed_dominated_arms_has_welch_df():
    """Two arms, each 2 seeds, equal seed variances: Welch's df = (v + v)² / (v²/1 + v²/1) = 2, t(2) = 4.30."""
    a, b = pooled_tau(runs([2.0, 2.2])), pooled_tau(runs([1.5, 1.7]))
    diff = Difference(a, b)
    assert diff.df == pytest.approx(2.0) and diff.se == pytest.approx(math.sqrt(0.02))
    assert diff.high - diff.mean == pytest.approx(T2 * math.sqrt(0.02))
    # 0.5 − 4.3027·0.1414 = −0.108: not resolved, where the normal interval (the old rule) excluded 0
    assert diff.low == pytest.approx(0.5 - T2 * math.sqrt(0.02)) and diff.verdict == "not resolved"
    assert diff.mean - 1.959964 * diff.se > 0
    # control: 40 seeds per arm with the same spread resolve it (df ≈ 78, t ≈ 1.99)
    many = Difference(pooled_tau(runs([2.0, 2.2] * 20)), pooled_tau(runs([1.5, 1.7] * 20)))
    assert many.df == pytest.approx(78.0) and many.verdict == "holds"


def test_prompt_terms_dominate_when_the_seeds_agree():
    """Seeds 2.0 and 2.0 with half-width 0.2 over 60 prompts: the seed term is 0, the prompt terms (df 59 each)
    make df = (v+v)²/(v²/59 + v²/59) = 118 — the interval is close to the normal one, not t(1)."""
    arm = pooled_tau(runs([2.0, 2.0], half=0.2))
    se_run = 0.2 / t_quantile_df(59)
    assert arm.se == pytest.approx(math.sqrt(2 * se_run**2 / 4))
    assert arm.df == pytest.approx(118.0)
    assert arm.high - arm.mean == pytest.approx(t_quantile_df(118.0) * arm.se)
    # control: with the seeds 0.2 apart, the seed term (0.01, 1 df) comes back and dominates the df
    spread = pooled_tau(runs([1.9, 2.1], half=0.2))
    within = se_run**2 / 4
    assert spread.df == pytest.approx((0.01 + 2 * within) ** 2 / (0.01**2 + 2 * within**2 / 59))
    assert spread.df < 2.5 and spread.high - spread.mean > 3 * (arm.high - arm.mean)


def test_satterthwaite_by_hand():
    terms = [Term(0.01, 1.0, seed=True), Term(0.004, 59.0)]
    assert satterthwaite(terms) == pytest.approx(0.014**2 / (0.01**2 / 1 + 0.004**2 / 59))
    assert satterthwaite([Term(0.01, math.inf)]) == math.inf and satterthwaite([]) == math.inf
    assert satterthwaite([Term(0.0, 1.0), Term(0.01, 3.0)]) == pytest.approx(3.0)  # a zero term carries no df


def test_pooled_plain_is_the_student_t_interval_over_runs():
    """A metric with no within-run spread: its interval is exactly the Student-t interval over runs (n − 1 df)."""
    rows = pl.DataFrame({"val/tau_prob": [1.50, 1.52, 1.55]})
    pooled = pooled_plain(rows, "val/tau_prob")
    mean = (1.50 + 1.52 + 1.55) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in (1.50, 1.52, 1.55)) / 2)
    assert pooled.df == pytest.approx(2.0) and pooled.high - pooled.mean == pytest.approx(T2 * sd / math.sqrt(3))
    assert math.isnan(pooled_plain(rows.head(1), "val/tau_prob").se)  # one run: no interval at all


# ---- one seed ----


def test_one_seed_reads_seed_variance_not_measured():
    """One run per arm, a within-run interval that excludes 0: the verdict is withheld, and the line says why;
    control: the same interval with 2 runs per arm holds."""
    a, b = pooled_tau(runs([2.0], half=0.1)), pooled_tau(runs([1.8], half=0.1))
    one = Difference(a, b)
    assert one.low > 0 and one.verdict == ONE_SEED
    assert verdict_of(one.low, one.high, runs=1) == ONE_SEED and verdict_of(one.low, one.high, runs=2) == "holds"
    assert verdict_of(-0.3, -0.1, runs=1) == ONE_SEED and verdict_of(-0.3, -0.1, runs=2) == "reversed"
    # an interval spanning 0 stays not resolved (a seed term could only widen it)
    assert verdict_of(-0.1, 0.3, runs=1) == "not resolved"
    from dspark.reports.claims import judged

    assert "seed variance not measured) → **seed variance not measured**" in judged("all", one)


# ---- magnitude claims ----


def test_a_magnitude_claim_excluding_the_papers_size_is_not_reproduced():
    """The block-size growth: ours +0.8% [−5.0%, +6.6%] against the paper's +9.7 points."""
    assert verdict_of(-0.050, 0.066, runs=2, paper_effect=0.097) == NOT_REPRODUCED
    assert verdict_of(-0.050, 0.066, runs=2) == "not resolved"  # control: direction only
    assert verdict_of(-0.050, 0.120, runs=2, paper_effect=0.097) == "not resolved"  # spans the paper's size
    assert verdict_of(0.010, 0.066, runs=2, paper_effect=0.097) == NOT_REPRODUCED  # above 0, below the paper's
    assert verdict_of(0.050, 0.150, runs=2, paper_effect=0.097) == "holds"
    assert verdict_of(-0.2, -0.1, runs=2, paper_effect=0.097) == "reversed"
    assert verdict_of(-0.050, 0.066, runs=1, paper_effect=0.097) == ONE_SEED  # one seed: withheld
    claim = Claim.judge(
        id="x.g.all", statement="s", paper="p", ours="o", mean=0.008, low=-0.05, high=0.066, runs=2, seeds="0,1",
        scope="s", paper_effect=0.097,
    )  # fmt: skip
    assert claim.verdict == NOT_REPRODUCED and claim.to_dict()["paper_effect"] == 0.097


def test_a_gain_change_carries_the_papers_size_into_its_verdict():
    change = GainChange(0.008, (Term(0.0003, 60.0), Term(0.0006, 60.0)), 2, paper_effect=0.097)
    assert change.claim_verdict == NOT_REPRODUCED and change.verdict == NOT_REPRODUCED
    assert GainChange(0.008, change.terms, 2).verdict == "not resolved"
    assert GainChange(0.2, change.terms, 2).verdict == "grows"


# ---- Holm ----


def test_holm_on_a_seeded_family_by_hand():
    """Three domains with normal intervals (df ∞) and z = 2.5, 2.2, 1.0: p = 0.01242, 0.02781, 0.31731.
    Holm: 3·0.01242 = 0.0373 < 0.05 rejects, 2·0.02781 = 0.0556 stops, the rest stay — so math holds, code and
    chat are not resolved, although code's unadjusted 95% interval excludes 0 (the control)."""
    family = {
        "math": Difference(Pooled(2.5, 0.0, 2), Pooled(0.0, 1.0, 2)),
        "code": Difference(Pooled(2.2, 0.0, 2), Pooled(0.0, 1.0, 2)),
        "chat": Difference(Pooled(1.0, 0.0, 2), Pooled(0.0, 1.0, 2)),
    }
    p = {k: d.p_value for k, d in family.items()}
    assert p["math"] == pytest.approx(0.012419, abs=1e-6) and p["code"] == pytest.approx(0.027807, abs=1e-6)
    assert family["code"].verdict == "holds"  # unadjusted
    adjusted = holm(family)
    assert {k: d.verdict for k, d in adjusted.items()} == {
        "math": "holds",
        "code": "not resolved",
        "chat": "not resolved",
    }
    # the printed levels: 1 − 0.05·p/p̃ with p̃ = 3·p_math, max(3·p_math, 2·p_code), max(…, 1·p_chat)
    assert adjusted["math"].confidence == pytest.approx(1 - 0.05 / 3)
    assert adjusted["code"].confidence == pytest.approx(1 - 0.05 / 2)
    assert adjusted["chat"].confidence == pytest.approx(0.95)
    assert "Holm 98.3%" in adjusted["math"].stat_text() and "Holm" not in adjusted["chat"].stat_text()
    # control: a family of one is a plain 95% test
    assert holm({"all": family["code"]})["all"].verdict == "holds"


def test_holm_intervals_agree_with_the_adjusted_test():
    """For every member, the widened interval excludes 0 exactly when Holm's adjusted p-value is below 0.05."""
    means = [3.0, 2.45, 2.3, 1.9, 0.5]
    family = {i: Difference(Pooled(m, 0.0, 2), Pooled(0.0, 1.0, 2)) for i, m in enumerate(means)}
    ordered = sorted(family, key=lambda k: family[k].p_value)
    adjusted_p, running = {}, 0.0
    for rank, key in enumerate(ordered):
        running = max(running, min(1.0, (len(means) - rank) * family[key].p_value))
        adjusted_p[key] = running
    for key, diff in holm(family).items():
        assert (diff.low > 0) == (adjusted_p[key] < 0.05), (key, diff.low, adjusted_p[key])


# ---- "≥ in every domain" ----


def test_every_domain_is_not_resolved_when_one_domain_is():
    """The seeded depth case: math and code hold, chat's interval spans 0 → the claim is not resolved (it used to
    print holds, 'no domain significantly below'); controls: all hold → holds, one reversed → reversed."""
    verdicts = {"math": "holds", "code": "holds", "chat": "not resolved"}
    assert every_scope(verdicts).startswith("**not resolved** (2 of 3 hold; chat not resolved)")
    assert every_scope({"math": "holds", "code": "holds"}) == "**holds**"
    assert every_scope({"math": "holds", "chat": "reversed"}) == "**reversed** in chat"
    assert every_scope({"math": "holds", "chat": ONE_SEED}).startswith("**not resolved**")


def test_the_depth_report_prints_not_resolved_for_the_at_least_claim(tmp_path):
    """End to end through the depth report: a 2-layer DSpark well above DFlash-5 on math and code, level on chat."""
    from dspark.reports.collect import SweepRuns
    from dspark.reports.context import REPORT_BUILDERS, ReportContext

    def cell(drafter: str, depth: int, seed: int, shift: dict[str, float]) -> dict:
        row = {"run_id": f"{drafter}{depth}-{seed}", "drafter": drafter, "model.head": "markov", "seed": seed}
        row |= {"axis.drafter": drafter, "axis.model.depth": depth, "axis.seed": seed}
        for scope in ("all", "math", "code", "chat"):
            prefix = "eval/all" if scope == "all" else f"eval/domain/{scope}"
            value = 1.3 + shift.get(scope, 0.0) + 0.002 * seed
            row |= {f"{prefix}/tau": value, f"{prefix}/tau_prompt_mean": value}
            row |= {f"{prefix}/tau_prompt_ci95": 0.03, f"{prefix}/prompts": 20.0}
        return row | {"summary/tau": row["eval/all/tau"]}

    def report(chat: float) -> str:
        up = {"all": 0.15, "math": 0.2, "code": 0.2, "chat": chat}
        rows = [cell("dspark", 2, s, up) for s in (0, 1)] + [cell("dflash", 5, s, {}) for s in (0, 1)]
        ctx = ReportContext(
            name="depth", runs=SweepRuns(sweep="depth", parent=None, frame=pl.DataFrame(rows)), out_dir=tmp_path
        )
        return "\n".join(s.body for s in REPORT_BUILDERS.resolve("depth")(ctx))

    line = next(x for x in report(0.0).splitlines() if "≥ DFlash depth 5 in every domain" in x)
    assert "**not resolved** (2 of 3 hold; chat not resolved)" in line, line
    control = next(x for x in report(0.2).splitlines() if "≥ DFlash depth 5 in every domain" in x)
    assert control.endswith("**holds**"), control


# ---- figures ----


def test_figure_intervals_are_clipped_to_the_unit_interval(tmp_path):
    """A cond@k of 0.05 with a t(1) interval [−4.1, +4.2] is drawn from 0 to 1, never below 0 or above 1; the
    control without `clip` draws the raw interval."""
    wide = Estimate(0.05, 4.15, 2)  # what the n = 2 Student-t bars used to draw
    centres, below, above = error_bars([wide], clip=(0.0, 1.0))
    assert centres == [0.05] and below[0] == pytest.approx(0.05) and above[0] == pytest.approx(0.95)
    raw = error_bars([wide])
    assert raw[1][0] == pytest.approx(4.15) and raw[2][0] == pytest.approx(4.15)
    # a point outside the range is drawn at the bound, with no bar past it
    assert error_bars([Band(1.2, 1.1, 1.3)], clip=(0.0, 1.0)) == ([1.0], [0.0], [0.0])
    assert error_bars([Estimate(float("nan"), float("nan"), 0)], clip=(0.0, 1.0)) == ([0.0], [0.0], [0.0])
    path = plot_lines(
        {"math": {"cond": [(1, wide), (2, Band(0.3, 0.25, 0.35))]}},
        tmp_path / "cond.png",
        xlabel="k",
        ylabel="cond@k",
        clip=(0.0, 1.0),
        references={"math": {"paper": [(1, 0.93)]}},
    )
    assert path.is_file() and path.stat().st_size > 0


def test_figures_draw_the_judged_interval_not_the_runs_t_bars():
    """A pooled per-prompt τ (what the figures draw) and the table's Student-t over two runs differ: the pooled
    interval carries the prompts' spread and the seeds' on their Satterthwaite df."""
    rows = runs([1.40, 1.42], half=0.05)
    judged = pooled_tau(rows)
    table = Estimate(1.41, T1 * 0.01, 2)  # mean ± t(1)·s/√2 of the two run means
    assert judged.mean == pytest.approx(table.mean)
    assert judged.high - judged.mean < table.high - table.mean  # the prompt terms lift the df above 1
    assert judged.high - judged.mean == pytest.approx(t_quantile_df(judged.df) * judged.se)


# ---- the results index's data check ----


def test_the_index_checks_a_claims_files_verdicts_against_their_data():
    def claim(id: str, verdict: str, low: float, high: float, runs: int, effect: float | None = None) -> IndexClaim:
        return IndexClaim(
            id=id, statement="", paper="", verdict=verdict, low=low, high=high, runs=runs, paper_effect=effect
        )

    good = [
        claim("a", "holds", 0.1, 0.2, 2),
        claim("b", ONE_SEED, 0.1, 0.2, 1),
        claim("c", "not resolved", -0.1, 0.2, 1),
        claim("d", NOT_REPRODUCED, -0.05, 0.066, 2, 0.097),
        claim("e", ONE_SEED, -0.05, 0.066, 1, 0.097),
    ]
    assert [claim_disagreement(c) for c in good] == [None] * len(good)
    bad = [
        claim("f", "holds", 0.1, 0.2, 1),
        claim("g", ONE_SEED, 0.1, 0.2, 2),
        claim("h", ONE_SEED, -0.1, 0.2, 1),
        claim("i", NOT_REPRODUCED, -0.05, 0.12, 2, 0.097),
    ]
    assert [(claim_disagreement(c) or "").split(":")[0] for c in bad] == ["f", "g", "h", "i"]
