"""The speculative decoding engine: one verifier for every drafter, lossless by construction (METHOD §5, §6).

Sequence positions are absolute (prompt at 0..S-1). The target's KV cache always holds exactly the positions
before the current anchor x_0 at position p; so does the proposer's context (`kv < anchor`, METHOD §2.1).

    1  prefill 0..S-1 into the target's cache; sample the first token from the target (not a round): x_0 at S
    per round, anchor x_0 at p:
    2  propose x_1..x_γ' with p_d and c_k (proposer context = positions 0..p-1)
    3  confidences → STS calibration (when given) → policy.choose with R = 1 (c_k depends on x_<k only) → ℓ, cut at
       the first drafted stop id and the end of the target's context (ℓ_eff)
    4  one target forward over [x_0, x_1..x_ℓ] at p..p+ℓ appended to the cache → p_t for slots 1..ℓ+1, features
    5  the verifier on the target's logits (rejection sampling; greedy matching at T = 0) → A, extra token y
    6  commit x_1..x_A and y; an accepted stop id ends the round there (τ = A, no y)
    7  roll the target cache back to positions ≤ p+A
    8  extend the proposer with the features of p..p+A; y is the next anchor at p+A+1

Round timings: `seconds_draft_parallel` = the proposer's parallel forward plus extending its context with this
round's committed positions (drafter compute), `seconds_draft_sequential` = its sampling loop, `seconds_verify` = the target
forward, p_t and the verifier's rejection sampling (steps 4–5), `seconds_other` = the rest (calibration, policy,
commit, rollback, records): the engine's Python overhead.
The checks, first token, commit rule and stop reasons are shared with the batched engine (`decoding.shared`).

Round costs (`step_costs`): "profile" plans SPS-planning policies (scheduler, async) on the table they were built
with; "measured" re-prices them after every round from what the rounds paid — the median verify time per B = ℓ + 1
and the round's cost outside the verify forward (`scheduling.measured.MeasuredRoundCosts`), kept across `generate`
calls of one engine.

Verifier (`verifier`, decode.verifier): "token" (token-by-token rejection sampling) or "block" (block verification),
both lossless for every policy's ℓ (`decoding.verify`). Bypass (`bypass`, decode.bypass): "cost" asks a
`scheduling.bypass.DraftingGate` before step 2 whether drafting pays; when it does not, the round skips steps 2–3
(nothing drafted, ℓ = 0) and is a plain target step through steps 4–8 — the target-only round, one uniform.

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
from dspark.config.schema import BYPASS_MODES, STEP_COSTS
from dspark.decoding.confidence import observe_round
from dspark.decoding.policies import VerificationPolicy, build_policy
from dspark.decoding.proposers import Proposal, Proposer
from dspark.decoding.records import GenerationResult, RoundRecord
from dspark.decoding.shared import (
    STOP_EOS,
    STOP_MAX_NEW_TOKENS,
    check_calibration,
    check_max_new_tokens,
    check_calibrated_input,
    check_policy_drafter,
    check_temperature,
    commit_verified,
    draft_limit,
    drafting_hook,
    is_done,
    prompt_error,
    sample_first,
    step_confidences,
    stop_reason,
)
from dspark.decoding.verify import probs_from_logits, resolve_verifier, verify_drafts_from_logits
from dspark.scheduling.bypass import BypassCosts, DraftingGate
from dspark.scheduling.measured import MeasuredRoundCosts
from dspark.timing import synchronize

__all__ = ["STOP_EOS", "STOP_MAX_NEW_TOKENS", "SpeculativeEngine", "commit_verified"]
KEY = "decode"


@dataclass
class _Decoding:
    """Mutable state of one generation."""

    cache: Any
    anchor: int  # x_0 of the next round
    position: int  # its position p (== cached positions)
    limit: int  # max_new_tokens
    new_tokens: list[int] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    done: bool = False


class SpeculativeEngine:
    """Draft → choose ℓ → verify → commit loop for one sequence at a time (numbered steps: module docstring).

    policy None = `fixed`; `calibration` (STS) is applied to the confidences before policies that read calibrated
    ones (`scheduler`, `async`, `calibrated_threshold`) and recorded in every round either way. `step_costs`
    (`decode.step_costs`): "profile" | "measured" (module docstring; policies without an SPS table ignore it).
    `verifier` (decode.verifier): "token" | "block". `bypass` (decode.bypass): "off" | "cost", priced on the measured
    round seconds, or on `bypass_costs` when given (a fixed table: decisions that do not follow the clock).
    """

    def __init__(
        self,
        *,
        target: Any,
        proposer: Proposer | None,
        policy: VerificationPolicy | None,
        temperature: float,
        max_new_tokens: int,
        calibration: STSCalibration | None = None,
        step_costs: str = "profile",
        verifier: str = "token",
        bypass: str = "off",
        bypass_costs: BypassCosts | None = None,
    ) -> None:
        self.temperature = check_temperature(temperature, KEY)
        self.verifier = resolve_verifier(verifier, key=KEY)
        if bypass not in BYPASS_MODES:
            raise ValueError(
                f"{KEY}.bypass={bypass!r}: choose one of {', '.join(BYPASS_MODES)} (off: draft every round; cost: a "
                "plain target step whenever drafting does not pay on the measured round costs)"
            )
        self.max_new_tokens = check_max_new_tokens(max_new_tokens, KEY)
        if step_costs not in STEP_COSTS:
            raise ValueError(
                f"{KEY}.step_costs={step_costs!r}: choose one of {', '.join(STEP_COSTS)} (profile: the "
                "SPS(B) table profiled at the start, reproducible from a seed; measured: re-priced from "
                "the rounds' own verify and drafting times)"
            )
        policy = policy if policy is not None else build_policy("fixed")
        if proposer is not None:
            check_policy_drafter(policy, has_confidence=proposer.has_confidence, key=KEY)
            check_calibrated_input(policy, calibration, key=KEY)
            check_calibration(calibration, block_size=proposer.block_size)
        self.target, self.proposer, self.policy, self.calibration = target, proposer, policy, calibration
        self.stop_ids = frozenset(int(t) for t in target.stop_token_ids)
        self.max_positions = getattr(target.hf_config, "max_position_embeddings", None)
        self._policy_hook = drafting_hook(policy, calibration)
        self._max_drafts = draft_limit(policy)
        self.gate = (
            DraftingGate(
                max_tokens=min(proposer.block_size, self._max_drafts or proposer.block_size) + 1, costs=bypass_costs
            )
            if bypass == "cost" and proposer is not None
            else None
        )
        profile = getattr(policy, "sps", None)
        self.round_costs = (
            MeasuredRoundCosts(profile)
            if step_costs == "measured" and profile is not None and proposer is not None and hasattr(policy, "reprice")
            else None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generate(
        self, prompt_ids: list[int], *, generator: torch.Generator | None, max_new_tokens: int | None = None
    ) -> GenerationResult:
        """Generate after `prompt_ids` (already templated). `generator` drives every random choice."""
        limit = self._check_prompt(prompt_ids, max_new_tokens)
        self.policy.reset()
        start = time.perf_counter()
        state = self._prefill(prompt_ids, generator=generator, limit=limit)
        prefill_seconds = time.perf_counter() - start
        while not state.done:
            state.rounds.append(self._round(state, generator))
        new_tokens = state.new_tokens[:limit]
        return GenerationResult(
            prompt_ids=list(prompt_ids),
            new_tokens=new_tokens,
            rounds=state.rounds,
            stop_reason=stop_reason(new_tokens, self.stop_ids),
            prefill_seconds=prefill_seconds,
            total_seconds=time.perf_counter() - start,
        )

    def _check_prompt(self, prompt_ids: list[int], max_new_tokens: int | None) -> int:
        limit = check_max_new_tokens(self.max_new_tokens if max_new_tokens is None else max_new_tokens, KEY)
        error = prompt_error(
            list(prompt_ids), limit=limit, vocab_size=self.target.vocab_size, max_positions=self.max_positions, key=KEY
        )
        if error is not None:
            raise ValueError(error)
        return limit

    @torch.no_grad()
    def _prefill(self, prompt_ids: list[int], *, generator: torch.Generator | None, limit: int) -> _Decoding:
        # 1. Prefill positions 0..S-1; the last one's distribution gives the first token (x_0 of round 1, at S).
        cache = self.target.new_cache()
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.target.device)
        forward = self.target.forward(ids, cache=cache)
        logits = self.target.logits_from_hidden(forward.final_hidden[:, -1])
        first = sample_first(probs_from_logits(logits, self.temperature), generator, greedy=self.greedy)
        state = _Decoding(cache=cache, anchor=first, position=len(prompt_ids), limit=limit, new_tokens=[first])
        state.done = first in self.stop_ids or limit <= 1
        if self.proposer is not None and not state.done:
            self.proposer.start(features=forward.features, token_ids=list(prompt_ids))
        return state

    @torch.no_grad()
    def _round(self, state: _Decoding, generator: torch.Generator | None) -> RoundRecord:
        start, position, anchor = time.perf_counter(), state.position, state.anchor
        # 2. Propose from the context of positions 0..p-1 — unless decode.bypass finds that drafting does not pay:
        #    then nothing is drafted and the round is a plain target step (ℓ = 0).
        drafting = self.gate is None or self.gate.draft()
        proposal = self._propose(state, generator) if drafting else self._no_proposal()
        drafts = proposal.tokens.tolist()
        # 3. Calibrate, choose ℓ; cut at the first drafted stop id and at the end of the target's context.
        calibrated, policy_input = step_confidences(self.policy, proposal.confidences, self.calibration)
        num_verified = self._num_to_verify(policy_input, drafts, position)
        # 4. One target forward over [x_0, x_1..x_ℓ] at positions p..p+ℓ, appended to the cache.
        verify_start = time.perf_counter()
        block = torch.tensor([[anchor, *drafts[:num_verified]]], dtype=torch.long, device=self.target.device)
        forward = self.target.forward(block, cache=state.cache)
        target_logits = self.target.logits_from_hidden(forward.final_hidden[0])
        # 5. The verifier (token: p_t = softmax(logits / T) row by row, only as far as it reads, the same result as
        #    on every row's p_t, `verify_drafts_from_logits`; block: every row). The token verifier is called by its
        #    module name here: tests/test_lossless.py swaps that name for a biased one to show its test can fail.
        verify = verify_drafts_from_logits if self.verifier.name == "token" else self.verifier.from_logits
        result = verify(
            draft_tokens=proposal.tokens[:num_verified],
            draft_probs=proposal.draft_probs[:num_verified],
            target_logits=target_logits,
            temperature=self.temperature,
            generator=generator,
        )
        synchronize(target_logits.device)
        verify_seconds = time.perf_counter() - verify_start
        # 6. Commit the accepted drafts and the extra token (an accepted stop id ends the round without one).
        accepted, committed, extra = commit_verified(result, self.stop_ids)
        observe_round(self.proposer, verified=[num_verified], accepted=[result.num_accepted])
        state.new_tokens.extend(committed)
        state.done = is_done(extra, stop_ids=self.stop_ids, committed=len(state.new_tokens), limit=state.limit)
        extend_seconds = 0.0
        if not state.done:
            # 7. Keep the target's KV of positions ≤ p+A (drops the rejected drafts').
            keep = position + len(accepted) + 1
            self.target.rollback(state.cache, keep=keep)
            # 8. The drafter's context gains p..p+A (A+1 features from the verify forward); y anchors at p+A+1.
            if self.proposer is not None:
                extend_start = time.perf_counter()
                self.proposer.extend(features=forward.features[:, : len(accepted) + 1], token_ids=[anchor, *accepted])
                synchronize(target_logits.device)
                extend_seconds = time.perf_counter() - extend_start
            state.anchor, state.position = extra, keep
        total = time.perf_counter() - start
        if self.gate is not None:
            self.gate.observe(
                drafted=drafting,
                committed=len(committed),
                verified=num_verified,
                seconds=total,
                verify_seconds=verify_seconds,
            )
        if self.round_costs is not None:  # decode.step_costs=measured: price the next round by what this one paid
            # a plain step (decode.bypass) prices B = 1 but not the drafting rounds' overhead (NaN: not observed)
            overhead = total - verify_seconds if drafting else float("nan")
            self.round_costs.observe(num_verified + 1, verify_seconds, overhead)
            self.policy.reprice(self.round_costs.table())
            total = time.perf_counter() - start  # the re-pricing counts as this round's "other"
        return self._record(
            proposal,
            drafts,
            calibrated,
            anchor_position=position,
            num_verified=num_verified,
            accepted=accepted,
            committed=committed,
            extra=extra,
            seconds=(total, verify_seconds, extend_seconds),
        )

    def _no_proposal(self) -> Proposal:
        """No drafts (target-only decoding, a bypassed round): ℓ = 0, the target's own step."""
        device, vocab = self.target.device, self.target.vocab_size
        return Proposal(
            torch.zeros(0, dtype=torch.long, device=device),
            torch.zeros(0, vocab, dtype=torch.float32, device=device),
            None,
        )

    def _propose(self, state: _Decoding, generator: torch.Generator | None) -> Proposal:
        if self.proposer is None:
            return self._no_proposal()
        return self.proposer.propose(
            anchor_token=state.anchor,
            anchor_position=state.position,
            temperature=self.temperature,
            generator=generator,
            stop_ids=self.stop_ids,
            policy_hook=self._policy_hook,
            max_drafts=self._max_drafts,
        )

    def _num_to_verify(self, confidences: Tensor | None, drafts: list[int], position: int) -> int:
        """ℓ_eff = min(policy's ℓ, slot of the first drafted stop id, room left in the target's context)."""
        count = len(drafts)
        if self.proposer is None or count == 0:
            return 0
        chosen = self.policy.choose(
            confidences=None if confidences is None else confidences.reshape(1, -1), num_drafts=count
        )
        chosen = int(torch.as_tensor(chosen).reshape(-1)[0])
        if not 0 <= chosen <= count:
            raise ValueError(f"decode.policy returned ℓ={chosen}, outside [0, {count}] for {count} drafts")
        first_stop = next((k + 1 for k, token in enumerate(drafts) if token in self.stop_ids), count)
        room = count if self.max_positions is None else self.max_positions - 1 - position
        return max(0, min(chosen, first_stop, room))

    def _record(
        self,
        proposal: Proposal,
        drafts: list[int],
        calibrated: Tensor | None,
        *,
        anchor_position: int,
        num_verified: int,
        accepted: list[int],
        committed: list[int],
        extra: int | None,
        seconds: tuple[float, float, float],
    ) -> RoundRecord:
        confidences = None if proposal.confidences is None else proposal.confidences.float()
        total, verify, extend = seconds
        parallel = proposal.seconds_parallel + extend  # block forward + the context update with the committed tokens
        drafting = parallel + proposal.seconds_sequential
        return RoundRecord(
            anchor_position=anchor_position,
            drafts=drafts,
            confidences=None if confidences is None else confidences.tolist(),
            calibrated=None if calibrated is None else calibrated.tolist(),
            num_verified=num_verified,
            num_accepted=len(accepted),
            committed=len(committed),
            extra_token=extra,
            seconds_draft_parallel=parallel,
            seconds_draft_sequential=proposal.seconds_sequential,
            seconds_verify=verify,
            seconds_other=max(0.0, total - drafting - verify),
        )
