"""STS is fitted on one half of the calibration prompts and scored on the other (dspark.evaluation.calibrate): the
two splits are disjoint by prompt, the reported metrics are the score split's, positions with too few accepts or
rejections are marked uninformative, and entries stored before the split are refitted, never reused."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.calibration import calibration_metrics
from dspark.evaluation.calibrate import (
    MIN_EVENTS,
    PROTOCOL,
    CalibrationRounds,
    auroc_se,
    calibration_key,
    entry_to_report,
    fit_calibration,
    report_to_entry,
    split_by_prompt,
)


def synthetic_rounds(prompts: int = 6, rounds_per_prompt: int = 40, block: int = 3, seed: int = 0):
    """Rounds whose acceptance follows an overconfident head: P(accept slot k) = c_k / 2."""
    rng = torch.Generator().manual_seed(seed)
    n = prompts * rounds_per_prompt
    conf = torch.rand(n, block, generator=rng, dtype=torch.float64) * 0.8 + 0.2
    accepted = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        for k in range(block):
            if float(torch.rand(1, generator=rng)) < float(conf[i, k]) / 2:
                accepted[i] += 1
            else:
                break
    valid = torch.ones(n, block, dtype=torch.bool)
    prompt = torch.arange(prompts).repeat_interleave(rounds_per_prompt)
    return CalibrationRounds(conf, accepted, valid, prompts, prompt)


def test_fit_and_score_splits_are_disjoint_by_prompt_and_cover_every_round():
    rounds = synthetic_rounds(prompts=5)
    fit, score, held_out = split_by_prompt(rounds)
    assert held_out
    fit_prompts, score_prompts = set(fit.prompt.tolist()), set(score.prompt.tolist())
    assert fit_prompts.isdisjoint(score_prompts) and fit_prompts | score_prompts == set(range(5))
    assert fit.num_prompts == 3 and score.num_prompts == 2  # ⌈5/2⌉ fit
    assert fit.conf.shape[0] + score.conf.shape[0] == rounds.conf.shape[0]


def test_reported_metrics_are_the_score_splits():
    rounds = synthetic_rounds()
    report = fit_calibration(rounds, temperature=1.0)
    _, score, _ = split_by_prompt(rounds)
    expected = calibration_metrics(score.conf, score.accepted_prefix, score.valid)
    assert report.held_out and report.before.ece == expected.ece and report.before.count == expected.count
    in_sample = calibration_metrics(rounds.conf, rounds.accepted_prefix, rounds.valid)
    assert report.before.count != in_sample.count  # the control: not the rounds the fit saw
    assert report.fit_prompts + report.score_prompts == rounds.num_prompts
    assert report.metrics()["calibration/held_out"] == 1.0
    assert "fitted on" in report.markdown() and "the score split" in report.markdown()


def test_one_prompt_is_in_sample_and_says_so():
    rounds = synthetic_rounds(prompts=1)
    report = fit_calibration(rounds, temperature=1.0)
    assert not report.held_out and report.metrics()["calibration/held_out"] == 0.0
    assert "in-sample" in report.markdown()


def test_positions_with_few_accepts_are_uninformative():
    rounds = synthetic_rounds(prompts=4, rounds_per_prompt=30)
    report = fit_calibration(rounds, temperature=1.0)
    positives, counts = report.before.positives, report.before.count
    for k in range(3):
        informative = positives[k] >= MIN_EVENTS and counts[k] - positives[k] >= MIN_EVENTS
        assert report.informative(k) == informative
        assert report.metrics()[f"calibration/informative/pos{k + 1}"] == float(informative)
        assert (f"calibration/auroc_before_se/pos{k + 1}" in report.metrics()) == informative
    assert not report.informative(2)  # slot 3: (c/2)³ of 60 scored rounds gives a handful of accepts
    assert "uninformative" in report.markdown()


def test_hanley_mcneil_se_matches_its_formula_and_shrinks_with_data():
    a = 0.8
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    by_hand = math.sqrt((a * (1 - a) + 9 * (q1 - a * a) + 19 * (q2 - a * a)) / (10 * 20))
    assert auroc_se(a, positives=10, count=30) == pytest.approx(by_hand)
    assert auroc_se(a, positives=100, count=300) < auroc_se(a, positives=10, count=30)
    assert math.isnan(auroc_se(a, positives=0, count=30))


def test_stored_entries_round_trip_and_old_protocol_entries_are_not_reused(tmp_path):
    rounds = synthetic_rounds()
    report = fit_calibration(rounds, temperature=1.0, source="online")
    entry = report_to_entry(report, rounds)
    assert entry["protocol"] == PROTOCOL
    back, back_rounds = entry_to_report(entry)
    assert back.held_out and back.source == "online" and back.score_rounds == report.score_rounds
    assert torch.equal(back_rounds.prompt, rounds.prompt)
    old = {k: v for k, v in entry.items() if k not in ("protocol", "held_out", "split")}
    assert not entry_to_report(old)[0].held_out  # an entry from before the split reads as in-sample
    assert calibration_key(1.0) == "T=1" and calibration_key(1.0, "online", "alpaca") == "T=1/online@alpaca"
