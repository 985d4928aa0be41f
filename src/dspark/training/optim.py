"""The paper's optimiser recipe (METHOD §3): AdamW (weight decay 0), linear warm-up over a fraction of the steps,
then cosine to 0; gradient clipping is the Trainer's (`gradient_clip_val`)."""

from __future__ import annotations

import math

import torch
from torch import nn


def warmup_cosine(step: int, *, total_steps: int, warmup_steps: int) -> float:
    """LR multiplier: linear 0→1 over `warmup_steps`, then cosine 1→0 at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(
    params, *, lr: float, betas: tuple[float, float], weight_decay: float, total_steps: int, warmup_fraction: float
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW + per-step warm-up/cosine schedule over `total_steps` optimiser steps."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("The drafter has no trainable parameters; check model.* settings.")
    # On the CPU, the fused kernel updates each parameter in one pass instead of a dozen elementwise ones: the
    # Markov W_1 alone is V × r (49,152 × 256 for SmolLM2), and its unfused AdamW step was 8% of a training step
    # (benchmarks/results/training.md). Not on accelerators: fp16 AMP's gradient scaler cannot unscale before
    # Lightning's clipping with a fused optimizer there.
    fused = all(p.device.type == "cpu" and p.dtype.is_floating_point for p in params)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused or None)
    warmup = int(round(warmup_fraction * total_steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, total_steps=total_steps, warmup_steps=warmup)
    )
    return optimizer, schedule


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
