"""What an imported checkpoint claims, checked before anything is built or any tensor is read.

An import directory's `config.json` sizes the drafter (draft layers, Markov rank, draft vocabulary) and its
`model.safetensors` header lists every tensor's dtype, shape and byte range. Both are read here without the weights:
the config into typed values (each error names the file, the key and the fix), the header into `TensorInfo`s (a
truncated, padded or foreign file is named before safetensors or torch sees it). `dspark.interop.load` then compares
the sizes the config claims with the header and the target, so a config that asks for more than the file holds is
refused with the field named instead of allocating it.

Every value quoted in an error goes through `clip`: a config or header is input, and may hold a megabyte string.
"""

from __future__ import annotations

import json
import re
import reprlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.interop.layouts import MARKOV_W1

QUOTE_LIMIT = 80  # characters of a quoted value in an error message
# A drafter's config.json is a few KB; a file this large is not one (and json would build it all in memory).
MAX_CONFIG_BYTES = 4 << 20
# A safetensors header is ~150 bytes per tensor: 16 MiB is ~100k tensors, far beyond any drafter (safetensors itself
# accepts up to 100 MB). The bound is checked on the 8-byte length before the header is read.
MAX_HEADER_BYTES = 16 << 20
# The dtypes torch loads from safetensors, with their element size in bytes.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
REEXPORT = "export it again (stage=export) or download the checkpoint again"
_MISSING = object()
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 8, 8, 8
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = QUOTE_LIMIT


def clip(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """`value` as an error quotes it: a bounded repr (reprlib: 8 entries per level, 3 levels, so a list of 10^6 ids
    quotes as fast as a short one) of at most `limit` characters, an ellipsis marking the cut."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int past Python's 4300-digit str() limit
        text = f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) else "<a value too large to show>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---- config.json ----


def read_json_object(path: Path, *, fix: str = REEXPORT, max_bytes: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """The JSON object in `path`; a ValueError naming the file, where it fails and `fix` when it is unreadable,
    larger than `max_bytes`, not UTF-8, not JSON or not an object."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ValueError(f"{path} is {size:,} bytes, more than a config file can be ({max_bytes:,}); {fix}")
        raw = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{path} cannot be read ({err.strerror or err}); {fix}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (at byte offset {err.start}); {fix}") from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); {fix}"
        ) from None
    except (ValueError, RecursionError) as err:  # an integer of > 4300 digits, nesting deeper than the stack
        raise ValueError(f"{path} is not valid JSON ({clip(str(err))}); {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object of config fields; {fix}")
    return data


class ConfigReader:
    """Typed reads of one JSON object; each error names the file, the key's path in it, the value and the fix.

    >>> reader = ConfigReader({"block_size": 7}, source="ckpt/config.json", fix="fix it")
    >>> reader.integer("block_size", minimum=1)
    7
    """

    def __init__(self, data: dict[str, Any], *, source: str, fix: str = REEXPORT, prefix: str = "") -> None:
        self.data, self.source, self.fix, self.prefix = data, source, fix, prefix

    def path(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def error(self, key: str, expected: str) -> ValueError:
        if self.data.get(key) is None:
            return ValueError(f"{self.source}: `{self.path(key)}` is missing ({expected}); {self.fix}")
        return ValueError(
            f"{self.source}: `{self.path(key)}` must be {expected}, not {clip(self.data[key])}; {self.fix}"
        )

    def _absent(self, key: str, default: Any, expected: str) -> bool:
        """True when `key` is absent or null and has a default; absent without one is an error."""
        if self.data.get(key) is not None:
            return False
        if default is _MISSING:
            raise self.error(key, expected)
        return True

    def integer(self, key: str, *, minimum: int = 0, default: Any = _MISSING) -> Any:
        """An integer >= minimum (bools and floats refused); `default` when absent or null, if given."""
        expected = f"an integer >= {minimum}"
        if self._absent(key, default, expected):
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(key, expected)
        return value

    def flag(self, key: str, *, default: bool) -> bool:
        if self._absent(key, default, "true or false"):
            return default
        if not isinstance(self.data[key], bool):
            raise self.error(key, "true or false")
        return self.data[key]

    def text(self, key: str, *, default: Any = _MISSING) -> Any:
        if self._absent(key, default, "a string"):
            return default
        if not isinstance(self.data[key], str):
            raise self.error(key, "a string")
        return self.data[key]

    def integers(self, key: str, *, default: Any = _MISSING) -> Any:
        """A non-empty list of integers (any sign: their range is the target's to check)."""
        if self._absent(key, default, "a non-empty list of integers"):
            return default
        value = self.data[key]
        if (
            not isinstance(value, list)
            or not value
            or any(isinstance(i, bool) or not isinstance(i, int) for i in value)
        ):
            raise self.error(key, "a non-empty list of integers")
        return value

    def section(self, key: str, *, optional: bool = False) -> ConfigReader:
        """The nested object at `key` (an empty one when it is absent and `optional`)."""
        value = {} if self._absent(key, {} if optional else _MISSING, "an object") else self.data[key]
        if not isinstance(value, dict):
            raise self.error(key, "an object")
        return ConfigReader(value, source=self.source, fix=self.fix, prefix=f"{self.path(key)}.")

    def first_section(self, key: str) -> ConfigReader:
        """The first object of the non-empty list at `key`."""
        value = self.data.get(key)
        if not isinstance(value, list) or not value or not isinstance(value[0], dict):
            raise self.error(key, "a non-empty list of objects")
        return ConfigReader(value[0], source=self.source, fix=self.fix, prefix=f"{self.path(key)}[0].")


# ---- the safetensors header ----


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: dtype name (safetensors' spelling), shape, and its byte range in the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_safetensors_header(path: Path, *, fix: str = REEXPORT) -> dict[str, TensorInfo]:
    """Every tensor's entry in the header of the safetensors file `path`, read without the data; a ValueError naming
    the file and `fix` when it is not a safetensors file, its header is damaged, or its size disagrees with the
    header (truncated, or bytes after the last tensor, both of which safetensors refuses later with no file name).

    Layout: an 8-byte little-endian header length n, n bytes of JSON {name: {dtype, shape, data_offsets}}
    (plus an optional `__metadata__` of strings), then the data; the ranges tile the data section exactly."""
    size, header_len, header = _raw_header(path, fix=fix)
    entries = {
        name: _tensor_info(path, name, info, data_bytes=size - 8 - header_len, fix=fix)
        for name, info in header.items()
        if name != "__metadata__"
    }
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: the header's __metadata__ is not an object of strings; {fix}")
    end = 0
    for name, info in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != end:
            raise ValueError(
                f"{path}: the byte range of tensor {clip(name)} ({info.begin:,}-{info.end:,}) "
                f"{'overlaps another' if info.begin < end else 'leaves a gap after the previous one'}; "
                f"the file is damaged: {fix}"
            )
        end = info.end
    needed = 8 + header_len + end  # every range ends inside the file (`_tensor_info`): only a tail can be left
    if size > needed:
        raise ValueError(
            f"{path} has {size - needed:,} bytes after its last tensor ({size:,} bytes, its header describes "
            f"{needed:,}): it was appended to or overwritten; {fix}"
        )
    return entries


def _raw_header(path: Path, *, fix: str) -> tuple[int, int, dict[str, Any]]:
    """(file size, header length, the parsed header object), bounded before anything large is read."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise ValueError(f"{path} is {size} bytes, too short for a safetensors file; {fix}")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES:
                raise ValueError(
                    f"{path} is not a safetensors file: its first 8 bytes give a {header_len:,}-byte header, "
                    f"more than a checkpoint's can be ({MAX_HEADER_BYTES:,}); {fix}"
                )
            if header_len > size - 8:
                raise ValueError(
                    f"{path} is truncated or not a safetensors file ({size:,} bytes, its header alone "
                    f"needs {8 + header_len:,}); {fix}"
                )
            raw = handle.read(header_len)
    except OSError as err:
        raise ValueError(f"{path} cannot be read ({err.strerror or err}); {fix}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        reason = err.msg if isinstance(err, json.JSONDecodeError) else type(err).__name__
        raise ValueError(f"{path} is not a safetensors file (its header is not JSON: {clip(reason)}); {fix}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is not a JSON object); {fix}")
    return size, header_len, header


def _tensor_info(path: Path, name: str, info: Any, *, data_bytes: int, fix: str) -> TensorInfo:
    """One validated header entry: a known dtype, a shape of non-negative integers, and a byte range inside the
    file's `data_bytes` whose length is the shape's element count times the dtype's size."""

    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: the header entry of tensor {clip(name)} is invalid ({why}); {fix}")

    if not isinstance(info, dict):
        raise bad("not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise bad(f"dtype {clip(dtype)} is not one torch loads: {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise bad(f"shape {clip(shape)} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(n) for n in offsets):
        raise bad(f"data_offsets {clip(offsets)} are not two non-negative integers")
    begin, end = offsets
    if end > data_bytes:
        raise ValueError(
            f"{path} is truncated: tensor {clip(name)} ends at byte {clip(end)} of the data, which has "
            f"{data_bytes:,}; {fix}"
        )
    needed = _numel(shape, cap=data_bytes) * DTYPE_BYTES[dtype]
    if begin > end or end - begin != needed:
        raise bad(f"shape {clip(shape)} of {dtype} does not fill its byte range {clip(begin)}-{end}")
    return TensorInfo(dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _numel(shape: list[int], *, cap: int) -> int:
    """The element count of `shape`, or cap + 1 once it passes `cap` (a header may claim 10^4000-long dimensions)."""
    if 0 in shape:
        return 0
    total = 1
    for n in shape:
        total *= n
        if total > cap:
            return cap + 1
    return total


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ---- what the config claims against what the header holds ----

LAYER_NAME = re.compile(r"^layers\.(\d{1,9})\.")  # their draft layers (both layouts); longer ids are no layer
# Which config field sizes a tensor (for the message when its shape is not the one expected); first match wins.
SHAPE_FIELDS = (
    ("fc.", "hidden_size and the number of target layer ids"),
    ("markov_head.", "markov_rank, hidden_size and draft_vocab_size"),
    ("confidence_head.", "markov_rank, confidence_head_with_markov and hidden_size"),
    (".mlp.", "intermediate_size and hidden_size"),
    (".self_attn.", "num_attention_heads, num_key_value_heads, head_dim and hidden_size"),
    ("lm_head.", "draft_vocab_size and hidden_size"),
    ("d2t", "draft_vocab_size"),
    ("", "vocab_size and hidden_size"),
)


def check_header_sizes(fields: dict[str, Any], header: dict[str, TensorInfo], *, config: str, weights: str) -> None:
    """The sizes `config` claims (draft layers, Markov rank, draft vocabulary) against the tensors in `weights`'
    header, so that none asks for more than the file holds; needs no target. `fields` is `load.describe`'s."""
    keys = fields["keys"]
    layers = sorted({int(found.group(1)) for name in header if (found := LAYER_NAME.match(name))})
    depth = fields["depth"]
    if len(layers) != depth or (layers and layers[-1] != depth - 1):  # sorted distinct ids: exactly 0..depth-1
        held = f"{len(layers)} draft layer(s)" + (f" numbered {clip(layers)}" if layers else "")
        raise ValueError(
            f"{config}: `{keys['depth']}` is {clip(depth)} but {weights} holds {held}; the config and the weights "
            f"were not exported together: {REEXPORT}"
        )
    _check_rank(fields["markov_rank"], header.get(MARKOV_W1), config=config, weights=weights)
    _check_layer_widths(fields["layer_config"], header, config=config, weights=weights)
    vd, d2t = fields["draft_vocab_size"], header.get("d2t")
    if d2t is not None and (vd is None or d2t.shape != (vd,)):
        claimed = "no `draft_vocab_size`" if vd is None else f"`draft_vocab_size` {clip(vd)}"
        raise ValueError(
            f"{config} has {claimed} but {weights} holds d2t of shape {clip(d2t.shape)} (one offset per draft id); "
            f"the config and the weights were not exported together: {REEXPORT}"
        )


#: (layer-config key, header tensor suffix of draft layer 0, axis of that tensor holding the size)
LAYER_WIDTHS = (
    ("hidden_size", "layers.0.input_layernorm.weight", 0),
    ("intermediate_size", "layers.0.mlp.gate_proj.weight", 0),
)


def _check_layer_widths(layer: dict[str, Any], header: dict[str, TensorInfo], *, config: str, weights: str) -> None:
    """The layer widths the config claims (hidden, MLP) against draft layer 0's tensors in the header, so a
    config claiming a 2^24-wide layer is refused from the header instead of being built."""
    for key, suffix, axis in LAYER_WIDTHS:
        claimed = layer.get(key)
        tensor = next((info for name, info in header.items() if name.endswith(suffix)), None)
        if claimed is None or tensor is None or len(tensor.shape) <= axis:
            continue
        if claimed != tensor.shape[axis]:
            raise ValueError(
                f"{config}: `{key}` is {clip(claimed)} but {weights} holds {suffix} of shape {clip(tensor.shape)}; "
                f"the config and the weights were not exported together: {REEXPORT}"
            )


def _check_rank(rank: int, w1: TensorInfo | None, *, config: str, weights: str) -> None:
    """`markov_rank` r against W_1 [V, r] (their `markov_head.markov_w1.weight`)."""
    held = None if w1 is None else (w1.shape[-1] if len(w1.shape) == 2 else None)
    if (rank == 0 and w1 is None) or (rank > 0 and held == rank):
        return
    found = f"no {MARKOV_W1}" if w1 is None else f"{MARKOV_W1} of shape {clip(w1.shape)}"
    raise ValueError(
        f"{config}: `markov_rank` is {clip(rank)} but {weights} has {found}; the config and the weights were not "
        f"exported together: {REEXPORT}"
    )


def check_header_shapes(
    expected: dict[str, tuple[int, ...]],
    header: dict[str, TensorInfo],
    *,
    optional: set[str],
    weights: str,
    target_name: str,
) -> None:
    """Every tensor the drafter needs (`expected`: their name → shape, from the config and the target) is in the
    header with that shape, names in `optional` may be absent, and nothing else is there."""
    missing = [name for name in expected if name not in header and name not in optional]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        why = " (`draft_vocab_size` is below the target's vocabulary: d2t maps draft ids to target ids)"
        raise ValueError(
            f"{weights} lacks {clip(missing[:5])}{more}, which the drafter its config.json describes needs"
            f"{why if 'd2t' in missing else ''}; {REEXPORT}"
        )
    extra = sorted(set(header) - set(expected))
    if extra:
        raise ValueError(
            f"{weights}: tensors {clip(extra[:5])} have no equivalent in our drafter; it cannot be represented"
        )
    for name, shape in expected.items():
        if name in header and header[name].shape != shape:
            raise ValueError(
                f"{weights}: {clip(name)} is {clip(header[name].shape)}, but config.json and target "
                f"'{target_name}' make it {shape} (from {_field_of(name)}); use the target the drafter was trained "
                f"for, or {REEXPORT}"
            )


def _field_of(name: str) -> str:
    """The config fields that size the tensor `name` (`SHAPE_FIELDS`)."""
    return next(label for part, label in SHAPE_FIELDS if part in name)
