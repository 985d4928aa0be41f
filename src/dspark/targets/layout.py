"""The target's few-token matrix-product layout, chosen by measurement on this machine.

A verify forward pushes B = ℓ + 1 tokens through the target. `nn.Linear` computes x Wᵀ; for a few rows some BLAS/CPU
pairs take a general product that streams a DRAM-resident weight far slower than the (W xᵀ)ᵀ layout does, and the
cost of either is not monotone in the row count. So, per machine: `few_row_layout` measures whether (W xᵀ)ᵀ is
faster, `row_padding` which row counts are cheaper computed as more rows (the extra ones zero),
`use_few_row_products` switches a frozen model's linear layers to that layout, and `choose_few_row_layout` does all
three at target load, keeping the measured choice in `few_row_decision_path` (benchmarks/bench_matmul_layout.py
measures the same things side by side).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import statistics
import threading
import time
import types
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from dspark.files import atomic_write_text
from dspark.hardware import cpu_model, machine_fingerprint

log = logging.getLogger("dspark")

#: products with at most this many rows (tokens) may take the (W xᵀ)ᵀ layout: a verify forward's B = ℓ + 1 tokens
FEW_ROWS = 16
#: the smallest weight (elements) worth probing: smaller ones sit in cache, where the layouts cost the same
FEW_ROW_PROBE_MIN_ELEMENTS = 4_000_000
#: how much faster the (W xᵀ)ᵀ layout must be, at every probed row count, to be chosen
FEW_ROW_MARGIN = 1.5
FEW_ROW_LAYOUT_ENV = "DSPARK_FEW_ROW_LAYOUT"
#: how much faster a product of n rows must be when computed as m > n rows (the extra ones zero) to be padded
#: (`row_padding`): above timing noise, below the gaps measured where padding pays (docs/LOG.md)
ROW_PAD_MARGIN = 1.1
ROW_PAD_ENV = "DSPARK_ROW_PADDING"
#: a row-padding table: {n: m} computes an n-row (W xᵀ)ᵀ product as m > n rows, the extra ones zero; absent n are
#: computed as they are
RowPadding = dict[int, int]


def few_row_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, row_padding: RowPadding | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., K], weight [N, K] → [..., N], computed as (W xᵀ)ᵀ when x has at most
    `FEW_ROWS` rows (the same numbers up to summation order), as `F.linear` otherwise. row_padding: an n-row x with
    n in the table is multiplied as `row_padding[n]` rows (the extra ones zero) and its n rows kept (`row_padding`
    decides where that pays).

    Why: for a few rows, BLAS's x Wᵀ product can cost ~2–4× the (W xᵀ)ᵀ one for a weight that lives in DRAM on some
    BLAS/CPU pairs (benchmarks/results/matmul-layout.md), making a one-draft verify cost 1.5 plain steps; and the
    cost of the (W xᵀ)ᵀ product is not monotone in the row count, hence the padding table."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows > FEW_ROWS:
        return torch.nn.functional.linear(x, weight, bias)
    padded_rows = row_padding.get(rows, rows) if row_padding else rows
    if padded_rows > rows:
        out = torch.mm(weight, _padded_rows(flat, padded_rows, weight).t())[:, :rows].t()
    else:
        out = torch.mm(weight, flat.t()).t()
    # Contiguous again: a strided q/k/v projection sends a ≥ 2-token forward's attention to SDPA's math kernel and
    # every elementwise op after it to a strided loop, which costs far more than this B×N copy
    out = out.contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


_PADDING_BUFFERS = threading.local()  # per thread: {(rows, K, dtype, device): [rows, K] tensor, zero past the data}


def _padded_rows(flat: torch.Tensor, padded_rows: int, weight: torch.Tensor) -> torch.Tensor:
    """flat [n, K] as the first n rows of a [padded_rows, K] matrix whose other rows are zero.

    Without autograd the matrix is a buffer kept per thread, shape and dtype: only its first n rows are ever written,
    so the rest stay zero, and a padded product costs one copy of n rows instead of a fresh zero matrix plus a
    concatenation (two allocations and a fill per linear layer). With autograd recording, a fresh matrix (an in-place
    write into a shared buffer would invalidate the graph)."""
    if torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad):
        return torch.cat([flat, flat.new_zeros(padded_rows - flat.shape[0], flat.shape[1])])
    buffers = getattr(_PADDING_BUFFERS, "by_shape", None)
    if buffers is None:
        buffers = _PADDING_BUFFERS.by_shape = {}
    key = (padded_rows, flat.shape[1], flat.dtype, flat.device)
    buffer = buffers.get(key)
    if buffer is None:
        buffer = buffers[key] = flat.new_zeros(padded_rows, flat.shape[1])
    buffer[: flat.shape[0]].copy_(flat)
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
    return (
        weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() >= FEW_ROW_PROBE_MIN_ELEMENTS
    )


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
        cheaper = [m for m in sizes[index + 1 :] if costs[n] >= margin * costs[m]]
        if cheaper:
            table[n] = cheaper[0]
    return table


def row_padding(
    weight: torch.Tensor, *, max_rows: int = FEW_ROWS, rounds: int = 3, reps: int = 3
) -> tuple[RowPadding, dict[int, float]]:
    """Which few-row (W xᵀ)ᵀ products should be computed with more rows on this machine: (the table,
    `padding_from_costs` of the measured costs; those costs {rows: ms}, empty when not probed).

    Measured like `few_row_layout`, for the same weights (fp32 on the CPU, at least `FEW_ROW_PROBE_MIN_ELEMENTS`
    elements), at every row count 1..`max_rows`: the median over `rounds` interleaved rounds of the median of `reps`
    calls (a single median of a few calls flipped the choice between loads under noise). BLAS picks its kernel by
    shape, so the cost of a product is not monotone in its rows. `DSPARK_ROW_PADDING=auto|off|n:m,...` overrides the
    choice (`auto`, the default, probes).
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


def few_row_decision_path(cache_dir: str | Path, fingerprint: str) -> Path:
    """Where a target's measured few-row choice is kept for this machine:
    `<cache>/hardware/few-row-<fingerprint[:16]>-<machine hash>-t<torch threads>.json` (the machine: SPS tables'
    `machine_fingerprint` and the CPU model)."""
    digest = hashlib.sha256(f"{machine_fingerprint()}|{cpu_model()}".encode()).hexdigest()[:12]
    return Path(cache_dir) / "hardware" / f"few-row-{fingerprint[:16]}-{digest}-t{torch.get_num_threads()}.json"


def _read_decision(path: Path) -> tuple[str, RowPadding] | None:
    try:
        record = json.loads(path.read_text())
        layout, padding = record["layout"], parse_row_padding(record["row_padding"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (layout, padding) if layout in ("linear", "transposed") else None


def choose_few_row_layout(
    model: nn.Module, head_weight: Tensor, decision_file: Path | None = None
) -> tuple[str, RowPadding]:
    """Measure once whether this machine's few-row products (a verify forward's ℓ + 1 tokens) are faster in the
    (W xᵀ)ᵀ layout, and switch every `nn.Linear` of the frozen model to it if so (`few_row_layout`: fp32 CPU weights
    only, tiny models never); in that layout, also which row counts are faster computed as more rows
    (`row_padding`, e.g. one row as two). Returns (layout, row padding).

    decision_file: where a measured choice is kept and, when present, read instead of measuring again — the probe's
    choice can vary from load to load on a busy machine, and two runs on one machine must compare the same baseline.
    Delete the file to measure again; `DSPARK_FEW_ROW_LAYOUT` / `DSPARK_ROW_PADDING` still override it."""
    forced = os.environ.get(FEW_ROW_LAYOUT_ENV, "auto") != "auto" or os.environ.get(ROW_PAD_ENV, "auto") != "auto"
    kept = _read_decision(decision_file) if decision_file is not None and not forced else None
    if kept is not None:
        layout, padding = kept
        source = f"kept in {decision_file} (delete it to measure again)"
    else:
        layout, speedup = few_row_layout(head_weight.detach())
        padding, costs = row_padding(head_weight.detach()) if layout == "transposed" else ({}, {})
        source = f"measured: {speedup:.1f}× x Wᵀ's speed on the LM head at 2–4 tokens"
        if costs:
            source += "; LM head ms " + ", ".join(
                f"{n} → {m} rows {costs[n]:.1f} → {costs[m]:.1f}" for n, m in sorted(padding.items())
            )
        # only a measured choice is kept: tiny, bf16 or GPU weights are never probed
        if decision_file is not None and not forced and worth_probing(head_weight):
            record = {
                "layout": layout,
                "row_padding": format_row_padding(padding),
                "layout_speedup": speedup,
                "row_costs_ms": costs,
            }
            try:
                atomic_write_text(decision_file, json.dumps(record, indent=1))
            except OSError as err:  # a convenience, not a result: a read-only cache only means measuring next time
                log.warning("target: could not keep the few-row choice (%s); the next load measures again", err)
    if layout != "transposed":
        return layout, {}
    count = use_few_row_products(model, row_padding=padding)
    log.info(
        "target: %d linear layers compute few-token products as (W xᵀ)ᵀ, row padding %s (%s; %s=linear, "
        "%s=off turn these off)",
        count,
        format_row_padding(padding),
        source,
        FEW_ROW_LAYOUT_ENV,
        ROW_PAD_ENV,
    )
    return layout, padding
