"""Timing diagnostics: the scheduler's SPS table and the per-round latency breakdown (paper Fig. 4 right).

- SPS(B) (METHOD §6): one target forward of B = 1..γ+1 new tokens appended to a ~256-token KV cache (rolled back
  after every call), median of 5 timed calls — the R = 1 case of the one cached profile (`scheduling.profile`,
  `<cache>/sps/serving-<target>-<machine>-r1-c256.json`); a table whose recorded target or machine differs, or that
  does not reach γ+1, is re-profiled with a warning.
- Latency breakdown: untrained DSpark drafters (timing does not depend on the weights) with heads none / markov / rnn
  at several block sizes, fixed ℓ = γ, on a context of random tokens of a given length; the engine's per-round
  timings (verification, parallel draft, sequential loop, the rest) are medians over a few rounds. The `latency`
  sweep runs it per cell (`sweeps.latency`) and `reports.diagnostics` draws it; the static threshold sweep (Fig. 5)
  is `sweep=threshold` (decode.policy=threshold cells) with its report.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from dspark.scheduling import SPSTable
from dspark.scheduling.profile import load_or_profile_serving_sps

SPS_CONTEXT_TOKENS = 256
TIMES = {
    "seconds_verify": "verify_ms",
    "seconds_draft_parallel": "draft_parallel_ms",
    "seconds_draft_sequential": "draft_sequential_ms",
    "seconds_other": "other_ms",
}


# ---- SPS(B) for the scheduler ----


def load_or_profile_sps(
    *, target: Any, cache_dir: str | Path, block_size: int, refresh: bool = False
) -> tuple[SPSTable, Path]:
    """The cached SPS table of this target and machine covering B = 1..γ+1 (R = 1), profiling it when missing or
    stale — the one cache of `dspark.scheduling.profile`, shared with serving."""
    return load_or_profile_serving_sps(
        target,
        cache_dir=cache_dir,
        max_batch_tokens=block_size + 1,
        num_rows=1,
        context_length=SPS_CONTEXT_TOKENS,
        repeats=5,
        refresh=refresh,
    )


def sps_markdown(table: SPSTable) -> str:
    """The table as markdown: B, steps/s, ms per forward."""
    rows = [f"| {b} | {s:.2f} | {1000.0 / s:.2f} |" for b, s in zip(table.batch_tokens, table.steps_per_second)]
    return "\n".join(["| B tokens | SPS (forwards/s) | ms / forward |", "|---|---|---|", *rows])


# ---- latency breakdown (paper Fig. 4 right) ----


def untrained_dspark(target: Any, *, head: str, block_size: int, depth: int, markov_rank: int, seed: int = 0):
    """A randomly initialised DSpark drafter of the given head and γ around `target` (for timing only)."""
    from dspark.drafters.factory import DrafterSpec, build_drafter

    spec = DrafterSpec(
        kind="dspark",
        head=head,
        depth=depth,
        block_size=block_size,
        markov_rank=markov_rank if head != "none" else 0,
        feature_layers=tuple(target.feature_layer_ids),
        mask_token_id=target.mask_token_id,
        target_fingerprint=target.fingerprint,
    )
    torch.manual_seed(seed)
    return build_drafter(spec, target).to(target.device).eval()


def random_context(target: Any, *, length: int, seed: int) -> list[int]:
    """`length` random token ids avoiding the MASK and stop ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (length * 2,), generator=generator).tolist()
    banned = {target.mask_token_id, *target.stop_token_ids}
    return [i for i in ids if i not in banned][:length]


def time_rounds(*, target: Any, drafter: Any, context: list[int], rounds: int, seed: int) -> dict[str, float]:
    """Median ms per round of each phase over `rounds` rounds with the fixed policy (after one warm-up call).

    Generations of `rounds` new tokens are repeated (fresh seeds) until `rounds` rounds are collected, so a drafter
    that happens to be accepted (few rounds per call) is timed over as many rounds as one that is not. Medians,
    not means: on a shared machine a single preempted round would dominate a mean.
    """
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.policies import build_policy
    from dspark.decoding.proposers import build_proposer

    engine = SpeculativeEngine(
        target=target,
        proposer=build_proposer(drafter),
        policy=build_policy("fixed"),
        temperature=1.0,
        max_new_tokens=max(2, rounds),
    )
    engine.generate(context, generator=torch.Generator(device=target.device).manual_seed(seed), max_new_tokens=2)
    records: list[Any] = []
    for attempt in range(rounds):
        generator = torch.Generator(device=target.device).manual_seed(seed + 1 + attempt)
        records += engine.generate(context, generator=generator).rounds
        if len(records) >= rounds:
            break
    records = records[:rounds]
    out = {
        name: 1000.0 * statistics.median(getattr(r, key) for r in records) if records else float("nan")
        for key, name in TIMES.items()
    }
    out["round_ms"] = sum(out[name] for name in TIMES.values())
    out["rounds"] = len(records)
    out["sequential_share"] = out["draft_sequential_ms"] / out["round_ms"] if out["round_ms"] else float("nan")
    return out


def time_steps(
    *, target: Any, drafter: Any, context: list[int], rounds: int, seed: int, concurrency: int
) -> dict[str, float]:
    """`time_rounds` for R = `concurrency` requests served together by the BatchedEngine (paper Fig. 4 right at a
    batch): R copies of the context, the fixed policy (ℓ_r = γ), median ms per step of each phase over the steps
    after the first (which carries the R prefills) while all R requests are active."""
    from dspark.decoding.policies import build_policy
    from dspark.serving.engine import BatchedEngine, ServeRequest

    # room for `rounds` steps even if every draft were accepted (γ + 1 tokens a step), plus the first step
    limit = (rounds + 2) * (drafter.block_size + 1)
    engine = BatchedEngine(
        target=target, drafter=drafter, policy=build_policy("fixed"), temperature=1.0, max_new_tokens=limit
    )
    requests = [ServeRequest(request_id=r, prompt_ids=list(context)) for r in range(concurrency)]
    engine.serve(requests[:1], concurrency=1, seed=seed, progress=False)  # warm-up
    served = engine.serve(requests, concurrency=concurrency, seed=seed + 1, progress=False).steps
    # every request joins before step 0 (concurrency = R = the requests), so later steps carry no prefill
    steps = [s for s in served[1:] if s.num_active == concurrency][:rounds]
    phases = {
        "verify_ms": [s.seconds_verify for s in steps],
        "draft_parallel_ms": [s.seconds_draft - s.seconds_draft_sequential for s in steps],
        "draft_sequential_ms": [s.seconds_draft_sequential for s in steps],
        "other_ms": [s.seconds_other for s in steps],
    }
    out = {name: 1000.0 * statistics.median(v) if v else float("nan") for name, v in phases.items()}
    out["round_ms"] = sum(out[name] for name in phases)
    out["rounds"] = len(steps)
    out["sequential_share"] = out["draft_sequential_ms"] / out["round_ms"] if out["round_ms"] else float("nan")
    return out


def latency_breakdown(
    *,
    target: Any,
    heads: Sequence[str] = ("none", "markov", "rnn"),
    block_sizes: Sequence[int] = (3, 7, 11, 15),
    context_lengths: Sequence[int] = (256, 1024),
    rounds: int = 8,
    depth: int = 5,
    markov_rank: int = 256,
    seed: int = 0,
    concurrency: Sequence[int] = (1,),
    show_progress: bool = True,
) -> list[dict]:
    """One row per (concurrency R, context length, head, block size) with the median ms per round (R = 1, the
    single-request engine) or per step (R > 1, the BatchedEngine) of each phase."""
    cells = [(r, c, h, b) for r in concurrency for c in context_lengths for b in block_sizes for h in heads]
    rows = []
    for requests, context_length, head, block_size in tqdm(
        cells, desc="latency breakdown", unit="cell", disable=not show_progress
    ):
        drafter = untrained_dspark(
            target, head=head, block_size=block_size, depth=depth, markov_rank=markov_rank, seed=seed
        )
        context = random_context(target, length=context_length, seed=seed)
        common = {"target": target, "drafter": drafter, "context": context, "rounds": rounds, "seed": seed}
        timing = time_rounds(**common) if requests == 1 else time_steps(**common, concurrency=int(requests))
        rows.append(
            {"concurrency": int(requests), "context_length": context_length, "head": head, "block_size": block_size}
            | timing
        )
    return rows
