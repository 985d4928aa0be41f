"""One decoding vocabulary (issue 12) and the lean round (issue 11) on the tiny target:

- decode.policy=X and serve.policy=X on the same drafter, θ and calibration verify the same prefix lengths on the
  same confidences (X = threshold, calibrated_threshold, scheduler): one family, calibration in one place;
- the cached-context round (per-layer context keys/values extended only by committed positions) drafts exactly
  what a full recomputation from the raw features drafts, for a fixed seed, with and without a draft vocabulary;
- the drafter's precision: `auto` follows the AMX detection (never assumed), bf16 stays close to fp32.
"""

from __future__ import annotations

import pytest
import torch

from dspark.calibration.sts import STSCalibration
from dspark.decoding import DSparkProposer, SpeculativeEngine, build_policy
from dspark.decoding import drafting
from dspark.decoding.drafting import ParallelStage, resolve_precision
from dspark.scheduling import SPSTable
from dspark.serving import BatchedEngine, ServeRequest, build_serve_policy
from test_lossless import draft_vocab
from test_serving_lossless import build_test_drafter

GAMMA = 3
SPS = SPSTable(batch_tokens=list(range(1, 10)), steps_per_second=[1 / (1 + (b - 1) / 2) for b in range(1, 10)])
CALIBRATION = STSCalibration(temperatures=[2.0, 0.5, 1.0], grid=[0.5, 1.0, 2.0], n_bins=20, ece_before=[], ece_after=[])
TEXTS = ("What is 2+2?", "Hi", "Write a short poem about the sea and the wind, please.")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from dspark.targets import load_target

    target = load_target("tiny", cache_dir=tmp_path_factory.mktemp("cache"), seed=1)
    with torch.no_grad():
        target.model.get_decoder().norm.weight.mul_(12.0)
    target.stop_token_ids = []  # long generations: many rounds per prompt
    return target


@pytest.fixture(scope="module")
def prompts(target):
    return [target.chat_prompt_ids(text) for text in TEXTS]


@pytest.mark.parametrize("policy", ["threshold", "calibrated_threshold", "scheduler"])
def test_decode_and_serve_policies_verify_the_same_prefix_lengths(target, prompts, policy):
    """Greedy (deterministic drafts): the single-request engine and the batched one at R = 1 see the same raw
    confidences round by round and verify the same ℓ; the calibration changes what calibrated policies read."""
    drafter = build_test_drafter(target)
    single = SpeculativeEngine(
        target=target,
        proposer=DSparkProposer(drafter),
        policy=build_policy(policy, threshold=0.5, sps=SPS),
        temperature=0.0,
        max_new_tokens=24,
        calibration=CALIBRATION,
    )
    batched = BatchedEngine(
        target=target,
        drafter=drafter,
        policy=build_serve_policy(policy, threshold=0.5, sps=SPS),
        temperature=0.0,
        max_new_tokens=24,
        calibration=CALIBRATION,
    )
    lengths = set()
    for index, prompt in enumerate(prompts):
        solo = single.generate(prompt, generator=None)
        served = batched.serve(
            [ServeRequest(request_id=index, prompt_ids=prompt)], concurrency=1, seed=0, progress=False
        )
        rounds = [r for step in served.steps for r in step.rounds]
        assert served.requests[0].new_tokens == solo.new_tokens
        assert [r.num_verified for r in rounds] == [r.num_verified for r in solo.rounds]
        for mine, theirs in zip(solo.rounds, rounds):
            # The single engine stops drafting where threshold rules stop verifying; the verified prefix agrees.
            seen = mine.num_verified
            torch.testing.assert_close(torch.tensor(mine.confidences[:seen]), torch.tensor(theirs.confidences[:seen]))
            torch.testing.assert_close(torch.tensor(mine.calibrated[:seen]), torch.tensor(theirs.calibrated[:seen]))
        lengths |= {r.num_verified for r in solo.rounds}
    assert len(lengths) > 1  # the policy really decides per round


def test_threshold_reads_raw_and_calibrated_threshold_calibrated_confidences(target, prompts):
    """The same engine, θ and calibration: the two named behaviours differ, each equal to its rule on the record."""
    drafter = build_test_drafter(target)
    for name, field in (("threshold", "confidences"), ("calibrated_threshold", "calibrated")):
        engine = SpeculativeEngine(
            target=target,
            proposer=DSparkProposer(drafter),
            policy=build_policy(name, threshold=0.5),
            temperature=1.0,
            max_new_tokens=24,
            calibration=CALIBRATION,
        )
        for prompt in prompts:
            result = engine.generate(prompt, generator=torch.Generator().manual_seed(0))
            for r in result.rounds:
                values = getattr(r, field)
                expected = next((k for k, c in enumerate(values) if c < 0.5), len(values))
                assert r.num_verified == min(expected, len(r.drafts))


class FullRecomputation(DSparkProposer):
    """The reference: keeps the raw target features and recomputes the whole drafter context every round with the
    training-time forward (`DSparkBackbone.forward`: fusion, context keys/values and the block in one pass)."""

    def start(self, *, features, token_ids=None):
        self.features = features[:, :0]  # DSparkProposer.start extends with the prompt's features
        super().start(features=features, token_ids=token_ids)

    def extend(self, *, features, token_ids=None):
        self.features = torch.cat([self.features, features], dim=1)
        super().extend(features=features, token_ids=token_ids)

    def block_hidden(self, anchor_token, anchor_position):
        block = torch.full((1, 1, self.block_size), self.drafter.mask_token_id, dtype=torch.long)
        block[0, 0, 0] = anchor_token
        hidden = self.drafter.backbone(
            self.features, block_input_ids=block, anchor_positions=torch.tensor([[anchor_position]])
        )
        return hidden[0, 0]


@pytest.mark.parametrize("vocabulary", ["full", "draft"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_cached_context_round_drafts_what_a_full_recomputation_drafts(target, prompts, vocabulary, temperature):
    drafter = build_test_drafter(target, draft_vocab(target) if vocabulary == "draft" else None)
    engines = [
        SpeculativeEngine(
            target=target,
            proposer=proposer(drafter),
            policy=build_policy("fixed"),
            temperature=temperature,
            max_new_tokens=32,
        )
        for proposer in (DSparkProposer, FullRecomputation)
    ]
    rounds = 0
    for index, prompt in enumerate(prompts):
        cached, full = (engine.generate(prompt, generator=torch.Generator().manual_seed(index)) for engine in engines)
        assert [r.drafts for r in cached.rounds] == [r.drafts for r in full.rounds]
        assert cached.new_tokens == full.new_tokens
        rounds += len(cached.rounds)
    assert rounds > 20


def test_auto_precision_follows_the_detected_hardware(monkeypatch):
    monkeypatch.setattr(drafting, "cpu_has_fast_bf16", lambda: True)
    assert resolve_precision("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(drafting, "cpu_has_fast_bf16", lambda: False)
    assert resolve_precision("auto", "cpu") == torch.float32
    assert resolve_precision("fp32") == torch.float32 and resolve_precision("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match=r"decode\.drafter_precision='fp16'.*auto"):
        resolve_precision("fp16")
    assert resolve_precision("int8", "cpu") == torch.qint8
    with pytest.raises(ValueError, match=r"int8 runs on the CPU only"):
        resolve_precision("int8", "meta")


def test_int8_parallel_stage_is_a_close_quantised_copy_and_drafts_through_the_engine(target, prompts):
    """decode.drafter_precision=int8: the fusion, draft-layer and LM-head products become dynamic int8 copies (the
    drafter itself untouched); U_k stays close to the fp32 one, the cached keys/values stay fp32, and a proposer on
    it drafts through the engine (its losslessness: tests/test_lossless.py)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    drafter = build_test_drafter(target, draft_vocab(target))
    before = {name: p.clone() for name, p in drafter.named_parameters()}
    stage = ParallelStage(drafter, torch.qint8)
    quantised = [m for m in stage.backbone.modules() if isinstance(m, DynamicLinear)]
    # fc + per layer the fused [q; k; v], [k; v] (context rows), o, [gate; up] and down products
    assert len(quantised) == 1 + 5 * len(drafter.backbone.layers)
    assert not any(isinstance(m, torch.nn.Linear) for m in stage.backbone.modules())
    assert all(torch.equal(p, before[name]) for name, p in drafter.named_parameters())
    assert stage.activation_dtype == torch.float32 and stage.backbone.embed_tokens is drafter.backbone.embed_tokens
    hidden = torch.randn(4, target.hidden_size)
    reference, logits = drafter.project(hidden), stage.logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (4, 256)
    assert (logits - reference).abs().max() < 0.05 * reference.abs().max()
    proposer = DSparkProposer(drafter, precision="int8")
    engine = SpeculativeEngine(
        target=target, proposer=proposer, policy=build_policy("fixed"), temperature=1.0, max_new_tokens=12
    )
    result = engine.generate(prompts[0], generator=torch.Generator().manual_seed(0))
    assert len(result.new_tokens) == 12 and all(len(r.drafts) > 0 for r in result.rounds[:-1])
    assert proposer._keys[0].view().dtype == torch.float32
    # the batched serving proposer on the same int8 stage: greedy output is the target's own (lossless at T = 0)
    plain = SpeculativeEngine(target=target, proposer=None, policy=None, temperature=0.0, max_new_tokens=12)
    served = BatchedEngine(
        target=target,
        drafter=drafter,
        policy=build_serve_policy("fixed"),
        temperature=0.0,
        max_new_tokens=12,
        precision="int8",
    )
    result = served.serve(
        [ServeRequest(request_id=i, prompt_ids=p) for i, p in enumerate(prompts[:2])],
        concurrency=2,
        seed=0,
        progress=False,
    )
    assert [r.new_tokens for r in result.requests] == [
        plain.generate(p, generator=None).new_tokens for p in prompts[:2]
    ]
    assert served.proposer.dtype == torch.float32
    assert any(r.num_verified > 0 for step in result.steps for r in step.rounds)


def test_bf16_parallel_stage_is_a_close_copy_and_leaves_the_drafter_alone(target):
    drafter = build_test_drafter(target, draft_vocab(target))
    before = {name: p.clone() for name, p in drafter.named_parameters()}
    stage = ParallelStage(drafter, torch.bfloat16)
    assert stage.backbone is not drafter.backbone and stage.backbone.embed_tokens is drafter.backbone.embed_tokens
    assert all(p.dtype == torch.float32 for p in drafter.parameters())
    assert all(torch.equal(p, before[name]) for name, p in drafter.named_parameters())
    hidden = torch.randn(4, target.hidden_size)
    reference = drafter.project(hidden)
    logits = stage.logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (4, 256)
    assert (logits - reference).abs().max() < 0.02 * reference.abs().max()


def test_markov_bias_table_equals_the_product_and_falls_back_outside_the_set():
    """The decode-time bias table (heads.BiasTable) returns W_2 W_1[x] for tabulated previous tokens, the plain
    product for others (the anchor may lie outside the draft vocabulary), is rebuilt when the weights change and
    is never used under autograd."""
    from dspark.drafters.heads import MarkovHead

    torch.manual_seed(0)
    head = MarkovHead(hidden_size=8, vocab_size=50, rank=4, output_size=12)
    ids = torch.tensor([1, 3, 5, 7, 40])
    assert head.enable_bias_table(ids)
    with torch.no_grad():
        inside = torch.tensor([3, 40])
        expected = head.w2(head.w1(inside))
        torch.testing.assert_close(head.step(None, inside, None)[0], expected)
        outside = torch.tensor([3, 2])  # one row outside the set: the product for the whole batch
        torch.testing.assert_close(head.step(None, outside, None)[0], head.w2(head.w1(outside)))
        for token in (3, 40):  # one previous token (the single-request loop): a row of the table, shaped [1, Vd]
            single = torch.tensor([token])
            torch.testing.assert_close(head.step(None, single, None)[0], head.w2(head.w1(single)))
        assert head._table.lookup(head, torch.tensor([2])) is None  # outside the set: the caller falls back
        torch.testing.assert_close(head.step(None, torch.tensor([2]), None)[0], head.w2(head.w1(torch.tensor([2]))))
        head.w2.weight.mul_(2.0)  # a weight change invalidates the table
        torch.testing.assert_close(head.step(None, inside, None)[0], head.w2(head.w1(inside)))
        torch.testing.assert_close(head.step(None, torch.tensor([5]), None)[0], head.w2(head.w1(torch.tensor([5]))))
    bias = head.step(None, inside, None)[0]
    assert bias.requires_grad  # under autograd: the trainable product, not a table row
    assert not head.enable_bias_table(None) and not head.enable_bias_table(torch.arange(20000))


@pytest.mark.parametrize("dtype", [torch.float32, torch.qint8, torch.bfloat16])
def test_fused_projections_of_a_decode_copy_give_the_separate_products(target, dtype):
    """`ParallelStage` fuses q/k/v, k/v and gate/up of its copy into one product each: the block's hidden states and
    the cached context keys/values equal those of the same copy unfused (int8: bit for bit — the activation scale
    is per call and the input shared; fp32/bf16 up to the kernels' blocking)."""
    import copy

    from dspark.drafters.backbone import DraftDecoderLayer

    drafter = build_test_drafter(target, draft_vocab(target))
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in drafter.backbone.layers:  # weights away from the init, so that a mix-up would show
            for parameter in layer.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
    stage = ParallelStage(drafter, torch.float32 if dtype == torch.float32 else dtype)
    fused_backbone = stage.backbone if dtype != torch.float32 else copy.deepcopy(drafter.backbone)
    if dtype == torch.float32:
        for layer in fused_backbone.layers:
            layer.fuse_projections()
    unfused = copy.deepcopy(drafter.backbone)
    if dtype == torch.qint8:
        unfused = drafting.quantize_linears(unfused)
    elif dtype == torch.bfloat16:
        unfused = unfused.to(torch.bfloat16)
        unfused.rotary.float()
    assert all(layer.self_attn.q_proj is None and layer.mlp.gate_proj is None for layer in fused_backbone.layers)
    assert all(isinstance(layer, DraftDecoderLayer) and layer.self_attn.qkv_proj is None for layer in unfused.layers)
    act = torch.float32 if dtype in (torch.float32, torch.qint8) else dtype
    context = torch.randn(1, 9, target.hidden_size).to(act)
    block = torch.randn(1, GAMMA, target.hidden_size).to(act)
    rope_ctx = fused_backbone.rotary(torch.arange(9).unsqueeze(0))
    rope_blk = fused_backbone.rotary(torch.arange(9, 9 + GAMMA).unsqueeze(0))
    outputs = []
    with torch.no_grad():
        for backbone in (fused_backbone, unfused):
            layer = backbone.layers[0]
            keys, values = layer.context_kv(context, rope_ctx)

            def extend(k, v, keys=keys, values=values):
                return torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)

            outputs.append((keys, values, layer.forward_cached(block, rope=rope_blk, extend_kv=extend)))
    for fused_out, separate_out in zip(*outputs):
        if dtype == torch.qint8:
            assert torch.equal(fused_out, separate_out)
        else:
            torch.testing.assert_close(
                fused_out,
                separate_out,
                atol=1e-5 if dtype == torch.float32 else 2e-2,
                rtol=1e-5 if dtype == torch.float32 else 2e-2,
            )
