"""`model.init_layers`: draft layers initialised from the target's own decoder layers (`dspark.drafters.init`)."""

from __future__ import annotations

import pytest
import torch

from dspark.config import resolve_config
from dspark.config.schema import ModelConfig
from dspark.drafters.factory import build_drafter, drafter_spec_for
from dspark.drafters.init import copy_target_layers

TINY_TARGET = {"threads": 1}


def draft_of(tiny, depth: int = 2):
    torch.manual_seed(0)
    return build_drafter(drafter_spec_for(kind="dspark", model_cfg=ModelConfig(depth=depth), target=tiny), tiny)


def test_each_draft_layer_becomes_a_copy_of_its_target_layer_and_nothing_else_moves(tiny):
    drafter = draft_of(tiny)
    before = {name: p.clone() for name, p in drafter.named_parameters() if not name.startswith("backbone.layers.")}
    names = copy_target_layers(drafter.backbone.layers, tiny, [0, -1])
    assert {"self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"} <= set(names)
    for draft_layer, layer_id in zip(drafter.backbone.layers, [0, tiny.num_layers - 1]):
        source = dict(tiny.decoder_layer(layer_id).named_parameters())
        for name, param in draft_layer.named_parameters():
            assert torch.equal(param, source[name].to(param.dtype)), name
            assert param.data_ptr() != source[name].data_ptr()  # a copy: training never writes into the target
    after = dict(drafter.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in before.items())  # fusion, mask, heads untouched
    # the two layers really differ (so the test would see a copy of the wrong layer)
    assert not torch.equal(drafter.backbone.layers[0].mlp.up_proj.weight, drafter.backbone.layers[1].mlp.up_proj.weight)


def test_bad_layer_lists_are_refused_before_anything_is_copied(tiny):
    drafter = draft_of(tiny)
    snapshot = [p.clone() for p in drafter.parameters()]
    with pytest.raises(ValueError, match="model.init_layers names 1 target layers for 2 draft layers"):
        copy_target_layers(drafter.backbone.layers, tiny, [0])
    with pytest.raises(ValueError, match=f"target layer {tiny.num_layers} does not exist"):
        copy_target_layers(drafter.backbone.layers, tiny, [0, tiny.num_layers])
    assert all(torch.equal(a, b) for a, b in zip(snapshot, drafter.parameters()))


def test_a_layer_of_another_shape_is_refused_with_the_key(tiny):
    drafter = draft_of(tiny, depth=1)
    layer = drafter.backbone.layers[0]
    layer.mlp.up_proj = torch.nn.Linear(tiny.hidden_size, 3, bias=False)  # a draft layer the target cannot fill
    with pytest.raises(ValueError, match=r"model.init_layers: draft parameter mlp.up_proj.weight \(3, "):
        copy_target_layers(drafter.backbone.layers, tiny, [0])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["model.depth=2", "model.init_layers=[0]"], "names 1 target layers for model.depth=2"),
        (["drafter=eagle3", "model.depth=1", "model.init_layers=[0]"], "EAGLE-3's layer reads"),
    ],
)
def test_the_config_refuses_a_layer_list_it_cannot_apply(argv, message):
    with pytest.raises(Exception, match=message):
        resolve_config(argv)


def test_a_matching_layer_list_resolves():
    assert resolve_config(["model.depth=2", "model.init_layers=[0,-1]"]).cfg.model.init_layers == [0, -1]
