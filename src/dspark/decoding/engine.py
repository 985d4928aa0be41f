"""The speculative decoding engine: one verifier for every drafter, lossless by construction (METHOD §5, §6).

Sequence positions are absolute (prompt at 0..S-1). The target's KV cache always holds exactly the positions
before the current anchor x_0 at position p; so does the proposer's context (`kv < anchor`, METHOD §2.1).

    1  prefill 0..S-1 into the target's cache; sample the first token from the target (not a round): x_0 at S
    per round, anchor x_0 at p:
    2  propose x_1..x_γ' with p_d and c_k (proposer context = positions 0..p-1)
    3  choose ℓ with the policy (c_k depends on x_<k only), cut at the first drafted stop id (ℓ_eff)
    4  one target forward over [x_0, x_1..x_ℓ] at p..p+ℓ appended to the cache → p_t for slots 1..ℓ+1, features
    5  verify_drafts (rejection sampling; greedy matching when temperature == 0) → A, extra token y
    6  commit x_1..x_A and y; an accepted stop id ends the round there (τ = A, no y)
    7  roll the target cache back to positions ≤ p+A
    8  extend the proposer with the features of p..p+A; y is the next anchor at p+A+1

Generation stops at a stop id or once `max_new_tokens` are committed (the last round counts whole in the records;
`new_tokens` is truncated). Without a proposer every round is one target forward over the anchor (ℓ = 0, τ = 1):
the target-only baseline, through the same code path and the same verifier.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dspark.calibration.sts import STSCalibration
from dspark.decoding.policies import FixedPolicy, VerificationPolicy, calibrate_confidences
from dspark.decoding.proposers import Proposal, Proposer
from dspark.decoding.records import GenerationResult, RoundRecord
from dspark.decoding.verify import VerifyResult, probs_from_logits, verify_drafts

STOP_EOS = "eos"
STOP_MAX_NEW_TOKENS = "max_new_tokens"


@dataclass
class _Decoding:
    """Mutable state of one generation."""

    cache: Any
    anchor: int          # x_0 of the next round
    position: int        # its position p (== cached positions)
    limit: int           # max_new_tokens
    new_tokens: list[int] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    done: bool = False


class SpeculativeEngine:
    """Draft → choose ℓ → verify → commit loop for one sequence at a time (numbered steps: module docstring)."""

    def __init__(self, *, target: Any, proposer: Proposer | None, policy: VerificationPolicy | None,
                 temperature: float, max_new_tokens: int, calibration: STSCalibration | None = None) -> None:
        if temperature < 0:
            raise ValueError(f"decode.temperature={temperature} must be >= 0 (0 = greedy verification)")
        _check_max_new_tokens(max_new_tokens)
        policy = policy if policy is not None else FixedPolicy()
        if proposer is not None and getattr(policy, "needs_confidences", False) and not proposer.has_confidence:
            raise ValueError(f"decode.policy={getattr(policy, 'name', policy)} needs a drafter with a confidence "
                             "head (drafter=dspark); dflash and eagle3 have none: use decode.policy=fixed")
        self.target, self.proposer, self.policy = target, proposer, policy
        self.temperature, self.max_new_tokens, self.calibration = float(temperature), max_new_tokens, calibration
        self.stop_ids = frozenset(int(t) for t in target.stop_token_ids)
        self.max_positions = getattr(target.hf_config, "max_position_embeddings", None)
        self._policy_hook = getattr(policy, "stop_drafting", None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generate(self, prompt_ids: list[int], *, generator: torch.Generator | None,
                 max_new_tokens: int | None = None) -> GenerationResult:
        """Generate after `prompt_ids` (already templated). `generator` drives every random choice."""
        limit = self._check_prompt(prompt_ids, max_new_tokens)
        start = time.perf_counter()
        state = self._prefill(prompt_ids, generator=generator, limit=limit)
        prefill_seconds = time.perf_counter() - start
        while not state.done:
            state.rounds.append(self._round(state, generator))
        new_tokens = state.new_tokens[:limit]
        stop_reason = STOP_EOS if new_tokens[-1] in self.stop_ids else STOP_MAX_NEW_TOKENS
        return GenerationResult(prompt_ids=list(prompt_ids), new_tokens=new_tokens, rounds=state.rounds,
                                stop_reason=stop_reason, prefill_seconds=prefill_seconds,
                                total_seconds=time.perf_counter() - start)

    def _check_prompt(self, prompt_ids: list[int], max_new_tokens: int | None) -> int:
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        _check_max_new_tokens(limit)
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token (e.g. the chat-templated user turn)")
        vocab = self.target.vocab_size
        if any(not 0 <= int(t) < vocab for t in prompt_ids):
            raise ValueError(f"the prompt has token ids outside the target vocabulary [0, {vocab})")
        if self.max_positions is not None and len(prompt_ids) + limit > self.max_positions:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + decode.max_new_tokens={limit} exceeds the "
                             f"target's context of {self.max_positions} positions (max_position_embeddings); "
                             "shorten the prompt or lower decode.max_new_tokens")
        return limit

    def _sample_target(self, target_probs: Tensor, generator: torch.Generator | None) -> int:
        """One token from p_t [1, V] through the verifier with no drafts (argmax when greedy)."""
        no_drafts = torch.zeros(0, dtype=torch.long, device=target_probs.device)
        return verify_drafts(draft_tokens=no_drafts, draft_probs=target_probs.new_zeros(0, target_probs.shape[-1]),
                             target_probs=target_probs, generator=generator, greedy=self.greedy).next_token

    @torch.no_grad()
    def _prefill(self, prompt_ids: list[int], *, generator: torch.Generator | None, limit: int) -> _Decoding:
        # 1. Prefill positions 0..S-1; the last one's distribution gives the first token (x_0 of round 1, at S).
        cache = self.target.new_cache()
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.target.device)
        forward = self.target.forward(ids, cache=cache)
        logits = self.target.logits_from_hidden(forward.final_hidden[:, -1])
        first = self._sample_target(probs_from_logits(logits, self.temperature), generator)
        state = _Decoding(cache=cache, anchor=first, position=len(prompt_ids), limit=limit, new_tokens=[first])
        state.done = first in self.stop_ids or limit <= 1
        if self.proposer is not None and not state.done:
            self.proposer.start(features=forward.features, token_ids=list(prompt_ids))
        return state

    @torch.no_grad()
    def _round(self, state: _Decoding, generator: torch.Generator | None) -> RoundRecord:
        start, position, anchor = time.perf_counter(), state.position, state.anchor
        # 2. Propose from the context of positions 0..p-1.
        proposal = self._propose(state, generator)
        drafts = proposal.tokens.tolist()
        # 3. Choose ℓ; cut at the first drafted stop id and at the end of the target's context.
        num_verified = self._num_to_verify(proposal, drafts, position)
        # 4. One target forward over [x_0, x_1..x_ℓ] at positions p..p+ℓ, appended to the cache.
        verify_start = time.perf_counter()
        block = torch.tensor([[anchor, *drafts[:num_verified]]], dtype=torch.long, device=self.target.device)
        forward = self.target.forward(block, cache=state.cache)
        target_probs = probs_from_logits(self.target.logits_from_hidden(forward.final_hidden[0]), self.temperature)
        _sync(target_probs.device)
        verify_seconds = time.perf_counter() - verify_start
        # 5. The one verifier.
        result = verify_drafts(draft_tokens=proposal.tokens[:num_verified],
                               draft_probs=proposal.draft_probs[:num_verified], target_probs=target_probs,
                               generator=generator, greedy=self.greedy)
        # 6. Commit the accepted drafts and the extra token (an accepted stop id ends the round without one).
        accepted, committed, extra = commit_verified(result, self.stop_ids)
        state.new_tokens.extend(committed)
        state.done = extra is None or extra in self.stop_ids or len(state.new_tokens) >= state.limit
        if not state.done:
            # 7. Keep the target's KV of positions ≤ p+A (drops the rejected drafts').
            keep = position + len(accepted) + 1
            self.target.rollback(state.cache, keep=keep)
            # 8. The drafter's context gains p..p+A (A+1 features from the verify forward); y anchors at p+A+1.
            if self.proposer is not None:
                self.proposer.extend(features=forward.features[:, :len(accepted) + 1],
                                     token_ids=[anchor, *accepted])
            state.anchor, state.position = extra, keep
        return self._record(proposal, drafts, anchor_position=position,
                            num_verified=num_verified, accepted=accepted, committed=committed, extra=extra,
                            seconds=(time.perf_counter() - start, verify_seconds))

    def _propose(self, state: _Decoding, generator: torch.Generator | None) -> Proposal:
        if self.proposer is None:
            device, vocab = self.target.device, self.target.vocab_size
            return Proposal(torch.zeros(0, dtype=torch.long, device=device),
                            torch.zeros(0, vocab, dtype=torch.float32, device=device), None)
        return self.proposer.propose(anchor_token=state.anchor, anchor_position=state.position,
                                     temperature=self.temperature, generator=generator, stop_ids=self.stop_ids,
                                     policy_hook=self._policy_hook)

    def _num_to_verify(self, proposal: Proposal, drafts: list[int], position: int) -> int:
        """ℓ_eff = min(policy's ℓ, slot of the first drafted stop id, room left in the target's context)."""
        count = len(drafts)
        if self.proposer is None or count == 0:
            return 0
        chosen = int(self.policy.choose(confidences=proposal.confidences, num_drafts=count))
        if not 0 <= chosen <= count:
            raise ValueError(f"decode.policy returned ℓ={chosen}, outside [0, {count}] for {count} drafts")
        first_stop = next((k + 1 for k, token in enumerate(drafts) if token in self.stop_ids), count)
        room = count if self.max_positions is None else self.max_positions - 1 - position
        return max(0, min(chosen, first_stop, room))

    def _record(self, proposal: Proposal, drafts: list[int], *, anchor_position: int, num_verified: int,
                accepted: list[int], committed: list[int], extra: int | None,
                seconds: tuple[float, float]) -> RoundRecord:
        confidences = None if proposal.confidences is None else proposal.confidences.float()
        calibrated = None
        if confidences is not None and self.calibration is not None:
            calibrated = calibrate_confidences(self.calibration, confidences).tolist()
        total, verify = seconds
        drafting = proposal.seconds_parallel + proposal.seconds_sequential
        return RoundRecord(anchor_position=anchor_position, drafts=drafts,
                           confidences=None if confidences is None else confidences.tolist(), calibrated=calibrated,
                           num_verified=num_verified, num_accepted=len(accepted), committed=len(committed),
                           extra_token=extra, seconds_draft_parallel=proposal.seconds_parallel,
                           seconds_draft_sequential=proposal.seconds_sequential, seconds_verify=verify,
                           seconds_other=max(0.0, total - drafting - verify))


def commit_verified(result: VerifyResult, stop_ids: frozenset[int]) -> tuple[list[int], list[int], int | None]:
    """(accepted drafts, committed tokens, extra token or None) of one verified round (METHOD §5's EOS rule): an
    accepted stop id ends the round at it, with no extra token. Shared by the single and the batched engine."""
    accepted = result.accepted_tokens.tolist()
    for k, token in enumerate(accepted):
        if token in stop_ids:
            return accepted[:k + 1], accepted[:k + 1], None
    return accepted, [*accepted, result.next_token], result.next_token


def _check_max_new_tokens(max_new_tokens: int) -> None:
    if int(max_new_tokens) < 1:
        raise ValueError(f"decode.max_new_tokens={max_new_tokens} must be >= 1")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
