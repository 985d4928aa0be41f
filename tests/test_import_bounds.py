"""An imported checkpoint is checked before anything is built (issue 57, deliverable 4): its config.json is parsed
with errors naming the file and the key, its safetensors header is read without the data (truncated, padded or
foreign files named), and every size the config claims is compared with the header and the target, so an absurd
size is refused with the field named instead of allocated. A drafter.pt whose spec claims more than its weights
hold is refused the same way. Every message quotes values in bounded length."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

import dspark.drafters.factory as factory
import safetensors.torch
from dspark.drafters.checkpoint import DRAFTER_FILE, load_drafter, save_drafter
from dspark.drafters.factory import DrafterSpec, build_drafter
from dspark.interop import export_drafter, import_drafter
from dspark.interop.bounds import MAX_CONFIG_BYTES, read_safetensors_header
from dspark.interop.load import check_import_dir

TINY_TARGET = {"threads": 1}
MESSAGE_LIMIT = 600  # characters: every refusal here quotes bounded values, whatever the input's size
HUGE = 10**9


def _spec(target, **changes) -> DrafterSpec:
    base = dict(
        kind="dspark",
        head="markov",
        depth=2,
        block_size=4,
        markov_rank=8,
        feature_layers=tuple(target.feature_layer_ids),
        mask_token_id=target.mask_token_id,
        target_fingerprint=target.fingerprint,
    )
    return DrafterSpec(**(base | changes))


@pytest.fixture(scope="module")
def qwen(tiny_qwen3_dir, tmp_path_factory):
    """The tiny target's shape as a random Qwen3 (q/k norms): the speculators layout holds Qwen3 layers only."""
    from dspark.targets import load_target

    return load_target(str(tiny_qwen3_dir), cache_dir=tmp_path_factory.mktemp("qwen3-cache"))


@pytest.fixture(scope="module")
def exports(qwen, tmp_path_factory) -> dict[str, Path]:
    """One export per layout of a depth-2, rank-8 DSpark drafter for the Qwen3-shaped tiny target."""
    spec = _spec(qwen)
    drafter = build_drafter(spec, qwen)
    root = tmp_path_factory.mktemp("exports")
    return {
        layout: export_drafter(drafter, spec, qwen, root / layout, layout=layout)
        for layout in ("deepspec", "speculators")
    }


@pytest.fixture()
def nothing_built(monkeypatch):
    """Fail the test if a drafter is built other than on the meta device (which allocates no weight) or a tensor
    is read."""
    real = factory.build_drafter

    def meta_only(*args, **kwargs):
        if torch.empty(0).device.type != "meta":
            raise AssertionError("a drafter was built before the checkpoint was refused")
        return real(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read before the checkpoint was refused")

    monkeypatch.setattr(factory, "build_drafter", meta_only)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


def _edit(path: Path, edit) -> None:
    """Apply `edit(config)` to path/config.json (a dict edited in place)."""
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def _refusal(path: Path, target, **kwargs) -> str:
    with pytest.raises(ValueError) as err:
        import_drafter(path, target, **kwargs)
    message = str(err.value)
    assert len(message) < MESSAGE_LIMIT, message[:2000]
    return message


# ---- absurd sizes: refused before any allocation ----


def _set(key: str, value):
    def edit(config):
        section = config
        *parents, last = key.split(".")
        for name in parents:
            section = section[name]
        section[last] = value

    return edit


@pytest.mark.parametrize(
    "layout, key, value, needle",
    [
        ("deepspec", "num_hidden_layers", HUGE, r"`num_hidden_layers` is 1000000000 but .* holds 2 draft layer"),
        ("deepspec", "num_hidden_layers", 3, r"`num_hidden_layers` is 3 but .* holds 2 draft layer"),
        ("deepspec", "markov_rank", HUGE, r"`markov_rank` is 1000000000 but .*markov_w1.weight of shape"),
        ("deepspec", "draft_vocab_size", HUGE, r"draft_vocab_size=1000000000 is outside 1\.\."),
        ("deepspec", "hidden_size", HUGE, r"`hidden_size` is 1000000000 but .* holds layers.0.input_layernorm.weight"),
        (
            "deepspec",
            "intermediate_size",
            HUGE,
            r"`intermediate_size` is 1000000000 but .* holds layers.0.mlp.gate_proj",
        ),
        ("deepspec", "num_attention_heads", HUGE, r"attention heads is 1000000000"),
        ("deepspec", "vocab_size", HUGE, r"vocabulary size is 1000000000"),
        ("deepspec", "mask_token_id", HUGE, r"mask_token_id=1000000000 is outside the vocabulary"),
        ("deepspec", "num_target_layers", HUGE, r"1000000000-layer target"),
        ("deepspec", "target_layer_ids", list(range(10**5)), r"target layer ids \[0, 1, 2.* are outside target"),
        ("deepspec", "block_size", HUGE, r"block_size=1000000000, the run asks for model.block_size=4"),
        (
            "speculators",
            "transformer_layer_config.num_hidden_layers",
            HUGE,
            r"`transformer_layer_config.num_hidden_layers` is 1000000000 but .* holds 2 draft layer",
        ),
        ("speculators", "markov_rank", HUGE, r"`markov_rank` is 1000000000"),
        ("speculators", "draft_vocab_size", HUGE, r"draft_vocab_size=1000000000 is outside"),
        ("speculators", "block_size", HUGE, r"block_size=1000000000, the run asks for model.block_size=4"),
    ],
)
def test_absurd_sizes_are_refused_before_anything_is_built(
    exports, qwen, tmp_path, nothing_built, layout, key, value, needle
):
    path = _copy(exports[layout], tmp_path)
    _edit(path, _set(key, value))
    assert re.search(needle, _refusal(path, qwen, block_size=4))


def test_a_config_that_agrees_with_a_smaller_header_names_the_tensor(exports, qwen, tmp_path):
    """Config and target agree, but a draft layer's MLP in the file is narrower: named with its shape and field."""
    path = _copy(exports["deepspec"], tmp_path)
    tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
    tensors["layers.1.mlp.gate_proj.weight"] = tensors["layers.1.mlp.gate_proj.weight"][:7].contiguous()
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
    message = _refusal(path, qwen)
    assert "'layers.1.mlp.gate_proj.weight' is (7, 64)" in message and "intermediate_size" in message
    del tensors["layers.1.mlp.gate_proj.weight"]
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
    assert "lacks ['layers.1.mlp.gate_proj.weight']" in _refusal(path, qwen)


def test_a_draft_vocabulary_without_d2t_names_the_field(qwen, tmp_path):
    spec = _spec(qwen, draft_vocab_size=20)
    drafter = build_drafter(spec, qwen, draft_vocab_ids=torch.arange(0, 60, 3))
    path = export_drafter(drafter, spec, qwen, tmp_path / "ckpt", layout="deepspec")
    tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
    del tensors["d2t"]
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
    assert "lacks ['d2t'], which the drafter its config.json describes needs (`draft_vocab_size`" in _refusal(
        path, qwen
    )
    _edit(path, _set("draft_vocab_size", 21))
    tensors["d2t"] = torch.zeros(20, dtype=torch.long)
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
    assert "`draft_vocab_size` 21 but" in _refusal(path, qwen)


def test_check_import_dir_needs_no_target(exports, tmp_path, nothing_built):
    fields, header = check_import_dir(exports["deepspec"])
    assert fields["depth"] == 2 and fields["markov_rank"] == 8 and "fc.weight" in header
    path = _copy(exports["deepspec"], tmp_path)
    _edit(path, _set("num_hidden_layers", HUGE))
    with pytest.raises(ValueError, match="`num_hidden_layers` is 1000000000"):
        check_import_dir(path)


# ---- malformed config.json ----


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"architectures": ["LlamaDSparkModel"], "block_size": ', r"config.json is not valid JSON \(.* at line 1"),
        ("[1, 2]", r"config.json holds a JSON list, not an object"),
        ('{"a": ' + "9" * 5000 + "}", r"config.json is not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, r"config.json is not valid JSON"),
    ],
)
def test_unparsable_configs_name_the_file(exports, qwen, tmp_path, nothing_built, text, needle):
    path = _copy(exports["deepspec"], tmp_path)
    (path / "config.json").write_text(text)
    message = _refusal(path, qwen)
    assert re.search(needle, message) and str(path / "config.json") in message


def test_non_utf8_and_oversized_configs_name_the_file(exports, qwen, tmp_path, nothing_built):
    path = _copy(exports["deepspec"], tmp_path)
    (path / "config.json").write_bytes(b'{"a": "\xff\xfe"}')
    assert "config.json is not UTF-8 text (at byte offset 7)" in _refusal(path, qwen)
    (path / "config.json").write_bytes(b" " * (MAX_CONFIG_BYTES + 1))
    assert "more than a config file can be" in _refusal(path, qwen)


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("num_hidden_layers", None, r"`num_hidden_layers` is missing \(an integer >= 1\)"),
        ("num_hidden_layers", "2", r"`num_hidden_layers` must be an integer >= 1, not '2'"),
        ("num_hidden_layers", 2.0, r"`num_hidden_layers` must be an integer >= 1, not 2.0"),
        ("num_hidden_layers", 0, r"`num_hidden_layers` must be an integer >= 1, not 0"),
        ("markov_rank", True, r"`markov_rank` must be an integer >= 0, not True"),
        ("enable_confidence_head", "yes", r"`enable_confidence_head` must be true or false"),
        ("target_layer_ids", "1,3,5", r"`target_layer_ids` must be a non-empty list of integers"),
        ("target_layer_ids", [], r"`target_layer_ids` must be a non-empty list of integers"),
        ("markov_head_type", 5, r"`markov_head_type` must be a string, not 5"),
        ("markov_head_type", "x" * 10**6, r"markov_head_type='xxx.*has no head here"),
        ("model_type", ["qwen3"], r"`model_type` must be a string"),
        ("hidden_size", {"a": 1}, r"`hidden_size` must be an integer >= 1"),
        ("architectures", "LlamaDSparkModel", r"`architectures` must be a list of model class names"),
        ("architectures", ["x" * 10**6], r"is neither a DeepSpec DSpark/DFlash/EAGLE-3 config"),
    ],
)
def test_ill_typed_fields_are_named_with_the_file(exports, qwen, tmp_path, nothing_built, key, value, needle):
    path = _copy(exports["deepspec"], tmp_path)
    _edit(path, (lambda c: c.pop(key)) if value is None else _set(key, value))
    message = _refusal(path, qwen)
    assert re.search(needle, message) and str(path / "config.json") in message


def test_speculators_sections_are_named_with_their_path(exports, qwen, tmp_path, nothing_built):
    path = _copy(exports["speculators"], tmp_path)
    _edit(path, _set("speculators_model_type", "eagle3"))
    _edit(path, _set("transformer_layer_config.num_hidden_layers", 1))
    _edit(path, _set("speculators_config", []))
    assert "`speculators_config` must be an object, not []" in _refusal(path, qwen)
    _edit(path, _set("speculators_config", {"proposal_methods": []}))
    assert "`speculators_config.proposal_methods` must be a non-empty list of objects" in _refusal(path, qwen)
    _edit(path, _set("speculators_model_type", "medusa" * 10**5))
    assert "speculators_model_type='medusamedusa" in _refusal(path, qwen)


# ---- model.safetensors, read through its header only ----


def _weights(path: Path) -> Path:
    return path / "model.safetensors"


def _rewrite_header(path: Path, edit) -> None:
    """Apply `edit(header)` to the JSON header of a safetensors file, keeping its data."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), r"is truncated"),
        (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 100), r"has 100 bytes after its last tensor"),
        (lambda p: p.write_text("this is a text file, not weights\n"), r"is not a safetensors file"),
        (lambda p: p.write_bytes(b"abc"), r"3 bytes, too short for a safetensors file"),
        (lambda p: p.write_bytes(struct.pack("<Q", 2**60) + b"{}"), r"is not a safetensors file: .* header"),
        (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}"), r"its header is not JSON"),
        (lambda p: p.write_bytes(struct.pack("<Q", 2) + b"[]"), r"its header is not a JSON object"),
    ],
)
def test_damaged_weights_are_named_before_safetensors_reads_them(
    exports, qwen, tmp_path, nothing_built, damage, needle
):
    path = _copy(exports["deepspec"], tmp_path)
    damage(_weights(path))
    message = _refusal(path, qwen)
    assert re.search(needle, message) and str(_weights(path)) in message


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda h: h["fc.weight"].update(shape=[10**12, 10**12]), r"does not fill its byte range"),
        (lambda h: h["fc.weight"].update(data_offsets=[0, 10**15]), r"is truncated: tensor 'fc.weight' ends at"),
        (lambda h: h["fc.weight"].update(dtype="F4X"), r"dtype 'F4X' is not one torch loads"),
        (lambda h: h["fc.weight"].update(shape="big"), r"shape 'big' is not a list"),
        (lambda h: h.update({"__metadata__": {"format": 1}}), r"__metadata__ is not an object of strings"),
        (lambda h: h.update({"x" * 10**5: h.pop("fc.weight")}), r"lacks \['fc.weight'\]"),
        (
            lambda h: h.update({f"layers.{'9' * 5000}.mlp.up_proj.weight": h.pop("layers.1.mlp.up_proj.weight")}),
            r"lacks \['layers.1.mlp.up_proj.weight'\]",
        ),
    ],
)
def test_lying_headers_are_named(exports, qwen, tmp_path, nothing_built, edit, needle):
    path = _copy(exports["deepspec"], tmp_path)
    _rewrite_header(_weights(path), edit)
    message = _refusal(path, qwen)
    assert re.search(needle, message) and str(_weights(path)) in message


def test_an_intact_header_is_read_without_the_data(exports):
    header = read_safetensors_header(_weights(exports["deepspec"]))
    assert header["layers.1.mlp.down_proj.weight"].shape[0] == 64
    assert sum(info.end - info.begin for info in header.values()) < _weights(exports["deepspec"]).stat().st_size


# ---- drafter.pt: the spec's sizes against its weights ----


@pytest.fixture(scope="module")
def drafter_pt(tiny, tmp_path_factory) -> Path:
    spec = _spec(tiny, depth=1)
    path = tmp_path_factory.mktemp("run") / DRAFTER_FILE
    save_drafter(path, spec=spec, state_dict=build_drafter(spec, tiny).state_dict(), metrics={})
    return path


def _with_spec(path: Path, tmp_path: Path, **changes) -> Path:
    payload = torch.load(path, weights_only=True)
    payload["spec"] |= changes
    out = tmp_path / DRAFTER_FILE
    torch.save(payload, out)
    return out


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"depth": HUGE}, r"its spec says depth=1000000000 but its weights hold 1 draft layer"),
        ({"markov_rank": HUGE}, r"head.w1.weight is \(\d+, 8\), the spec makes it \(\d+, 1000000000\)"),
        ({"draft_vocab_size": 7}, r"lacks draft_head.draft_to_target"),
        ({"depth": "2"}, r"drafter spec field depth must be an integer >= 1, not '2'"),
        ({"feature_layers": "1,2"}, r"drafter spec field feature_layers must be a list of integers"),
        ({"surprise": 1}, r"unknown drafter spec field\(s\) \['surprise'\]"),
        ({"kind": "x" * 10**6}, r"drafter spec kind 'xxx.* is not one of dflash, dspark"),
        ({"head": "lstm"}, r"drafter spec head 'lstm' is not one of"),
    ],
)
def test_a_drafter_pt_spec_beyond_its_weights_is_refused_before_the_build(
    drafter_pt, tiny, tmp_path, monkeypatch, changes, needle
):
    built = []
    real = factory.DRAFTER_BUILDERS.resolve("dspark")
    monkeypatch.setitem(factory.DRAFTER_BUILDERS._items, "dspark", lambda *a: built.append(torch.empty(0)) or real(*a))
    path = _with_spec(drafter_pt, tmp_path, **changes)
    with pytest.raises(ValueError) as err:
        load_drafter(path, tiny)
    assert re.search(needle, str(err.value)) and len(str(err.value)) < MESSAGE_LIMIT, str(err.value)
    assert all(t.device.type == "meta" for t in built)  # only meta builds (no weight allocated) happened


def test_a_claimed_layer_width_the_header_does_not_hold_is_refused_from_the_header():
    """A config whose hidden size is 2^24 while draft layer 0's norm is 64 wide: refused naming the key, no build."""
    from dspark.interop.bounds import TensorInfo, check_header_sizes

    header = {
        "layers.0.input_layernorm.weight": TensorInfo(dtype="F32", shape=(64,), begin=0, end=256),
        "layers.0.mlp.gate_proj.weight": TensorInfo(dtype="F32", shape=(128, 64), begin=256, end=33024),
    }
    fields = {
        "keys": {"depth": "num_hidden_layers"},
        "depth": 1,
        "markov_rank": 0,
        "draft_vocab_size": None,
        "layer_config": {"hidden_size": 1 << 24, "intermediate_size": 128},
    }
    with pytest.raises(ValueError, match="`hidden_size` is 16777216"):
        check_header_sizes(fields, header, config="config.json", weights="model.safetensors")
    fields["layer_config"]["hidden_size"] = 64  # the control: the sizes the header holds pass
    check_header_sizes(fields, header, config="config.json", weights="model.safetensors")
