"""Every numeric config key declares its range once, in the schema, and a value outside it stops the run before any
work (issue 57): a zero batch size, a fraction above 1, `inf`, NaN, a negative temperature, zero epochs.

The keys are enumerated from the schema, so a numeric key added without a rule fails `test_every_numeric_key_...`,
and the bad values are generated from each declared rule: below its minimum, above its maximum, each open bound
itself, ±inf and NaN for floats, a fraction and 2⁶³ for integers. The control: a value just inside each bound (and
each sentinel) is accepted, so a rule that refused everything would fail too.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time

import pytest

from dspark.config import ConfigError, RunConfig, resolve_config
from dspark.config.loader import MAX_VALUE_CHARS, coerce, safe_load
from dspark.config.ranges import QUOTE_LIMIT, Range, field_range, numeric_kind, quote, range_errors
from dspark.config.reference import config_reference
from dspark.config.resolve import repo_root
from dspark.config.schema import BUDGETS

SMOKE = ["budget=smoke"]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One numeric key of the schema."""

    key: str
    kind: type  # int | float
    rule: Range | None
    is_list: bool


def numeric_leaves(cls: type = RunConfig, prefix: str = "") -> list[Leaf]:
    """Every numeric leaf of the schema, nested groups included (bare, Optional and list entries)."""
    leaves = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            leaves += numeric_leaves(type(default), f"{prefix}{f.name}.")
        elif (kind := numeric_kind(cls, f.name)) is not None:
            leaves.append(Leaf(f"{prefix}{f.name}", kind, field_range(f), str(f.type).startswith("list")))
    return leaves


LEAVES = numeric_leaves()
RULED = [leaf for leaf in LEAVES if leaf.rule is not None]

#: what a key's just-inside value needs from the other keys (the cross-key rules of dspark.config.resolve)
CONTEXT = {
    "data.val_fraction": ["data.calib_fraction=0"],  # the two fractions must leave a training split
    "data.calib_fraction": ["data.val_fraction=0.001"],
    "model.init_layers": ["model.depth=1"],  # one id per draft layer
    "data.train_weights": ["data.train_sets=[synthetic,gsm8k-train]"],  # one weight per set, a positive sum
}
#: entries a list key's test value carries besides the one under test
PAD = {"data.train_weights": [1.0]}


def _step(leaf: Leaf, bound: float) -> float:
    return 1 if leaf.kind is int else 0.01 * max(1.0, abs(bound))


def outside_values(leaf: Leaf) -> list[float]:
    """Values the key's rule must refuse: past each bound, each open bound itself, a miss next to each sentinel,
    non-finite floats, and for an integer key without an upper bound one past 64 bits."""
    rule = leaf.rule
    values = [rule.ge - _step(leaf, rule.ge)] if rule.ge is not None else []
    values += [rule.le + _step(leaf, rule.le)] if rule.le is not None else []
    values += [bound for bound in (rule.gt, rule.lt) if bound is not None]
    values += [s - _step(leaf, s) for s in rule.sentinels] + [s + _step(leaf, s) for s in rule.sentinels]
    values = [v for v in values if not rule.admits(v)]
    if leaf.kind is float:
        return values + [math.inf, -math.inf, math.nan]
    return values + ([2**63] if rule.le is None and rule.lt is None else [])


def inside_values(leaf: Leaf) -> list[float]:
    """Values the rule must accept: each closed bound, just inside each open one, and every sentinel."""
    rule = leaf.rule
    values = [v for v in (rule.ge, rule.le) if v is not None]
    values += [rule.gt + _step(leaf, rule.gt)] if rule.gt is not None else []
    values += [rule.lt - _step(leaf, rule.lt)] if rule.lt is not None else []
    return values + list(rule.sentinels)


def _text(leaf: Leaf, value: float) -> str:
    text = str(int(value)) if leaf.kind is int and math.isfinite(value) else repr(float(value))
    return "[" + ",".join([text, *map(str, PAD.get(leaf.key, []))]) + "]" if leaf.is_list else text


def _cases(values_of) -> list:
    return [
        pytest.param(leaf, value, id=f"{leaf.key}={_text(leaf, value)}") for leaf in RULED for value in values_of(leaf)
    ]


def _refusal(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        resolve_config(argv)
    return str(err.value)


# ---- the rules exist ----


def test_the_enumeration_reaches_every_group():
    """The control for the next test: nested groups, Optional and list keys are all enumerated."""
    keys = {leaf.key for leaf in LEAVES}
    assert {
        "seed",
        "optim.lr",
        "data.sampling.top_p",
        "decode.tree.widths",
        "data.train_weights",
        "data.seed",
        "target_options.mask_token_id",
        "serve.simulate_concurrency",
        "optuna.startup_trials",
    } <= keys
    assert len(keys) >= 60


def test_every_numeric_key_declares_a_range():
    missing = [leaf.key for leaf in LEAVES if leaf.rule is None]
    assert not missing, f"declare a range with ranged(...) in dspark/config/schema.py for: {missing}"


def test_every_default_lies_in_its_range():
    assert range_errors(RunConfig()) == []


@dataclasses.dataclass
class _Unruled:
    rate: float = 0.5
    count: int = 1
    sizes: list[int] = dataclasses.field(default_factory=list)


def test_finite_and_64_bits_hold_without_a_declared_range():
    """A numeric key added without a rule (which the test above fails) still refuses what no key means."""
    assert range_errors(_Unruled()) == []
    errors = range_errors(_Unruled(rate=math.inf, count=2**63, sizes=[1, -(2**64)]), "x.")
    assert [e.split(" (got")[0] for e in errors] == [
        "x.rate must be finite",
        "x.count must be within 64 bits",
        "every entry of x.sizes must be within 64 bits",
    ]


def test_the_reference_shows_every_range():
    text = config_reference()
    for leaf in RULED:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{leaf.key}` |"))
        assert str(leaf.rule) in row.split(" | ")[-1], row


# ---- the rules hold ----


@pytest.mark.parametrize("leaf, value", _cases(outside_values))
def test_a_value_outside_the_range_is_refused_naming_the_key(leaf, value):
    message = _refusal([*SMOKE, f"{leaf.key}={_text(leaf, value)}"])
    lines = [line for line in message.splitlines() if leaf.key in line]
    expected = "is NaN" if isinstance(value, float) and math.isnan(value) else str(leaf.rule)
    assert any(expected in line for line in lines), message


@pytest.mark.parametrize("leaf, value", _cases(inside_values))
def test_a_value_just_inside_the_range_is_accepted(leaf, value):
    cfg = resolve_config([*SMOKE, *CONTEXT.get(leaf.key, []), f"{leaf.key}={_text(leaf, value)}"]).cfg
    node = cfg
    for part in leaf.key.split("."):
        node = getattr(node, part)
    assert (node[0] if leaf.is_list else node) == value


@pytest.mark.parametrize("leaf", [leaf for leaf in RULED if leaf.kind is int], ids=lambda leaf: leaf.key)
def test_an_integer_key_refuses_fractions_and_booleans(leaf):
    for text in (f"{int(inside_values(leaf)[0])}.5", "true"):
        value = f"[{text}]" if leaf.is_list else text
        assert f"'{leaf.key}' expects an integer" in _refusal([*SMOKE, f"{leaf.key}={value}"])


def test_optional_keys_accept_null():
    cfg = resolve_config([*SMOKE, "data.seed=null", "target_options.mask_token_id=null"]).cfg
    assert cfg.data.seed is None and cfg.target_options.mask_token_id is None


def test_every_problem_is_reported_at_once():
    message = _refusal([*SMOKE, "optim.epochs=0", "decode.temperature=inf", "data.sampling.top_p=1.5", "seed=-1"])
    for key in ("optim.epochs", "decode.temperature", "data.sampling.top_p", "seed"):
        assert f"  - {key} must be" in message, message


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["data.val_fraction=0.6", "data.calib_fraction=0.5"], "leaves no sequence to train on"),
        (["model.feature_layers=[3,3]"], "names a layer twice"),
        (["decode.tree.shape=branching", "decode.tree.branching=[64,64,64]"], "nodes per round"),
        (["data.train_weights=[0.0]"], "positive sum"),
    ],
)
def test_cross_key_rules(argv, needle):
    assert needle in _refusal([*SMOKE, *argv])


# ---- every shipped configuration stays inside the rules ----


@pytest.mark.parametrize("budget", BUDGETS)
def test_every_budget_and_sweep_resolves_inside_the_rules(budget):
    from dspark.sweeps.driver import plan_grid
    from dspark.sweeps.spec import load_sweep

    resolve_config([f"budget={budget}"])
    for path in sorted((repo_root() / "sweeps").glob("*.yaml")):
        spec = load_sweep(path.stem)
        if spec.kind == "grid":
            assert plan_grid(resolve_config([f"budget={budget}", f"sweep={path.stem}"]), spec, check=False).cells
            continue
        for param in spec.optuna.params:  # the search space lies inside the key's range
            for value in param.choices or (param.low, param.high):
                resolve_config([f"budget={budget}", f"{param.key}={value}"])


# ---- values an error quotes stay short ----

BOMB = "[&a [1,1,1,1,1,1,1,1,1],&b [*a,*a,*a,*a,*a,*a,*a,*a,*a],&c [*b,*b,*b,*b,*b,*b,*b,*b,*b]," + (
    "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c],&e [*d,*d,*d,*d,*d,*d,*d,*d,*d],&f [*e,*e,*e,*e,*e,*e,*e,*e,*e]]"
)


@pytest.mark.parametrize(
    "arg, needle",
    [
        (f"model.feature_layers={BOMB}", "aliases"),
        (f"model.depth={BOMB}", "aliases"),
        ("decode.tree.widths=[" + ",".join(["1"] * 100_000) + "]", f"at most {MAX_VALUE_CHARS:,}"),
        ("model.depth=" + "[" * 5000 + "]" * 5000, f"at most {MAX_VALUE_CHARS:,}"),
        ("drafter=" + "x" * 5000, "Unknown drafter"),
        ("x" * 5000 + "=1", "Unknown config key"),
        ("model.depth=" + "9" * 5000, "model.depth"),
        ("model.depth=" + "[" * 3000 + "]" * 3000, "levels deep"),
    ],
    ids=[
        "alias-bomb-list",
        "alias-bomb-int",
        "100k-list",
        "10k-nesting",
        "long-name",
        "long-key",
        "5000-digits",
        "3000-deep",
    ],
)
def test_oversized_values_are_refused_with_a_short_message(arg, needle):
    start = time.perf_counter()
    message = _refusal([*SMOKE, arg])
    assert needle in message and len(message) < 600, message[:1000]
    assert time.perf_counter() - start < 5


def test_a_value_from_a_yaml_file_is_quoted_short_however_it_expands():
    """Files may use aliases; the 9⁶-entry list they expand to is quoted in bounded time and length."""
    value = safe_load(BOMB)
    start = time.perf_counter()
    assert len(quote(value)) <= QUOTE_LIMIT
    with pytest.raises(ConfigError) as err:
        coerce(value, int, key="model.depth")
    assert len(str(err.value)) < 200 and time.perf_counter() - start < 1


# ---- through the real command line: exit 2, nothing created ----


@pytest.mark.parametrize(
    "args, keys",
    [
        (["optim.epochs=0", "data.sampling.top_p=1.5", "data.batch_size=0"], ["optim.epochs", "top_p", "batch_size"]),
        (["decode.temperature=inf"], ["decode.temperature"]),
        ([f"model.feature_layers={BOMB}"], ["model.feature_layers"]),
    ],
    ids=["three-keys", "infinite-temperature", "alias-bomb"],
)
def test_the_command_line_exits_2_before_creating_anything(args, keys, tmp_path):
    root = tmp_path / "root"
    argv = [sys.executable, str(repo_root() / "experiments" / "run.py"), *SMOKE, *args, f"paths.root={root}"]
    env = dict(os.environ, PYTHONPATH=str(repo_root() / "src"), OMP_NUM_THREADS="1")
    env.pop("DSPARK_MLFLOW_RUN_ID", None)
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error:") and len(proc.stderr) < 1000, proc.stderr[:2000]
    assert all(key in proc.stderr for key in keys), proc.stderr
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())
