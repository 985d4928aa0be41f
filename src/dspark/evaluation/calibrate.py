"""Fit Sequential Temperature Scaling on held-out decoding rounds and store it with the drafter (METHOD §6, §8).

Protocol (METHOD §6): rounds are decoded with the fixed policy (ℓ = γ, so no prefix event is censored) at the serving
temperature on held-out prompts — the calibration split of the regenerated training data (`split_indices`, the
prompts the drafter never trained on) when that data is in the cache, topped up to the wanted count (or replaced)
by synthetic prompts from a different seed, minus any training prompt. Per round: raw confidences `c_1..c_γ`,
accepted drafts `A`, and slot k valid iff `k ≤ ℓ_eff` (slots after a drafted EOS are dropped). The fit
(`fit_sts`) and the ECE / AUROC / Brier of the cumulative product `a_k` before and after come from
`dspark.calibration`.

Held out twice: the prompts are split by prompt (never by round: rounds of one prompt are correlated) into a *fit*
split — the first ⌈P/2⌉ prompts in their (already random) order — and a *score* split, the rest. STS is fitted on
the fit split only and every quality number (ECE, AUROC, Brier before → after) is measured on the score split, so
the reported gain is what the stored calibration does on prompts it never saw. With one prompt there is no score
split: the report then says "in-sample" in its table and its `calibration/held_out` metric is 0.
A position's cell is *uninformative* when the score split has fewer than `MIN_EVENTS` prefix-accepts (A ≥ k) or
fewer than `MIN_EVENTS` rejections there: with a handful of positives ECE is small by construction and AUROC is
noise (or undefined with none); the table prints such cells as "uninformative (n+ = …)" instead of a number.

Storage: `drafter.pt["calibration"]` is a dict keyed by temperature and confidence source (`calibration_key`, e.g.
"T=1", or "T=1/draft_max_prob" for a head-less source) — greedy and sampled acceptance are different events, and each
source's c_k a different signal — each entry being `STSCalibration.to_dict()` plus the fit's metrics, the split and
the raw rounds (so a report can redraw the reliability diagram without decoding again). Entries of an older protocol
(`PROTOCOL`: before the held-out split) are refitted, never reused.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from dspark.calibration import (
    CalibrationMetrics,
    STSCalibration,
    calibration_metrics,
    fit_sts,
    plot_reliability,
    reliability_curves,
)
from dspark.data.regenerate import derive_seed
from dspark.markdown import markdown_table, num
from dspark.drafters.checkpoint import read_checkpoint, save_drafter
from dspark.drafters.factory import DrafterSpec

if TYPE_CHECKING:
    from dspark.targets import Target
    from dspark.config.schema import DataConfig
    from dspark.data.prompts import PromptRecord

log = logging.getLogger("dspark")
SYNTHETIC_SEED_OFFSET = 7919  # held-out synthetic prompts: a seed no training run of this config uses
MIN_EVENTS = 10  # a position's ECE / AUROC is informative with at least this many accepts and this many rejections
PROTOCOL = 2  # 2 = fit on one prompt split, scored on the other (1, unmarked: fitted and scored on the same rounds)


@dataclass
class CalibrationRounds:
    """Rounds decoded with ℓ = γ. n rounds, γ block size."""

    conf: Tensor  # [n, γ] float64 raw c_k (0.5 where the slot is invalid)
    accepted_prefix: Tensor  # [n] long, A
    valid: Tensor  # [n, γ] bool, k ≤ ℓ_eff
    num_prompts: int
    prompt: Tensor | None = None  # [n] long, the index of the prompt each round decoded (None: not recorded)

    def select(self, keep: Tensor) -> "CalibrationRounds":
        """The rounds where `keep` [n] bool is true (prompt count = the distinct prompts kept)."""
        prompt = None if self.prompt is None else self.prompt[keep]
        prompts = int(prompt.unique().numel()) if prompt is not None else self.num_prompts
        return CalibrationRounds(self.conf[keep], self.accepted_prefix[keep], self.valid[keep], prompts, prompt)


def split_by_prompt(rounds: CalibrationRounds) -> tuple[CalibrationRounds, CalibrationRounds, bool]:
    """(fit rounds, score rounds, held_out): prompts < ⌈P/2⌉ fit, the rest score (module docstring); with fewer
    than two prompts (or no prompt index) both are all rounds and held_out is False."""
    if rounds.prompt is None or rounds.prompt.numel() == 0 or int(rounds.prompt.unique().numel()) < 2:
        return rounds, rounds, False
    prompts = rounds.prompt.unique(sorted=True)
    cut = prompts[(prompts.numel() + 1) // 2 - 1]
    fit = rounds.prompt <= cut
    return rounds.select(fit), rounds.select(~fit), True


def rounds_to_arrays(
    rounds: Iterable[Any], *, block_size: int, num_prompts: int = 0, prompts: Sequence[int] | None = None
) -> CalibrationRounds:
    """RoundRecords (objects or dicts) → `CalibrationRounds`; a round without confidences is an error. `prompts`:
    each round's prompt index (same length as the rounds), for the fit / score split."""
    conf, accepted, valid = [], [], []
    for index, record in enumerate(rounds):
        get = record.get if isinstance(record, dict) else lambda name, r=record: getattr(r, name)
        confidences, verified = get("confidences"), int(get("num_verified"))
        if confidences is None:
            raise ValueError(
                "STS calibration needs c_k in every round, but round "
                f"{index} has none; calibrate drafter=dspark, or a head-less decode.confidence=draft_max_prob / "
                "online, or set decode.calibrate=false."
            )
        if verified > block_size or len(confidences) < verified:
            raise ValueError(
                f"round {index}: ℓ_eff={verified} with {len(confidences)} confidences does not fit "
                f"block_size={block_size}"
            )
        conf.append([float(c) for c in confidences[:block_size]] + [0.5] * (block_size - len(confidences)))
        accepted.append(int(get("num_accepted")))
        valid.append([k < verified for k in range(block_size)])
    return CalibrationRounds(
        torch.tensor(conf, dtype=torch.float64).reshape(-1, block_size),
        torch.tensor(accepted, dtype=torch.long),
        torch.tensor(valid, dtype=torch.bool).reshape(-1, block_size),
        num_prompts,
        None if prompts is None else torch.tensor(list(prompts), dtype=torch.long),
    )


def collect_calibration_rounds(
    *,
    target: Target,
    proposer: Any,
    prompt_ids: Sequence[list[int]],
    temperature: float,
    max_new_tokens: int,
    seed: int,
    block_size: int,
    show_progress: bool = True,
) -> CalibrationRounds:
    """Decode every prompt with the fixed policy (ℓ = γ) and gather its rounds."""
    from dspark.decoding.engine import SpeculativeEngine
    from dspark.decoding.policies import build_policy

    if not prompt_ids:
        raise ValueError(
            "STS calibration needs at least one held-out prompt; set decode.calibrate=false or "
            "regenerate more data (data.num_train_prompts, data.calib_fraction)."
        )
    engine = SpeculativeEngine(
        target=target,
        proposer=proposer,
        policy=build_policy("fixed", threshold=0.0, sps=None, calibration=None),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
    )
    rounds: list[Any] = []
    prompts: list[int] = []
    for index, ids in enumerate(tqdm(prompt_ids, desc="calibration rounds", unit="prompt", disable=not show_progress)):
        generator = torch.Generator(device=target.device).manual_seed(derive_seed(seed, "calibration", index))
        decoded = engine.generate(list(ids), generator=generator).rounds
        rounds.extend(decoded)
        prompts.extend([index] * len(decoded))
    return rounds_to_arrays(rounds, block_size=block_size, num_prompts=len(prompt_ids), prompts=prompts)


@dataclass
class CalibrationReport:
    """A fitted STS with its quality before / after, for one decoding temperature."""

    temperature: float
    sts: STSCalibration
    before: CalibrationMetrics  # on the score split
    after: CalibrationMetrics  # on the score split
    num_rounds: int  # all rounds (fit + score)
    num_prompts: int  # all prompts (fit + score)
    plot_path: Path | None = None
    held_out: bool = False  # True: fitted on the fit split, scored on the disjoint score split (`split_by_prompt`)
    fit_rounds: int = 0
    fit_prompts: int = 0
    score_rounds: int = 0
    score_prompts: int = 0
    source: str = "head"  # the confidence source whose c_k were calibrated (decode.confidence)
    prompt_set: str = ""  # the calibration prompts: "" = the held-out split, else a prompt set (decode.calibration_set)

    def informative(self, k: int) -> bool:
        """Whether position k (0-based) of the score split has ≥ MIN_EVENTS accepts and ≥ MIN_EVENTS rejections."""
        positives = self.before.positives
        if positives is None:
            return True  # an entry stored before the count: nothing to judge it by
        return positives[k] >= MIN_EVENTS and self.before.count[k] - positives[k] >= MIN_EVENTS

    def metrics(self) -> dict[str, float]:
        """`calibration/{ece,auroc,brier}_{before,after}/pos{k}` (score split), `calibration/informative/pos{k}` (1: a
        cell a report may read), the temperatures, the split sizes and `calibration/held_out`, for MLflow."""
        out = {
            "calibration/rounds": float(self.num_rounds),
            "calibration/held_out": float(self.held_out),
            "calibration/fit_rounds": float(self.fit_rounds),
            "calibration/score_rounds": float(self.score_rounds),
        }
        for when, m in (("before", self.before), ("after", self.after)):
            for name in ("ece", "auroc", "brier"):
                out.update({f"calibration/{name}_{when}/pos{k + 1}": v for k, v in enumerate(getattr(m, name))})
        # every value is logged; reports read a cell only where it is informative (module docstring)
        out.update({f"calibration/informative/pos{k + 1}": float(self.informative(k)) for k in range(len(m.ece))})
        if self.before.positives is not None:
            out.update({f"calibration/positives/pos{k + 1}": float(v) for k, v in enumerate(self.before.positives)})
            out.update({f"calibration/count/pos{k + 1}": float(v) for k, v in enumerate(self.before.count)})
            for when, m in (("before", self.before), ("after", self.after)):
                for k, value in enumerate(m.auroc):
                    se = auroc_se(value, positives=self.before.positives[k], count=self.before.count[k])
                    if self.informative(k) and math.isfinite(se):
                        out[f"calibration/auroc_{when}_se/pos{k + 1}"] = se
        out.update({f"calibration/temperature/pos{k + 1}": t for k, t in enumerate(self.sts.temperatures)})
        return out

    def split_text(self) -> str:
        """Which rounds fitted and which scored, in words."""
        if not self.held_out:
            return (
                f"**in-sample**: fitted and scored on the same {self.num_rounds} rounds of {self.num_prompts} "
                "prompt(s) (fewer than two prompts: no held-out split)"
            )
        return (
            f"fitted on {self.fit_rounds} rounds of {self.fit_prompts} prompts (the fit split), scored on "
            f"{self.score_rounds} rounds of the other {self.score_prompts} prompts (the score split)"
        )

    def markdown(self) -> str:
        """A table of T_k and ECE / AUROC / Brier of a_k before → after, per position."""
        intro = (
            f"STS of the `{self.source}` confidences at decoding temperature {self.temperature:g}, held-out "
            f"prompts decoded with ℓ = γ: {self.split_text()}. Grid of {len(self.sts.grid)} log-spaced "
            f"temperatures in [{min(self.sts.grid):g}, {max(self.sts.grid):g}] on the logit, ECE with "
            f"{self.sts.n_bins} equal-width bins (our choices, METHOD §6). Metrics of the cumulative "
            "product a_k against the prefix-accept event; a cell is *uninformative* when the scored rounds hold "
            f"fewer than {MIN_EVENTS} accepts or {MIN_EVENTS} rejections at that position (n+ = accepts)."
        )
        header = ["k", "rounds", "n+", "T_k", "ECE % before → after", "AUROC before → after", "Brier before → after"]
        b, a = self.before, self.after
        rows = []
        for k, temp in enumerate(self.sts.temperatures):
            positives = "–" if b.positives is None else b.positives[k]
            if self.informative(k):
                cells = [
                    f"{num(100 * b.ece[k], 1)} → {num(100 * a.ece[k], 1)}",
                    f"{num(b.auroc[k], 3)} → {num(a.auroc[k], 3)}",
                    f"{num(b.brier[k], 3)} → {num(a.brier[k], 3)}",
                ]
            else:
                cells = [f"uninformative (n+ = {positives})"] * 3
            rows.append([k + 1, b.count[k], positives, f"{temp:.3g}", *cells])
        return intro + "\n\n" + markdown_table(header, rows)


def auroc_se(auroc: float, *, positives: int, count: int) -> float:
    """Hanley & McNeil's (1982) standard error of an AUROC from its value and the numbers of positives and negatives
    (a within-run uncertainty over rounds; rounds of one prompt are correlated, so it is optimistic — the sweep's
    between-seed term is not). NaN when either class is empty."""
    negatives = count - positives
    if positives < 1 or negatives < 1 or not math.isfinite(auroc):
        return math.nan
    q1, q2 = auroc / (2 - auroc), 2 * auroc**2 / (1 + auroc)
    variance = (auroc * (1 - auroc) + (positives - 1) * (q1 - auroc**2) + (negatives - 1) * (q2 - auroc**2)) / (
        positives * negatives
    )
    return math.sqrt(max(variance, 0.0))


def fit_calibration(
    rounds: CalibrationRounds,
    *,
    temperature: float,
    plot_path: str | Path | None = None,
    source: str = "head",
) -> CalibrationReport:
    """Fit STS on the fit split, measure before / after on the score split (`split_by_prompt`), optionally draw the
    reliability diagram of the score split."""
    if rounds.conf.shape[0] == 0:
        raise ValueError("STS calibration got no rounds; raise decode.max_new_tokens or add calibration prompts.")
    fit, score, held_out = split_by_prompt(rounds)
    if not held_out:
        log.warning("STS calibration: fewer than two prompts, so it is fitted and scored in-sample")
    sts = fit_sts(fit.conf, fit.accepted_prefix, fit.valid)
    report = CalibrationReport(
        temperature=float(temperature),
        sts=sts,
        before=calibration_metrics(score.conf, score.accepted_prefix, score.valid),
        after=calibration_metrics(sts.apply(score.conf), score.accepted_prefix, score.valid),
        num_rounds=int(rounds.conf.shape[0]),
        num_prompts=rounds.num_prompts,
        held_out=held_out,
        fit_rounds=int(fit.conf.shape[0]),
        fit_prompts=fit.num_prompts,
        score_rounds=int(score.conf.shape[0]),
        score_prompts=score.num_prompts,
        source=source,
    )
    if plot_path is not None:
        report.plot_path = draw_reliability(score, sts, plot_path)
    return report


def draw_reliability(rounds: CalibrationRounds, sts: STSCalibration, path: str | Path) -> Path:
    """Reliability diagram of a_k before and after STS (paper Fig. 6) on `rounds` (the score split)."""
    before = reliability_curves(rounds.conf, rounds.accepted_prefix, rounds.valid, n_bins=sts.n_bins)
    after = reliability_curves(sts.apply(rounds.conf), rounds.accepted_prefix, rounds.valid, n_bins=sts.n_bins)
    return plot_reliability(before, after, path)


def calibration_key(temperature: float, source: str = "head", prompt_set: str = "") -> str:
    """The drafter.pt calibration entry of a decoding temperature, confidence source and calibration prompts: 'T=1',
    'T=0.7', 'T=0' (greedy) for the head on the held-out split; 'T=1/draft_max_prob' for another source;
    'T=1@alpaca' when fitted on a named prompt set (decode.calibration_set)."""
    base = f"T={float(temperature):g}"
    base = base if source == "head" else f"{base}/{source}"
    return f"{base}@{prompt_set}" if prompt_set else base


def report_to_entry(report: CalibrationReport, rounds: CalibrationRounds) -> dict:
    """The drafter.pt entry: STS fields + temperature, counts, metrics and the raw rounds."""
    return report.sts.to_dict() | {
        "protocol": PROTOCOL,
        "temperature": report.temperature,
        "source": report.source,
        "prompt_set": report.prompt_set,
        "num_rounds": report.num_rounds,
        "num_prompts": report.num_prompts,
        "held_out": report.held_out,
        "split": {
            "fit_rounds": report.fit_rounds,
            "fit_prompts": report.fit_prompts,
            "score_rounds": report.score_rounds,
            "score_prompts": report.score_prompts,
        },
        "metrics_before": asdict(report.before),
        "metrics_after": asdict(report.after),
        "rounds": {
            "conf": rounds.conf,
            "accepted_prefix": rounds.accepted_prefix,
            "valid": rounds.valid,
            "prompt": rounds.prompt,
        },
    }


def entry_to_report(entry: dict) -> tuple[CalibrationReport, CalibrationRounds]:
    """Inverse of `report_to_entry`."""
    rounds = CalibrationRounds(**entry["rounds"], num_prompts=int(entry["num_prompts"]))
    split = entry.get("split") or {}
    report = CalibrationReport(
        temperature=float(entry["temperature"]),
        sts=STSCalibration.from_dict(entry),
        before=CalibrationMetrics(**entry["metrics_before"]),
        after=CalibrationMetrics(**entry["metrics_after"]),
        num_rounds=int(entry["num_rounds"]),
        num_prompts=int(entry["num_prompts"]),
        held_out=bool(entry.get("held_out", False)),
        fit_rounds=int(split.get("fit_rounds", entry["num_rounds"])),
        fit_prompts=int(split.get("fit_prompts", entry["num_prompts"])),
        score_rounds=int(split.get("score_rounds", entry["num_rounds"])),
        score_prompts=int(split.get("score_prompts", entry["num_prompts"])),
        source=str(entry.get("source", "head")),
        prompt_set=str(entry.get("prompt_set", "")),
    )
    return report, rounds


def score_rounds_of(rounds: CalibrationRounds) -> CalibrationRounds:
    """The score split of stored rounds (all of them when the entry predates the split)."""
    return split_by_prompt(rounds)[1]


def store_calibration(drafter_path: str | Path, report: CalibrationReport, rounds: CalibrationRounds) -> None:
    """Add / replace this temperature's entry in drafter.pt (atomic rewrite through `save_drafter`)."""
    payload = read_checkpoint(drafter_path)
    entries = dict(payload.get("calibration") or {})
    entries[calibration_key(report.temperature, report.source, report.prompt_set)] = report_to_entry(report, rounds)
    save_drafter(
        Path(drafter_path),
        spec=DrafterSpec.from_dict(payload["spec"]),
        state_dict=payload["state_dict"],
        metrics=payload.get("metrics") or {},
        calibration=entries,
    )


def calibrate_drafter(
    *,
    target: Target,
    proposer: Any,
    drafter_path: str | Path,
    payload: dict,
    prompt_ids: Sequence[list[int]],
    temperature: float,
    max_new_tokens: int,
    seed: int,
    block_size: int,
    plot_path: str | Path | None = None,
    refit: bool = False,
    source: str = "head",
    prompt_set: str = "",
) -> CalibrationReport:
    """The drafter's STS at `temperature` for the `source` confidences (decode.confidence): reused from drafter.pt
    when stored under this protocol (unless `refit`), else fitted on `prompt_ids` and stored there."""
    key = calibration_key(temperature, source, prompt_set)
    entry = (payload.get("calibration") or {}).get(key)
    reusable = entry is not None and entry.get("protocol") == PROTOCOL
    if reusable and not refit and len(entry.get("temperatures", [])) == block_size:
        log.info("reusing the STS calibration stored in %s for %s", drafter_path, key)
        report, rounds = entry_to_report(entry)
        if plot_path is not None:
            report.plot_path = draw_reliability(score_rounds_of(rounds), report.sts, plot_path)
        return report
    if entry is not None and not reusable:
        log.info("the STS calibration stored for %s predates the held-out split: refitting it", key)
    log.info("fitting STS at temperature %g on %d held-out prompts", temperature, len(prompt_ids))
    rounds = collect_calibration_rounds(
        target=target,
        proposer=proposer,
        prompt_ids=prompt_ids,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        block_size=block_size,
    )
    report = fit_calibration(rounds, temperature=temperature, plot_path=plot_path, source=source)
    report.prompt_set = prompt_set
    store_calibration(drafter_path, report, rounds)
    return report


def calibration_prompt_ids(
    target: Target, *, held_out: Sequence[PromptRecord], limit: int, seed: int, data: DataConfig
) -> tuple[list[list[int]], str]:
    """`limit` held-out prompt ids for STS (chat template, no system prompt) and a line saying where they came
    from: `held_out` first (the regenerated data's calibration split, `regenerated_calibration_split`), topped up
    with synthetic prompts absent from the training set of `data` (trained with `seed`)."""
    records = list(held_out)[:limit]
    sources = [f"{len(records)} prompts of the regenerated training data's calibration split"] if records else []
    if len(records) < limit:  # a small split (or none) is topped up with unseen synthetic prompts
        extra = held_out_synthetic(data, seed=seed, limit=limit - len(records))
        records += extra
        sources.append(
            f"{len(extra)} synthetic prompts (seed {seed + SYNTHETIC_SEED_OFFSET}) absent from the training set"
        )
    return [target.chat_prompt_ids(r.prompt) for r in records], " + ".join(sources)


def regenerated_calibration_split(
    train_prompts: Sequence[PromptRecord], regen_dir: Path, *, data: DataConfig, seed: int
) -> list[PromptRecord]:
    """The training prompts whose regenerated sequences (under `regen_dir`) form the `calibration` split."""
    from dspark.data.datamodule import split_indices
    from dspark.data.regenerate import load_regenerated

    if data.calib_fraction <= 0:
        return []
    ids = load_regenerated(regen_dir)["prompt_id"]
    try:
        split = split_indices(ids, val_fraction=data.val_fraction, calibration_fraction=data.calib_fraction, seed=seed)[
            "calibration"
        ]
    except ValueError:
        return []
    by_id = {p.id: p for p in train_prompts}
    return [by_id[ids[i]] for i in split if ids[i] in by_id]


def held_out_synthetic(data: DataConfig, *, seed: int, limit: int) -> list[PromptRecord]:
    """`limit` synthetic prompts drawn with a seed no training run uses, minus any prompt of the training set."""
    from dspark.data.prompts import load_prompts

    # only synthetic training prompts can coincide with these; over-draw by as many as could be dropped
    overlap = data.num_train_prompts if "synthetic" in data.train_sets else 0
    train = {p.prompt for p in load_prompts("synthetic", limit=overlap, seed=seed)} if overlap else set()
    pool = load_prompts("synthetic", limit=limit + overlap, seed=seed + SYNTHETIC_SEED_OFFSET)
    return [p for p in pool if p.prompt not in train][:limit]
