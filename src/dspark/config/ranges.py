"""Numeric range rules, declared once beside each schema field and checked on the merged config before any work.

A numeric field is declared with `ranged(default, ge=…, gt=…, le=…, lt=…, sentinels=…)`: the bounds (as pydantic
spells them) go into the field's metadata as a `Range`, and `range_errors` walks a config tree and checks every
numeric leaf against it. Whatever a field declares, every number must also be finite (NaN and ±inf mean nothing to
any key) and every integer must fit in 64 bits (tensors and seeds hold no more). A list field's rule applies to each
entry; an Optional field's to any value but None. The int/float/bool types themselves are the loader's
(`dspark.config.loader.coerce`): an integer key refuses 2.5 and true before any rule runs.

`quote` is how every config error shows a value: a bounded repr, whatever the value's size or nesting.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import reprlib
import typing
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable

#: the metadata key under which `ranged` stores a field's `Range`
RANGE_KEY = "range"
#: the most characters of a value any config error quotes
QUOTE_LIMIT = 80
INT64_MAX = 2**63 - 1

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 8, 8, 8
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = QUOTE_LIMIT


def shorten(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`text` cut to at most `limit` characters (an ellipsis marks the cut)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def quote(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """The repr of `value` in at most `limit` characters, built in bounded time: reprlib stops at 8 entries per
    level and 3 levels, so an alias-expanded YAML list of 10⁹ entries quotes as fast as a short one."""
    return shorten(_REPR.repr(value), limit)


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: within every given bound (ge ≤ v, gt < v, v ≤ le, v < lt), or one of the
    `sentinels` the key documents (-1 = epochs decide). `note` says what a bound or sentinel means and is quoted by
    the refusal; `example` is a valid value for the refusal's example fix ("" = the key's default)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    sentinels: tuple[float, ...] = ()
    note: str = ""
    example: str = ""

    @property
    def bounded(self) -> bool:
        """Whether the rule says anything beyond "a finite number"."""
        return any(b is not None for b in (self.ge, self.gt, self.le, self.lt)) or bool(self.sentinels)

    def admits(self, value: float) -> bool:
        """Whether `value` (finite) lies inside the bounds or is a sentinel."""
        return value in self.sentinels or (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def __str__(self) -> str:
        """The rule as a refusal or docs/CONFIG.md writes it: `≥ 1`, `in (0, 1]`, `-1 or ≥ 1`."""
        low = (f"[{_num(self.ge)}", f"≥ {_num(self.ge)}") if self.ge is not None else None
        low = (f"({_num(self.gt)}", f"> {_num(self.gt)}") if self.gt is not None else low
        high = (f"{_num(self.le)}]", f"≤ {_num(self.le)}") if self.le is not None else None
        high = (f"{_num(self.lt)})", f"< {_num(self.lt)}") if self.lt is not None else high
        if low and high:
            text = f"in {low[0]}, {high[0]}"
        else:
            text = (low or high or ("", "any number"))[1]
        return " or ".join([*(_num(s) for s in self.sentinels), text])


def _num(value: float) -> str:
    """A bound as written in a rule: 1 not 1.0, 4294967295 not 4.29e9."""
    return str(int(value)) if float(value).is_integer() else repr(value)


def ranged(default: Any = MISSING, *, factory: Callable[[], Any] | None = None, **rule: Any) -> Any:
    """A dataclass field (default `default`, or `factory()` for lists) whose values `Range(**rule)` admits."""
    metadata = {RANGE_KEY: Range(**rule)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def field_range(f: dataclasses.Field) -> Range | None:
    """The `Range` a field was declared with (None: not declared with `ranged`)."""
    return f.metadata.get(RANGE_KEY)


@functools.cache
def numeric_kind(cls: type, name: str) -> type | None:
    """int or float when field `name` of dataclass `cls` holds numbers (bare, Optional or list entries); else None."""
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args:
        hint = args[0]
    elif args and type(None) in args:
        hint = next(a for a in args if a is not type(None))
    return hint if hint in (int, float) else None


def range_errors(node: Any, prefix: str = "") -> list[str]:
    """One message per numeric key of the dataclass tree `node` (keys spelt `prefix` + path) whose value is NaN,
    ±inf, past 64 bits or outside its declared `Range`."""
    errors = []
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            errors += range_errors(value, f"{key}.")
        elif numeric_kind(type(node), f.name) is not None:
            message = _value_error(key, value, field_range(f) or Range(), default=_default(f))
            errors += [message] if message else []
    return errors


def _value_error(key: str, value: Any, rule: Range, *, default: Any) -> str:
    """The refusal of `value` (a number, None or a list of numbers) for `key`, or "" when it passes."""
    example = rule.example or _yaml(default)
    entries = value if isinstance(value, list) else [value]
    for entry in entries:
        if entry is None or isinstance(entry, bool) or not isinstance(entry, (int, float)):
            continue  # None is Optional's "unset"; types are the loader's to refuse
        if isinstance(entry, float) and math.isnan(entry):
            return f"{key} is NaN; give a number (e.g. {key}={example}), or drop the key for its default."
        finite = isinstance(entry, int) or math.isfinite(entry)
        admitted, too_wide = finite and rule.admits(entry), isinstance(entry, int) and abs(entry) > INT64_MAX
        if admitted and not too_wide:
            continue
        must = _requirement(rule, finite=finite, admitted=admitted)
        got = quote(entry) if entries is not value else f"{quote(entry)} in {quote(value)}"
        subject = f"every entry of {key}" if entries is value else key
        note = f"; {rule.note}" if rule.note else ""
        return f"{subject} must be {must} (got {got}){note}. Example: {key}={example}"
    return ""


def _requirement(rule: Range, *, finite: bool, admitted: bool) -> str:
    """What a refused value must be: its rule, after "finite" for ±inf, before "within 64 bits" for an integer the
    rule admits but no tensor or seed can hold."""
    bounds = [str(rule)] if rule.bounded else []
    if not finite:
        return " and ".join(["finite", *bounds])
    return " and ".join([*bounds, "within 64 bits"]) if admitted else str(rule)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _yaml(value: Any) -> str:
    """A value as written after `key=` on the command line."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    return repr(value)
