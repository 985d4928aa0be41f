"""Two-tap dynamic depthwise convolution along a block's slots: the parallel half of `model.head=selector_conv`
(METHOD §2.2; DFlash2-style, written from its public description).

Around one sublayer f (attention or MLP) of a draft layer, with x_t the sublayer's normed input at slot t of a block:

    a_t = (α_0 + δ_t,0) ⊙ x_t + (α_1 + δ_t,1) ⊙ x_{t-1}           convolution in:  the sublayer reads a_t
    y_t = f(a)_t
    out_t = (β_0 + ε_t,0) ⊙ y_t + (β_1 + ε_t,1) ⊙ y_{t-1}          convolution out: added to the residual stream
    [δ_t,0; δ_t,1; ε_t,0; ε_t,1] = expand(P x_t)                    P: d → 4G, one value per group of d/G channels

x_0 ≡ 0 and y_0 ≡ 0 at a block's first slot: the taps never cross a block boundary, so blocks stay independent and
the cached decoder (one block per row) computes what training computes. The static taps are stored as their offset
from the identity (α_0, α_1) = (β_0, β_1) = (1, 0), and both the offset and P start at zero: a new layer is exactly
the plain layer, zero weights always mean "no convolution", and the convolution learns its way in. Everything depends on h only — never on drafted tokens — so it runs in the parallel
stage and cannot touch losslessness.

Follows DFlash2 (z-lab / Inco AI, 2026; vllm-project/speculators#1014, sgl-project/sglang#35371): a static per-channel
kernel plus a content-adaptive correction shared by each group of channels, both taps zero across the block
boundary, wrapping every attention and MLP sublayer in and out from one projection of its input. Departs in that
the group count is d/16 rounded down (≥ 1; any d works) and the kernel's input is the sublayer's normed input
(DFlash2's exact input and sizes are not public in full).

Shape symbols: B rows, L = N·γ slots (N blocks of γ), d hidden size, G groups.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

#: channels per group of the dynamic correction (DFlash2's `conv_group_size` 16)
GROUP_SIZE = 16
TAPS = 2  # x_t and x_{t-1}
SITES = 2  # before and after the sublayer


class BlockConv(nn.Module):
    """The two convolutions around one sublayer: `kernels(x)` once, then `convolve` before and after it."""

    def __init__(self, hidden_size: int, *, group_size: int = GROUP_SIZE) -> None:
        super().__init__()
        groups = max(1, hidden_size // group_size)
        self.static = nn.Parameter(torch.empty(SITES, TAPS, hidden_size))
        self.dynamic = nn.Linear(hidden_size, SITES * TAPS * groups, bias=False)
        # channel c belongs to group ⌊c·G/d⌋ (even groups when G divides d); a long buffer: never cast to bf16
        group_of = torch.arange(hidden_size) * groups // hidden_size
        self.register_buffer("group_of", group_of, persistent=False)
        identity = torch.zeros(SITES, TAPS, 1)
        identity[:, 0] = 1.0  # the static taps are stored as their offset from (1, 0)
        self.register_buffer("identity", identity, persistent=False)
        self.groups = groups
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: static taps (1, 0) at both sites (an offset of 0), no dynamic correction (P = 0)."""
        self.static.zero_()
        self.dynamic.weight.zero_()

    def kernels(self, x: Tensor) -> Tensor:
        """x [B, L, d] (the sublayer's normed input) → per-slot kernels [B, L, SITES, TAPS, d]."""
        delta = self.dynamic(x).unflatten(-1, (SITES, TAPS, self.groups))  # [B, L, 2, 2, G]
        static = self.static.to(delta.dtype) + self.identity.to(delta.dtype)
        return static + delta.index_select(-1, self.group_of)

    @staticmethod
    def convolve(kernel: Tensor, x: Tensor, *, block_size: int | None = None) -> Tensor:
        """kernel [B, L, TAPS, d] of one site, x [B, L, d] → k_0 ⊙ x_t + k_1 ⊙ x_{t-1} [B, L, d], with x_{t-1} = 0 at
        each block's first slot (blocks of `block_size` slots; None: the whole length is one block)."""
        gamma = x.shape[1] if block_size is None else block_size
        blocks = x.unflatten(1, (-1, gamma))  # [B, N, γ, d]
        previous = torch.cat([torch.zeros_like(blocks[:, :, :1]), blocks[:, :, :-1]], dim=2).flatten(1, 2)
        return kernel[..., 0, :] * x + kernel[..., 1, :] * previous

    def wrap(self, sublayer, x: Tensor, *, block_size: int | None = None) -> Tensor:
        """out = conv_out(f(conv_in(x))) for the sublayer `sublayer` (a callable [B, L, d] → [B, L, d])."""
        kernel = self.kernels(x)
        inner = sublayer(self.convolve(kernel[..., 0, :, :], x, block_size=block_size))
        return self.convolve(kernel[..., 1, :, :], inner, block_size=block_size)
