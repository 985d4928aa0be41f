"""Shared fixtures: a session-wide output root so the tiny target and regenerated data are built once."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory) -> str:
    """A paths.root shared by the CLI tests of one session (caches are keyed, so sharing is safe)."""
    return str(tmp_path_factory.mktemp("dspark-root"))


@pytest.fixture()
def one_thread():
    """Tiny models run faster single-threaded on a loaded 2-core machine; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
