"""Training throughput of every drafter: blocks/s, s/step, peak RSS, and the share of the step spent in the frozen
LM head and in the Markov projection (method: the METHOD text below, copied into the results file).

The timed step is the real one (`DrafterModule.training_step` + backward + clip + AdamW) on a synthetic batch whose
target features are precomputed (the feature-cache path); the online target forward is timed on its own. Every
configuration runs in a fresh subprocess, so `ru_maxrss` is its own peak. Prints a markdown table and writes
benchmarks/results/training.md with the command, date, machine and load average.

    .venv/bin/python benchmarks/bench_training.py                                  # tiny + smollm2-135m, ~10 min
    .venv/bin/python benchmarks/bench_training.py --targets tiny --steps 3         # about a minute
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "training.md"
TARGET_CACHE = Path("/work/main/outputs/cache")
DRAFTERS = ("dspark-markov", "dspark-rnn", "dspark-none", "dflash", "eagle3")
# (B, T, N): tiny as asked; smollm2-135m = budget=cpu (data.batch_size 4, data.max_length 512, data.max_anchors 32)
SHAPES = {"tiny": (4, 256, 16), "smollm2-135m": (4, 512, 32)}
FALLBACK = {"smollm2-135m": (2, 512, 16)}  # used for a drafter whose warm-up step exceeds --max-step-seconds


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="tiny,smollm2-135m", help="comma-separated target names")
    parser.add_argument("--drafters", default=",".join(DRAFTERS), help=f"comma-separated, from {DRAFTERS}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--min-seconds", type=float, default=3.0,
                        help="fast configurations time more steps (up to 50) until this many seconds have passed")
    parser.add_argument("--component-repeats", type=int, default=3, help="timed repeats of each isolated op")
    parser.add_argument("--feature-repeats", type=int, default=2, help="timed online target forwards")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-step-seconds", type=float, default=20.0,
                        help="a drafter whose forward alone is slower switches smollm2-135m to B=2, N=16")
    parser.add_argument("--cache-dir", type=Path, default=TARGET_CACHE, help="where targets are cached")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON job for a worker subprocess
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------------- worker side

def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def time_calls(fn, *, repeats: int, warmup: bool = True) -> tuple[float, float]:
    """(median, min) seconds of `repeats` calls, after one warm-up call (allocator, first-touch pages)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def load(job: dict):
    from dspark.targets import load_target

    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    return load_target(job["target"], cache_dir=Path(job["cache_dir"]))


def run_features_job(job: dict) -> dict:
    """Make the synthetic batch, compute its features once (saved, float16 like the cache) and time that forward."""
    from safetensors.torch import save_file

    target = load(job)
    b, t = job["batch"], job["length"]
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, target.vocab_size, (b, t), generator=gen)
    input_ids[input_ids == target.mask_token_id] = (target.mask_token_id + 1) % target.vocab_size  # MASK never in data
    attention_mask = torch.ones(b, t, dtype=torch.bool)
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    loss_mask[:, t // 2:] = True
    out = target.forward(input_ids, attention_mask=attention_mask)  # the saved features, and the warm-up
    result = {"peak_rss_mb": 0.0, "online": {}}
    for rows in sorted({b, *job["fallback_batches"]}, reverse=True):
        result["online"][str(rows)] = time_calls(
            lambda: target.forward(input_ids[:rows], attention_mask=attention_mask[:rows]),
            repeats=job["feature_repeats"], warmup=rows != b)
    save_file({"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
               "features": out.features.half().contiguous(), "final_hidden": out.final_hidden.half().contiguous()},
              job["batch_file"])
    return {**result, "peak_rss_mb": peak_rss_mb()}


def make_batch(job: dict) -> dict[str, torch.Tensor]:
    """The first B saved sequences plus N anchors each (eligible positions: the loss-masked second half)."""
    from safetensors.torch import load_file

    from dspark.data.blocks import sample_anchors

    saved = load_file(job["batch_file"])
    b, n = job["batch"], job["anchors"]
    batch = {k: v[:b] for k, v in saved.items()}
    gen = torch.Generator().manual_seed(0)
    anchors = torch.stack([sample_anchors(m, max_anchors=n, generator=gen) for m in batch["loss_mask"]])
    batch["anchors"], batch["anchor_valid"] = anchors, torch.ones_like(anchors, dtype=torch.bool)
    return batch


def build_module(job: dict, target):
    from dspark.config import resolve_config, to_dict
    from dspark.drafters.factory import build_drafter, drafter_spec_for
    from dspark.training.module import DrafterModule

    kind, _, head = job["drafter"].partition("-")
    argv = [f"target={job['target']}", f"drafter={kind}", "budget=cpu"]
    cfg = resolve_config(argv + ([f"model.head={head}"] if head else [])).cfg
    spec = drafter_spec_for(kind=kind, model_cfg=cfg.model, target=target)
    loss = cfg.loss
    weights = {"alpha_ce": loss.alpha_ce, "alpha_tv": loss.alpha_tv, "alpha_conf": loss.alpha_conf,
               "decay": loss.decay}
    module = DrafterModule(drafter=build_drafter(spec, target), target=target, drafter_kind=kind,
                           block_size=spec.block_size, loss_weights=weights, optim=to_dict(cfg.optim),
                           drafter_config=spec.to_dict())
    return module, cfg


def supervised_counts(kind: str, batch: dict, *, block_size: int, mask_token_id: int) -> tuple[int, int]:
    """(blocks, supervised slots) of one batch, counted as the step function counts them."""
    if kind == "eagle3":
        from dspark.losses.eagle3 import create_eagle3_loss_mask

        valid = create_eagle3_loss_mask(batch["loss_mask"], batch["attention_mask"], num_steps=block_size)
        valid = valid.long().cumprod(-1).bool()
        return int(valid[..., 0].sum()), int(valid.sum())
    from dspark.data.blocks import build_blocks

    blocks = build_blocks(batch["input_ids"], batch["loss_mask"], batch["anchors"], batch["anchor_valid"],
                          block_size=block_size, mask_token_id=mask_token_id)
    return int(batch["anchor_valid"].sum()), int(blocks.label_valid.sum())


def run_step_job(job: dict) -> dict:
    """Time warm-up + `steps` real training steps, then the LM head / Markov projection in isolation."""
    import warnings

    from dspark.training.optim import build_optimizer, count_parameters

    warnings.filterwarnings("ignore", message=".*self.log.*")  # no Trainer attached: logging is a no-op
    target = load(job)
    module, cfg = build_module(job, target)
    batch = make_batch(job)
    params = [p for p in module.drafter.parameters() if p.requires_grad]
    o = cfg.optim
    optimizer, schedule = build_optimizer(params, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                                          total_steps=job["warmup"] + max(job["steps"], 50),
                                          warmup_fraction=o.warmup_fraction)
    setup_rss = peak_rss_mb()

    def step() -> tuple[float, float, float]:
        start = time.perf_counter()
        loss = module.training_step(batch, 0)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        return forward - start, backward - forward, time.perf_counter() - backward

    # Too slow to time when the forward alone exceeds the limit (then so does the step). Judged on the forward,
    # not the whole step, so that other jobs slowing a fast drafter down rarely switch it to the smaller shape.
    if job["max_step_s"]:
        start = time.perf_counter()
        module.training_step(batch, 0)
        forward_s = time.perf_counter() - start
        if forward_s > job["max_step_s"]:
            return {"too_slow": forward_s}
    for _ in range(job["warmup"]):
        step()
    parts, start = [], time.perf_counter()
    # at least `steps`; fast configurations keep going for `min_seconds` (≤ 50 steps) so the median is stable
    while len(parts) < job["steps"] or (time.perf_counter() - start < job["min_seconds"] and len(parts) < 50):
        parts.append(step())
    totals = [sum(p) for p in parts]
    result = {"step_s": statistics.median(totals), "step_min_s": min(totals),
              "split": [statistics.median(p[i] for p in parts) for i in range(3)], "timed_steps": len(parts),
              "peak_rss_mb": peak_rss_mb(), "setup_rss_mb": setup_rss,
              "params_m": count_parameters(module.drafter) / 1e6}
    kind = job["drafter"].split("-")[0]
    result["blocks"], result["slots"] = supervised_counts(kind, batch, block_size=module.block_size,
                                                          mask_token_id=target.mask_token_id)
    result.update(time_components(job, module, target, batch))
    result["load_1min"] = os.getloadavg()[0]
    return result


def time_components(job: dict, module, target, batch: dict) -> dict:
    """The frozen LM head (draft logits forward + input-gradient backward, target logits forward) and the
    Markov projection (W_1 lookup → W_2, forward + backward into both tables), same shapes as the step."""
    b, t = batch["input_ids"].shape
    g, d, v = module.block_size, target.hidden_size, target.vocab_size
    eagle = job["drafter"] == "eagle3"
    rows = (b, t) if eagle else (b, job["anchors"], g)  # one draft-logit call; EAGLE-3 makes γ of them
    calls = g if eagle else 1
    repeats = job["component_repeats"]
    hidden = torch.randn(*rows, d, requires_grad=True)
    grad = torch.randn(*rows, v)

    def draft_head() -> None:
        target.lm_head(hidden).backward(grad)
        hidden.grad = None

    def target_head() -> None:
        with torch.no_grad():
            target.lm_head(hidden.detach()).float()

    draft, target_only = time_calls(draft_head, repeats=repeats), time_calls(target_head, repeats=repeats)
    out = {"lm_head_s": calls * draft[0] + target_only[0], "lm_head_min_s": calls * draft[1] + target_only[1]}
    head = getattr(module.drafter, "head", None)
    if head is not None and getattr(head, "rank", 0) > 0:
        prev = torch.randint(0, v, rows)

        def markov() -> None:
            head.w2(head.w1(prev)).backward(grad)
            head.w1.weight.grad = head.w2.weight.grad = None

        out["markov_s"], out["markov_min_s"] = time_calls(markov, repeats=repeats)
    return out


def run_child(job_json: str) -> None:
    job = json.loads(job_json)
    result = run_features_job(job) if job["kind"] == "features" else run_step_job(job)
    print(json.dumps(result))


# ----------------------------------------------------------------------------------------------- parent side

def spawn(job: dict, *, timeout: float = 900.0) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def bench_target(name: str, args: argparse.Namespace, work: Path) -> dict:
    base = {"target": name, "cache_dir": str(args.cache_dir), "threads": args.threads,
            "batch_file": str(work / f"{name}.safetensors"), "feature_repeats": args.feature_repeats,
            "steps": args.steps, "warmup": args.warmup, "min_seconds": args.min_seconds,
            "component_repeats": args.component_repeats}
    b, t, n = SHAPES.get(name, SHAPES["tiny"])
    fallback = FALLBACK.get(name)
    features = spawn({**base, "kind": "features", "batch": b, "length": t,
                      "fallback_batches": [fallback[0]] if fallback else []})
    print(f"[{name}] features: {features}", file=sys.stderr, flush=True)
    rows: list[dict] = []
    if "error" in features:
        return {"features": features, "rows": rows, "shape": (b, t, n)}
    for drafter in args.drafters.split(","):
        shape = (b, t, n)
        job = {**base, "kind": "step", "drafter": drafter, "batch": b, "anchors": n,
               "max_step_s": args.max_step_seconds if fallback else 0}
        result = spawn(job)
        if "too_slow" in result:
            shape = fallback
            result = {**spawn({**job, "batch": shape[0], "anchors": shape[2], "max_step_s": 0}),
                      "fallback_from": result["too_slow"]}
        result["online_s"] = features["online"][str(shape[0])][0]
        print(f"[{name}] {drafter} {shape}: {result}", file=sys.stderr, flush=True)
        rows.append({"drafter": drafter, "shape": shape, **result})
    return {"features": features, "rows": rows, "shape": (b, t, n)}


def table(results: dict[str, dict]) -> str:
    head = ("| target | drafter | B×T, N | trainable params | s/step median (min) | fwd / bwd / opt | blocks/s median "
            "(best) | supervised slots/s | peak RSS (after set-up) | LM head share | Markov share "
            "| blocks/s, online features | load 1 min |")
    lines = [head, "|" + "---|" * 13]
    for name, res in results.items():
        for r in res["rows"]:
            b, t, n = r["shape"]
            shape = f"{b}×{t}, " + ("— (all positions)" if r["drafter"] == "eagle3" else f"N={n}")
            if "error" in r:
                lines.append(f"| {name} | {r['drafter']} | {shape} | error: {r['error']} |" + " |" * 9)
                continue
            lines.append(f"| {name} | {r['drafter']} | {shape} | " + " | ".join(row_cells(r)) + " |")
    return "\n".join(lines)


def row_cells(r: dict) -> list[str]:
    s, best = r["step_s"], r["step_min_s"]
    unit = "positions/s" if r["drafter"] == "eagle3" else "blocks/s"
    # shares: best isolated op time / best step time (both least disturbed by other jobs; see Method)
    markov = f"{100 * r['markov_min_s'] / best:.1f}%" if "markov_min_s" in r else "—"
    online = f"{r['blocks'] / (s + r['online_s']):.1f}" if r.get("online_s") else "—"
    return [f"{r['params_m']:.2f} M", f"{s:.3f} ({best:.3f})",
            " / ".join(f"{100 * x / sum(r['split']):.0f}%" for x in r["split"]),
            f"{r['blocks'] / s:.1f} ({r['blocks'] / best:.1f}) {unit}", f"{r['slots'] / s:.1f}",
            f"{r['peak_rss_mb'] / 1024:.2f} GB ({r['setup_rss_mb'] / 1024:.2f})",
            f"{100 * r['lm_head_min_s'] / best:.1f}%", markov, online, f"{r['load_1min']:.1f}"]


def feature_lines(results: dict[str, dict]) -> list[str]:
    lines = []
    for name, res in results.items():
        feats, t = res["features"], res["shape"][1]
        if "error" in feats:
            lines.append(f"- {name}: feature computation failed: {feats['error']}")
            continue
        for rows, (median, best) in feats["online"].items():
            lines.append(f"- {name}: one target forward over B×T = {rows}×{t} (no grad, fp32, all feature layers + "
                         f"final norm) takes **{median:.3f} s** (min {best:.3f} s) per batch. Without the feature "
                         "cache it is added to every step (column *blocks/s, online features*).")
        lines.append(f"- {name}: peak RSS of the process running these forwards: {feats['peak_rss_mb'] / 1024:.2f} GB.")
    return lines


def machine_line(args: argparse.Namespace, load_before: tuple, load_after: tuple) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    return (f"Machine: {os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}, {args.threads} threads, fp32, "
            f"Python {platform.python_version()}. Load average (1, 5, 15 min) before "
            f"{', '.join(f'{x:.2f}' for x in load_before)}, after {', '.join(f'{x:.2f}' for x in load_after)} — "
            "other jobs shared the machine, so absolute times are noisy (±50%); shares and ratios less so.")


METHOD = """\
## Method

- **Step** = `DrafterModule.training_step` (registered step function: blocks, drafter forward, frozen-LM-head target
  logits from the cached `final_hidden`, loss, teacher-forced metric updates) + `backward` + `clip_grad_norm_`
  (`optim.grad_clip`) + AdamW/warm-up-cosine step + `zero_grad`. Config from `resolve_config([..., "budget=cpu"])`,
  so the loss weights are the real ones (dflash: CE only; dspark: 0.1 CE + 0.9 TV + 1.0 BCE). Lightning's own
  loop overhead is not included. s/step is the median of the timed steps (min in brackets); `fwd / bwd / opt`
  splits it into forward + loss + metrics / backward / clip + AdamW (medians of each part).
- **Batch**: random token ids (never the MASK id), `attention_mask` all ones, `loss_mask` 1 on the second half,
  N anchors per sequence from `sample_anchors` (all valid). `features` / `final_hidden` are precomputed once and
  passed as float16, as the feature cache delivers them, so the target forward is not in the step.
- **blocks/s** = valid anchors per step / step time (median; best = min step in brackets) for DSpark/DFlash. For
  EAGLE-3 the unit is **positions/s**: sequence positions whose TTT step 0 is supervised (StepResult
  `num_blocks`). **supervised slots/s** (median) counts supervised (block, slot) pairs — (position, TTT step)
  pairs for EAGLE-3 — the like-for-like number of training targets. *blocks/s, online features* = blocks / (median
  step + median online target forward of the same batch): the throughput without the feature cache.
- **Peak RSS** = `ru_maxrss` of a fresh subprocess per configuration, read after the timed steps (target weights,
  batch, activations and optimiser state included); in brackets the peak after set-up, before the first step.
- **Shares** (method: isolated timing, not a profiler): after the steps, in the same process, with the same shapes,
  weights and thread count, each op is run `--component-repeats` times after one warm-up; share = its min time /
  the min step time. Mins, because other jobs on the machine inflate medians unevenly and the min of each is the
  least disturbed estimate. *LM head* = draft logits `lm_head(h)` forward + backward (input gradient only — the
  head is frozen) on B·N·γ rows (EAGLE-3: γ calls on B·T rows) + target logits forward without grad on the same
  rows (EAGLE-3: B·T rows). *Markov* = `W_2(W_1[x])`, embedding look-up and the r→V projection, forward +
  backward into both tables, B·N·γ rows (for `rnn` the same two ops, which its head also runs, excluding its
  recurrent cell). Not in these shares: the softmax / loss over V, the bias add, and the AdamW update of W_1/W_2.
- **load 1 min** = `os.getloadavg()[0]` when the configuration finished; above 2 (the core count) other jobs
  were competing for the CPUs during that row.
"""


def write_results(results: dict, args: argparse.Namespace, argv: list[str], loads: tuple) -> str:
    command = ".venv/bin/python benchmarks/bench_training.py " + shlex.join(argv)
    notes = []
    for name, res in results.items():
        for r in res["rows"]:
            if "fallback_from" in r:
                notes.append(f"- {name} / {r['drafter']}: at B×T, N = {'×'.join(map(str, res['shape'][:2]))}, "
                             f"{res['shape'][2]} the forward alone took {r['fallback_from']:.1f} s "
                             f"(> --max-step-seconds {args.max_step_seconds:g}), too slow to time {args.steps}+ "
                             f"steps, so it was timed at B={r['shape'][0]}, N={r['shape'][2]} instead.")
    text = "\n\n".join([
        "# Training throughput benchmark",
        f"Command: `{command.strip()}`",
        f"Date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}. " + machine_line(args, *loads),
        f"Model: depth 5, γ = 7, Markov rank 256 (defaults). Timed steps: at least {args.steps} after {args.warmup} "
        f"warm-up, more (≤ 50) for fast configurations until {args.min_seconds:g} s have passed.",
        table(results),
        "### Online target features\n\n" + "\n".join(feature_lines(results)),
        ("### Notes\n\n" + "\n".join(notes)) if notes else "",
        METHOD,
    ])
    text = text.replace("\n\n\n\n", "\n\n")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text.rstrip() + "\n")
    return text


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.child is not None:
        run_child(args.child)
        return 0
    load_before = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory(prefix="dspark-bench-") as work:
        for name in args.targets.split(","):
            results[name] = bench_target(name, args, Path(work))
    print(write_results(results, args, argv, (load_before, os.getloadavg())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
