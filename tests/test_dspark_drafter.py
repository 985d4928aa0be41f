"""DSpark/DFlash drafter: masking, RoPE, DFlash equivalence, non-anticipation, step API (METHOD §2.1–§2.3).

Weights are re-drawn with a large std so that a leak would move outputs far beyond float noise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from dspark.drafters import SEQUENTIAL_HEADS, DSparkDrafter, DraftLayerSpec, build_sequential_head

HEADS = SEQUENTIAL_HEADS.ordered()  # every registered head is held to these contracts
RANKED_HEADS = [h for h in HEADS if h != "none"]  # the heads with a W_1 table (none is DFlash's B_k = 0)

VOCAB, D, M, GAMMA, MASK_ID = 97, 32, 2, 4, 96
ANCHORS = torch.tensor([[3, 7, 10], [5, 1, 9]])  # [B, N]
T = 12


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread (tests/conftest.py)


def tiny_spec(qk_norm: bool = False) -> DraftLayerSpec:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        num_hidden_layers=4,
    )
    return dataclasses.replace(DraftLayerSpec.from_hf_config(config), qk_norm=qk_norm)


def frozen_modules(seed: int = 0) -> tuple[nn.Embedding, nn.Linear]:
    torch.manual_seed(seed)
    embed, lm_head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB, bias=False)
    return embed.requires_grad_(False), lm_head.requires_grad_(False)


def make_drafter(
    head: str = "markov",
    rank: int = 6,
    *,
    confidence: bool = True,
    qk_norm: bool = False,
    seed: int = 0,
    depth: int = 2,
) -> DSparkDrafter:
    embed, lm_head = frozen_modules()  # the same "target" for every drafter; `seed` draws the drafter weights
    torch.manual_seed(seed + 1)
    drafter = DSparkDrafter(
        spec=tiny_spec(qk_norm),
        num_feature_layers=M,
        depth=depth,
        block_size=GAMMA,
        head=head,
        markov_rank=rank,
        confidence=confidence,
        embed_tokens=embed,
        lm_head=lm_head,
        mask_token_id=MASK_ID,
    )
    with torch.no_grad():  # large weights so that any leak is visible far above float noise
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return drafter.eval()


def make_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch, blocks = ANCHORS.shape
    block_ids = torch.full((batch, blocks, GAMMA), MASK_ID)
    block_ids[..., 0] = torch.randint(0, VOCAB - 1, (batch, blocks), generator=g)
    prev = torch.randint(0, VOCAB - 1, (batch, blocks, GAMMA), generator=g)
    prev[..., 0] = block_ids[..., 0]
    return dict(
        context_features=torch.randn(batch, T, M * D, generator=g),
        context_valid=torch.ones(batch, T, dtype=torch.bool),
        block_input_ids=block_ids,
        anchor_positions=ANCHORS.clone(),
        prev_tokens=prev,
    )


def run(drafter: DSparkDrafter, inputs: dict) -> object:
    with torch.no_grad():
        return drafter(**inputs)


def assert_block_same(a, b, bi: int, n: int) -> None:
    for field in ("hidden", "logits", "confidence_logits"):
        torch.testing.assert_close(getattr(a, field)[bi, n], getattr(b, field)[bi, n], atol=1e-6, rtol=0)


def block_changed(a, b, bi: int, n: int) -> bool:
    return (a.hidden[bi, n] - b.hidden[bi, n]).abs().max().item() > 1e-3


@pytest.mark.parametrize("qk_norm", [False, True])
def test_block_sees_only_its_block_and_context_before_anchor(qk_norm):
    drafter, inputs = make_drafter("rnn", qk_norm=qk_norm), make_inputs()
    base = run(drafter, inputs)
    for bi in range(ANCHORS.shape[0]):
        for n in range(ANCHORS.shape[1]):
            anchor = ANCHORS[bi, n].item()
            future = {**inputs, "context_features": inputs["context_features"].clone()}
            future["context_features"][bi, anchor:] += 5 * torch.randn(T - anchor, M * D)
            assert_block_same(base, run(drafter, future), bi, n)
            others = {**inputs, "block_input_ids": inputs["block_input_ids"].clone()}
            others["block_input_ids"][bi, [j for j in range(ANCHORS.shape[1]) if j != n], 0] += 1
            assert_block_same(base, run(drafter, others), bi, n)
            past = {**inputs, "context_features": inputs["context_features"].clone()}
            past["context_features"][bi, anchor - 1] += 5.0
            assert block_changed(base, run(drafter, past), bi, n), "the context just before the anchor is ignored"


def test_invalid_context_positions_are_ignored():
    drafter, inputs = make_drafter("markov"), make_inputs()
    perturbed = {**inputs, "context_features": inputs["context_features"].clone()}
    perturbed["context_features"][0, 2] += 5.0  # position 2 is before every anchor of sequence 0
    assert block_changed(run(drafter, inputs), run(drafter, perturbed), 0, 0)
    masked = {**inputs, "context_valid": inputs["context_valid"].clone()}
    masked["context_valid"][0, 2] = False
    masked_perturbed = {**perturbed, "context_valid": masked["context_valid"]}
    base, out = run(drafter, masked), run(drafter, masked_perturbed)
    for n in range(ANCHORS.shape[1]):
        assert_block_same(base, out, 0, n)


def test_rope_is_relative_to_a_shifted_context():
    """Left-padding the context by `pad` invalid positions and shifting anchors by `pad` changes nothing."""
    drafter, inputs = make_drafter("rnn", qk_norm=True), make_inputs()
    pad = 5
    shifted = dict(inputs)
    shifted["context_features"] = torch.cat([torch.randn(2, pad, M * D), inputs["context_features"]], dim=1)
    shifted["context_valid"] = torch.cat([torch.zeros(2, pad, dtype=torch.bool), inputs["context_valid"]], dim=1)
    shifted["anchor_positions"] = inputs["anchor_positions"] + pad
    base, out = run(drafter, inputs), run(drafter, shifted)
    torch.testing.assert_close(out.logits, base.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.confidence_logits, base.confidence_logits, atol=1e-4, rtol=1e-4)
    # Without shifting the block positions too, relative offsets change and so do the outputs.
    unshifted = {**shifted, "anchor_positions": inputs["anchor_positions"] + pad - 1}
    assert (run(drafter, unshifted).hidden - base.hidden).abs().max() > 1e-3


def test_single_block_call_matches_batched_forward():
    """The decoding path: one block against its own context prefix equals that block inside the batch."""
    drafter, inputs = make_drafter("markov"), make_inputs()
    base = run(drafter, inputs)
    for bi, n in [(0, 1), (1, 2), (1, 1)]:
        anchor = ANCHORS[bi, n].item()
        with torch.no_grad():
            hidden = drafter.backbone(
                inputs["context_features"][bi : bi + 1, :anchor],
                block_input_ids=inputs["block_input_ids"][bi : bi + 1, n : n + 1],
                anchor_positions=torch.tensor([[anchor]]),
            )
        torch.testing.assert_close(hidden[0, 0], base.hidden[bi, n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head", RANKED_HEADS)
def test_rank_zero_is_exactly_dflash(head):
    dflash, inputs = make_drafter("none", rank=0, confidence=False), make_inputs()
    ranked_none = make_drafter("none", rank=8, confidence=False)  # rank ignored by `none`
    rank0 = make_drafter(head, rank=0, confidence=False, seed=7)
    assert set(rank0.state_dict()) == set(dflash.state_dict()) == set(ranked_none.state_dict())
    rank0.load_state_dict(dflash.state_dict())
    ref, out = run(dflash, inputs), run(rank0, inputs)
    assert torch.equal(out.logits, ref.logits) and torch.equal(ref.logits, ref.parallel_logits)
    assert out.confidence_logits is None


@pytest.mark.parametrize("head", HEADS)
def test_confidence_and_logits_never_see_the_current_token(head):
    """prev_tokens[..., j] is x_j, the label of slot j (1-based): slots 1..j (indices < j) must ignore it."""
    drafter, inputs = make_drafter(head), make_inputs()
    base = run(drafter, inputs)
    for j in range(1, GAMMA):
        perturbed = {**inputs, "prev_tokens": inputs["prev_tokens"].clone()}
        perturbed["prev_tokens"][..., j:] = (perturbed["prev_tokens"][..., j:] + 11) % (VOCAB - 1)
        out = run(drafter, perturbed)
        assert torch.equal(out.hidden, base.hidden)
        assert torch.equal(out.confidence_logits[..., :j], base.confidence_logits[..., :j])
        assert torch.equal(out.logits[..., :j, :], base.logits[..., :j, :])
        if head != "none":  # slot j+1 does read x_j: the check above can fail
            assert not torch.allclose(out.confidence_logits[..., j], base.confidence_logits[..., j])


@pytest.mark.parametrize("head", HEADS)
def test_step_loop_reproduces_teacher_forced_outputs(head):
    drafter, inputs = make_drafter(head), make_inputs()
    base = run(drafter, inputs)
    prev = inputs["prev_tokens"]
    bias = drafter.head.teacher_forced_bias(base.hidden, prev, parallel_logits=base.parallel_logits)
    state = drafter.head.init_state(prev.shape[:-1])
    with torch.no_grad():
        for k in range(GAMMA):
            step_bias, _ = drafter.head.step(
                base.hidden[..., k, :], prev[..., k], state, parallel_logits=base.parallel_logits[..., k, :]
            )
            logits, conf, state = drafter.sequential_step(
                hidden_k=base.hidden[..., k, :],
                parallel_logits_k=base.parallel_logits[..., k, :],
                prev_token=prev[..., k],
                state=state,
            )
            if bias is not None:
                torch.testing.assert_close(step_bias, bias[..., k, :], atol=1e-6, rtol=0)
            torch.testing.assert_close(logits, base.logits[..., k, :], atol=1e-6, rtol=0)
            torch.testing.assert_close(conf, base.confidence_logits[..., k], atol=1e-6, rtol=0)


def test_mask_slots_use_the_trained_mask_embedding():
    drafter, inputs = make_drafter("markov"), make_inputs()
    base = run(drafter, inputs)
    with torch.no_grad():
        drafter.embed_tokens.weight[MASK_ID] += 3.0  # the target's MASK row is never used
    torch.testing.assert_close(run(drafter, inputs).hidden, base.hidden, atol=0, rtol=0)
    with torch.no_grad():
        drafter.backbone.mask_embedding += 1.0
    assert (run(drafter, inputs).hidden - base.hidden).abs().max() > 1e-3


def test_only_drafter_weights_are_parameters_and_state():
    embed, lm_head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB, bias=False)  # requires_grad on purpose
    drafter = DSparkDrafter(
        spec=tiny_spec(),
        num_feature_layers=M,
        depth=1,
        block_size=GAMMA,
        head="rnn",
        markov_rank=4,
        confidence=True,
        embed_tokens=embed,
        lm_head=lm_head,
        mask_token_id=MASK_ID,
    )
    frozen = {id(p) for p in [*embed.parameters(), *lm_head.parameters()]}
    assert not frozen & {id(p) for p in drafter.parameters()}
    assert not any(k.startswith(("embed", "lm_head")) or ".embed_tokens" in k for k in drafter.state_dict())
    assert not embed.weight.requires_grad and not lm_head.weight.requires_grad
    # Fresh weights follow init_new_weights: N(0, 0.02) matrices, norms at 1.
    assert torch.all(drafter.backbone.norm.weight == 1)
    assert abs(drafter.backbone.fc.weight.std().item() - 0.02) < 0.004


def test_extra_config_rebuilds_the_drafter():
    drafter, inputs = make_drafter("rnn", rank=5, qk_norm=True), make_inputs()
    rebuilt = DSparkDrafter.from_extra_config(
        drafter.extra_config(), embed_tokens=drafter.embed_tokens, lm_head=drafter.lm_head
    )
    rebuilt.load_state_dict(drafter.state_dict())
    torch.testing.assert_close(run(rebuilt.eval(), inputs).logits, run(drafter, inputs).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    "key,kwargs",
    [
        ("model.block_size", {"block_size": 0}),
        ("model.depth", {"depth": 0}),
        ("model.markov_rank", {"markov_rank": -1}),
        ("model.head", {"head": "markv"}),
    ],
)
def test_bad_config_values_name_the_key(key, kwargs):
    embed, lm_head = frozen_modules()
    args = dict(
        spec=tiny_spec(),
        num_feature_layers=M,
        depth=1,
        block_size=GAMMA,
        head="markov",
        markov_rank=4,
        confidence=True,
        embed_tokens=embed,
        lm_head=lm_head,
        mask_token_id=MASK_ID,
    )
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        DSparkDrafter(**{**args, **kwargs})


def test_forward_rejects_blocks_of_another_size():
    drafter, inputs = make_drafter("none", confidence=False), make_inputs()
    inputs["block_input_ids"] = inputs["block_input_ids"][..., :-1]
    with pytest.raises(ValueError, match=r"model\.block_size"):
        drafter(**inputs)


def test_registry_and_rank_zero_rule():
    assert {"none", "markov", "rnn"} <= set(SEQUENTIAL_HEADS.names())  # DFlash's and the paper's heads
    for name in RANKED_HEADS:
        assert build_sequential_head(name, hidden_size=D, vocab_size=VOCAB, rank=0).rank == 0
    head = build_sequential_head("rnn", hidden_size=D, vocab_size=VOCAB, rank=0)
    assert head.rank == 0 and head.prev_token_embedding(torch.zeros(2, dtype=torch.long)) is None
    assert sum(p.numel() for p in head.parameters()) == 0


@pytest.mark.parametrize("head", RANKED_HEADS)
def test_decode_projection_cache_matches_the_layer_and_follows_weight_updates(head):
    """The decoding loop's cached [r, V] copy of W_2 gives the layer's numbers and is rebuilt after the weights change."""
    from dspark.drafters.heads import build_sequential_head

    torch.manual_seed(0)
    module = build_sequential_head(head, hidden_size=8, vocab_size=50, rank=6)
    hidden, prev = torch.randn(3, 8), torch.tensor([1, 7, 49])
    parallel = torch.randn(3, 50)  # U_k: the selector's candidates
    with torch.no_grad():
        cached, _ = module.step(hidden, prev, None, parallel_logits=parallel)
    with torch.enable_grad():
        plain, _ = module.step(hidden, prev, None, parallel_logits=parallel)  # autograd on: the plain nn.Linear path
    torch.testing.assert_close(cached, plain.detach())
    with torch.no_grad():
        module.w2.weight.mul_(2.0)  # an in-place update (an optimizer step, load_state_dict) bumps the version
        again, _ = module.step(hidden, prev, None, parallel_logits=parallel)
    torch.testing.assert_close(again, 2.0 * plain.detach())
