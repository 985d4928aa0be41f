"""The `tree` sweep (sweeps/tree.yaml) and its report (`dspark.reports.trees`): the spec plans four shapes per drafter
at one node budget, sharing each drafter's training; the report builder, on synthetic runs frames (no store, no
decoding), tables τ, nodes per round and the speed-up per shape, and judges "trees beat chains" per drafter only where
the interval says so: a drafter whose trees tie the chain or lose to it is the control that must not read "holds",
and so is a best shape that wins at 95% alone but not once its being picked among K is accounted for."""

from __future__ import annotations

import math

import polars as pl
import pytest

from dspark.config import resolve_config
from dspark.decoding.tree import TreeShape
from dspark.evaluation.rollouts import PromptRollout
from dspark.reports import Provenance, build_report
from dspark.reports.claims import VERDICTS, Pooled, verdict_of
from dspark.reports.collect import SweepRuns
from dspark.reports.context import REPORT_BUILDERS, ReportContext
from dspark.reports.trees import familywise_z, nodes_of_rollouts, ratio_interval
from dspark.stages.context import training_key
from dspark.sweeps import load_sweep
from dspark.sweeps.driver import plan_grid

SHAPES = {  # the sweep's five cells per drafter: their axes beside drafter and seed
    "chain": {"decode.tree.shape": "chain"},
    "widths": {
        "decode.tree.shape": "widths",
        "decode.tree.widths": "[4, 2, 2, 1, 1, 1, 1]",
        "decode.tree.scheme": "descent",
    },
    "widths-rrsw": {
        "decode.tree.shape": "widths",
        "decode.tree.widths": "[4, 2, 2, 1, 1, 1, 1]",
        "decode.tree.scheme": "rrsw",
    },
    "branching": {
        "decode.tree.shape": "branching",
        "decode.tree.branching": "[3, 1, 1, 1]",
        "decode.tree.scheme": "rrsw",
    },
    "dynamic": {
        "decode.tree.shape": "dynamic",
        "decode.tree.nodes": 12,
        "decode.tree.beam": 4,
        "decode.tree.scheme": "rrsw",
    },
}
CELL_SCHEMES = {(a["decode.tree.shape"], a.get("decode.tree.scheme", "descent")) for a in SHAPES.values()}


# ---- the sweep file ----


@pytest.fixture(scope="module")
def plan():
    """The first seed's cells, resolved (resolving costs ~0.5 s a cell; the second seed only repeats them)."""
    spec = load_sweep("tree").with_args({"sweep.seeds": [0]})
    return plan_grid(resolve_config(["budget=smoke", "sweep=tree"]), spec, check=False)


def test_the_sweep_has_five_shapes_per_drafter_and_seed():
    cells = load_sweep("tree").cells("smoke")
    assert len(cells) == 30 and cells[0].key == "drafter=dspark decode.tree.shape=chain seed=0"  # the smoke test's
    found = {
        (c.axes["drafter"], c.axes["decode.tree.shape"], c.axes.get("decode.tree.scheme", "descent"), c.axes["seed"])
        for c in cells
    }
    expected = {(d, s, k, seed) for d in ("dspark", "dflash", "eagle3") for s, k in CELL_SCHEMES for seed in (0, 1)}
    assert found == expected


def test_every_tree_has_the_12_node_budget_and_its_exact_scheme(plan):
    assert len(plan.cells) == 15
    for pc in plan.cells:
        decode, shape = pc.rc.cfg.decode, pc.cell.axes["decode.tree.shape"]
        assert decode.policy == "fixed" and decode.temperature == 1.0 and decode.tree.shape == shape
        assert (shape, decode.tree.scheme) in CELL_SCHEMES
        gamma = pc.rc.cfg.model.block_size
        nodes = TreeShape.from_config(decode.tree).max_nodes(gamma)
        assert nodes == (gamma if shape == "chain" else 12), (shape, nodes)


def test_each_drafter_is_trained_once_and_shared_by_its_shapes(plan):
    keys: dict[str, set[str]] = {}
    for pc in plan.cells:
        keys.setdefault(pc.cell.axes["drafter"], set()).add(training_key(pc.rc.cfg))
    assert all(len(k) == 1 for k in keys.values()) and len(set().union(*keys.values())) == 3, keys


def test_the_override_lines_resolve():
    spec = load_sweep("tree")
    branching = next(c for c in spec.cells("smoke") if c.axes["decode.tree.shape"] == "branching")
    greedy = resolve_config(["budget=smoke", "decode.temperature=0"], cell_overrides=branching.overrides)
    assert greedy.cfg.decode.temperature == 0.0 and greedy.cfg.decode.tree.scheme == "rrsw"
    grown = spec.with_args({"sweep.axes.decode.tree.nodes": [8, 12]}).cells("smoke")
    assert len(grown) == 36 and {c.axes.get("decode.tree.nodes") for c in grown} == {None, 8, 12}


# ---- the report on synthetic runs ----


def tree_metrics(tau: float, seed: int, *, ci95: float = 0.1, prompts: float = 40.0) -> dict[str, float]:
    """What an evaluation logs for all prompts: per-prompt τ and speed-up with their intervals, the verify rate
    of a 7-draft chain at this τ (verify_rate = τ / (ℓ + 1))."""
    return {
        "eval/all/tau": tau,
        "eval/all/tau_prompt_mean": tau + 0.01 * seed,
        "eval/all/tau_prompt_ci95": ci95,
        "eval/all/prompts": prompts,
        "eval/all/verify_rate": tau / 8.0,
        "eval/all/speedup_prompt_mean": 0.5 * tau + 0.01 * seed,
        "eval/all/speedup_prompt_ci95": 0.05,
        "summary/tau": tau,
    }


def runs_of(taus: dict[str, dict[str, float]], *, seeds=(0, 1), **metrics) -> SweepRuns:
    """One run per (seed, drafter, shape) with the axis columns a collected frame has (lists as JSON text)."""
    rows = []
    for seed in seeds:
        for drafter, per_shape in taus.items():
            for shape, tau in per_shape.items():
                axes = {"drafter": drafter, **SHAPES[shape], "seed": seed}
                rows.append(
                    {
                        "run_id": f"{drafter}-{shape}-{seed}",
                        "drafter": drafter,
                        "model.head": "markov" if drafter == "dspark" else "none",
                        "seed": seed,
                        **{f"axis.{k}": v for k, v in axes.items()},
                        **tree_metrics(tau, seed, **metrics),
                    }
                )
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return SweepRuns(sweep="tree", parent=None, frame=pl.DataFrame([{k: r.get(k) for k in keys} for r in rows]))


def build(runs: SweepRuns, tmp_path) -> tuple[str, ReportContext]:
    ctx = ReportContext(name="tree", runs=runs, out_dir=tmp_path)
    sections = REPORT_BUILDERS.resolve("tree")(ctx)
    return "\n\n".join(f"## {s.title}\n\n{s.body}" for s in sections), ctx


def check_claims(ctx: ReportContext, text: str) -> dict[str, str]:
    """Every claim's verdict is its interval's and its number is the printed one; returns {drafter: verdict}."""
    out = {}
    for claim in ctx.claims:
        assert claim.verdict in VERDICTS and claim.verdict == verdict_of(claim.low, claim.high, runs=claim.runs)
        if claim.verdict in ("holds", "reversed", "not resolved"):
            assert claim.low <= claim.mean <= claim.high and claim.ours in text, claim
        drafter = claim.id.removeprefix("tree.").removesuffix("_best_tree_vs_chain.all")
        out[drafter] = claim.verdict
    return out


TAUS = {
    "dspark": {"chain": 2.0, "widths": 2.6, "branching": 2.3, "dynamic": 2.5},  # trees win
    "dflash": {"chain": 2.0, "widths": 2.01, "branching": 1.99, "dynamic": 2.0},  # control: a tie
    "eagle3": {"chain": 2.0, "widths": 1.6, "branching": 1.5, "dynamic": 1.7},  # control: trees lose
}


def test_the_report_tables_every_shape_and_judges_each_drafter(tmp_path):
    text, ctx = build(runs_of(TAUS), tmp_path)
    verdicts = check_claims(ctx, text)
    assert verdicts == {"dspark": "holds", "dflash": "not resolved", "eagle3": "reversed"}
    dspark = next(c for c in ctx.claims if c.id == "tree.dspark_best_tree_vs_chain.all")
    assert dspark.seeds == "0,1" and dspark.runs == 2 and "widths [4,2,2,1,1,1,1]" in dspark.scope
    assert dspark.mean == pytest.approx(2.605 / 2.005 - 1)
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 12 and "speed-up vs target-only" in table[0]
    for label in (
        "| chain |",
        "| widths [4,2,2,1,1,1,1] |",
        "| branching [3,1,1,1] rrsw |",
        "| dynamic N≤12 beam 4 rrsw |",
    ):
        assert sum(label in line for line in table) == 3, label
    assert "| 12 (shape) |" in text and "| ≤ 12 (shape) |" in text and "≈ 7.0 ± 0.0 (n=2) (τ / verify rate)" in text
    assert (tmp_path / "tree-tau.png").stat().st_size > 1000 and "![τ per tree shape](tree-tau.png)" in text


def test_a_best_shape_significant_alone_is_not_resolved_once_picked_among_three(tmp_path):
    """The winner's curse: the best of three trees beats the chain at 95% on its own, not with the Bonferroni
    interval the claim uses."""
    taus = {"dspark": {"chain": 2.0, "widths": 2.11, "branching": 2.0, "dynamic": 1.95}}
    text, ctx = build(runs_of(taus), tmp_path)
    lone = next(line for line in text.splitlines() if "| widths" in line)
    low = float(lone.split("×")[1].split("[")[1].split(",")[0])
    assert low > 1.0, lone  # alone, at 95%, it would hold
    assert check_claims(ctx, text) == {"dspark": "not resolved"}


def test_a_missing_chain_is_not_run_yet_and_a_spreadless_arm_has_no_interval(tmp_path):
    text, ctx = build(runs_of({"dspark": {"widths": 2.5, "dynamic": 2.4}}), tmp_path)
    assert check_claims(ctx, text) == {"dspark": "not run yet"} and "not run yet" in text
    one = runs_of({"dflash": {"chain": 2.0, "widths": 2.5}}, seeds=(0,), prompts=1.0)
    text, ctx = build(one, tmp_path)
    assert check_claims(ctx, text) == {"dflash": "no interval"} and "+25.0% (no interval)" in text


def test_ratio_intervals_and_the_familywise_quantile():
    a, b = Pooled(2.2, 0.05, 2), Pooled(2.0, 0.05, 2)
    one, three = ratio_interval(a, b), ratio_interval(a, b, z=familywise_z(3))
    assert one.mean == pytest.approx(1.1) and three.low < one.low < 1.1 < one.high < three.high
    assert familywise_z(1) == pytest.approx(1.959964, abs=1e-5) and familywise_z(3) == pytest.approx(2.394, abs=1e-3)
    assert ratio_interval(a, Pooled(2.0, 0.0, 1)) is None and ratio_interval(a, Pooled(math.nan, math.nan, 0)) is None


def test_nodes_per_round_come_from_the_round_records(tmp_path):
    """Tree rounds count their N, chain rounds their ℓ_eff; a store with the runs' records replaces the shape's."""
    rounds = [{"tree_nodes": 12, "num_verified": 7}, {"tree_nodes": 9, "num_verified": 4}, {"num_verified": 7}]
    rollout = lambda mode, rr: PromptRollout("gsm8k", "math", "p", mode, 3, [1], "eos", 0.0, 0.0, rr)  # noqa: E731
    assert nodes_of_rollouts([rollout("speculative", rounds), rollout("target", [])]) == pytest.approx(28 / 3)
    assert math.isnan(nodes_of_rollouts([rollout("target", [])]))

    class Client:  # the MLflow client calls the report makes: the eval's attached round records
        def list_artifacts(self, run_id, path):
            return [type("A", (), {"path": "eval/rounds.jsonl"})()]

        def download_artifacts(self, run_id, path, dst):
            from dspark.evaluation.rollouts import write_rollouts_jsonl

            n = 11 if "dynamic" in run_id else 12 if "chain" not in run_id else 7
            return str(write_rollouts_jsonl(f"{dst}/rounds.jsonl", [rollout("speculative", [{"tree_nodes": n}] * 3)]))

    runs = runs_of({"dspark": {"chain": 2.0, "dynamic": 2.4}})
    ctx = ReportContext(name="tree", runs=runs, out_dir=tmp_path, store=type("S", (), {"client": Client()})())
    text = "\n".join(s.body for s in REPORT_BUILDERS.resolve("tree")(ctx))
    assert "| 7.0 ± 0.0 (n=2) |" in text and "| 11.0 ± 0.0 (n=2) |" in text and "(shape)" not in text


def test_the_sweep_report_is_built_by_the_tree_builder(tmp_path):
    text, figures, ctx = build_report(
        runs_of(TAUS), spec=load_sweep("tree"), out_dir=tmp_path, provenance=Provenance(budget="smoke")
    )
    assert "## Do trees beat chains?" in text and figures == [tmp_path / "tree-tau.png"]
    assert len(ctx.claims) == 3
