"""Timing and policy diagnostics: the scheduler's SPS table, the static threshold sweep (paper Fig. 5) and the
per-round latency breakdown (paper Fig. 4 right).

- SPS(B) (METHOD §6): one target forward of B = 1..γ+1 new tokens appended to a ~256-token KV cache (rolled back
  after every call), median of 5 timed calls — the R = 1 case of the one cached profile (`scheduling.profile`,
  `<cache>/sps/serving-<target>-<machine>-r1-c256.json`); a table whose recorded target or machine differs, or that
  does not reach γ+1, is re-profiled with a warning.
- Threshold sweep: for each θ in a grid, decode the prompts with the threshold policy (verify the prefix before the
  first c_k < θ) and report, per domain (rounds pooled over its prompts), accepted and rejected drafts per round and
  the verify rate Σ τ / Σ (ℓ_eff + 1).
- Latency breakdown: untrained DSpark drafters (timing does not depend on the weights) with heads none / markov / rnn
  at several block sizes, fixed ℓ = γ, on a context of random tokens of a given length; the engine's per-round
  timings (verification, parallel draft, sequential loop, the rest) are medians over a few rounds.
"""
from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any, Sequence

import polars as pl
import torch
from tqdm.auto import tqdm

from dspark.evaluation.plots import plot_latency_breakdown, plot_threshold_sweep
from dspark.evaluation.rollouts import EvalPrompt, run_rollouts
from dspark.files import atomic_write_text
from dspark.scheduling import SPSTable
from dspark.scheduling.profile import load_or_profile_serving_sps, profile_serving_sps, serving_sps_path

log = logging.getLogger("dspark")
SPS_CONTEXT_TOKENS = 256
TIMES = {"seconds_verify": "verify_ms", "seconds_draft_parallel": "draft_parallel_ms",
         "seconds_draft_sequential": "draft_sequential_ms", "seconds_other": "other_ms"}


# ---- SPS(B) for the scheduler ----

def sps_table_path(cache_dir: str | Path, target: Any) -> Path:
    """Where the single-request table is cached: the R = 1, 256-token-context file of `scheduling.profile`."""
    return serving_sps_path(cache_dir, target, num_rows=1, context_length=SPS_CONTEXT_TOKENS)


def profile_target_sps(target: Any, *, max_tokens: int, context_tokens: int = SPS_CONTEXT_TOKENS,
                       repeats: int = 5, seed: int = 0) -> SPSTable:
    """Time one target forward of B = 1..max_tokens tokens (and p_t at each) appended to a `context_tokens` cache."""
    return profile_serving_sps(target, max_batch_tokens=max_tokens, num_rows=1, context_length=context_tokens,
                               repeats=repeats, seed=seed, batch_tokens=list(range(1, max_tokens + 1)))


def load_or_profile_sps(*, target: Any, cache_dir: str | Path, block_size: int,
                        refresh: bool = False) -> tuple[SPSTable, Path]:
    """The cached SPS table of this target and machine covering B = 1..γ+1 (R = 1), profiling it when missing or
    stale — the one cache of `dspark.scheduling.profile`, shared with serving."""
    return load_or_profile_serving_sps(target, cache_dir=cache_dir, max_batch_tokens=block_size + 1, num_rows=1,
                                       context_length=SPS_CONTEXT_TOKENS, repeats=5, refresh=refresh)


def sps_markdown(table: SPSTable) -> str:
    """The table as markdown: B, steps/s, ms per forward."""
    rows = [f"| {b} | {s:.2f} | {1000.0 / s:.2f} |" for b, s in zip(table.batch_tokens, table.steps_per_second)]
    return "\n".join(["| B tokens | SPS (forwards/s) | ms / forward |", "|---|---|---|", *rows])


# ---- static threshold sweep (paper Fig. 5) ----

def threshold_sweep(*, target: Any, proposer: Any, prompts: Sequence[EvalPrompt], thresholds: Sequence[float],
                    temperature: float, max_new_tokens: int, seed: int, calibration: Any = None,
                    show_progress: bool = True) -> list[dict]:
    """Decode `prompts` once per threshold; one row per (threshold, domain) plus domain 'all'."""
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.policies import build_policy

    rows = []
    for threshold in thresholds:
        policy = build_policy("threshold", threshold=float(threshold))  # raw c_k (Fig. 5); c̃ is recorded
        engine = SpeculativeEngine(target=target, proposer=proposer, policy=policy, temperature=temperature,
                                   max_new_tokens=max_new_tokens, calibration=calibration)
        rollouts = run_rollouts({"speculative": engine}, prompts, seed=seed, desc=f"threshold {threshold:g}",
                                show_progress=show_progress)
        rows.extend(sweep_rows(rollouts, threshold=float(threshold)))
    return rows


def sweep_rows(rollouts: Sequence[Any], *, threshold: float) -> list[dict]:
    """Per-domain (and 'all') accepted / rejected drafts per round, verify rate and pooled τ of one threshold."""
    frame = pl.DataFrame([{"domain": r.domain, "verified": int(rd["num_verified"]), "accepted": int(rd["num_accepted"]),
                           "committed": int(rd["committed"])} for r in rollouts for rd in r.rounds],
                         schema={"domain": pl.String, "verified": pl.Int64, "accepted": pl.Int64,
                                 "committed": pl.Int64})
    frame = pl.concat([frame, frame.with_columns(pl.lit("all").alias("domain"))])
    stats = frame.group_by("domain").agg(
        pl.len().alias("rounds"), pl.col("accepted").mean().alias("accepted_per_round"),
        (pl.col("verified") - pl.col("accepted")).mean().alias("rejected_per_round"),
        pl.col("verified").mean().alias("verified_per_round"), pl.col("committed").mean().alias("tau"),
        (pl.col("committed").sum() / (pl.col("verified") + 1).sum()).alias("verify_rate"))
    return [row | {"threshold": threshold} for row in stats.sort("domain").to_dicts()]


def sweep_markdown(rows: Sequence[dict]) -> str:
    header = "| domain | θ | rounds | accepted / round | rejected / round | verify rate | τ pooled |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["domain"], r["threshold"])):
        lines.append(f"| {r['domain']} | {r['threshold']:g} | {r['rounds']} | {r['accepted_per_round']:.2f} | "
                     f"{r['rejected_per_round']:.2f} | {r['verify_rate']:.3f} | {r['tau']:.2f} |")
    return "\n".join(lines)


def write_threshold_sweep(rows: Sequence[dict], out_dir: str | Path, *, stem: str = "threshold-sweep"
                          ) -> tuple[Path, Path]:
    """Plot (domains other than 'all') and markdown table; returns their paths."""
    out_dir = Path(out_dir)
    png = plot_threshold_sweep([r for r in rows if r["domain"] != "all"] or list(rows), out_dir / f"{stem}.png")
    table = out_dir / f"{stem}.md"
    atomic_write_text(table, f"# Static threshold sweep (paper Fig. 5)\n\n![sweep]({png.name})\n\n"
                             f"{sweep_markdown(rows)}\n")
    return png, table


# ---- latency breakdown (paper Fig. 4 right) ----

def untrained_dspark(target: Any, *, head: str, block_size: int, depth: int, markov_rank: int, seed: int = 0):
    """A randomly initialised DSpark drafter of the given head and γ around `target` (for timing only)."""
    from dspark.drafters.factory import DrafterSpec, build_drafter

    spec = DrafterSpec(kind="dspark", head=head, depth=depth, block_size=block_size,
                       markov_rank=markov_rank if head != "none" else 0,
                       feature_layers=tuple(target.feature_layer_ids), mask_token_id=target.mask_token_id,
                       target_fingerprint=target.fingerprint)
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

    engine = SpeculativeEngine(target=target, proposer=build_proposer(drafter), policy=build_policy("fixed"),
                               temperature=1.0, max_new_tokens=max(2, rounds))
    engine.generate(context, generator=torch.Generator(device=target.device).manual_seed(seed), max_new_tokens=2)
    records: list[Any] = []
    for attempt in range(rounds):
        generator = torch.Generator(device=target.device).manual_seed(seed + 1 + attempt)
        records += engine.generate(context, generator=generator).rounds
        if len(records) >= rounds:
            break
    records = records[:rounds]
    out = {name: 1000.0 * statistics.median(getattr(r, key) for r in records) if records else float("nan")
           for key, name in TIMES.items()}
    out["round_ms"] = sum(out[name] for name in TIMES.values())
    out["rounds"] = len(records)
    out["sequential_share"] = out["draft_sequential_ms"] / out["round_ms"] if out["round_ms"] else float("nan")
    return out


def latency_breakdown(*, target: Any, heads: Sequence[str] = ("none", "markov", "rnn"),
                      block_sizes: Sequence[int] = (3, 7, 11, 15), context_lengths: Sequence[int] = (256, 1024),
                      rounds: int = 8, depth: int = 5, markov_rank: int = 256, seed: int = 0,
                      show_progress: bool = True) -> list[dict]:
    """One row per (context length, head, block size) with the mean ms per round of each phase."""
    cells = [(c, h, b) for c in context_lengths for b in block_sizes for h in heads]
    rows = []
    for context_length, head, block_size in tqdm(cells, desc="latency breakdown", unit="cell",
                                                 disable=not show_progress):
        drafter = untrained_dspark(target, head=head, block_size=block_size, depth=depth,
                                   markov_rank=markov_rank, seed=seed)
        context = random_context(target, length=context_length, seed=seed)
        timing = time_rounds(target=target, drafter=drafter, context=context, rounds=rounds, seed=seed)
        rows.append({"context_length": context_length, "head": head, "block_size": block_size, **timing})
    return rows


def latency_markdown(rows: Sequence[dict]) -> str:
    header = ("| context | head | γ | rounds | verify ms | draft parallel ms | draft sequential ms | other ms | "
              "round ms (Σ medians) | sequential share |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context_length']} | {r['head']} | {r['block_size']} | {r['rounds']} | "
                     f"{r['verify_ms']:.1f} | {r['draft_parallel_ms']:.1f} | {r['draft_sequential_ms']:.2f} | "
                     f"{r['other_ms']:.1f} | {r['round_ms']:.1f} | {100 * r['sequential_share']:.1f}% |")
    return "\n".join(lines)


def write_latency_breakdown(rows: Sequence[dict], out_dir: str | Path, *, stem: str = "latency-breakdown"
                            ) -> tuple[Path, Path]:
    """Plot and markdown table; returns their paths."""
    out_dir = Path(out_dir)
    png = plot_latency_breakdown(rows, out_dir / f"{stem}.png")
    table = out_dir / f"{stem}.md"
    atomic_write_text(table, "# Latency per round (paper Fig. 4 right; untrained drafters, fixed ℓ = γ)\n\n"
                      f"![latency]({png.name})\n\n{latency_markdown(rows)}\n")
    return png, table
