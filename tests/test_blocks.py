"""build_blocks against a per-block Python reference (METHOD §2.1 table) and sample_anchors properties (§3)."""

from __future__ import annotations

import pytest
import torch

from dspark.data.blocks import build_blocks, eligible_anchor_positions, sample_anchors

MASK = 999


def reference_blocks(seq, mask, anchors, valid, *, block_size, mask_token_id):
    """Plain-Python transcription of the slot table: one block, one slot at a time."""
    length = len(seq)
    out = {name: [] for name in ("inp", "pos", "lab", "prev", "valid", "tpos")}
    for a, ok in zip(anchors, valid):
        row = {name: [] for name in out}
        prefix_alive = bool(ok)
        for k in range(1, block_size + 1):
            row["inp"].append(seq[a] if k == 1 else mask_token_id)
            row["pos"].append(a + k - 1)
            row["lab"].append(seq[a + k] if a + k < length else 0)
            row["prev"].append(seq[a + k - 1] if a + k - 1 < length else 0)
            prefix_alive = prefix_alive and a + k < length and bool(mask[a + k])
            row["valid"].append(prefix_alive)
            row["tpos"].append(min(a + k - 1, length - 1))
        for name in out:
            out[name].append(row[name])
    return out


def random_batch(gen: torch.Generator, *, batch: int, length: int, num_anchors: int):
    ids = torch.randint(0, 50, (batch, length), generator=gen)
    mask = torch.rand(batch, length, generator=gen) < 0.7
    # anchors concentrated near the end so that blocks run past T
    anchors = length - 1 - torch.randint(0, min(length, 6), (batch, num_anchors), generator=gen)
    anchors[:, : num_anchors // 2] = torch.randint(0, length, (batch, num_anchors // 2), generator=gen)
    valid = torch.rand(batch, num_anchors, generator=gen) < 0.8
    return ids, mask, anchors, valid


@pytest.mark.parametrize("block_size", [1, 3, 7])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_build_blocks_matches_reference(block_size: int, seed: int) -> None:
    """Catches off-by-one label/position shifts, a non-contiguous validity mask and wrong edge handling at T."""
    gen = torch.Generator().manual_seed(seed)
    ids, mask, anchors, valid = random_batch(gen, batch=3, length=17, num_anchors=8)
    blocks = build_blocks(ids, mask, anchors, valid, block_size=block_size, mask_token_id=MASK)
    for b in range(ids.shape[0]):
        ref = reference_blocks(
            ids[b].tolist(),
            mask[b].tolist(),
            anchors[b].tolist(),
            valid[b].tolist(),
            block_size=block_size,
            mask_token_id=MASK,
        )
        assert blocks.block_input_ids[b].tolist() == ref["inp"]
        assert blocks.positions[b].tolist() == ref["pos"]
        assert blocks.labels[b].tolist() == ref["lab"]
        assert blocks.prev_tokens[b].tolist() == ref["prev"]
        assert blocks.label_valid[b].tolist() == ref["valid"]
        assert blocks.target_positions[b].tolist() == ref["tpos"]


def test_build_blocks_shapes_dtypes_and_prefix() -> None:
    gen = torch.Generator().manual_seed(3)
    ids, mask, anchors, valid = random_batch(gen, batch=2, length=12, num_anchors=5)
    blocks = build_blocks(ids, mask, anchors, valid, block_size=4, mask_token_id=MASK)
    for name in ("block_input_ids", "positions", "labels", "prev_tokens", "target_positions"):
        tensor = getattr(blocks, name)
        assert tensor.shape == (2, 5, 4) and tensor.dtype == torch.long, name
    assert blocks.label_valid.dtype == torch.bool
    # once a slot is invalid, every later slot of the block is too
    as_int = blocks.label_valid.long()
    assert bool((as_int[..., 1:] <= as_int[..., :-1]).all())
    assert not blocks.label_valid[~valid].any()


def test_build_blocks_hand_example() -> None:
    """The METHOD §2.1 table on one sequence: anchor a=2, γ=3, mask breaking the prefix at slot 3."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 1, 1, 0, 1]])
    blocks = build_blocks(ids, mask, torch.tensor([[2]]), torch.tensor([[True]]), block_size=3, mask_token_id=MASK)
    assert blocks.block_input_ids.tolist() == [[[12, MASK, MASK]]]
    assert blocks.positions.tolist() == [[[2, 3, 4]]]
    assert blocks.labels.tolist() == [[[13, 14, 15]]]
    assert blocks.prev_tokens.tolist() == [[[12, 13, 14]]]
    assert blocks.label_valid.tolist() == [[[True, False, False]]]  # loss_mask[4] = 0 ends the prefix


def test_build_blocks_rejects_out_of_range_anchor() -> None:
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="anchors"):
        build_blocks(ids, ids.bool(), torch.tensor([[4]]), torch.tensor([[True]]), block_size=2, mask_token_id=MASK)


def _mask(bits: str) -> torch.Tensor:
    return torch.tensor([int(c) for c in bits], dtype=torch.bool)


def test_eligible_positions() -> None:
    assert eligible_anchor_positions(_mask("0111011")).tolist() == [1, 2, 5]
    assert eligible_anchor_positions(_mask("1")).tolist() == []


def test_sample_anchors_properties() -> None:
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(300, generator=gen) < 0.8
    eligible = set(eligible_anchor_positions(mask).tolist())
    assert len(eligible) > 40
    draws = []
    for seed in range(5):
        anchors = sample_anchors(mask, max_anchors=32, generator=torch.Generator().manual_seed(seed))
        assert anchors.dtype == torch.long and anchors.numel() == 32
        assert len(set(anchors.tolist())) == 32  # no duplicates
        assert set(anchors.tolist()) <= eligible
        assert anchors.tolist() == sorted(anchors.tolist())
        draws.append(tuple(anchors.tolist()))
    assert len(set(draws)) == 5  # a different generator gives a different draw
    same = sample_anchors(mask, max_anchors=32, generator=torch.Generator().manual_seed(0))
    assert tuple(same.tolist()) == draws[0]
    everything = sample_anchors(mask, max_anchors=10_000, generator=torch.Generator().manual_seed(0))
    assert set(everything.tolist()) == eligible


def test_sample_anchors_uniform() -> None:
    """Each eligible position is picked with probability K/#eligible (a biased draw fails this)."""
    mask = _mask("0" + "1" * 11)  # eligible positions 1..10
    counts = torch.zeros(12)
    trials = 2000
    gen = torch.Generator().manual_seed(1)
    for _ in range(trials):
        counts[sample_anchors(mask, max_anchors=3, generator=gen)] += 1
    freq = counts[1:11] / trials
    assert counts[0] == 0 and counts[11] == 0
    assert torch.allclose(freq, torch.full_like(freq, 0.3), atol=0.05)


def test_sample_anchors_rejects_bad_k() -> None:
    with pytest.raises(ValueError, match="max_anchors"):
        sample_anchors(_mask("111"), max_anchors=0, generator=torch.Generator())
