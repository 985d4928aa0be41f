"""Stages `eval`, `report` and `profile`: turn a trained drafter into measured results (METHOD §5, §6, §8).

`run_eval`: load target + drafter → (STS calibration on held-out prompts, when decode.calibrate and the policy reads
confidences) → (SPS table, for the scheduler) → speculative decoding and (decode.baseline) target-only decoding
of the same prompts → per-dataset / per-domain / overall metrics (`dspark.evaluation.summary`) → MLflow (`eval/…`,
`summary/…`), raw round records (`<run dir>/evals/<stamp>-<policy>-T<temperature>/rounds.jsonl` + `meta.json`)
and a markdown report `<reports>/eval-<run dir>-<policy>-T<temperature>-<prompts digest>.md` with its figures next to it (also
attached to the MLflow run).
`run_report` rebuilds that report from the latest saved records of this config; `run_profile` re-measures SPS(B).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark.config import to_dict
from dspark.config.schema import CONFIDENCE_POLICIES  # the policies that read c_k: calibrate for them
from dspark.decoding.drafting import precision_name
from dspark.evaluation.calibrate import CalibrationReport
from dspark.evaluation.diagnostics import load_or_profile_sps, sps_markdown
from dspark.evaluation.plots import plot_conditional_acceptance
from dspark.evaluation.rollouts import encode_prompts, read_rollouts_jsonl, run_rollouts, write_rollouts_jsonl
from dspark.evaluation.summary import flatten_metrics, report_markdown, summarize
from dspark.files import atomic_write_text
from dspark.hardware import machine_summary
from dspark.stages.context import StageContext, run_name
from dspark.stages.drafter import TrainedDrafter, calibrate, open_trained_drafter
from dspark.stages.prepare import PreparedData

if TYPE_CHECKING:
    from dspark.drafters.factory import DrafterSpec
    from dspark.targets import Target

log = logging.getLogger("dspark")
EVALS_DIR = "evals"
ROUNDS_FILE = "rounds.jsonl"
META_FILE = "meta.json"
SPS_POLICIES = ("scheduler", "async")


def check_decode_config(decode: Any) -> None:
    """Re-check what the engine relies on (the config validator does too; this also guards direct calls)."""
    if not 0.0 <= float(decode.threshold) <= 1.0:
        raise ValueError(f"decode.threshold={decode.threshold} must lie in [0, 1]; e.g. decode.threshold=0.5")
    if decode.max_new_tokens < 1:
        raise ValueError(f"decode.max_new_tokens={decode.max_new_tokens} must be >= 1")
    if decode.prompts_per_set < 1 or not decode.eval_sets:
        raise ValueError("decode.eval_sets must name at least one prompt set and decode.prompts_per_set be >= 1")


def report_stem(ctx: StageContext) -> str:
    """`eval-<run directory>-<policy>[-th<θ>|-k<k>]-T<temperature>-<prompts digest>`: the run directory name carries
    the training-config hash and the digest the evaluated prompts (decode.eval_sets, prompts_per_set, max_new_tokens,
    seed), so neither another drafter nor the same drafter evaluated on other prompts (sweep=main's nine sets vs
    sweep=head's three) overwrites a report."""
    decode = ctx.cfg.decode
    threshold = (f"-th{decode.threshold:g}" if "threshold" in decode.policy else
                 f"-k{decode.static_k}" if decode.policy == "static" else "")
    prompts = json.dumps([list(decode.eval_sets), int(decode.prompts_per_set), int(decode.max_new_tokens),
                          int(ctx.cfg.seed)])
    digest = hashlib.sha1(prompts.encode()).hexdigest()[:6]
    return f"eval-{ctx.run_dir.name}-{decode.policy}{threshold}-T{decode.temperature:g}-{digest}"


def report_paths(ctx: StageContext) -> dict[str, Path]:
    """Where the report and its figures go: `<reports>/<report_stem>{.md,-cond.png,-reliability.png}`."""
    stem = report_stem(ctx)
    reports = Path(ctx.paths.reports)
    return {"report": reports / f"{stem}.md", "cond": reports / f"{stem}-cond.png",
            "reliability": reports / f"{stem}-reliability.png"}


def load_eval_prompts(ctx: StageContext, target: Target) -> list:
    """decode.prompts_per_set prompts of each decode.eval_sets set, chat-templated, in the paper's order."""
    decode = ctx.cfg.decode
    records = {name: ctx.load_prompts(name, limit=decode.prompts_per_set) for name in decode.eval_sets}
    return encode_prompts(target, records, max_new_tokens=decode.max_new_tokens)


def maybe_calibrate(ctx: StageContext, trained: TrainedDrafter, *, proposer: Any, prepared: PreparedData | None
                    ) -> tuple[CalibrationReport | None, str]:
    """STS at decode.temperature when decode.calibrate, the policy reads confidences and the drafter has them."""
    decode = ctx.cfg.decode
    if not decode.calibrate or decode.policy not in CONFIDENCE_POLICIES:
        return None, "not used (decode.policy reads no confidences or decode.calibrate=false)"
    if not trained.has_confidence:
        raise ValueError(f"decode.policy={decode.policy} needs a drafter with a confidence head (drafter=dspark); "
                         "use decode.policy=fixed for dflash / eagle3")
    return calibrate(ctx, trained, prepared=prepared, proposer=proposer, plot_path=report_paths(ctx)["reliability"])


def new_eval_dir(ctx: StageContext) -> Path:
    decode = ctx.cfg.decode
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = ctx.run_dir / EVALS_DIR / f"{stamp}-{decode.policy}-T{decode.temperature:g}"
    suffix = 1
    while path.exists():  # two evaluations within one second
        path, suffix = path.with_name(f"{path.name.split('~')[0]}~{suffix}"), suffix + 1
    path.mkdir(parents=True)
    return path


def run_eval(ctx: StageContext, drafter_path: str | Path, *, prepared: PreparedData | None = None) -> Path:
    """Evaluate the drafter at `drafter_path` with the decode.* config; returns the report's path. `prepared` (the
    data this invocation regenerated) supplies the held-out calibration prompts."""
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.policies import build_policy
    from dspark.decoding.proposers import build_proposer
    from dspark.evaluation.coverage import draft_vocab_coverage

    cfg, decode = ctx.cfg, ctx.cfg.decode
    check_decode_config(decode)
    trained = open_trained_drafter(ctx, drafter_path)
    target, spec, drafter_path = trained.target, trained.spec, trained.path
    proposer = build_proposer(trained.drafter, precision=decode.drafter_precision)
    calibration, calibration_source = maybe_calibrate(ctx, trained, proposer=proposer, prepared=prepared)
    sts = calibration.sts if calibration else None
    sps, sps_path = (None, None)
    if decode.policy in SPS_POLICIES:
        sps, sps_path = load_or_profile_sps(target=target, cache_dir=ctx.paths.cache, block_size=spec.block_size)
    policy = build_policy(decode.policy, threshold=decode.threshold, static_k=decode.static_k, sps=sps)
    prompts = load_eval_prompts(ctx, target)
    log.info("evaluating %s on %d prompts (%s), policy %s, temperature %g", drafter_path, len(prompts),
             ", ".join(decode.eval_sets), decode.policy, decode.temperature)
    engines = {"speculative": SpeculativeEngine(target=target, proposer=proposer, policy=policy,
                                                temperature=decode.temperature, max_new_tokens=decode.max_new_tokens,
                                                calibration=sts, step_costs=decode.step_costs)}
    if decode.baseline:
        engines["target"] = SpeculativeEngine(target=target, proposer=None, policy=build_policy("fixed"),
                                              temperature=decode.temperature, max_new_tokens=decode.max_new_tokens)
    rollouts = run_rollouts(engines, prompts, seed=cfg.seed,
                            desc="eval (speculative + target-only)" if decode.baseline else "eval (speculative)")
    out_dir = new_eval_dir(ctx)
    write_rollouts_jsonl(out_dir / ROUNDS_FILE, rollouts)
    meta = eval_meta(ctx, spec=spec, drafter_path=drafter_path, out_dir=out_dir, sps_path=sps_path,
                     calibration=calibration, calibration_source=calibration_source)
    atomic_write_text(out_dir / META_FILE, json.dumps(meta, indent=2))
    summary = summarize(rollouts, block_size=spec.block_size)
    metrics = flatten_metrics(summary) | (calibration.metrics() if calibration else {})
    coverage = draft_vocab_coverage(target=target, drafter=trained.drafter, prompts=prompts, rollouts=rollouts,
                                    temperature=decode.temperature)
    if coverage:
        metrics |= {("eval/vocab_coverage" if d == "all" else f"eval/domain/{d}/vocab_coverage"): v
                    for d, v in coverage.items()}
        log.info("draft-vocabulary coverage of the target's own generations: %s",
                 ", ".join(f"{d} {v:.3f}" for d, v in sorted(coverage.items())))
    if ctx.store is not None:
        ctx.store.log_metrics(ctx.run_id, metrics)
    report = write_report(ctx, meta, summary)
    log.info("eval: τ %.3f (pooled, mean over datasets), speed-up %s; report %s", summary.overall["tau"],
             speedup_note(decode, summary.overall.get("speedup")), report)
    return report


def speedup_note(decode: Any, speedup: float | None) -> str:
    """The speed-up as the final log line states it; under `decode.policy=fixed` it says that this policy measures τ
    (every draft verified, the paper's offline setting) and names the speed policy, so a ratio below 1× is not read as
    what speculative decoding gives on this machine."""
    if not decode.baseline or speedup is None:
        return "not measured (decode.baseline=false)"
    if decode.policy != "fixed":
        return f"{speedup:.2f}x"
    return (f"{speedup:.2f}x under decode.policy=fixed (every draft verified: the τ setting, not a speed policy; for "
            "speed evaluate with decode.policy=scheduler, README 'What to expect')")


def eval_meta(ctx: StageContext, *, spec: DrafterSpec, drafter_path: Path, out_dir: Path, sps_path: Path | None,
              calibration: CalibrationReport | None, calibration_source: str) -> dict:
    """What ran, for the report and for rebuilding it (`run_report`)."""
    tags = ctx.run_tags()
    target = ctx.load_target()
    return {
        "run_name": run_name(ctx.cfg), "command": tags["command"], "git_commit": tags.get("git.commit", ""),
        "mlflow_run_id": ctx.run_id, "target": target.name, "target_fingerprint": target.fingerprint,
        "drafter_kind": spec.kind, "spec": spec.to_dict(), "drafter_path": str(drafter_path),
        "decode": to_dict(ctx.cfg.decode), "seed": ctx.cfg.seed, "eval_dir": str(out_dir),
        "rounds_file": str(out_dir / ROUNDS_FILE), "sps_table": str(sps_path) if sps_path else None,
        "calibration_source": calibration_source,
        "calibration_md": calibration.markdown() if calibration else None,
        "reliability_plot": calibration.plot_path.name if calibration and calibration.plot_path else None,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        # where the speeds were measured: reports of one config name from two machines are otherwise alike
        "machine": machine_summary(),
        "precision": f"target {str(target.dtype).removeprefix('torch.')}, drafter parallel stage "
                     f"{precision_name(ctx.cfg.decode.drafter_precision, target.device)} "
                     f"(decode.drafter_precision={ctx.cfg.decode.drafter_precision})",
    }


def write_report(ctx: StageContext, meta: dict, summary: Any) -> Path:
    """Write the markdown report and the cond@k figure; attach both (and the reliability figure) to MLflow."""
    paths = report_paths(ctx)
    paths["report"].parent.mkdir(parents=True, exist_ok=True)
    plot_conditional_acceptance(summary, paths["cond"], title=f"cond@k — {meta['run_name']}, "
                                f"policy {meta['decode']['policy']}, T={meta['decode']['temperature']:g}")
    reliability = meta.get("reliability_plot") if paths["reliability"].exists() else None
    calibration_md = meta.get("calibration_md")
    if calibration_md:
        calibration_md = f"Held-out prompts: {meta['calibration_source']}.\n\n{calibration_md}"
    atomic_write_text(paths["report"], report_markdown(meta, summary, cond_plot=paths["cond"].name,
                                                       calibration_md=calibration_md, reliability_plot=reliability),
                      key="paths.reports")
    if ctx.store is not None:
        for key in ("report", "cond") + (("reliability",) if reliability else ()):
            ctx.store.client.log_artifact(ctx.run_id, str(paths[key]), artifact_path="eval")
        if meta.get("rounds_file") and Path(meta["rounds_file"]).exists():
            ctx.store.client.log_artifact(ctx.run_id, meta["rounds_file"], artifact_path="eval")
    return paths["report"]


def latest_eval_dir(ctx: StageContext) -> Path | None:
    """The most recent `<run dir>/evals/*` holding both round records and meta, or None."""
    root = ctx.run_dir / EVALS_DIR
    found = [p.parent for p in root.glob(f"*/{META_FILE}") if (p.parent / ROUNDS_FILE).exists()]
    return max(found, key=lambda p: (p / META_FILE).stat().st_mtime) if found else None


def run_report(ctx: StageContext) -> Path:
    """Rebuild the markdown report of this config's latest evaluation from its saved round records (no decoding)."""
    latest = latest_eval_dir(ctx)
    if latest is None:
        raise ValueError(f"No saved evaluation of this config under {ctx.run_dir / EVALS_DIR}: run stage=eval (or "
                         "stage=all) with the same training config first, then stage=report.")
    meta = json.loads((latest / META_FILE).read_text())
    rollouts = read_rollouts_jsonl(latest / ROUNDS_FILE)
    summary = summarize(rollouts, block_size=int(meta["spec"]["block_size"]))
    report = write_report(ctx, meta, summary)
    if ctx.store is not None:
        ctx.store.log_metrics(ctx.run_id, flatten_metrics(summary))
    log.info("rebuilt %s from %s", report, latest)
    print(f"report: {report} (from {latest})")
    return report


def run_profile(ctx: StageContext) -> Path:
    """Re-measure the target's SPS(B) for B = 1..γ+1 on this machine, save it to the cache and print it."""
    target = ctx.load_target()
    table, path = load_or_profile_sps(target=target, cache_dir=ctx.paths.cache, block_size=ctx.cfg.model.block_size,
                                      refresh=True)
    if ctx.store is not None:
        ctx.store.log_metrics(ctx.run_id, {f"profile/sps/B{b}": s for b, s in
                                           zip(table.batch_tokens, table.steps_per_second)})
        ctx.store.client.log_artifact(ctx.run_id, str(path), artifact_path="profile")
    print(f"SPS table of {target.name} on {table.machine}\n{path}\n\n{sps_markdown(table)}")
    return path
