"""The sweep file schema (`sweeps/<name>.yaml`) and its validation.

A sweep file is a mapping with these top-level keys (everything but `grid`/`optuna` is optional):

    paper_ref: "Fig. 3"               what it reproduces (tag `paper.ref` on every run)
    description: "..."                one line for the report
    report: depth                     report builder (dspark.reports.builders; default: the sweep's name)
    runner: experiment | latency      how a cell runs: the normal stages (default) or a timing-only cell
    fixed: {key: value, ...}          dotted (or nested) config overrides applied to every cell
    budget_overrides: {cpu: {...}}    extra fixed overrides for one budget only (sizing, never science)
    seeds: [0, 1]                     crossed with every grid cell (outermost loop); default [0]
    grid:                             a list of blocks; each block is the product of its axes, blocks are unioned
      - {drafter: [dspark], model.depth: [1, 2, 3]}
      - {drafter: [dflash], model.depth: [5]}
    optuna:                           instead of `grid`: an Optuna search (dspark.sweeps.optuna_search)
      direction: maximize
      objective: {all: summary/tau, train: val/tau_prob}   metric read from the trial's run, by stage
      prune_on: val/tau_prob          validation metric reported per epoch for pruning
      params: {loss.alpha_ce: {type: float, low: 0.0, high: 1.0}, model.markov_rank: {choices: [64, 256]}}
      defaults: {loss.alpha_ce: 0.1}  the paper's values, always enqueued as a trial
    latency: {context_lengths: [...], rounds: N, budgets: {smoke: {...}}}   options of the latency runner

Every key (fixed, budget overrides, axes, Optuna params) is checked against the config schema and every value
coerced to the schema's type here, before anything runs; errors name the sweep file and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.config import ConfigError, RunConfig, valid_keys
from dspark.config.loader import coerce, flatten, safe_load
from dspark.config.resolve import available_sweeps, sweeps_dir
from dspark.registry import unknown_name_message

TOP_LEVEL = {
    "paper_ref",
    "description",
    "report",
    "runner",
    "fixed",
    "budget_overrides",
    "seeds",
    "grid",
    "optuna",
    "latency",
}
RUNNERS = ("experiment", "latency")
SWEEP_PLUMBING = ("paths.", "tracking.", "optuna.")  # the sweep's own settings, never a cell's choice
OPTUNA_KEYS = {"direction", "objective", "prune_on", "params", "defaults"}


@dataclass(frozen=True)
class Cell:
    """One grid point: `axes` (incl. `seed`) plus the fixed overrides give `overrides` (all coerced)."""

    index: int
    key: str  # stable id from the axis values, e.g. "drafter=dspark model.depth=1 seed=0"
    axes: dict[str, Any]
    overrides: dict[str, Any]


@dataclass(frozen=True)
class ParamSpec:
    """One Optuna search dimension over a config key."""

    key: str
    kind: str  # float | int | categorical
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple = ()

    def suggest(self, trial: Any) -> Any:
        """Ask the trial for a value (the parameter is named by its config key)."""
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.key, float(self.low), float(self.high), log=self.log)

    def contains(self, value: Any) -> bool:
        if self.kind == "categorical":
            return value in self.choices
        return self.low <= value <= self.high


@dataclass(frozen=True)
class OptunaSpec:
    direction: str
    objective: dict[str, str]  # stage group ("train" | "all") → metric of the trial's MLflow run
    prune_on: str | None
    params: tuple[ParamSpec, ...]
    defaults: dict[str, Any]

    def objective_metric(self, stage: str) -> str:
        """The metric a trial is scored by: training-only stages read the validation proxy."""
        group = "train" if stage in ("prepare", "train") else "all"
        if group not in self.objective:
            raise ConfigError(
                f"stage={stage}: this search has no objective for it (objective: {self.objective}); "
                "run it with a stage its objective names."
            )
        return self.objective[group]


@dataclass
class SweepSpec:
    """A parsed, validated sweep file."""

    name: str
    path: Path
    text: str
    paper_ref: str = ""
    description: str = ""
    report: str = ""
    runner: str = "experiment"
    fixed: dict[str, Any] = field(default_factory=dict)
    budget_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [0])
    grid: list[dict[str, list[Any]]] = field(default_factory=list)
    optuna: OptunaSpec | None = None
    latency: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "optuna" if self.optuna else "grid"

    def base_overrides(self, budget: str) -> dict[str, Any]:
        """What every cell/trial sets: `fixed` then this budget's overrides."""
        return {**self.fixed, **self.budget_overrides.get(budget, {})}

    def axis_keys(self) -> list[str]:
        keys = list(dict.fromkeys(k for block in self.grid for k in block))
        return keys + ["seed"]

    def cells(self, budget: str) -> list[Cell]:
        """Every grid cell, seeds outermost (a whole first replicate before any repeat), in file order."""
        base = self.base_overrides(budget)
        out: list[Cell] = []
        seen: set[str] = set()
        for seed in self.seeds:
            for block in self.grid:
                for values in itertools.product(*block.values()):
                    axes = dict(zip(block.keys(), values)) | {"seed": seed}
                    key = " ".join(f"{k}={_show(v)}" for k, v in axes.items())
                    if key not in seen:  # overlapping blocks: a cell runs once
                        seen.add(key)
                        out.append(Cell(index=len(out), key=key, axes=axes, overrides={**base, **axes}))
        return out

    def with_args(self, args: dict[str, Any]) -> "SweepSpec":
        """This sweep with its axes or seeds replaced from the command line (`sweep.axes.<key>=[v, ...]`,
        `sweep.seeds=[0, 1, 2]`): a grown sweep keeps its identity, so its finished cells are reused and only new
        cells run. Every problem is a ConfigError naming the argument and the fix."""
        if not args:
            return self
        grid = [dict(block) for block in self.grid]
        seeds = self.seeds
        for arg, raw in args.items():
            values = raw if isinstance(raw, list) else [raw]
            if arg == "sweep.seeds":
                seeds = [coerce(v, int, key=arg) for v in values]
                if not seeds:
                    raise ConfigError(f"{arg}=[]: give at least one seed, e.g. {arg}=[0,1].")
                continue
            key = arg[len(AXES_ARG) :] if arg.startswith(AXES_ARG) else ""
            axes = [k for k in self.axis_keys() if k != "seed"]
            if self.kind != "grid" or key not in axes:
                where = f"sweep={self.name}"
                raise ConfigError(
                    f"{arg}: {where} has no axis '{key or arg}' (its axes: {', '.join(axes) or 'none'};"
                    f" seeds: sweep.seeds=[...]). To set a key for every cell, pass {key or 'KEY'}=VALUE."
                )
            if not values:
                raise ConfigError(
                    f"{arg}=[]: give at least one value, e.g. {arg}=[{_show(grid_values(grid, key)[0])}]."
                )
            coerced = [coerce_value(key, v, where=f"command line {arg}") for v in values]
            grid = [{k: (coerced if k == key else v) for k, v in block.items()} for block in grid]
        return dataclasses.replace(self, grid=grid, seeds=seeds)

    def latency_options(self, budget: str) -> dict[str, Any]:
        opts = {k: v for k, v in self.latency.items() if k != "budgets"}
        return opts | dict(self.latency.get("budgets", {}).get(budget, {}))

    def digest(self) -> str:
        """Hash of the parsed file (comments and formatting excluded)."""
        payload = {
            "fixed": self.fixed,
            "budget_overrides": self.budget_overrides,
            "seeds": self.seeds,
            "grid": self.grid,
            "runner": self.runner,
            "latency": self.latency,
            "optuna": dataclasses.asdict(self.optuna) if self.optuna else None,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


#: the command-line prefix that replaces one axis's values (`sweep.axes.model.head=[markov,rnn]`)
AXES_ARG = "sweep.axes."


def grid_values(grid: list[dict[str, list[Any]]], key: str) -> list[Any]:
    """Every value of one axis over the grid's blocks, in order, once each."""
    return list(dict.fromkeys(v for block in grid for v in block.get(key, [])))


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def schema_type(key: str) -> Any:
    """The annotated type of a dotted config key (the key must be valid)."""
    node: Any = RunConfig
    for part in key.split("."):
        hint = typing.get_type_hints(node)[part]
        node = hint
    return node


def check_key(key: str, *, where: str) -> None:
    """A dotted key must be a leaf of the schema and not the sweep's own plumbing."""
    keys = valid_keys()
    if key not in keys:
        close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
        hint = f" Closest valid keys: {', '.join(close)}." if close else " See experiments/default.yaml."
        raise ConfigError(f"{where}: unknown config key '{key}'.{hint}")
    if key == "sweep" or key.startswith(SWEEP_PLUMBING):
        raise ConfigError(f"{where}: '{key}' belongs to the sweep itself, not to a cell; set it on the command line.")


def coerce_value(key: str, value: Any, *, where: str) -> Any:
    """Coerce `value` to the schema type of `key`; the error names the sweep file and the key."""
    check_key(key, where=where)
    return coerce(value, schema_type(key), key=f"{where}: {key}")


def _mapping(value: Any, *, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping of config keys, got {type(value).__name__}.")
    return flatten(value)


def _parse_overrides(value: Any, *, where: str) -> dict[str, Any]:
    return {k: coerce_value(k, v, where=where) for k, v in _mapping(value, where=where).items()}


def _parse_grid(value: Any, *, where: str) -> list[dict[str, list[Any]]]:
    blocks = value if isinstance(value, list) else [value]
    out = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or not block:
            raise ConfigError(f"{where} grid[{i}]: expected a non-empty mapping of axis key → list of values.")
        parsed = {}
        for key, values in flatten(block).items():
            if key == "seed":
                raise ConfigError(f"{where} grid[{i}]: list seeds under the top-level `seeds:` key, not as an axis.")
            values = values if isinstance(values, list) else [values]
            if not values:
                raise ConfigError(f"{where} grid[{i}]: axis '{key}' has no values.")
            parsed[key] = [coerce_value(key, v, where=f"{where} grid[{i}] axis") for v in values]
        out.append(parsed)
    return out


def _parse_param(key: str, raw: Any, *, where: str) -> ParamSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: param '{key}' must be a mapping (type/low/high or choices).")
    check_key(key, where=where)
    hint = schema_type(key)
    if "choices" in raw:
        choices = tuple(coerce(v, hint, key=f"{where}: {key}") for v in raw["choices"])
        return ParamSpec(key=key, kind="categorical", choices=choices)
    kind = raw.get("type", "int" if hint is int else "float")
    if kind not in ("int", "float") or hint not in (int, float) or {"low", "high"} - set(raw):
        raise ConfigError(
            f"{where}: param '{key}' needs `choices: [...]` or numeric `low`/`high` (and optional "
            f"`type: int|float`, `log: true`) for a numeric key."
        )
    cast = int if kind == "int" else float
    low, high = (cast(coerce(raw[b], hint, key=f"{where}: {key}.{b}")) for b in ("low", "high"))
    if not low < high:
        raise ConfigError(f"{where}: param '{key}' needs low < high (got {low}, {high}).")
    return ParamSpec(key=key, kind=kind, low=low, high=high, log=bool(raw.get("log", False)))


def _parse_optuna(raw: Any, *, where: str) -> OptunaSpec:
    if not isinstance(raw, dict) or set(raw) - OPTUNA_KEYS or "params" not in raw:
        raise ConfigError(
            f"{where} optuna: expected a mapping with params (and direction, objective, prune_on, "
            f"defaults); got keys {sorted(raw) if isinstance(raw, dict) else raw!r}."
        )
    direction = raw.get("direction", "maximize")
    if direction not in ("maximize", "minimize"):
        raise ConfigError(f"{where} optuna.direction must be maximize or minimize (got {direction!r}).")
    objective = raw.get("objective", {"all": "summary/tau", "train": "val/tau_prob"})
    objective = {"all": objective} if isinstance(objective, str) else dict(objective)
    if not objective or set(objective) - {"all", "train"}:
        raise ConfigError(f"{where} optuna.objective: a metric name or a mapping with keys all/train.")
    params = tuple(_parse_param(k, v, where=f"{where} optuna.params") for k, v in (raw["params"] or {}).items())
    if not params:
        raise ConfigError(f"{where} optuna.params: name at least one config key to search over.")
    by_key = {p.key: p for p in params}
    defaults = {}
    for key, value in _mapping(raw.get("defaults"), where=f"{where} optuna.defaults").items():
        if key not in by_key:
            raise ConfigError(
                f"{where} optuna.defaults: '{key}' is not one of the searched params ({', '.join(by_key)})."
            )
        value = coerce_value(key, value, where=f"{where} optuna.defaults")
        if not by_key[key].contains(value):
            raise ConfigError(f"{where} optuna.defaults: {key}={value} lies outside its search space.")
        defaults[key] = value
    return OptunaSpec(
        direction=direction, objective=objective, prune_on=raw.get("prune_on"), params=params, defaults=defaults
    )


def load_sweep(name: str) -> SweepSpec:
    """Read and validate `sweeps/<name>.yaml`; every problem is a ConfigError naming the file and key."""
    if name not in available_sweeps():
        raise ConfigError(unknown_name_message("sweep", name, available_sweeps()))
    path = sweeps_dir() / f"{name}.yaml"
    return parse_sweep(name, path.read_text(), path=path)


def parse_sweep(name: str, text: str, *, path: Path | None = None) -> SweepSpec:
    """Validate the YAML text of a sweep (see the module docstring for the schema)."""
    where = f"sweeps/{name}.yaml"
    raw = safe_load(text) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level.")
    unknown = set(raw) - TOP_LEVEL
    if unknown:
        raise ConfigError(f"{where}: unknown top-level keys {sorted(unknown)}; valid: {sorted(TOP_LEVEL)}.")
    if ("grid" in raw) == ("optuna" in raw):
        raise ConfigError(f"{where}: give exactly one of `grid:` (a grid sweep) or `optuna:` (a search).")
    runner = raw.get("runner", "experiment")
    if runner not in RUNNERS:
        raise ConfigError(unknown_name_message(f"{where} runner", runner, list(RUNNERS)))
    seeds = raw.get("seeds", [0])
    seeds = [coerce(s, int, key=f"{where}: seeds") for s in (seeds if isinstance(seeds, list) else [seeds])]
    budgets = raw.get("budget_overrides") or {}
    spec = SweepSpec(
        name=name,
        path=path or Path(where),
        text=text,
        paper_ref=str(raw.get("paper_ref", "")),
        description=str(raw.get("description", "")),
        report=str(raw.get("report", name)),
        runner=runner,
        fixed=_parse_overrides(raw.get("fixed"), where=f"{where} fixed"),
        budget_overrides={b: _parse_overrides(v, where=f"{where} budget_overrides.{b}") for b, v in budgets.items()},
        seeds=seeds or [0],
        latency=dict(raw.get("latency") or {}),
    )
    if "grid" in raw:
        spec.grid = _parse_grid(raw["grid"], where=where)
    else:
        spec.optuna = _parse_optuna(raw["optuna"], where=where)
    return spec
