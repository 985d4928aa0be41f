"""The draft vocabulary (EAGLE-3's `draft_vocab_size`; speculators: "W2 projects to the draft vocabulary").

A drafter may predict over only the Vd most frequent target tokens. Its logits are then over *draft ids*
j = 0..Vd-1, where draft id j stands for the target token `draft_to_target[j]`; the LM-head rows it uses are the
frozen target rows `lm_head.weight[draft_to_target]`. Its probability outside the draft vocabulary is exactly 0,
so verification against the target's full distribution stays lossless, and the acceptance of a slot is
Σ_{x ∈ Vd} min(p_d(x), p_t(x)) with p_t the target's *full-vocabulary* distribution.

Token ids going *into* a drafter (anchors, previous tokens, W₁ rows) stay target ids: only outputs are over Vd.

`build_draft_vocab` picks the ids from token counts (training data), `DraftVocabHead` is the frozen projection.
Shape symbols: V target vocabulary, Vd draft vocabulary, d hidden size, `...` any batch shape.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.nn import functional as F


def build_draft_vocab(token_counts: Tensor, *, size: int, always: Iterable[int] = ()) -> Tensor:
    """The `size` most frequent target ids (ties broken by the smaller id), sorted ascending: [Vd] long.

    token_counts [V] (any numeric dtype) counts each target token in the training text; `always` ids (stop
    tokens, say) are included whatever their count. `size` 0 or ≥ V means the full vocabulary (arange(V)).
    """
    vocab_size = token_counts.numel()
    if size < 0:
        raise ValueError(f"model.draft_vocab_size must be >= 0 (got {size}); 0 = the full target vocabulary")
    if size == 0 or size >= vocab_size:
        return torch.arange(vocab_size, dtype=torch.long)
    forced = sorted({int(i) for i in always if 0 <= int(i) < vocab_size})
    if len(forced) > size:
        raise ValueError(f"model.draft_vocab_size={size} is smaller than the {len(forced)} ids that must be in it")
    # Order by (count desc, id asc): a stable sort of the ids by descending count keeps ties in id order.
    scores = token_counts.double().clone()
    scores[forced] = float("inf")
    order = torch.sort(-scores, stable=True).indices
    return torch.sort(order[:size]).values.long()


def target_to_draft(draft_to_target: Tensor, *, vocab_size: int) -> Tensor:
    """Inverse map [V] long: the draft id of each target token, -1 outside the draft vocabulary."""
    inverse = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_to_target.device)
    inverse[draft_to_target] = torch.arange(draft_to_target.numel(), device=draft_to_target.device)
    return inverse


class DraftVocabHead(nn.Module):
    """Frozen LM-head rows of the draft vocabulary: h [..., d] → logits [..., Vd].

    `lm_head` is the target's module, held outside the module tree (not in `parameters()`/`state_dict()`).
    `draft_to_target` is a persistent buffer when Vd < V (it travels with checkpoints) and a non-persistent
    `arange(V)` for the full vocabulary (so older checkpoints without it still load). The selected rows are
    cached — the LM head is frozen — and rebuilt when its weight changes storage, version, dtype or device.
    """

    def __init__(self, lm_head: nn.Module, *, vocab_size: int, draft_vocab_ids: Tensor | None = None) -> None:
        super().__init__()
        self._frozen = (lm_head,)
        ids = torch.arange(vocab_size, dtype=torch.long) if draft_vocab_ids is None else draft_vocab_ids.long().cpu()
        _check_ids(ids, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self.is_full = ids.numel() == vocab_size
        self.register_buffer("draft_to_target", ids, persistent=not self.is_full)
        self._rows_key: tuple | None = None
        self._rows: Tensor | None = None

    @property
    def lm_head(self) -> nn.Module:
        return self._frozen[0]

    @property
    def size(self) -> int:
        """Vd (== V for the full vocabulary)."""
        return int(self.draft_to_target.numel())

    def weight(self) -> Tensor:
        """The frozen rows [Vd, d] (detached)."""
        weight = self.lm_head.weight
        if self.is_full:
            return weight.detach()
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device, self.draft_to_target.data_ptr())
        if key != self._rows_key:
            self._rows = weight.detach().index_select(0, self.draft_to_target.to(weight.device))
            self._rows_key = key
        return self._rows

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [..., d] → logits over the draft vocabulary [..., Vd] (the LM head's bias, if any, too)."""
        weight = self.weight()
        return F.linear(hidden.to(weight.dtype), weight, self.bias())

    def bias(self) -> Tensor | None:
        """The LM head's bias on the draft ids [Vd] (detached), or None when it has none."""
        bias = getattr(self.lm_head, "bias", None)
        if bias is None or self.is_full:
            return None if bias is None else bias.detach()
        return bias.detach().index_select(0, self.draft_to_target.to(bias.device))

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft ids [...] → target ids [...]."""
        return draft_ids if self.is_full else self.draft_to_target.to(draft_ids.device)[draft_ids]

    def to_draft_ids(self, target_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Target ids [...] → (draft ids [...] (0 where outside), inside [...] bool)."""
        if self.is_full:
            return target_ids, torch.ones_like(target_ids, dtype=torch.bool)
        ids = self.draft_to_target
        # the inverse map is derived from the buffer once per (storage, device), not rebuilt every training step
        key = (ids.data_ptr(), ids._version, target_ids.device)
        if key != getattr(self, "_inverse_key", None):
            self._inverse = target_to_draft(ids.to(target_ids.device), vocab_size=self.vocab_size)
            self._inverse_key = key
        draft = self._inverse[target_ids]
        return draft.clamp_min(0), draft >= 0

    def expand(self, draft_values: Tensor) -> Tensor:
        """[..., Vd] → [..., V], zero outside the draft vocabulary (e.g. p_d for the full-vocabulary verifier)."""
        if self.is_full:
            return draft_values
        out = draft_values.new_zeros(*draft_values.shape[:-1], self.vocab_size)
        index = self.draft_to_target.to(draft_values.device).expand_as(draft_values)
        return out.scatter_(-1, index, draft_values)


def _check_ids(ids: Tensor, *, vocab_size: int) -> None:
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError("draft vocabulary: draft_vocab_ids must be a non-empty 1-D tensor of target ids")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft vocabulary: ids must lie in [0, {vocab_size}) (the target vocabulary)")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary: draft_vocab_ids must be sorted ascending and unique")
