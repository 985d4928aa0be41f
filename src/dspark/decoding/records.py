"""What one speculative generation produces: a record per round plus the committed tokens (METHOD §1, §5, §8).

Terms (METHOD §1): a round drafts γ' ≤ γ tokens, verifies ℓ_eff of them, accepts A and commits τ tokens —
normally A + 1 (the accepted drafts and the target's extra token); τ = A when an accepted draft is a stop id
(the round ends at it, no extra token). The target's first token after prefill is not a round. `tau` pools
over rounds (Σ τ / #rounds, DeepSpec's convention), not a per-prompt mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RoundRecord:
    """One decoding round (draft → choose ℓ → verify → commit)."""

    anchor_position: int  # p, position of the anchor x_0
    drafts: list[int]  # x_1..x_γ'; γ' < γ when drafting stopped at a drafted stop id, or when
    # the policy had already excluded slot k (threshold: c_k < θ)
    confidences: list[float] | None  # raw c_k per drafted slot; None without a confidence head
    calibrated: list[float] | None  # STS-calibrated c̃_k when the engine has a calibration
    num_verified: int  # ℓ_eff: drafts sent to the target (after the policy, EOS truncation); a tree: its depth
    # (the most drafts one round could accept, so per-slot acceptance means the same for chains and trees)
    num_accepted: int  # A
    committed: int  # τ: tokens committed this round (extra token included; EOS rule §5)
    extra_token: int | None  # the target's correction or bonus; None when an accepted draft was a stop id
    seconds_draft_parallel: float = 0.0  # drafter's parallel forward (backbone + LM head) + context update
    seconds_draft_sequential: float = 0.0  # drafter's sequential sampling loop (all of EAGLE-3's chain)
    seconds_verify: float = 0.0  # the target's verify forward and its probabilities
    seconds_other: float = 0.0  # the rest of the round: policy, verifier, commit, rollback (overhead)
    tree_nodes: int | None = None  # a tree round: N, the nodes the target verified (`drafts` holds their tokens)

    @property
    def seconds(self) -> float:
        """Wall time of the whole round."""
        return self.seconds_draft_parallel + self.seconds_draft_sequential + self.seconds_verify + self.seconds_other


@dataclass
class GenerationResult:
    """One prompt's generation: `new_tokens` (truncated to max_new_tokens, stop id kept) and the rounds."""

    prompt_ids: list[int]
    new_tokens: list[int]
    rounds: list[RoundRecord]
    stop_reason: str  # "eos" | "max_new_tokens"
    prefill_seconds: float  # prompt forward, first token, drafter context set-up
    total_seconds: float  # prefill + all rounds

    @property
    def tokens_per_second(self) -> float:
        """New tokens per wall-clock second, prefill included."""
        return len(self.new_tokens) / self.total_seconds if self.total_seconds > 0 else float("nan")

    @property
    def tau(self) -> float:
        """Pooled acceptance length Σ τ / #rounds (NaN without rounds)."""
        return sum(r.committed for r in self.rounds) / len(self.rounds) if self.rounds else float("nan")

    def round_counts(self) -> dict[str, Tensor]:
        """Per-round ℓ_eff, A and τ as [R] int64 tensors: `RolloutAcceptance.update(**result.round_counts())`."""
        columns = {
            "num_verified": [r.num_verified for r in self.rounds],
            "num_accepted": [r.num_accepted for r in self.rounds],
            "committed": [r.committed for r in self.rounds],
        }
        return {name: torch.tensor(values, dtype=torch.int64) for name, values in columns.items()}
