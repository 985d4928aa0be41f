"""Names come from the registries: a newly registered head, drafter or policy reaches the report comparisons and the
parametrized lossless / export round-trip tests with no further edit, or fails a test that names the missing piece.
And the reports' judged claims as data (`dspark.reports.claims.Claim`): every verdict agrees with its interval, and
every interval claim carries the numbers the report prints.

A throwaway head (`ScratchHead`) is registered by a fixture and removed again in its teardown; the report builders
run on synthetic runs frames (no tracking store needed: a `SweepRuns` over a polars frame).
"""

from __future__ import annotations

import math

import polars as pl
import pytest
from torch import Tensor, nn

from dspark.config import schema
from dspark.decoding.policies import POLICIES
from dspark.decoding.tree import TREE_SHAPES
from dspark.decoding.tree_verify import TREE_SCHEMES
from dspark.drafters.factory import DRAFTER_BUILDERS
from dspark.drafters.heads import SEQUENTIAL_HEADS, SequentialHead
from dspark.interop.layouts import LAYOUTS, markov_head_type
from dspark.registry import Registry
from dspark.reports.claims import VERDICTS, Claim, verdict_of
from dspark.reports.collect import SweepRuns
from dspark.reports.context import REPORT_BUILDERS, ReportContext
from dspark.training.steps import TRAINING_STEPS
from test_interop import export_gaps, round_trip_cases
from test_lossless import lossless_drafters

import dspark.reports  # noqa: F401  (registers the report builders)

SCRATCH = "scratch"


class ScratchHead(SequentialHead):
    """A throwaway head: B_k = 0 with a W_1 table (enough to be built and to feed the confidence head)."""

    def __init__(self, *, hidden_size: int, vocab_size: int, rank: int, output_size: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        self.w1 = nn.Embedding(vocab_size, rank)

    def prev_token_embedding(self, prev_tokens: Tensor) -> Tensor:
        return self.w1(prev_tokens)


@pytest.fixture()
def scratch_head():
    """`ScratchHead` registered as model.head=scratch for one test, unregistered in the teardown."""
    SEQUENTIAL_HEADS.add(SCRATCH, ScratchHead)
    try:
        yield SCRATCH
    finally:
        SEQUENTIAL_HEADS.unregister(SCRATCH)


# ---- synthetic runs frames ----


def sweep_runs(cells: list[tuple[dict, dict[str, float]]]) -> SweepRuns:
    """One completed run per (axes, metrics), with the run tags a collected frame has (drafter, model.head, seed)."""
    rows = []
    for index, (axes, metrics) in enumerate(cells):
        drafter = axes.get("drafter", "dspark")
        head = axes.get("model.head", "markov" if drafter == "dspark" else "none")
        rows.append(
            {
                "run_id": f"run-{index}",
                "drafter": drafter,
                "model.head": head,
                "seed": axes["seed"],
                **{f"axis.{k}": v for k, v in axes.items()},
                **metrics,
            }
        )
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return SweepRuns(sweep="synthetic", parent=None, frame=pl.DataFrame([{k: r.get(k) for k in keys} for r in rows]))


def rollout_metrics(
    tau: float,
    seed: int,
    *,
    cond2: float = 0.3,
    domains: dict[str, float] | None = None,
    sets: dict[str, float] | None = None,
) -> dict[str, float]:
    """Per-prompt τ with its interval for `all` and each domain (a shift per domain), cond@k counters, τ_prob."""
    out = {}
    for domain, shift in {"all": 0.0, **(domains or {"math": 0.05, "code": 0.0, "chat": -0.05})}.items():
        scope = "eval/all" if domain == "all" else f"eval/domain/{domain}"
        value = tau + shift
        out |= {
            f"{scope}/tau": value,
            f"{scope}/tau_prompt_mean": value + 0.002 * seed,
            f"{scope}/tau_prompt_ci95": 0.02,
            f"{scope}/prompts": 40.0,
        }
    out |= {f"eval/{name}/tau": tau + shift for name, shift in (sets or {}).items()}
    out |= {
        "eval/all/rounds": 2000.0,
        "eval/all/survival/pos1": 0.3,
        "eval/all/cond/pos1": 0.3,
        "eval/all/cond/pos2": cond2 + 0.001 * seed,
        "val/accept/pos1": 0.3 + 0.001 * seed,
        "val/accept/pos2": cond2 + 0.002 * seed,
        "val/tau_prob": tau + 0.1 + 0.003 * seed,
        "summary/tau": tau,
    }
    return out


def build(name: str, cells: list[tuple[dict, dict[str, float]]], tmp_path) -> tuple[str, ReportContext]:
    """Run the `name` report builder over the synthetic cells: (its markdown body, the context with its claims)."""
    ctx = ReportContext(name=name, runs=sweep_runs(cells), out_dir=tmp_path)
    sections = REPORT_BUILDERS.resolve(name)(ctx)
    return "\n\n".join(f"## {s.title}\n\n{s.body}" for s in sections), ctx


def head_cells(heads: dict[str, tuple[float, float]]) -> list[tuple[dict, dict[str, float]]]:
    """Two seeds per head: {head: (τ, cond@2)}."""
    return [
        ({"model.head": head, "seed": seed}, rollout_metrics(tau, seed, cond2=cond2))
        for seed in (0, 1)
        for head, (tau, cond2) in heads.items()
    ]


# ---- (a) a registered head enters the report's comparisons ----


def test_a_registered_head_is_compared_in_the_head_report(scratch_head, tmp_path):
    text, ctx = build(
        "head",
        head_cells({"none": (1.30, 0.10), "markov": (1.50, 0.30), "rnn": (1.51, 0.31), scratch_head: (1.20, 0.05)}),
        tmp_path,
    )
    ids = {c.id for c in ctx.claims}
    assert f"{scratch_head} vs none, 95% CIs:" in text and f"- {scratch_head} vs markov: " in text
    assert {
        f"head.{scratch_head}_vs_none.all",
        f"head.{scratch_head}_vs_markov.all",
        f"head.{scratch_head}_vs_none.cond2",
    } <= ids, sorted(ids)
    # registration order: none is the reference; markov, rnn, then the new head against it
    order = [h for h in ("markov", "rnn", scratch_head) if f"{h} vs none, 95% CIs:" in text]
    assert sorted(order, key=text.index) == ["markov", "rnn", scratch_head]
    assert next(c for c in ctx.claims if c.id == f"head.{scratch_head}_vs_none.all").verdict == "reversed"


def test_without_the_registration_the_head_is_not_compared(tmp_path):
    """Runs of a head the registry does not know (renamed, removed) appear in the table, not in the claims."""
    text, ctx = build(
        "head", head_cells({"none": (1.30, 0.10), "markov": (1.50, 0.30), SCRATCH: (1.2, 0.05)}), tmp_path
    )
    assert f"{SCRATCH} vs none" not in text and not any(SCRATCH in c.id for c in ctx.claims)
    assert f"DSpark ({SCRATCH})" in text  # still a row of the τ table


# ---- (b) the lossless and round-trip parameters come from the registry ----


def test_a_registered_head_enters_the_lossless_and_round_trip_parameters(scratch_head):
    assert lossless_drafters()[f"dspark-{scratch_head}"] == ("dspark", scratch_head)
    assert all(
        ("qwen3" if layout == "speculators" else "llama", layout, "dspark", scratch_head) in round_trip_cases()
        for layout in LAYOUTS
    )


def test_a_head_without_an_export_mapping_fails_naming_the_missing_map(scratch_head):
    gaps = export_gaps(SEQUENTIAL_HEADS.ordered(), DRAFTER_BUILDERS.ordered())
    assert gaps and all(scratch_head in gap and "HEAD_TO_MARKOV_TYPE" in gap for gap in gaps), gaps
    for layout in LAYOUTS:  # the round trip it entered fails with the same fix named
        with pytest.raises(ValueError, match=f"export.layout={layout}: model.head='{scratch_head}'.*HEAD_TO_MARKOV"):
            markov_head_type(scratch_head, layout=layout)


def test_the_registry_is_restored_after_the_throwaway_head():
    assert SCRATCH not in SEQUENTIAL_HEADS and f"dspark-{SCRATCH}" not in lossless_drafters()
    assert not export_gaps(SEQUENTIAL_HEADS.ordered(), DRAFTER_BUILDERS.ordered())


def test_registry_order_labels_and_unregister():
    registry: Registry[int] = Registry("thing")
    registry.add("b", 1, label="Bee")
    registry.add("a", 2)
    assert registry.ordered() == ["b", "a"] and registry.names() == ["a", "b"]
    assert registry.label("b") == "Bee" and registry.label("a") == "a"
    assert registry.unregister("b") == 1 and registry.ordered() == ["a"] and registry.label("b") == "b"
    assert DRAFTER_BUILDERS.label("eagle3") == "EAGLE-3"


def test_the_config_schema_accepts_every_registered_name():
    """config.schema keeps its own lists (the config layer sits below the drafters): they must match the registries."""
    assert set(schema.HEADS) == set(SEQUENTIAL_HEADS.names()), "config.schema.HEADS must list every registered head"
    assert set(schema.DRAFTERS) == set(DRAFTER_BUILDERS.names()), "config.schema.DRAFTERS: every registered drafter"
    for kind in DRAFTER_BUILDERS.ordered():
        assert kind in schema.FIXED_HEAD and kind in schema.CONFIDENCE_HEAD, (
            f"drafter={kind!r}: add it to config.schema.FIXED_HEAD and CONFIDENCE_HEAD"
        )
        assert kind in TRAINING_STEPS, f"drafter={kind!r}: register its training step in training.steps"
    assert set(schema.POLICIES) == set(POLICIES.names()), "config.schema.POLICIES must list every registered policy"
    assert set(schema.TREE_SHAPES) == set(TREE_SHAPES.names()), "config.schema.TREE_SHAPES: every registered shape"
    assert set(schema.TREE_SCHEMES) == set(TREE_SCHEMES.names()), "config.schema.TREE_SCHEMES: every tree scheme"


# ---- claims as data ----


def check_claims(ctx: ReportContext, text: str) -> None:
    """Every claim's verdict is its interval's; ids are unique; an interval claim's numbers are the printed ones."""
    ids = [c.id for c in ctx.claims]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for claim in ctx.claims:
        assert claim.verdict in VERDICTS and claim.verdict == verdict_of(claim.low, claim.high, runs=claim.runs)
        assert claim.id.startswith(f"{ctx.name}.") and claim.statement and claim.scope and claim.paper
        if claim.verdict in ("holds", "reversed", "not resolved"):
            assert claim.low <= claim.mean <= claim.high, claim
            assert claim.ours in text, (claim.id, claim.ours)
        assert claim.to_dict()["verdict"] == claim.verdict


def test_claim_verdicts_are_read_from_the_interval():
    assert verdict_of(0.01, 0.2, runs=2) == "holds" and verdict_of(-0.2, -0.01, runs=2) == "reversed"
    assert verdict_of(-0.1, 0.1, runs=2) == "not resolved" and verdict_of(math.nan, math.nan, runs=1) == "no interval"
    assert verdict_of(math.nan, math.nan, runs=0) == "not run yet"
    claim = Claim.judge(
        id="x.y.all", statement="s", paper="p", ours="+1.0% (no interval)", mean=0.01, runs=1, seeds="0", scope="s"
    )
    assert claim.verdict == "no interval" and claim.to_dict()["low"] is None and claim.to_dict()["mean"] == 0.01
    with pytest.raises(ValueError, match="disagrees with its interval"):
        Claim(
            id="x.y.all",
            statement="s",
            paper="p",
            ours="o",
            low=0.1,
            high=0.2,
            mean=0.15,
            runs=2,
            seeds="0,1",
            verdict="reversed",
            scope="s",
        )


def test_head_report_claims(tmp_path):
    text, ctx = build(
        "head", head_cells({"none": (1.30, 0.10), "markov": (1.50, 0.30), "rnn": (1.501, 0.30)}), tmp_path
    )
    check_claims(ctx, text)
    verdicts = {c.id: c.verdict for c in ctx.claims}
    assert verdicts["head.markov_vs_none.all"] == "holds" and verdicts["head.markov_vs_none.cond2"] == "holds"
    assert verdicts["head.rnn_vs_markov.all"] == "not resolved"
    assert next(c for c in ctx.claims if c.id == "head.markov_vs_none.all").seeds == "0,1"


def test_main_report_claims(tmp_path):
    """Per pair of drafters: the macro gain (a point estimate, the paper's headline) and per-prompt τ per scope."""
    from dspark.reports.paper import DATASETS

    taus = {"dspark": 1.6, "dflash": 1.4, "eagle3": 1.35}
    cells = [
        ({"drafter": d, "seed": s}, rollout_metrics(t, s, sets={name: 0.01 * i for i, name in enumerate(DATASETS)}))
        for s in (0, 1)
        for d, t in taus.items()
    ]
    text, ctx = build("main", cells, tmp_path)
    check_claims(ctx, text)
    claims = {c.id: c for c in ctx.claims}
    headline = claims["main.dspark_vs_eagle3.macro"]
    assert headline.verdict == "no interval" and headline.paper.startswith("+30.9%") and headline.runs == 2
    assert claims["main.dspark_vs_dflash.macro"].paper.startswith("+16.3%")
    assert claims["main.dspark_vs_dflash.all"].verdict == "holds"
    assert claims["main.dflash_vs_eagle3.math"].paper.endswith("(Table 1, math sets, Qwen3-4B)")


def test_depth_report_claims(tmp_path):
    taus = {1: 1.30, 2: 1.45, 3: 1.50}
    cells = [
        ({"drafter": "dspark", "model.depth": d, "seed": s}, rollout_metrics(t, s))
        for s in (0, 1)
        for d, t in taus.items()
    ]
    cells += [({"drafter": "dflash", "model.depth": 5, "seed": s}, rollout_metrics(1.35, s)) for s in (0, 1)]
    text, ctx = build("depth", cells, tmp_path)
    check_claims(ctx, text)
    verdicts = {c.id: c.verdict for c in ctx.claims}
    assert verdicts["depth.dspark2_vs_dflash5.all"] == "holds" and "depth.dspark2_vs_dflash5.chat" in verdicts
    assert verdicts["depth.dspark3_vs_dspark1.all"] == "holds" and "depth.dspark3_vs_dspark1.tau_prob" in verdicts


def test_depth_claims_without_rollout_intervals_are_point_estimates(tmp_path):
    """Cells that logged only pooled τ: the 2-layer claim is printed on point estimates, recorded without interval."""
    cells = [
        (
            {"drafter": d, "model.depth": depth, "seed": 0},
            {"eval/domain/math/tau": t, "eval/all/tau": t, "summary/tau": t, "val/tau_prob": t},
        )
        for d, depth, t in (("dspark", 2, 1.4), ("dflash", 5, 1.5))
    ]
    text, ctx = build("depth", cells, tmp_path)
    check_claims(ctx, text)
    claim = next(c for c in ctx.claims if c.id == "depth.dspark2_vs_dflash5.math")
    assert claim.verdict == "no interval" and claim.ours == "-6.7% (no interval)" and "math -6.7%" in text


def test_block_size_report_claims(tmp_path):
    per_gamma = {
        ("dspark", "markov", 3): 1.50,
        ("dspark", "markov", 15): 1.80,
        ("dspark", "rnn", 3): 1.50,
        ("dspark", "rnn", 15): 1.85,
        ("dflash", "none", 3): 1.40,
        ("dflash", "none", 15): 1.40,
    }
    cells = [
        (
            {"drafter": d, "model.block_size": g, "seed": s} | ({"model.head": h} if d == "dspark" else {}),
            rollout_metrics(t, s),
        )
        for s in (0, 1)
        for (d, h, g), t in per_gamma.items()
    ]
    text, ctx = build("block_size", cells, tmp_path)
    check_claims(ctx, text)
    verdicts = {c.id: c.verdict for c in ctx.claims}
    assert verdicts["block_size.dspark_markov_vs_dflash_growth.all"] == "holds"
    assert verdicts["block_size.dspark_markov_vs_dflash.g15"] == "holds"
    assert verdicts["block_size.dspark_rnn_vs_dspark_markov.g15"] == "holds"
    assert "block_size.dspark_markov_vs_dflash_growth.math" in verdicts
    assert "block_size.dspark_markov_vs_dflash_growth_points.rollout" in verdicts


def test_threshold_and_calibration_report_claims(tmp_path):
    def metrics(theta: float, seed: int) -> dict[str, float]:
        out = {}
        for domain in ("math", "chat"):
            out |= {
                f"eval/domain/{domain}/tau": 1.4 - 0.2 * theta + 0.01 * seed,
                f"eval/domain/{domain}/verify_rate": 0.5 + 0.4 * theta + 0.01 * seed,
            }
        for k in (1, 2):
            out |= {
                f"calibration/ece_before/pos{k}": 0.08 + 0.002 * seed,
                f"calibration/ece_after/pos{k}": 0.02 + 0.003 * seed,
                f"calibration/auroc_before/pos{k}": 0.7,
                f"calibration/auroc_after/pos{k}": 0.7,
            }
        return out

    cells = [({"decode.threshold": theta, "seed": s}, metrics(theta, s)) for s in (0, 1) for theta in (0.0, 0.5)]
    text, ctx = build("threshold", cells, tmp_path)
    check_claims(ctx, text)
    assert {c.id: c.verdict for c in ctx.claims}["threshold.verify_rate.math"] == "holds"
    text, ctx = build("calibration", cells[:1] + cells[2:3], tmp_path)
    check_claims(ctx, text)
    assert {c.id: c.verdict for c in ctx.claims}["calibration.ece_drop.pos1"] == "holds"


def test_latency_and_serving_report_claims(tmp_path):
    """Point claims only (a share's range over cells, a median over matched points): verdict 'no interval'; every
    registered non-static policy served is compared with MTP-1."""
    phases = ("verify_ms", "draft_parallel_ms", "draft_sequential_ms", "other_ms", "round_ms", "sequential_share")
    cells = [
        (
            {"model.head": head, "model.block_size": 7, "seed": 0},
            {
                f"latency/ctx{length}/{p}": value
                for length in (512, 1024)
                for p, value in zip(phases, (10.0, 2.0, share * 13, 1.0, 13.0 + share * 13, share))
            },
        )
        for head, share in (("none", 0.0), ("markov", 0.004), ("rnn", 0.012))
    ]
    text, ctx = build("latency", cells, tmp_path)
    check_claims(ctx, text)
    claims = {c.id: c for c in ctx.claims}
    assert set(claims) == {
        "latency.sequential_share.markov",
        "latency.sequential_share.rnn",
        "latency.overhead_vs_dflash.markov.r1",
        "latency.overhead_vs_dflash.rnn.r1",
    }
    # DSpark vs DFlash at γ = 7 (Fig. 4 right): (13 + 0.012·13) / 13 − 1 = +1.2% for rnn, a point claim
    assert claims["latency.overhead_vs_dflash.rnn.r1"].mean == pytest.approx(0.012)
    assert (
        claims["latency.sequential_share.rnn"].verdict == "no interval"
        and "1.20%" in claims["latency.sequential_share.rnn"].ours
    )

    speed = {"mtp1": 1.0, "static": 1.2, "fixed": 1.1, "scheduler": 1.4, "threshold": 1.3}
    cells = []
    for policy, gain in speed.items():
        for level in (1, 2, 4):
            throughput = 10 * level * (gain / (1 + 0.1 * level) if policy != "mtp1" else 1 / (1 + 0.05 * level))
            cells += [
                (
                    {"serve.policy": policy, "serve.concurrency": level, "seed": s},
                    {
                        "serve/throughput": throughput + 0.01 * s,
                        "serve/user_speed": throughput / level,
                        "serve/budget": 2.0,
                        "serve/tau": 1.5,
                        "serve/num_requests": 4.0,
                        "serve/steps": 10.0,
                        "serve/wall_seconds": 1.0,
                    },
                )
                for s in (0, 1)
            ]
    text, ctx = build("serving", cells, tmp_path)
    check_claims(ctx, text)
    claims = {c.id: c for c in ctx.claims}
    assert {
        "serving.threshold_vs_mtp1.user_speed",
        "serving.scheduler_vs_mtp1.user_speed",
        "serving.scheduler_vs_best_static.throughput",
        "serving.scheduler_budget_vs_load",
    } == set(claims)
    assert claims["serving.scheduler_vs_mtp1.user_speed"].paper.startswith("1.60–1.85×")
    assert all(c.verdict == "no interval" and c.runs == 2 and c.seeds == "0,1" for c in claims.values())
