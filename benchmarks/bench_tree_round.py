"""What one draft-tree round costs on this machine, piece by piece (issue 53's round-cost targets, METHOD §5.1).

For each drafter (`--drafter NAME=RUN_DIR_OR_DRAFTER_PT`, repeatable; without any, bench_decoding's untrained
DSpark-Markov, DFlash and EAGLE-3 stand-ins of `--depth` / γ = `--block-size` / `--draft-vocab`: timing does not depend
on the weights) and each node budget N of `--nodes` (a dynamic tree, `TreeShape(kind="dynamic", nodes=N, beam=b)`,
b from `--beams`), interleaved rep by rep after `--warmup` reps, medians over `--reps`:

- the target's plain decode step: one token over a `--context`-token KV cache and its LM-head row (a target-only
  round's work);
- drafting the tree (`tree_proposers.propose_tree`: the drafter's block forward / EAGLE-3's step 0, the growth over
  every depth, the cut to the N best nodes) over a context of real target features that grows by one committed
  position per rep (as in decoding), and the context update of that position (`proposer.extend`);
- sizing: what `TreeEngine` does to a dynamic tree after drafting (`TreeEngine._sized`: `choose_node_budget` on the
  SPS(B) table and the subtree of the N* best nodes);
- the tree mask and positions (`tree.tree_attention`, `tree.tree_positions`), the target's verify forward over the
  anchor and the whole N-node tree (N + 1 tokens, tree mask; no LM head: the verifier applies it to the rows it
  visits), and beside it a causal forward of N + 1 tokens (what the SPS(B) table prices);
- the Python overhead of a tree round: the median `seconds_other` of `TreeEngine` round records (round minus
  drafting with the context update minus the verify forward and walk: sizing, KV compaction
  `Target.keep_positions`, commit, records) over a short generation (`--overhead-tokens` from the same context), once
  sized on the SPS(B) table (the engine as evaluated) and once unsized (`sps=None`: every round verifies N nodes), and
  the chain engine's (`SpeculativeEngine`, fixed ℓ = γ) for reference.

The issue's targets are printed next to the numbers, not asserted: drafting a 32-node tree ≤ 15% of a plain target
step; Python overhead per round ≤ 1 ms. Writes `--output` (default outputs/benchmarks/tree-round.md) with the command,
machine, load averages and git commit. The SPS(B) table is the cached one of `dspark.evaluation.diagnostics`
(`load_or_profile_sps`, B up to max N + 1; profiled when missing, `--refresh-sps` to re-profile): it only decides the
sized trees' N*.

    .venv/bin/python benchmarks/bench_tree_round.py                          # smollm2-135m, ~2 min on 2 idle cores
    .venv/bin/python benchmarks/bench_tree_round.py --drafter dspark=outputs/runs/<run> --threads 1
    .venv/bin/python benchmarks/bench_tree_round.py --target tiny --reps 3 --warmup 1 --overhead-tokens 6   # seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from common import (
    RESULTS,
    add_target_arguments,
    command_line,
    git_commit,
    machine_line,
    provenance_line,
    repo_path,
    start_timing,
    trained_drafters,
    untrained_drafters,
    write_result,
)

PIECES = ("draft", "extend", "sizing", "mask", "tree_forward", "causal_forward")
DRAFT_SHARE_TARGET = 0.15  # issue 53: drafting a 32-node tree ≤ 15% of a plain target step
OVERHEAD_TARGET_MS = 1.0  # issue 53: Python overhead per round ≤ 1 ms


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a trained drafter: run directory or drafter.pt (repeatable; default: untrained stand-ins)",
    )
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32], help="node budgets N of the trees")
    parser.add_argument(
        "--beams",
        type=int,
        nargs="+",
        default=None,
        help="beam of each --nodes entry (default: 4 up to N = 16, then 6 as bench_decoding's dynamic32b6; the "
        "drafted tree holds at most beam × γ nodes)",
    )
    parser.add_argument("--block-size", type=int, default=7, help="γ of untrained drafters")
    parser.add_argument("--depth", type=int, default=5, help="draft layers of untrained DSpark/DFlash drafters")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="Vd of untrained drafters (0 = full V)")
    parser.add_argument("--precision", default="auto", help="decode.drafter_precision: auto | fp32 | bf16 | int8")
    parser.add_argument("--context", type=int, default=200, help="cached positions before the anchor")
    parser.add_argument("--reps", type=int, default=30, help="timed reps (medians)")
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed reps first (>= 1: EAGLE-3's first step 0 runs the whole context)"
    )
    parser.add_argument("--overhead-tokens", type=int, default=32, help="new tokens of each overhead generation")
    parser.add_argument("--temperature", type=float, default=1.0, help="drafting and verifying temperature")
    parser.add_argument("--refresh-sps", action="store_true", help="re-profile the SPS(B) table instead of the cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS / "tree-round.md")
    args = parser.parse_args(argv)
    if args.beams is None:
        args.beams = [4 if n <= 16 else 6 for n in args.nodes]
    if len(args.beams) != len(args.nodes):
        parser.error(f"--beams needs one value per --nodes entry ({len(args.nodes)}), got {len(args.beams)}")
    if min(args.nodes) < 1 or min(args.beams) < 1 or args.reps < 1 or args.warmup < 1 or args.context < 8:
        parser.error("--nodes and --beams must be >= 1, --reps >= 1, --warmup >= 1 and --context >= 8")
    if args.overhead_tokens < 2:
        parser.error("--overhead-tokens must be >= 2")
    return args


def median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values) if values else float("nan")


def fmt(value: float, digits: int = 2) -> str:
    return "–" if value != value else f"{value:.{digits}f}"


def overhead_rounds(engine, prompt: list[int], *, tokens: int, seed: int, device) -> list:
    """Round records of one generation of `tokens` new tokens after a 4-token warm-up generation."""
    engine.generate(prompt, generator=torch.Generator(device=device).manual_seed(seed), max_new_tokens=4)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    result = engine.generate(prompt, generator=generator, max_new_tokens=tokens)
    return result.rounds


def main(argv: list[str]) -> int:
    from dspark.decoding import SpeculativeEngine, build_policy, build_proposer
    from dspark.decoding.tree import TreeShape, tree_attention, tree_positions
    from dspark.decoding.tree_engine import TreeEngine
    from dspark.decoding.tree_proposers import propose_tree
    from dspark.evaluation.diagnostics import load_or_profile_sps, random_context
    from dspark.targets import load_target

    args = parse_args(argv)
    started, load_start = start_timing(args.threads)
    commit = git_commit()  # at the start: the code this run imported
    target = load_target(args.target, cache_dir=args.cache_dir)
    drafters = (
        trained_drafters(target, args.drafter)
        if args.drafter
        else untrained_drafters(
            target, depth=args.depth, block_size=args.block_size, draft_vocab=args.draft_vocab, seed=args.seed
        )
    )
    sps, sps_path = load_or_profile_sps(
        target=target,
        cache_dir=args.cache_dir,
        block_size=max([*args.nodes, *(d.module.block_size for d in drafters)]),
        refresh=args.refresh_sps,
    )
    device = target.device
    stop_ids = frozenset(int(t) for t in target.stop_token_ids)
    total_reps = args.warmup + args.reps
    # the context, then one committed position per rep (the anchors), all with real target features
    ids = random_context(target, length=args.context + total_reps + 1, seed=args.seed)
    with torch.no_grad():
        features = target.forward(torch.tensor([ids], device=device), cache=target.new_cache()).features
        cache = target.new_cache()
        target.forward(torch.tensor([ids[: args.context]], device=device), cache=cache)
    anchor_ids = torch.tensor([[ids[args.context]]], device=device)
    shapes = [TreeShape(kind="dynamic", nodes=n, beam=b) for n, b in zip(args.nodes, args.beams)]
    cells = []  # (drafter, shape, proposer, engine that sizes its trees)
    for drafter in drafters:
        for shape in shapes:
            proposer = build_proposer(drafter.module, precision=drafter.precision or args.precision)
            proposer.start(features=features[:, : args.context], token_ids=ids[: args.context])
            sizer = TreeEngine(  # only its `_sized` (the engine's own sizing of a drafted dynamic tree) is called
                target=target,
                proposer=proposer,
                shape=shape,
                temperature=args.temperature,
                max_new_tokens=args.overhead_tokens,
                sps=sps,
            )
            cells.append((drafter, shape, proposer, sizer))
    times: dict[tuple[int, str], list[float]] = {}
    sizes: dict[int, list[int]] = {}
    plain: list[float] = []
    generator = torch.Generator(device=device).manual_seed(args.seed)

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start

    with torch.no_grad():
        for rep in range(total_reps):
            keep = rep >= args.warmup
            _, seconds = timed(lambda: target.logits_from_hidden(target.forward(anchor_ids, cache=cache).final_hidden))
            target.rollback(cache, keep=args.context)
            if keep:
                plain.append(seconds)
            for index, (drafter, shape, proposer, sizer) in enumerate(cells):
                position = proposer.context_length
                tree, draft_seconds = propose_tree(
                    proposer,
                    shape,
                    anchor_token=ids[position],
                    anchor_position=position,
                    temperature=args.temperature,
                    generator=generator,
                    stop_ids=stop_ids,
                )
                _, sizing = timed(lambda: sizer._sized(tree, draft_seconds))
                (mask, positions), mask_seconds = timed(
                    lambda: (
                        tree_attention(tree, context=args.context).to(device),
                        tree_positions(tree, anchor_position=args.context).to(device),
                    )
                )
                block = torch.cat([anchor_ids[0], tree.tokens.to(device)]).unsqueeze(0)
                _, tree_forward = timed(
                    lambda: target.forward(block, attention_mask=mask, position_ids=positions, cache=cache)
                )
                target.rollback(cache, keep=args.context)
                _, causal_forward = timed(lambda: target.forward(block, cache=cache))
                target.rollback(cache, keep=args.context)
                _, extend = timed(
                    lambda: proposer.extend(features=features[:, position : position + 1], token_ids=[ids[position]])
                )
                if keep:
                    for piece, seconds in zip(
                        PIECES, (draft_seconds, extend, sizing, mask_seconds, tree_forward, causal_forward)
                    ):
                        times.setdefault((index, piece), []).append(seconds)
                    sizes.setdefault(index, []).append(tree.size)
        # the Python overhead of whole rounds: TreeEngine sized on SPS(B), unsized, and the chain engine
        prompt = ids[: args.context]
        overhead: dict[tuple[int, str], list] = {}
        chain_other: dict[str, list] = {}
        for index, (drafter, shape, *_) in enumerate(cells):
            for label, table in (("sized", sps), ("unsized", None)):
                engine = TreeEngine(
                    target=target,
                    proposer=build_proposer(drafter.module, precision=drafter.precision or args.precision),
                    shape=shape,
                    scheme="descent",
                    temperature=args.temperature,
                    max_new_tokens=args.overhead_tokens,
                    sps=table,
                )
                overhead[(index, label)] = overhead_rounds(
                    engine, prompt, tokens=args.overhead_tokens, seed=args.seed, device=device
                )
            if drafter.name not in chain_other:
                engine = SpeculativeEngine(
                    target=target,
                    proposer=build_proposer(drafter.module, precision=drafter.precision or args.precision),
                    policy=build_policy("fixed"),
                    temperature=args.temperature,
                    max_new_tokens=args.overhead_tokens,
                )
                chain_other[drafter.name] = overhead_rounds(
                    engine, prompt, tokens=args.overhead_tokens, seed=args.seed, device=device
                )
    plain_ms = median_ms(plain)

    def cell(index: int, piece: str) -> float:
        return median_ms(times[(index, piece)])

    lines = [
        f"# One draft-tree round, piece by piece — {args.target}",
        "",
        f"Command: `{command_line('bench_tree_round.py', argv)}` ({time.time() - started:.0f} s in all)  ",
        f"Machine: {machine_line()}; target {str(target.dtype).replace('torch.', '')}, drafter precision "
        f"{args.precision}  ",
        provenance_line(load_start, threads=args.threads, commit=f"{commit} (at the start)"),
        "",
        f"Context {args.context} cached positions of random tokens (real target features); dynamic trees at "
        f"T = {args.temperature:g}; medians over {args.reps} reps after {args.warmup} warm-up reps, every piece "
        f"interleaved rep by rep. The target's plain decode step (one token + its LM-head row over the "
        f"{args.context}-token cache): **{plain_ms:.2f} ms**. Targets (issue 53, not asserted): drafting a 32-node "
        f"tree ≤ {DRAFT_SHARE_TARGET:.0%} of a plain step; Python overhead per round ≤ {OVERHEAD_TARGET_MS:g} ms.",
        "",
        "| drafter | N (beam) | nodes drafted | draft tree (ms) | draft / plain step | context update (ms) | "
        "sizing (ms) | tree mask (ms) | verify forward N+1, tree mask (ms) | causal forward N+1 (ms) | "
        "verify / plain step |",
        "|" + "---|" * 11,
    ]
    for index, (drafter, shape, *_) in enumerate(cells):
        draft = cell(index, "draft")
        verify = cell(index, "tree_forward")
        share = draft / plain_ms
        mark = ""
        if shape.nodes == 32:
            mark = " ✓" if share <= DRAFT_SHARE_TARGET else " ✗ (target ≤ 15%)"
        lines.append(
            f"| {drafter.name} | {shape.nodes} ({shape.beam}) | {statistics.median(sizes[index]):.0f} | "
            f"{fmt(draft)} | {share:.1%}{mark} | {fmt(cell(index, 'extend'))} | {fmt(cell(index, 'sizing'))} | "
            f"{fmt(cell(index, 'mask'))} | {fmt(verify)} | {fmt(cell(index, 'causal_forward'))} | "
            f"{verify / plain_ms:.2f}× |"
        )
    lines += [
        "",
        f"Python overhead of a whole round (`TreeEngine` round records' `seconds_other`, median over the rounds of "
        f"one {args.overhead_tokens}-token generation from the same context, after a warm-up generation; "
        f"target ≤ {OVERHEAD_TARGET_MS:g} ms). Sized: N* per round on the SPS(B) table (the engine as evaluated); "
        "unsized: every round verifies the N drafted nodes. Round = drafting with the context update + verify "
        "(forward and walk) + other.",
        "",
        "| drafter | N (beam) | rounds | mean nodes verified | round (ms) | draft (ms) | verify (ms) | other (ms) | "
        "unsized: nodes | unsized: round (ms) | unsized: other (ms) | chain fixed ℓ = γ: other (ms) |",
        "|" + "---|" * 12,
    ]
    for index, (drafter, shape, *_) in enumerate(cells):
        rounds, unsized = overhead[(index, "sized")], overhead[(index, "unsized")]

        def med(records, attribute: str) -> float:
            return median_ms([getattr(r, attribute) for r in records])

        other = med(rounds, "seconds_other")
        mark = " ✓" if other <= OVERHEAD_TARGET_MS else " ✗"
        nodes = sum(r.tree_nodes for r in rounds) / len(rounds) if rounds else float("nan")
        unsized_nodes = sum(r.tree_nodes for r in unsized) / len(unsized) if unsized else float("nan")
        lines.append(
            f"| {drafter.name} | {shape.nodes} ({shape.beam}) | {len(rounds)} | {fmt(nodes, 1)} | "
            f"{fmt(med(rounds, 'seconds'))} | {fmt(med(rounds, 'seconds_draft_parallel'))} | "
            f"{fmt(med(rounds, 'seconds_verify'))} | {fmt(other)}{mark} | {fmt(unsized_nodes, 1)} | "
            f"{fmt(med(unsized, 'seconds'))} | {fmt(med(unsized, 'seconds_other'))} | "
            f"{fmt(med(chain_other[drafter.name], 'seconds_other'))} |"
        )
    lines += [
        "",
        "Draft tree: `propose_tree` (for EAGLE-3 including step 0 over the committed position; DSpark/DFlash's "
        "context update is the next column). Sizing: `choose_node_budget` + `best_nodes` + `subtree` on the drafted "
        "tree, inside `TreeEngine`'s other. Tree mask: `tree_attention` + `tree_positions`, inside its verify. The "
        "verify forward runs without the LM head (the verifier applies it only to the rows its walk visits).",
        "",
        f"SPS(B) table: `{repo_path(sps_path)}` ("
        f"{'profiled by this run' if args.refresh_sps else 'the cached table, profiled when missing or short'}; "
        f"B = {sps.batch_tokens[0]}..{sps.batch_tokens[-1]}; it decides the sized rounds' N* only).",
    ]
    write_result("\n".join(lines) + "\n", args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
