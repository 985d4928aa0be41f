"""What the machine can do, detected at run time (never assumed): bf16 matrix instructions on the CPU, the allocator
setting large freed blocks need, and the one-line machine descriptions that reports and cached costs record.

bf16 matrix products beat fp32 wherever the CPU has bf16 dot-product instructions (AMX-BF16 or AVX512-BF16;
docs/METHOD.md); without either bf16 is emulated, *slower* than fp32, and fp32 stays the default. The
target's few-token matrix-product layout, also chosen per machine, lives beside the target (`dspark.targets.layout`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import sys
from pathlib import Path

import torch

PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true")


#: /proc/cpuinfo flags of bf16 dot-product instructions, fastest first
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=1)
def cpu_bf16_unit() -> str | None:
    """The CPU's bf16 matrix instructions, `amx_bf16` or `avx512_bf16` (the /proc/cpuinfo flag), else None.

    Read from /proc/cpuinfo (Linux), else from torch's own capability string. `DSPARK_CPU_BF16=0|1` overrides the
    detection (for benchmarks that compare both on one machine): 1 reports `forced`, 0 reports None."""
    forced = os.environ.get("DSPARK_CPU_BF16")
    if forced in ("0", "1"):
        return "forced" if forced == "1" else None
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="ignore")
    except OSError:
        cpuinfo = ""
    capability = str(getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")())
    return bf16_unit_from(cpuinfo, capability=capability)


def bf16_unit_from(cpuinfo: str, *, capability: str = "") -> str | None:
    """The first of `BF16_CPU_FLAGS` among the whitespace-separated flags of `cpuinfo` (/proc/cpuinfo text), else
    `amx_bf16` when torch's capability string names AMX, else None. A flag must match whole (`avx512_bf16` is not
    `avx512bw`)."""
    flags = set(cpuinfo.split())
    for flag in BF16_CPU_FLAGS:
        if flag in flags:
            return flag
    return "amx_bf16" if "AMX" in capability.upper() else None


def cpu_has_fast_bf16() -> bool:
    """True when bf16 matrix products run faster than fp32 on this CPU (`cpu_bf16_unit()` found one)."""
    return cpu_bf16_unit() is not None


def resolve_precision(precision: str, *, accelerator: str) -> str:
    """`trainer.precision=auto` → a Lightning precision for this machine; anything else passes through.

    CPU: bf16-mixed with bf16 matrix instructions (AMX-BF16 or AVX512-BF16), else 32-true. CUDA: bf16-mixed where
    the GPU supports bf16, else 32-true.
    """
    if precision != "auto":
        return precision
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if on_gpu:
        return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"
    return "bf16-mixed" if cpu_has_fast_bf16() else "32-true"


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype for frozen-model inference on `device` (None: run in the model's own dtype)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if cpu_has_fast_bf16() else None


#: glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
#: free memory at the top of the heap kept before glibc gives it back (the mallopt argument is a C int)
_TRIM_THRESHOLD_BYTES = 2**31 - 1


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Make glibc malloc reuse freed memory instead of unmapping it; True where that took effect.

    Why: glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh `mmap` and returns it
    with `munmap` on free, so a training step whose logits, attention scores and gradients are tens of MiB each
    page-faults all of them in again, zero-filled, every step (a quarter of a training step's time, docs/LOG.md).
    It is the setting Intel's PyTorch CPU guide reaches with
    jemalloc/tcmalloc, without a preloaded library: no mmap for large blocks (`M_MMAP_MAX = 0`) and up to 2 GiB of
    freed heap kept (`M_TRIM_THRESHOLD`). Resident memory then stays at the process's peak instead of breathing.

    Linux with glibc only (elsewhere a no-op returning False); `DSPARK_KEEP_FREED_MEMORY=0` turns it off. Call it
    early: it governs allocations made after it.
    """
    if os.environ.get("DSPARK_KEEP_FREED_MEMORY", "1") == "0":
        return False
    libc = _glibc()  # glibc only: musl's mallopt accepts and ignores the parameters
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))


@functools.lru_cache(maxsize=1)
def _glibc():
    """libc as a ctypes handle when it is glibc (mallopt / malloc_trim mean what glibc documents), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if libc.gnu_get_libc_version() else None
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc `malloc_trim(0)`); True where glibc released any.

    The counterpart of `keep_freed_memory` between phases of one long process: a sweep trains, evaluates and trains
    again in one process, each phase with its own allocation sizes, so a heap that never trims grows towards the sum
    of their peaks (a `sweep=main` process reached 14.5 GB resident by its third cell). The sweep driver calls this
    after every cell and an experiment between training and evaluation, where nothing is in flight; inside a phase
    the kept blocks are reused. A no-op (False) without glibc.
    """
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def machine_fingerprint() -> str:
    """One line naming what measured costs depend on: platform, CPU count, torch version, CUDA device if any (SPS
    tables record it; the kept few-row choice adds `cpu_model`)."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return f"{platform.platform()}|{platform.machine()}|cpus={os.cpu_count()}|torch={torch.__version__}|device={device}"


def machine_summary() -> str:
    """One readable line for report headers: the CPU model with its family/model numbers (two EPYC generations
    share the model name "AMD EPYC"), CPU count, bf16 matrix instructions and torch threads, e.g.
    `AMD EPYC (family 25 model 17), 2 CPUs, bf16 unit avx512_bf16, 2 torch threads`."""
    family = model = None
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="ignore").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "cpu family" and family is None:
                family = value.strip()
            elif key.strip() == "model" and model is None:
                model = value.strip()
    except OSError:
        pass
    numbers = f" (family {family} model {model})" if family and model else ""
    return (
        f"{cpu_model()}{numbers}, {os.cpu_count()} CPUs, bf16 unit {cpu_bf16_unit() or 'none'}, "
        f"{torch.get_num_threads()} torch threads"
    )


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else the platform's processor string, else "unknown CPU"
    (for benchmark headers: results are only comparable on the same model)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="ignore").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


@contextlib.contextmanager
def autocast_linear_weights(model: torch.nn.Module, dtype: torch.dtype | None = torch.bfloat16):
    """Inside `torch.autocast(dtype)`: give every `nn.Linear` of a frozen `model` its weight already cast to `dtype`
    for the duration, restoring the originals after (even on error); `dtype` None does nothing.

    Autocast casts a linear layer's fp32 weight on every call and caches the cast only for leaves that require grad,
    so a frozen target re-casts all its matrices at every decoding step (SmolLM2: ~0.8 GB of memory traffic per
    step). The pre-cast copy is the very tensor autocast would make (fp32 → bf16 rounding is deterministic), so the
    outputs are bit-identical (tested); norms and embeddings keep their dtype, and a tied LM head gets its own copy
    while the embedding it shares keeps the fp32 rows. Measured: regeneration at batch 48 ~10–20% faster.
    Code that needs the full-precision weights inside the context reads them with `uncast_weight`."""
    if dtype is None:
        yield model
        return
    saved = []
    try:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.dtype != dtype:
                original = module.weight
                saved.append((module, original))
                module.weight = torch.nn.Parameter(original.detach().to(dtype), requires_grad=False)
                # a plain tensor attribute, not a Parameter: the module's parameters and state_dict stay as they are
                module.weight_before_cast = original.detach()
        yield model
    finally:
        for module, weight in saved:
            module.weight = weight
            module.__dict__.pop("weight_before_cast", None)


def uncast_weight(linear: torch.nn.Module) -> torch.Tensor:
    """`linear`'s weight as it was before `autocast_linear_weights` cast it: the original (same storage) inside that
    context, the module's own weight outside it. Exact computations beside a bf16 forward read this (the feature
    prefill's log-normaliser refinement read the bf16 copy once and was ~8× off)."""
    return linear.__dict__.get("weight_before_cast", linear.weight)
