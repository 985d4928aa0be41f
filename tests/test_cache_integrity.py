"""Cache integrity (issue 14, "Caches"): a truncated or bit-flipped regeneration or feature shard is detected by
the checksums in the manifest and rebuilt (only that shard), never trained on; two processes preparing the same
cache at once produce one valid cache (a lock file), the second reusing the first one's work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dspark.data.features as features_lib
import dspark.data.regenerate as regen_lib
from dspark.data.features import FeatureCache, cache_features
from dspark.data.integrity import CHECKSUMS, damaged_files
from dspark.data.prompts import PromptRecord
from dspark.data.reference import build_reference_dataset
from dspark.data.regenerate import MANIFEST, SamplingConfig, load_regenerated, regenerate_responses, shard_path

TINY_TARGET = {"threads": 1}
SAMPLING = SamplingConfig(max_new_tokens=6, batch_size=2)
PROMPTS = [PromptRecord(f"p{i}", "math", f"What is {i} + {i}?") for i in range(6)]  # 3 shards of 2 prompts
REPO = Path(__file__).resolve().parents[1]


def _regen(tiny, cache_dir: Path) -> Path:
    return regenerate_responses(
        tiny, PROMPTS, sampling=SAMPLING, cache_dir=cache_dir, seed=0, min_loss_tokens=1, show_progress=False
    )


def _features(tiny, regen_dir: Path, cache_dir: Path) -> Path:
    return cache_features(
        tiny, regen_dir, cache_dir=cache_dir, batch_size=2, shard_size=2, show_progress=False, precision="fp32"
    )


def _count_calls(monkeypatch, module, name: str) -> list:
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _flip_one_bit(path: Path, *, at: float = 0.6) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x04
    path.write_bytes(bytes(data))


def test_a_sealed_cache_records_every_shard(tiny, tmp_path):
    regen_dir = _regen(tiny, tmp_path)
    manifest = json.loads((regen_dir / MANIFEST).read_text())
    assert sorted(manifest[CHECKSUMS]) == [shard_path(regen_dir, i).name for i in range(3)]
    assert all(len(v["sha256"]) == 64 and v["bytes"] > 0 for v in manifest[CHECKSUMS].values())
    assert damaged_files(regen_dir) == []


@pytest.mark.parametrize("damage", ["truncate", "bit-flip", "delete"])
def test_a_damaged_regeneration_shard_is_rebuilt_alone(damage, tiny, tmp_path, monkeypatch, caplog):
    regen_dir = _regen(tiny, tmp_path)
    good = load_regenerated(regen_dir).to_list()
    shard = shard_path(regen_dir, 1)
    original = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(original[: len(original) // 2])
    elif damage == "bit-flip":
        _flip_one_bit(shard)
    else:
        shard.unlink()
    assert damaged_files(regen_dir) == [shard.name]
    calls = _count_calls(monkeypatch, regen_lib, "regenerate_batch")
    with caplog.at_level("WARNING", logger="dspark"):
        assert _regen(tiny, tmp_path) == regen_dir
    assert "do not match the checksums" in caplog.text and shard.name in caplog.text
    assert len(calls) == 1  # only the damaged shard was regenerated
    assert damaged_files(regen_dir) == []
    assert load_regenerated(regen_dir).to_list() == good  # batch seeds make the rows identical (timings differ)


def test_a_whole_cache_is_reused_without_work(tiny, tmp_path, monkeypatch):
    regen_dir = _regen(tiny, tmp_path)
    calls = _count_calls(monkeypatch, regen_lib, "regenerate_batch")
    assert _regen(tiny, tmp_path) == regen_dir and calls == []


def test_a_cache_sealed_before_checksums_is_reused_unverified(tiny, tmp_path, monkeypatch):
    regen_dir = _regen(tiny, tmp_path)
    manifest = json.loads((regen_dir / MANIFEST).read_text())
    del manifest[CHECKSUMS]
    (regen_dir / MANIFEST).write_text(json.dumps(manifest))
    calls = _count_calls(monkeypatch, regen_lib, "regenerate_batch")
    assert _regen(tiny, tmp_path) == regen_dir and calls == [] and damaged_files(regen_dir) is None


@pytest.mark.parametrize("damage", ["truncate", "bit-flip"])
def test_a_damaged_feature_shard_is_recomputed_before_training_reads_it(damage, tiny, tmp_path, monkeypatch, caplog):
    regen_dir = _regen(tiny, tmp_path)
    feature_dir = _features(tiny, regen_dir, tmp_path)
    good = [tuple(t.clone() for t in FeatureCache(feature_dir)[i]) for i in range(len(PROMPTS))]  # not mmapped
    shard = feature_dir / "features-00002.safetensors"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    else:
        _flip_one_bit(shard, at=0.9)  # inside the tensor data: the file still opens, the values are wrong
    calls = _count_calls(monkeypatch, features_lib, "_shard_tensors")
    with caplog.at_level("WARNING", logger="dspark"):
        assert _features(tiny, regen_dir, tmp_path) == feature_dir
    assert len(calls) == 1 and "features-00002.safetensors" in caplog.text
    rebuilt = FeatureCache(feature_dir)
    for i, (feats, hidden) in enumerate(good):
        assert torch.equal(rebuilt[i][0], feats) and torch.equal(rebuilt[i][1], hidden)


def test_a_damaged_reference_shard_is_rebuilt(tiny, tmp_path, caplog):
    prompts = [
        PromptRecord(f"r{i}", "math", f"Add {i} and 2.", reference=f"{i} + 2 = {i + 2}, done.") for i in range(3)
    ]
    out = build_reference_dataset(tiny, prompts, cache_dir=tmp_path, max_length=64, min_loss_tokens=1)
    good = load_regenerated(out).to_list()
    shard_path(out, 0).write_bytes(b"PAR1")
    with caplog.at_level("WARNING", logger="dspark"):
        assert build_reference_dataset(tiny, prompts, cache_dir=tmp_path, max_length=64, min_loss_tokens=1) == out
    assert "do not match the checksums" in caplog.text and load_regenerated(out).to_list() == good


PREPARER = textwrap.dedent("""
    import json, pathlib, sys, time
    import torch
    torch.set_num_threads(1)
    import dspark.data.features as features_lib
    import dspark.data.regenerate as regen_lib
    from dspark.data.features import cache_features
    from dspark.data.prompts import PromptRecord
    from dspark.data.regenerate import SamplingConfig, regenerate_responses
    from dspark.targets import load_target
    cache, barrier, me = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
    target = load_target("tiny", cache_dir=cache / f"target-{me}")  # same seed: same weights and fingerprint
    calls = {"regen_batches": 0, "feature_shards": 0}
    real_batch, real_tensors = regen_lib.regenerate_batch, features_lib._shard_tensors
    def regen_batch(*a, **k):
        calls["regen_batches"] += 1
        return real_batch(*a, **k)
    def shard_tensors(*a, **k):
        calls["feature_shards"] += 1
        return real_tensors(*a, **k)
    regen_lib.regenerate_batch, features_lib._shard_tensors = regen_batch, shard_tensors
    (barrier / me).touch()
    while len(list(barrier.iterdir())) < 2:
        time.sleep(0.01)
    prompts = [PromptRecord(f"p{i}", "math", f"What is {i} + {i}?") for i in range(6)]
    regen = regenerate_responses(target, prompts, sampling=SamplingConfig(max_new_tokens=6, batch_size=2),
                                 cache_dir=cache, seed=0, min_loss_tokens=1, show_progress=False)
    feats = cache_features(target, regen, cache_dir=cache, batch_size=2, shard_size=2, show_progress=False,
                           precision="fp32")
    print(json.dumps({"regen": str(regen), "features": str(feats), **calls}))
""")


@pytest.mark.slow
def test_two_processes_preparing_one_cache_build_it_once(tmp_path):
    cache, barrier = tmp_path / "cache", tmp_path / "barrier"
    barrier.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PREPARER, str(cache), str(barrier), name],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert results[0]["regen"] == results[1]["regen"] and results[0]["features"] == results[1]["features"]
    assert sorted(r["regen_batches"] for r in results) == [0, 3]  # one process built all 3 shards, the other none
    assert sorted(r["feature_shards"] for r in results) == [0, 3]
    assert damaged_files(Path(results[0]["regen"])) == [] and damaged_files(Path(results[0]["features"])) == []
    assert [p.name for p in (cache / "regen").iterdir()] == [Path(results[0]["regen"]).name]  # one dataset
