"""Data lineage and system metrics in MLflow (`dspark.tracking.lineage`, `dspark.tracking.system_metrics`): a run's
training and evaluation sets are dataset inputs with digests and sources; credentials in a source never reach the
store; `system/*` metrics are logged when `tracking.system_metrics` is on, and the sampler stops at once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from dspark.tracking.store import TrackingStore

SMOKE = [
    "budget=smoke",
    "optim.epochs=1",
    "decode.eval_sets=[gsm8k,mt-bench]",
    "decode.prompts_per_set=1",
    "decode.baseline=false",
    "decode.calibrate=false",
]


def _runs(root: Path) -> list:
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("dspark-lab").experiment_id
    return [client.get_run(r.info.run_id) for r in client.search_runs([experiment], order_by=["attributes.start_time"])]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """A cheap end-to-end run (train + evaluate on 2 prompts), then a prepare-only rerun with system metrics off;
    their paths.root (its store is reused by the unit tests: creating one costs seconds of schema migrations)."""
    from dspark.cli import main

    root = tmp_path_factory.mktemp("lineage-root")
    argv = [*SMOKE, f"paths.root={root}", f"paths.reports={root / 'reports'}"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(argv) == 0
        assert main([*argv, "stage=prepare", "tracking.system_metrics=false"]) == 0  # control: the switch
    finally:
        torch.set_num_threads(threads)
    return root


@pytest.fixture(scope="module")
def store(smoke):
    uri = f"sqlite:///{smoke / 'mlflow.db'}"
    client = MlflowClient(uri)
    return TrackingStore(uri=uri, experiment_id=client.create_experiment("lineage-unit"), client=client)


def test_a_smoke_run_logs_its_data_as_dataset_inputs_and_its_system_metrics(smoke):
    root = smoke
    full, prepare_only = _runs(root)
    inputs = {d.dataset.name: d for d in full.inputs.dataset_inputs}
    assert sorted(inputs) == ["eval:gsm8k", "eval:mt-bench", "regenerated:synthetic", "target-features:synthetic"]
    context = {name: {t.key: t.value for t in d.tags}["mlflow.data.context"] for name, d in inputs.items()}
    assert context == {n: "evaluation" if n.startswith("eval:") else "training" for n in inputs}
    for name, entry in inputs.items():
        assert len(entry.dataset.digest) == 16 and int(entry.dataset.digest, 16) >= 0, name
        assert str(root) not in entry.dataset.source  # cache paths are recorded relative to paths.root
    regen = json.loads(inputs["regenerated:synthetic"].dataset.source)["uri"]
    assert (root / regen / "COMPLETE").exists() and json.loads(inputs["regenerated:synthetic"].dataset.profile)
    assert json.loads(inputs["eval:gsm8k"].dataset.source) == {"uri": "dspark/data/prompt_sets/gsm8k_test.jsonl"}
    # the same data gives the same digests: the prepare-only rerun reused the caches
    again = {d.dataset.name: d.dataset.digest for d in prepare_only.inputs.dataset_inputs}
    assert again == {n: inputs[n].dataset.digest for n in again} and "regenerated:synthetic" in again
    assert full.data.metrics["system/cpu_utilization_percentage"] >= 0
    assert full.data.metrics["system/system_memory_usage_megabytes"] > 0
    assert not [k for k in prepare_only.data.metrics if k.startswith("system/")]


def test_credentials_in_a_source_never_reach_the_store(store, tmp_path):
    """A regeneration server's URL with user:password@ (or any URL in a tag) is recorded masked."""
    from dspark.config import resolve_config
    from dspark.tracking.lineage import log_data_inputs, training_inputs

    regen = tmp_path / "cache" / "regen" / "abc"
    regen.mkdir(parents=True)
    backend = {"backend": "openai", "url": "http://me:Sec-123@gen.local:8000/v1", "model": {"id": "m"}}
    manifest = {"key": "abc", "target": "tiny", "backend": backend, "checksums": {"s": {"sha256": "0" * 64}}}
    (regen / "manifest.json").write_text(json.dumps(manifest))
    cfg = resolve_config(["budget=smoke", f"paths.root={tmp_path}"]).cfg
    run = store.create_run(run_name="lineage", tags={})
    log_data_inputs(store, run, training_inputs(regen, None, cfg=cfg, root=tmp_path))
    (entry,) = store.client.get_run(run).inputs.dataset_inputs
    assert entry.dataset.source_type == "http" and json.loads(entry.dataset.source)["url"].startswith("http://me:***@")
    assert "Sec-123" not in Path(store.uri.removeprefix("sqlite:///")).read_bytes().decode("latin-1")


def test_the_sampler_logs_a_last_sample_and_stops_without_waiting_an_interval(store):
    from dspark.tracking.system_metrics import SAMPLING_INTERVAL_S, system_metrics

    run = store.create_run(run_name="metrics", tags={})
    with system_metrics(store, run, enabled=True):
        time.sleep(0.2)
        started = time.perf_counter()
    stopped = time.perf_counter() - started
    assert stopped < SAMPLING_INTERVAL_S / 4, stopped  # it did not sit out the 10 s interval
    history = store.client.get_metric_history(run, "system/cpu_utilization_percentage")
    assert len(history) == 1  # the run was shorter than one interval: the last sample is its only step
    off = store.create_run(run_name="off", tags={})
    with system_metrics(store, off, enabled=False):  # control
        time.sleep(0.2)
    assert not store.client.get_run(off).data.metrics
