"""The ablation axes taken from DeepSpec / speculators: the gated Markov head, a confidence head without W_1,
and the D-PARD objective (values against hand computations, gradients, and lossless decoding after D-PARD training).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from dspark.config import RunConfig
from dspark.decoding import SpeculativeEngine, build_policy, build_proposer
from dspark.drafters.dspark import DSparkDrafter, DSparkOutput
from dspark.drafters.factory import build_drafter, drafter_spec_for
from dspark.drafters.heads import GatedMarkovHead
from dspark.drafters.layers import DraftLayerSpec
from dspark.losses import BLOCK_OBJECTIVES, compute_dpard_loss
from dspark.losses.dpard import dpard_position_weights, reach_weights, renyi_half
from dspark.targets import load_target
from lossless_checks import pit_values, uniformity_p_values

SPEC = DraftLayerSpec(
    hidden_size=16,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    intermediate_size=32,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    qk_norm=False,
    vocab_size=40,
)


# ---- gated head ----


def test_gated_bias_is_deepspec_formula_and_step_matches_teacher_forcing():
    torch.manual_seed(0)
    head = GatedMarkovHead(hidden_size=16, vocab_size=40, rank=6)
    with torch.no_grad():
        head.gate.bias.normal_()  # not the zero init, so the gate is not a constant ½
    hidden, prev = torch.randn(2, 3, 4, 16), torch.randint(0, 40, (2, 3, 4))
    e = head.w1.weight[prev]
    gate = torch.sigmoid(torch.cat([hidden, e], -1) @ head.gate.weight.T + head.gate.bias)
    expected = (gate * e) @ head.w2.weight.T
    assert torch.allclose(head.teacher_forced_bias(hidden, prev), expected, atol=1e-6)
    with torch.no_grad():
        stepped = torch.stack([head.step(hidden[..., k, :], prev[..., k], None)[0] for k in range(4)], dim=-2)
    assert torch.allclose(stepped, expected, atol=1e-5)
    assert torch.equal(head.prev_token_embedding(prev), e)  # the confidence input stays ungated, as DeepSpec's


def _drafter(head: str, *, with_markov: bool = True) -> DSparkDrafter:
    torch.manual_seed(1)
    return DSparkDrafter(
        spec=SPEC,
        num_feature_layers=2,
        depth=1,
        block_size=4,
        head=head,
        markov_rank=6,
        confidence=True,
        embed_tokens=torch.nn.Embedding(40, 16),
        lm_head=torch.nn.Linear(16, 40),
        mask_token_id=39,
        confidence_with_markov=with_markov,
    ).eval()


def test_confidence_without_markov_reads_h_only():
    with_w1, without = _drafter("markov"), _drafter("markov", with_markov=False)
    assert with_w1.confidence_head.proj.in_features == 16 + 6 and without.confidence_head.proj.in_features == 16
    hidden = torch.randn(3, 16)
    a, b = without.confidence(hidden, torch.tensor([1, 2, 3])), without.confidence(hidden, torch.tensor([7, 8, 9]))
    assert torch.equal(a, b)  # no dependence on x_{k-1}
    assert not torch.equal(
        with_w1.confidence(hidden, torch.tensor([1, 2, 3])), with_w1.confidence(hidden, torch.tensor([7, 8, 9]))
    )
    assert without.extra_config()["confidence_with_markov"] is False
    rebuilt = DSparkDrafter.from_extra_config(
        without.extra_config(), embed_tokens=without.embed_tokens, lm_head=without.lm_head
    )
    assert rebuilt.confidence_head.proj.in_features == 16


# ---- D-PARD ----


def test_dpard_weights_follow_the_dpace_recurrence_by_hand():
    a = torch.tensor([[[0.8, 0.5, 0.2, 0.9]]])
    valid = torch.tensor([[[True, True, True, False]]])
    s = [(1 - 0.5) * x + 0.5 for x in (0.8, 0.5, 0.2)]  # 0.9, 0.75, 0.6
    prefix = [s[0], s[0] * s[1], s[0] * s[1] * s[2]]
    expected = torch.tensor([[[sum(prefix), prefix[1] + prefix[2], prefix[2], 0.0]]])
    assert torch.allclose(dpard_position_weights(a, valid, alpha=0.5), expected)
    assert torch.allclose(reach_weights(a, valid), torch.tensor([[[1.0, 0.8, 0.4, 0.0]]]))
    assert torch.allclose(dpard_position_weights(a, valid, alpha=1.0), torch.tensor([[[3.0, 2.0, 1.0, 0.0]]]))
    with pytest.raises(ValueError, match="loss.dpard_alpha"):
        dpard_position_weights(a, valid, alpha=0.0)


def test_renyi_half_values():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.6, 0.3, 0.1]])
    got = renyi_half(torch.log(q), p)
    expected = torch.tensor([0.0, -2 * math.log(sum(math.sqrt(x * y) for x, y in zip(p[1], q[1])))])
    assert torch.allclose(got, expected, atol=1e-6)
    # a draft vocabulary: p_t sums to its covered mass, q is a distribution over the draft ids only
    covered = torch.tensor([[0.3, 0.3]])
    assert float(renyi_half(torch.log(torch.tensor([[0.5, 0.5]])), covered)) == pytest.approx(
        -2 * math.log(2 * math.sqrt(0.3 * 0.5))
    )


def _output(logits: torch.Tensor, confidence: torch.Tensor | None) -> DSparkOutput:
    return DSparkOutput(
        hidden=torch.zeros(*logits.shape[:-1], 4), parallel_logits=logits, logits=logits, confidence_logits=confidence
    )


def test_dpard_loss_value_gradient_and_registry():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 4, 10, requires_grad=True)
    conf = torch.randn(2, 3, 4, requires_grad=True)
    p_t = torch.softmax(torch.randn(2, 3, 4, 10), -1)
    valid = torch.ones(2, 3, 4, dtype=torch.bool)
    valid[0, 0, 2:] = False
    valid[1, 2] = False  # a block with no supervised slot does not count
    out = compute_dpard_loss(
        _output(logits, conf),
        label_valid=valid,
        target_probs=p_t,
        alpha_conf=1.0,
        dpard_alpha=0.5,
        labels=None,
        alpha_ce=0.1,
    )
    q = torch.softmax(logits.detach(), -1)
    a = torch.minimum(q, p_t).sum(-1) * valid
    w, r = dpard_position_weights(a, valid, alpha=0.5), reach_weights(a, valid)
    renyi = -2 * torch.log(torch.sqrt(p_t * q).sum(-1))
    bce = F.binary_cross_entropy_with_logits(conf.detach(), a, reduction="none")
    blocks = 5
    assert torch.allclose(out.renyi, (w * renyi)[valid].sum() / blocks, atol=1e-5)
    assert torch.allclose(out.conf, (r * bce)[valid].sum() / blocks, atol=1e-5)
    assert torch.allclose(out.total, out.renyi + out.conf) and torch.allclose(out.c_star, a, atol=1e-6)
    out.total.backward()
    assert logits.grad[~valid].abs().max() == 0 and logits.grad[valid].abs().max() > 0
    assert BLOCK_OBJECTIVES.resolve("dpard") is compute_dpard_loss
    with pytest.raises(ValueError, match="loss.kind"):
        BLOCK_OBJECTIVES.resolve("renyi")


def test_dpard_is_zero_when_the_draft_is_the_target():
    logits = torch.randn(1, 2, 3, 8)
    p_t = torch.softmax(logits, -1)
    out = compute_dpard_loss(
        _output(logits, None),
        label_valid=torch.ones(1, 2, 3, dtype=torch.bool),
        target_probs=p_t,
        alpha_conf=0.0,
        dpard_alpha=0.5,
    )
    assert abs(float(out.total)) < 1e-5 and torch.allclose(out.c_star, torch.ones(1, 2, 3))


# ---- config ----


def test_config_names_the_new_keys():
    from dspark.config import ConfigError, resolve_config

    rc = resolve_config(
        ["model.head=gated", "model.confidence_with_markov=false", "loss.kind=dpard", "loss.dpard_alpha=0.25"]
    )
    assert (rc.cfg.model.head, rc.cfg.model.confidence_with_markov, rc.cfg.loss.kind) == ("gated", False, "dpard")
    for argv, needle in (
        (["loss.kind=renyi"], "loss.kind"),
        (["loss.dpard_alpha=0"], "loss.dpard_alpha"),
        (["drafter=eagle3", "loss.kind=dpard"], "EAGLE-3"),
    ):
        with pytest.raises(ConfigError, match=needle):
            resolve_config(argv)


# ---- a D-PARD-trained gated drafter still decodes losslessly ----


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_target("tiny", cache_dir=tmp_path_factory.mktemp("targets"), seed=1)


@pytest.mark.slow
def test_dpard_trained_gated_drafter_decodes_losslessly(tiny, one_thread):
    from test_training_module import _batch

    from dspark.training.steps import dspark_step

    cfg = RunConfig()
    cfg.model.head, cfg.model.depth, cfg.model.markov_rank, cfg.model.block_size = "gated", 1, 16, 3
    torch.manual_seed(0)
    drafter = build_drafter(drafter_spec_for(kind="dspark", model_cfg=cfg.model, target=tiny), tiny)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    batch = _batch(tiny)
    for _ in range(6):
        result = dspark_step(
            drafter=drafter,
            target=tiny,
            batch=batch,
            block_size=3,
            alpha_ce=0.0,
            alpha_tv=0.0,
            alpha_conf=1.0,
            decay=4.0,
            kind="dpard",
            dpard_alpha=0.5,
        )
        optimizer.zero_grad()
        result.loss.total.backward()
        optimizer.step()
    with torch.no_grad():  # peaked drafts (as tests/test_lossless.py) so that rejections happen
        drafter.backbone.norm.weight.mul_(6.0)
    engine = SpeculativeEngine(
        target=tiny,
        proposer=build_proposer(drafter.eval()),
        policy=build_policy("threshold", threshold=0.5),
        temperature=1.0,
        max_new_tokens=4,
    )
    prompt = tiny.chat_prompt_ids("Tell me a story.")
    generator = torch.Generator().manual_seed(0)
    results = [engine.generate(prompt, generator=generator) for _ in range(300)]
    rounds = [r for res in results for r in res.rounds]
    assert any(r.num_accepted < r.num_verified for r in rounds)
    u = pit_values(tiny, prompt, [r.new_tokens for r in results], np.random.default_rng(0))[1:]
    p_values = uniformity_p_values({f"position {k + 2}": x for k, x in enumerate(u)} | {"pooled": np.concatenate(u)})
    assert min(p_values.values()) > 1e-3, p_values
