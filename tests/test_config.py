"""Config files, key=value parsing and the errors users see (issue: config and command line, bad input)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark.config import ConfigError, RunConfig, parse_overrides, resolve_config, valid_keys
from dspark.config.loader import load_yaml
from dspark.config.resolve import experiments_dir, repo_root
from dspark.drafters.factory import DRAFTER_BUILDERS
from dspark.drafters.heads import SEQUENTIAL_HEADS

YAML_FILES = sorted(p for p in (repo_root() / "experiments").rglob("*.yaml"))


def test_yaml_files_exist():
    assert (repo_root() / "experiments" / "default.yaml") in YAML_FILES
    assert {p.stem for p in (experiments_dir() / "budgets").glob("*.yaml")} == {
        "smoke",
        "cpu",
        "cpu-ref",
        "cpu-long",
        "paper",
    }


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_every_yaml_uses_only_schema_keys(path: Path):
    keys = set(valid_keys())
    flat = load_yaml(path)
    assert flat, f"{path} is empty"
    unknown = [k for k in flat if k not in keys]
    assert not unknown, f"{path}: unknown keys {unknown}"


@pytest.mark.parametrize("budget", ["smoke", "cpu", "paper"])
def test_each_budget_resolves(budget: str, tmp_path):
    rc = resolve_config([f"budget={budget}", f"paths.root={tmp_path}"])
    assert rc.cfg.budget == budget
    assert Path(rc.cfg.paths.root) == tmp_path.resolve()
    assert Path(rc.cfg.paths.reports) == tmp_path.resolve() / "reports"


def test_defaults_match_the_paper():
    cfg = resolve_config(["budget=paper"]).cfg
    assert (cfg.target, cfg.drafter, cfg.model.head) == ("smollm2-135m", "dspark", "markov")
    assert (cfg.model.depth, cfg.model.block_size, cfg.model.markov_rank) == (5, 7, 256)
    assert (cfg.loss.alpha_ce, cfg.loss.alpha_tv, cfg.loss.alpha_conf, cfg.loss.decay) == (0.1, 0.9, 1.0, 4.0)
    assert cfg.model.draft_vocab_size == 0 and cfg.data.responses == "regenerate"
    # the CPU budget (the default run) trades depth and vocabulary for a drafter that learns in minutes
    rc = resolve_config([])
    cpu = rc.cfg
    assert (cpu.budget, cpu.model.depth, cpu.model.draft_vocab_size, cpu.data.responses) == ("cpu", 2, 8192, "mix")
    # ~500 optimiser steps: slot 1 gets a larger share of the loss (experiments/budgets/cpu.yaml says why)
    assert (cpu.loss.alpha_ce, cpu.loss.alpha_tv, cpu.loss.alpha_conf, cpu.loss.decay) == (0.1, 0.9, 1.0, 2.0)
    cfg = cpu
    assert (
        Path(cfg.paths.root) == repo_root() / "outputs"
        and Path(cfg.paths.reports) == repo_root() / "outputs" / "reports"
    )


def test_precedence_cli_over_budget_over_default():
    rc = resolve_config(["budget=smoke"])
    assert rc.cfg.target == "tiny" and rc.cfg.model.depth == 2  # from budgets/smoke.yaml
    rc = resolve_config(["budget=smoke", "target=smollm2-135m", "model.depth=4"])
    assert rc.cfg.target == "smollm2-135m" and rc.cfg.model.depth == 4


def test_values_parse_as_yaml():
    over = parse_overrides(["model.feature_layers=[1,8,14]", "data.local_dir=null", "loss.decay=7", "seed=3"])
    assert over == {"model.feature_layers": [1, 8, 14], "data.local_dir": None, "loss.decay": 7, "seed": 3}
    rc = resolve_config(["model.feature_layers=[1,8,14]", "loss.decay=7"])
    assert rc.cfg.model.feature_layers == [1, 8, 14] and rc.cfg.loss.decay == 7.0


def test_dflash_means_no_head_and_ce_only():
    cfg = resolve_config(["drafter=dflash"]).cfg
    assert cfg.model.head == "none"
    assert (cfg.loss.alpha_ce, cfg.loss.alpha_tv, cfg.loss.alpha_conf) == (1.0, 0.0, 0.0)


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["no_such_key=1"], ["no_such_key", "Top-level keys"]),
        (["model.depht=3"], ["model.depht", "model.depth"]),
        (["model.depth=abc"], ["model.depth", "integer"]),
        (["loss.alpha_ce=[1]"], ["loss.alpha_ce", "number"]),
        (["data.cache_features=maybe"], ["data.cache_features", "true/false"]),
        (["drafter=medusa"], ["drafter", *DRAFTER_BUILDERS.names()]),  # the error lists every registered drafter
        (["model.head=lstm"], ["model.head", *SEQUENTIAL_HEADS.names()]),  # ... and every registered head
        (["budget=huge"], ["budget", "smoke", "paper"]),
        (["model.block_size=0"], ["model.block_size"]),
        (["model.depth=0"], ["model.depth"]),
        (["model.markov_rank=-1"], ["model.markov_rank"]),
        (["decode.threshold=1.5"], ["decode.threshold", "[0, 1]"]),
        (["drafter=dflash", "model.head=markov"], ["dflash", "model.head"]),
        (["drafter=eagle3", "model.head=rnn"], ["eagle3", "model.head"]),
        (["sweep=no_such_sweep"], ["sweep", "no_such_sweep"]),
        (["serve.scheduler_cost=bogus"], ["serve.scheduler_cost", "bogus", "tokens", "columns"]),
        (["model"], ["key=value"]),
        (["decode.tree.shape=star"], ["decode.tree.shape", "star", "dynamic", "branching"]),
        (["decode.tree.shape=widths", "decode.tree.widths=[2,0]"], ["decode.tree.widths", "≥ 1"]),
        (["decode.tree.shape=dynamic", "decode.tree.nodes=0"], ["decode.tree.nodes"]),
        (["decode.tree.shape=dynamic", "decode.policy=scheduler"], ["decode.policy=scheduler", "decode.tree.shape"]),
    ],
)
def test_bad_input_names_the_problem(argv, needles):
    with pytest.raises(ConfigError) as err:
        resolve_config(argv)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_all_errors_reported_together():
    with pytest.raises(ConfigError) as err:
        resolve_config(["model.depth=0", "model.block_size=0"])
    assert "model.depth" in str(err.value) and "model.block_size" in str(err.value)


def test_schema_keys_are_documented_in_default_yaml():
    """The public keys of the issue are all in the schema."""
    keys = set(valid_keys())
    for key in [
        "target",
        "drafter",
        "model.head",
        "model.depth",
        "model.block_size",
        "model.markov_rank",
        "model.feature_layers",
        "loss.alpha_ce",
        "loss.alpha_tv",
        "loss.alpha_conf",
        "loss.decay",
        "seed",
        "budget",
        "stage",
        "paths.root",
        "data.local_dir",
    ]:
        assert key in keys
    assert isinstance(RunConfig().model.feature_layers, list)


# Defect 2 of issue 14: PyYAML's YAML 1.1 resolver read `1e-4` (no dot) as a string, so every float key refused it.
FLOAT_FORMS = [
    "1e-4",
    "3e-3",
    "1E-4",
    "1e4",
    "+2.5E-1",
    "-0.5e+0",
    ".5",
    "5.",
    "0.25",
    "1_0.5e-1",
    "7",
    " 1e-4 ",
    "inf",
    "-Infinity",
    "1e-04",
]


def _float_keys() -> list[str]:
    from dspark.sweeps.spec import schema_type

    return [k for k in valid_keys() if schema_type(k) in (float, float | None)]


def test_float_keys_exist():
    assert {"optim.lr", "loss.decay", "decode.threshold", "serve.threshold"} <= set(_float_keys())


@pytest.mark.parametrize("form", FLOAT_FORMS)
def test_every_python_float_form_works_for_every_float_key(form):
    from dspark.config.loader import apply_overrides

    keys = _float_keys()
    cfg = apply_overrides(RunConfig(), parse_overrides([f"{k}={form}" for k in keys]), source="command line")
    for key in keys:
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        assert node == float(form) and isinstance(node, float), (key, form, node)


@pytest.mark.parametrize("form", ["1e-4", "3e-3", "1E-4", "2.5e-4"])
def test_scientific_lr_on_the_command_line_and_in_files(form, tmp_path):
    assert resolve_config([f"optim.lr={form}"]).cfg.optim.lr == float(form)
    path = tmp_path / "overlay.yaml"
    path.write_text(f"optim:\n  lr: {form}   # scientific notation without a dot\nloss: {{decay: {form}}}\n")
    flat = load_yaml(path)
    assert flat == {"optim.lr": float(form), "loss.decay": float(form)}
    assert resolve_config([f"{k}={v}" for k, v in flat.items()]).cfg.optim.lr == float(form)


def test_numbers_follow_python_not_yaml_1_1():
    """`010` is ten (YAML 1.1: octal eight); words, dates and bad literals are unchanged."""
    from dspark.config.loader import safe_load

    assert [safe_load(t) for t in ["010", "1_000", "0x1f", "1e5", ".inf", "-.inf"]] == [
        10,
        1000,
        31,
        1e5,
        float("inf"),
        float("-inf"),
    ]
    assert [safe_load(t) for t in ["1e", "e5", "1__0", "nan", "yes", "null"]] == ["1e", "e5", "1__0", "nan", True, None]
    assert resolve_config(["model.depth=1e0", "seed=1_0"]).cfg.model.depth == 1


def test_scientific_floats_in_sweep_files():
    from dspark.sweeps.spec import parse_sweep

    spec = parse_sweep("t", "fixed: {optim.lr: 1e-4}\ngrid:\n  - {loss.decay: [1e0, 4E0]}\n")
    assert spec.fixed == {"optim.lr": 1e-4} and spec.grid == [{"loss.decay": [1.0, 4.0]}]
    search = parse_sweep(
        "t",
        "optuna:\n  params: {optim.lr: {type: float, low: 1e-5, high: 1e-3, log: true}}\n"
        "  defaults: {optim.lr: 6e-4}\n",
    ).optuna
    assert (search.params[0].low, search.params[0].high, search.defaults) == (1e-5, 1e-3, {"optim.lr": 6e-4})


@pytest.mark.parametrize("argv", [["optim.lr=nan"], ["optim.beta2=NaN"], ["loss.alpha_tv=.nan"]])
def test_nan_is_refused_with_the_key(argv):
    key = argv[0].split("=")[0]
    with pytest.raises(ConfigError, match=f"{key} is NaN"):
        resolve_config(argv)
