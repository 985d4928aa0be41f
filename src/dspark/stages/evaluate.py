"""Stages `eval`, `report` and `profile`: turn a trained drafter into measured results (METHOD §5, §6, §8).

`run_eval`: load target + drafter → (STS calibration on held-out prompts, when decode.calibrate and a policy reads
confidences) → (SPS table, for the scheduler) → speculative decoding and (decode.baseline) target-only decoding
of the same prompts → per-dataset / per-domain / overall metrics (`dspark.evaluation.summary`) → MLflow (`eval/…`,
`summary/…`), raw round records (`<run dir>/evals/<stamp>-<policy>-T<temperature>/rounds.jsonl` + `meta.json`)
and a markdown report `<reports>/eval-<run dir>-<policy>-T<temperature>-<prompts digest>.md` with its figures next to
it (attached to the MLflow run with an HTML rendering, `dspark.tracking.artifacts.log_report`). paths.reports is
claimed before decoding (`claimed_report_paths`): a directory or report file we did not write is refused, untouched.

The speed measurement: decode.policy=fixed (every draft verified) gives the paper's τ but is not a speed policy, so
when decode.baseline is on and the policy is not already the speed policy, `SPEED_POLICY` (the scheduler) and
target-only decoding are also run on decode.speed_prompts of the prompts (`speed-rounds.jsonl`, `speed/…` metrics,
a report section). `EvalResult.headline` states τ and that speed-up: the run's last line.

Nothing written holds an absolute path of the machine: paths in meta.json and the report are relative to
paths.root (`portable_path`), and the command drops its `paths.*` arguments.
`run_report` rebuilds that report from the latest saved records of this config; `run_profile` re-measures SPS(B).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark.config import to_dict
from dspark.config.schema import CALIBRATED_POLICIES as CALIBRATED_READERS
from dspark.config.schema import CONFIDENCE_POLICIES  # the policies that read c_k: calibrate for them
from dspark.config.secrets import mask_arg
from dspark.decoding.drafting import precision_name
from dspark.evaluation.calibrate import CalibrationReport
from dspark.evaluation.diagnostics import load_or_profile_sps, sps_markdown
from dspark.evaluation.plots import plot_conditional_acceptance
from dspark.evaluation.rollouts import encode_prompts, read_rollouts_jsonl, run_rollouts, write_rollouts_jsonl
from dspark.evaluation.summary import (
    EvalSummary,
    flatten_metrics,
    report_markdown,
    speed_metrics,
    speedup_phrase,
    summarize,
    tau_phrase,
)
from dspark.files import atomic_write_text, check_output_file, claim_output_dir, is_our_markdown, is_report_entry
from dspark.hardware import machine_summary
from dspark.stages.context import StageContext, run_name
from dspark.stages.drafter import TrainedDrafter, calibrate, confidence_source, open_trained_drafter
from dspark.stages.prepare import PreparedData
from dspark.tracking.artifacts import log_report
from dspark.tracking.lineage import log_eval_data

if TYPE_CHECKING:
    from dspark.drafters.factory import DrafterSpec
    from dspark.targets import Target

log = logging.getLogger("dspark")
EVALS_DIR = "evals"
ROUNDS_FILE = "rounds.jsonl"
SPEED_ROUNDS_FILE = "speed-rounds.jsonl"
META_FILE = "meta.json"
SPS_POLICIES = ("scheduler", "async")
SPEED_POLICY = "scheduler"  # the policy whose speed-up the run reports (README "What to expect")


@dataclass
class EvalResult:
    """What `run_eval` leaves: the report and the line that states the result (the run prints it last)."""

    report: Path
    headline: str


@dataclass
class SpeedPlan:
    """Whether and how the speed-up is measured beside decode.policy's pass (`plan_speed`)."""

    separate: bool  # a second pass: SPEED_POLICY and target-only on `prompts` of the prompts
    prompts: int
    note: str  # why there is no separate pass (empty when there is one)


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
    threshold = (
        f"-th{decode.threshold:g}"
        if "threshold" in decode.policy
        else f"-k{decode.static_k}"
        if decode.policy == "static"
        else ""
    )
    prompts = json.dumps(
        [list(decode.eval_sets), int(decode.prompts_per_set), int(decode.max_new_tokens), int(ctx.cfg.seed)]
    )
    digest = hashlib.sha1(prompts.encode()).hexdigest()[:6]
    policy = decode.policy if decode.tree.shape == "chain" else f"tree-{tree_name(decode)}"
    # another confidence source or calibration set is another evaluation of the same drafter (the head's and the
    # held-out split's names stay as they were)
    confidence = "" if decode.confidence == "head" else f"-{decode.confidence}"
    calibration = f"-cal-{decode.calibration_set}" if decode.calibration_set else ""
    arms = f"{arm_stem(decode)}{confidence}{calibration}"
    return f"eval-{ctx.run_dir.name}-{policy}{threshold}{arms}-T{decode.temperature:g}-{digest}"


def arm_stem(decode: Any) -> str:
    """The verification arms off their defaults as a file-name part (`-block`, `-argmax`, `-bypass`), so that the
    cells of sweep=verifier / sweep=scheduler_arms, which share one drafter, do not overwrite each other's report."""
    parts = [
        "-block" if decode.verifier == "block" else "",
        "-argmax" if decode.scheduler_stop == "global_argmax" else "",
        "-bypass" if decode.bypass == "cost" else "",
    ]
    return "".join(parts)


def scheduler_lossy(decode: Any, *, speed: bool = False) -> bool:
    """Whether a scheduler of this evaluation ran with decode.scheduler_stop=global_argmax (biased: Appendix A)."""
    scheduled = decode.policy == "scheduler" or (speed and SPEED_POLICY == "scheduler")
    return decode.scheduler_stop == "global_argmax" and scheduled and decode.tree.shape == "chain"


LOSSY_NOTE = "LOSSY: decode.scheduler_stop=global_argmax, the output is not the target's (paper Appendix A)"


def arm_metrics(decode: Any, engine: Any, *, speed: bool) -> dict[str, float]:
    """`eval/lossy` = 1 when a global-argmax scheduler ran; `eval/bypass_rate`: the share of rounds decode.bypass made
    plain target steps (over decode.policy's pass)."""
    metrics = {"eval/lossy": 1.0} if scheduler_lossy(decode, speed=speed) else {}
    gate = getattr(engine, "gate", None)
    if gate is not None and gate.drafted + gate.bypassed:
        metrics["eval/bypass_rate"] = gate.bypassed / (gate.drafted + gate.bypassed)
        log.info(
            "decode.bypass=cost: %d of %d rounds were plain target steps", gate.bypassed, gate.drafted + gate.bypassed
        )
    if metrics.get("eval/lossy"):
        log.warning("%s", LOSSY_NOTE)
    return metrics


def tree_name(decode: Any) -> str:
    """decode.tree as a file-name-safe word: `dynamic16b4-descent`, `branching2-2-1-rrsw` (chain: `chain`)."""
    from dspark.decoding.tree import TreeShape

    label = TreeShape.from_config(decode.tree).label()
    if label == "chain":
        return label
    return f"{label.replace('[', '').replace(']', '').replace(',', '-')}-{decode.tree.scheme}"


def report_paths(ctx: StageContext) -> dict[str, Path]:
    """Where the report and its figures go: `<reports>/<report_stem>{.md,-cond.png,-reliability.png}`."""
    stem = report_stem(ctx)
    reports = Path(ctx.paths.reports)
    return {
        "report": reports / f"{stem}.md",
        "cond": reports / f"{stem}-cond.png",
        "reliability": reports / f"{stem}-reliability.png",
    }


def claimed_report_paths(ctx: StageContext) -> dict[str, Path]:
    """`report_paths`, once paths.reports is claimed (new, empty or ours) and the report is missing or ours;
    ForeignOutputError otherwise, before anything is written."""
    paths = report_paths(ctx)
    claim_output_dir(paths["report"].parent, key="paths.reports", kind="reports", ours=is_report_entry)
    check_output_file(paths["report"], key="paths.reports", ours=is_our_markdown)
    return paths


def load_eval_prompts(ctx: StageContext, target: Target) -> list:
    """decode.prompts_per_set prompts of each decode.eval_sets set, chat-templated, in the paper's order."""
    decode = ctx.cfg.decode
    records = {name: ctx.load_prompts(name, limit=decode.prompts_per_set) for name in decode.eval_sets}
    return encode_prompts(target, records, max_new_tokens=decode.max_new_tokens)


def plan_speed(decode: Any, trained: TrainedDrafter) -> SpeedPlan:
    """A separate speed pass runs when decode.baseline is on, decode.policy is not SPEED_POLICY already (its own pass
    then measures the speed-up), decode.speed_prompts > 0 and the drafter has the confidences the scheduler reads."""
    count = decode.speed_prompts
    if not decode.baseline:
        return SpeedPlan(False, 0, "not measured (decode.baseline=false)")
    if decode.policy == SPEED_POLICY or decode.tree.shape != "chain":  # its own pass (with target-only) is timed
        return SpeedPlan(False, 0, "")
    if count < 1:
        return SpeedPlan(False, 0, "not measured (decode.speed_prompts=0)")
    if not trained.has_confidences(decode.confidence):
        return SpeedPlan(
            False,
            0,
            f"{trained.spec.kind} has no confidence head for decode.policy={SPEED_POLICY} "
            "(decode.confidence=draft_max_prob or online needs none)",
        )
    return SpeedPlan(True, count, "")


def maybe_calibrate(
    ctx: StageContext,
    trained: TrainedDrafter,
    *,
    proposer: Any,
    prepared: PreparedData | None,
    speed: SpeedPlan | None = None,
) -> tuple[CalibrationReport | None, str]:
    """STS at decode.temperature when decode.calibrate and a policy of this evaluation (decode.policy, or the speed
    pass's scheduler) reads confidences the drafter has."""
    decode = ctx.cfg.decode
    speed_reads = speed is not None and speed.separate
    if decode.policy not in CONFIDENCE_POLICIES and not speed_reads:
        return None, "not used (decode.policy reads no confidences)"
    if not decode.calibrate:
        reads_calibrated = [
            p for p in (decode.policy, SPEED_POLICY if speed_reads else None) if p in CALIBRATED_READERS
        ]
        if reads_calibrated:  # said loudly, in the log, the report and the run's tags: never a silent fallback
            note = raw_confidence_note(reads_calibrated)
            log.warning(note)
            return None, note
        return None, "not used (decode.calibrate=false)"
    if not trained.has_confidences(decode.confidence):
        raise ValueError(
            f"decode.policy={decode.policy} needs c_k: a drafter with a confidence head (drafter=dspark), or a "
            "head-less decode.confidence=draft_max_prob / online; or use decode.policy=fixed for dflash / eagle3"
        )
    return calibrate(ctx, trained, prepared=prepared, proposer=proposer, plot_path=report_paths(ctx)["reliability"])


def raw_confidence_note(policies: list[str]) -> str:
    """The line a run states when a policy that reads calibrated c̃_k ran on raw c_k (decode.calibrate=false)."""
    names = ", ".join(f"decode.policy={p}" if i == 0 else p for i, p in enumerate(policies))
    return (
        f"**raw c_k**: {names} reads calibrated c̃_k, but decode.calibrate=false, so it ran on the raw c_k "
        "(no STS); set decode.calibrate=true for the paper's setting"
    )


def new_eval_dir(ctx: StageContext) -> Path:
    decode = ctx.cfg.decode
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = ctx.run_dir / EVALS_DIR / f"{stamp}-{decode.policy}-T{decode.temperature:g}"
    suffix = 1
    while path.exists():  # two evaluations within one second
        path, suffix = path.with_name(f"{path.name.split('~')[0]}~{suffix}"), suffix + 1
    path.mkdir(parents=True)
    return path


def speed_subset(prompts: list, count: int) -> list:
    """`count` of the prompts, taken in turn from each set (gsm8k, humaneval, mt-bench, gsm8k, …) in their order."""
    by_set: dict[str, list] = {}
    for prompt in prompts:
        by_set.setdefault(prompt.dataset, []).append(prompt)
    chosen, depth = [], 0
    while len(chosen) < min(count, len(prompts)):
        chosen += [group[depth] for group in by_set.values() if depth < len(group)][: count - len(chosen)]
        depth += 1
    return chosen


def run_eval(ctx: StageContext, drafter_path: str | Path, *, prepared: PreparedData | None = None) -> EvalResult:
    """Evaluate the drafter at `drafter_path` with the decode.* config (and the speed pass of `plan_speed`); returns
    the report's path and the headline. `prepared` (the data this invocation regenerated) supplies the held-out
    calibration prompts."""
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.policies import build_policy
    from dspark.decoding.proposers import build_proposer
    from dspark.decoding.tree import TreeShape
    from dspark.decoding.tree_engine import TreeEngine

    cfg, decode = ctx.cfg, ctx.cfg.decode
    check_decode_config(decode)
    claimed_report_paths(ctx)  # a report we may not write fails now, not after decoding
    trained = open_trained_drafter(ctx, drafter_path)
    target, spec = trained.target, trained.spec
    proposer = build_proposer(
        trained.drafter, precision=decode.drafter_precision, confidence=confidence_source(ctx, trained)
    )
    speed = plan_speed(decode, trained)
    calibration, calibration_source = maybe_calibrate(ctx, trained, proposer=proposer, prepared=prepared, speed=speed)
    sts = calibration.sts if calibration else None
    sps, sps_path = (None, None)
    if decode.policy in SPS_POLICIES or speed.separate:
        sps, sps_path = load_or_profile_sps(target=target, cache_dir=ctx.paths.cache, block_size=spec.block_size)

    tree = TreeShape.from_config(decode.tree)
    if tree.kind == "dynamic":  # N is sized on SPS(B) up to B = nodes + 1
        sps, sps_path = load_or_profile_sps(
            target=target, cache_dir=ctx.paths.cache, block_size=max(spec.block_size, tree.nodes)
        )

    def engine(policy: str | None) -> Any:  # None: target-only decoding, the speed-up's baseline
        common = {"target": target, "temperature": decode.temperature, "max_new_tokens": decode.max_new_tokens}
        if policy is None:
            return SpeculativeEngine(proposer=None, policy=build_policy("fixed"), **common)
        if tree.kind != "chain":
            return TreeEngine(proposer=proposer, shape=tree, scheme=decode.tree.scheme, sps=sps, **common)
        return SpeculativeEngine(
            proposer=proposer,
            policy=build_policy(
                policy,
                threshold=decode.threshold,
                static_k=decode.static_k,
                sps=sps,
                scheduler_stop=decode.scheduler_stop,
            ),
            calibration=sts if policy in CONFIDENCE_POLICIES else None,
            step_costs=decode.step_costs,
            verifier=decode.verifier,
            bypass=decode.bypass,
            **common,
        )

    prompts = load_eval_prompts(ctx, target)
    log_eval_data(ctx, prompts)  # each evaluation set as a dataset input of the run (digest and source)
    log.info(
        "evaluating %s on %d prompts (%s), policy %s, temperature %g",
        portable_path(trained.path, ctx=ctx),
        len(prompts),
        ", ".join(decode.eval_sets),
        decode.policy,
        decode.temperature,
    )
    engines = {"speculative": engine(decode.policy)} | ({"target": engine(None)} if decode.baseline else {})
    rollouts = run_rollouts(
        engines,
        prompts,
        seed=cfg.seed,
        desc="eval (speculative + target-only)" if decode.baseline else "eval (speculative)",
    )
    speed_rollouts = None
    if speed.separate:
        subset = speed_subset(prompts, speed.prompts)
        log.info(
            "speed-up: decode.policy=%s against target-only decoding on %d of the prompts", SPEED_POLICY, len(subset)
        )
        speed_rollouts = run_rollouts(
            {"speculative": engine(SPEED_POLICY), "target": engine(None)},
            subset,
            seed=cfg.seed,
            desc=f"speed ({SPEED_POLICY} + target-only)",
        )
    out_dir = new_eval_dir(ctx)
    write_rollouts_jsonl(out_dir / ROUNDS_FILE, rollouts)
    if speed_rollouts is not None:
        write_rollouts_jsonl(out_dir / SPEED_ROUNDS_FILE, speed_rollouts)
    meta = eval_meta(
        ctx,
        spec=spec,
        drafter_path=trained.path,
        out_dir=out_dir,
        sps_path=sps_path,
        calibration=calibration,
        calibration_source=calibration_source,
        speed=speed_rollouts is not None,
    )
    summary = summarize(rollouts, block_size=spec.block_size)
    speed_summary = summarize(speed_rollouts, block_size=spec.block_size) if speed_rollouts else None
    meta["headline"] = headline(decode, summary, speed_summary, note=speed.note, block_size=spec.block_size)
    atomic_write_text(out_dir / META_FILE, json.dumps(meta, indent=2))
    metrics = flatten_metrics(summary) | (calibration.metrics() if calibration else {})
    metrics |= speed_metrics(speed_summary) if speed_summary else {}
    metrics |= coverage_metrics(target=target, trained=trained, prompts=prompts, rollouts=rollouts, decode=decode)
    metrics |= confidence_metrics(decode, proposer=proposer, calibrated=sts is not None)
    metrics |= arm_metrics(decode, engines["speculative"], speed=speed_rollouts is not None)
    if ctx.store is not None:
        ctx.store.log_metrics(ctx.run_id, metrics)
    report = write_report(ctx, meta, summary, speed=speed_summary)
    log.info("eval: report %s", report)
    return EvalResult(report=report, headline=meta["headline"])


def confidence_metrics(decode: Any, *, proposer: Any, calibrated: bool) -> dict[str, float]:
    """`eval/calibrated_input` (1: the calibrated-reading policy read c̃_k; 0: it ran on raw c_k — the report says so)
    and, for decode.confidence=online, what the estimator learned (`confidence/online/<weight>`)."""
    out: dict[str, float] = {}
    if decode.policy in CALIBRATED_READERS:
        out["eval/calibrated_input"] = float(calibrated)
    state = getattr(getattr(proposer, "confidence", None), "state", None)
    if callable(state):
        out |= {f"confidence/online/{name}": value for name, value in state().items()}
    return out


def coverage_metrics(
    *, target: Target, trained: TrainedDrafter, prompts: list, rollouts: list, decode: Any
) -> dict[str, float]:
    """`eval/vocab_coverage` (and per domain): the draft vocabulary's share of the target's own generations."""
    from dspark.evaluation.coverage import draft_vocab_coverage

    coverage = draft_vocab_coverage(
        target=target, drafter=trained.drafter, prompts=prompts, rollouts=rollouts, temperature=decode.temperature
    )
    if not coverage:
        return {}
    log.info(
        "draft-vocabulary coverage of the target's own generations: %s",
        ", ".join(f"{d} {v:.3f}" for d, v in sorted(coverage.items())),
    )
    return {
        ("eval/vocab_coverage" if d == "all" else f"eval/domain/{d}/vocab_coverage"): v for d, v in coverage.items()
    }


def tau_setting(decode: Any, *, block_size: int) -> str:
    """How τ was measured, in the paper's words when it is the paper's setting (fixed ℓ = γ, T = 1)."""
    temperature = f"T={decode.temperature:g}" + (" (greedy)" if decode.temperature == 0 else "")
    if decode.tree.shape != "chain":
        return f"tree {tree_name(decode)}, {temperature}"
    arms = "".join(
        f", decode.{key}={value}"
        for key, value, default in (
            ("verifier", decode.verifier, "token"),
            ("bypass", decode.bypass, "off"),
            ("scheduler_stop", decode.scheduler_stop, "first_non_improvement"),
        )
        if value != default
    )
    if decode.policy == "fixed":
        return f"fixed ℓ=γ={block_size}, {temperature}{arms}"
    return f"decode.policy={decode.policy}, {temperature}{arms}"


def headline(decode: Any, summary: EvalSummary, speed: EvalSummary | None, *, note: str, block_size: int) -> str:
    """The run's last line: τ in the evaluated setting (the paper's with decode.policy=fixed, T=1) and the speed-up
    of SPEED_POLICY over target-only decoding, each with its 95% interval over prompts where there is one."""
    tau = tau_phrase(summary, setting=tau_setting(decode, block_size=block_size))
    if scheduler_lossy(decode, speed=speed is not None):  # first, where no reader of the line can miss it
        tau = f"{LOSSY_NOTE} · {tau}"
    against = "vs target-only on this machine"
    if speed is not None:
        return f"{tau} · {speedup_phrase(speed, setting=f'with decode.policy={SPEED_POLICY} {against}')}"
    if decode.baseline and decode.tree.shape != "chain":
        return f"{tau} · {speedup_phrase(summary, setting=f'with decode.tree {tree_name(decode)} {against}')}"
    if decode.baseline and (decode.policy == SPEED_POLICY or note):
        reason = f"; {note}" if note else ""
        return f"{tau} · {speedup_phrase(summary, setting=f'with decode.policy={decode.policy} {against}{reason}')}"
    return f"{tau} · speed-up {note or 'not measured'}"


def portable_path(path: str | Path | None, *, ctx: StageContext) -> str | None:
    """`path` as written into reports and meta: relative to paths.root when under it, else relative to the current
    directory when under it, else only its name (`…/name`): never an absolute path of this machine."""
    if path is None:
        return None
    path = Path(path).expanduser()
    if not path.is_absolute():
        return path.as_posix()
    resolved = path.resolve()
    for base in (Path(ctx.paths.root).resolve(), Path.cwd().resolve()):
        if resolved.is_relative_to(base):
            return resolved.relative_to(base).as_posix() or "."
    return f"…/{path.name}"


def portable_command(argv: list[str], *, ctx: StageContext) -> str:
    """The command as reports record it: without `paths.*` (this machine's directories; reports say that paths are
    relative to paths.root), any other absolute path made portable and a URI's password masked."""
    kept = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.startswith("paths."):
            continue
        if sep and value.startswith(("/", "~")):
            arg = f"{key}={portable_path(value, ctx=ctx)}"
        else:
            arg = mask_arg(arg)  # a credential in any value, with or without a scheme
        kept.append(arg)
    return " ".join(["python experiments/run.py", *kept])


def eval_meta(
    ctx: StageContext,
    *,
    spec: DrafterSpec,
    drafter_path: Path,
    out_dir: Path,
    sps_path: Path | None,
    calibration: CalibrationReport | None,
    calibration_source: str,
    speed: bool = False,
) -> dict:
    """What ran, for the report and for rebuilding it (`run_report`); paths relative to paths.root."""
    tags = ctx.run_tags()
    target = ctx.load_target()
    speed_meta = {"policy": SPEED_POLICY, "rounds_file": portable_path(out_dir / SPEED_ROUNDS_FILE, ctx=ctx)}
    return {
        "run_name": run_name(ctx.cfg),
        "command": portable_command(ctx.rc.argv, ctx=ctx),
        "git_commit": tags.get("git.commit", ""),
        "mlflow_run_id": ctx.run_id,
        "target": portable_path(target.name, ctx=ctx),
        "target_fingerprint": target.fingerprint,
        "drafter_kind": spec.kind,
        "spec": spec.to_dict(),
        "drafter_path": portable_path(drafter_path, ctx=ctx),
        "paths_relative_to": "paths.root",
        "decode": to_dict(ctx.cfg.decode),
        "seed": ctx.cfg.seed,
        "eval_dir": portable_path(out_dir, ctx=ctx),
        "rounds_file": portable_path(out_dir / ROUNDS_FILE, ctx=ctx),
        "speed": speed_meta if speed else None,
        "sps_table": portable_path(sps_path, ctx=ctx),
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


def write_report(ctx: StageContext, meta: dict, summary: Any, *, speed: EvalSummary | None = None) -> Path:
    """Write the markdown report and the cond@k figure; attach them (an HTML rendering with the figures inlined, the
    reliability figure, the round records) to the MLflow run."""
    paths = claimed_report_paths(ctx)
    plot_conditional_acceptance(
        summary,
        paths["cond"],
        title=f"cond@k — {meta['run_name']}, policy {meta['decode']['policy']}, T={meta['decode']['temperature']:g}",
    )
    reliability = meta.get("reliability_plot") if paths["reliability"].exists() else None
    calibration_md = meta.get("calibration_md")
    if calibration_md:
        calibration_md = f"Held-out prompts: {meta['calibration_source']}.\n\n{calibration_md}"
    elif str(meta.get("calibration_source", "")).startswith("**raw c_k**"):  # stated where the numbers are read
        calibration_md = str(meta["calibration_source"])
    atomic_write_text(
        paths["report"],
        report_markdown(
            meta,
            summary,
            cond_plot=paths["cond"].name,
            calibration_md=calibration_md,
            reliability_plot=reliability,
            speed=speed,
        ),
        key="paths.reports",
    )
    if ctx.store is not None:
        figures = [paths["cond"]] + ([paths["reliability"]] if reliability else [])
        log_report(ctx.store, ctx.run_id, paths["report"], figures, artifact_path="eval")
        for records in (meta.get("rounds_file"), (meta.get("speed") or {}).get("rounds_file")):
            path = Path(ctx.paths.root) / records if records else None  # an absolute path (older meta) stays as is
            if path is not None and path.exists():
                ctx.store.client.log_artifact(ctx.run_id, str(path), artifact_path="eval")
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
        raise ValueError(
            f"No saved evaluation of this config under {ctx.run_dir / EVALS_DIR}: run stage=eval (or "
            "stage=all) with the same training config first, then stage=report."
        )
    meta = json.loads((latest / META_FILE).read_text())
    block_size = int(meta["spec"]["block_size"])
    summary = summarize(read_rollouts_jsonl(latest / ROUNDS_FILE), block_size=block_size)
    speed_file = latest / SPEED_ROUNDS_FILE
    speed = summarize(read_rollouts_jsonl(speed_file), block_size=block_size) if speed_file.exists() else None
    report = write_report(ctx, meta, summary, speed=speed)
    if ctx.store is not None:
        ctx.store.log_metrics(ctx.run_id, flatten_metrics(summary) | (speed_metrics(speed) if speed else {}))
    log.info("rebuilt %s from %s", report, latest)
    print(f"report: {report} (from {latest})")
    return report


def run_profile(ctx: StageContext) -> Path:
    """Re-measure the target's SPS(B) for B = 1..γ+1 on this machine, save it to the cache and print it."""
    target = ctx.load_target()
    table, path = load_or_profile_sps(
        target=target, cache_dir=ctx.paths.cache, block_size=ctx.cfg.model.block_size, refresh=True
    )
    if ctx.store is not None:
        ctx.store.log_metrics(
            ctx.run_id, {f"profile/sps/B{b}": s for b, s in zip(table.batch_tokens, table.steps_per_second)}
        )
        ctx.store.client.log_artifact(ctx.run_id, str(path), artifact_path="profile")
    print(f"SPS table of {target.name} on {table.machine}\n{path}\n\n{sps_markdown(table)}")
    return path
