"""Sequential Temperature Scaling of the confidence head (METHOD §6, paper Fig. 6).

The scheduler ranks slots by the cumulative survival `a_k = Π_{i≤k} c̃_i`, so calibration targets `a_k` against the
realised event "the first k drafts were accepted" (`A ≥ k`). Each per-slot confidence is rescaled on its logit,

    c̃_k = σ(logit(c_k) / T_k),

and for k = 1..γ in order `T_k` is the grid point minimising the ECE of `a_k` with `T_1..T_{k-1}` already fixed.
The map is monotone per slot (ranking of each `c_k` kept, AUROC of `a_1` unchanged); the ranking of `a_k` for k ≥ 2
may change, so AUROC is reported before and after. Our choices, recorded with the fit: temperature on the logit,
an 81-point log-spaced grid in [0.25, 4], ECE with 20 equal-width bins (METHOD §8: weighted by bin counts).

Data: rounds decoded with fixed ℓ = γ at the serving temperature (so no prefix event is censored), shapes
`conf [n, γ]` raw per-slot c_k, `accepted_prefix [n]` A per round, `valid [n, γ]` False for slots after an EOS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dspark.files import atomic_output

DEFAULT_GRID_SIZE = 81
DEFAULT_GRID_RANGE = (0.25, 4.0)


def default_grid() -> Tensor:
    """81 log-spaced temperatures in [0.25, 4] (1.0 included)."""
    return torch.logspace(-2.0, 2.0, DEFAULT_GRID_SIZE, base=2.0, dtype=torch.float64)


def scale_confidence(conf: Tensor, temperature: Tensor | float) -> Tensor:
    """σ(logit(c)/T) in float64. c = 0 and 1 map to themselves (infinite logits), so zero confidence stays zero."""
    logits = torch.logit(conf.to(torch.float64).clamp(0.0, 1.0))
    return torch.sigmoid(logits / temperature)


def _scale_float(confidence: float, temperature: float) -> float:
    """`scale_confidence` for one Python float: σ(logit(c)/T), with c ≤ 0 → 0, c ≥ 1 → 1 and NaN → NaN."""
    if confidence != confidence:
        return confidence
    if confidence <= 0.0:
        return 0.0
    if confidence >= 1.0:
        return 1.0
    x = math.log(confidence / (1.0 - confidence)) / temperature
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)  # never overflows for x < 0
    return e / (1.0 + e)


def _check_rounds(conf: Tensor, accepted_prefix: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if conf.dim() != 2:
        raise ValueError(f"STS: conf must be [n, γ] per-slot confidences, got shape {tuple(conf.shape)}")
    if tuple(accepted_prefix.shape) != (conf.shape[0],) or tuple(valid.shape) != tuple(conf.shape):
        raise ValueError(
            f"STS: accepted_prefix must be [n] and valid [n, γ] for conf {tuple(conf.shape)}, got "
            f"{tuple(accepted_prefix.shape)} and {tuple(valid.shape)}"
        )
    if bool((accepted_prefix < 0).any()) or bool((accepted_prefix > conf.shape[1]).any()):
        raise ValueError(f"STS: accepted_prefix must be in [0, γ={conf.shape[1]}] (rounds decoded with ℓ = γ)")
    return conf.detach().cpu().to(torch.float64), accepted_prefix.detach().cpu().long(), valid.detach().cpu().bool()


def _events(accepted_prefix: Tensor, block: int) -> Tensor:
    """[n, γ] float64: column k-1 is 1[A ≥ k]."""
    return (accepted_prefix.unsqueeze(1) >= torch.arange(1, block + 1)).to(torch.float64)


def _binned_ece(scores: Tensor, labels: Tensor, n_bins: int) -> Tensor:
    """ECE of scores [..., n] vs labels [n] with equal-width bins → [...]; NaN when n = 0."""
    bins = (scores * n_bins).long().clamp(0, n_bins - 1)
    shape = (*scores.shape[:-1], n_bins)
    gap = torch.zeros(shape, dtype=torch.float64).scatter_add_(-1, bins, scores - labels.expand_as(scores))
    # Σ_b (n_b/n)|mean_conf_b − mean_acc_b| = Σ_b |Σ_{i∈b}(conf_i − acc_i)| / n
    return gap.abs().sum(-1) / scores.shape[-1] if scores.shape[-1] else torch.full(shape[:-1], float("nan"))


def auroc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (Mann–Whitney, ties count ½); NaN if a class is missing."""
    scores, labels = scores.detach().cpu().to(torch.float64).reshape(-1), labels.detach().cpu().bool().reshape(-1)
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)
    ranks = (ends - (counts - 1) / 2.0)[inverse]  # average 1-based rank within each tie group
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


def brier(scores: Tensor, labels: Tensor) -> float:
    """Mean squared error of probabilities against 0/1 outcomes; NaN when empty."""
    scores, labels = scores.detach().cpu().to(torch.float64), labels.detach().cpu().to(torch.float64)
    return float(((scores - labels) ** 2).mean()) if scores.numel() else float("nan")


def ece_cumulative(conf: Tensor, accepted_prefix: Tensor, valid: Tensor, *, n_bins: int = 20) -> Tensor:
    """[γ] float64 ECE of a_k = Π_{i≤k} c_i against 1[A ≥ k] over valid rounds, per position k (NaN if none)."""
    conf, accepted_prefix, valid = _check_rounds(conf, accepted_prefix, valid)
    survival, events = conf.cumprod(dim=1), _events(accepted_prefix, conf.shape[1])
    return torch.stack(
        [_binned_ece(survival[valid[:, k], k], events[valid[:, k], k], n_bins) for k in range(conf.shape[1])]
    )


@dataclass
class CalibrationMetrics:
    """Per-position calibration of cumulative survival a_k (METHOD §8); lists of length γ."""

    ece: list[float]
    auroc: list[float]
    brier: list[float]
    count: list[int]  # valid rounds at position k
    positives: list[int] | None = None  # of those, rounds with A ≥ k (None: an entry stored before this field)


def calibration_metrics(
    conf: Tensor, accepted_prefix: Tensor, valid: Tensor, *, n_bins: int = 20
) -> CalibrationMetrics:
    """ECE, AUROC and Brier of a_k against 1[A ≥ k] per position k."""
    conf, accepted_prefix, valid = _check_rounds(conf, accepted_prefix, valid)
    survival, events = conf.cumprod(dim=1), _events(accepted_prefix, conf.shape[1])
    columns = [(survival[valid[:, k], k], events[valid[:, k], k]) for k in range(conf.shape[1])]
    return CalibrationMetrics(
        ece=[float(_binned_ece(s, y, n_bins)) for s, y in columns],
        auroc=[auroc(s, y) for s, y in columns],
        brier=[brier(s, y) for s, y in columns],
        count=[int(s.numel()) for s, _ in columns],
        positives=[int(y.sum()) for _, y in columns],
    )


@dataclass
class STSCalibration:
    """Fitted per-slot temperatures T_1..T_γ with the fit's record (stored with the drafter)."""

    temperatures: list[float]  # [γ]
    grid: list[float]  # temperatures searched
    n_bins: int  # ECE bins used by the fit
    ece_before: list[float]  # [γ] ECE of a_k with raw confidences
    ece_after: list[float]  # [γ] ECE of a_k with calibrated confidences

    def apply(self, conf: Tensor) -> Tensor:
        """Calibrated per-slot confidences c̃ [..., γ] (same dtype and device as `conf` [..., γ])."""
        if conf.shape[-1] != len(self.temperatures):
            raise ValueError(
                f"STSCalibration.apply: last dimension must be γ = {len(self.temperatures)} "
                f"(the block_size it was fitted for), got {tuple(conf.shape)}"
            )
        temperatures = torch.tensor(self.temperatures, dtype=torch.float64, device=conf.device)
        return scale_confidence(conf, temperatures).to(conf.dtype)

    def apply_row(self, conf: list[float]) -> list[float]:
        """`apply` for the first k ≤ γ slots of one request, on plain floats: c̃_j = σ(logit(c_j)/T_j) in float64.

        The single-request proposer calibrates c_1..c_k before every slot it drafts (its drafting stop); a
        tensor round trip cost ~50 µs a slot there. Equal to `apply` up to float rounding (Python's libm against
        torch's kernels, ≤ a few ulps); c ≤ 0 and c ≥ 1 map to 0 and 1 as in `scale_confidence`, NaN stays NaN."""
        if len(conf) > len(self.temperatures):
            raise ValueError(
                f"STSCalibration.apply_row: {len(conf)} confidences for a calibration fitted for "
                f"γ = {len(self.temperatures)} slots"
            )
        return [_scale_float(c, t) for c, t in zip(conf, self.temperatures)]

    def to_dict(self) -> dict:
        return {
            "method": "sts",
            "temperatures": list(self.temperatures),
            "grid": list(self.grid),
            "n_bins": self.n_bins,
            "ece_before": list(self.ece_before),
            "ece_after": list(self.ece_after),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "STSCalibration":
        if data.get("method") != "sts":
            raise ValueError(f"STSCalibration.from_dict: expected method 'sts', got {data.get('method')!r}")
        return cls(
            temperatures=[float(t) for t in data["temperatures"]],
            grid=[float(t) for t in data["grid"]],
            n_bins=int(data["n_bins"]),
            ece_before=[float(e) for e in data["ece_before"]],
            ece_after=[float(e) for e in data["ece_after"]],
        )


def _best_temperature(prefix: Tensor, conf_k: Tensor, event_k: Tensor, *, grid: Tensor, n_bins: int) -> float:
    """Grid point minimising the ECE of prefix·σ(logit(c_k)/T); among equal ECEs the one closest to T = 1."""
    if conf_k.numel() == 0:
        return 1.0
    candidates = prefix * scale_confidence(conf_k.unsqueeze(0), grid.unsqueeze(1))  # [G, n]
    errors = _binned_ece(candidates, event_k, n_bins)
    tied = errors <= errors.min() + 1e-12
    distance = torch.where(tied, grid.log().abs(), torch.full_like(grid, float("inf")))
    return float(grid[distance.argmin()])


def fit_sts(
    conf: Tensor, accepted_prefix: Tensor, valid: Tensor, *, grid: Tensor | None = None, n_bins: int = 20
) -> STSCalibration:
    """Fit T_1..T_γ sequentially on held-out rounds (shapes in the module docstring)."""
    conf, accepted_prefix, valid = _check_rounds(conf, accepted_prefix, valid)
    grid = default_grid() if grid is None else torch.as_tensor(grid, dtype=torch.float64).reshape(-1)
    if grid.numel() == 0 or bool((grid <= 0).any()):
        raise ValueError("fit_sts: grid must be a non-empty list of positive temperatures")
    events = _events(accepted_prefix, conf.shape[1])
    prefix = torch.ones(conf.shape[0], dtype=torch.float64)
    temperatures = []
    for k in range(conf.shape[1]):
        rows = valid[:, k]
        temperature = _best_temperature(prefix[rows], conf[rows, k], events[rows, k], grid=grid, n_bins=n_bins)
        temperatures.append(temperature)
        prefix = prefix * scale_confidence(conf[:, k], temperature)
    fitted = STSCalibration(temperatures, grid.tolist(), n_bins, [], [])
    fitted.ece_before = ece_cumulative(conf, accepted_prefix, valid, n_bins=n_bins).tolist()
    fitted.ece_after = ece_cumulative(fitted.apply(conf), accepted_prefix, valid, n_bins=n_bins).tolist()
    return fitted


@dataclass
class ReliabilityCurves:
    """Per-position, per-bin reliability data of a_k (shapes [γ, n_bins]); empty bins have count 0 and NaN means."""

    mean_confidence: Tensor
    accept_rate: Tensor
    count: Tensor
    ece: list[float]


def reliability_curves(conf: Tensor, accepted_prefix: Tensor, valid: Tensor, *, n_bins: int = 20) -> ReliabilityCurves:
    """Bin a_k by equal-width confidence bins: mean confidence vs empirical 1[A ≥ k] rate per bin."""
    conf, accepted_prefix, valid = _check_rounds(conf, accepted_prefix, valid)
    survival, events = conf.cumprod(dim=1), _events(accepted_prefix, conf.shape[1])
    bins = (survival * n_bins).long().clamp(0, n_bins - 1)
    weight = valid.to(torch.float64)
    shape = (conf.shape[1], n_bins)
    count = torch.zeros(shape, dtype=torch.float64).scatter_add_(1, bins.t(), weight.t())
    conf_sum = torch.zeros(shape, dtype=torch.float64).scatter_add_(1, bins.t(), (survival * weight).t())
    event_sum = torch.zeros(shape, dtype=torch.float64).scatter_add_(1, bins.t(), (events * weight).t())
    ece = ((conf_sum - event_sum).abs().sum(1) / count.sum(1)).tolist()
    return ReliabilityCurves(conf_sum / count, event_sum / count, count.long(), ece)


def plot_reliability(
    before: ReliabilityCurves, after: ReliabilityCurves, path: str | Path, *, positions: list[int] | None = None
) -> Path:
    """Write a reliability-diagram PNG like paper Fig. 6: one panel per position (1-based), before vs after."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry touched

    block = before.count.shape[0]
    positions = positions or [k for k in (1, 3, 5, 7) if k <= block] or [1]
    fig = Figure(figsize=(3.2 * len(positions), 3.2))
    axes = fig.subplots(1, len(positions), squeeze=False)
    for axis, k in zip(axes[0], positions):
        axis.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
        for curves, label, marker in ((before, "before", "o"), (after, "after STS", "s")):
            keep = curves.count[k - 1] > 0
            axis.plot(
                curves.mean_confidence[k - 1][keep],
                curves.accept_rate[k - 1][keep],
                marker=marker,
                markersize=3,
                label=f"{label} (ECE {100 * curves.ece[k - 1]:.1f}%)",
            )
        axis.set(title=f"position {k}", xlabel="mean cumulative confidence", xlim=(0, 1), ylim=(0, 1))
        axis.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("empirical prefix-accept rate")
    fig.tight_layout()
    path = Path(path)
    with atomic_output(path) as handle:
        fig.savefig(handle, dpi=120, format=path.suffix.lstrip(".") or "png")
    return path
