"""The tree stays formatted by the configured formatter (`ruff format`, settings in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["src", "tests", "benchmarks", "experiments", "tools"]


def _ruff() -> list[str]:
    local = Path(sys.executable).with_name("ruff")
    if local.exists():
        return [str(local)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: `pip install -e '.[test]'` installs it (the test extra)")
    return [found]


def test_the_tree_is_formatted():
    result = subprocess.run([*_ruff(), "format", "--check", *FOLDERS], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"run `ruff format {' '.join(FOLDERS)}`:\n{result.stdout[-3000:]}"


def test_the_check_fails_on_an_unformatted_file(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("x = {  'a':1 }\n")
    result = subprocess.run([*_ruff(), "format", "--check", "bad.py"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 1 and "bad.py" in result.stdout
