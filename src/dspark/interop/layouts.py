"""The checkpoint layouts other tools read and write, and how our parameter names map onto theirs.

Two layouts, both a directory with `config.json` + `model.safetensors` (docs/INTEROP.md documents every field):

- `deepspec`: what deepseek-ai/DeepSpec writes (`save_pretrained` of `Qwen3DSparkModel`,
  deepspec/modeling/dspark/qwen3/{config,modeling}.py, markov_head.py, common.py) and what vLLM loads as
  `architectures: ["Qwen3DSparkModel"]` (vllm/model_executor/models/qwen3_dspark.py). DSpark and DFlash share it
  (DFlash = `markov_rank: 0`, `enable_confidence_head: false`, as DeepSpec's config/dflash/*.py).
- `speculators`: vllm-project/speculators (`speculators_model_type` dspark | dflash | eagle3;
  src/speculators/models/{dspark,dflash,eagle3}/), which vLLM also serves.

Our names differ from theirs only by prefixes, the fused-context norm's name (`context_norm` = their
`hidden_norm`) and the MASK embedding: ours is a trained vector `backbone.mask_embedding`, theirs the row
`embed_tokens.weight[mask_token_id]` (the drafter's own copy of the target embedding). Export writes that row;
import reads it back, so the mapping is exact.
"""

from __future__ import annotations

import re

LAYOUTS = ("deepspec", "speculators")
FORMAT_VERSION = 1  # of the `dspark_lab` provenance block we add to config.json
SPECULATORS_VERSION = "0.7.0"  # the vllm-project/speculators release whose config schema this mirrors

# Every registered head (`dspark.drafters.heads.SEQUENTIAL_HEADS`) is one of: NO_HEAD (written as `markov_rank: 0`,
# no `markov_head_type`), a key of HEAD_TO_MARKOV_TYPE, or a key of HEAD_REFUSALS (why no layout can hold it);
# tests/test_interop.py checks each registered head and names the map a new one is missing from.
NO_HEAD = "none"
# our head names <-> DeepSpec / speculators `markov_head_type` (both layouts use the same field and values)
HEAD_TO_MARKOV_TYPE = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}
MARKOV_TYPE_TO_HEAD = {v: k for k, v in HEAD_TO_MARKOV_TYPE.items()}
# head -> why neither layout can represent it: DeepSpec, speculators and vLLM know markov_head_type vanilla | gated |
# rnn only, so a head of another form has no tensor names or forward there
HEAD_REFUSALS: dict[str, str] = {
    "gru": "DeepSpec / speculators / vLLM have no GRU head (their markov_head_type is vanilla, gated or rnn)",
    "selector_conv": (
        "DeepSpec / speculators / vLLM have no selector head and no block convolution in their draft layers "
        "(their markov_head_type is vanilla, gated or rnn)"
    ),
}

# Every registered drafter kind (`dspark.drafters.factory.DRAFTER_BUILDERS`) is written with one tensor-name map and,
# per layout, one architecture, or is refused in DRAFTER_REFUSALS[(kind, layout)] with the reason.
SPECULATORS_ARCHITECTURES = {"dspark": "DSparkSpeculator", "dflash": "DFlashSpeculator", "eagle3": "Eagle3Speculator"}
# after the target family's prefix (Qwen3DSparkModel, LlamaEagle3Model)
DEEPSPEC_ARCHITECTURES = {"dspark": "DSparkModel", "dflash": "DSparkModel", "eagle3": "Eagle3Model"}
ARCHITECTURES = {"deepspec": DEEPSPEC_ARCHITECTURES, "speculators": SPECULATORS_ARCHITECTURES}
DRAFTER_REFUSALS: dict[tuple[str, str], str] = {}  # (kind, layout) -> why that layout cannot hold the kind

MARKOV_W1 = "markov_head.markov_w1.weight"  # their W_1 [V, r]: its width is the Markov rank r
# DSpark / DFlash: ours -> theirs (deepspec and speculators use the same tensor names).
# `{i}` is the draft-layer index. Tensors absent from our model (embed_tokens, lm_head, d2t, t2d) are written
# from the target and the draft vocabulary by the exporter.
DSPARK_NAME_MAP = (
    (r"backbone\.fc\.weight", "fc.weight"),
    (r"backbone\.context_norm\.weight", "hidden_norm.weight"),
    (r"backbone\.norm\.weight", "norm.weight"),
    (r"backbone\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight", r"layers.\1.\2.weight"),
    (
        r"backbone\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight",
        r"layers.\1.self_attn.\2.weight",
    ),
    (r"backbone\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight", r"layers.\1.mlp.\2.weight"),
    (r"head\.w1\.weight", MARKOV_W1),
    (r"head\.w2\.weight", "markov_head.markov_w2.weight"),
    (r"head\.cell\.(weight|bias)", r"markov_head.joint_proj.\1"),  # rnn: columns [s | W1[x] | h] in both
    (r"head\.gate\.(weight|bias)", r"markov_head.gate_proj.\1"),  # gated: input [h | W1[x]] in both
    (r"confidence_head\.proj\.(weight|bias)", r"confidence_head.proj.\1"),
)
# EAGLE-3 (speculators only): our single layer is their `layers.0`, the first-layer variant with hidden_norm.
EAGLE3_NAME_MAP = (
    (r"fc\.weight", "fc.weight"),
    (r"norm\.weight", "norm.weight"),
    (r"layer\.input_norm\.weight", "layers.0.input_layernorm.weight"),
    (r"layer\.hidden_norm\.weight", "layers.0.hidden_norm.weight"),
    (r"layer\.post_attention_norm\.weight", "layers.0.post_attention_layernorm.weight"),
    (r"layer\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight", r"layers.0.self_attn.\1.weight"),
    (r"layer\.mlp\.(gate_proj|up_proj|down_proj)\.weight", r"layers.0.mlp.\1.weight"),
)
# Our drafter kind -> the tensor-name map of its exported weights (both layouts use the same names).
NAME_MAPS = {"dspark": DSPARK_NAME_MAP, "dflash": DSPARK_NAME_MAP, "eagle3": EAGLE3_NAME_MAP}
# Our buffers that are not weights of theirs: the draft vocabulary's ids, written as d2t / t2d instead.
OURS_NOT_EXPORTED = ("draft_head.draft_to_target",)


def markov_head_type(head: str, *, layout: str) -> str | None:
    """The `markov_head_type` that `layout` writes for our `head` (None for no head); a ValueError naming the layout
    and the fix for a head it cannot hold or that has no mapping yet."""
    if head == NO_HEAD:
        return None
    if head in HEAD_REFUSALS:
        raise ValueError(f"export.layout={layout}: model.head={head!r} cannot be represented: {HEAD_REFUSALS[head]}")
    if head not in HEAD_TO_MARKOV_TYPE:
        raise ValueError(
            f"export.layout={layout}: model.head={head!r} has no markov_head_type; add it to "
            "dspark.interop.layouts.HEAD_TO_MARKOV_TYPE (and its tensors to DSPARK_NAME_MAP), or give "
            "the reason it cannot be represented in HEAD_REFUSALS"
        )
    return HEAD_TO_MARKOV_TYPE[head]


def drafter_layout(kind: str, *, layout: str) -> tuple[str, tuple]:
    """(architecture name in `layout`, tensor-name map) of our drafter `kind`; a ValueError naming the layout and the
    fix for a kind it cannot hold or that has no mapping yet."""
    if (kind, layout) in DRAFTER_REFUSALS:
        raise ValueError(
            f"export.layout={layout}: drafter={kind!r} cannot be represented: {DRAFTER_REFUSALS[(kind, layout)]}"
        )
    if kind not in ARCHITECTURES[layout] or kind not in NAME_MAPS:
        raise ValueError(
            f"export.layout={layout}: drafter={kind!r} has no exported form; add it to "
            f"dspark.interop.layouts.NAME_MAPS and {layout.upper()}_ARCHITECTURES, or give the reason "
            "in DRAFTER_REFUSALS"
        )
    return ARCHITECTURES[layout][kind], NAME_MAPS[kind]


def _compile(pairs):
    return [(re.compile(rf"^{ours}$"), theirs) for ours, theirs in pairs]


def map_names(names, pairs) -> dict[str, str]:
    """ours -> theirs for every name; raises ValueError naming the first name the layout cannot hold."""
    compiled = _compile(pairs)
    mapped = {}
    for name in names:
        if name in OURS_NOT_EXPORTED:
            continue
        for pattern, repl in compiled:
            if pattern.match(name):
                mapped[name] = pattern.sub(repl, name)
                break
        else:
            raise ValueError(f"parameter '{name}' has no equivalent in the exported layout; it cannot be represented")
    return mapped


def d2t_offsets(draft_to_target):
    """EAGLE-3 / speculators / vLLM `d2t`: target id = draft index + d2t[draft index] (offsets, not ids)."""
    import torch

    return draft_to_target.long() - torch.arange(draft_to_target.numel(), dtype=torch.long)


def t2d_mask(draft_to_target, vocab_size: int):
    """speculators `t2d`: bool [V], True for the target ids in the draft vocabulary."""
    import torch

    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[draft_to_target.long()] = True
    return mask
