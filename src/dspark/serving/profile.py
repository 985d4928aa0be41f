"""Serving's SPS(B) profiles. The cached profile of the verify forward lives in `dspark.scheduling.profile` (shared
with the single-request engine's scheduler, which uses its R = 1 case) and times a forward on a plain cache; this
module adds the forward the `BatchedEngine` itself runs (`serve.sps_forward=engine`): a 2-D attention mask over a
cache that keeps hole columns, per-token positions, the LM head — what its `seconds_verify` measures.

Why both: a scheduler priced on a forward other than the one the engine runs misjudges ℓ; where the two code paths
cost differently (e.g. a mask-building cost that grows with the cache's holes) serving profiles its own forward
(`benchmarks/bench_sps_forward.py` compares them; docs/LOG.md has the serving run that raised it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from dspark.config.schema import SPS_FORWARDS
from dspark.scheduling.profile import (
    SERVING_CONTEXT_TOKENS,
    load_or_profile_serving_sps,
    load_sps_table,
    monotone_table,
    profile_serving_sps,
    serving_batch_grid,
    serving_sps_path,
    sps_milliseconds,
)
from dspark.scheduling.sps import SPSTable
from dspark.serving.kv import BatchedKVCache, prefill

__all__ = [
    "SERVING_CONTEXT_TOKENS",
    "SPS_FORWARDS",
    "engine_forward",
    "load_or_profile_serving_sps",
    "load_sps_table",
    "monotone_table",
    "profile_serving_sps",
    "serving_batch_grid",
    "serving_sps_path",
    "sps_milliseconds",
    "load_or_profile_sps_of",
]


def engine_forward(target: Any, context: Tensor, generator: torch.Generator) -> Callable[[int], None]:
    """The `BatchedEngine`'s verify forward: the R context rows prefilled as the engine admits requests (`prefill`,
    `BatchedKVCache.add_rows`); each call appends [R, ⌈B/R⌉] tokens at per-token positions after each row's
    committed ones (`BatchedKVCache.forward`) and takes the LM head at every query position (the engine's
    `seconds_verify`); the new columns then become holes, as rejected drafts do, and the cache compacts when the
    engine's would (`maybe_compact`) — so every call sees `context_length` committed tokens per row."""
    kv = BatchedKVCache(target)
    kv.add_rows(prefill(target, context.tolist()))

    def forward_fn(tokens: int) -> None:
        rows = kv.num_rows
        query = math.ceil(tokens / rows)
        ids = torch.randint(0, target.vocab_size, (rows, query), generator=generator).to(target.device)
        positions = kv.lengths.unsqueeze(1) + torch.arange(query, device=target.device).unsqueeze(0)
        valid = torch.ones(rows, query, dtype=torch.bool, device=target.device)
        forward = kv.forward(ids, position_ids=positions, input_valid=valid)
        target.logits_from_hidden(forward.final_hidden)
        kv.keep_new(torch.zeros(rows, dtype=torch.long, device=target.device))
        kv.maybe_compact()

    return forward_fn


def load_or_profile_sps_of(
    forward_name: str, target: Any, *, cache_dir: str | Path, max_batch_tokens: int, num_rows: int, **options: Any
) -> tuple[SPSTable, Path]:
    """The cached serving table of `forward_name` (`SPS_FORWARDS`: plain | engine); see `load_or_profile_serving_sps`."""
    if forward_name not in SPS_FORWARDS:
        raise ValueError(
            f"serve.sps_forward={forward_name!r}: choose one of {', '.join(SPS_FORWARDS)} (plain: a "
            "forward on a plain cache, engine: the batched engine's own verify forward)"
        )
    forward = engine_forward if forward_name == "engine" else None
    return load_or_profile_serving_sps(
        target,
        cache_dir=cache_dir,
        max_batch_tokens=max_batch_tokens,
        num_rows=num_rows,
        forward=forward,
        forward_name=forward_name,
        **options,
    )
