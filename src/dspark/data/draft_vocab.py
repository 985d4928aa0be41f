"""Which target ids a drafter with a draft vocabulary predicts over, chosen from its training data.

`dspark.drafters.vocab.build_draft_vocab` picks the Vd ids of largest score; this module supplies the scores of a
prepared dataset: the target's expected token mass Σ p_t over the supervised positions when the feature cache holds
it (acceptance at a position is bounded by Σ_{x ∈ Vd} p_t(x), so that mass is what a draft vocabulary must cover),
else the counts of the supervised tokens of the training split.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dspark.data.features import FeatureCache
from dspark.data.regenerate import load_regenerated
from dspark.drafters.vocab import build_draft_vocab

if TYPE_CHECKING:
    from dspark.targets import Target

log = logging.getLogger("dspark")


def draft_vocab_from_data(
    regen_dir: Path, indices: list[int], *, target: Target, size: int, feature_dir: Path | None = None
) -> torch.Tensor:
    """The `size` target ids the drafter predicts over (+ the stop ids), sorted: [Vd] long.

    With a feature cache that holds the target's expected token mass, the ids of largest mass: what the target itself
    would write in these contexts. Otherwise the most frequent supervised tokens of the rows `indices` of the
    regenerated dataset (the training split)."""
    if feature_dir is not None:
        mass = FeatureCache(feature_dir).target_mass()
        if mass is not None:
            log.info("draft vocabulary: the %d ids of largest expected target mass", size)
            return build_draft_vocab(mass, size=size, always=target.stop_token_ids)
    rows = load_regenerated(regen_dir).select(indices).with_format("torch", columns=["input_ids", "loss_mask"])
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    for row in rows:
        counts += torch.bincount(row["input_ids"][row["loss_mask"].bool()].long(), minlength=target.vocab_size)
    return build_draft_vocab(counts, size=size, always=target.stop_token_ids)
