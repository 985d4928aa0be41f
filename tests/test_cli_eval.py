"""`python experiments/run.py budget=smoke …` in-process through `dspark.cli.main`: the eval stage with each decoding
policy and greedy verification, then `stage=report` and `stage=profile`. All invocations share one paths.root, so
prepare/train run once and later runs reuse the cached data and the trained drafter."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dspark.cli import main
from dspark.stages.experiment import RUN_ID_ENV

DATASETS = ("gsm8k", "humaneval", "mt-bench")
DOMAINS = ("math", "code", "chat")
BLOCK = 7  # budget=smoke keeps the default model.block_size


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-eval")


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """One thread; the CLI's environment variables (run id, MLflow URI) do not leak into other tests."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    for name in (RUN_ID_ENV, "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    yield
    torch.set_num_threads(previous)


def _latest_run(root):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    experiment = client.get_experiment_by_name("dspark-lab")
    return client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)[0]


def _eval_dirs(root):
    return sorted(root.glob("runs/*/evals/*"), key=lambda p: (p / "meta.json").stat().st_mtime)


CASES = {
    "fixed": [],
    "threshold": ["decode.policy=threshold", "decode.threshold=0.5"],
    "scheduler": ["decode.policy=scheduler"],
    "greedy": ["decode.temperature=0"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_eval_stage_logs_metrics(root, case):
    assert main(["budget=smoke", f"paths.root={root}", *CASES[case]]) == 0
    run = _latest_run(root)
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    for dataset in DATASETS:
        assert 1.0 <= metrics[f"eval/{dataset}/tau"] <= BLOCK + 1
        assert {f"eval/{dataset}/cond/pos{k}" for k in range(1, BLOCK + 1)} <= set(metrics)
        assert f"eval/{dataset}/speedup" in metrics and f"eval/{dataset}/tau_prompt_mean" in metrics
    for domain in DOMAINS:
        assert 1.0 <= metrics[f"eval/domain/{domain}/tau"] <= BLOCK + 1
        assert {f"eval/domain/{domain}/cond/pos{k}" for k in range(1, BLOCK + 1)} <= set(metrics)
    assert metrics["summary/tau"] == pytest.approx(metrics["eval/all/tau"])
    assert metrics["summary/speedup"] > 0 and metrics["eval/all/prompts"] == 2 * len(DATASETS)

    latest = _eval_dirs(root)[-1]
    meta = json.loads((latest / "meta.json").read_text())
    assert meta["decode"]["policy"] == ("fixed" if case in ("fixed", "greedy") else case)
    assert meta["mlflow_run_id"] == run.info.run_id
    rows = [json.loads(line) for line in (latest / "rounds.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in rows} == {"speculative", "target"} and len(rows) == 4 * len(DATASETS)
    policy = {"greedy": "fixed-T0", "threshold": "threshold-th0.5-T1"}.get(case, f"{case}-T1")
    prefix = f"eval-{next(root.glob('runs/dspark-markov-d2-g7-s0-*')).name}-{policy}-"
    [report] = (root / "reports").glob(f"{prefix}*.md")  # + the digest of the evaluated prompts
    stem = report.stem
    assert len(stem) == len(prefix) + 6
    assert "τ pooled" in report.read_text() and (root / "reports" / f"{stem}-cond.png").exists()
    from dspark.hardware import machine_summary

    # the machine and the resolved precisions are in the header (smoke: fp32 target; auto → bf16 or fp32 here)
    assert (
        meta["machine"] == machine_summary()
        and f"- machine: {meta['machine']}; target float32, drafter "
        f"parallel stage {meta['precision'].split('stage ')[1]}"
        in report.read_text()
    )
    assert meta["precision"].endswith("(decode.drafter_precision=auto)")
    artifacts = {a.path for a in _client(root).list_artifacts(run.info.run_id, "eval")}
    assert {f"eval/{stem}.md", f"eval/{stem}-cond.png"} <= artifacts

    if case == "threshold":  # STS fitted on held-out prompts and cached in drafter.pt under the temperature
        payload = torch.load(next(root.glob("runs/*/drafter.pt")), map_location="cpu", weights_only=True)
        assert len(payload["calibration"]["T=1"]["temperatures"]) == BLOCK
        assert "calibration/ece_before/pos1" in metrics and "Confidence calibration" in report.read_text()
    if case == "scheduler":
        assert len(list((root / "cache" / "sps").glob("*.json"))) == 1
    if case == "greedy":
        assert meta["decode"]["temperature"] == 0 and latest.name.endswith("-fixed-T0")


def _client(root):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")


def test_report_stage_rebuilds_from_saved_rounds(root, capsys):
    if not _eval_dirs(root):
        assert main(["budget=smoke", f"paths.root={root}"]) == 0
    [report] = (root / "reports").glob(f"eval-{next(root.glob('runs/dspark-markov-d2-g7-s0-*')).name}-fixed-T1-*.md")
    report.unlink()
    assert main(["budget=smoke", f"paths.root={root}", "stage=report"]) == 0
    assert "τ pooled" in report.read_text() and str(_eval_dirs(root)[-1]) in capsys.readouterr().out
    assert "summary/tau" in _latest_run(root).data.metrics


def test_report_stage_without_eval_says_so(tmp_path, capsys):
    assert main(["budget=smoke", f"paths.root={tmp_path}", "stage=report"]) == 1
    assert "No saved evaluation of this config" in capsys.readouterr().err


def test_profile_stage_prints_sps_table(root, capsys):
    assert main(["budget=smoke", f"paths.root={root}", "stage=profile"]) == 0
    out = capsys.readouterr().out
    assert "| B tokens | SPS" in out and f"| {BLOCK + 1} |" in out
    assert "profile/sps/B1" in _latest_run(root).data.metrics


def test_eval_without_the_target_only_baseline(root):
    """decode.baseline=false decodes each prompt once (speculative only): τ and acceptance are logged, the
    speed-up is not measured, and the saved rounds hold no target-only rollouts."""
    assert main(["budget=smoke", f"paths.root={root}", "decode.baseline=false", "decode.policy=static"]) == 0
    metrics = _latest_run(root).data.metrics
    assert 1.0 <= metrics["eval/all/tau"] <= BLOCK + 1 and metrics["eval/all/prompts"] == 2 * len(DATASETS)
    assert "eval/all/tau_prompt_ci95" in metrics
    assert math.isnan(metrics.get("summary/speedup", float("nan")))  # not measured
    latest = _eval_dirs(root)[-1]
    rows = [json.loads(line) for line in (latest / "rounds.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in rows} == {"speculative"} and len(rows) == 2 * len(DATASETS)


def test_report_names_tell_evaluations_of_one_drafter_apart():
    """The same drafter evaluated on other prompts (sweep=main's nine sets, sweep=head's three) gets its own report
    file; the same evaluation keeps its name (stage=report rebuilds it in place)."""
    from types import SimpleNamespace

    from dspark.config.schema import DecodeConfig
    from dspark.stages.evaluate import report_stem

    def stem(**decode):
        cfg = SimpleNamespace(decode=DecodeConfig(**decode), seed=0)
        return report_stem(SimpleNamespace(cfg=cfg, run_dir=Path("runs/dspark-markov-d2-g7-s0-abc")))

    base = stem(eval_sets=["gsm8k", "humaneval", "mt-bench"], prompts_per_set=10)
    assert base.startswith("eval-dspark-markov-d2-g7-s0-abc-fixed-T1-")
    assert base == stem(eval_sets=["gsm8k", "humaneval", "mt-bench"], prompts_per_set=10)
    others = {
        stem(eval_sets=["gsm8k", "math500"], prompts_per_set=10),
        stem(eval_sets=["gsm8k", "humaneval", "mt-bench"], prompts_per_set=4),
        stem(eval_sets=["gsm8k", "humaneval", "mt-bench"], prompts_per_set=10, max_new_tokens=32),
    }
    assert base not in others and len(others) == 3


def test_the_headline_never_reads_the_tau_policys_ratio_as_the_speed_up(root, capsys):
    """Under decode.policy=fixed (every draft verified: the τ setting) the speed-up of the last line is measured with
    decode.policy=scheduler on decode.speed_prompts of the prompts (its own round records and `speed/…` metrics),
    never the fixed policy's ratio; decode.baseline=false says the speed-up was not measured."""
    assert main(["budget=smoke", f"paths.root={root}"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("τ ") and "(fixed ℓ=γ=7, T=1, 6 prompts)" in last
    assert "with decode.policy=scheduler vs target-only on this machine" in last
    metrics = _latest_run(root).data.metrics
    assert metrics["speed/prompts"] == 6 and f"{metrics['speed/speedup_prompt_mean']:.2f}×" in last
    speed_rows = (_eval_dirs(root)[-1] / "speed-rounds.jsonl").read_text().splitlines()
    assert {json.loads(r)["mode"] for r in speed_rows} == {"speculative", "target"} and len(speed_rows) == 12
    assert main(["budget=smoke", f"paths.root={root}", "decode.baseline=false"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith("· speed-up not measured (decode.baseline=false)")
