"""Load a `RunConfig` from YAML files and dotted `key=value` overrides, with errors that name the key and the fix.

Values on the command line are parsed as YAML scalars/lists (`model.depth=3`, `model.feature_layers=[1,8,14]`,
`data.local_dir=null`). Every key is checked against the dataclass schema before anything runs.

Numbers follow Python, not YAML 1.1: PyYAML's resolver reads `1e-4` (no dot) as a string and `010` as octal, so
`safe_load` here resolves ints and floats with Python's literal grammar (`1e-4`, `3E-3`, `1_000`, `.5`, `5.`), and
a float key also accepts any string `float()` accepts (`inf`, `nan`, ` 1e-4 `); NaN and ±inf are then refused by
validation (`dspark.config.ranges`).

A command-line value is at most `MAX_VALUE_CHARS` characters and may not use YAML aliases (`*name`): an alias repeats
a node, aliases of aliases repeat it exponentially (a few hundred characters expand to 10⁹ entries), and nothing a
key takes needs one. Every error quotes a value through `quote` (at most 80 characters).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml

from dspark.config.ranges import quote
from dspark.config.schema import RunConfig


class ConfigError(ValueError):
    """A configuration problem; the message names the key and what to do."""


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_DIGITS = r"[0-9](?:_?[0-9])*"  # Python's digitpart: underscores only between digits
_INT_RE = re.compile(
    rf"^[-+]?(?:{_DIGITS}|0[xX][0-9a-fA-F](?:_?[0-9a-fA-F])*|0[oO][0-7](?:_?[0-7])*"
    r"|0[bB][01](?:_?[01])*)$"
)
_FLOAT_RE = re.compile(
    rf"^[-+]?(?:(?:{_DIGITS}\.(?:{_DIGITS})?|\.{_DIGITS})(?:[eE][-+]?{_DIGITS})?"
    rf"|{_DIGITS}[eE][-+]?{_DIGITS})$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
)


class _Loader(yaml.SafeLoader):
    """SafeLoader whose ints and floats are Python literals (YAML 1.2 core schema plus underscores)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_INT_TAG, _INT_RE, list("-+0123456789"))
_Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    return int(text, 0) if re.match(r"^[-+]?0[xXoObB]", text) else int(text, 10)  # "010" is ten, as in Python


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node)
    return float(text.lower().replace(".inf", "inf").replace(".nan", "nan"))


_Loader.add_constructor(_INT_TAG, _construct_int)
_Loader.add_constructor(_FLOAT_TAG, _construct_float)


#: the longest command-line value accepted (a path is at most 4096 bytes on Linux; a list of 100 ids is ~400)
MAX_VALUE_CHARS = 8192
#: the deepest `[`/`{` nesting accepted in a command-line value (no key takes more than a list of numbers; PyYAML
#: recurses per level and takes seconds to hit Python's recursion limit at a few thousand)
MAX_VALUE_NESTING = 16


class _ArgumentLoader(_Loader):
    """_Loader that refuses aliases (see the module docstring)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise _AliasRefused
        return super().compose_node(parent, index)


class _AliasRefused(Exception):
    pass


def safe_load(text: str) -> Any:
    """`yaml.safe_load` with Python's number grammar (see the module docstring); used for every config file."""
    return yaml.load(text, Loader=_Loader)


def parse_overrides(argv: Iterable[str]) -> dict[str, Any]:
    """`["a.b=1", "sweep=depth"]` → `{"a.b": 1, "sweep": "depth"}` (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for arg in argv:
        if "=" not in arg or arg.startswith("="):
            raise ConfigError(f"Cannot parse argument {quote(arg)}: write overrides as key=value, e.g. model.depth=3.")
        key, raw = arg.split("=", 1)
        out[key.strip()] = _parse_value(key.strip(), raw)
    return out


def _parse_value(key: str, raw: str) -> Any:
    """`raw` read as YAML (text YAML cannot read stays text); refused when too long or when it uses an alias."""
    if len(raw) > MAX_VALUE_CHARS:
        raise ConfigError(
            f"{quote(key)}: the value is {len(raw):,} characters long; a command-line value is at most "
            f"{MAX_VALUE_CHARS:,} (got {quote(raw)})."
        )
    if _nesting(raw) > MAX_VALUE_NESTING:
        raise ConfigError(
            f"{quote(key)}: the value nests lists more than {MAX_VALUE_NESTING} levels deep; no key takes more than "
            f"a flat list (got {quote(raw)})."
        )
    try:
        value = yaml.load(raw, Loader=_ArgumentLoader) if raw != "" else ""
    except _AliasRefused:
        raise ConfigError(
            f"{quote(key)}: YAML aliases (*name) are not accepted in a command-line value; write the value out "
            f"(got {quote(raw)})."
        ) from None
    except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: an integer past Python's 4300 digits
        return raw
    return raw if isinstance(value, (dict, set)) else value


def _nesting(raw: str) -> int:
    """The deepest bracket nesting of `raw` (brackets inside quotes count too: a cheap upper bound)."""
    depth = deepest = 0
    for char in raw:
        depth += (char in "[{") - (char in "]}")
        deepest = max(deepest, depth)
    return deepest


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping and flatten it to dotted keys."""
    stat = Path(path).stat()
    return copy.deepcopy(_load_yaml(str(path), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=64)
def _load_yaml(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    """`load_yaml` once per version of a file: PyYAML's pure-Python parser takes ~20 ms for default.yaml, and a
    sweep resolves every cell over default.yaml and its budget file."""
    data = safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level.")
    return flatten(data)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict → dotted keys; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def valid_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema."""
    keys = []
    for f in dataclasses.fields(cls):
        sub = _dataclass_type(cls, f.name)
        keys.extend(valid_keys(sub, f"{prefix}{f.name}.") if sub else [f"{prefix}{f.name}"])
    return keys


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A schema class's annotations, evaluated once: `typing.get_type_hints` compiles every string annotation
    anew on each call, and every override used to pay that for the whole schema."""
    return typing.get_type_hints(cls)


def _dataclass_type(cls: type, name: str) -> type | None:
    hint = _type_hints(cls)[name]
    return hint if dataclasses.is_dataclass(hint) else None


def apply_overrides(cfg: RunConfig, overrides: dict[str, Any], *, source: str) -> RunConfig:
    """Return a copy of `cfg` with dotted overrides applied; all bad keys/values are reported together."""
    cfg = _deepcopy(cfg)
    errors = []
    keys = valid_keys()
    for key, value in overrides.items():
        try:
            _set(cfg, key, value, keys)
        except ConfigError as err:
            errors.append(str(err))
    if errors:
        raise ConfigError(f"Invalid configuration ({source}):\n  - " + "\n  - ".join(errors))
    return cfg


def _deepcopy(cfg: RunConfig) -> RunConfig:
    return copy.deepcopy(cfg)


def _set(cfg: Any, key: str, value: Any, keys: list[str]) -> None:
    parts = key.split(".")
    node = cfg
    for part in parts[:-1]:
        if (
            not dataclasses.is_dataclass(node)
            or not hasattr(node, part)
            or not dataclasses.is_dataclass(getattr(node, part))
        ):
            raise ConfigError(_unknown_key(key, keys))
        node = getattr(node, part)
    leaf = parts[-1]
    if not dataclasses.is_dataclass(node) or leaf not in {f.name for f in dataclasses.fields(node)}:
        raise ConfigError(_unknown_key(key, keys))
    if dataclasses.is_dataclass(getattr(node, leaf)):
        raise ConfigError(
            f"'{key}' is a group; set one of its keys, e.g. {key}.{dataclasses.fields(getattr(node, leaf))[0].name}=..."
        )
    hint = _type_hints(type(node))[leaf]
    setattr(node, leaf, coerce(value, hint, key=key))


def _unknown_key(key: str, keys: list[str]) -> str:
    leaf = key.split(".")[-1]
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    close = close or [k for k in keys if k.split(".")[-1] == leaf or leaf in k][:3]
    groups = sorted({k.split(".")[0] for k in keys})
    hint = f" Closest valid keys: {', '.join(close)}." if close else f" Top-level keys and groups: {', '.join(groups)}."
    return f"Unknown config key {quote(key)}.{hint} See experiments/default.yaml for all keys."


def coerce(value: Any, hint: Any, *, key: str) -> Any:
    """Convert `value` to the annotated type or raise a ConfigError naming the key and the expected type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return coerce(value, args[0], key=key)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"'{key}' expects a list, e.g. {key}=[1,2,3]; got {quote(value)}.")
        return [coerce(v, item, key=key) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"'{key}' expects true/false; got {quote(value)}.")
    if hint is int:
        value = _number_from_text(value, int)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"'{key}' expects an integer; got {quote(value)}.")
    if hint is float:
        value = _number_from_text(value, float)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"'{key}' expects a number, e.g. {key}=1e-4 or 0.5; got {quote(value)}.")
    if hint is str:
        if value is None or isinstance(value, (dict, list)):
            raise ConfigError(f"'{key}' expects a string; got {quote(value)}.")
        return str(value)
    return value


def _number_from_text(value: Any, kind: type) -> Any:
    """A string Python's `int()`/`float()` reads becomes that number (YAML leaves e.g. `inf` a string)."""
    if not isinstance(value, str):
        return value
    for parse in (int, float) if kind is int else (float,):
        try:
            return parse(value)
        except ValueError:
            continue
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain-dict view (for YAML artifacts and MLflow params)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
