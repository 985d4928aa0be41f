"""dspark.evaluation: summary maths on hand-made rounds, plots, STS collection on a tiny drafter, SPS caching,
diagnostics. The engine-backed tests use the offline `tiny` target and untrained drafters."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch

from dspark.evaluation.calibrate import (
    CalibrationRounds,
    calibrate_drafter,
    calibration_key,
    collect_calibration_rounds,
    fit_calibration,
    rounds_to_arrays,
)
from dspark.evaluation.diagnostics import latency_breakdown, load_or_profile_sps
from dspark.evaluation.plots import plot_conditional_acceptance, plot_latency_breakdown, plot_threshold_sweep
from dspark.evaluation.rollouts import (
    EvalPrompt,
    PromptRollout,
    encode_prompts,
    read_rollouts_jsonl,
    write_rollouts_jsonl,
)
from dspark.evaluation.summary import flatten_metrics, mean_ci, metric_name, report_markdown, summarize
from dspark.scheduling.profile import serving_sps_path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BLOCK = 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread (tests/conftest.py)


def _round(verified: int, accepted: int, *, eos: bool = False, conf=None) -> dict:
    return {
        "anchor_position": 0,
        "drafts": [5] * verified,
        "confidences": conf,
        "calibrated": None,
        "num_verified": verified,
        "num_accepted": accepted,
        "committed": accepted + (0 if eos else 1),
        "extra_token": None if eos else 7,
        "seconds_draft_parallel": 0.002,
        "seconds_draft_sequential": 0.001,
        "seconds_verify": 0.010,
        "seconds_other": 0.001,
    }


def _pair(
    dataset: str, domain: str, pid: str, rounds: list[dict], *, spec_s: float = 1.0, target_s: float = 2.0
) -> list[PromptRollout]:
    """A speculative rollout with `rounds` and a target-only rollout of the same tokens."""
    tokens = sum(r["committed"] for r in rounds)
    common = dict(
        dataset=dataset,
        domain=domain,
        prompt_id=pid,
        prompt_tokens=10,
        stop_reason="max_new_tokens",
        prefill_seconds=0.1,
    )
    return [
        PromptRollout(mode="speculative", new_tokens=[1] * tokens, total_seconds=spec_s, rounds=rounds, **common),
        PromptRollout(mode="target", new_tokens=[1] * tokens, total_seconds=target_s, **common),
    ]


def test_mean_ci_matches_student_t():
    mean, half = mean_ci([1.0, 2.0, 3.0, 4.0])
    assert mean == pytest.approx(2.5)
    # t_{0.975, 3} = 3.1824, sd = 1.2910 → 3.1824 · 1.2910 / 2
    assert half == pytest.approx(2.0541, abs=1e-3)
    assert math.isnan(mean_ci([3.0])[1]) and math.isnan(mean_ci([])[0])


def test_tau_pooled_differs_from_per_prompt_mean():
    """Prompt A: 3 rounds of τ = 1; prompt B: 1 round of τ = 4 → pooled 7/4, per-prompt mean (1 + 4)/2."""
    rollouts = _pair("gsm8k", "math", "a", [_round(3, 0)] * 3) + _pair("gsm8k", "math", "b", [_round(3, 3)])
    metrics = summarize(rollouts, block_size=BLOCK).datasets["gsm8k"]
    assert metrics["tau"] == pytest.approx(7 / 4)
    assert metrics["tau_prompt_mean"] == pytest.approx(2.5)
    assert metrics["tau_prompt_ci95"] == pytest.approx(12.7062 * (3 / math.sqrt(2)) / math.sqrt(2), rel=1e-4)
    assert metrics["rounds"] == 4 and metrics["prompts"] == 2
    assert metrics["survival/pos1"] == pytest.approx(1 / 4)
    assert metrics["verify_rate"] == pytest.approx(7 / 16)
    assert metrics["draft_accept_rate"] == pytest.approx(3 / 12)
    assert metrics["speedup"] == pytest.approx(2.0)
    assert metrics["time/verify_ms"] == pytest.approx(10.0)


def test_cond_is_its_own_counter_and_eos_rounds_count():
    """cond@2 = #(A ≥ 2) / #(A ≥ 1 and ℓ ≥ 2); a round verifying only 1 draft is not in its denominator."""
    rounds = [_round(1, 1), _round(3, 2), _round(3, 1), _round(2, 2, eos=True)]
    metrics = summarize(_pair("humaneval", "code", "p", rounds), block_size=BLOCK).datasets["humaneval"]
    assert metrics["cond/pos1"] == pytest.approx(1.0)
    assert metrics["cond/pos2"] == pytest.approx(2 / 3)
    assert metrics["cond/pos3"] == pytest.approx(0.0)
    assert metrics["survival/pos2"] == pytest.approx(2 / 3)  # ℓ ≥ 2 in three rounds, A ≥ 2 in two
    assert metrics["tau"] == pytest.approx((2 + 3 + 2 + 2) / 4)


def test_domain_curves_average_benchmarks_not_rounds():
    """gsm8k: 1 round, cond@1 = 1; math500: 3 rounds, cond@1 = 0 → domain 0.5 (pooling would give 0.25)."""
    rollouts = (
        _pair("gsm8k", "math", "g", [_round(3, 1)])
        + _pair("math500", "math", "m", [_round(3, 0)] * 3, spec_s=1.0, target_s=4.0)
        + _pair("mt-bench", "chat", "c", [_round(3, 3)])
    )
    summary = summarize(rollouts, block_size=BLOCK)
    math_domain = summary.domains["math"]
    assert math_domain["cond/pos1"] == pytest.approx(0.5)
    assert math_domain["tau"] == pytest.approx((2.0 + 1.0) / 2)
    assert math_domain["tau_rounds_pooled"] == pytest.approx(5 / 4)
    assert math_domain["rounds"] == 4 and math_domain["prompts"] == 2 and math_domain["benchmarks"] == 2
    assert math_domain["speedup"] == pytest.approx((2.0 + 4.0) / 2)
    assert summary.overall["tau"] == pytest.approx((2.0 + 1.0 + 4.0) / 3)
    assert summary.overall["cond/pos1"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    flat = flatten_metrics(summary)
    assert flat["eval/domain/math/cond/pos1"] == pytest.approx(0.5)
    assert flat["eval/mt-bench/cond/pos3"] == pytest.approx(1.0)
    assert flat["summary/tau"] == summary.overall["tau"] and flat["summary/speedup"] == summary.overall["speedup"]
    assert all(re.fullmatch(r"[A-Za-z0-9_/. -]+", name) for name in flat)
    assert metric_name("eval", "a:b", "tau") == "eval/a_b/tau"


def test_mixed_dataset_splits_into_benchmarks_per_domain():
    rollouts = _pair("synthetic", "math", "a", [_round(3, 3)]) + _pair("synthetic", "chat", "b", [_round(3, 0)])
    summary = summarize(rollouts, block_size=BLOCK)
    assert set(summary.benchmarks) == {("synthetic", "math"), ("synthetic", "chat")}
    assert summary.datasets["synthetic"]["tau"] == pytest.approx(2.5)
    assert summary.domains["math"]["tau"] == pytest.approx(4.0)


def test_rollouts_jsonl_roundtrip_and_report(tmp_path):
    rollouts = _pair("gsm8k", "math", "a", [_round(3, 1), _round(2, 2, eos=True)])
    path = write_rollouts_jsonl(tmp_path / "rounds.jsonl", rollouts)
    back = read_rollouts_jsonl(path)
    assert back == rollouts
    summary = summarize(back, block_size=BLOCK)
    png = plot_conditional_acceptance(summary, tmp_path / "cond.png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    meta = {
        "run_name": "dspark-x",
        "command": "python experiments/run.py budget=smoke",
        "target": "tiny",
        "target_fingerprint": "abc",
        "drafter_kind": "dspark",
        "drafter_path": "d.pt",
        "spec": {"head": "markov", "depth": 1},
        "seed": 0,
        "rounds_file": str(path),
        "decode": {
            "policy": "threshold",
            "threshold": 0.5,
            "temperature": 1.0,
            "max_new_tokens": 8,
            "prompts_per_set": 1,
            "eval_sets": ["gsm8k"],
        },
    }
    text = report_markdown(meta, summary, cond_plot=png.name)
    assert "τ pooled" in text and "cond@3" in text and "θ = 0.5" in text and "![cond@k](cond.png)" in text
    with pytest.raises(ValueError, match="stage=eval"):
        read_rollouts_jsonl(tmp_path / "missing.jsonl")


def test_rounds_to_arrays_masks_slots_after_eos():
    rounds = [_round(3, 1, conf=[0.9, 0.5, 0.2]), _round(2, 2, eos=True, conf=[0.8, 0.7])]
    arrays = rounds_to_arrays(rounds, block_size=BLOCK, num_prompts=1)
    assert arrays.valid.tolist() == [[True, True, True], [True, True, False]]
    assert arrays.accepted_prefix.tolist() == [1, 2]
    assert arrays.conf[1].tolist() == pytest.approx([0.8, 0.7, 0.5])
    with pytest.raises(ValueError, match="decode.calibrate"):
        rounds_to_arrays([_round(3, 0)], block_size=BLOCK)


def test_fit_calibration_reports_and_plots(tmp_path):
    gen = torch.Generator().manual_seed(0)
    p = 0.3 + 0.6 * torch.rand(400, BLOCK, generator=gen, dtype=torch.float64)
    accepted = (torch.rand(400, BLOCK, generator=gen, dtype=torch.float64) < p).long().cumprod(1).sum(1)
    rounds = CalibrationRounds(torch.sigmoid(3.0 * torch.logit(p)), accepted, torch.ones(400, BLOCK, dtype=bool), 4)
    report = fit_calibration(rounds, temperature=1.0, plot_path=tmp_path / "rel.png")
    assert report.plot_path.read_bytes()[:8] == PNG_MAGIC
    assert report.sts.temperatures[0] > 1.5  # over-confident confidences get a temperature > 1
    assert report.after.ece[0] < report.before.ece[0]
    assert {"calibration/ece_before/pos1", "calibration/auroc_after/pos3", "calibration/temperature/pos2"} <= set(
        report.metrics()
    )
    assert "ECE % before → after" in report.markdown()


def test_threshold_and_latency_plots(tmp_path):
    """The rows `reports.diagnostics` hands the Fig. 5 and Fig. 4 (right) plots draw into PNG files."""
    threshold = [
        {
            "domain": d,
            "threshold": t,
            "accepted_per_round": 1.0 - t,
            "rejected_per_round": t,
            "verify_rate": 0.5 + t / 2,
        }
        for d in ("math", "chat")
        for t in (0.0, 0.5, 0.9)
    ]
    assert plot_threshold_sweep(threshold, tmp_path / "threshold.png").read_bytes()[:8] == PNG_MAGIC
    latency = [
        {
            "context_length": c,
            "head": h,
            "block_size": b,
            "rounds": 4,
            "verify_ms": 10.0,
            "draft_parallel_ms": 3.0,
            "draft_sequential_ms": 0.5 * (h != "none"),
            "other_ms": 1.0,
            "round_ms": 14.5,
            "sequential_share": 0.03,
        }
        for c in (64, 128)
        for h in ("none", "markov")
        for b in (3, 7)
    ]
    assert plot_latency_breakdown(latency, tmp_path / "latency.png").read_bytes()[:8] == PNG_MAGIC


# ---- engine-backed (tiny target) ----

TINY_TARGET = {"feature_layers": [0, 3, 6, 7]}  # the `tiny` fixture's options (tests/conftest.py)


def _untrained(target, *, head="markov", block_size=BLOCK):
    from dspark.evaluation.diagnostics import untrained_dspark

    return untrained_dspark(target, head=head, block_size=block_size, depth=1, markov_rank=8, seed=0)


def test_encode_prompts_errors_name_the_prompt(tiny):
    from dspark.data.prompts import PromptRecord

    ok = encode_prompts(tiny, {"gsm8k": [PromptRecord("g-1", "math", "What is 2 + 2?")]}, max_new_tokens=4)
    assert ok[0].input_ids == tiny.chat_prompt_ids("What is 2 + 2?") and ok[0].domain == "math"
    with pytest.raises(ValueError, match="'g-2'.*empty"):
        encode_prompts(tiny, {"gsm8k": [PromptRecord("g-2", "math", "  ")]}, max_new_tokens=4)
    with pytest.raises(ValueError, match="'g-3'.*context of 16"):
        encode_prompts(
            tiny, {"gsm8k": [PromptRecord("g-3", "math", "word " * 40)]}, max_new_tokens=4, context_length=16
        )


def test_sts_collection_on_tiny_drafter_stores_calibration(tiny, tmp_path, monkeypatch):
    from dspark.decoding.proposers import DSparkProposer
    from dspark.drafters.factory import DrafterSpec
    from dspark.drafters.checkpoint import load_drafter, save_drafter

    drafter = _untrained(tiny)
    spec = DrafterSpec(
        kind="dspark",
        head="markov",
        depth=1,
        block_size=BLOCK,
        markov_rank=8,
        feature_layers=tuple(tiny.feature_layer_ids),
        mask_token_id=tiny.mask_token_id,
        target_fingerprint=tiny.fingerprint,
    )
    path = tmp_path / "drafter.pt"
    save_drafter(path, spec=spec, state_dict=drafter.state_dict(), metrics={"val/loss": 1.0})
    _, _, payload = load_drafter(path, tiny, block_size=BLOCK)
    prompts = [tiny.chat_prompt_ids(text) for text in ("Add 3 and 4.", "Write a haiku.")]
    rounds = collect_calibration_rounds(
        target=tiny,
        proposer=DSparkProposer(drafter),
        prompt_ids=prompts,
        temperature=1.0,
        max_new_tokens=12,
        seed=0,
        block_size=BLOCK,
        show_progress=False,
    )
    assert rounds.conf.shape[1] == BLOCK and rounds.conf.shape[0] >= 4 and rounds.num_prompts == 2
    assert bool(((rounds.conf > 0) & (rounds.conf < 1))[rounds.valid].all())
    report = calibrate_drafter(
        target=tiny,
        proposer=DSparkProposer(drafter),
        drafter_path=path,
        payload=payload,
        prompt_ids=prompts,
        temperature=1.0,
        max_new_tokens=12,
        seed=0,
        block_size=BLOCK,
        plot_path=tmp_path / "reliability.png",
    )
    assert report.plot_path.read_bytes()[:8] == PNG_MAGIC
    _, _, stored = load_drafter(path, tiny, block_size=BLOCK)
    entry = stored["calibration"][calibration_key(1.0)]
    assert entry["method"] == "sts" and len(entry["temperatures"]) == BLOCK
    assert entry["num_rounds"] == report.num_rounds and stored["metrics"] == {"val/loss": 1.0}
    # a second call at the same temperature reuses the stored fit without decoding
    monkeypatch.setattr(
        "dspark.evaluation.calibrate.collect_calibration_rounds",
        lambda **_: pytest.fail("decoded again although drafter.pt holds a fit"),
    )
    again = calibrate_drafter(
        target=tiny,
        proposer=None,
        drafter_path=path,
        payload=stored,
        prompt_ids=prompts,
        temperature=1.0,
        max_new_tokens=12,
        seed=0,
        block_size=BLOCK,
    )
    assert again.sts.temperatures == report.sts.temperatures


def test_sps_table_cached_and_reprofiled_on_mismatch(tiny, tmp_path, caplog):
    table, path = load_or_profile_sps(target=tiny, cache_dir=tmp_path, block_size=2)
    assert path == serving_sps_path(tmp_path, tiny, num_rows=1, context_length=256)  # the R = 1 serving table
    assert table.batch_tokens == [1, 2, 3] and table.target_fingerprint == tiny.fingerprint
    again, _ = load_or_profile_sps(target=tiny, cache_dir=tmp_path, block_size=2)
    assert again.created == table.created and again.steps_per_second == table.steps_per_second
    table.machine = "another machine"
    table.save(path)
    with caplog.at_level(logging.WARNING, logger="dspark"):
        fresh, _ = load_or_profile_sps(target=tiny, cache_dir=tmp_path, block_size=2)
    assert "another target or machine" in caplog.text and fresh.machine != "another machine"


def test_latency_breakdown_on_tiny(tiny):
    """The `latency` sweep's cell runner (`sweeps.latency`) reads these rows: one per (head, γ, context)."""
    latency = latency_breakdown(
        target=tiny,
        heads=("none", "markov"),
        block_sizes=(3,),
        context_lengths=(32,),
        rounds=3,
        depth=1,
        markov_rank=8,
        show_progress=False,
    )
    assert [(r["head"], r["block_size"], r["context_length"]) for r in latency] == [("none", 3, 32), ("markov", 3, 32)]
    for row in latency:
        assert row["rounds"] >= 1 and row["verify_ms"] > 0 and row["draft_parallel_ms"] > 0
        assert row["round_ms"] == pytest.approx(
            row["verify_ms"] + row["draft_parallel_ms"] + row["draft_sequential_ms"] + row["other_ms"]
        )


def test_teacher_forced_steps_rerun_the_training_step_without_gradients(tiny):
    """`evaluation.heldout`: the run's own step with its loss weights (what `val/` metrics read) and the raw block
    forward, batch by batch, without gradients; the caller's grad mode is its own between batches."""
    from dataclasses import asdict

    from dspark.config.schema import LossConfig
    from dspark.evaluation.heldout import teacher_forced_steps, validation_step
    from dspark.training.steps import block_forward, dspark_step

    drafter = _untrained(tiny)
    ids = torch.tensor([tiny.chat_prompt_ids("Add 3 and 4.")])
    anchors = torch.tensor([[2, 5, 8]])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids, dtype=torch.bool),
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
        "anchors": anchors,
        "anchor_valid": torch.ones_like(anchors, dtype=torch.bool),
    }
    loss = LossConfig(alpha_ce=0.3, alpha_tv=0.7)
    [(seen, result)] = teacher_forced_steps(
        [batch],
        drafter=drafter,
        target=tiny,
        block_size=BLOCK,
        step=validation_step("dspark", loss),
        show_progress=False,
    )
    expected = dspark_step(drafter=drafter, target=tiny, batch=batch, block_size=BLOCK, **asdict(loss))
    assert seen is batch and torch.equal(result.c_star, expected.c_star)
    assert torch.equal(result.label_valid, expected.label_valid)
    assert not result.loss.total.requires_grad and torch.is_grad_enabled()
    torch.testing.assert_close(result.loss.total, expected.loss.total.detach())
    [(_, (output, blocks, _))] = teacher_forced_steps(
        [batch], drafter=drafter, target=tiny, block_size=BLOCK, show_progress=False
    )
    direct, _, _ = block_forward(drafter=drafter, target=tiny, batch=batch, block_size=BLOCK)
    assert torch.equal(output.logits, direct.logits) and not output.logits.requires_grad
    assert blocks.labels.shape == (1, 3, BLOCK)
