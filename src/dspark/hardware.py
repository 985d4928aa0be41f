"""What the machine can do, detected at run time (never assumed): bf16 matrix units on the CPU.

On Intel Xeons with AMX-BF16 bf16 matrix products ran ~5× faster than fp32 (`../shared/docs/CPU_RECIPE.md`); on
CPUs without it (the AMD EPYC machines of earlier sessions) bf16 is *slower* than fp32 and fp32 stays the default.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true")


@functools.lru_cache(maxsize=1)
def cpu_has_amx_bf16() -> bool:
    """True when the CPU advertises AMX-BF16 (Linux /proc/cpuinfo flag `amx_bf16`, or torch's own capability).

    `DSPARK_CPU_BF16=0|1` overrides the detection (for benchmarks that compare both on one machine)."""
    forced = os.environ.get("DSPARK_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="ignore")
        if "amx_bf16" in flags:
            return True
    except OSError:
        pass
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    return "AMX" in str(capability).upper()


def resolve_precision(precision: str, *, accelerator: str) -> str:
    """`trainer.precision=auto` → a Lightning precision for this machine; anything else passes through.

    CPU: bf16-mixed with AMX-BF16, else 32-true. CUDA: bf16-mixed where the GPU supports bf16, else 32-true.
    """
    if precision != "auto":
        return precision
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if on_gpu:
        return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"
    return "bf16-mixed" if cpu_has_amx_bf16() else "32-true"


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype for frozen-model inference on `device` (None: run in the model's own dtype)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if cpu_has_amx_bf16() else None
