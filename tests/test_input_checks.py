"""Bad inputs are refused by cheap checks before any loading (issue 14, defect 4): model directories, GGUF and
safetensors files, prompt files, and policies that need a confidence head.

Every check here reads headers or listings only, so each case is asserted to answer in well under a second (a
model load takes seconds; the GGUF conversion ~18 s).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from dspark.config import ConfigError, resolve_config
from dspark.data.prompts import check_prompt_file
from dspark.targets import load_target
from dspark.targets.checks import check_gguf_file, check_model_dir, check_target


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny target's save_pretrained directory (built once)."""
    cache = tmp_path_factory.mktemp("cache")
    load_target("tiny", cache_dir=cache)
    return cache / "targets" / "tiny-seed0"


def _copy(tiny_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(tiny_dir, out)
    return out


def _refused(fn, *args, match: str, **kwargs) -> float:
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)
    return time.perf_counter() - start


def test_a_whole_model_directory_passes(tiny_dir):
    check_model_dir(tiny_dir)
    check_target(str(tiny_dir))
    check_target("tiny")


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "config.json").unlink(), "no config.json"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json is not valid JSON"),
        (lambda d: (d / "config.json").write_text('{"hidden_size": 64}'), "no `model_type`"),
        (lambda d: (d / "model.safetensors").unlink(), "no weights"),
        (lambda d: _truncate(d / "model.safetensors", keep=0.5), "model.safetensors is truncated"),
        (lambda d: _truncate(d / "model.safetensors", keep_bytes=4), "not a readable safetensors"),
        (lambda d: _index_with_missing_shard(d), "missing shard"),
        (lambda d: [(d / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")], "no tokenizer files"),
    ],
)
def test_a_broken_model_directory_is_refused_before_loading(damage, match, tiny_dir, tmp_path):
    model = _copy(tiny_dir, tmp_path)
    damage(model)
    assert _refused(check_target, str(model), match=f"target=.*{match}|{match}") < 1.0
    # the loader runs the same check first: no weights are read, the error names the directory
    with pytest.raises(ValueError, match=match):
        load_target(str(model), cache_dir=tmp_path / "cache")


def _truncate(path: Path, *, keep: float | None = None, keep_bytes: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: keep_bytes if keep_bytes is not None else int(len(data) * keep)])


def _index_with_missing_shard(model: Path) -> None:
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))


def test_not_a_model_directory_is_refused_in_milliseconds(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    seconds = _refused(load_target, str(tmp_path), cache_dir=tmp_path / "cache", match="no config.json")
    assert seconds < 1.0 and not (tmp_path / "cache").exists()


def _write_gguf(path: Path, *, arch: str = "llama") -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name in ("token_embd.weight", "output.weight"):
        writer.add_tensor(name, np.ones((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_whole_gguf_passes(tmp_path):
    check_gguf_file(_write_gguf(tmp_path / "ok.gguf"))


@pytest.mark.parametrize("cut", [0, 3, 16, 32, 100, -1])
def test_a_truncated_gguf_names_the_file_and_the_fix(cut, tmp_path):
    """`cut` bytes kept (-1: all but the last byte); the old message was `unpack_from requires a buffer of at
    least 32 bytes` with no file name."""
    data = _write_gguf(tmp_path / "full.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut] if cut >= 0 else data[:-1])
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        check_target(str(path))
    assert time.perf_counter() - start < 1.0
    assert str(path) in str(err.value) and "download it again" in str(err.value)
    with pytest.raises(ValueError, match="download it again"):  # the loader checks before converting
        load_target(str(path), cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache" / "targets").glob("gguf-*"))


def test_a_gguf_of_an_unsupported_architecture_is_refused(tmp_path):
    with pytest.raises(ValueError, match="architecture 'rwkv6'"):
        check_gguf_file(_write_gguf(tmp_path / "rwkv.gguf", arch="rwkv6"))


def test_a_non_gguf_file_and_a_missing_path(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="not a .gguf"):
        check_target(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="no such file or directory"):
        check_target(str(tmp_path / "missing"))


def test_an_uncached_hub_id_is_refused_when_the_hub_is_off(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the suite may itself run offline (HF_HUB_OFFLINE=1 make test)
    check_target("someone/some-model")  # online: only loading can tell
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1 with no cached copy"):
        check_target("someone/some-model")


# ---- prompt files ----


def _jsonl(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_blank_lines_are_accepted_as_datasets_does(tmp_path):
    assert check_prompt_file(_jsonl(tmp_path / "a.jsonl", '{"prompt": "a"}\n\n{"prompt": "b"}\n\n\n')) == 2
    # U+2028 inside a string is not a line break for JSONL (str.splitlines would cut the row there)
    assert check_prompt_file(_jsonl(tmp_path / "b.jsonl", '{"prompt": "x\u2028y"}\n')) == 1


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"prompt": "a"}\n{"prompt": "b",}\n', r"line 2: not valid JSON"),
        ('{"prompt": "a"}\n["a list"]\n', r"line 2: a JSON list, not an object"),
        ('{"id": 1, "text": "no prompt"}\n', r"line 1: no `prompt` string"),
        ("\n\n", r"is empty"),
        ("", r"is empty"),
    ],
)
def test_malformed_jsonl_names_the_line(text, match, tmp_path):
    with pytest.raises(ValueError, match=match) as err:
        check_prompt_file(_jsonl(tmp_path / "bad.jsonl", text))
    assert "blank lines" not in str(err.value).replace("non-blank", "")  # the old message forbade them wrongly


def test_preflight_reads_local_prompt_files(tmp_path):
    from dspark.data.prompts import prompt_set_errors

    _jsonl(tmp_path / "gsm8k_train.jsonl", '{"prompt": "ok"}\n{"prompt": "cut off\n')
    errors = prompt_set_errors({"data.train_sets": ["gsm8k-train"]}, local_dir=tmp_path, cache_dir=None)
    assert len(errors) == 1 and errors[0].startswith("data.train_sets: ") and "gsm8k_train.jsonl line 2" in errors[0]
    _jsonl(tmp_path / "gsm8k_train.jsonl", '{"prompt": "ok"}\n\n{"prompt": "fine"}\n')
    assert prompt_set_errors({"data.train_sets": ["gsm8k-train"]}, local_dir=tmp_path, cache_dir=None) == []


def test_every_vendored_prompt_file_passes():
    from dspark.data.prompts import PROMPT_SETS, VENDORED_DIR

    for name in PROMPT_SETS.names():
        spec = PROMPT_SETS.resolve(name)
        for file in spec.local_files:
            if (VENDORED_DIR / file).is_file():
                assert check_prompt_file(VENDORED_DIR / file, keep_row=spec.keep_local_row) > 0


# ---- policies that read confidences ----


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["drafter=dflash", "decode.policy=scheduler"], "decode.policy=scheduler"),
        (["drafter=dflash", "decode.policy=threshold", "stage=eval"], "decode.policy=threshold"),
        (["drafter=eagle3", "decode.policy=threshold"], "drafter=eagle3 has no confidence head"),
        (["drafter=dflash", "stage=serve", "serve.policy=async"], "serve.policy=async"),
    ],
)
def test_confidence_policies_need_a_confidence_head(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        resolve_config(argv)


def test_confidence_policies_are_fine_where_they_are_not_used():
    resolve_config(["drafter=dflash", "decode.policy=scheduler", "stage=train"])
    resolve_config(["drafter=dflash", "stage=serve", "serve.policy=mtp1"])
    resolve_config(["drafter=dspark", "decode.policy=scheduler"])


def test_config_lists_of_confidence_policies_match_the_policy_classes():
    """The config rule's lists are the policies whose classes read confidences (a new policy updates both)."""
    from dspark.config.schema import CONFIDENCE_POLICIES, POLICIES, SERVE_CONFIDENCE_POLICIES, SERVE_POLICIES
    from dspark.decoding import policies as offline
    from dspark.scheduling.sps import SPSTable
    from dspark.serving import policies as serving

    sps = SPSTable(batch_tokens=[1, 8], steps_per_second=[10.0, 8.0])
    assert set(POLICIES) == set(offline.POLICIES.names()) and set(SERVE_POLICIES) == set(serving.SERVE_POLICIES.names())
    needs = {n for n in POLICIES if offline.build_policy(n, sps=sps).needs_confidences}
    serve_needs = {n for n in SERVE_POLICIES if serving.build_serve_policy(n, sps=sps).needs_confidences}
    assert needs == set(CONFIDENCE_POLICIES) and serve_needs == set(SERVE_CONFIDENCE_POLICIES)


# ---- the same inputs through the command line: exit 2 in preflight, nothing ran ----


def _cli_refuses(argv: list[str], root: Path, needle: str, capsys) -> str:
    from dspark.cli import main

    start = time.perf_counter()
    assert main(argv + [f"paths.root={root}"]) == 2
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert needle in err, err
    assert not (root / "mlflow.db").exists() and seconds < 10, seconds  # refused before the store or any loading
    return err


def test_cli_refuses_a_directory_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    _cli_refuses(["budget=smoke", f"target={tmp_path / 'notes'}"], tmp_path / "root", "no config.json", capsys)


def test_cli_refuses_a_truncated_gguf_naming_the_file(tmp_path, capsys):
    data = _write_gguf(tmp_path / "full.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:32])
    err = _cli_refuses(
        ["budget=smoke", f"target={tmp_path / 'cut.gguf'}"], tmp_path / "root", "download it again", capsys
    )
    assert str(tmp_path / "cut.gguf") in err and "unpack_from" not in err.split("(")[0]


def test_cli_refuses_a_scheduler_on_dflash_before_prepare(tmp_path, capsys):
    _cli_refuses(
        ["budget=smoke", "drafter=dflash", "decode.policy=scheduler"],
        tmp_path / "root",
        "decode.policy=scheduler reads the confidence head",
        capsys,
    )


def test_cli_refuses_a_read_only_output_directory(tmp_path, capsys):
    """paths.root under a regular file cannot be created: the portable stand-in for a read-only disk here (the
    real read-only directory is tested in test_output_files.py)."""
    (tmp_path / "file").write_text("not a directory")
    root = tmp_path / "file" / "root"
    from dspark.cli import main

    assert main(["budget=smoke", f"paths.root={root}"]) == 2
    assert f"paths.root={root} is not writable" in capsys.readouterr().err
    assert main(["budget=smoke", "stage=report", f"paths.root={tmp_path}", f"paths.reports={root}"]) == 2
    assert f"paths.reports={root} is not writable" in capsys.readouterr().err
