"""`sweep=serving` end to end on the tiny target: every policy served for real (stage=serve), simulated levels and
validation logged, and `serving.md` generated from the tracking store with the frontier and budget figures."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from dspark.cli import main
from dspark.config import resolve_config
from dspark.reports.serving import real_summaries, simulated_summaries
from dspark.reports.collect import collect_sweep_runs
from dspark.serving.policies import SERVE_POLICIES
from dspark.sweeps.driver import run_sweep
from dspark.tracking import open_store

# one served sweep end to end (every policy, simulated levels, a bf16 serve): the slow tier (make test-all)
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]
FAST = ["budget=smoke", "optim.epochs=1", "serve.num_requests=3", "serve.max_new_tokens=6"]


@pytest.fixture(scope="module")
def serving_sweep(shared_root):
    """All six policies at R = 2 (an axis value on the command line selects those cells)."""
    argv = [
        "sweep=serving",
        *FAST,
        "serve.concurrency=2",
        f"paths.root={shared_root}",
        "tracking.experiment=serving-sweep",
    ]
    rc = resolve_config(argv)
    assert run_sweep(rc) == 0
    return rc


def test_every_policy_is_served_and_reported(serving_sweep):
    rc = serving_sweep
    store = open_store(rc.cfg)
    runs = collect_sweep_runs(store, sweep="serving")
    frame = runs.frame
    assert frame.height == len(SERVE_POLICIES.names())
    for column in (
        "serve/throughput",
        "serve/user_speed",
        "serve/budget",
        "serve/tau",
        "sim/R4/throughput",
        "sim/validation/tau_rel_err",
    ):
        assert column in frame.columns and frame[column].null_count() == 0, column
    real = {s.policy: s for s in real_summaries(frame)}
    assert set(real) == set(SERVE_POLICIES.names())
    assert real["mtp1"].budget == pytest.approx(1.0)  # mtp1 verifies exactly one draft per request and step
    assert real["fixed"].budget >= real["static"].budget >= real["mtp1"].budget
    assert all(s.simulated for s in simulated_summaries(frame))
    text = (Path(rc.cfg.paths.reports) / "serving.md").read_text()
    for policy in SERVE_POLICIES.names():
        assert f"| {policy} | 2 |" in text
    for figure in ("serving-frontier.png", "serving-budget.png"):
        assert f"]({figure})" in text and (Path(rc.cfg.paths.reports) / figure).stat().st_size > 1000
    assert "Scheduler vs MTP-1" in text and "Simulator validation" in text


def test_report_regenerates_from_the_store_alone(serving_sweep, capsys):
    rc = serving_sweep
    path = Path(rc.cfg.paths.reports) / "serving.md"
    path.unlink()
    assert (
        main(
            [
                "sweep=serving",
                *FAST,
                "serve.concurrency=2",
                f"paths.root={rc.cfg.paths.root}",
                "tracking.experiment=serving-sweep",
                "stage=report",
            ]
        )
        == 0
    )
    assert "| scheduler | 2 |" in path.read_text()


def test_serve_steps_are_attached(serving_sweep):
    rc = serving_sweep
    client = MlflowClient(rc.cfg.tracking.uri or f"sqlite:///{Path(rc.cfg.paths.root) / 'mlflow.db'}")
    runs = collect_sweep_runs(open_store(rc.cfg), sweep="serving").frame
    run_id = runs["run_id"][0]
    artifacts = [a.path for a in client.list_artifacts(run_id, "serve")]
    assert "serve/steps.jsonl" in artifacts and any(p.startswith("serve/serving-") for p in artifacts)  # + SPS table


def test_bad_serving_config_fails_before_work(capsys, tmp_path):
    assert (
        main(["stage=serve", "budget=smoke", "serve.policy=bogus", "serve.concurrency=0", f"paths.root={tmp_path}"])
        == 2
    )
    err = capsys.readouterr().err
    assert "serve.policy" in err and "serve.concurrency" in err
    assert main(["stage=serve", "budget=smoke", "drafter=eagle3", f"paths.root={tmp_path}"]) == 2
    assert "drafter=dspark or dflash" in capsys.readouterr().err
    assert (
        main(["stage=serve", "budget=smoke", f"serve.sps_table={tmp_path / 'missing.json'}", f"paths.root={tmp_path}"])
        == 2
    )
    assert "serve.sps_table" in capsys.readouterr().err


def test_each_simulated_level_is_timed_with_a_table_profiled_at_that_concurrency(serving_sweep):
    """budget=smoke simulates R = 4 and 8: each level gets its own SPS(B), profiled with that many rows up to
    R·(γ+1) tokens, instead of the cell's R = 2 table extrapolated past its largest batch."""
    import yaml

    from dspark.scheduling.sps import SPSTable

    cfg = serving_sweep.cfg
    sweep_file = Path(__file__).resolve().parents[1] / "sweeps" / "serving.yaml"
    levels = yaml.safe_load(sweep_file.read_text())["budget_overrides"]["smoke"]["serve.simulate_concurrency"]
    assert levels == [4, 8]  # the cells' levels (the sweep's smoke override, not the command line's default)
    sps_dir = Path(cfg.paths.root) / "cache" / "sps"
    for level in levels:
        tables = sorted(t for t in sps_dir.glob(f"serving-*-r{level}-c*.json") if not t.stem.endswith("-engine"))
        assert len(tables) == 1, (level, [p.name for p in sps_dir.iterdir()])
        table = SPSTable.load(tables[0])
        assert table.batch_tokens[0] == level and table.batch_tokens[-1] >= level * 2


def test_serve_target_dtype_serves_a_bf16_load_with_the_same_drafter(serving_sweep):
    """serve.target_dtype=bfloat16 serves the drafter trained against the fp32 target (same training key, no
    retraining) with a bf16 load of the same checkpoint; its SPS table and trace are the bf16 target's own."""
    import torch

    from dspark.stages.context import StageContext, training_key
    from dspark.stages.serve import serving_target, trace_key

    base = [
        "stage=serve",
        *FAST,
        "serve.concurrency=2",
        f"paths.root={serving_sweep.cfg.paths.root}",
        "tracking.experiment=serving-sweep",
    ]
    fp32, bf16 = resolve_config(base), resolve_config([*base, "serve.target_dtype=bfloat16"])
    assert training_key(fp32.cfg) == training_key(bf16.cfg)
    assert trace_key(StageContext(fp32, paths=None)) != trace_key(StageContext(bf16, paths=None))
    ctx = StageContext(bf16, paths=serving_sweep_paths(bf16))
    trained_target = ctx.load_target()
    served = serving_target(ctx, trained_target)
    assert next(trained_target.model.parameters()).dtype == torch.float32
    assert next(served.model.parameters()).dtype == torch.bfloat16
    assert served.checkpoint_fingerprint == trained_target.checkpoint_fingerprint
    assert served.fingerprint != trained_target.fingerprint  # the SPS tables are keyed by the served weights
    assert serving_target(StageContext(fp32, paths=serving_sweep_paths(fp32)), trained_target) is trained_target
    assert main([*base, "serve.target_dtype=bfloat16", "serve.policy=static"]) == 0  # end to end, drafter reused


def serving_sweep_paths(rc):
    from dspark.stages.context import RunPaths

    return RunPaths.from_config(rc.cfg)


def test_sps_forward_engine_plans_with_a_table_of_the_engines_own_forward(serving_sweep):
    """serve.sps_forward=engine: the scheduler's table (and the simulator's) is profiled on the batched engine's
    forward, cached under its own name; the run serves end to end with the drafter the sweep trained."""
    from dspark.scheduling.sps import SPSTable

    root = serving_sweep.cfg.paths.root
    base = ["stage=serve", *FAST, "serve.concurrency=2", f"paths.root={root}", "tracking.experiment=serving-engine"]
    assert main([*base, "serve.policy=scheduler", "serve.sps_forward=engine"]) == 0
    tables = sorted((Path(root) / "cache" / "sps").glob("serving-*-r2-c*-engine.json"))
    assert len(tables) == 1 and SPSTable.load(tables[0]).batch_tokens[0] == 2
