"""The draft vocabulary (issue: learning drafters): the selection, the frozen rows, exact TV/acceptance against
the full-vocabulary target, and the structured training attention equal to the dense mask."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from dspark.drafters.backbone import BlockMask, block_structured_attention, create_block_mask
from dspark.drafters.dspark import DSparkDrafter
from dspark.drafters.layers import DraftLayerSpec
from dspark.drafters.vocab import DraftVocabHead, build_draft_vocab, target_to_draft
from dspark.losses.dspark import compute_dspark_loss

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, D, M, GAMMA, MASK_ID = 40, 32, 2, 4, 39


def test_build_draft_vocab_takes_the_most_frequent_ids_and_forced_ones():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    ids = build_draft_vocab(counts, size=4, always=[6])
    assert ids.tolist() == [2, 3, 5, 6]  # forced 6, then counts 9, 9 (tie: smaller id first), 7
    assert build_draft_vocab(counts, size=0).tolist() == list(range(8))
    assert build_draft_vocab(counts, size=99).tolist() == list(range(8))
    inverse = target_to_draft(ids, vocab_size=8)
    assert inverse.tolist() == [-1, -1, 0, 1, -1, 2, 3, -1]
    with pytest.raises(ValueError, match="model.draft_vocab_size"):
        build_draft_vocab(counts, size=-1)


def test_draft_head_uses_the_frozen_rows_and_maps_ids_both_ways():
    lm_head = nn.Linear(D, VOCAB, bias=False)
    ids = torch.tensor([1, 5, 7, 20, 33])
    head = DraftVocabHead(lm_head, vocab_size=VOCAB, draft_vocab_ids=ids)
    h = torch.randn(3, D)
    torch.testing.assert_close(head(h), lm_head(h)[:, ids])
    assert head.to_target_ids(torch.tensor([0, 4])).tolist() == [1, 33]
    draft, inside = head.to_draft_ids(torch.tensor([5, 6, 33]))
    assert draft.tolist() == [1, 0, 4] and inside.tolist() == [True, False, True]
    p = torch.softmax(torch.randn(2, 5), -1)
    full = head.expand(p)
    assert full.shape == (2, VOCAB) and torch.allclose(full[:, ids], p) and full.sum(-1).allclose(torch.ones(2))
    assert "draft_to_target" in head.state_dict()
    assert "draft_to_target" not in DraftVocabHead(lm_head, vocab_size=VOCAB).state_dict()  # full: not persisted


def _drafter(ids, head="markov") -> DSparkDrafter:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        num_hidden_layers=4,
    )
    torch.manual_seed(0)
    return DSparkDrafter(
        spec=DraftLayerSpec.from_hf_config(config),
        num_feature_layers=M,
        depth=1,
        block_size=GAMMA,
        head=head,
        markov_rank=8,
        confidence=True,
        embed_tokens=nn.Embedding(VOCAB, D),
        lm_head=nn.Linear(D, VOCAB, bias=False),
        mask_token_id=MASK_ID,
        draft_vocab_ids=ids,
    )


def test_drafter_logits_are_over_the_draft_vocabulary_and_state_round_trips():
    ids = torch.arange(0, VOCAB, 2)
    drafter = _drafter(ids)
    assert (
        drafter.draft_vocab_size == 20
        and drafter.head.w2.out_features == 20
        and drafter.head.w1.num_embeddings == VOCAB
    )
    out = drafter(
        context_features=torch.randn(1, 10, M * D),
        context_valid=torch.ones(1, 10, dtype=torch.bool),
        block_input_ids=torch.full((1, 2, GAMMA), MASK_ID),
        anchor_positions=torch.tensor([[3, 7]]),
        prev_tokens=torch.randint(0, VOCAB - 1, (1, 2, GAMMA)),
    )
    assert out.logits.shape == (1, 2, GAMMA, 20)
    rebuilt = DSparkDrafter.from_extra_config(
        drafter.extra_config(), embed_tokens=drafter.embed_tokens, lm_head=drafter.lm_head
    )
    rebuilt.load_state_dict(drafter.state_dict())
    assert torch.equal(rebuilt.draft_to_target, ids)


def test_tv_and_acceptance_with_a_draft_vocabulary_equal_the_full_vocabulary_brute_force():
    """The loss sees only p_t on the Vd ids (+ nothing else); its L1, c* and CE must equal the full-vocabulary
    computation where p_d is zero outside Vd."""
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor(sorted(torch.randperm(VOCAB, generator=g)[:15].tolist()))
    shape = (2, 3, GAMMA)
    draft_logits = torch.randn(*shape, 15, generator=g)
    target_full = torch.softmax(torch.randn(*shape, VOCAB, generator=g) * 2, -1)
    labels_full = torch.randint(0, VOCAB, shape, generator=g)
    valid = torch.ones(shape, dtype=torch.bool)
    valid[0, 0, 2:] = False
    inverse = target_to_draft(ids, vocab_size=VOCAB)
    labels = inverse[labels_full].clamp_min(0)
    in_vocab = inverse[labels_full] >= 0
    from dspark.drafters.dspark import DSparkOutput

    out = DSparkOutput(
        hidden=torch.zeros(*shape, 1),
        parallel_logits=draft_logits,
        logits=draft_logits,
        confidence_logits=torch.randn(*shape, generator=g),
    )
    loss = compute_dspark_loss(
        out,
        labels=labels,
        label_valid=valid,
        target_probs=target_full[..., ids],
        label_in_vocab=in_vocab,
        alpha_ce=0.1,
        alpha_tv=0.9,
        alpha_conf=1.0,
        decay=4.0,
    )
    # brute force over the full vocabulary
    p_d_full = torch.zeros(*shape, VOCAB)
    p_d_full[..., ids] = torch.softmax(draft_logits, -1)
    l1 = (p_d_full - target_full).abs().sum(-1)
    accept = torch.minimum(p_d_full, target_full).sum(-1)
    torch.testing.assert_close(loss.c_star[valid], accept[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss.c_star[valid], (1 - 0.5 * l1)[valid], atol=1e-5, rtol=1e-5)
    w = torch.exp(-torch.arange(GAMMA, dtype=torch.float32) / 4.0).expand(shape)[valid]
    torch.testing.assert_close(loss.tv, (w * l1[valid]).sum() / w.sum(), atol=1e-5, rtol=1e-5)
    nll = -torch.log(p_d_full.gather(-1, labels_full.unsqueeze(-1)).squeeze(-1).clamp_min(1e-30))
    nll = torch.where(in_vocab, nll, 0.0)  # outside labels: no CE term (p_d is 0 there by construction)
    torch.testing.assert_close(loss.ce, (w * nll[valid]).sum() / w.sum(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("blocks", [2, 5])
def test_structured_block_attention_equals_the_dense_mask(blocks):
    g = torch.Generator().manual_seed(blocks)
    batch, heads, ctx, hd = 2, 3, 11, 8
    length = blocks * GAMMA
    q = torch.randn(batch, heads, length, hd, generator=g)
    k = torch.randn(batch, heads, ctx + length, hd, generator=g)
    v = torch.randn(batch, heads, ctx + length, hd, generator=g)
    anchors = torch.randint(0, ctx + 1, (batch, blocks), generator=g)
    valid = torch.ones(batch, ctx, dtype=torch.bool)
    valid[1, 7:] = False
    dense = create_block_mask(anchor_positions=anchors, context_valid=valid, block_size=GAMMA)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    before = torch.arange(ctx) < anchors.unsqueeze(-1)
    got = block_structured_attention(q, k, v, BlockMask(context_mask=before & valid.unsqueeze(1), block_size=GAMMA))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("blocks", [1, 6])  # 1: gathered positions; 6: N·γ > T, once per position then gathered
def test_target_distribution_is_the_exact_full_vocabulary_p_t_on_draft_ids(blocks):
    from types import SimpleNamespace

    from dspark.training.steps import target_distribution

    ids = torch.tensor([0, 3, 4, 9, 17, 30])
    drafter = _drafter(ids)
    g = torch.Generator().manual_seed(3)
    final_hidden = torch.randn(2, 9, D, generator=g)
    positions = torch.randint(0, 9, (2, blocks, GAMMA), generator=g)
    full = torch.softmax(drafter.lm_head(final_hidden), -1)  # [2, 9, V]
    expected = torch.stack([full[b, positions[b]] for b in range(2)])[..., ids]
    target = SimpleNamespace(lm_head=drafter.lm_head)
    online = target_distribution(drafter, target, {}, final_hidden, positions)
    cached = target_distribution(
        drafter, target, {"log_normalizer": torch.logsumexp(drafter.lm_head(final_hidden), -1)}, final_hidden, positions
    )
    for got in (online, cached):
        torch.testing.assert_close(got.probs, expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got.coverage, expected.sum(-1), atol=1e-6, rtol=1e-5)
    # the loss's supervised slots only: the same rows, in [select] order, and coverage still per slot
    select = torch.rand(positions.shape, generator=g) < 0.6
    selected = target_distribution(
        drafter,
        target,
        {"log_normalizer": torch.logsumexp(drafter.lm_head(final_hidden), -1)},
        final_hidden,
        positions,
        select=select,
    )
    torch.testing.assert_close(selected.probs, expected[select], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(selected.coverage, expected.sum(-1), atol=1e-6, rtol=1e-5)
