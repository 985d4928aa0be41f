"""Every parser error names its file and the fix (issue 57, deliverable 6): a prompt row's defect names the file, the
line and the field; a refused pickle gets our message, never torch's advice to load it unsafely; a full disk while a
feature or regeneration shard is written leaves no shard and names where and what to do."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

import dspark.data.features as features_lib
import dspark.data.prompts as P
import dspark.data.regenerate as regen_lib
from dspark.data.features import FeatureCache, write_shard
from dspark.data.integrity import building, read_cache_manifest
from dspark.data.prompts import check_prompt_file, load_prompts, prompt_set_errors
from dspark.drafters.checkpoint import load_weights_only
from dspark.files import OutputError

MESSAGE_LIMIT = 700  # characters: values are quoted in bounded length, whatever the row holds


def _jsonl(path: Path, *rows, raw: bytes | None = None) -> Path:
    path.write_bytes(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in rows).encode())
    return path


def _refusal(path: Path, **kwargs) -> str:
    with pytest.raises(ValueError) as err:
        check_prompt_file(path, **kwargs)
    message = str(err.value)
    assert str(path) in message and len(message) < MESSAGE_LIMIT, message[:2000]
    return message


# ---- prompt rows: file + line + field + fix ----


@pytest.mark.parametrize(
    "row, needle",
    [
        ({}, r"no `prompt` string \(nor a `turns` list\)"),
        ({"prompt": None, "id": "a"}, r"no `prompt` string"),
        ({"prompt": 5}, r"`prompt` must be a non-empty string, not 5"),
        ({"prompt": ""}, r"`prompt` must be a non-empty string, not ''"),
        ({"prompt": ["a", "b"]}, r"`prompt` must be a non-empty string, not \['a', 'b'\]"),
        ({"turns": "just text"}, r"`turns` must be a list of strings"),
        ({"turns": [1, 2]}, r"`turns` must be a list of strings"),
        ({"turns": []}, r"no `prompt` string"),
        ({"prompt": "a", "turns": [None]}, r"`turns` must be a list of strings"),
        ({"prompt": "a", "id": [1]}, r"`id` must be a string or an integer, not \[1\]"),
        ({"prompt": "a", "id": True}, r"`id` must be a string or an integer, not True"),
        ({"prompt": "a", "id": 1.5}, r"`id` must be a string or an integer"),
        ({"prompt": "a", "domain": 3}, r"`domain` must be a string, not 3"),
        ({"prompt": "a", "reference": {"x": 1}}, r"`reference` must be a string"),
        ({"prompt": "a", "reference": False}, r"`reference` must be a string"),
        ({"prompt": "a", "paper_eval_rank": -1}, r"`paper_eval_rank` must be an integer >= 0, not -1"),
        ({"prompt": "a", "paper_eval_rank": "3"}, r"`paper_eval_rank` must be an integer >= 0, not '3'"),
        ({"prompt": "a", "paper_eval_rank": 1.5}, r"`paper_eval_rank` must be an integer >= 0"),
        ({"prompt": 7, "x": "y" * 10**6}, r"`prompt` must be a non-empty string, not 7"),
        ({"prompt": "a", "domain": ["y" * 10**6]}, r"`domain` must be a string, not \['yyy.*…"),
    ],
)
def test_a_row_defect_names_file_line_and_field(tmp_path, row, needle):
    path = _jsonl(tmp_path / "set.jsonl", {"prompt": "fine"}, row)
    message = _refusal(path)
    assert re.search(rf"set.jsonl line 2: {needle}", message) and "prompt files need one JSON object" in message


def test_a_mixed_set_names_an_unknown_domain(tmp_path):
    path = _jsonl(tmp_path / "mixed.jsonl", {"prompt": "a", "domain": "poetry" * 10**5})
    assert re.search(
        r"line 1: `domain` must be one of math, code, chat, instruction, not 'poetry",
        _refusal(path, domain_required=True),
    )
    assert check_prompt_file(path) == 1  # a set with its own domain ignores the row's


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', r"line 2: not UTF-8 text \(byte 16 of the line is 0xe9\)"),
        (b'{"prompt": "a"}\n{"prompt": "b",}\n', r"line 2: not valid JSON \(.*column 16\)"),
        (b'{"prompt": "a", "n": ' + b"9" * 5000 + b"}\n", r"line 1: not valid JSON \('Exceeds the limit"),
        (b"[" * 100_000 + b"]" * 100_000 + b"\n", r"line 1: not valid JSON \(nested too deeply\)"),
        (b'"just a string"\n', r"line 1: a JSON str, not an object"),
        (b"\n \n\t\n", r"is empty \(no non-blank lines\)"),
    ],
)
def test_unparsable_lines_name_file_and_line(tmp_path, raw, needle):
    assert re.search(needle, _refusal(_jsonl(tmp_path / "set.jsonl", raw=raw)))


def test_a_huge_line_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "MAX_LINE_BYTES", 1000)
    path = _jsonl(tmp_path / "set.jsonl", {"prompt": "ok"}, {"prompt": "x" * 5000})
    assert "line 2: longer than 1,000 bytes" in _refusal(path)
    _jsonl(path, raw=b'{"prompt": "' + b"x" * 980 + b'"}\n')  # just under the bound: accepted
    assert check_prompt_file(path) == 1


def test_a_byte_order_mark_is_accepted(tmp_path):
    assert check_prompt_file(_jsonl(tmp_path / "set.jsonl", raw='\ufeff{"prompt": "a"}\n'.encode())) == 1


def test_a_row_filter_names_the_field_it_reads(tmp_path):
    for bad in ({"prompt": "a"}, {"prompt": "a", "task_id": "12"}):
        _jsonl(tmp_path / "mbpp_full.jsonl", {"prompt": "a", "task_id": 1}, bad)
        errors = prompt_set_errors({"data.train_sets": ["mbpp-train"]}, local_dir=tmp_path, cache_dir=None)
        assert len(errors) == 1 and "mbpp_full.jsonl line 2: `task_id` must be MBPP's integer task number" in errors[0]


def test_loading_a_bad_local_file_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_DATA_DIR", str(tmp_path / "none"))
    _jsonl(tmp_path / "gsm8k_test.jsonl", {"prompt": "a", "reference": ["x"]})
    with pytest.raises(ValueError, match=r"gsm8k_test.jsonl line 1: `reference` must be a string"):
        load_prompts("gsm8k", local_dir=tmp_path)
    _jsonl(tmp_path / "gsm8k_test.jsonl", {"prompt": "a", "id": 3, "reference": 7, "paper_eval_rank": None})
    [record] = load_prompts("gsm8k", local_dir=tmp_path)
    assert (record.id, record.reference) == ("3", "7")


# ---- pickles: our message, never torch's ----


class _Payload:
    def __reduce__(self):
        return (print, ("unpickled",))


def test_a_refused_pickle_gets_our_message(tmp_path):
    path = tmp_path / "cache.pt"
    torch.save({"stamp": _Payload()}, path)
    with pytest.raises(ValueError) as err:
        load_weights_only(path, fix="Delete it.")
    message = str(err.value)
    assert str(path) in message and "was refused" in message and "could run code" in message
    assert "weights_only" not in message and message.endswith("Delete it.")


def test_a_damaged_torch_file_is_named(tmp_path):
    path = tmp_path / "cache.pt"
    torch.save({"x": torch.zeros(100)}, path)
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ValueError, match=r"cache.pt is not a readable cache.pt .*Delete it.") as err:
        load_weights_only(path, fix="Delete it.")
    assert len(str(err.value)) < MESSAGE_LIMIT


# ---- a full disk while a cache shard is written ----


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("failure", ["oserror", "safetensors"])
def test_a_full_disk_leaves_no_feature_shard_and_names_it(tmp_path, monkeypatch, failure):
    """safetensors' writer reports a full disk as a SafetensorError carrying the OS error number; a Python writer as
    an OSError. Either way: no shard (nor temporary file) left, an OutputError naming the shard and the fix."""

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a shard")
        if failure == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(features_lib, "save_file", full_disk)
    shard = tmp_path / "features" / "key" / "features-00003.safetensors"
    shard.parent.mkdir(parents=True)
    with pytest.raises(OutputError) as err:
        write_shard(shard, {"x": torch.zeros(3)})
    assert err.value.errno == errno.ENOSPC
    message = str(err.value)
    assert str(shard) in message and "free disk space there or point paths.root at another disk" in message
    assert "rerun the same command to resume" in message and _leftovers(shard.parent) == []


def test_another_safetensors_error_is_not_disguised(tmp_path, monkeypatch):
    def broken(tensors, filename, metadata=None):
        raise SafetensorError("some other failure")

    monkeypatch.setattr(features_lib, "save_file", broken)
    with pytest.raises(SafetensorError, match="some other failure"):
        write_shard(tmp_path / "features-00000.safetensors", {"x": torch.zeros(3)})
    assert _leftovers(tmp_path) == []


def test_a_full_disk_leaves_no_regeneration_shard(tmp_path, monkeypatch):
    def full_disk(table, where, **kwargs):
        where.write(b"PAR1 half a shard")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(regen_lib.pq, "write_table", full_disk)
    shard = regen_lib.shard_path(tmp_path, 0)
    with pytest.raises(OutputError, match=re.escape(str(shard)) + r".*free disk space there.*rerun the same command"):
        regen_lib._write_shard(shard, [regen_lib.RegeneratedSequence([1, 2], [0, 1], "p0", "math")], {"sequences": 1})
    assert _leftovers(tmp_path) == []


def test_an_unwritable_cache_directory_is_named(tmp_path):
    (tmp_path / "cache").write_text("a file where the cache directory should be")
    with pytest.raises(OutputError, match=r"could not create the cache directory .*cache/features/key"):
        with building(tmp_path / "cache" / "features" / "key"):
            pass


# ---- cache manifests ----


def test_an_unreadable_manifest_is_named_and_its_cache_rebuilt(tmp_path):
    out = tmp_path / "features" / "key"
    out.mkdir(parents=True)
    (out / "manifest.json").write_text('{"num_sequences": 3')
    (out / "COMPLETE").write_text("")
    with pytest.raises(ValueError, match=r"manifest.json cannot be read \(not valid JSON\); delete .* and rerun"):
        read_cache_manifest(out)
    with pytest.raises(ValueError, match=r"manifest.json cannot be read"):
        FeatureCache(out)
    with building(out) as whole:  # a finished cache with a damaged manifest is rebuilt, never reused
        assert not whole and not (out / "COMPLETE").exists()
