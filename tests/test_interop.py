"""Checkpoint interop: export -> import round trips on tiny Llama- and Qwen3-shaped targets, the exported names and
config fields pinned against the reference code, and the errors for a drafter that does not fit its target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.config.schema import FIXED_HEAD
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.policies import build_policy
from dspark.decoding.proposers import build_proposer
from dspark.drafters.factory import DRAFTER_BUILDERS, DrafterSpec, build_drafter
from dspark.drafters.heads import SEQUENTIAL_HEADS
from dspark.interop import export_drafter, import_drafter
from dspark.interop.layouts import (
    ARCHITECTURES,
    DRAFTER_REFUSALS,
    HEAD_REFUSALS,
    HEAD_TO_MARKOV_TYPE,
    LAYOUTS,
    NAME_MAPS,
    NO_HEAD,
    markov_head_type,
)
from dspark.targets import load_target


@pytest.fixture(scope="module")
def targets(tiny_qwen3_dir, tmp_path_factory):
    """{"llama": the built-in tiny Llama, "qwen3": the same shape as a random Qwen3 (q/k norms)}."""
    cache = tmp_path_factory.mktemp("interop-cache")
    qwen_dir = tiny_qwen3_dir
    return {"llama": load_target("tiny", cache_dir=cache), "qwen3": load_target(str(qwen_dir), cache_dir=cache)}


def make_drafter(
    target,
    *,
    kind: str,
    head: str = "markov",
    rank: int = 8,
    depth: int = 2,
    block_size: int = 4,
    seed: int = 0,
    draft_vocab: int = 0,
    confidence_with_markov: bool = True,
):
    """A drafter with every weight random (norms and biases too, so a swapped or dropped tensor shows);
    `draft_vocab` > 0: a draft vocabulary of that many (every third, spread out) target ids."""
    spec = DrafterSpec(
        kind=kind,
        head=head if kind == "dspark" else "none",
        depth=depth,
        block_size=block_size,
        markov_rank=rank if kind == "dspark" and head != "none" else 0,
        feature_layers=tuple(target.feature_layer_ids),
        mask_token_id=target.mask_token_id,
        target_fingerprint=target.fingerprint,
        draft_vocab_size=draft_vocab,
        confidence_with_markov=confidence_with_markov,
    )
    ids = torch.arange(0, target.vocab_size, 3)[:draft_vocab] if draft_vocab else None
    drafter = build_drafter(spec, target, draft_vocab_ids=ids)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return drafter.eval(), spec


def decode(target, drafter, *, prompt: list[int], seed: int = 7, temperature: float = 1.0) -> list[int]:
    engine = SpeculativeEngine(
        target=target,
        proposer=build_proposer(drafter),
        policy=build_policy("fixed"),
        temperature=temperature,
        max_new_tokens=24,
    )
    return engine.generate(prompt, generator=torch.Generator().manual_seed(seed)).new_tokens


def dspark_outputs(drafter, target, *, seed: int = 1):
    """Teacher-forced outputs on random inputs (2 sequences, 3 blocks)."""
    g = torch.Generator().manual_seed(seed)
    d, m, gamma = target.hidden_size, len(target.feature_layer_ids), drafter.block_size
    ids = torch.randint(0, target.vocab_size, (2, 3, gamma), generator=g)
    ids[..., 1:] = drafter.mask_token_id
    with torch.no_grad():
        return drafter(
            context_features=torch.randn(2, 20, m * d, generator=g),
            context_valid=torch.ones(2, 20).bool(),
            block_input_ids=ids,
            anchor_positions=torch.tensor([[3, 9, 15], [5, 11, 19]]),
            prev_tokens=torch.randint(0, target.vocab_size, (2, 3, gamma), generator=g),
        )


# Drafter kinds whose round trip another test covers (a different forward signature).
ROUND_TRIP_ELSEWHERE = {"eagle3": "test_eagle3_round_trip_is_bit_identical"}


def exported_variants() -> list[tuple[str, str]]:
    """(kind, head) of every registered drafter, with every registered head that no layout refuses for a kind whose
    head `model.head` chooses: a new head or kind is round-tripped with no edit, and one without an export mapping
    fails there with the error naming the map to extend (tests/test_registry_coverage.py checks this)."""
    out = []
    for kind in (k for k in DRAFTER_BUILDERS.ordered() if k not in ROUND_TRIP_ELSEWHERE):
        fixed = FIXED_HEAD.get(kind)
        heads = (
            [fixed]
            if fixed is not None
            else [h for h in SEQUENTIAL_HEADS.ordered() if h != NO_HEAD and h not in HEAD_REFUSALS]
        )
        out += [(kind, head) for head in heads]
    return out


def round_trip_cases() -> list[tuple[str, str, str, str]]:
    """(target family, layout, kind, head): every exported variant on a Llama- and a Qwen3-shaped target in the
    deepspec layout and on Qwen3 in the speculators one (whose DSpark layers are Qwen3's), plus a confidence head
    that reads h_k only."""
    cases = [
        (family, layout, kind, head)
        for family, layout in (("llama", "deepspec"), ("qwen3", "deepspec"), ("qwen3", "speculators"))
        for kind, head in exported_variants()
    ]
    return cases + [("qwen3", "deepspec", "dspark", "markov-conf-no-markov")]


CASES = round_trip_cases()


@pytest.mark.parametrize("family, layout, kind, head", CASES, ids=["-".join(c) for c in CASES])
def test_dspark_round_trip_is_bit_identical(targets, tmp_path, one_thread, family, layout, kind, head):
    target = targets[family]
    with_markov = not head.endswith("-conf-no-markov")
    drafter, spec = make_drafter(target, kind=kind, head=head.split("-")[0], confidence_with_markov=with_markov)
    export_drafter(drafter, spec, target, tmp_path / "out", layout=layout)
    imported, imported_spec = import_drafter(tmp_path / "out", target, block_size=spec.block_size)
    assert imported_spec == spec
    before, after = dspark_outputs(drafter, target), dspark_outputs(imported, target)
    assert torch.equal(before.logits, after.logits) and torch.equal(before.parallel_logits, after.parallel_logits)
    if before.confidence_logits is None:
        assert after.confidence_logits is None
    else:
        assert torch.equal(before.confidence_logits, after.confidence_logits)
    prompt = target.chat_prompt_ids("Count to five.")
    assert decode(target, drafter, prompt=prompt) == decode(target, imported, prompt=prompt)
    for a, b in zip(drafter.state_dict().values(), imported.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout, kind", [("deepspec", "dspark"), ("speculators", "dspark"), ("speculators", "eagle3")])
def test_draft_vocabulary_round_trip(targets, tmp_path, one_thread, layout, kind):
    """Vd < V: lm_head holds the draft rows, d2t the offsets (target id = j + d2t[j]), t2d the mask."""
    target = targets["qwen3"]
    drafter, spec = make_drafter(target, kind=kind, depth=1 if kind == "eagle3" else 2, draft_vocab=40)
    export_drafter(drafter, spec, target, tmp_path, layout=layout)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    ids = drafter.draft_to_target
    assert torch.equal(torch.arange(40) + tensors["d2t"], ids) and torch.equal(tensors["t2d"].nonzero().flatten(), ids)
    assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight.detach()[ids])
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 40
    imported, imported_spec = import_drafter(tmp_path, target)
    assert imported_spec == spec and torch.equal(imported.draft_to_target, ids)
    prompt = target.chat_prompt_ids("Say hi.")
    assert decode(target, drafter, prompt=prompt) == decode(target, imported, prompt=prompt)


@pytest.mark.parametrize("family, layout", [("llama", "speculators"), ("qwen3", "speculators"), ("qwen3", "deepspec")])
def test_eagle3_round_trip_is_bit_identical(targets, tmp_path, one_thread, family, layout):
    target = targets[family]
    drafter, spec = make_drafter(target, kind="eagle3", depth=1)  # EAGLE-3 is one layer; the spec's depth unused
    export_drafter(drafter, spec, target, tmp_path / "out", layout=layout)
    imported, imported_spec = import_drafter(tmp_path / "out", target, block_size=spec.block_size)
    assert imported_spec == spec
    g = torch.Generator().manual_seed(2)
    features = torch.randn(2, 12, len(target.feature_layer_ids) * target.hidden_size, generator=g)
    ids = torch.randint(0, target.vocab_size, (2, 12), generator=g)
    with torch.no_grad():
        a = drafter(features=features, input_ids=ids, attention_mask=torch.ones(2, 12))
        b = imported(features=features, input_ids=ids, attention_mask=torch.ones(2, 12))
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    prompt = target.chat_prompt_ids("Name a colour.")
    assert decode(target, drafter, prompt=prompt) == decode(target, imported, prompt=prompt)


def test_bfloat16_export_loads_and_decodes(targets, tmp_path, one_thread):
    """A serving-size bf16 export passes the embedding check (rounding only) and drafts close to the fp32 one."""
    target = targets["qwen3"]
    drafter, spec = make_drafter(target, kind="dspark")
    export_drafter(drafter, spec, target, tmp_path / "bf16", dtype="bfloat16")
    imported, _ = import_drafter(tmp_path / "bf16", target)
    before, after = dspark_outputs(drafter, target), dspark_outputs(imported, target)
    assert torch.allclose(before.logits, after.logits, atol=0.5, rtol=0.05)


# ---- names and config fields, pinned against the reference code ----

# deepseek-ai/DeepSpec @ afdfa7c: deepspec/modeling/dspark/qwen3/modeling.py (Qwen3DSparkModel, Qwen3DSparkAttention,
# Qwen3DSparkDecoderLayer: embed_tokens, layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
# post_attention_layernorm, mlp.{gate,up,down}_proj}, norm, fc, hidden_norm, lm_head), markov_head.py (VanillaMarkov:
# markov_w1, markov_w2; GatedMarkovHead: gate_proj; RNNHead: joint_proj), common.py (AcceptRatePredictor: proj).
# The same names are read by vLLM vllm/model_executor/models/qwen3_dspark.py (markov_head.markov_w1/w2,
# confidence_head.proj) and written by vllm-project/speculators src/speculators/models/dspark/model_definitions.py.
DEEPSPEC_LAYER_NAMES = [
    "layers.{i}.input_layernorm.weight",
    "layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.self_attn.k_norm.weight",
    "layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.up_proj.weight",
    "layers.{i}.mlp.down_proj.weight",
]
DEEPSPEC_TOP_NAMES = ["embed_tokens.weight", "norm.weight", "fc.weight", "hidden_norm.weight", "lm_head.weight"]
DEEPSPEC_HEAD_NAMES = {
    "markov": ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"],
    "gated": [
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "markov_head.gate_proj.weight",
        "markov_head.gate_proj.bias",
    ],
    "rnn": [
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "markov_head.joint_proj.weight",
        "markov_head.joint_proj.bias",
    ],
}
CONFIDENCE_NAMES = ["confidence_head.proj.weight", "confidence_head.proj.bias"]
# deepseek-ai/DeepSpec deepspec/modeling/dspark/qwen3/config.py build_draft_config (and the asserts of
# Qwen3DSparkModel.__init__): the fields a DeepSpec DSpark config adds to the target's config.
DEEPSPEC_CONFIG_FIELDS = [
    "architectures",
    "num_target_layers",
    "num_hidden_layers",
    "block_size",
    "tie_word_embeddings",
    "layer_types",
    "mask_token_id",
    "target_layer_ids",
    "num_anchors",
    "enable_confidence_head",
    "markov_rank",
]
# vllm-project/speculators @ c05b95b: src/speculators/models/dflash/config.py (DFlashSpeculatorConfig),
# src/speculators/models/dspark/config.py (DSparkSpeculatorConfig), src/speculators/config.py (SpeculatorModelConfig,
# SpeculatorsConfig, VerifierConfig), src/speculators/proposals/greedy.py (GreedyTokenProposalConfig).
SPECULATORS_DSPARK_FIELDS = [
    "speculators_model_type",
    "speculators_version",
    "speculators_config",
    "architectures",
    "transformer_layer_config",
    "draft_vocab_size",
    "block_size",
    "target_hidden_size",
    "aux_hidden_state_layer_ids",
    "mask_token_id",
    "sliding_window_non_causal",
    "sample_from_anchor",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
]
SPECULATORS_CONFIG_FIELDS = ["algorithm", "proposal_methods", "default_proposal_method", "verifier"]
# src/speculators/models/eagle3/{config,core,model_definitions}.py: Eagle3SpeculatorConfig fields and the
# Eagle3DraftModel tensors (embed_tokens, fc, layers.0 = the first-layer variant with hidden_norm, norm, lm_head).
SPECULATORS_EAGLE3_FIELDS = [
    "speculators_model_type",
    "speculators_version",
    "speculators_config",
    "architectures",
    "transformer_layer_config",
    "draft_vocab_size",
    "norm_before_residual",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "embed_requires_grad",
]
EAGLE3_NAMES = [
    "embed_tokens.weight",
    "fc.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.hidden_norm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.self_attn.q_norm.weight",
    "layers.0.self_attn.k_norm.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
]


def _expected_dspark_names(head: str, depth: int, *, confidence: bool) -> set[str]:
    names = set(DEEPSPEC_TOP_NAMES) | {n.format(i=i) for i in range(depth) for n in DEEPSPEC_LAYER_NAMES}
    return names | set(DEEPSPEC_HEAD_NAMES.get(head, [])) | (set(CONFIDENCE_NAMES) if confidence else set())


# DeepSpec markov_head.py: the `markov_head_type` of each of its heads (VanillaMarkov is "vanilla").
REFERENCE_MARKOV_TYPES = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}


@pytest.mark.parametrize("kind, head", exported_variants())
def test_deepspec_names_and_fields_match_the_reference(targets, tmp_path, kind, head):
    assert head == NO_HEAD or head in DEEPSPEC_HEAD_NAMES and head in REFERENCE_MARKOV_TYPES, (
        f"model.head={head!r}: add its reference tensor names to DEEPSPEC_HEAD_NAMES and its markov_head_type to "
        "REFERENCE_MARKOV_TYPES (tests/test_interop.py), from the reference code"
    )
    target = targets["qwen3"]
    drafter, spec = make_drafter(target, kind=kind, head=head, depth=3)
    export_drafter(drafter, spec, target, tmp_path, layout="deepspec")
    assert set(load_file(str(tmp_path / "model.safetensors"))) == _expected_dspark_names(
        head, 3, confidence=kind == "dspark"
    )
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(DEEPSPEC_CONFIG_FIELDS) <= set(config)
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 3 and config["num_target_layers"] == target.num_layers
    assert config["block_size"] == spec.block_size and config["mask_token_id"] == spec.mask_token_id
    assert config["target_layer_ids"] == list(target.feature_layer_ids)  # hidden_states[id + 1] (common.py)
    assert config["layer_types"] == ["full_attention"] * 3 and config["tie_word_embeddings"] is False
    if kind == "dspark":
        assert config["markov_rank"] == 8 and config["enable_confidence_head"] is True
        assert config["markov_head_type"] == REFERENCE_MARKOV_TYPES[head]
        assert config["confidence_head_with_markov"] is True
    else:  # DeepSpec config/dflash/*.py: markov_rank=0, confidence_head_alpha=0 -> enable_confidence_head False
        assert config["markov_rank"] == 0 and config["enable_confidence_head"] is False
        assert "markov_head_type" not in config and "confidence_head_with_markov" not in config


def test_speculators_names_and_fields_match_the_reference(targets, tmp_path):
    target = targets["qwen3"]
    drafter, spec = make_drafter(target, kind="dspark", depth=2)
    export_drafter(drafter, spec, target, tmp_path / "dspark", layout="speculators")
    assert set(load_file(str(tmp_path / "dspark" / "model.safetensors"))) == _expected_dspark_names(
        "markov", 2, confidence=True
    )
    config = json.loads((tmp_path / "dspark" / "config.json").read_text())
    assert set(SPECULATORS_DSPARK_FIELDS) <= set(config)
    assert set(SPECULATORS_CONFIG_FIELDS) <= set(config["speculators_config"])
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkSpeculator"]
    # speculators ids index hidden_states directly (convert/dflash/converter.py: z-lab id + 1)
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in target.feature_layer_ids]
    assert config["sample_from_anchor"] is True and config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert config["speculators_config"]["proposal_methods"][0] == {
        "proposal_type": "greedy",
        "speculative_tokens": spec.block_size,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    eagle, eagle_spec = make_drafter(target, kind="eagle3")
    export_drafter(eagle, eagle_spec, target, tmp_path / "eagle3", layout="speculators")
    assert set(load_file(str(tmp_path / "eagle3" / "model.safetensors"))) == set(EAGLE3_NAMES)
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert set(SPECULATORS_EAGLE3_FIELDS) <= set(config) and config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in target.feature_layer_ids]


# deepseek-ai/DeepSpec deepspec/modeling/eagle3/qwen3/config.py build_draft_config and modeling.py Qwen3Eagle3Model
# (embed_tokens, fc, layers.{i}.{hidden_norm, input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}, norm,
# lm_head): the same tensor names as speculators' EAGLE-3, full vocabulary, DeepSpec's target_layer_ids convention.
DEEPSPEC_EAGLE3_FIELDS = [
    "architectures",
    "num_target_layers",
    "num_hidden_layers",
    "layer_types",
    "target_model_name_or_path",
    "target_layer_ids",
    "ttt_length",
    "step_loss_decay",
    "draft_num_hidden_layers",
    "tie_word_embeddings",
]


def test_deepspec_eagle3_names_and_fields_match_the_reference(targets, tmp_path):
    target = targets["qwen3"]
    eagle, spec = make_drafter(target, kind="eagle3", depth=1)
    export_drafter(eagle, spec, target, tmp_path, layout="deepspec")
    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(EAGLE3_NAMES)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(DEEPSPEC_EAGLE3_FIELDS) <= set(config) and config["architectures"] == ["Qwen3Eagle3Model"]
    assert config["ttt_length"] == spec.block_size and config["target_layer_ids"] == list(target.feature_layer_ids)
    assert config["num_hidden_layers"] == config["draft_num_hidden_layers"] == 1


def test_mask_embedding_is_the_mask_row_of_embed_tokens(targets, tmp_path):
    target = targets["llama"]
    drafter, spec = make_drafter(target, kind="dspark")
    export_drafter(drafter, spec, target, tmp_path)
    embed = load_file(str(tmp_path / "model.safetensors"))["embed_tokens.weight"]
    assert torch.equal(embed[spec.mask_token_id], drafter.backbone.mask_embedding.detach())
    others = torch.ones(target.vocab_size, dtype=torch.bool)
    others[spec.mask_token_id] = False
    assert torch.equal(embed[others], target.embed_tokens.weight.detach()[others])


# ---- every registered head and drafter has an exported form or a named refusal ----


def export_gaps(heads: list[str], kinds: list[str]) -> list[str]:
    """What `heads` / drafter `kinds` lack in dspark.interop.layouts, one message per missing piece."""
    gaps = [
        f"model.head={head!r} has no markov_head_type in interop.layouts.HEAD_TO_MARKOV_TYPE for the {layout} "
        "layout and no refusal in HEAD_REFUSALS"
        for head in heads
        for layout in LAYOUTS
        if head != NO_HEAD and head not in HEAD_TO_MARKOV_TYPE and head not in HEAD_REFUSALS
    ]
    return gaps + [
        f"drafter={kind!r} has no tensor-name map (interop.layouts.NAME_MAPS) or {layout} architecture "
        f"(interop.layouts.ARCHITECTURES[{layout!r}]) and no refusal in DRAFTER_REFUSALS"
        for kind in kinds
        for layout in LAYOUTS
        if (kind, layout) not in DRAFTER_REFUSALS and (kind not in NAME_MAPS or kind not in ARCHITECTURES[layout])
    ]


@pytest.mark.parametrize("head", SEQUENTIAL_HEADS.ordered())
def test_every_registered_head_has_an_export_mapping_or_a_refusal_naming_the_layout(head):
    assert not export_gaps([head], []), export_gaps([head], [])
    for layout in LAYOUTS:
        if head in HEAD_REFUSALS:
            with pytest.raises(ValueError, match=f"export.layout={layout}: model.head='{head}' cannot be represented"):
                markov_head_type(head, layout=layout)
        else:
            assert markov_head_type(head, layout=layout) == HEAD_TO_MARKOV_TYPE.get(head)


@pytest.mark.parametrize("kind", DRAFTER_BUILDERS.ordered())
def test_every_registered_drafter_has_an_exported_form_or_a_refusal(kind):
    assert not export_gaps([], [kind]), export_gaps([], [kind])


# ---- what cannot be represented, and target/drafter disagreements ----


def test_unrepresentable_exports_are_refused(targets, tmp_path):
    llama = targets["llama"]
    drafter, spec = make_drafter(llama, kind="dspark")
    with pytest.raises(ValueError, match="Llama-shaped target cannot be represented.*export.layout=deepspec"):
        export_drafter(drafter, spec, llama, tmp_path, layout="speculators")
    eagle, eagle_spec = make_drafter(llama, kind="eagle3", draft_vocab=40)
    with pytest.raises(ValueError, match="full vocabulary.*export.layout=speculators"):
        export_drafter(eagle, eagle_spec, llama, tmp_path, layout="deepspec")
    with pytest.raises(ValueError, match="export.layout='vllm' is not one of"):
        export_drafter(drafter, spec, llama, tmp_path, layout="vllm")


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_disagreements_with_the_target_are_named(targets, tmp_path):
    llama, qwen = targets["llama"], targets["qwen3"]
    drafter, spec = make_drafter(llama, kind="dspark")
    out = tmp_path / "out"
    export_drafter(drafter, spec, llama, out)
    with pytest.raises(ValueError, match="block_size=4.*model.block_size=7; set model.block_size=4"):
        import_drafter(out, llama, block_size=7)
    with pytest.raises(ValueError, match="Llama-shaped|q/k norm"):
        import_drafter(out, qwen)
    _edit_config(out, target_layer_ids=[0, 2, 4, 6, 7])
    with pytest.raises(ValueError, match=r"reads target layers \[0, 2, 4, 6, 7\].*set model.feature_layers"):
        import_drafter(out, llama)
    _edit_config(out, target_layer_ids=list(llama.feature_layer_ids), hidden_size=128)
    # the weights still hold 64-wide layers: refused from the header, before the target is compared
    with pytest.raises(ValueError, match=r"`hidden_size` is 128 but .*model.safetensors holds"):
        import_drafter(out, llama)
    _edit_config(out, hidden_size=64, vocab_size=llama.vocab_size + 1)
    with pytest.raises(ValueError, match="vocabulary size"):
        import_drafter(out, llama)
    _edit_config(out, vocab_size=llama.vocab_size, num_target_layers=12)
    with pytest.raises(ValueError, match="12-layer target"):
        import_drafter(out, llama)
    _edit_config(out, num_target_layers=llama.num_layers)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"] + 0.5
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="embed_tokens.weight differs from target 'tiny'.*another target"):
        import_drafter(out, llama)


def test_official_deepspec_options_we_cannot_hold_are_named(targets, tmp_path):
    target = targets["qwen3"]
    drafter, spec = make_drafter(target, kind="dspark")
    export_drafter(drafter, spec, target, tmp_path, layout="deepspec")
    _edit_config(tmp_path, target_layer_ids=[-1, 1, 3, 5, 6])
    with pytest.raises(ValueError, match="-1 .the embedding output. cannot be represented"):
        import_drafter(tmp_path, target)
    _edit_config(tmp_path, target_layer_ids=list(target.feature_layer_ids), markov_head_type="fir")
    with pytest.raises(ValueError, match="markov_head_type='fir'"):
        import_drafter(tmp_path, target)
