"""Frontier analysis (dspark.serving.load) against hand-computed numbers, and the serving plots."""

from __future__ import annotations

import math

import pytest

from dspark.serving.load import (
    frontier,
    gap_to_best_static,
    speedup_at_matched_throughput,
    summaries_frame,
    throughput_gain_at_user_speed,
)
from dspark.serving.plots import plot_budget, plot_frontier
from dspark.serving.records import ServeSummary

# (R, throughput tokens/s, user speed tokens/s/user, budget ℓ)
BASELINE = [(1, 12.0, 24.0, 1.0), (2, 22.0, 22.0, 1.0), (4, 40.0, 20.0, 1.0), (8, 64.0, 16.0, 1.0)]
POLICY = [(1, 20.0, 30.0, 5.0), (2, 38.0, 28.0, 4.5), (4, 70.0, 25.0, 3.5), (8, 100.0, 18.0, 2.0)]


def _summaries(policy: str, points, *, simulated=False) -> list[ServeSummary]:
    return [
        ServeSummary(policy, r, thr, speed, budget, 1.0 + budget / 2, 4 * r, 50, 10.0, simulated=simulated)
        for r, thr, speed, budget in points
    ]


@pytest.fixture()
def summaries():
    return _summaries("mtp1", BASELINE) + _summaries("scheduler", POLICY)


def test_frontier_sorted_by_throughput_real_over_simulated(summaries):
    extra = _summaries("scheduler", [(4, 1.0, 1.0, 1.0), (16, 5.0, 2.0, 1.0)], simulated=True)
    points = frontier(summaries + extra, "scheduler")
    assert [(p.concurrency, p.simulated) for p in points] == [
        (16, True),
        (1, False),
        (2, False),
        (4, False),
        (8, False),
    ]
    assert [p.concurrency for p in frontier(summaries + extra, "scheduler", simulated=True)] == [4, 16]
    nan_point = _summaries("mtp1", [(32, float("nan"), 1.0, 1.0)])
    assert len(frontier(summaries + nan_point, "mtp1")) == 4 and frontier(summaries, "async") == []


def test_speedup_at_matched_throughput_hand_computed(summaries):
    result = speedup_at_matched_throughput(summaries, "scheduler", "mtp1")
    # baseline R=1 (12 tokens/s) is below the policy's range [20, 100]; the others interpolate:
    expected = [
        (2, (30 + (22 - 20) / (38 - 20) * (28 - 30)) / 22),
        (4, (28 + (40 - 38) / (70 - 38) * (25 - 28)) / 20),
        (8, (28 + (64 - 38) / (70 - 38) * (25 - 28)) / 16),
    ]
    assert [(p.concurrency, p.ratio) for p in result.points] == [(r, pytest.approx(v)) for r, v in expected]
    ratios = sorted(v for _, v in expected)
    assert (result.min, result.median, result.max) == (
        pytest.approx(ratios[0]),
        pytest.approx(ratios[1]),
        pytest.approx(ratios[2]),
    )
    assert result.reason is None


def test_speedup_no_overlap_and_missing_policy(summaries):
    far = _summaries("scheduler", [(1, 200.0, 30.0, 5.0), (2, 300.0, 28.0, 4.0)])
    result = speedup_at_matched_throughput(_summaries("mtp1", BASELINE) + far, "scheduler", "mtp1")
    assert result.points == [] and math.isnan(result.median) and "no overlap" in result.reason
    missing = speedup_at_matched_throughput(summaries, "async", "mtp1")
    assert missing.points == [] and "not enough points" in missing.reason and math.isnan(missing.min)


def test_speedup_takes_the_best_crossing_of_a_saturating_curve():
    saturating = _summaries("scheduler", [(1, 10.0, 10.0, 3.0), (2, 20.0, 9.0, 3.0), (4, 15.0, 5.0, 3.0)])
    base = _summaries("mtp1", [(4, 17.0, 3.1, 1.0)])
    result = speedup_at_matched_throughput(saturating + base, "scheduler", "mtp1")
    # crossings at 17 tokens/s: 10 + 0.7·(9 − 10) = 9.3 (rising part) and 9 + 0.6·(5 − 9) = 6.6 (falling part)
    assert result.points[0].policy_speed == pytest.approx(9.3) and result.median == pytest.approx(3.0)


def test_throughput_gain_at_user_speed_hand_computed(summaries):
    gains = throughput_gain_at_user_speed(summaries, "scheduler", "mtp1", [20.0, 26.0, 17.0])
    at20, at26, at17 = gains
    assert at20.policy_throughput == pytest.approx(70 + (20 - 25) / (18 - 25) * (100 - 70))
    assert at20.baseline_throughput == pytest.approx(40.0) and at20.reason is None
    assert at20.ratio == pytest.approx((70 + 5 / 7 * 30) / 40)
    assert at26.policy_throughput == pytest.approx(38 + (26 - 28) / (25 - 28) * (70 - 38))
    assert math.isnan(at26.ratio) and "mtp1 never reaches 26" in at26.reason
    assert at17.baseline_throughput == pytest.approx(40 + (17 - 20) / (16 - 20) * (64 - 40))
    assert math.isnan(at17.ratio) and "below every measured point of scheduler" in at17.reason
    none = throughput_gain_at_user_speed(summaries, "async", "mtp1", [20.0])
    assert math.isnan(none[0].ratio) and "not enough points" in none[0].reason


def test_gap_to_best_static(summaries):
    fixed = _summaries("fixed", [(1, 25.0, 25.0, 7.0), (2, 30.0, 15.0, 7.0)])
    lone = _summaries("scheduler", [(16, 120.0, 10.0, 1.0)])
    result = gap_to_best_static(summaries + fixed + lone)
    rows = {row.concurrency: row for row in result.rows}
    assert rows[1].best_static == "fixed" and rows[1].gap == pytest.approx(20 / 25 - 1)
    assert rows[2].best_static == "fixed" and rows[2].gap == pytest.approx(38 / 30 - 1)
    assert rows[4].best_static == "mtp1" and rows[4].gap == pytest.approx(70 / 40 - 1)
    assert rows[16].best_static is None and math.isnan(rows[16].gap) and "no static policy" in rows[16].reason
    assert result.reason is None
    missing = gap_to_best_static(summaries, policy="async")
    assert missing.rows == [] and "not enough points" in missing.reason


def test_summaries_frame(summaries):
    frame = summaries_frame(summaries)
    assert frame.height == 8 and frame["policy"].to_list()[:4] == ["mtp1"] * 4
    assert frame.filter(frame["policy"] == "scheduler")["throughput"].to_list() == [20.0, 38.0, 70.0, 100.0]
    assert summaries_frame([]).height == 0 and "user_speed" in summaries_frame([]).columns


def test_plots_write_pngs(summaries, tmp_path):
    simulated = _summaries("scheduler", [(16, 130.0, 12.0, 1.5), (32, 150.0, 8.0, 1.0)], simulated=True)
    for plot, name in ((plot_frontier, "frontier.png"), (plot_budget, "budget.png")):
        path = plot(summaries + simulated, tmp_path / name)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    assert plot_frontier([], tmp_path / "empty.png").exists()
