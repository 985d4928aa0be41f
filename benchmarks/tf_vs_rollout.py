"""Teacher-forced vs rollout acceptance of one drafter on the text the target itself writes.

For each prompt: decode with the lossless engine (policy fixed, ℓ = γ), then run the drafter teacher-forced over the
final sequence (prompt + generated tokens) with the block of every round's anchor, and compare slot 1:

- T = 0: the teacher-forced argmax at slot 1 against the rollout's "draft 1 accepted" (greedy verification accepts
  iff the draft is the target's argmax). The contexts are identical, so any difference is a train/decode mismatch
  (features, positions, anchors): the two columns must agree exactly up to float ties.
- T = 1: the teacher-forced c*₁ = Σ_v min(p_d, p_t) (the expected acceptance of slot 1 at that context) against the
  realised fraction of rounds whose first draft was accepted; equal in expectation.

Beside them, the drafter's held-out teacher-forced slot-1 acceptance on its training-distribution text (recorded at
training time): the gap between that column and these is the drafter meeting text unlike its training text, not a
decoding bug.

    .venv/bin/python benchmarks/tf_vs_rollout.py --drafter outputs/runs/<run dir> --prompts 4
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch

from common import RESULTS, add_target_arguments, command_line, git_commit, repo_path, write_result


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, type=Path, help="a run directory or drafter.pt (DSpark/DFlash)")
    add_target_arguments(parser)
    parser.add_argument("--sets", nargs="+", default=["gsm8k", "humaneval", "mt-bench"])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS / "tf_vs_rollout.md")
    return parser.parse_args(argv)


@torch.no_grad()
def slot1_teacher_forced(target, drafter, sequence: list[int], anchors: list[int], temperature: float) -> list[float]:
    """Per anchor a: T = 0 → 1.0 if the drafter's slot-1 argmax is the target's argmax at a+1, else 0.0;
    T > 0 → c*₁ = Σ_v min(p_d(v), p_t(v)) at temperature T. The drafter runs teacher-forced over one batch of the
    final text, every position supervised, as in training (`dspark.evaluation.heldout.teacher_forced_steps`)."""
    from dspark.decoding.drafting import draft_to_target, to_target_probs
    from dspark.decoding.verify import probs_from_logits
    from dspark.evaluation.heldout import teacher_forced_steps

    ids = torch.tensor([sequence], device=target.device)
    anchor_t = torch.tensor([anchors], device=target.device)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids, dtype=torch.bool),
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
        "anchors": anchor_t,
        "anchor_valid": torch.ones_like(anchor_t, dtype=torch.bool),
    }
    [(_, (drafted, _, final_hidden))] = teacher_forced_steps(
        [batch], drafter=drafter, target=target, block_size=drafter.block_size, show_progress=False
    )
    draft_logits = drafted.logits[0, :, 0].float()  # [N, Vd]: slot 1 of each block
    target_logits = target.logits_from_hidden(final_hidden[0, anchor_t[0]]).float()  # [N, V]: predicts a+1
    ids_map = draft_to_target(drafter)
    if temperature == 0:
        best = draft_logits.argmax(-1)
        best = best if ids_map is None else ids_map[best]
        return (best == target_logits.argmax(-1)).float().tolist()
    p_d = to_target_probs(probs_from_logits(draft_logits, temperature), ids_map, target.vocab_size)
    p_t = probs_from_logits(target_logits, temperature)
    return torch.minimum(p_d, p_t).sum(-1).tolist()


def main(argv: list[str]) -> int:
    from dspark.data.prompts import load_prompts
    from dspark.decoding import SpeculativeEngine, build_policy, build_proposer
    from dspark.drafters.checkpoint import drafter_file, load_drafter
    from dspark.evaluation.rollouts import encode_prompts, prompt_generator
    from dspark.targets import load_target

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started, load_start = time.time(), os.getloadavg()
    target = load_target(args.target, cache_dir=args.cache_dir)
    path = drafter_file(args.drafter)
    drafter, spec, payload = load_drafter(path, target)
    drafter = drafter.eval()
    if spec.kind == "eagle3":
        raise SystemExit("tf_vs_rollout.py compares block drafters (dspark, dflash); EAGLE-3 drafts a chain")
    prompts = encode_prompts(
        target, {s: load_prompts(s, limit=args.prompts) for s in args.sets}, max_new_tokens=args.max_new_tokens
    )
    held_out = (payload.get("metrics") or {}).get("val/accept/pos1")
    rows = []
    for temperature in args.temperatures:
        engine = SpeculativeEngine(
            target=target,
            proposer=build_proposer(drafter),
            policy=build_policy("fixed"),
            temperature=temperature,
            max_new_tokens=args.max_new_tokens,
        )
        by_set: dict[str, list[tuple[float, float]]] = {}
        for prompt in prompts:
            result = engine.generate(prompt.input_ids, generator=prompt_generator(seed=args.seed, prompt=prompt))
            sequence = [*prompt.input_ids, *result.new_tokens]
            rounds = [r for r in result.rounds if r.num_verified > 0 and r.anchor_position + 1 < len(sequence)]
            if not rounds:
                continue
            forced = slot1_teacher_forced(target, drafter, sequence, [r.anchor_position for r in rounds], temperature)
            by_set.setdefault(prompt.dataset, []).extend(
                (f, float(r.num_accepted >= 1)) for f, r in zip(forced, rounds)
            )
        pooled = [pair for pairs in by_set.values() for pair in pairs]
        for name, pairs in [*by_set.items(), ("all", pooled)]:
            forced_mean = sum(f for f, _ in pairs) / len(pairs)
            rollout_mean = sum(r for _, r in pairs) / len(pairs)
            rows.append((temperature, name, len(pairs), forced_mean, rollout_mean))
    commit = git_commit()  # short hash, "(with uncommitted changes)" when dirty
    label = {0.0: "T = 0: teacher-forced argmax agreement", 1.0: "T = 1: teacher-forced c*₁"}
    lines = [
        f"# Teacher-forced vs rollout slot-1 acceptance on the target's own text — {args.target}",
        "",
        f"Command: `{command_line('tf_vs_rollout.py', argv)}` ({time.time() - started:.0f} s)  ",
        f"Date {datetime.datetime.now():%Y-%m-%d %H:%M}, commit {commit}; {os.cpu_count()} CPUs, {args.threads} "
        f"thread(s); load average {load_start[0]:.1f} → {os.getloadavg()[0]:.1f}.  ",
        f"Drafter: `{repo_path(path)}` ({spec.kind}-{spec.head}-d{spec.depth}-g{spec.block_size}, Vd "
        f"{spec.draft_vocab_size or target.vocab_size}); its held-out teacher-forced slot-1 acceptance on "
        f"training-distribution text: **{held_out:.3f}**."
        if held_out is not None
        else f"Drafter: `{repo_path(path)}`.",
        "",
        f"Prompts: the first {args.prompts} of {', '.join(args.sets)}; {args.max_new_tokens} new tokens, policy "
        "fixed (ℓ = γ). One row per (temperature, prompt set): the rounds' anchors on the final text.",
        "",
        "| T | set | rounds | teacher-forced slot 1 | rollout: draft 1 accepted |",
        "|---|---|---|---|---|",
        *[f"| {t:g} | {name} | {n} | {f:.3f} | {r:.3f} |" for t, name, n, f, r in rows],
        "",
        "Reading: at T = 0 the two columns must be equal (same contexts, deterministic); at T = 1 they agree in "
        "expectation. "
        + " ".join(
            f"{label.get(t, f'T = {t:g}')} {f:.3f} vs rollout {r:.3f} (all sets)."
            for t, name, _, f, r in rows
            if name == "all"
        ),
        "",
    ]
    write_result("\n".join(lines), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
