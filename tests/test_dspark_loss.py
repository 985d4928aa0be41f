"""DSpark loss (METHOD §3): terms against a per-slot python loop, gradient routing, and that training reduces it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from dspark.drafters import SEQUENTIAL_HEADS, DSparkDrafter, DSparkOutput, DraftLayerSpec
from dspark.losses import compute_dspark_loss, position_weights

VOCAB, D, M, GAMMA, MASK_ID = 97, 32, 2, 4, 96
ALPHAS = dict(alpha_ce=0.1, alpha_tv=0.9, alpha_conf=1.0)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread (tests/conftest.py)


def random_output(seed: int = 0, *, batch: int = 2, blocks: int = 3, vocab: int = 11) -> tuple[DSparkOutput, dict]:
    """Random logits/confidences and supervision with a contiguous valid prefix per block (some empty)."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, blocks, GAMMA)
    logits = (2 * torch.randn(*shape, vocab, generator=g)).requires_grad_()
    conf = torch.randn(*shape, generator=g).requires_grad_()
    out = DSparkOutput(hidden=torch.zeros(*shape, 4), parallel_logits=logits, logits=logits, confidence_logits=conf)
    lengths = torch.randint(0, GAMMA + 1, (batch, blocks), generator=g)
    lengths[0, 0] = GAMMA
    supervision = dict(
        labels=torch.randint(0, vocab, shape, generator=g),
        label_valid=torch.arange(GAMMA) < lengths.unsqueeze(-1),
        target_probs=torch.softmax(3 * torch.randn(*shape, vocab, generator=g), dim=-1),
    )
    return out, supervision


def brute_force_loss(
    out: DSparkOutput, sup: dict, *, decay: float, alpha_ce: float, alpha_tv: float, alpha_conf: float
) -> dict[str, float]:
    """Independent per-(sequence, block, slot) loop in float64."""
    sums = {"ce": 0.0, "tv": 0.0, "conf": 0.0}
    weight_total = 0.0
    batch, blocks, gamma = sup["labels"].shape
    for b in range(batch):
        for n in range(blocks):
            for k in range(1, gamma + 1):
                if not sup["label_valid"][b, n, k - 1]:
                    continue
                w = math.exp(-(k - 1) / decay)
                p_d = torch.softmax(out.logits[b, n, k - 1].double(), -1)
                p_t = sup["target_probs"][b, n, k - 1].double()
                l1 = sum(abs(p_d[v] - p_t[v]).item() for v in range(p_d.numel()))
                c_star = min(max(1 - l1 / 2, 0.0), 1.0)
                prob_c = 1 / (1 + math.exp(-out.confidence_logits[b, n, k - 1].item()))
                sums["ce"] += w * -math.log(p_d[sup["labels"][b, n, k - 1]].item())
                sums["tv"] += w * l1
                sums["conf"] += w * -(c_star * math.log(prob_c) + (1 - c_star) * math.log(1 - prob_c))
                weight_total += w
    terms = {key: value / weight_total for key, value in sums.items()}
    terms["total"] = alpha_ce * terms["ce"] + alpha_tv * terms["tv"] + alpha_conf * terms["conf"]
    return terms


@pytest.mark.parametrize("decay", [4.0, 1.5])
def test_terms_match_a_per_slot_loop(decay):
    out, sup = random_output()
    loss = compute_dspark_loss(out, **sup, **ALPHAS, decay=decay)
    expected = brute_force_loss(out, sup, decay=decay, **ALPHAS)
    for key in ("total", "ce", "tv", "conf"):
        assert getattr(loss, key).item() == pytest.approx(expected[key], rel=1e-5), key
    # c* = Σ_v min(p_d, p_t) on supervised slots, 0 elsewhere, detached.
    overlap = torch.minimum(torch.softmax(out.logits, -1), sup["target_probs"]).sum(-1)
    torch.testing.assert_close(loss.c_star, torch.where(sup["label_valid"], overlap, 0).detach(), atol=1e-6, rtol=0)
    assert not loss.c_star.requires_grad


def test_pooling_is_over_all_blocks_not_per_block():
    """Two blocks with 1 and 4 valid slots: a per-block mean would weigh the lone slot like four."""
    out, sup = random_output(batch=1, blocks=2)
    sup["label_valid"] = torch.tensor([[[True, False, False, False], [True, True, True, True]]])
    loss = compute_dspark_loss(out, **sup, alpha_ce=1.0, alpha_tv=0.0, alpha_conf=0.0, decay=4.0)
    nll = -torch.log_softmax(out.logits, -1).gather(-1, sup["labels"].unsqueeze(-1)).squeeze(-1)[0]
    w = position_weights(GAMMA, 4.0)
    pooled = (nll[0, 0] + (w * nll[1]).sum()) / (1 + w.sum())
    assert loss.ce.item() == pytest.approx(pooled.item(), rel=1e-6)


def test_target_logits_equal_target_probs():
    out, sup = random_output(1)
    logits_t = torch.log(sup.pop("target_probs")) + 0.7  # any shift: softmax is shift-invariant
    from_logits = compute_dspark_loss(out, **sup, target_logits=logits_t, **ALPHAS, decay=4.0)
    from_probs = compute_dspark_loss(out, **sup, target_probs=torch.softmax(logits_t, -1), **ALPHAS, decay=4.0)
    torch.testing.assert_close(from_logits.total, from_probs.total)


def test_zero_alphas_skip_terms_and_dflash_needs_no_target():
    out, sup = random_output(2)
    target = sup.pop("target_probs")
    dflash = compute_dspark_loss(
        dataclasses.replace(out, confidence_logits=None), **sup, alpha_ce=1.0, alpha_tv=0.0, alpha_conf=0.0, decay=4.0
    )
    assert dflash.c_star is None and dflash.tv.item() == 0 and dflash.conf.item() == 0
    assert dflash.total.item() == pytest.approx(dflash.ce.item())
    with_target = compute_dspark_loss(
        out, **sup, target_probs=target, alpha_ce=1.0, alpha_tv=0.0, alpha_conf=0.0, decay=4.0
    )
    assert with_target.c_star is not None and with_target.total.item() == pytest.approx(dflash.total.item())


@pytest.mark.parametrize(
    "change,match",
    [
        ({"alpha_conf": 1.0, "no_confidence": True}, r"loss\.alpha_conf"),
        ({"alpha_tv": 0.5, "no_target": True}, r"loss\.alpha_tv"),
        ({"alpha_ce": 0.0, "alpha_tv": 0.0, "alpha_conf": 0.0}, r"loss\.alpha_ce"),
        ({"alpha_ce": -1.0}, r"loss\.alpha_ce"),
        ({"decay": 0.0}, r"loss\.decay"),
    ],
)
def test_bad_loss_arguments_raise(change, match):
    out, sup = random_output(3)
    args = {**ALPHAS, "decay": 4.0, **change}
    if args.pop("no_confidence", False):
        out = dataclasses.replace(out, confidence_logits=None)
    if args.pop("no_target", False):
        sup.pop("target_probs")
    with pytest.raises(ValueError, match=match):
        compute_dspark_loss(out, **sup, **args)


def test_position_weights_and_empty_batch():
    torch.testing.assert_close(position_weights(3, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    out, sup = random_output(4)
    sup["label_valid"] = torch.zeros_like(sup["label_valid"])
    loss = compute_dspark_loss(out, **sup, **ALPHAS, decay=4.0)
    assert loss.total.item() == 0.0
    loss.total.backward()  # still attached to the graph
    assert out.logits.grad is not None and out.logits.grad.abs().sum() == 0


def tiny_drafter(head: str, *, seed: int = 0) -> DSparkDrafter:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        num_hidden_layers=4,
    )
    torch.manual_seed(seed)
    embed, lm_head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB, bias=False)
    return DSparkDrafter(
        spec=DraftLayerSpec.from_hf_config(config),
        num_feature_layers=M,
        depth=2,
        block_size=GAMMA,
        head=head,
        markov_rank=8,
        confidence=True,
        embed_tokens=embed,
        lm_head=lm_head,
        mask_token_id=MASK_ID,
    )


def training_batch(seed: int = 0) -> tuple[dict, dict]:
    """Blocks cut from one random sequence as the data module would (anchor, MASKs, shifted labels)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB - 1, (2, 24), generator=g)
    anchors = torch.tensor([[2, 8, 15], [4, 11, 19]])
    idx = anchors.unsqueeze(-1) + torch.arange(GAMMA)  # a+k-1 for k = 1..γ
    gather = lambda pos: torch.stack([seq[b][pos[b]] for b in range(2)])  # noqa: E731
    block_ids = torch.full(idx.shape, MASK_ID)
    block_ids[..., 0] = gather(anchors)
    inputs = dict(
        context_features=torch.randn(2, 24, M * D, generator=g),
        context_valid=torch.ones(2, 24, dtype=torch.bool),
        block_input_ids=block_ids,
        anchor_positions=anchors,
        prev_tokens=gather(idx),
    )
    labels = gather(idx + 1)
    target = torch.softmax(torch.randn(*labels.shape, VOCAB, generator=g), -1) * 0.3
    target = target + 0.7 * nn.functional.one_hot(labels, VOCAB)  # peaked on the label, like a real target
    return inputs, dict(labels=labels, label_valid=torch.ones_like(labels, dtype=torch.bool), target_probs=target)


@pytest.mark.parametrize("head", SEQUENTIAL_HEADS.ordered())
def test_gradients_reach_every_trained_part_and_no_frozen_one(head):
    drafter = tiny_drafter(head)
    inputs, sup = training_batch()
    compute_dspark_loss(drafter(**inputs), **sup, **ALPHAS, decay=4.0).total.backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert drafter.embed_tokens.weight.grad is None and drafter.lm_head.weight.grad is None


def test_confidence_loss_alone_trains_backbone_and_markov_embedding():
    """Only c* is detached: L_conf reaches h_k (backbone) and W_1, not W_2."""
    drafter = tiny_drafter("markov")
    inputs, sup = training_batch()
    loss = compute_dspark_loss(drafter(**inputs), **sup, alpha_ce=0.0, alpha_tv=0.0, alpha_conf=1.0, decay=4.0)
    loss.total.backward()
    assert drafter.backbone.fc.weight.grad.abs().sum() > 0 and drafter.head.w1.weight.grad.abs().sum() > 0
    assert drafter.head.w2.weight.grad is None or drafter.head.w2.weight.grad.abs().sum() == 0


@pytest.mark.parametrize("head", SEQUENTIAL_HEADS.ordered())
def test_a_few_optimizer_steps_reduce_the_loss(head):
    drafter = tiny_drafter(head, seed=1)
    inputs, sup = training_batch(1)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = compute_dspark_loss(drafter(**inputs), **sup, **ALPHAS, decay=4.0).total
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def plain_autograd_loss(
    out: DSparkOutput,
    sup: dict,
    *,
    alpha_ce: float,
    alpha_tv: float,
    alpha_conf: float,
    decay: float,
    label_in_vocab=None,
) -> torch.Tensor:
    """The objective written with autograd's own log_softmax / abs (the formula the fused row terms replace)."""
    valid = sup["label_valid"]
    w = position_weights(GAMMA, decay).expand(valid.shape)[valid]
    log_p = torch.log_softmax(out.logits[valid].float(), -1)
    p_t = sup["target_probs"][valid]
    nll = -log_p.gather(-1, sup["labels"][valid].unsqueeze(-1)).squeeze(-1)
    if label_in_vocab is not None:
        nll = torch.where(label_in_vocab[valid], nll, 0.0)
    l1 = (log_p.exp() - p_t).abs().sum(-1) + (1 - p_t.sum(-1)).clamp_min(0)
    bce = nn.functional.binary_cross_entropy_with_logits(
        out.confidence_logits[valid], (1 - 0.5 * l1.detach()).clamp(0, 1), reduction="none"
    )
    return (alpha_ce * (w * nll).sum() + alpha_tv * (w * l1).sum() + alpha_conf * (w * bce).sum()) / w.sum()


@pytest.mark.parametrize(
    "alphas",
    [
        ALPHAS,
        dict(alpha_ce=1.0, alpha_tv=0.0, alpha_conf=0.0),
        dict(alpha_ce=0.0, alpha_tv=1.0, alpha_conf=0.0),
        dict(alpha_ce=0.0, alpha_tv=0.0, alpha_conf=1.0),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fused_row_terms_give_autograds_gradients(alphas, dtype):
    """The hand-written backward of the L1 / CE terms equals autograd through the plain formula, for every α mix,
    with a draft vocabulary's partial p_t mass and labels outside it, and in the logits' own dtype (bf16 autocast)."""
    out, sup = random_output(5, blocks=4)
    sup["target_probs"] = sup["target_probs"] * 0.9  # p_t's mass outside the draft vocabulary: 0.1 per slot
    in_vocab = torch.rand(sup["labels"].shape, generator=torch.Generator().manual_seed(1)) > 0.2
    logits = out.logits.detach().to(dtype).requires_grad_()
    conf = out.confidence_logits.detach().clone().requires_grad_()
    fused = dataclasses.replace(out, logits=logits, parallel_logits=logits, confidence_logits=conf)
    loss = compute_dspark_loss(fused, **sup, label_in_vocab=in_vocab, **alphas, decay=4.0)
    if not loss.total.requires_grad:  # conf alone: only the confidence logits train
        assert alphas["alpha_conf"] > 0
    grads = torch.autograd.grad(loss.total, [logits, conf], allow_unused=True)
    ref_logits = out.logits.detach().to(dtype).double().requires_grad_()
    ref_conf = out.confidence_logits.detach().double().requires_grad_()
    ref_out = dataclasses.replace(out, logits=ref_logits, parallel_logits=ref_logits, confidence_logits=ref_conf)
    ref_sup = {**sup, "target_probs": sup["target_probs"].double()}
    reference = plain_autograd_loss(ref_out, ref_sup, label_in_vocab=in_vocab, **alphas, decay=4.0)
    ref_grads = torch.autograd.grad(reference, [ref_logits, ref_conf], allow_unused=True)
    assert loss.total.item() == pytest.approx(reference.item(), rel=1e-5)
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        if want is None or not want.abs().sum():
            assert got is None or not got.abs().sum()
        else:
            assert got.dtype == (dtype if got.shape == logits.shape else torch.float32)
            torch.testing.assert_close(got.double(), want, **tol)
    # the metrics' NLL rides along: −log p_d(label) on every supervised slot, detached
    expected_nll = -torch.log_softmax(logits.detach().float(), -1).gather(-1, sup["labels"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(loss.nll[sup["label_valid"]], expected_nll[sup["label_valid"]], atol=1e-5, rtol=1e-5)
    assert not loss.nll.requires_grad
