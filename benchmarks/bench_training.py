"""Training throughput before/after the CPU recipe, side by side in one run: blocks/s of the real training step.

Each configuration times the real step (`dspark.training.steps` step function → loss → backward → clip → AdamW)
on one batch of SmolLM2-shaped sequences whose target features come from the real target (the feature-cache
path, with the cached log-normaliser), interleaved round-robin over the configurations so that machine load hits
all of them alike. Levers (issue "drafters that learn"):

- `vocab`: the LM head and Markov W₂ over an 8,192-token draft vocabulary instead of V = 49,152;
- `bf16`: bf16 autocast (only where the CPU has bf16 instructions, AMX-BF16 or AVX512-BF16: `dspark.hardware`;
  elsewhere it is reported and skipped);
- `anchors`: 96 blocks per sequence instead of 32 (blocks share the context, so per-block cost falls);
- `attention`: the structured block attention instead of one dense [Nγ, T + Nγ] mask.

"before" = none of them (the previous default: full vocabulary, fp32, 32 anchors, dense mask); "after" = all four.

    .venv/bin/python benchmarks/bench_training.py                       # depth 1, 2, 5; ~10 min on 2 cores
    .venv/bin/python benchmarks/bench_training.py --depths 2 --repeats 2 # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from common import RESULTS, add_target_arguments, command_line, git_commit, machine_line, write_result

LEVERS = ("vocab", "bf16", "anchors", "attention")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--depths", default="1,2,5")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (B)")
    parser.add_argument("--length", type=int, default=384, help="tokens per sequence (T)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (after 1 warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS / "training.md")
    parser.add_argument("--single-levers", action="store_true", help="also time each lever alone")
    return parser.parse_args(argv)


def make_batch(target, *, batch: int, length: int, anchors: int) -> dict[str, torch.Tensor]:
    """Real target features over random token sequences (second half supervised), as the feature cache holds them."""
    from dspark.data.blocks import sample_anchors
    from dspark.data.features import log_normalizer

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (batch, length), generator=gen)
    ids[ids == target.mask_token_id] = 0
    mask = torch.ones(batch, length, dtype=torch.bool)
    loss_mask = torch.zeros(batch, length, dtype=torch.bool)
    loss_mask[:, length // 4 :] = True
    out = target.forward(ids, attention_mask=mask)
    final_hidden = out.final_hidden.half()
    anchor_rows = [sample_anchors(m, max_anchors=anchors, generator=gen) for m in loss_mask]
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "loss_mask": loss_mask,
        "features": out.features.half(),
        "final_hidden": final_hidden.float(),
        "log_normalizer": torch.stack([log_normalizer(target, h) for h in final_hidden]),
        "anchors": torch.stack(anchor_rows),
        "anchor_valid": torch.ones(batch, anchors, dtype=torch.bool),
    }


def build(target, *, kind: str, depth: int, vocab: bool, draft_ids: torch.Tensor):
    from dspark.config.schema import ModelConfig
    from dspark.drafters.factory import build_drafter, drafter_spec_for

    cfg = ModelConfig(
        head="markov" if kind == "dspark" else "none", depth=depth, draft_vocab_size=draft_ids.numel() if vocab else 0
    )
    spec = drafter_spec_for(kind=kind, model_cfg=cfg, target=target)
    return build_drafter(spec, target, draft_vocab_ids=draft_ids if vocab else None)


class Config:
    def __init__(self, name: str, *, kind: str, depth: int, levers: set[str], target, batches, draft_ids) -> None:
        from dspark.drafters import backbone

        self.name, self.kind, self.depth, self.levers = name, kind, depth, levers
        self.drafter = build(target, kind=kind, depth=depth, vocab="vocab" in levers, draft_ids=draft_ids)
        self.batch = batches["anchors" in levers]
        from dspark.training.optim import build_optimizer  # the recipe's AdamW (fused on the CPU)

        self.optimizer, _ = build_optimizer(
            self.drafter.parameters(),
            lr=1e-4,
            betas=(0.9, 0.999),
            weight_decay=0.0,
            total_steps=1_000,
            warmup_fraction=0.0,
        )
        self.target, self.backbone = target, backbone
        self.times: list[float] = []
        self.blocks = int(self.batch["anchor_valid"].sum())

    def step(self) -> float:
        from dspark.training.steps import TRAINING_STEPS

        dense = "attention" not in self.levers
        original = self.backbone.block_mask
        if dense:  # the previous path: one dense mask over [context ; every block]
            self.backbone.block_mask = lambda **kw: self.backbone.create_block_mask(**kw)
        try:
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled="bf16" in self.levers):
                result = TRAINING_STEPS.resolve(self.kind)(
                    drafter=self.drafter,
                    target=self.target,
                    batch=self.batch,
                    block_size=7,
                    alpha_ce=0.1,
                    alpha_tv=0.9,
                    alpha_conf=1.0 if self.kind == "dspark" else 0.0,
                    decay=4.0,
                )
            result.loss.total.backward()
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - start
        finally:
            self.backbone.block_mask = original


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from dspark.hardware import keep_freed_memory

    keep_freed_memory()  # as the CLI does (DSPARK_KEEP_FREED_MEMORY=0 measures glibc's default)
    from dspark.data.regenerate import load_regenerated  # noqa: F401  (import cost outside the timings)
    from dspark.hardware import cpu_has_fast_bf16
    from dspark.targets import load_target

    target = load_target(args.target, cache_dir=args.cache_dir)
    fast_bf16 = cpu_has_fast_bf16()
    batches = {
        False: make_batch(target, batch=args.batch, length=args.length, anchors=32),
        True: make_batch(target, batch=args.batch, length=args.length, anchors=96),
    }
    # a realistic draft vocabulary: the 8,192 most frequent ids of the vendored training text
    draft_ids = frequent_ids(target, size=8192)
    configs: list[Config] = []
    levers_on = set(LEVERS) if fast_bf16 else set(LEVERS) - {"bf16"}
    for depth in [int(d) for d in args.depths.split(",")]:
        for kind in ("dspark", "dflash"):
            variants = {"before": set(), "after": levers_on}
            if args.single_levers:
                variants.update({f"+{lever}": {lever} for lever in sorted(levers_on)})
            for name, levers in variants.items():
                configs.append(
                    Config(
                        name, kind=kind, depth=depth, levers=levers, target=target, batches=batches, draft_ids=draft_ids
                    )
                )
    load_before = os.getloadavg()
    for config in configs:  # warm-up
        config.step()
    for _ in range(args.repeats):  # interleaved
        for config in configs:
            config.times.append(config.step())
    load_after = os.getloadavg()
    write_report(args, configs, load=(load_before, load_after))
    return 0


def frequent_ids(target, *, size: int) -> torch.Tensor:
    """Top-`size` ids of the vendored training sets' reference responses (as budget=cpu builds them)."""
    from dspark.data.prompts import load_prompts
    from dspark.drafters.vocab import build_draft_vocab

    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    for name in ("gsm8k-train", "mbpp-train", "alpaca-5k"):
        for record in load_prompts(name, selection="all", local_dir=None, cache_dir=None)[:400]:
            if record.reference:
                ids = torch.tensor(target.tokenizer(record.reference, add_special_tokens=False)["input_ids"])
                counts += torch.bincount(ids, minlength=target.vocab_size)
    return build_draft_vocab(counts, size=size, always=target.stop_token_ids)


def write_report(args, configs: list[Config], *, load) -> None:
    lines = [
        "# Training throughput: before / after the CPU recipe (one interleaved run)",
        "",
        f"Command: `{command_line('bench_training.py', sys.argv[1:], prefix='.venv/bin/python')}`",
        "",
        f"Date {datetime.datetime.now():%Y-%m-%d %H:%M}, commit {git_commit()}. Machine: {machine_line()}. "
        "Load average "
        f"(1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load[0])}, after "
        f"{', '.join(f'{x:.2f}' for x in load[1])}.",
        "",
        f"Target {args.target}; batch B = {args.batch} sequences × T = {args.length} tokens; γ = 7; Markov rank 256. "
        f"Each cell: median (min) of {args.repeats} timed steps after a warm-up, configurations interleaved. "
        "before = full vocabulary, fp32, 32 anchors, dense block mask; after = 8,192-token draft vocabulary, "
        "bf16 autocast (CPUs with bf16 instructions only), 96 anchors, structured block attention.",
        "",
        "| depth | drafter | config | blocks/step | s/step median (min) | blocks/s median | speed-up vs before |",
        "|---|---|---|---|---|---|---|",
    ]
    before: dict[tuple, float] = {}
    for c in configs:
        med = statistics.median(c.times)
        rate = c.blocks / med
        if c.name == "before":
            before[(c.depth, c.kind)] = rate
        ratio = rate / before[(c.depth, c.kind)]
        lines.append(
            f"| {c.depth} | {c.kind} | {c.name} | {c.blocks} | {med:.3f} ({min(c.times):.3f}) | "
            f"{rate:.1f} | {ratio:.2f}× |"
        )
    write_result("\n".join(lines) + "\n", args.output)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
