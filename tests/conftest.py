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


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    """The tiny random-weight target (8-layer Llama, d=64, offline tokenizer), built once per test module.

    A module chooses its options with a module-level `TINY_TARGET` dict: `load_target` keywords (`seed`,
    `feature_layers`, ...) and `threads` (torch threads while the module runs; tiny ops gain nothing from more)."""
    from dspark.targets import load_target

    options = dict(getattr(request.module, "TINY_TARGET", {}))
    threads, before = options.pop("threads", None), torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    yield load_target("tiny", cache_dir=tmp_path_factory.mktemp("tiny-target"), **options)
    torch.set_num_threads(before)


@pytest.fixture()
def one_thread():
    """Tiny models run faster single-threaded on a loaded 2-core machine; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def eval_prompt_files(tmp_path_factory):
    """Tests never touch the network: when the staged prompt sets (../shared/data) are absent, write small JSONL
    files in their schema for every evaluation set (prompts from the project's own generator) and point
    DSPARK_DATA_DIR at them."""
    import json

    from dspark.data.prompts import PROMPT_SETS, default_data_dir
    from dspark.data.synthetic import generate_synthetic_prompts

    if default_data_dir() is not None:
        yield default_data_dir()
        return
    folder = tmp_path_factory.mktemp("prompt-sets")
    pool = generate_synthetic_prompts(60, seed=123)
    for name in PROMPT_SETS.names():
        spec = PROMPT_SETS.resolve(name)
        if spec.role != "eval" or not spec.local_files:
            continue
        rows = [p for p in pool if p.domain == spec.domain][:6]
        lines = [json.dumps({"id": f"{name}-{i}", "domain": spec.domain, "prompt": p.prompt,
                             "paper_eval_rank": i}) for i, p in enumerate(rows)]
        (folder / spec.local_files[0]).write_text("\n".join(lines) + "\n")
    os.environ["DSPARK_DATA_DIR"] = str(folder)
    yield folder
    os.environ.pop("DSPARK_DATA_DIR", None)
