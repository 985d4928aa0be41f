"""Fit Sequential Temperature Scaling on held-out decoding rounds and store it with the drafter (METHOD §6, §8).

Protocol (METHOD §6): rounds are decoded with the fixed policy (ℓ = γ, so no prefix event is censored) at the serving
temperature on held-out prompts — the calibration split of the regenerated training data (`split_indices`, the
prompts the drafter never trained on) when that data is in the cache, topped up to the wanted count (or replaced)
by synthetic prompts from a different seed, minus any training prompt. Per round: raw confidences `c_1..c_γ`,
accepted drafts `A`, and slot k valid iff `k ≤ ℓ_eff` (slots after a drafted EOS are dropped). The fit
(`fit_sts`) and the ECE / AUROC / Brier of the cumulative product `a_k` before and after come from
`dspark.calibration`.

Storage: `drafter.pt["calibration"]` is a dict keyed by temperature (`calibration_key`, e.g. "T=1") — greedy and
sampled acceptance are different events — each entry being `STSCalibration.to_dict()` plus the fit's metrics and the
raw rounds (so a report can redraw the reliability diagram without decoding again).
"""

from __future__ import annotations

import logging
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


@dataclass
class CalibrationRounds:
    """Rounds decoded with ℓ = γ. n rounds, γ block size."""

    conf: Tensor  # [n, γ] float64 raw c_k (0.5 where the slot is invalid)
    accepted_prefix: Tensor  # [n] long, A
    valid: Tensor  # [n, γ] bool, k ≤ ℓ_eff
    num_prompts: int


def rounds_to_arrays(rounds: Iterable[Any], *, block_size: int, num_prompts: int = 0) -> CalibrationRounds:
    """RoundRecords (objects or dicts) → `CalibrationRounds`; a round without confidences is an error."""
    conf, accepted, valid = [], [], []
    for index, record in enumerate(rounds):
        get = record.get if isinstance(record, dict) else lambda name, r=record: getattr(r, name)
        confidences, verified = get("confidences"), int(get("num_verified"))
        if confidences is None:
            raise ValueError(
                "STS calibration needs the confidence head's c_k in every round, but round "
                f"{index} has none; calibrate only drafter=dspark (set decode.calibrate=false)."
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
    for index, ids in enumerate(tqdm(prompt_ids, desc="calibration rounds", unit="prompt", disable=not show_progress)):
        generator = torch.Generator(device=target.device).manual_seed(derive_seed(seed, "calibration", index))
        rounds.extend(engine.generate(list(ids), generator=generator).rounds)
    return rounds_to_arrays(rounds, block_size=block_size, num_prompts=len(prompt_ids))


@dataclass
class CalibrationReport:
    """A fitted STS with its quality before / after, for one decoding temperature."""

    temperature: float
    sts: STSCalibration
    before: CalibrationMetrics
    after: CalibrationMetrics
    num_rounds: int
    num_prompts: int
    plot_path: Path | None = None

    def metrics(self) -> dict[str, float]:
        """`calibration/{ece,auroc,brier}_{before,after}/pos{k}` and the temperatures, for MLflow."""
        out = {"calibration/rounds": float(self.num_rounds)}
        for when, m in (("before", self.before), ("after", self.after)):
            for name in ("ece", "auroc", "brier"):
                out.update({f"calibration/{name}_{when}/pos{k + 1}": v for k, v in enumerate(getattr(m, name))})
        out.update({f"calibration/temperature/pos{k + 1}": t for k, t in enumerate(self.sts.temperatures)})
        return out

    def markdown(self) -> str:
        """A table of T_k and ECE / AUROC / Brier of a_k before → after, per position."""
        intro = (
            f"STS fitted at decoding temperature {self.temperature:g} on {self.num_rounds} rounds of "
            f"{self.num_prompts} held-out prompts (ℓ = γ); grid of {len(self.sts.grid)} log-spaced "
            f"temperatures in [{min(self.sts.grid):g}, {max(self.sts.grid):g}] on the logit, ECE with "
            f"{self.sts.n_bins} equal-width bins (our choices, METHOD §6). Metrics of the cumulative "
            "product a_k against the prefix-accept event."
        )
        header = ["k", "rounds", "T_k", "ECE % before → after", "AUROC before → after", "Brier before → after"]
        b, a = self.before, self.after
        rows = [
            [
                k + 1,
                b.count[k],
                f"{temp:.3g}",
                f"{num(100 * b.ece[k], 1)} → {num(100 * a.ece[k], 1)}",
                f"{num(b.auroc[k], 3)} → {num(a.auroc[k], 3)}",
                f"{num(b.brier[k], 3)} → {num(a.brier[k], 3)}",
            ]
            for k, temp in enumerate(self.sts.temperatures)
        ]
        return intro + "\n\n" + markdown_table(header, rows)


def fit_calibration(
    rounds: CalibrationRounds, *, temperature: float, plot_path: str | Path | None = None
) -> CalibrationReport:
    """Fit STS on the rounds, measure before / after, optionally draw the reliability diagram."""
    if rounds.conf.shape[0] == 0:
        raise ValueError("STS calibration got no rounds; raise decode.max_new_tokens or add calibration prompts.")
    sts = fit_sts(rounds.conf, rounds.accepted_prefix, rounds.valid)
    calibrated = sts.apply(rounds.conf)
    report = CalibrationReport(
        temperature=float(temperature),
        sts=sts,
        before=calibration_metrics(rounds.conf, rounds.accepted_prefix, rounds.valid),
        after=calibration_metrics(calibrated, rounds.accepted_prefix, rounds.valid),
        num_rounds=int(rounds.conf.shape[0]),
        num_prompts=rounds.num_prompts,
    )
    if plot_path is not None:
        report.plot_path = draw_reliability(rounds, sts, plot_path)
    return report


def draw_reliability(rounds: CalibrationRounds, sts: STSCalibration, path: str | Path) -> Path:
    """Reliability diagram of a_k before and after STS (paper Fig. 6)."""
    before = reliability_curves(rounds.conf, rounds.accepted_prefix, rounds.valid, n_bins=sts.n_bins)
    after = reliability_curves(sts.apply(rounds.conf), rounds.accepted_prefix, rounds.valid, n_bins=sts.n_bins)
    return plot_reliability(before, after, path)


def calibration_key(temperature: float) -> str:
    """The drafter.pt calibration entry of a decoding temperature: 'T=1', 'T=0.7', 'T=0' (greedy)."""
    return f"T={float(temperature):g}"


def report_to_entry(report: CalibrationReport, rounds: CalibrationRounds) -> dict:
    """The drafter.pt entry: STS fields + temperature, counts, metrics and the raw rounds."""
    return report.sts.to_dict() | {
        "temperature": report.temperature,
        "num_rounds": report.num_rounds,
        "num_prompts": report.num_prompts,
        "metrics_before": asdict(report.before),
        "metrics_after": asdict(report.after),
        "rounds": {"conf": rounds.conf, "accepted_prefix": rounds.accepted_prefix, "valid": rounds.valid},
    }


def entry_to_report(entry: dict) -> tuple[CalibrationReport, CalibrationRounds]:
    """Inverse of `report_to_entry`."""
    rounds = CalibrationRounds(**entry["rounds"], num_prompts=int(entry["num_prompts"]))
    report = CalibrationReport(
        temperature=float(entry["temperature"]),
        sts=STSCalibration.from_dict(entry),
        before=CalibrationMetrics(**entry["metrics_before"]),
        after=CalibrationMetrics(**entry["metrics_after"]),
        num_rounds=int(entry["num_rounds"]),
        num_prompts=int(entry["num_prompts"]),
    )
    return report, rounds


def store_calibration(drafter_path: str | Path, report: CalibrationReport, rounds: CalibrationRounds) -> None:
    """Add / replace this temperature's entry in drafter.pt (atomic rewrite through `save_drafter`)."""
    payload = read_checkpoint(drafter_path)
    entries = dict(payload.get("calibration") or {})
    entries[calibration_key(report.temperature)] = report_to_entry(report, rounds)
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
) -> CalibrationReport:
    """The drafter's STS at `temperature`: reused from drafter.pt when present (unless `refit`), else fitted on
    `prompt_ids` and stored there."""
    entry = (payload.get("calibration") or {}).get(calibration_key(temperature))
    if entry is not None and not refit and len(entry.get("temperatures", [])) == block_size:
        log.info("reusing the STS calibration stored in %s for %s", drafter_path, calibration_key(temperature))
        report, rounds = entry_to_report(entry)
        if plot_path is not None:
            report.plot_path = draw_reliability(rounds, report.sts, plot_path)
        return report
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
    report = fit_calibration(rounds, temperature=temperature, plot_path=plot_path)
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
