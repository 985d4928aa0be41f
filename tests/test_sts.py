"""Sequential Temperature Scaling (dspark.calibration.sts): fit on synthetic rounds, metrics against torchmetrics."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torchmetrics.classification import BinaryAUROC, BinaryCalibrationError

from dspark.calibration import (
    STSCalibration,
    auroc,
    brier,
    calibration_metrics,
    ece_cumulative,
    fit_sts,
    plot_reliability,
    reliability_curves,
    scale_confidence,
)

BLOCK = 4


def _rounds(num: int, sharpen: float, seed: int):
    """Rounds decoded with ℓ = γ: true per-slot accept prob p, reported c = σ(sharpen·logit(p)).

    sharpen > 1 is over-confident (the fitted temperature should be ≈ sharpen), < 1 under-confident.
    """
    gen = torch.Generator().manual_seed(seed)
    p = 0.3 + 0.69 * torch.rand(num, BLOCK, generator=gen, dtype=torch.float64)
    accepted = torch.rand(num, BLOCK, generator=gen, dtype=torch.float64) < p
    prefix = accepted.long().cumprod(1).sum(1)
    conf = torch.sigmoid(sharpen * torch.logit(p))
    return conf, prefix, torch.ones(num, BLOCK, dtype=torch.bool)


@pytest.fixture(scope="module")
def over_confident():
    conf, prefix, valid = _rounds(4000, 2.0, seed=0)
    return conf, prefix, valid, fit_sts(conf, prefix, valid)


def test_over_confidence_is_cooled_and_ece_drops(over_confident):
    _, _, _, fitted = over_confident
    assert all(t > 1.0 for t in fitted.temperatures)
    assert 1.5 < fitted.temperatures[0] < 2.7  # the generating temperature is 2
    assert all(after < before for before, after in zip(fitted.ece_before, fitted.ece_after))


def test_under_confidence_is_sharpened():
    conf, prefix, valid = _rounds(3000, 0.5, seed=1)
    fitted = fit_sts(conf, prefix, valid)
    assert fitted.temperatures[0] < 1.0
    assert fitted.ece_after[0] < fitted.ece_before[0]


def test_per_slot_ranking_is_preserved(over_confident):
    conf, prefix, valid, fitted = over_confident
    calibrated = fitted.apply(conf)
    for k in range(BLOCK):
        assert torch.equal(torch.argsort(conf[:, k]), torch.argsort(calibrated[:, k]))
    # a_1 = c̃_1, so its AUROC is unchanged; a_k for k ≥ 2 may re-rank (reported, not asserted).
    before, after = calibration_metrics(conf, prefix, valid), calibration_metrics(calibrated, prefix, valid)
    assert after.auroc[0] == pytest.approx(before.auroc[0], abs=1e-12)


def test_apply_is_monotone_and_safe_at_the_ends():
    fitted = STSCalibration([0.25, 1.0, 4.0], [0.25, 1.0, 4.0], 20, [0.0] * 3, [0.0] * 3)
    grid = torch.linspace(0, 1, 1001).unsqueeze(1).expand(-1, 3)
    out = fitted.apply(grid)
    assert out.dtype == grid.dtype and bool(torch.isfinite(out).all())
    assert bool((out.diff(dim=0) >= 0).all())
    assert out[0].tolist() == [0.0, 0.0, 0.0] and out[-1].tolist() == [1.0, 1.0, 1.0]
    assert torch.allclose(out[:, 1], grid[:, 1])  # T = 1 is the identity
    with pytest.raises(ValueError, match="block_size"):
        fitted.apply(torch.rand(2, 4))


def test_round_trip_through_json(over_confident):
    fitted = over_confident[3]
    restored = STSCalibration.from_dict(json.loads(json.dumps(fitted.to_dict())))
    assert restored == fitted
    assert len(restored.grid) == 81 and restored.n_bins == 20


def test_metrics_match_torchmetrics(over_confident):
    conf, prefix, valid, _ = over_confident
    valid = valid.clone()
    valid[::3, 2:] = False  # rounds that ended at an EOS in slot 2
    ece = ece_cumulative(conf, prefix, valid, n_bins=20)
    survival = conf.cumprod(1)
    for k in range(BLOCK):
        rows = valid[:, k]
        scores, events = survival[rows, k].float(), (prefix[rows] >= k + 1).long()
        reference = BinaryCalibrationError(n_bins=20, norm="l1")(scores, events)
        assert float(ece[k]) == pytest.approx(float(reference), abs=1e-5)
        assert auroc(scores, events) == pytest.approx(float(BinaryAUROC()(scores, events)), abs=1e-5)
        assert brier(scores, events) == pytest.approx(float(((scores - events) ** 2).mean()), abs=1e-6)
    assert calibration_metrics(conf, prefix, valid).count == [4000, 4000, 2666, 2666]


def test_auroc_handles_ties_and_missing_classes():
    assert auroc(torch.tensor([0.5, 0.5]), torch.tensor([1, 0])) == 0.5
    assert auroc(torch.tensor([0.1, 0.9, 0.4]), torch.tensor([0, 1, 0])) == 1.0
    assert math.isnan(auroc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])))


def test_input_checks():
    conf, prefix, valid = _rounds(10, 1.0, seed=2)
    with pytest.raises(ValueError, match="accepted_prefix"):
        fit_sts(conf, prefix + 5, valid)
    with pytest.raises(ValueError, match=r"\[n, γ\]"):
        fit_sts(conf[:, 0], prefix, valid)


def test_plot_reliability_writes_png(tmp_path, over_confident):
    conf, prefix, valid, fitted = over_confident
    before = reliability_curves(conf, prefix, valid)
    after = reliability_curves(fitted.apply(conf), prefix, valid)
    assert before.ece == pytest.approx(fitted.ece_before) and after.ece == pytest.approx(fitted.ece_after)
    assert int(before.count[0].sum()) == 4000
    path = plot_reliability(before, after, tmp_path / "fig6.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_scale_confidence_matches_formula():
    conf = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64)
    expected = torch.sigmoid(torch.log(conf / (1 - conf)) / 2.0)
    assert torch.allclose(scale_confidence(conf, 2.0), expected)


def test_apply_row_on_floats_equals_apply():
    """The single-request drafting stop calibrates c_1..c_k as Python floats (`apply_row`): the same values as
    the tensor `apply` up to float rounding, for every k ≤ γ, with 0, 1 and NaN mapped as `scale_confidence` maps
    them, and more than γ slots refused."""
    calibration = STSCalibration(temperatures=[0.05, 0.5, 1.0, 3.0], grid=[], n_bins=20, ece_before=[], ece_after=[])
    generator = torch.Generator().manual_seed(0)
    rows = torch.rand(200, 4, generator=generator, dtype=torch.float64)
    rows[0] = torch.tensor([0.0, 1.0, 1e-30, 1.0 - 1e-12])
    for row in rows:
        expected = calibration.apply(row).tolist()
        for k in range(5):
            got = calibration.apply_row(row[:k].tolist())
            assert len(got) == k
            for a, b in zip(got, expected[:k]):
                assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300), (row.tolist(), k, a, b)
    nan = calibration.apply_row([float("nan"), 0.3])
    assert nan[0] != nan[0] and nan[1] == pytest.approx(
        float(calibration.apply(torch.tensor([0.0, 0.3, 0, 0], dtype=torch.float64))[1])
    )
    with pytest.raises(ValueError, match="fitted for"):
        calibration.apply_row([0.5] * 5)
