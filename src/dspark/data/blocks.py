"""Training blocks (METHOD §2.1 table, §3 "Anchors"): anchor sampling and vectorised block construction.

DSpark convention, slot k = 1..γ (tensor index k-1), anchor `x_0 = seq[a]`:

    input  = seq[a] (k = 1) or MASK (k ≥ 2)     RoPE position = a + k - 1
    label  = seq[a + k]                          previous token = seq[a + k - 1]
    target_positions = a + k - 1                 (index into the target's final_hidden for p_t)

Supervised slots are the contiguous prefix with `a + k < T`, `loss_mask[a + k] = 1` and a valid anchor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Blocks:
    """All blocks of a batch, shape symbols B (sequences), N (anchors per sequence), γ (block_size).

    Slots whose source position falls past the sequence end carry filler values: labels and prev_tokens 0 (a valid
    vocabulary id, so embedding look-ups and gathers never fail) and target_positions clamped to T-1. They are
    never supervised (label_valid is False there); positions keep the true RoPE value a+k-1.
    """

    block_input_ids: Tensor  # [B, N, γ] long  seq[a], then MASK
    positions: Tensor  # [B, N, γ] long  a + k - 1 (RoPE)
    labels: Tensor  # [B, N, γ] long  seq[a + k]
    prev_tokens: Tensor  # [B, N, γ] long  seq[a + k - 1]
    label_valid: Tensor  # [B, N, γ] bool  contiguous prefix of supervised slots
    target_positions: Tensor  # [B, N, γ] long  a + k - 1, clamped to [0, T-1]


def _gather_or_zero(seq: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """`seq[b, index[b, n, j]]` for `seq` [B,T] and `index` [B,N,γ]; 0 where index ≥ T. Returns (values, in_range)."""
    batch, length = seq.shape
    in_range = index < length
    flat = index.clamp(max=length - 1).reshape(batch, -1)
    values = torch.gather(seq, 1, flat).reshape(index.shape)
    return torch.where(in_range, values, torch.zeros_like(values)), in_range


def build_blocks(
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    anchor_valid: Tensor,
    *,
    block_size: int,
    mask_token_id: int,
) -> Blocks:
    """Build every block of a batch with gathers (no Python loop over blocks).

    Args:
        input_ids: [B, T] long, right-padded sequences.
        loss_mask: [B, T] bool (or 0/1), 1 on assistant tokens through end-of-turn; 0 on padding.
        anchors: [B, N] long anchor positions a (padding entries may hold any position in [0, T)).
        anchor_valid: [B, N] bool, False for padding anchors (their slots are never supervised).
        block_size: γ ≥ 1.
        mask_token_id: the reserved MASK id used as input for slots k ≥ 2.
    """
    if block_size < 1:
        raise ValueError(f"model.block_size must be >= 1, got {block_size}; set a positive block size")
    if anchors.numel() and (anchors.min() < 0 or anchors.max() >= input_ids.shape[1]):
        raise ValueError("data anchors must lie in [0, T); resample anchors from the batch's loss_mask")
    offsets = torch.arange(block_size, device=anchors.device)
    positions = anchors.unsqueeze(-1) + offsets  # [B, N, γ] = a + k - 1
    prev_tokens, _ = _gather_or_zero(input_ids, positions)
    labels, label_in_range = _gather_or_zero(input_ids, positions + 1)
    label_mask, _ = _gather_or_zero(loss_mask.to(torch.long), positions + 1)
    raw_valid = label_in_range & label_mask.bool() & anchor_valid.bool().unsqueeze(-1)
    # contiguous prefix: a slot counts only if every earlier slot of its block does
    label_valid = torch.cumprod(raw_valid.to(torch.long), dim=-1).bool()
    block_input_ids = torch.full_like(positions, mask_token_id)
    block_input_ids[..., 0] = prev_tokens[..., 0]
    return Blocks(
        block_input_ids=block_input_ids,
        positions=positions,
        labels=labels,
        prev_tokens=prev_tokens,
        label_valid=label_valid,
        target_positions=positions.clamp(max=input_ids.shape[1] - 1),
    )


def eligible_anchor_positions(loss_mask: Tensor) -> Tensor:
    """Positions a of a [T] mask with loss_mask[a] = loss_mask[a+1] = 1 (METHOD §3), ascending, long."""
    mask = loss_mask.bool()
    return torch.nonzero(mask[:-1] & mask[1:], as_tuple=False).flatten()


def sample_anchors(loss_mask: Tensor, *, max_anchors: int, generator: torch.Generator) -> Tensor:
    """Up to `max_anchors` (K) anchors drawn uniformly without replacement among eligible positions.

    Args:
        loss_mask: [T] bool or 0/1 for one (unpadded or right-padded) sequence.
        max_anchors: K ≥ 1; when fewer positions are eligible, all of them are returned.
        generator: a CPU torch.Generator; the draw depends only on it and the mask.
    Returns:
        LongTensor [min(K, #eligible)], sorted ascending.
    """
    if max_anchors < 1:
        raise ValueError(f"data.max_anchors must be >= 1, got {max_anchors}; set a positive anchor count")
    eligible = eligible_anchor_positions(loss_mask.cpu())
    if eligible.numel() <= max_anchors:
        return eligible
    pick = torch.randperm(eligible.numel(), generator=generator)[:max_anchors]
    return eligible[pick].sort().values
