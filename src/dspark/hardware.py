"""What the machine can do, detected at run time (never assumed): bf16 matrix instructions on the CPU.

bf16 matrix products beat fp32 wherever the CPU has bf16 dot-product instructions: Intel Xeons with AMX-BF16
(~5× fp32, `../shared/docs/CPU_RECIPE.md`) and CPUs with AVX512-BF16 (AMD EPYC Zen 4, Intel Cooper Lake; measured on
an EPYC Zen 4 here, one thread: a 512×576·576×1536 product 42 GFLOP/s fp32 vs 123 bf16, SmolLM2 prefill 184 vs
333 tok/s under autocast). Without either (the EPYC Zen 3 machines of earlier sessions) bf16 is emulated, *slower*
than fp32, and fp32 stays the default.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import statistics
import sys
import threading
import time
import types
from pathlib import Path
from typing import Callable

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
    page-faults all of them in again, zero-filled, every step. Measured here (Intel Xeon VM, two threads,
    `bench_training.py --depths 2`, depth-2 DSpark): 1.57–1.73 s per step with ~15 s of kernel time per run, 1.20–1.32 s
    and ~3 s with this setting, interleaved. It is the setting Intel's PyTorch CPU guide reaches with
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
    return (f"{platform.platform()}|{platform.machine()}|cpus={os.cpu_count()}|torch={torch.__version__}"
            f"|device={device}")


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
    return (f"{cpu_model()}{numbers}, {os.cpu_count()} CPUs, bf16 unit {cpu_bf16_unit() or 'none'}, "
            f"{torch.get_num_threads()} torch threads")


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


#: products with at most this many rows (tokens) may take the (W xᵀ)ᵀ layout: a verify forward's B = ℓ + 1 tokens
FEW_ROWS = 16
#: the smallest weight (elements) worth probing: smaller ones sit in cache, where the layouts cost the same
FEW_ROW_PROBE_MIN_ELEMENTS = 4_000_000
#: how much faster the (W xᵀ)ᵀ layout must be, at every probed row count, to be chosen
FEW_ROW_MARGIN = 1.5
FEW_ROW_LAYOUT_ENV = "DSPARK_FEW_ROW_LAYOUT"
#: how much faster a product of n rows must be when computed as m > n rows (the extra ones zero) to be padded
#: (`row_padding`). The Zen 3 measured one row 1.2–1.8× slower than two on the LM head (a whole 1-token step 7% faster
#: padded), three rows 1.2× slower than four (a whole 3-token verify step 66.4 → 63.0 ms padded to four).
ROW_PAD_MARGIN = 1.1
ROW_PAD_ENV = "DSPARK_ROW_PADDING"
#: a row-padding table: {n: m} computes an n-row (W xᵀ)ᵀ product as m > n rows, the extra ones zero; absent n are
#: computed as they are
RowPadding = dict[int, int]


def few_row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    row_padding: RowPadding | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., K], weight [N, K] → [..., N], computed as (W xᵀ)ᵀ when x has at most
    `FEW_ROWS` rows (the same numbers up to summation order), as `F.linear` otherwise. row_padding: an n-row x with
    n in the table is multiplied as `row_padding[n]` rows (the extra ones zero) and its n rows kept (`row_padding`
    decides where that pays).

    Why: for a few rows, BLAS's x Wᵀ product can cost ~2–4× the (W xᵀ)ᵀ one for a weight that lives in DRAM (MKL on an
    AVX2-only AMD EPYC Zen 3, fp32: SmolLM2's LM head at 2 rows 36.8 vs 13.3 ms, a 2-token target forward 198 vs
    131 ms; benchmarks/results/matmul-layout.md), which made verifying one draft cost 1.5 plain decoding steps. And
    the cost of the (W xᵀ)ᵀ product is not monotone in the row count: on that machine one row (BLAS's matrix-vector
    kernel) streamed the LM head at 9.0 ms against 6.0 ms for two, and three rows cost 7.0 ms against 5.8 for four."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows > FEW_ROWS:
        return torch.nn.functional.linear(x, weight, bias)
    padded_rows = row_padding.get(rows, rows) if row_padding else rows
    if padded_rows > rows:
        out = torch.mm(weight, _padded_rows(flat, padded_rows, weight).t())[:, :rows].t()
    else:
        out = torch.mm(weight, flat.t()).t()
    # Contiguous again: the transposed product's rows are strided, and a strided q/k/v projection sends the
    # attention of a ≥ 2-token forward to SDPA's math kernel (its head dimension's stride is not 1, which the flash
    # kernel requires) and every elementwise op after it to a strided loop — on the Zen 3 of 2026-12-05 a 2-token
    # target forward cost 65.8 ms strided vs 53.2 ms contiguous (a 1-token step 56 ms either way). The copy is B×N.
    out = out.contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


_PADDING_BUFFERS = threading.local()  # per thread: {(rows, K, dtype, device): [rows, K] tensor, zero past the data}


def _padded_rows(flat: torch.Tensor, padded_rows: int, weight: torch.Tensor) -> torch.Tensor:
    """flat [n, K] as the first n rows of a [padded_rows, K] matrix whose other rows are zero.

    Without autograd the matrix is a buffer kept per thread, shape and dtype: only its first n rows are ever written,
    so the rest stay zero, and a padded product costs one copy of n rows instead of a fresh zero matrix plus a
    concatenation — two allocations and a fill per linear layer, ~1 ms of a 1-token SmolLM2-135M step on the Zen 3
    (57.3 → 56.2 ms, seven interleaved rounds). With autograd recording, a fresh matrix (an in-place write into a
    shared buffer would invalidate the graph)."""
    if torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad):
        return torch.cat([flat, flat.new_zeros(padded_rows - flat.shape[0], flat.shape[1])])
    buffers = getattr(_PADDING_BUFFERS, "by_shape", None)
    if buffers is None:
        buffers = _PADDING_BUFFERS.by_shape = {}
    key = (padded_rows, flat.shape[1], flat.dtype, flat.device)
    buffer = buffers.get(key)
    if buffer is None:
        buffer = buffers[key] = flat.new_zeros(padded_rows, flat.shape[1])
    buffer[:flat.shape[0]].copy_(flat)
    return buffer


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def worth_probing(weight: torch.Tensor) -> bool:
    """The few-row probes' scope: fp32 CPU weights of at least `FEW_ROW_PROBE_MIN_ELEMENTS` (smaller ones sit in cache,
    where the layouts cost the same; tiny test models keep `nn.Linear`)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.numel() >= FEW_ROW_PROBE_MIN_ELEMENTS)


def few_row_layout(weight: torch.Tensor, *, rows: tuple[int, ...] = (2, 4), reps: int = 3) -> tuple[str, float]:
    """Which layout a frozen model's few-row products should take on this machine: ("transposed" | "linear", the
    measured speed-up of (W xᵀ)ᵀ over x Wᵀ at the worst probed row count; 1.0 when not probed).

    Measured, never assumed: `weight` (the model's largest, e.g. its LM head) is timed in both layouts at `rows`
    rows, and "transposed" is chosen only when it is `FEW_ROW_MARGIN`× faster at every one of them. Probed only for
    fp32 weights on the CPU of at least `FEW_ROW_PROBE_MIN_ELEMENTS` elements (so tiny test models keep
    `nn.Linear`). `DSPARK_FEW_ROW_LAYOUT=linear|transposed` overrides the choice (`auto`, the default, probes)."""
    forced = os.environ.get(FEW_ROW_LAYOUT_ENV, "auto")
    if forced in ("linear", "transposed"):
        return forced, 1.0
    if forced != "auto":
        raise ValueError(f"{FEW_ROW_LAYOUT_ENV}={forced!r}: expected auto, linear or transposed.")
    if not worth_probing(weight):
        return "linear", 1.0
    gen = torch.Generator().manual_seed(0)
    speedups = []
    with torch.no_grad():
        for n in rows:
            x = torch.randn(n, weight.shape[1], generator=gen)
            shipped = _median_ms(lambda: torch.nn.functional.linear(x, weight), reps)
            transposed = _median_ms(lambda: few_row_product(x, weight), reps)
            speedups.append(shipped / max(transposed, 1e-6))
    worst = min(speedups)
    return ("transposed" if worst >= FEW_ROW_MARGIN else "linear"), worst


def parse_row_padding(text: str) -> RowPadding:
    """A row-padding table written as `n:m,n:m` (e.g. `1:2,3:4`), each 1 <= n < m <= `FEW_ROWS`; `off` or empty:
    none."""
    if text.strip() in ("", "off"):
        return {}
    table: RowPadding = {}
    for item in text.split(","):
        try:
            n, m = (int(part) for part in item.split(":"))
        except ValueError:
            raise ValueError(f"{ROW_PAD_ENV}={text!r}: expected auto, off or n:m pairs such as 1:2,3:4.") from None
        if not 1 <= n < m <= FEW_ROWS:
            raise ValueError(f"{ROW_PAD_ENV}={text!r}: each n:m needs 1 <= n < m <= {FEW_ROWS} (got {n}:{m}).")
        table[n] = m
    return table


def format_row_padding(table: RowPadding) -> str:
    """The inverse of `parse_row_padding`: `1:2,3:4`, or `off` for an empty table."""
    return ",".join(f"{n}:{m}" for n, m in sorted(table.items())) or "off"


def padding_from_costs(costs: dict[int, float], *, margin: float = ROW_PAD_MARGIN) -> RowPadding:
    """The row-padding table that measured product `costs` {rows: ms} call for: each n is padded to the smallest
    measured m > n that costs at most 1/`margin` of n; otherwise it stays. The smallest, not the cheapest: the probe
    times the model's largest weight, and a model's small, cache-resident products cost more with every added row."""
    table: RowPadding = {}
    sizes = sorted(costs)
    for index, n in enumerate(sizes):
        cheaper = [m for m in sizes[index + 1:] if costs[n] >= margin * costs[m]]
        if cheaper:
            table[n] = cheaper[0]
    return table


def row_padding(weight: torch.Tensor, *, max_rows: int = FEW_ROWS, rounds: int = 3, reps: int = 3
                ) -> tuple[RowPadding, dict[int, float]]:
    """Which few-row (W xᵀ)ᵀ products should be computed with more rows on this machine: (the table,
    `padding_from_costs` of the measured costs; those costs {rows: ms}, empty when not probed).

    Measured like `few_row_layout`, for the same weights (fp32 on the CPU, at least `FEW_ROW_PROBE_MIN_ELEMENTS`
    elements), at every row count 1..`max_rows`: the median over `rounds` interleaved rounds of the median of `reps`
    calls. (One median of 5 calls per product read 1.06× in one load out of six on the Zen 3 where interleaved rounds
    read 1.3–1.8×: two decoding runs in a row then differed in whether the plain step was padded.) BLAS picks its
    kernel by shape, so the cost of a product is not monotone in its rows (MKL on the Zen 3: 3 rows dearer than 4,
    9–15 dearer than 16). `DSPARK_ROW_PADDING=auto|off|n:m,...` overrides the choice (`auto`, the default, probes).
    Only consulted where the model takes the transposed layout."""
    forced = os.environ.get(ROW_PAD_ENV, "auto")
    if forced != "auto":
        return parse_row_padding(forced), {}
    if not worth_probing(weight):
        return {}, {}
    gen = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(n, weight.shape[1], generator=gen) for n in range(1, max_rows + 1)}
    timings: dict[int, list[float]] = {n: [] for n in inputs}
    with torch.no_grad():
        for _ in range(rounds):
            for n, x in inputs.items():
                timings[n].append(_median_ms(lambda: few_row_product(x, weight), reps))
    costs = {n: statistics.median(times) for n, times in timings.items()}
    return padding_from_costs(costs), costs


def use_few_row_products(model: torch.nn.Module, *, row_padding: RowPadding | None = None) -> int:
    """Make every `nn.Linear` of a frozen `model` compute through `few_row_product` (with the `row_padding` table);
    returns how many.

    An instance attribute shadows `nn.Linear.forward` and reads the module's weight at each call (so
    `autocast_linear_weights`' swapped weights still apply); state dict and hooks are untouched, and `del
    module.forward` restores the class's."""
    table = dict(row_padding or {})
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for module in linears:
        module.forward = types.MethodType(functools.partial(_few_row_forward, row_padding=table), module)
    return len(linears)


def _few_row_forward(self: torch.nn.Linear, x: torch.Tensor, *, row_padding: RowPadding) -> torch.Tensor:
    return few_row_product(x, self.weight, self.bias, row_padding=row_padding)
