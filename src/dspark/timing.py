"""Host-side timing of device work: CUDA kernels are queued, so a clock read sees them finish only after a sync."""

from __future__ import annotations

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for the queued CUDA work of `device` (of the current device when None, once CUDA is initialised);
    nothing on CPU. Call it before each clock read that should include device work."""
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
