"""dspark.metrics against brute-force python references, analytic values and torchmetrics (METHOD §8)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from torchmetrics.classification import BinaryAUROC, BinaryCalibrationError

from dspark.metrics import (
    CumulativeCalibration,
    PositionCrossEntropy,
    RolloutAcceptance,
    TeacherForcedAcceptance,
    binned_auroc,
    reliability_bins,
    rollout_prefix_events,
    soft_prefix_events,
)
from dspark.metrics.calibration import AUROC_LOGIT_RANGE

GAMMA = 5
MLFLOW_KEY = re.compile(r"^[A-Za-z0-9_/. -]+$")


def random_blocks(seed: int, *, shape=(3, 40), gamma: int = GAMMA):
    """(values in [0, 1], label_valid) with random valid-prefix lengths 0..γ and NaN in the ignored slots."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.rand(*shape, gamma, generator=gen)
    lengths = torch.randint(0, gamma + 1, shape, generator=gen)
    valid = torch.arange(gamma) < lengths.unsqueeze(-1)
    return values.masked_fill(~valid, float("nan")), valid


def valid_length(row_valid) -> int:
    """Length of the contiguous valid prefix of one block (python loop, independent of the library)."""
    length = 0
    for flag in row_valid:
        if not flag:
            break
        length += 1
    return length


def assert_dicts_close(actual: dict, expected: dict, *, atol: float = 1e-12) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(
            torch.as_tensor(actual[key], dtype=torch.float64),
            torch.as_tensor(expected[key], dtype=torch.float64),
            atol=atol,
            rtol=0,
            equal_nan=True,
            msg=key,
        )


# ---------------------------------------------------------------- teacher-forced acceptance, cross-entropy


def reference_acceptance(c_star: torch.Tensor, valid: torch.Tensor) -> dict:
    gamma = c_star.shape[-1]
    sums, counts, taus = [0.0] * gamma, [0] * gamma, []
    for row, row_valid in zip(c_star.reshape(-1, gamma).tolist(), valid.reshape(-1, gamma).tolist()):
        length = valid_length(row_valid)
        if length == 0:
            continue
        tau, prod = 1.0, 1.0
        for k in range(length):
            sums[k] += row[k]
            counts[k] += 1
            prod *= row[k]
            tau += prod
        taus.append(tau)
    out = {f"accept/pos{k + 1}": sums[k] / counts[k] if counts[k] else math.nan for k in range(gamma)}
    out["tau_prob"] = sum(taus) / len(taus) if taus else math.nan
    return out


def test_acceptance_matches_bruteforce_with_padding():
    c_star, valid = random_blocks(0)
    metric = TeacherForcedAcceptance(GAMMA)
    metric.update(c_star[:2], valid[:2])
    metric.update(c_star[2:], valid[2:])
    assert_dicts_close(metric.compute(), reference_acceptance(c_star, valid))


def test_acceptance_perfect_and_useless_drafts():
    """c* = 1 everywhere ⇒ every slot accepted and τ_prob = γ + 1; c* = 0 ⇒ τ_prob = 1 (only the extra token)."""
    valid = torch.ones(2, 3, GAMMA, dtype=torch.bool)
    perfect = TeacherForcedAcceptance(GAMMA)
    perfect.update(torch.ones(2, 3, GAMMA), valid)
    out = perfect.compute()
    assert all(out[f"accept/pos{k}"].item() == 1.0 for k in range(1, GAMMA + 1))
    assert out["tau_prob"].item() == GAMMA + 1
    useless = TeacherForcedAcceptance(GAMMA)
    useless.update(torch.zeros(2, 3, GAMMA), valid)
    assert useless.compute()["tau_prob"].item() == 1.0


def test_acceptance_short_prefix_and_non_contiguous_mask():
    """A block valid on 2 of 3 slots adds 1 + c1 + c1·c2; a slot after a hole is ignored even if flagged valid."""
    c_star = torch.tensor([[0.5, 0.5, 0.5], [0.8, 0.9, 0.7]])
    valid = torch.tensor([[True, True, False], [True, False, True]])
    metric = TeacherForcedAcceptance(3)
    metric.update(c_star, valid)
    out = metric.compute()
    assert out["tau_prob"].item() == pytest.approx(((1 + 0.5 + 0.25) + (1 + 0.8)) / 2)
    assert out["accept/pos1"].item() == pytest.approx(0.65)
    assert out["accept/pos2"].item() == pytest.approx(0.5)
    assert math.isnan(out["accept/pos3"].item())


def test_position_cross_entropy_matches_bruteforce():
    nll, valid = random_blocks(1)
    nll = nll * 7.0
    metric = PositionCrossEntropy(GAMMA)
    metric.update(nll, valid)
    per_slot = [[] for _ in range(GAMMA)]
    for row, row_valid in zip(nll.reshape(-1, GAMMA).tolist(), valid.reshape(-1, GAMMA).tolist()):
        for k in range(valid_length(row_valid)):
            per_slot[k].append(row[k])
    expected = {f"ce/pos{k + 1}": float(np.mean(per_slot[k])) for k in range(GAMMA)}
    expected["ce/mean"] = float(np.mean([v for slot in per_slot for v in slot]))
    assert_dicts_close(metric.compute(), expected, atol=1e-9)


# ---------------------------------------------------------------- calibration


def reference_calibration(conf: torch.Tensor, event: torch.Tensor, valid: torch.Tensor, *, n_bins: int) -> dict:
    """Per-slot ECE (equal-width bins), exact pairwise AUROC with weighted soft labels, Brier, count-weighted means."""
    gamma = conf.shape[-1]
    scores, events = [[] for _ in range(gamma)], [[] for _ in range(gamma)]
    for row, ev, row_valid in zip(
        conf.reshape(-1, gamma).tolist(), event.reshape(-1, gamma).double().tolist(), valid.reshape(-1, gamma).tolist()
    ):
        prod = 1.0
        for k in range(valid_length(row_valid)):
            prod *= row[k]
            scores[k].append(prod)
            events[k].append(ev[k])
    out, counts = {}, []
    for k in range(gamma):
        a, e = np.array(scores[k]), np.array(events[k])
        counts.append(len(a))
        bins = np.minimum(np.floor(a * n_bins).astype(int), n_bins - 1)
        ece = sum(abs(a[bins == b].sum() - e[bins == b].sum()) for b in range(n_bins)) / len(a)
        diff = a[:, None] - a[None, :]
        pair_w = e[:, None] * (1 - e)[None, :]
        auroc = (pair_w * ((diff > 0) + 0.5 * (diff == 0))).sum() / (e.sum() * (1 - e).sum())
        out[f"ece/pos{k + 1}"], out[f"auroc/pos{k + 1}"] = ece, auroc
        out[f"brier/pos{k + 1}"] = float(np.mean((a - e) ** 2))
    for name in ("ece", "auroc", "brier"):
        out[f"{name}/mean"] = np.average([out[f"{name}/pos{k + 1}"] for k in range(gamma)], weights=counts)
    return {key: out[key] for key in sorted(out, key=lambda s: (s.split("/")[0], s))}


def calibration_data(seed: int, *, rows: int = 600, gamma: int = GAMMA):
    """Confidences and per-slot accept draws correlated with them; hard prefix events from a rollout-like draw."""
    gen = torch.Generator().manual_seed(seed)
    conf = torch.rand(rows, gamma, generator=gen) * 0.6 + 0.4
    accepted = torch.rand(rows, gamma, generator=gen) < conf**1.5  # miscalibrated on purpose
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    num_verified = torch.where(
        torch.rand(rows, generator=gen) < 0.8, gamma, torch.randint(0, gamma + 1, (rows,), generator=gen)
    )
    num_accepted = torch.minimum(num_accepted, num_verified)
    event, valid = rollout_prefix_events(num_accepted=num_accepted, num_verified=num_verified, block_size=gamma)
    return conf, event, valid


def test_calibration_hard_events_match_torchmetrics():
    """ECE equals BinaryCalibrationError(l1, 20 bins) within 1e-6; binned AUROC equals BinaryAUROC within 1e-3."""
    conf, event, valid = calibration_data(2)
    metric = CumulativeCalibration(GAMMA, n_bins=20)
    metric.update(conf, event, valid)
    out = metric.compute()
    a = torch.cumprod(conf.double(), dim=-1)
    for k in range(GAMMA):
        keep = valid[:, k]
        scores, target = a[keep, k].float(), event[keep, k].long()
        ece = BinaryCalibrationError(n_bins=20, norm="l1")(scores, target)
        auroc = BinaryAUROC()(scores, target)
        assert abs(out[f"ece/pos{k + 1}"].item() - ece.item()) < 1e-6
        assert abs(out[f"auroc/pos{k + 1}"].item() - auroc.item()) < 1e-3
    assert 0.55 < out["auroc/mean"].item() < 0.95  # the data carry signal, so the test is not vacuous


def test_calibration_matches_bruteforce_hard_and_soft():
    conf, event, valid = calibration_data(3, rows=300)
    soft_conf, soft_valid = random_blocks(4, shape=(300,))
    c_star = torch.rand(300, GAMMA, generator=torch.Generator().manual_seed(5))
    soft_event = soft_prefix_events(c_star)
    for c, e, v in ((conf, event, valid), (soft_conf, soft_event, soft_valid)):
        metric = CumulativeCalibration(GAMMA, n_bins=20)
        metric.update(c[:100], e[:100], v[:100])
        metric.update(c[100:], e[100:], v[100:])
        got, expected = metric.compute(), reference_calibration(c, e, v, n_bins=20)
        exact = {key: val for key, val in expected.items() if not key.startswith("auroc")}
        assert_dicts_close({key: got[key] for key in exact}, exact, atol=1e-9)
        for key in expected.keys() - exact.keys():
            assert abs(got[key].item() - expected[key]) < 1e-3, key


def test_binned_auroc_exact_when_scores_sit_on_bin_centres():
    """With scores on (logit-spaced) bin centres the histogram loses nothing: equal to the pairwise formula."""
    gen = torch.Generator().manual_seed(6)
    bins = 64
    width = 2 * AUROC_LOGIT_RANGE / bins
    centre = torch.randint(0, bins, (400, 1), generator=gen).double()  # many exact ties, handled as ½
    scores = torch.sigmoid(-AUROC_LOGIT_RANGE + (centre + 0.5) * width)
    event = torch.rand(400, 1, generator=gen).double()
    all_valid = torch.ones(400, 1, dtype=torch.bool)
    metric = CumulativeCalibration(1, auroc_bins=bins)
    metric.update(scores, event, all_valid)
    expected = reference_calibration(scores, event, all_valid, n_bins=20)
    assert metric.compute()["auroc/pos1"].item() == pytest.approx(expected["auroc/pos1"], abs=1e-12)


def test_binned_auroc_resolves_tiny_cumulative_products():
    """Deep slots of a weak drafter have a_k ≪ 0.01: 1000 equal-width bins in a would tie them (error ≈ 5e-3)."""
    gen = torch.Generator().manual_seed(16)
    scores = torch.rand(2000, 1, generator=gen).double() ** 6  # most mass below 0.01
    event = torch.rand(2000, 1, generator=gen) < scores**0.3
    metric = CumulativeCalibration(1)
    metric.update(scores, event, torch.ones(2000, 1, dtype=torch.bool))
    expected = BinaryAUROC()(scores.squeeze(1), event.squeeze(1).long()).item()
    assert abs(metric.compute()["auroc/pos1"].item() - expected) < 1e-4


def test_binned_auroc_degenerate_cases():
    assert binned_auroc(torch.tensor([0.0, 0.0, 2.0]), torch.tensor([3.0, 0.0, 0.0])).item() == 1.0
    assert binned_auroc(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])).item() == 0.5
    assert math.isnan(binned_auroc(torch.tensor([1.0, 2.0]), torch.zeros(2)).item())


def test_reliability_bins_pure_and_from_metric():
    conf, event, valid = calibration_data(7, rows=200)
    metric = CumulativeCalibration(GAMMA, n_bins=10)
    metric.update(conf, event, valid)
    table = metric.reliability()
    a = torch.cumprod(conf.double(), dim=-1)
    for k in range(GAMMA):
        scores, ev = a[valid[:, k], k].numpy(), event[valid[:, k], k].double().numpy()
        pure = reliability_bins(a[:, k], event[:, k], n_bins=10, valid=valid[:, k])
        bins = np.minimum(np.floor(scores * 10).astype(int), 9)
        count = np.bincount(bins, minlength=10)
        with np.errstate(invalid="ignore"):
            mean_conf = np.bincount(bins, weights=scores, minlength=10) / count
            mean_event = np.bincount(bins, weights=ev, minlength=10) / count
        for got in (pure, type(pure)(table.mean_confidence[k], table.mean_event[k], table.count[k])):
            np.testing.assert_array_equal(got.count.numpy(), count)
            np.testing.assert_allclose(got.mean_confidence.numpy(), mean_conf, atol=1e-12)
            np.testing.assert_allclose(got.mean_event.numpy(), mean_event, atol=1e-12)


def test_calibration_rejects_logits_and_wrong_block_size():
    valid = torch.ones(4, GAMMA, dtype=torch.bool)
    metric = CumulativeCalibration(GAMMA)
    with pytest.raises(ValueError, match="sigmoid"):
        metric.update(torch.randn(4, GAMMA) * 3, torch.zeros(4, GAMMA), valid)
    with pytest.raises(ValueError, match="block_size"):
        metric.update(torch.rand(4, GAMMA + 1), torch.zeros(4, GAMMA + 1), torch.ones(4, GAMMA + 1, dtype=torch.bool))


# ---------------------------------------------------------------- rollouts

# (ℓ_eff, A, τ) per round, γ = 3: full accept, early reject, ℓ = 1 threshold round, reject at slot 1, ℓ = 0,
# and an EOS accepted at slot 2 (τ = A, no extra token).
ROUNDS = [(3, 3, 4), (3, 1, 2), (1, 1, 2), (2, 0, 1), (0, 0, 1), (2, 2, 2)]


def test_rollout_hand_table():
    """Counted by hand: survival@k = #A≥k / #ℓ≥k, cond@k = #A≥k / #(A≥k−1 and ℓ≥k).

    cond@2 = 2/3 while survival@2 / survival@1 = 0.625: a metric deriving cond from survivals fails here.
    """
    metric = RolloutAcceptance(3)
    ell, acc, tau = (torch.tensor(col) for col in zip(*ROUNDS))
    metric.update(num_verified=ell, num_accepted=acc, committed=tau)
    expected = {
        "survival/pos1": 4 / 5,
        "survival/pos2": 2 / 4,
        "survival/pos3": 1 / 2,
        "cond/pos1": 4 / 5,
        "cond/pos2": 2 / 3,
        "cond/pos3": 1 / 1,
        "verify_rate": 12 / 17,
        "draft_accept_rate": 7 / 11,
        "tau": 12 / 6,
        "rounds": 6.0,
    }
    assert_dicts_close(metric.compute(), expected)


def reference_rollout(ell, acc, tau, *, gamma: int) -> dict:
    rounds = list(zip(ell.tolist(), acc.tolist(), tau.tolist()))

    def frac(num, den):
        return num / den if den else math.nan

    out = {}
    for k in range(1, gamma + 1):
        out[f"survival/pos{k}"] = frac(sum(a >= k for _, a, _ in rounds), sum(e >= k for e, _, _ in rounds))
    for k in range(1, gamma + 1):
        out[f"cond/pos{k}"] = frac(sum(a >= k for _, a, _ in rounds), sum(a >= k - 1 and e >= k for e, a, _ in rounds))
    out["verify_rate"] = frac(sum(t for *_, t in rounds), sum(e + 1 for e, _, _ in rounds))
    out["draft_accept_rate"] = frac(sum(a for _, a, _ in rounds), sum(e for e, _, _ in rounds))
    out["tau"] = frac(sum(t for *_, t in rounds), len(rounds))
    out["rounds"] = float(len(rounds))
    return out


def random_rounds(seed: int, *, rounds: int = 500, gamma: int = GAMMA):
    gen = torch.Generator().manual_seed(seed)
    ell = torch.randint(0, gamma + 1, (rounds,), generator=gen)
    acc = (torch.rand(rounds, generator=gen) * (ell + 1)).long().clamp(max=ell)
    eos = torch.rand(rounds, generator=gen) < 0.05
    tau = torch.where(eos & (acc > 0), acc, acc + 1)
    return ell, acc, tau


def test_rollout_matches_bruteforce():
    ell, acc, tau = random_rounds(8)
    metric = RolloutAcceptance(GAMMA)
    metric.update(num_verified=ell[:123], num_accepted=acc[:123], committed=tau[:123])
    metric.update(num_verified=ell[123:], num_accepted=acc[123:], committed=tau[123:])
    assert_dicts_close(metric.compute(), reference_rollout(ell, acc, tau, gamma=GAMMA))


def test_rollout_undefined_ratios_are_nan_and_bad_rounds_rejected():
    metric = RolloutAcceptance(3)
    metric.update(num_verified=torch.tensor([1]), num_accepted=torch.tensor([1]), committed=torch.tensor([2]))
    out = metric.compute()
    assert out["survival/pos1"].item() == 1.0 and math.isnan(out["survival/pos2"].item())
    with pytest.raises(ValueError, match="num_accepted"):
        metric.update(num_verified=torch.tensor([1]), num_accepted=torch.tensor([2]), committed=torch.tensor([3]))
    with pytest.raises(ValueError, match="block_size"):
        metric.update(num_verified=torch.tensor([4]), num_accepted=torch.tensor([0]), committed=torch.tensor([1]))
    with pytest.raises(ValueError, match="committed"):
        metric.update(num_verified=torch.tensor([2]), num_accepted=torch.tensor([0]), committed=torch.tensor([2]))


# ---------------------------------------------------------------- shared contracts


def build_and_feed(parts: list) -> list:
    """One instance of each metric per data part, updated on it."""
    made = []
    for c_star, valid, conf, event, cal_valid, ell, acc, tau in parts:
        metrics = [
            TeacherForcedAcceptance(GAMMA),
            PositionCrossEntropy(GAMMA),
            CumulativeCalibration(GAMMA),
            RolloutAcceptance(GAMMA),
        ]
        metrics[0].update(c_star, valid)
        metrics[1].update(c_star * 3, valid)
        metrics[2].update(conf, event, cal_valid)
        metrics[3].update(num_verified=ell, num_accepted=acc, committed=tau)
        made.append(metrics)
    return made


def test_merged_states_equal_one_instance_on_all_data():
    """merge_state adds the sum states, as DDP's all-reduce does: exact, no averaging of per-part ratios."""
    c_star, valid = random_blocks(9, shape=(50,))
    conf, event, cal_valid = calibration_data(10, rows=300)
    ell, acc, tau = random_rounds(11, rounds=200)
    cut, cal_cut, r_cut = 10, 220, 37  # uneven parts, so averaging ratios would be wrong
    parts = [
        (
            c_star[:cut],
            valid[:cut],
            conf[:cal_cut],
            event[:cal_cut],
            cal_valid[:cal_cut],
            ell[:r_cut],
            acc[:r_cut],
            tau[:r_cut],
        ),
        (
            c_star[cut:],
            valid[cut:],
            conf[cal_cut:],
            event[cal_cut:],
            cal_valid[cal_cut:],
            ell[r_cut:],
            acc[r_cut:],
            tau[r_cut:],
        ),
    ]
    first, second = build_and_feed(parts)
    (whole,) = build_and_feed([(c_star, valid, conf, event, cal_valid, ell, acc, tau)])
    for left, right, full in zip(first, second, whole):
        left.merge_state(right)
        assert_dicts_close(left.compute(), full.compute())


def test_names_are_mlflow_safe_and_states_stay_exact_under_casts():
    c_star, valid = random_blocks(12, shape=(4,))
    conf, event, cal_valid = calibration_data(13, rows=20)
    ell, acc, tau = random_rounds(14, rounds=20)
    for metric in build_and_feed([(c_star, valid, conf, event, cal_valid, ell, acc, tau)])[0]:
        assert all(MLFLOW_KEY.match(key) for key in metric.compute()), metric
        before = {name: state.clone() for name, state in metric.metric_state.items()}
        metric.to(torch.bfloat16)
        metric.half()
        for name, state in metric.metric_state.items():
            assert state.dtype in (torch.float64, torch.int64), name
            assert torch.equal(state, before[name]), name


def test_forward_returns_batch_value_and_accumulates():
    c_star, valid = random_blocks(15)
    metric = TeacherForcedAcceptance(GAMMA)
    batch_value = metric(c_star[:1], valid[:1])
    metric(c_star[1:], valid[1:])
    assert_dicts_close(batch_value, reference_acceptance(c_star[:1], valid[:1]))
    assert_dicts_close(metric.compute(), reference_acceptance(c_star, valid))


def test_updates_detach_inputs():
    """Confidences come from the head with grad attached: states must not join the autograd graph."""
    conf = torch.rand(4, GAMMA, requires_grad=True)
    valid = torch.ones(4, GAMMA, dtype=torch.bool)
    calibration, acceptance = CumulativeCalibration(GAMMA), TeacherForcedAcceptance(GAMMA)
    ce = PositionCrossEntropy(GAMMA)
    calibration.update(conf, soft_prefix_events(conf), valid)
    acceptance.update(conf, valid)
    ce.update(-torch.log(conf), valid)
    for metric in (calibration, acceptance, ce):
        assert not any(state.requires_grad for state in metric.metric_state.values())
