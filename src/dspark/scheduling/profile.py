"""SPS(B) of the verify forward, profiled once per target, machine, row count and context and cached (METHOD §6–§7,
paper §5.3): the one copy used by the single-request engine (`decode.policy=scheduler`, R = 1) and by serving.

At concurrency R the engine verifies all active requests in one target forward: R rows, each appending its
anchor and ℓ_r drafts to its own KV cache, B = Σ_r (1 + ℓ_r) tokens in all. The rows are padded to one query
length, so the profiled forward for B tokens is R rows × q = ⌈B/R⌉ new tokens on R caches of `context_length`
tokens each (the most even split of B over the rows), plus the target's probabilities at every query position
(the engine's `seconds_verify` covers both). The cache is prefilled once and rolled back after every timed call
(`Target.rollback`), so each call sees the same context.

Sizes B < R are not profiled: an R-row forward has at least R tokens, and `SPSTable` answers SPS(R) below its
smallest size, which is what such a step costs. Grid: every B from R up to 16, then a geometric grid (×√2) up to
`max_batch_tokens` (included).

A table is only valid for the target, machine, forward code path, row count and context length it was measured with:
the cache file name carries all five and `SPSTable.matches` re-checks the first two before reuse. The single-request engine's
table is the R = 1 case: B = 1..γ+1 tokens appended to one 256-token cache, p_t at every query position — exactly
the forward its verify step runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from dspark.scheduling.sps import SPSTable, machine_fingerprint, profile_sps

__all__ = [
    "SERVING_CONTEXT_TOKENS",
    "ForwardFactory",
    "load_or_profile_serving_sps",
    "load_sps_table",
    "monotone_table",
    "plain_cache_forward",
    "profile_serving_sps",
    "serving_batch_grid",
    "serving_sps_path",
    "sps_milliseconds",
]

log = logging.getLogger("dspark")
DENSE_GRID_LIMIT = 16  # every B up to here: the small forwards where SPS changes fastest
GEOMETRIC_RATIO = math.sqrt(2.0)
SERVING_CONTEXT_TOKENS = 256  # cached tokens per row by default: a chat prompt plus a few dozen generated tokens
SPS_TABLE_KEY = "serve.sps_table"
#: the revision of the target's forward code path in the cache file name: bump it when a change in our code moves what
#: a verify forward costs, so tables profiled before it are not reused (2: `few_row_product` returns row-major
#: outputs, which took ~20% off a 2–8-token forward on an AVX2 EPYC; 3: one-token products may run as two rows;
#: 4: multi-token forwards attend with grouped-query SDPA instead of copying the KV cache, `dspark.targets.attention`;
#: 5: padded products copy into a kept buffer instead of concatenating a fresh zero matrix, ~1 ms off a 1-token step)
FORWARD_PATH_REVISION = 5


def serving_batch_grid(max_batch_tokens: int, *, num_rows: int = 1) -> list[int]:
    """B values to profile: every B in [num_rows, 16], then ×√2 steps up to `max_batch_tokens` (included)."""
    if num_rows < 1 or max_batch_tokens < num_rows:
        raise ValueError(
            f"serving SPS grid: need 1 <= num_rows ({num_rows}) <= max_batch_tokens "
            f"({max_batch_tokens}); an R-row verify forward has at least R tokens, so profile up to "
            "R·(γ+1)"
        )
    sizes = list(range(num_rows, max(num_rows, min(DENSE_GRID_LIMIT, max_batch_tokens)) + 1))
    size = float(sizes[-1])
    while size < max_batch_tokens:
        size = min(size * GEOMETRIC_RATIO, float(max_batch_tokens))
        if round(size) > sizes[-1]:
            sizes.append(round(size))
    if sizes[-1] != max_batch_tokens:
        sizes.append(max_batch_tokens)
    return sizes


#: builds the timed call of a profile: (target, context ids [R, context_length], generator) → forward_fn(B), one
#: verify forward over B new tokens that leaves the cache as it found it (`profile_sps`)
ForwardFactory = Callable[[Any, Tensor, torch.Generator], Callable[[int], None]]


def plain_cache_forward(target: Any, context: Tensor, generator: torch.Generator) -> Callable[[int], None]:
    """The verify forward on a plain cache (the single-request engine's): R rows × ⌈B/R⌉ tokens appended to the
    prefilled context, the LM head and softmax at every query position, then rolled back (`Target.rollback`)."""
    num_rows, context_length = context.shape
    cache = target.new_cache()
    target.forward(context, cache=cache)

    def forward_fn(tokens: int) -> None:
        query = math.ceil(tokens / num_rows)
        ids = torch.randint(0, target.vocab_size, (num_rows, query), generator=generator).to(target.device)
        forward = target.forward(ids, cache=cache)
        # The verifier needs p_t at every query position: the LM head and softmax are part of the step.
        torch.softmax(target.logits_from_hidden(forward.final_hidden).float(), dim=-1)
        target.rollback(cache, keep=context_length)

    return forward_fn


def profile_serving_sps(
    target: Any,
    *,
    max_batch_tokens: int,
    num_rows: int,
    context_length: int = SERVING_CONTEXT_TOKENS,
    repeats: int = 3,
    warmup: int = 1,
    seed: int = 0,
    batch_tokens: list[int] | None = None,
    monotone: bool = True,
    forward: ForwardFactory | None = None,
) -> SPSTable:
    """Profile SPS(B) of an R-row padded verify forward (module docstring) over `serving_batch_grid`.

    target: a `dspark.targets.Target`. num_rows: R. context_length: cached tokens per row. batch_tokens: an
    explicit grid instead of the default one. monotone: clean timing noise with `monotone_table`. forward: which
    forward is timed (default `plain_cache_forward`; serving's engine passes its own, `dspark.serving.profile`).
    Returns a table tagged with the target's fingerprint and this machine.
    """
    if num_rows < 1 or context_length < 1:
        raise ValueError(
            f"profile_serving_sps: num_rows ({num_rows}) and context_length ({context_length}) must "
            "be >= 1 (serve.concurrency, and the cached context per request)"
        )
    sizes = batch_tokens if batch_tokens is not None else serving_batch_grid(max_batch_tokens, num_rows=num_rows)
    generator = torch.Generator().manual_seed(seed)
    context = torch.randint(0, target.vocab_size, (num_rows, context_length), generator=generator).to(target.device)
    forward_fn = (forward or plain_cache_forward)(target, context, generator)
    table = profile_sps(
        forward_fn, batch_tokens=sizes, repeats=repeats, warmup=warmup, target_fingerprint=target.fingerprint
    )
    return monotone_table(table) if monotone else table


def monotone_table(table: SPSTable) -> SPSTable:
    """The table with each step time replaced by the least time measured at this or any larger size.

    A forward over more tokens is never faster, and load from other processes only ever adds time: if every
    measurement is at or above the true time, so is the smallest one at B' >= B, which is also at most the
    measurement at B. This removes the rises of SPS(B) in B that a busy machine leaves in a table (not a table
    measured under load throughout).
    """
    times = [1.0 / s for s in table.steps_per_second]
    for index in range(len(times) - 2, -1, -1):
        times[index] = min(times[index], times[index + 1])
    return SPSTable(
        table.batch_tokens,
        [1.0 / t for t in times],
        target_fingerprint=table.target_fingerprint,
        machine=table.machine,
        created=table.created,
    )


def serving_sps_path(
    cache_dir: str | Path, target: Any, *, num_rows: int, context_length: int, forward_name: str = "plain"
) -> Path:
    """`<cache>/sps/serving-<target fingerprint[:16]>-<machine hash>-f<forward path>-r<R>-c<context>[-<forward>].json`;
    the forward path is `FORWARD_PATH_REVISION`, the target's few-row layout (`Target.few_row_layout`) and, where it
    pads row counts (`Target.row_padding`), p and the table's pairs (`p1.2-3.4`: one row as two, three as four);
    `forward_name` names a timed forward other than the plain cache's (`-engine`: serving's batched engine)."""
    machine = hashlib.sha256(machine_fingerprint().encode()).hexdigest()[:12]
    padding = getattr(target, "row_padding", None) or {}
    padded = ("p" + "-".join(f"{n}.{m}" for n, m in sorted(padding.items()))) if padding else ""
    layout = getattr(target, "few_row_layout", "linear")[0] + padded
    name = (
        f"serving-{target.fingerprint[:16]}-{machine}-f{FORWARD_PATH_REVISION}{layout}"
        f"-r{num_rows}-c{context_length}{'' if forward_name == 'plain' else '-' + forward_name}.json"
    )
    return Path(cache_dir) / "sps" / name


def load_or_profile_serving_sps(
    target: Any,
    *,
    cache_dir: str | Path,
    max_batch_tokens: int,
    num_rows: int,
    context_length: int = SERVING_CONTEXT_TOKENS,
    repeats: int = 3,
    refresh: bool = False,
    forward: ForwardFactory | None = None,
    forward_name: str = "plain",
) -> tuple[SPSTable, Path]:
    """The cached serving SPS table of this target, machine, R and context; profiled when missing or stale.

    A cached table from another target or machine, one that does not reach `max_batch_tokens`, or an unreadable
    file is re-profiled with a logged warning. `forward` / `forward_name`: another timed forward and the name its
    tables are cached under (`profile_serving_sps`, `serving_sps_path`). Returns (table, path of the JSON cache).
    """
    path = serving_sps_path(
        cache_dir, target, num_rows=num_rows, context_length=context_length, forward_name=forward_name
    )
    if path.exists() and not refresh:
        cached = _reusable(path, target=target, max_batch_tokens=max_batch_tokens)
        if cached is not None:
            return cached, path
    log.info(
        "profiling the batched verify forward SPS(B) (%s forward) for B <= %d tokens, %d rows × %d cached "
        "tokens (once per target, machine, rows and context) → %s",
        forward_name,
        max_batch_tokens,
        num_rows,
        context_length,
        path,
    )
    table = profile_serving_sps(
        target,
        max_batch_tokens=max_batch_tokens,
        num_rows=num_rows,
        context_length=context_length,
        repeats=repeats,
        forward=forward,
    )
    table.save(path)
    return table, path


def _reusable(path: Path, *, target: Any, max_batch_tokens: int) -> SPSTable | None:
    try:
        table = SPSTable.load(path)
    except (ValueError, TypeError, json.JSONDecodeError) as error:
        log.warning("serving SPS table %s is unreadable (%s); re-profiling", path, error)
        return None
    if not table.matches(target.fingerprint, machine_fingerprint()):
        log.warning(
            "serving SPS table %s was profiled for another target or machine (%s); re-profiling", path, table.machine
        )
        return None
    if table.batch_tokens[-1] < max_batch_tokens:
        log.warning(
            "serving SPS table %s covers B <= %d but %d tokens were asked for; re-profiling",
            path,
            table.batch_tokens[-1],
            max_batch_tokens,
        )
        return None
    return table


def load_sps_table(path: str | Path) -> SPSTable:
    """An SPS table profiled elsewhere (e.g. on a GPU) for the simulator; no target or machine check.

    Raises ValueError naming the file when it is missing or not an `SPSTable` JSON.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"{SPS_TABLE_KEY}={path}: no such file; give the JSON written by "
            "load_or_profile_serving_sps (or SPSTable.save) on the machine being modelled"
        )
    try:
        return SPSTable.load(path)
    except (ValueError, TypeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{SPS_TABLE_KEY}={path} is not an SPS table ({error}); expected JSON with "
            "batch_tokens and steps_per_second lists as written by SPSTable.save"
        ) from error


def sps_milliseconds(table: SPSTable) -> list[tuple[int, float]]:
    """(B, ms per forward) for every profiled size."""
    return [(b, 1000.0 / s) for b, s in zip(table.batch_tokens, table.steps_per_second)]
