"""Grouped-query SDPA for the target's multi-token forwards (`dspark.targets.attention`): the same numbers as
transformers' `sdpa`, with the grouped path actually taken, and the switch's rules."""

from __future__ import annotations

import copy

import pytest
import torch

from dspark.targets import attention
from dspark.targets.attention import ATTENTION_ENV, GROUPED_SDPA, use_grouped_sdpa

TINY_TARGET = {"threads": 1}


@pytest.fixture()
def hf_twin(tiny):
    """A deep copy of the tiny target's model switched back to transformers' `sdpa` (the reference)."""
    twin = copy.deepcopy(tiny.model)
    twin.set_attn_implementation("sdpa")
    return twin


def test_tiny_target_runs_grouped_sdpa(tiny):
    assert tiny.hf_config.num_attention_heads > tiny.hf_config.num_key_value_heads  # grouped heads: the case
    assert tiny.attention == GROUPED_SDPA
    assert tiny.model.config._attn_implementation == GROUPED_SDPA


def _decode_blocks(model, prompt: torch.Tensor, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Prefill `prompt`, then forward each block over the cache and drop it again: the verify pattern."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = [model(input_ids=prompt, cache=cache, use_cache=True).logits]
    for block in blocks:
        out.append(model(input_ids=block, cache=cache, use_cache=True).logits)
        cache.crop(-block.shape[1])  # transformers 5.x: crop(-k) drops the last k positions
    return out


def test_verify_forwards_equal_transformers_sdpa_and_take_the_grouped_path(tiny, hf_twin, monkeypatch):
    calls = []
    grouped = attention.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa", False) and kwargs.get("attn_mask") is not None)
        return grouped(*args, **kwargs)

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, tiny.vocab_size, (1, 37), generator=generator)
    blocks = [torch.randint(0, tiny.vocab_size, (1, n), generator=generator) for n in (1, 2, 3, 4, 8)]
    reference = _decode_blocks(hf_twin, prompt, blocks)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    ours = _decode_blocks(tiny.model, prompt, blocks)
    for got, want in zip(ours, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # every layer of every multi-token block (2, 3, 4, 8 tokens) took the grouped path with a mask
    assert sum(calls) == 4 * tiny.num_layers


def test_padded_batch_equals_transformers_sdpa(tiny, hf_twin):
    """A left-padded batch (feature extraction, serving prefill) carries a mask: the grouped path again."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tiny.vocab_size, (3, 20), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :11] = 0
    want = hf_twin(input_ids=ids, attention_mask=mask).logits
    got = tiny.model(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=1e-6)


def test_env_keeps_transformers_sdpa_and_bad_values_are_refused(tiny, monkeypatch):
    model = copy.deepcopy(tiny.model)
    model.set_attn_implementation("sdpa")
    monkeypatch.setenv(ATTENTION_ENV, "sdpa")
    assert use_grouped_sdpa(model) == "sdpa"
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.setenv(ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match=ATTENTION_ENV):
        use_grouped_sdpa(model)
    monkeypatch.delenv(ATTENTION_ENV)
    assert use_grouped_sdpa(model) == GROUPED_SDPA


def test_models_without_grouped_heads_or_on_another_implementation_are_left_alone(tiny):
    model = copy.deepcopy(tiny.model)
    model.set_attn_implementation("eager")
    assert use_grouped_sdpa(model) == "eager"  # not transformers' sdpa: not ours to change
    model.set_attn_implementation("sdpa")
    model.config.num_key_value_heads = model.config.num_attention_heads  # plain multi-head attention: nothing to copy
    assert use_grouped_sdpa(model) == "sdpa"
