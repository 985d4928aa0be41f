"""Captured features from elsewhere (docs/FEATURES.md, `dspark.data.feature_format`): the reference writer
`tools/write_features.py` (a plain transformers forward) writes what our own prepare stage writes for the same
sequences; malformed directories are refused before any work with the field named; training reads a valid one.

Every malformed case is re-sealed after the damage (fresh checksums and shard table), except the checksum case
itself, so each is caught by exactly the check it names: removing that check lets the case through.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.config import resolve_config
from dspark.data.feature_format import (
    MANIFEST,
    TargetIdentity,
    content_digest,
    feature_dir_errors,
    load_external_features,
    preflight_errors,
    read_metadata,
    seal_feature_dir,
    shard_name,
)
from dspark.data.integrity import seal_cache

REPO = Path(__file__).resolve().parents[1]
ANSWER = "First add the two numbers, then check the sum twice; the answer is {n}, and it is even."


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_dir, tmp_path_factory):
    from dspark.targets import load_target

    torch.set_num_threads(1)
    return load_target(str(tiny_qwen3_dir), cache_dir=tmp_path_factory.mktemp("qwen3-cache"))


@pytest.fixture(scope="module")
def written(qwen3, tiny_qwen3_dir, tmp_path_factory):
    """Six prompt/response pairs in shards of 4 (the last one partial): our prepare's cache of them (reference
    responses, fp32 prefill) and the reference writer's directory."""
    from dspark.data.features import cache_features
    from dspark.data.records import PromptRecord
    from dspark.data.reference import build_reference_dataset

    root = tmp_path_factory.mktemp("features")
    prompts = [
        PromptRecord(
            id=f"p{i}", domain="math", prompt=f"What is {i} plus {i}?", turns=[], reference=ANSWER.format(n=2 * i)
        )
        for i in range(6)
    ]
    regen = build_reference_dataset(qwen3, prompts, cache_dir=root / "cache", max_length=256, min_loss_tokens=1)
    ours = cache_features(qwen3, regen, cache_dir=root / "cache", shard_size=4, precision="fp32", show_progress=False)
    pairs = root / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"id": p.id, "domain": p.domain, "prompt": p.prompt, "response": p.reference}) + "\n"
            for p in prompts
        )
    )
    writer = _writer()
    assert (
        writer.main(
            ["--model", str(tiny_qwen3_dir), "--pairs", str(pairs), "--out", str(root / "ext"), "--shard-size", "4"]
        )
        == 0
    )
    return {"root": root, "ours": ours, "ext": root / "ext", "pairs": pairs, "regen": regen}


def _writer():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import write_features
    finally:
        sys.path.remove(str(REPO / "tools"))
    return write_features


def _shards(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for s in range(json.loads((directory / MANIFEST).read_text())["num_shards"]):
        tensors |= {f"{s}/{k}": v for k, v in load_file(str(directory / shard_name(s))).items()}
    return tensors


def test_the_reference_writer_writes_what_our_prepare_stage_writes(written, qwen3):
    identity = TargetIdentity.of_target(qwen3)
    for directory in (written["ours"], written["ext"]):
        assert feature_dir_errors(directory, expected=identity, verify_hashes=True) == []
    ours, theirs = _shards(written["ours"]), _shards(written["ext"])
    assert sorted(ours) == sorted(theirs) and any(k.endswith("input_ids.5") for k in ours)
    for name, mine in ours.items():
        other = theirs[name]
        assert mine.dtype == other.dtype and mine.shape == other.shape, name
        if mine.dtype.is_floating_point:  # fp16-stored features: one rounding step apart at most
            torch.testing.assert_close(mine.float(), other.float(), atol=2e-3, rtol=2e-3, msg=name)
        else:
            assert torch.equal(mine, other), name
    manifests = [json.loads((d / MANIFEST).read_text()) for d in (written["ours"], written["ext"])]
    assert manifests[0]["target"] == manifests[1]["target"] and manifests[0]["tokenizer"] == manifests[1]["tokenizer"]
    assert manifests[0]["shards"] == manifests[1]["shards"] and manifests[1]["num_tokens"] > 6 * 20
    assert read_metadata(written["ext"] / shard_name(1)) == read_metadata(written["ours"] / shard_name(1))


def test_the_comparison_sees_other_feature_layers(written, tiny_qwen3_dir, tmp_path):
    """Control: the writer with other layers writes other features, which the comparison above would refuse."""
    out = tmp_path / "other-layers"
    args = ["--model", str(tiny_qwen3_dir), "--pairs", str(written["pairs"]), "--out", str(out), "--shard-size", "4"]
    assert _writer().main([*args, "--layers", "0,2,3,4,5"]) == 0
    mine, other = _shards(written["ours"])["0/features.0"], _shards(out)["0/features.0"]
    assert mine.shape == other.shape and not torch.allclose(mine.float(), other.float(), atol=2e-3, rtol=2e-3)


def _reseal(directory: Path, edit=None) -> None:
    manifest = json.loads((directory / MANIFEST).read_text())
    if edit is not None:
        edit(manifest)
    seal_feature_dir(directory, manifest)


def _rewrite_shard(directory: Path, shard: int, change) -> None:
    path = directory / shard_name(shard)
    metadata, tensors = read_metadata(path), load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata=metadata)
    _reseal(directory)


def _flip_a_data_byte(directory: Path, shard: int) -> None:
    path = directory / shard_name(shard)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10  # inside the last tensor's data: the header (names, shapes, dtypes) and the size stay valid
    path.write_bytes(bytes(data))


def _wrong_target(manifest):
    manifest["target"]["name"] = "someone/other-model"
    manifest["target"].pop("weights_digest")


MALFORMED = {
    "wrong shape": (
        lambda d: _rewrite_shard(d, 1, lambda t: t.update({"final_hidden.5": t["final_hidden.5"][:, :32].clone()})),
        ['features-00001.safetensors: tensor "final_hidden.5" has shape [', ", 32], expected [", "hidden_size 64"],
    ),
    "wrong dtype": (
        lambda d: _rewrite_shard(d, 0, lambda t: t.update({"features.2": t["features.2"].float()})),
        ['features-00000.safetensors: tensor "features.2" has dtype F32, expected F16'],
    ),
    "missing tensor": (
        lambda d: _rewrite_shard(d, 0, lambda t: t.pop("log_normalizer.1")),
        ['features-00000.safetensors: tensor "log_normalizer.1" is missing'],
    ),
    "bad checksum": (
        lambda d: _flip_a_data_byte(d, 1),
        ["features-00001.safetensors: sha256", "differs from the manifest's"],
    ),
    "wrong layer ids": (
        lambda d: _reseal(d, lambda m: m.update(feature_layer_ids=[0, 2, 3, 4, 5])),
        ["manifest.json: feature_layer_ids=[0, 2, 3, 4, 5] but the run's target uses [1, 2, 3, 4, 5]"],
    ),
    "wrong target": (
        lambda d: _reseal(d, _wrong_target),
        ["manifest.json: target.name='someone/other-model'", "set target="],
    ),
    "control: a good directory": (lambda d: None, []),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_directory_is_refused_in_preflight_naming_the_field(case, written, tiny_qwen3_dir, tmp_path):
    damage, needles = MALFORMED[case]
    directory = tmp_path / "ext"
    shutil.copytree(written["ext"], directory)
    damage(directory)
    cfg = resolve_config(
        ["budget=smoke", f"target={tiny_qwen3_dir}", f"data.features_from={directory}", f"paths.root={tmp_path}"]
    ).cfg
    errors = preflight_errors(cfg)
    if not needles:
        assert errors == []
        return
    assert errors and all(e.startswith(f"data.features_from={directory}: ") for e in errors)
    assert any(all(n in e for n in needles) for e in errors), errors


def test_the_cli_refuses_a_malformed_directory_before_any_work(written, tiny_qwen3_dir, tmp_path, capsys):
    from dspark.cli import main

    directory = tmp_path / "ext"
    shutil.copytree(written["ext"], directory)
    _reseal(directory, lambda m: m.update(feature_layer_ids=[0, 2, 3, 4, 5]))
    argv = ["stage=train", "budget=smoke", f"target={tiny_qwen3_dir}", f"data.features_from={directory}"]
    assert main([*argv, f"paths.root={tmp_path / 'root'}"]) == 2
    assert "feature_layer_ids=[0, 2, 3, 4, 5]" in capsys.readouterr().err
    assert not (tmp_path / "root" / "mlflow.db").exists()  # nothing ran


def test_other_weights_are_refused_once_the_target_is_loaded(written, qwen3, tmp_path):
    """The weights digest needs the loaded target: checked at prepare, before training (preflight lets it pass)."""
    directory = tmp_path / "ext"
    shutil.copytree(written["ext"], directory)
    regen, features = load_external_features(qwen3, directory, cache_dir=tmp_path / "cache")  # control: accepted
    assert features == directory
    from dspark.data.regenerate import load_regenerated

    rows = load_regenerated(regen)
    theirs = load_regenerated(written["regen"])
    assert rows["input_ids"] == theirs["input_ids"] and rows["prompt_id"] == theirs["prompt_id"]
    _reseal(directory, lambda m: m["target"].update(weights_digest="0" * 64))
    with pytest.raises(ValueError, match="target.weights_digest differs"):
        load_external_features(qwen3, directory, cache_dir=tmp_path / "cache")


def test_a_version_1_cache_is_read_as_ours(written, qwen3, tmp_path):
    """Caches written before format version 2 (no token ids, no identity) train beside their regenerated data;
    checked by our target fingerprint."""
    cache = written["root"] / "cache"
    directory = cache / "features" / f"v1-{tmp_path.name}"
    shutil.copytree(written["ours"], directory)
    manifest = json.loads((directory / MANIFEST).read_text())
    v1 = {k: manifest[k] for k in ("key", "regen_key", "target_fingerprint", "feature_layer_ids", "hidden_size")}
    v1 |= {k: manifest[k] for k in ("num_sequences", "shard_size", "num_shards", "precision", "format")}
    v1["dtype"] = "torch.float16"
    for s in range(v1["num_shards"]):
        path = directory / shard_name(s)
        tensors = {k: v for k, v in load_file(str(path)).items() if not k.startswith(("input_ids", "loss_mask"))}
        save_file(tensors, str(path))
    (directory / MANIFEST).unlink()
    seal_cache(directory, v1, [shard_name(s) for s in range(v1["num_shards"])])
    identity = TargetIdentity.of_target(qwen3)
    assert feature_dir_errors(directory, expected=identity, fingerprint=qwen3.fingerprint, verify_hashes=True) == []
    assert load_external_features(qwen3, directory, cache_dir=cache) == (written["regen"], directory)
    errors = feature_dir_errors(directory, expected=identity, fingerprint="other", verify_hashes=True)
    assert len(errors) == 1 and "target_fingerprint differs" in errors[0]  # control: another target is refused


def test_training_reads_the_captured_features_without_a_prefill(written, tiny_qwen3_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    from dspark.cli import main

    root = tmp_path / "root"
    argv = ["stage=train", "budget=smoke", "optim.epochs=1", f"target={tiny_qwen3_dir}", f"paths.root={root}"]
    assert main([*argv, f"data.features_from={written['ext']}"]) == 0
    assert not (root / "cache" / "features").exists()  # the target never ran a prefill: the shards were read
    manifests = [json.loads(p.read_text()) for p in (root / "cache" / "regen").glob(f"*/{MANIFEST}")]
    assert [m["responses"] for m in manifests] == ["features_from"] and manifests[0]["num_prompts"] == 6
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("dspark-lab").experiment_id])
    (entry,) = client.get_run(run.info.run_id).inputs.dataset_inputs
    digest = content_digest(json.loads((written["ext"] / MANIFEST).read_text()))[:16]
    assert (entry.dataset.name, entry.dataset.digest) == ("captured-features:ext", digest)
    assert run.data.metrics["data/sequences"] == 6
