"""Decoding speed side by side on this machine, in one run: our engine with each drafter under every policy vs
target-only vs transformers' own decoding (issue 11), and each drafter with draft trees (issue 53).

Modes, on the same chat-templated prompts (the first `--prompts` of each default eval set), interleaved prompt by
prompt (so load drift hits all alike), each after one warm-up call, at every `--temperatures` value:
- `target-only`: our engine without a proposer (one target forward per token, the same sampler and verifier);
- `HF generate`: `target.model.generate` (sampling with top_k=0, top_p=1 at T > 0; greedy at T = 0);
- `HF prompt lookup`: the same with `prompt_lookup_num_tokens=γ` (transformers' lossless n-gram drafting);
- each drafter (`--drafter NAME=RUN_DIR_OR_DRAFTER_PT`, repeatable; without any, untrained DSpark-markov, DFlash and
  EAGLE-3 stand-ins of `--depth` / `--block-size` / `--draft-vocab`, which measure round costs only: τ ≈ 1) under
  `fixed` (ℓ = γ), every static ℓ = 1..γ−1 and `scheduler` (this machine's SPS(B) profile, cached, and the STS
  calibration stored in the drafter.pt at that temperature when there is one; raw confidences otherwise), once on
  the profile and once re-priced after every round from the rounds' own costs (`--step-costs`,
  `decode.step_costs=measured`, `dspark.scheduling.measured`; its final prices are listed);
- each drafter with draft trees (`TreeEngine`, METHOD §5.1; `--trees`, on by default, `--no-trees` skips them), one
  row per `--tree-shapes` entry: by default `widths[4,2,2,1,1,1,1]` with rrsw (each expanded node's first child drawn
  from the draft distribution, then the best others) and with descent (deterministic top-k), `branching[3,1,1,1]`,
  `dynamic12b4` and `dynamic32b6` (rrsw; N sized per round on the same SPS(B) table as the scheduler rows, which is
  then profiled up to B = nodes + 1). At T = 0 every scheme is greedy descent.
Columns: tokens/s (prefill included), ratio to target-only with its paired bootstrap 95% CI over prompts, the same
against the faster of target-only and `HF generate` at that temperature (the issue's speed targets are stated against
the faster of the two), τ, mean ℓ (a tree: its depth), mean tree nodes N, and ms per round split into verify (target
forward, p_t and the verifier's rejection sampling) / draft parallel (block forward + LM head + context update; a
tree: its whole drafting) / draft sequential (Markov loop with the policy's drafting stop; all of EAGLE-3's chain) /
other (calibration, policy, commit, rollback, records; a tree: sizing, KV compaction: the engine's Python overhead).
Each scheduler row is compared with its drafter's fixed and static rows (ratio, paired 95% CI, ahead / behind / not
distinguishable); each tree row with its drafter's fixed ℓ = γ and scheduler chains the same way. The round-cost
section reads the γ = 7 DSpark rows: the sequential loop's share of a round and the drafter's round against one plain
target step, and every tree row's drafting and Python overhead (issue 53's targets: ≤ 15% of a plain step for a
32-node tree, ≤ 1 ms). The headroom section replays static ℓ and the hindsight policy (each round's ℓ chosen knowing
its accepted count) on each drafter's fixed-ℓ = γ rounds with this run's verify cost per ℓ
(`dspark.evaluation.headroom`): the most any verify-length policy, the scheduler included, could be ahead of the best
static ℓ — read the scheduler's paired CIs against it.
Writes `--output` (default outputs/benchmarks/decoding.md) with the command, machine (CPU model, its bf16
instructions, drafter precision), load averages and git commit. The target cache defaults to `<repo>/outputs/cache`
($DSPARK_BENCH_CACHE overrides it).

    .venv/bin/python benchmarks/bench_decoding.py --quick                                  # minutes: round costs
    .venv/bin/python benchmarks/bench_decoding.py --quick --no-trees                       # chains only
    .venv/bin/python benchmarks/bench_decoding.py --quick --tree-shapes 'widths[4,2,1]' dynamic16b4 \\
        'branching[2,2,1]@descent'                                                          # other trees
    .venv/bin/python benchmarks/bench_decoding.py --drafter dspark=outputs/runs/<run> --drafter dflash=... \\
        --drafter eagle3=...                                                                # the full comparison
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from common import (
    RESULTS,
    Drafter,
    add_target_arguments,
    command_line,
    git_commit,
    load_verdict,
    machine_line,
    relative_argument,
    repo_path,
    start_timing,
    trained_drafters,
    untrained_drafters,
    write_result,
)

PHASES = (
    ("seconds_verify", "verify"),
    ("seconds_draft_parallel", "draft parallel"),
    ("seconds_draft_sequential", "draft sequential"),
    ("seconds_other", "other"),
)
TARGET_ONLY = "target-only (our engine)"
HF_GENERATE = "HF generate"
DEFAULT_TREE_SHAPES = [
    "widths[4,2,2,1,1,1,1]",
    "widths[4,2,2,1,1,1,1]@descent",
    "branching[3,1,1,1]",
    "dynamic12b4",
    "dynamic32b6",
]


@dataclasses.dataclass(frozen=True)
class TreeRow:
    """One `--tree-shapes` entry: the shape and its verifier at T > 0 (at T = 0 every tree runs `descent`)."""

    shape: object  # dspark.decoding.tree.TreeShape
    scheme: str

    def scheme_at(self, temperature: float) -> str:
        return self.scheme if temperature > 0 else "descent"

    def label(self, temperature: float) -> str:
        return f"tree {self.shape.label()} {self.scheme_at(temperature)}"


_TREE_SPEC = re.compile(
    r"(?P<kind>widths|branching)(?:\[(?P<list1>\d+(?:,\d+)*)\]|:(?P<list2>\d+(?:,\d+)*))"
    r"|dynamic(?P<nodes>\d+)(?:b(?P<beam>\d+))?(?:d(?P<depth>\d+))?"
)


def parse_tree_shape(text: str) -> TreeRow:
    """`widths[4,2,2]` / `widths:4,2,2`, `branching[3,1,1]`, `dynamicNbBdD` (b, d optional: beam 4, depth γ), each
    optionally `@descent` / `@rrsw` (default rrsw: drawn children accepted by rejection sampling, then descent on the
    residual; METHOD §5.1) — `TreeShape.label()`'s syntax."""
    from dspark.decoding.tree import TreeShape

    spec, _, scheme = text.replace(" ", "").partition("@")
    match = _TREE_SPEC.fullmatch(spec)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"--tree-shapes {text!r}: expected widths[4,2,2,1], branching[3,1,1], dynamicNbB[dD] (e.g. dynamic12b4), "
            "optionally followed by @descent or @rrsw"
        )
    if match["kind"]:
        values = tuple(int(v) for v in (match["list1"] or match["list2"]).split(","))
        shape_args = {"widths": values} if match["kind"] == "widths" else {"branching": values}
        kind = match["kind"]
    else:
        kind = "dynamic"
        shape_args = {"nodes": int(match["nodes"]), "beam": int(match["beam"] or 4), "depth": int(match["depth"] or 0)}
    scheme = scheme or "rrsw"
    if scheme not in ("descent", "rrsw"):
        raise argparse.ArgumentTypeError(f"--tree-shapes {text!r}: scheme must be descent or rrsw")
    try:
        return TreeRow(TreeShape(kind=kind, **shape_args), scheme)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--tree-shapes {text!r}: {error}") from error


def parse_args(argv: list[str]) -> argparse.Namespace:
    from dspark.config.schema import DecodeConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a trained drafter: run directory or drafter.pt (repeatable)",
    )
    parser.add_argument("--sets", nargs="+", default=DecodeConfig().eval_sets)
    parser.add_argument("--prompts", type=int, default=10, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    parser.add_argument("--static", type=int, nargs="*", default=None, help="static ℓ values (default 1..γ-1)")
    parser.add_argument("--no-scheduler", action="store_true")
    parser.add_argument(
        "--trees",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tree rows (TreeEngine) for every drafter, one per --tree-shapes entry (--no-trees: chains only)",
    )
    parser.add_argument(
        "--tree-shapes",
        nargs="+",
        type=parse_tree_shape,
        default=None,
        metavar="SHAPE",
        help="tree shapes: widths[4,2,2,1,1,1,1] | branching[3,1,1,1] | dynamicNbB[dD] (N nodes at most, sized on "
        "SPS(B); beam B, depth D = γ by default), each optionally @descent | @rrsw (default rrsw; at T = 0 both are "
        f"greedy descent). Default: {' '.join(DEFAULT_TREE_SHAPES)}",
    )
    parser.add_argument(
        "--step-costs",
        nargs="+",
        default=["profile", "measured"],
        choices=["profile", "measured"],
        help="decode.step_costs of the scheduler rows, one row each: profile (the SPS(B) table of "
        "the start of the run) and measured (re-priced from the rounds' own costs)",
    )
    parser.add_argument(
        "--reuse-sps",
        action="store_true",
        help="read the cached SPS(B) table instead of profiling it at the start of this run (a table "
        "measured under another load misleads the scheduler: the rounds then pay other costs)",
    )
    parser.add_argument(
        "--static-drafters",
        type=int,
        default=None,
        metavar="N",
        help="static ℓ rows for the first N drafters only (default: every drafter)",
    )
    parser.add_argument("--block-size", type=int, default=7, help="γ of untrained drafters and of prompt lookup")
    parser.add_argument("--depth", type=int, default=5, help="draft layers of untrained DSpark/DFlash drafters")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="Vd of untrained drafters (0 = full V)")
    parser.add_argument("--precision", default="auto", help="decode.drafter_precision: auto | fp32 | bf16 | int8")
    parser.add_argument(
        "--also-precision",
        nargs="*",
        default=[],
        metavar="PRECISION",
        help="every drafter again at these decode.drafter_precision values (rows named [int8], say), "
        "side by side with --precision in the same run",
    )
    parser.add_argument(
        "--target-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="target.dtype of every mode (the baseline too): bfloat16 flattens the cost of verifying "
        "2–8 tokens on AMX-BF16 CPUs",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 prompts per set, 24 tokens, T = 1, static ℓ 1 and 3: round costs in minutes",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "decoding.md")
    args = parser.parse_args(argv)
    if args.tree_shapes is None:
        args.tree_shapes = [parse_tree_shape(text) for text in DEFAULT_TREE_SHAPES]
    if not args.trees:
        args.tree_shapes = []
    if args.quick:
        args.prompts, args.max_new_tokens, args.temperatures = min(args.prompts, 2), min(args.max_new_tokens, 24), [1.0]
        args.static = [1, 3] if args.static is None else args.static
    return args


# ---- drafters and modes ----


def calibration_for(drafter: Drafter, temperature: float):
    """The STS fit stored in drafter.pt at this temperature, or None (then the scheduler reads raw c_k)."""
    from dspark.evaluation.calibrate import calibration_key, entry_to_report

    entry = (drafter.payload.get("calibration") or {}).get(calibration_key(temperature))
    return entry_to_report(entry)[0].sts if entry else None


Mode = Callable[[object], dict]  # prompt → {"tokens", "seconds", "rounds"}


def engine_mode(
    target,
    drafter: Drafter | None,
    policy: str,
    *,
    temperature: float,
    args,
    sps=None,
    static_k: int = 0,
    step_costs: str = "profile",
) -> Mode:
    from dspark.decoding import SpeculativeEngine, build_policy, build_proposer

    calibration = calibration_for(drafter, temperature) if drafter is not None and policy == "scheduler" else None
    engine = SpeculativeEngine(
        target=target,
        proposer=None
        if drafter is None
        else build_proposer(drafter.module, precision=drafter.precision or args.precision),
        policy=build_policy(policy, static_k=static_k, sps=sps),
        temperature=temperature,
        max_new_tokens=args.max_new_tokens,
        calibration=calibration,
        step_costs=step_costs,
    )

    return engine_run(engine, target, args)


def engine_run(engine, target, args) -> Mode:
    """The mode of one engine (`SpeculativeEngine` or `TreeEngine`): a generation per prompt, its own seed."""
    from dspark.evaluation.rollouts import prompt_generator

    def run(prompt, max_new_tokens=None):
        result = engine.generate(
            prompt.input_ids,
            max_new_tokens=max_new_tokens,
            generator=prompt_generator(seed=args.seed, prompt=prompt, device=target.device),
        )
        return {"tokens": len(result.new_tokens), "seconds": result.total_seconds, "rounds": result.rounds}

    run.engine = engine
    return run


def tree_mode(target, drafter: Drafter, row: TreeRow, *, temperature: float, args, sps) -> Mode:
    """The drafter with draft trees of `row`'s shape (`TreeEngine`); dynamic trees sized on `sps` (up to N + 1)."""
    from dspark.decoding import build_proposer
    from dspark.decoding.tree_engine import TreeEngine

    engine = TreeEngine(
        target=target,
        proposer=build_proposer(drafter.module, precision=drafter.precision or args.precision),
        shape=row.shape,
        scheme=row.scheme_at(temperature),
        temperature=temperature,
        max_new_tokens=args.max_new_tokens,
        sps=sps if row.shape.kind == "dynamic" else None,
    )
    return engine_run(engine, target, args)


def measured_cost_lines(modes: dict[str, Mode]) -> list[str]:
    """What each `decode.step_costs=measured` scheduler ended the run with: per B the verify ms it priced (measured
    median, or the profile at today's level), the rounds measured at B, and the per-round overhead it added."""
    lines = []
    for name, run in modes.items():
        costs = getattr(getattr(run, "engine", None), "round_costs", None)
        if costs is None:
            continue
        measured = costs.measured()
        sizes = ", ".join(
            f"B={b}: {1000 * costs.verify_seconds(b):.1f}"
            + (f" ({costs.samples(b)})" if b in measured else " (profile)")
            for b in costs.profile.batch_tokens
        )
        lines.append(
            f"- {name}: {costs.rounds} rounds; verify ms by B (rounds in the window) {sizes}; overhead "
            f"{1000 * (costs.overhead or 0.0):.1f} ms per round; level {costs.level():.2f}× the profile"
        )
    return lines


def hf_mode(target, *, temperature: float, lookup: int | None, args) -> Mode:
    def run(prompt, max_new_tokens=None):
        ids = torch.tensor([prompt.input_ids], device=target.device)
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            if temperature > 0
            else {"do_sample": False}
        )
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        out = target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            pad_token_id=target.stop_token_ids[0],
            eos_token_id=list(target.stop_token_ids),
            max_new_tokens=max_new_tokens or args.max_new_tokens,
            **sampling,
            **extra,
        )
        return {"tokens": int(out.shape[1] - ids.shape[1]), "seconds": time.perf_counter() - start, "rounds": []}

    return run


def build_modes(target, drafters: list[Drafter], *, temperature: float, args, sps) -> dict[str, Mode]:
    modes = {
        TARGET_ONLY: engine_mode(target, None, "fixed", temperature=temperature, args=args),
        HF_GENERATE: hf_mode(target, temperature=temperature, lookup=None, args=args),
        f"HF prompt lookup ({args.block_size})": hf_mode(
            target, temperature=temperature, lookup=args.block_size, args=args
        ),
    }
    for position, drafter in enumerate(drafters):
        gamma = drafter.module.block_size
        statics = args.static if args.static is not None else range(1, gamma)
        if args.static_drafters is not None and position >= args.static_drafters:
            statics = []
        modes[f"{drafter.name} · fixed ℓ={gamma}"] = engine_mode(
            target, drafter, "fixed", temperature=temperature, args=args
        )
        for k in statics:
            if 0 < k < gamma:
                modes[f"{drafter.name} · static ℓ={k}"] = engine_mode(
                    target, drafter, "static", static_k=k, temperature=temperature, args=args
                )
        if not args.no_scheduler and getattr(drafter.module, "confidence_head", None) is not None:
            for step_costs in args.step_costs:
                label = f"{drafter.name} · scheduler" + ("" if step_costs == "profile" else f" ({step_costs} costs)")
                modes[label] = engine_mode(
                    target, drafter, "scheduler", sps=sps, temperature=temperature, args=args, step_costs=step_costs
                )
        for row in args.tree_shapes:
            modes[f"{drafter.name} · {row.label(temperature)}"] = tree_mode(
                target, drafter, row, temperature=temperature, args=args, sps=sps
            )
    return modes


def run_interleaved(modes: dict[str, Mode], prompts: list, *, label: str) -> dict[str, dict]:
    for run in modes.values():
        run(prompts[0], max_new_tokens=4)  # warm-up (first-call allocations, lazy caches)
    totals = {name: {"tokens": 0, "seconds": 0.0, "rounds": [], "per_prompt": []} for name in modes}
    for index, prompt in enumerate(prompts):
        for name, run in modes.items():
            out = run(prompt)
            for key in ("tokens", "seconds", "rounds"):
                totals[name][key] += out[key]
            totals[name]["per_prompt"].append((out["tokens"], out["seconds"]))
        print(f"{label}: prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    return totals


# ---- tables ----

BOOTSTRAP_DRAWS = 4000


def paired_ratio_ci(
    mode: list[tuple[int, float]], base: list[tuple[int, float]], *, seed: int = 0, confidence: float = 0.95
) -> tuple[float, float]:
    """Percentile-bootstrap CI of (Σ tokens / Σ seconds of `mode`) / (the same of `base`) over prompts resampled
    jointly: both modes ran on the same prompts, interleaved, so resampling pairs keeps what they share (prompt
    length, the machine's drift at that minute) out of the interval. Lists of per-prompt (tokens, seconds)."""
    if len(mode) != len(base) or len(mode) < 2:
        return float("nan"), float("nan")
    data = torch.tensor([[t, s, tb, sb] for (t, s), (tb, sb) in zip(mode, base)], dtype=torch.float64)
    draws = torch.randint(0, len(mode), (BOOTSTRAP_DRAWS, len(mode)), generator=torch.Generator().manual_seed(seed))
    sums = data[draws].sum(dim=1)  # [draws, 4]
    ratios = (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])
    tail = (1 - confidence) / 2
    low, high = torch.quantile(ratios, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return low, high


def scheduler_comparison(totals: dict[str, dict]) -> list[str]:
    """Each drafter's scheduler rows against its own fixed, static and other scheduler rows (not those of another
    drafter or of its [int8] copy) and against transformers' rows (prompt lookup, generate): tok/s ratio with its
    paired 95% CI (the issue's "ahead of every static ℓ" and "ahead of prompt lookup", judged by whether the
    interval lies above 1). Tree rows are left to `tree_comparison`."""
    lines = []
    for name, t in totals.items():
        if "· scheduler" not in name:
            continue
        drafter = name[: name.index("· scheduler")]
        rate = t["tokens"] / t["seconds"]
        lines.append(f"- {name}:")
        others = [
            (other[len(drafter) + 2 :], o)
            for other, o in totals.items()
            if other != name and other.startswith(drafter + "· ") and not is_tree(other)
        ]
        others += [(other, o) for other, o in totals.items() if other.startswith("HF ") and o.get("per_prompt")]
        for label, o in others:
            low, high = paired_ratio_ci(t["per_prompt"], o["per_prompt"])
            ratio = rate / (o["tokens"] / o["seconds"])
            lines.append(f"  - vs {label}: {ratio:.3f}× [{low:.3f}, {high:.3f}] → {verdict_of(low, high)}")
    return lines


def is_tree(name: str) -> bool:
    return "· tree " in name


def verdict_of(low: float, high: float) -> str:
    return "ahead" if low > 1 else ("behind" if high < 1 else "not distinguishable")


def tau_of(rounds) -> float:
    return sum(r.committed for r in rounds) / len(rounds) if rounds else float("nan")


def mean_nodes(rounds) -> float:
    nodes = [r.tree_nodes for r in rounds if r.tree_nodes is not None]
    return sum(nodes) / len(nodes) if nodes else float("nan")


def tree_comparison(totals: dict[str, dict]) -> list[str]:
    """Each tree row against its own drafter's chains (fixed ℓ = γ and every scheduler row; not another drafter's,
    nor its [int8] copy's): tok/s ratio with its paired 95% CI and τ of both — whether the tree's extra verified nodes
    and drafting pay for themselves against the chain the drafter would otherwise run."""
    lines = []
    for name, t in totals.items():
        if not is_tree(name):
            continue
        drafter = name[: name.index("· tree ")]
        rate = t["tokens"] / t["seconds"]
        lines.append(f"- {name} (τ {fmt(tau_of(t['rounds']))}, {fmt(mean_nodes(t['rounds']), 1)} nodes per round):")
        chains = [
            (other[len(drafter) + 2 :], o)
            for other, o in totals.items()
            if other.startswith(drafter + "· ") and ("· fixed" in other or "· scheduler" in other)
        ]
        for label, o in chains:
            low, high = paired_ratio_ci(t["per_prompt"], o["per_prompt"])
            ratio = rate / (o["tokens"] / o["seconds"])
            lines.append(
                f"  - vs {label}: {ratio:.3f}× [{low:.3f}, {high:.3f}] → {verdict_of(low, high)} "
                f"(τ {fmt(tau_of(o['rounds']))})"
            )
    return lines


def precision_comparison(totals: dict[str, dict], precisions: list[str]) -> list[str]:
    """Each `[precision]` row (--also-precision) against the same drafter and policy at --precision: tok/s ratio and
    τ, with the tok/s ratio's paired 95% CI — whether the cheaper drafter round outweighs any acceptance it loses."""
    lines = []
    for precision in precisions:
        tag = f" [{precision}] · "
        for name, t in totals.items():
            if tag not in name:
                continue
            base_name = name.replace(tag, " · ")
            base = totals.get(base_name)
            if base is None:
                continue
            low, high = paired_ratio_ci(t["per_prompt"], base["per_prompt"])
            verdict = "faster" if low > 1 else ("slower" if high < 1 else "not distinguishable")
            taus = [sum(r.committed for r in x["rounds"]) / max(1, len(x["rounds"])) for x in (t, base)]
            ratio = (t["tokens"] / t["seconds"]) / (base["tokens"] / base["seconds"])
            lines.append(
                f"- {name[name.index('· ') + 2 :]}: [{precision}] {ratio:.3f}× "
                f"[{low:.3f}, {high:.3f}] the tok/s of the same policy at --precision → {verdict}; "
                f"τ {taus[0]:.3f} vs {taus[1]:.3f}"
            )
    return lines


def headroom_lines(totals: dict[str, dict]) -> list[str]:
    """Per drafter with a fixed-ℓ = γ row: the hindsight bound of `dspark.evaluation.headroom` — how far ahead of
    the best static ℓ any verify-length policy could be on its rounds, with the verify cost at each ℓ measured in
    this run (the target-only rounds for ℓ = 0, the drafter's fixed and static rounds grouped by ℓ_eff)."""
    from collections import defaultdict

    from dspark.evaluation.headroom import policy_headroom

    plain = totals[TARGET_ONLY]["rounds"]
    lines = []
    for name, t in totals.items():
        if "· fixed" not in name or not t["rounds"] or not plain:
            continue
        drafter = name[: name.index("· fixed")]
        by_length = defaultdict(list)
        for other, o in totals.items():
            if other.startswith(drafter) and ("· fixed" in other or "· static" in other):
                for r in o["rounds"]:
                    by_length[r.num_verified].append(r.seconds_verify)
        verify = {0: sum(r.seconds_verify for r in plain) / len(plain)}
        verify |= {ell: sum(v) / len(v) for ell, v in by_length.items() if ell > 0 and len(v) >= 5}
        if len(verify) < 2:  # a short run: no verify length ≥ 1 measured in 5 rounds or more
            lines.append(f"- {name}: too few rounds at any verify length ≥ 1 (5 needed) for the replay")
            continue
        gamma = max(r.num_verified for r in t["rounds"])
        head = policy_headroom(t["rounds"], verify_seconds=verify, block_size=gamma)
        measured = ", ".join(f"{ell}: {1000 * verify[ell]:.1f}" for ell in sorted(verify))
        best = head.static_rates[head.best_static]
        statics = ", ".join(f"ℓ = {ell}: {rate / best:.3f}" for ell, rate in sorted(head.static_rates.items()))
        lines.append(
            f"- {name}: hindsight (each round's ℓ chosen knowing its accepted count; not causal, a bound) "
            f"{head.ratio:.3f}× the best static ℓ = {head.best_static} and "
            f"{head.hindsight_rate / head.static_rates[1]:.3f}× static ℓ = 1 (MTP-1's verify length) on the "
            f"same {len(t['rounds'])} rounds — the most any verify-length policy could be ahead here. "
            f"Every static ℓ replayed on these rounds, relative to the best: {statics} (verify ms by ℓ: "
            f"{measured}; ℓ between measured lengths interpolated)"
        )
    return lines


def mean_ms(rounds, attribute: str) -> float:
    return 1000 * sum(getattr(r, attribute) for r in rounds) / len(rounds) if rounds else float("nan")


def fmt(value: float, digits: int = 2) -> str:
    return "–" if value != value else f"{value:.{digits}f}"


def rate_of(t: dict) -> float:
    return t["tokens"] / t["seconds"]


def faster_baseline(totals: dict[str, dict]) -> str:
    """The faster (tok/s) of target-only (our engine) and `HF generate` in this section: the issue's speed targets
    are stated against the faster of the two."""
    return max((name for name in (TARGET_ONLY, HF_GENERATE) if name in totals), key=lambda n: rate_of(totals[n]))


def baseline_line(totals: dict[str, dict]) -> str:
    fastest = faster_baseline(totals)
    rates = ", ".join(f"{name} {rate_of(totals[name]):.1f} tok/s" for name in (TARGET_ONLY, HF_GENERATE))
    return (
        f"Faster baseline here (the × faster columns): **{fastest}** ({rates}); every speed ratio below is also stated "
        "against it."
    )


def ratio_cells(t: dict, base: dict) -> str:
    """`ratio× | [low, high]` of `t`'s tok/s over `base`'s (paired bootstrap CI; 1 exactly for the row itself)."""
    low, high = paired_ratio_ci(t["per_prompt"], base["per_prompt"]) if t is not base else (1.0, 1.0)
    return f"{rate_of(t) / rate_of(base):.2f}× | [{fmt(low)}, {fmt(high)}]"


def speed_table(totals: dict[str, dict]) -> str:
    base = totals[TARGET_ONLY]
    fastest = totals[faster_baseline(totals)]
    head = (
        "| mode | tokens | tok/s | × target-only | 95% CI | × faster baseline | 95% CI | τ | mean ℓ (tree: depth) | "
        "tree nodes | rounds | ms / round | verify | draft parallel | draft sequential | other |"
    )
    lines = [head, "|" + "---|" * 16]
    for name, t in totals.items():
        rate, rounds = rate_of(t), t["rounds"]
        ell = sum(r.num_verified for r in rounds) / len(rounds) if rounds else float("nan")
        phases = " | ".join(fmt(mean_ms(rounds, attribute)) for attribute, _ in PHASES)
        lines.append(
            f"| {name} | {t['tokens']} | {rate:.1f} | {ratio_cells(t, base)} | {ratio_cells(t, fastest)} | "
            f"{fmt(tau_of(rounds))} | {fmt(ell)} | {fmt(mean_nodes(rounds), 1)} | "
            f"{len(rounds) or '–'} | {fmt(mean_ms(rounds, 'seconds'), 1)} | {phases} |"
        )
    return "\n".join(lines)


def round_costs(totals: dict[str, dict]) -> list[str]:
    """The issue's two targets on the fixed-ℓ = γ rounds of every drafter: sequential share, drafter vs target step."""
    plain = totals[TARGET_ONLY]["rounds"]
    step_ms = mean_ms(plain, "seconds")
    lines = [
        f"- one plain target step (target-only round, our engine): {step_ms:.1f} ms "
        f"(verify {mean_ms(plain, 'seconds_verify'):.1f} ms, other {mean_ms(plain, 'seconds_other'):.2f} ms)"
    ]
    for name, t in totals.items():
        if "· fixed" not in name or not t["rounds"]:
            continue
        rounds = t["rounds"]
        total, sequential = mean_ms(rounds, "seconds"), mean_ms(rounds, "seconds_draft_sequential")
        drafting = mean_ms(rounds, "seconds_draft_parallel") + sequential
        lines.append(
            f"- {name}: round {total:.1f} ms; sequential loop {sequential:.2f} ms = "
            f"{100 * sequential / total:.1f}% of the round (target ≤ 5%); drafter round {drafting:.1f} ms = "
            f"{100 * drafting / step_ms:.0f}% of a plain target step (target ≤ 20%); Python overhead "
            f"{mean_ms(rounds, 'seconds_other'):.2f} ms per round (target ≤ 1 ms)"
        )
    for name, t in totals.items():
        if not is_tree(name) or not t["rounds"]:
            continue
        rounds = t["rounds"]
        drafting = mean_ms(rounds, "seconds_draft_parallel")
        lines.append(
            f"- {name}: round {mean_ms(rounds, 'seconds'):.1f} ms over {fmt(mean_nodes(rounds), 1)} nodes; tree "
            f"drafting with the context update {drafting:.1f} ms = {100 * drafting / step_ms:.0f}% of a plain target "
            f"step (target ≤ 15% for a 32-node tree); verify {mean_ms(rounds, 'seconds_verify'):.1f} ms; Python "
            f"overhead {mean_ms(rounds, 'seconds_other'):.2f} ms per round (target ≤ 1 ms)"
        )
    return lines


def precision_line(args) -> str:
    """The target's dtype and the drafter precision of every row, for the machine line."""
    from dspark.decoding.drafting import resolve_precision

    precision = resolve_precision(args.precision)
    return (
        f"target {args.target_dtype} (every mode), drafter parallel stage "
        f"{str(precision).replace('torch.', '')} (decode.drafter_precision={args.precision})"
        + "".join(f"; rows marked [{p}]: decode.drafter_precision={p}" for p in args.also_precision)
    )


def main(argv: list[str]) -> int:
    from dspark.data.prompts import load_prompts
    from dspark.evaluation.diagnostics import load_or_profile_sps, sps_markdown
    from dspark.evaluation.rollouts import encode_prompts
    from dspark.targets import load_target

    args = parse_args(argv)
    started, load_start = start_timing(args.threads)
    commit = git_commit()  # at the start: the code this run imported, whatever is committed while it runs
    target = load_target(args.target, cache_dir=args.cache_dir, dtype=args.target_dtype)
    records = {name: load_prompts(name, limit=args.prompts) for name in args.sets}
    prompts = encode_prompts(target, records, max_new_tokens=args.max_new_tokens)
    drafters = (
        trained_drafters(target, args.drafter)
        if args.drafter
        else untrained_drafters(
            target, depth=args.depth, block_size=args.block_size, draft_vocab=args.draft_vocab, seed=args.seed
        )
    )
    drafters += [
        dataclasses.replace(d, name=f"{d.name} [{precision}]", precision=precision)
        for precision in args.also_precision
        for d in list(drafters)
    ]
    gamma = max(d.module.block_size for d in drafters)
    # one table for the scheduler and the dynamic trees (sized on SPS(B) up to B = nodes + 1)
    tree_nodes = max((row.shape.nodes for row in args.tree_shapes if row.shape.kind == "dynamic"), default=0)
    sps, sps_path = load_or_profile_sps(
        target=target, cache_dir=args.cache_dir, block_size=max(gamma, tree_nodes), refresh=not args.reuse_sps
    )
    sections = []
    for temperature in args.temperatures:
        modes = build_modes(target, drafters, temperature=temperature, args=args, sps=sps)
        totals = run_interleaved(modes, prompts, label=f"T={temperature:g}")
        comparison = scheduler_comparison(totals)
        trees = tree_comparison(totals)
        by_precision = precision_comparison(totals, args.also_precision)
        sections += [
            f"## Temperature {temperature:g}",
            "",
            baseline_line(totals),
            "",
            speed_table(totals),
            "",
            *(
                [
                    "Scheduler against the same drafter's other policies (tok/s ratio, paired bootstrap 95% CI "
                    "over prompts):",
                    "",
                    *comparison,
                    "",
                ]
                if comparison
                else []
            ),
            *(
                [
                    "Draft trees against the same drafter's chains (tok/s ratio, paired bootstrap 95% CI over "
                    "prompts):",
                    "",
                    *trees,
                    "",
                ]
                if trees
                else []
            ),
            *(
                [
                    "Each drafter at another precision against itself at --precision (paired bootstrap 95% CI "
                    "over prompts):",
                    "",
                    *by_precision,
                    "",
                ]
                if by_precision
                else []
            ),
            *(
                [
                    "Round costs the measured-cost scheduler ended with (`dspark.scheduling.measured`):",
                    "",
                    *measured,
                    "",
                ]
                if (measured := measured_cost_lines(modes))
                else []
            ),
            "Round costs (fixed ℓ = γ; tree rows):",
            "",
            *round_costs(totals),
            "",
            "Headroom of any verify-length policy (replayed on the fixed-ℓ = γ rounds, `dspark.evaluation.headroom`):",
            "",
            *headroom_lines(totals),
            "",
        ]
    trained = all(d.trained for d in drafters)
    note = (
        ("trained drafters: " + ", ".join(relative_argument(d) for d in args.drafter))
        if trained
        else (
            "**untrained drafters** (no --drafter given): τ ≈ 1, so their rows measure round costs, not a speed-up; "
            "the scheduler reads raw confidences of an untrained head (σ ≈ 0.5)"
        )
    )
    loads = f"{load_start[0]:.1f} / {os.getloadavg()[0]:.1f}"
    sts_lines = [
        f"{d.name}: "
        + ", ".join(
            f"T={t:g} {'STS from drafter.pt' if calibration_for(d, t) is not None else 'raw c_k (no STS stored)'}"
            for t in args.temperatures
        )
        for d in drafters
        if getattr(d.module, "confidence_head", None) is not None
    ]
    sps_origin = "read from the cache (--reuse-sps)" if args.reuse_sps else "profiled at the start of this run"
    text = "\n".join(
        [
            f"# Decoding speed side by side — {args.target}",
            "",
            f"Command: `{command_line('bench_decoding.py', argv)}` ({time.time() - started:.0f} s in all)  ",
            f"Machine: {machine_line()}; {precision_line(args)}; the target's few-token products: "
            f"{target.few_row_layout} layout (`dspark.targets.layout.few_row_layout`)  ",
            f"Git commit {commit} (at the start); {time.strftime('%Y-%m-%d %H:%M %Z')} (the end); 1-min load average "
            f"{loads} at the start / "
            f"end on {os.cpu_count()} cores ({load_verdict(load_start[0], args.threads)}).",
            "",
            f"Prompts: the first {args.prompts} of {', '.join(args.sets)} ({len(prompts)} in all), chat-templated; "
            f"max_new_tokens {args.max_new_tokens}; modes interleaved per prompt after a warm-up call; tok/s include "
            f"prefill. Drafters: {note}.",
            "",
            *(
                [
                    "Tree rows (`dspark.decoding.tree_engine.TreeEngine`): "
                    + ", ".join(
                        f"{row.shape.label()} ({row.scheme}{' at T > 0, descent at T = 0' * (row.scheme != 'descent')})"
                        for row in args.tree_shapes
                    )
                    + (
                        "; dynamic trees sized per round on the SPS(B) table below (up to B = nodes + 1)."
                        if any(row.shape.kind == "dynamic" for row in args.tree_shapes)
                        else "."
                    ),
                    "",
                ]
                if args.tree_shapes
                else []
            ),
            *([f"Confidences the scheduler reads: {'; '.join(sts_lines)}.", ""] if sts_lines else []),
            *sections,
            f"SPS(B) used by the scheduler (`{repo_path(sps_path)}`; R = 1, 256-token cache; {sps_origin}):",
            "",
            sps_markdown(sps),
            "",
        ]
    )
    write_result(text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
