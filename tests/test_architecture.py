"""The layer rules of docs/ARCHITECTURE.md hold (import-linter contracts in pyproject.toml), and each contract fails
on an import planted in a copy of the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="install the test extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[1]
LINT = (
    "import sys; from importlinter.cli import lint_imports_command; "
    "sys.argv[0] = 'lint-imports'; sys.exit(lint_imports_command())"
)


def lint_imports(root: Path, *contracts: str) -> subprocess.CompletedProcess:
    """`lint-imports` over `root/src/dspark` with `root/pyproject.toml`, optionally limited to some contracts."""
    args = [sys.executable, "-c", LINT, str(root / "pyproject.toml"), "--no-cache", "--no-logo"]
    for contract in contracts:
        args += ["--contract", contract]
    env = os.environ | {"PYTHONPATH": str(root / "src")}
    return subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_every_contract():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def copy_root(tmp_path_factory) -> Path:
    """The package and its contracts, copied (the planted imports must never touch the real tree)."""
    root = tmp_path_factory.mktemp("layers")
    shutil.copytree(ROOT / "src" / "dspark", root / "src" / "dspark", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize(
    "module, planted, contract",
    [
        ("evaluation/summary.py", "from dspark.stages.context import StageContext", "library-below-orchestration"),
        ("decoding/engine.py", "import dspark.cli", "library-below-orchestration"),
        ("training/optim.py", "from dspark.sweeps import driver", "layers"),
        ("reports/collect.py", "from dspark.sweeps.driver import plan_grid", "reports-from-the-store"),
        ("drafters/layers.py", "from dspark.targets import Target", "layers"),
        ("sweeps/identity.py", "from dspark.sweeps.driver import plan_grid", "no-cycles"),
        ("newtopic.py", "import dspark.registry", "layers"),  # a top-level module no layer names
    ],
    ids=[
        "evaluation->stages",
        "decoding->cli",
        "training->sweeps",
        "reports->sweeps",
        "drafters->targets",
        "sweeps-cycle",
        "unlayered-module",
    ],
)
def test_a_planted_violation_breaks_its_contract(copy_root, module, planted, contract):
    path = copy_root / "src" / "dspark" / module
    original = path.read_text() if path.exists() else None
    path.write_text((original or '"""A module no layer names."""\n') + f"\n{planted}  # planted\n")
    try:
        result = lint_imports(copy_root, contract)
    finally:
        if original is None:
            path.unlink()
        else:
            path.write_text(original)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "1 broken" in out or "Missing layer" in out, out
    importer = "dspark." + module.removesuffix(".py").replace("/", ".")
    assert importer in out or importer.rsplit(".", 1)[-1] in out, out
