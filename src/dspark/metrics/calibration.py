"""Calibration of the cumulative confidence a_k = Π_{i≤k} c_i against the prefix-accept event (METHOD §8, §6).

The confidence head's c_k estimates P(draft k accepted | drafts 1..k−1 accepted) (§2.3), so the quantity a
scheduler acts on is the cumulative product a_k, the predicted probability that the prefix of length k survives.
Per slot k we judge a_k against the event e_k "the prefix of length k was accepted":

- rollouts (decoding): e_k ∈ {0, 1}, the realised event `k ≤ A` (see `rollout_prefix_events`);
- teacher-forced training: e_k ∈ [0, 1], the soft target Π_{i≤k} c*_i (see `soft_prefix_events`).

Note the asymmetry: `conf` holds per-slot c_k (the metric multiplies them), `event` is already cumulative.

Statistics per slot, all from sum states (float64/int64, `dist_reduce_fx="sum"`), hence exact under DDP:

- ECE: `n_bins` equal-width bins [j/n, (j+1)/n) over [0, 1] (a = 1 falls in the last bin), each keeping
  (count, Σ a, Σ e); ECE = Σ_bins |Σ a − Σ e| / count, the usual Σ_b (n_b/n)·|mean a_b − mean e_b|.
- Brier: mean (a − e)².
- AUROC: `auroc_bins` score bins, equal-width in logit(a) over [−12, 12] (a ≈ 6e−6 … 1 − 6e−6; scores beyond
  fall in the end bins), each holding positive weight Σ e and negative weight Σ (1 − e) (a hard event puts a
  sample entirely on one side); AUROC = P(score of a positive > score of a negative) with ties counted ½, computed
  on the histogram (the trapezoid rule over the bin thresholds). AUROC depends only on the order of the scores, so
  the monotone logit map changes nothing but the bin widths: deep slots of a weak drafter have a_k ≪ 0.01 and
  equal-width bins in a would lump them together. Approximation: scores that share a bin count as tied, so the
  value is exact up to bin resolution — exact whenever no positive and negative share a bin, and off by at most
  ½ · (weight of positive–negative pairs sharing a bin) / (P·N) otherwise; with the default 4096 bins a bin is
  ≈ 0.0015 wide at a = 0.5 and ≈ 6e−5 wide at a = 0.01. With a soft event a sample's own positive and negative
  weights are a tied pair (½).
- Summaries "*/mean" average the per-slot values weighted by each slot's sample count, over the slots where the
  value is defined.

Undefined values are NaN: every statistic of a slot with no valid sample, and AUROC of a slot whose samples are
all positive or all negative.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspark.metrics.acceptance import ExactSumMetric, check_block_tensor, prefix_mask, ratio


@dataclass
class ReliabilityBins:
    """Reliability-diagram table over equal-width bins; shapes [..., n_bins]. Empty bins hold NaN means."""

    mean_confidence: Tensor  # float64, mean predicted probability in the bin
    mean_event: Tensor  # float64, observed (or soft) event frequency in the bin
    count: Tensor  # int64, samples in the bin


def cumulative_confidence(conf: Tensor) -> Tensor:
    """a_k = Π_{i≤k} c_i along the last (slot) dimension, in float64; conf [..., γ] → [..., γ]."""
    return torch.cumprod(conf.double(), dim=-1)


def soft_prefix_events(c_star: Tensor) -> Tensor:
    """Teacher-forced soft event Π_{i≤k} c*_i; c_star [..., γ] in [0, 1] → [..., γ] float64."""
    return cumulative_confidence(c_star)


def rollout_prefix_events(*, num_accepted: Tensor, num_verified: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Realised prefix events of decoding rounds: (event [R, γ] = k ≤ A, valid [R, γ] = k ≤ ℓ_eff), k = 1..γ.

    A slot past ℓ_eff (not verified, or after an EOS) carries no label (METHOD §6: fit on ℓ = γ rounds so no
    prefix label is censored).
    """
    slots = torch.arange(1, block_size + 1, device=num_accepted.device)
    return slots <= num_accepted.reshape(-1, 1), slots <= num_verified.reshape(-1, 1)


def bin_index(values: Tensor, n_bins: int) -> Tensor:
    """Equal-width bin of each value in [0, 1]: j such that j/n ≤ v < (j+1)/n, with v = 1 in bin n − 1."""
    edges = torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float64, device=values.device)
    idx = torch.bucketize(values.double(), edges, right=True) - 1
    return idx.clamp(0, n_bins - 1)


AUROC_LOGIT_RANGE = 12.0  # AUROC score bins cover logit(a) in [−12, 12]


def auroc_bin_index(scores: Tensor, n_bins: int) -> Tensor:
    """AUROC score bin of each a in [0, 1]: equal-width bins of logit(a) over ±AUROC_LOGIT_RANGE, ends clamped."""
    z = torch.logit(scores.double()).clamp(-AUROC_LOGIT_RANGE, AUROC_LOGIT_RANGE)
    idx = torch.floor((z + AUROC_LOGIT_RANGE) * (n_bins / (2 * AUROC_LOGIT_RANGE))).long()
    return idx.clamp(0, n_bins - 1)


def _per_slot_histogram(values: Tensor, bins: Tensor, *, n_bins: int) -> Tensor:
    """Σ values per (slot, bin); values, bins [R, γ] → [γ, n_bins] float64 (int64 for integer values)."""
    gamma = values.shape[-1]
    flat = (torch.arange(gamma, device=bins.device) * n_bins + bins).reshape(-1)
    out = torch.zeros(gamma * n_bins, dtype=values.dtype, device=values.device)
    return out.index_add_(0, flat, values.reshape(-1)).reshape(gamma, n_bins)


def reliability_bins(
    confidence: Tensor, event: Tensor, *, n_bins: int = 20, valid: Tensor | None = None
) -> ReliabilityBins:
    """Reliability table of already-cumulative confidences against events, pooled over all elements.

    confidence, event: same shape, values in [0, 1] (event bool or float); valid: optional bool mask of that shape.
    Returns [n_bins] tensors (mean confidence, mean event, count) for a reliability diagram.
    """
    if valid is None:
        valid = torch.ones_like(confidence, dtype=torch.bool)
    mask = valid.reshape(-1, 1)
    conf = torch.where(mask, confidence.detach().reshape(-1, 1).double(), 0.0)
    ev = torch.where(mask, event.detach().reshape(-1, 1).double(), 0.0)
    bins = bin_index(conf, n_bins)
    count = _per_slot_histogram(mask.long(), bins, n_bins=n_bins)[0]
    conf_sum = _per_slot_histogram(conf, bins, n_bins=n_bins)[0]
    event_sum = _per_slot_histogram(ev, bins, n_bins=n_bins)[0]
    return ReliabilityBins(ratio(conf_sum, count), ratio(event_sum, count), count)


def binned_auroc(positive: Tensor, negative: Tensor) -> Tensor:
    """AUROC from score histograms [..., M] (ascending score bins) of positive and negative weight; ties count ½.

    Σ_b neg_b · (pos above b + ½ pos_b) / (P·N); NaN when P or N is 0.
    """
    positive, negative = positive.double(), negative.double()
    pos_total = positive.sum(dim=-1)
    pos_above = pos_total.unsqueeze(-1) - torch.cumsum(positive, dim=-1)
    wins = (negative * (pos_above + 0.5 * positive)).sum(dim=-1)
    pairs = pos_total * negative.sum(dim=-1)
    return ratio(wins, pairs)


def _calibration_update(
    conf: Tensor, event: Tensor, valid: Tensor, *, n_bins: int, auroc_bins: int
) -> dict[str, Tensor]:
    """Per-slot sums for one batch; conf/event/valid [..., γ] → dict of [γ, n_bins], [γ, auroc_bins], [γ] tensors.

    Only the contiguous valid prefix of each row counts; ignored slots may hold anything (NaN included).
    """
    gamma = conf.shape[-1]
    mask = prefix_mask(valid).reshape(-1, gamma)
    # zero the ignored slots before the product: garbage there cannot leak, and since the mask is a prefix the
    # running product is 0 on every ignored slot, so those add nothing to the sums below
    a = cumulative_confidence(torch.where(mask, conf.detach().reshape(-1, gamma).double(), 0.0))
    e = torch.where(mask, event.detach().reshape(-1, gamma).double(), 0.0)
    weight = mask.double()
    ece_bins, score_bins = bin_index(a, n_bins), auroc_bin_index(a, auroc_bins)
    return {
        "count": _per_slot_histogram(mask.long(), ece_bins, n_bins=n_bins),
        "conf_sum": _per_slot_histogram(a, ece_bins, n_bins=n_bins),
        "event_sum": _per_slot_histogram(e, ece_bins, n_bins=n_bins),
        "sq_err_sum": ((a - e) ** 2).sum(dim=0),
        "pos_weight": _per_slot_histogram(e, score_bins, n_bins=auroc_bins),
        "neg_weight": _per_slot_histogram(weight - e, score_bins, n_bins=auroc_bins),
    }


def _weighted_mean(values: Tensor, weights: Tensor) -> Tensor:
    """Σ w·v / Σ w over the entries where v is defined (not NaN); NaN when none is."""
    defined = ~torch.isnan(values)
    w = torch.where(defined, weights.double(), 0.0)
    return ratio(torch.where(defined, values, 0.0).mul(w).sum(), w.sum())


def _calibration_compute(
    *, count: Tensor, conf_sum: Tensor, event_sum: Tensor, sq_err_sum: Tensor, pos_weight: Tensor, neg_weight: Tensor
) -> dict[str, Tensor]:
    """{"ece/pos{k}", "auroc/pos{k}", "brier/pos{k}", "ece/mean", "auroc/mean", "brier/mean"} from the sums."""
    n = count.sum(dim=-1)
    ece = ratio((conf_sum - event_sum).abs().sum(dim=-1), n)
    brier = ratio(sq_err_sum, n)
    auroc = binned_auroc(pos_weight, neg_weight)
    out: dict[str, Tensor] = {}
    for name, per_slot in (("ece", ece), ("auroc", auroc), ("brier", brier)):
        out.update({f"{name}/pos{k + 1}": per_slot[k] for k in range(per_slot.shape[0])})
    out["ece/mean"] = _weighted_mean(ece, n)
    out["auroc/mean"] = _weighted_mean(auroc, n)
    out["brier/mean"] = ratio(sq_err_sum.sum(), n.sum())
    return out


def _check_unit_interval(name: str, value: Tensor, valid: Tensor) -> None:
    """ValueError if a valid entry is outside [0, 1] or NaN (torchmetrics-style sigmoid guessing is not done here)."""
    value = value.double()
    bad = prefix_mask(valid) & ~((value >= 0) & (value <= 1))
    if bool(bad.any()):
        raise ValueError(
            f"{name} must hold probabilities in [0, 1] on valid slots; apply sigmoid to confidence "
            "logits before calling update()"
        )


class CumulativeCalibration(ExactSumMetric):
    """ECE, AUROC and Brier of a_k = Π_{i≤k} c_i against the prefix-accept event, per slot k (METHOD §8).

    update(conf [..., γ] per-slot probabilities c_k, event [..., γ] bool or float in [0, 1] (cumulative: the
    prefix of length k accepted, or its soft teacher-forced probability), valid [..., γ] bool).
    compute() → {"ece/pos{k}", "auroc/pos{k}", "brier/pos{k}", "ece/mean", "auroc/mean", "brier/mean"} (float64).
    `validate_args=False` skips the [0, 1] range check (which needs a device sync).
    """

    higher_is_better = None  # AUROC up, ECE and Brier down

    def __init__(
        self, block_size: int, n_bins: int = 20, auroc_bins: int = 4096, validate_args: bool = True, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        for key, value in (("block_size", block_size), ("n_bins", n_bins), ("auroc_bins", auroc_bins)):
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        self.block_size, self.n_bins, self.auroc_bins = block_size, n_bins, auroc_bins
        self.validate_args = validate_args
        self.add_sum_state("count", (block_size, n_bins), torch.int64)
        self.add_sum_state("conf_sum", (block_size, n_bins), torch.float64)
        self.add_sum_state("event_sum", (block_size, n_bins), torch.float64)
        self.add_sum_state("sq_err_sum", (block_size,), torch.float64)
        self.add_sum_state("pos_weight", (block_size, auroc_bins), torch.float64)
        self.add_sum_state("neg_weight", (block_size, auroc_bins), torch.float64)

    def update(self, conf: Tensor, event: Tensor, valid: Tensor) -> None:
        check_block_tensor("conf", conf, reference=valid, block_size=self.block_size)
        check_block_tensor("event", event, reference=valid, block_size=self.block_size)
        if self.validate_args:
            _check_unit_interval("conf", conf, valid)
            _check_unit_interval("event", event, valid)
        sums = _calibration_update(conf, event, valid, n_bins=self.n_bins, auroc_bins=self.auroc_bins)
        for name, value in sums.items():
            setattr(self, name, getattr(self, name) + value)

    def compute(self) -> dict[str, Tensor]:
        return _calibration_compute(
            count=self.count,
            conf_sum=self.conf_sum,
            event_sum=self.event_sum,
            sq_err_sum=self.sq_err_sum,
            pos_weight=self.pos_weight,
            neg_weight=self.neg_weight,
        )

    def reliability(self) -> ReliabilityBins:
        """Per-slot reliability table [γ, n_bins] from the (all-reduced, under DDP) states."""
        with self.sync_context(dist_sync_fn=self.dist_sync_fn, should_sync=self.sync_on_compute):
            return ReliabilityBins(
                ratio(self.conf_sum, self.count), ratio(self.event_sum, self.count), self.count.clone()
            )
