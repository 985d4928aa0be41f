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


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A save_pretrained directory of the tiny target's shape as a random Qwen3 (q/k norms; seed 3): the layout
    tests need a Qwen3 beside the built-in tiny Llama (the speculators layout holds Qwen3 layers only)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dspark.targets.builtin import TINY_SHAPE
    from dspark.targets.tiny_tokenizer import build_tiny_tokenizer

    tokenizer, model_dir = build_tiny_tokenizer(), tmp_path_factory.mktemp("tiny-qwen3")
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **TINY_SHAPE,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        Qwen3ForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir
