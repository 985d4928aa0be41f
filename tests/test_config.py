"""Config files, key=value parsing and the errors users see (issue: config and command line, bad input)."""
from __future__ import annotations

from pathlib import Path

import pytest

from dspark.config import ConfigError, RunConfig, parse_overrides, resolve_config, valid_keys
from dspark.config.loader import load_yaml
from dspark.config.resolve import experiments_dir, repo_root

YAML_FILES = sorted(p for p in (repo_root() / "experiments").rglob("*.yaml"))


def test_yaml_files_exist():
    assert (repo_root() / "experiments" / "default.yaml") in YAML_FILES
    assert {p.stem for p in (experiments_dir() / "budgets").glob("*.yaml")} == {"smoke", "cpu", "cpu-ref", "cpu-long", "paper"}


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
    assert cfg.model.draft_vocab_size == 0 and cfg.data.responses == "regenerate"
    # the CPU budget (the default run) trades depth and vocabulary for a drafter that learns in minutes
    rc = resolve_config([])
    cpu = rc.cfg
    assert (cpu.budget, cpu.model.depth, cpu.model.draft_vocab_size, cpu.data.responses) == ("cpu", 2, 8192, "reference")
    cfg = cpu
    assert (cfg.loss.alpha_ce, cfg.loss.alpha_tv, cfg.loss.alpha_conf, cfg.loss.decay) == (0.1, 0.9, 1.0, 4.0)
    assert Path(cfg.paths.root) == repo_root() / "outputs" and Path(cfg.paths.reports) == repo_root() / "reports"


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


@pytest.mark.parametrize("argv, needles", [
    (["no_such_key=1"], ["no_such_key", "Top-level keys"]),
    (["model.depht=3"], ["model.depht", "model.depth"]),
    (["model.depth=abc"], ["model.depth", "integer"]),
    (["loss.alpha_ce=[1]"], ["loss.alpha_ce", "number"]),
    (["data.cache_features=maybe"], ["data.cache_features", "true/false"]),
    (["drafter=medusa"], ["drafter", "dspark", "eagle3"]),
    (["model.head=lstm"], ["model.head", "markov", "rnn"]),
    (["budget=huge"], ["budget", "smoke", "paper"]),
    (["model.block_size=0"], ["model.block_size"]),
    (["model.depth=0"], ["model.depth"]),
    (["model.markov_rank=-1"], ["model.markov_rank"]),
    (["decode.threshold=1.5"], ["decode.threshold", "[0, 1]"]),
    (["drafter=dflash", "model.head=markov"], ["dflash", "model.head"]),
    (["drafter=eagle3", "model.head=rnn"], ["eagle3", "model.head"]),
    (["sweep=no_such_sweep"], ["sweep", "no_such_sweep"]),
    (["model"], ["key=value"]),
])
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
    for key in ["target", "drafter", "model.head", "model.depth", "model.block_size", "model.markov_rank",
                "model.feature_layers", "loss.alpha_ce", "loss.alpha_tv", "loss.alpha_conf", "loss.decay", "seed",
                "budget", "stage", "paths.root", "data.local_dir"]:
        assert key in keys
    assert isinstance(RunConfig().model.feature_layers, list)
