"""Where a round's confidences c_k come from (`decode.confidence`, `serve.confidence`; METHOD §6).

Every confidence policy (threshold, calibrated_threshold, scheduler, async) reads per-slot confidences c_k — the
probability that draft x_k is accepted given that x_1..x_{k-1} were — and multiplies them into survivals
a_k = Π_{i≤k} c_i. Three sources produce them:

- `head`: the drafter's trained confidence head, c_k = σ(confidence logit) (the paper; dspark drafters only).
- `draft_max_prob`: the drafter's own top probability at slot k, c_k = max_v q_k(v) — no head needed, so DFlash and
  EAGLE-3 can run the confidence policies too (the plain max-softmax signal some engines use).
- `online`: a logistic model of acceptance fitted *while decoding* from the verifier's accept/reject outcomes,
  c_k = σ(w_0 + w_1·logit(max q_k) + b_k): a bias, a weight on the top probability's logit and one offset per slot.
  It starts at (0, 1, 0…) — exactly `draft_max_prob` — and after every verified round takes one gradient step of
  the log loss on the slots whose outcome the round observed (accepted for k ≤ A, rejected at k = A + 1 when
  A < ℓ; slots past the first rejection are censored and teach nothing), with an L2 pull towards the start so that
  a few unlucky rounds cannot drive it anywhere. Modelled on the online acceptance estimator vLLM merged
  (FIELD.md: a logistic model on logit(max q) of any drafter, vllm#52228); the slot offsets, the step size and the
  pull are ours (`decode.online_lr`, `decode.online_l2`).

Which distribution "top probability" reads: the drafter's distribution at the verification temperature T when
T > 0 (what the draft is sampled from, so what the verifier compares with p_t), and at T = 1 when decoding is greedy
(a greedy draft's one-hot has max 1; the T = 1 margin is what predicts whether the argmax matches the target's).

Losslessness: a policy may choose ℓ from these confidences because c_k depends only on x_{<k} (q_k is the
distribution x_k is drawn *from*; its max does not look at the x_k drawn) and on earlier rounds' outcomes (the online
weights) — never on x_k itself. A source that read q_k(x_k), the drawn token's own probability, would let x_k decide
whether x_k is verified and bias the output (METHOD §6, Appendix A's argument); tests/test_confidence_sources.py
keeps that source as the control its exact distribution test must catch.

A source is stateful per engine: the proposer calls `slot` once per drafted slot (in slot order, rows batched) and the
engine calls `observe` once per verified round; `reset` forgets a round's pending features (never the online
weights, which learn across prompts and requests).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from dspark.registry import Registry

HEAD, DRAFT_MAX_PROB, ONLINE = "head", "draft_max_prob", "online"
LOGIT_CLIP = 1e-6  # top probabilities are clipped to [ε, 1 − ε] before the logit (a one-hot top would be ±inf)


class ConfidenceSource(Protocol):
    """Per-slot confidences for a round's drafts (module docstring)."""

    name: str
    needs_head: bool  # True: only drafters with a confidence head can use it

    def reset(self, rows: int = 1) -> None:
        """Start a round for `rows` requests (forgets the previous round's pending features)."""

    def slot(self, k: int, *, head: Tensor | None, top_prob: Tensor) -> Tensor:
        """c_k [R] float32 for slot k (0-based) from the head's c_k [R] (None without a head) and the drafter's top
        probability max_v q_k(v) [R]; called once per slot, in slot order, before x_k is drawn."""

    def observe(self, *, verified: Tensor, accepted: Tensor) -> None:
        """The verifier's outcome of the round: ℓ_r drafts verified [R] and A_r accepted [R] (long)."""


class HeadConfidence:
    """The trained confidence head's c_k (the paper's source)."""

    name, needs_head = HEAD, True

    def reset(self, rows: int = 1) -> None:
        return None

    def slot(self, k: int, *, head: Tensor | None, top_prob: Tensor) -> Tensor:
        if head is None:
            raise ValueError("decode.confidence=head needs a drafter with a confidence head (drafter=dspark)")
        return head.float()

    def observe(self, *, verified: Tensor, accepted: Tensor) -> None:
        return None


class DraftMaxProb:
    """c_k = max_v q_k(v), the drafter's own top probability (no head)."""

    name, needs_head = DRAFT_MAX_PROB, False

    def reset(self, rows: int = 1) -> None:
        return None

    def slot(self, k: int, *, head: Tensor | None, top_prob: Tensor) -> Tensor:
        return top_prob.float().clamp(0.0, 1.0)

    def observe(self, *, verified: Tensor, accepted: Tensor) -> None:
        return None


class OnlineLogistic:
    """c_k = σ(w_0 + w_1·logit(max q_k) + b_k), fitted online from accept/reject outcomes (module docstring).

    lr: the step size of the per-round gradient step (mean log-loss gradient over the round's observed slots);
    l2: the pull towards the starting weights (0, 1, 0…), per step; block_size: γ (one offset b_k per slot).
    """

    name, needs_head = ONLINE, False

    def __init__(self, *, block_size: int, lr: float = 0.05, l2: float = 1e-3) -> None:
        if block_size < 1:
            raise ValueError(f"OnlineLogistic: block_size must be >= 1, got {block_size}")
        self.block_size, self.lr, self.l2 = int(block_size), float(lr), float(l2)
        self.prior = torch.tensor([0.0, 1.0] + [0.0] * self.block_size, dtype=torch.float64)
        self.weights = self.prior.clone()  # [2 + γ]: w_0, w_1, b_1..b_γ
        self.updates = 0  # rounds with at least one observed slot
        self._pending: list[list[float]] = [[]]  # per row: logit(max q_k) of the slots drafted this round

    def reset(self, rows: int = 1) -> None:
        self._pending = [[] for _ in range(rows)]

    def slot(self, k: int, *, head: Tensor | None, top_prob: Tensor) -> Tensor:
        if not 0 <= k < self.block_size:
            raise ValueError(f"OnlineLogistic: slot {k} outside the block [0, {self.block_size})")
        top = top_prob.detach().double().reshape(-1).clamp(LOGIT_CLIP, 1.0 - LOGIT_CLIP)
        logit = torch.log(top) - torch.log1p(-top)
        if len(self._pending) != top.numel():
            self.reset(top.numel())
        for row, value in zip(self._pending, logit.tolist()):
            if len(row) == k:  # a row that stopped drafting earlier keeps its own slots only
                row.append(value)
        w = self.weights
        return torch.sigmoid(w[0] + w[1] * logit + w[2 + k]).float().reshape(top_prob.shape)

    def observe(self, *, verified: Tensor, accepted: Tensor) -> None:
        rows, labels = [], []
        for r, (ell, a) in enumerate(zip(verified.reshape(-1).tolist(), accepted.reshape(-1).tolist())):
            features = self._pending[r] if r < len(self._pending) else []
            seen = min(int(ell), int(a) + 1, len(features))  # slots 1..A accepted, A+1 rejected (if verified)
            for k in range(seen):
                rows.append((k, features[k]))
                labels.append(1.0 if k < int(a) else 0.0)
        self.reset(len(self._pending))
        if not rows:
            return
        design = torch.zeros(len(rows), self.weights.numel(), dtype=torch.float64)
        for i, (k, logit) in enumerate(rows):
            design[i, 0], design[i, 1], design[i, 2 + k] = 1.0, logit, 1.0
        target = torch.tensor(labels, dtype=torch.float64)
        predicted = torch.sigmoid(design @ self.weights)
        gradient = design.T @ (predicted - target) / len(rows) + self.l2 * (self.weights - self.prior)
        self.weights = self.weights - self.lr * gradient
        self.updates += 1

    def state(self) -> dict[str, float]:
        """The fitted weights by name (logged with the run: what the estimator learned)."""
        names = ["bias", "top_logit_weight", *(f"slot{k + 1}_offset" for k in range(self.block_size))]
        return {name: float(v) for name, v in zip(names, self.weights.tolist())} | {"updates": float(self.updates)}


CONFIDENCE_SOURCES: Registry = Registry("decode.confidence")
CONFIDENCE_SOURCES.add(HEAD, lambda *, block_size, lr, l2: HeadConfidence(), label="trained head")
CONFIDENCE_SOURCES.add(DRAFT_MAX_PROB, lambda *, block_size, lr, l2: DraftMaxProb(), label="drafter's max prob")
CONFIDENCE_SOURCES.add(
    ONLINE, lambda *, block_size, lr, l2: OnlineLogistic(block_size=block_size, lr=lr, l2=l2), label="online logistic"
)


def build_confidence_source(
    name: str, *, block_size: int, lr: float = 0.05, l2: float = 1e-3, key: str = "decode"
) -> ConfidenceSource:
    """The source named by `<key>.confidence` (errors name that key and list the sources)."""
    if name not in CONFIDENCE_SOURCES:
        from dspark.registry import unknown_name_message

        raise ValueError(unknown_name_message(f"{key}.confidence", name, CONFIDENCE_SOURCES.names()))
    return CONFIDENCE_SOURCES.resolve(name)(block_size=block_size, lr=lr, l2=l2)


def top_probability(logits: Tensor, temperature: float) -> Tensor:
    """max_v q(v) [...] of drafter logits [..., V] at the verification temperature (T = 1 when greedy: module
    docstring); non-finite rows give 0 (no confidence)."""
    scale = temperature if temperature > 0 else 1.0
    top = torch.softmax(logits.float() / scale, dim=-1).amax(dim=-1)
    return torch.nan_to_num(top, nan=0.0)


def source_has_confidence(source: ConfidenceSource | None, *, has_head: bool) -> bool:
    """Whether proposals carry confidences: the head source needs a head, the others always do."""
    if source is None:
        return has_head
    return has_head or not source.needs_head


def observe_round(proposer: object | None, *, verified: list[int] | Tensor, accepted: list[int] | Tensor) -> None:
    """Tell the proposer's confidence source (if any) the round's outcome: ℓ_r verified and A_r accepted per row
    (the engines' one feedback point; a source without state ignores it)."""
    source = getattr(proposer, "confidence", None)
    if source is None or not getattr(proposer, "has_confidence", False):
        return
    source.observe(verified=torch.as_tensor(verified).long(), accepted=torch.as_tensor(accepted).long())
