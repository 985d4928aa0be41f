"""The frozen target LLM: `Target`, `load_target`, built-in targets (`tiny`, `smollm2-135m`). See base.py."""

from dspark.targets.base import Target, TargetForward, default_feature_layer_ids, resolve_feature_layer_ids
from dspark.targets.builtin import SMOLLM2_MASK_TOKEN, TARGETS, TargetSource
from dspark.targets.loading import (
    check_vocab_agreement,
    choose_mask_token_id,
    collect_stop_token_ids,
    compute_fingerprint,
    load_target,
)

__all__ = [
    "SMOLLM2_MASK_TOKEN",
    "TARGETS",
    "Target",
    "TargetForward",
    "TargetSource",
    "check_vocab_agreement",
    "choose_mask_token_id",
    "collect_stop_token_ids",
    "compute_fingerprint",
    "default_feature_layer_ids",
    "load_target",
    "resolve_feature_layer_ids",
]
