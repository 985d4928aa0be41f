"""The batched serving engine: continuous batching of R requests, one drafter and one target forward per step
(METHOD §5–§7, paper §5.2, §7). Semantics per request are those of `dspark.decoding.engine.SpeculativeEngine`.

Closed loop: `concurrency` requests are kept active; a finished request's slot is taken by the next queued one
at the next step. Positions are per request and absolute (prompt at 0..S-1). One step:

    0  join: prefill every joiner of this step in ONE right-padded forward, sample each one's first token
       (not a round), merge the rows into the target's KV store and the drafter's context
    1  draft for all R rows in one drafter forward (`BatchedDSparkProposer`): x_{r,1..γ'_r}, p_d, c_{r,k}
    2  confidences → STS calibration (when given) → policy.choose → ℓ_r, cut at the context end (a drafted stop
       id is always the row's last draft)
    3  ONE target forward over every row's [x_0, x_{r,1..ℓ_r}] right-padded to max ℓ + 1, at per-token positions
    4  per row, the verifier on its logits with that row's generator (rejection sampling; greedy matching at
       T = 0; p_t rows are formed only as far as it reads them, `verify_drafts_from_logits`)
    5  commit (METHOD §5 EOS rule), keep the KV columns of p..p+A_r (the rest become holes), extend the drafter
       context with the features of p..p+A_r from the verify forward; y_r anchors at p+A_r+1
    6  record `ServeRound`s and the `ServeStep`; rows at a stop id or max_new_tokens leave; compact the KV store

Every random number of request r comes from its own generator seeded from (seed, request_id), in the same
order as the single-request engine draws them, so a request's randomness never depends on who shares its batch.
The last round of a request counts whole in the records (`new_tokens` is truncated to max_new_tokens).
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from dspark.calibration.sts import STSCalibration
from dspark.config.schema import STEP_OVERHEADS
from dspark.decoding.policies import VerificationPolicy, build_policy
from dspark.decoding.shared import (
    STOP_EOS,
    STOP_MAX_NEW_TOKENS,
    STOP_REJECTED,
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
from dspark.decoding.confidence import ConfidenceSource, observe_round, source_has_confidence
from dspark.decoding.verify import probs_from_logits, resolve_verifier, verify_drafts_from_logits
from dspark.scheduling.measured import ema
from dspark.timing import synchronize
from dspark.serving.kv import BatchedKVCache, check_concurrency, kv_budget, prefill
from dspark.serving.proposer import BatchedDSparkProposer, BatchProposal, check_serving_drafter
from dspark.serving.records import RequestResult, ServeRound, ServeStep, ServeSummary, summarize_serving

__all__ = [
    "STOP_EOS",
    "STOP_MAX_NEW_TOKENS",
    "STOP_REJECTED",
    "BatchedEngine",
    "ServeRequest",
    "ServeResult",
    "request_generator",
]
KEY = "serve"


@dataclass
class ServeRequest:
    """One prompt to serve (already chat-templated); max_new_tokens None uses the engine's."""

    request_id: int
    prompt_ids: list[int]
    domain: str = ""
    max_new_tokens: int | None = None


@dataclass
class ServeResult:
    """What `BatchedEngine.serve` returns: per-request results (input order), per-step records, wall time."""

    requests: list[RequestResult]
    steps: list[ServeStep]
    wall_seconds: float
    concurrency: int

    def summary(self, policy_name: str) -> ServeSummary:
        return summarize_serving(
            self.requests, self.steps, wall_seconds=self.wall_seconds, policy=policy_name, concurrency=self.concurrency
        )


def request_generator(seed: int, request_id: int) -> torch.Generator:
    """A CPU generator seeded from (seed, request_id) alone (a hash, so nearby ids give unrelated streams)."""
    digest = hashlib.sha256(f"dspark-serve:{int(seed)}:{int(request_id)}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


@dataclass
class _Active:
    """Decoding state of one active request (one row of the KV store and of the proposer)."""

    request: ServeRequest
    generator: torch.Generator
    limit: int
    anchor: int  # x_0 of the next round
    position: int  # its position p (== committed positions before it)
    joined_at: float
    new_tokens: list[int] = field(default_factory=list)
    num_rounds: int = 0
    done: bool = False


@dataclass
class _Run:
    """Mutable state of one `serve` call."""

    queue: deque
    seed: int
    start: float
    bar: tqdm
    active: list[_Active] = field(default_factory=list)
    results: dict[int, RequestResult] = field(default_factory=dict)

    def now(self) -> float:
        return time.perf_counter() - self.start

    def finish(self, result: RequestResult) -> None:
        self.results[result.request_id] = result
        self.bar.update(1)


class BatchedEngine:
    """Continuous-batching speculative decoding for DSpark/DFlash drafters (numbered steps: module docstring).

    drafter None serves target-only (ℓ = 0 for every row, policy unused). policy None with a drafter = `fixed`.
    `calibration` (STS) is applied before policies that read calibrated confidences (`decoding.policies`) and
    recorded either way; `precision` is decode.drafter_precision (`decoding.drafting`); `verifier` is serve.verifier
    ("token" | "block", `decoding.verify`), applied row by row with each row's own generator.
    """

    def __init__(
        self,
        *,
        target,
        drafter,
        policy: VerificationPolicy | None,
        temperature: float,
        max_new_tokens: int,
        calibration: STSCalibration | None = None,
        precision: str = "fp32",
        step_overhead: str = "none",
        verifier: str = "token",
        confidence: ConfidenceSource | None = None,
    ) -> None:
        temperature = check_temperature(temperature, KEY)
        max_new_tokens = check_max_new_tokens(max_new_tokens, KEY)
        self.verifier = resolve_verifier(verifier, key=KEY)
        drafter = check_serving_drafter(drafter)
        policy = policy if policy is not None or drafter is None else build_policy("fixed", key=KEY)
        if drafter is not None:
            has_head = drafter.confidence_head is not None
            check_policy_drafter(policy, has_confidence=source_has_confidence(confidence, has_head=has_head), key=KEY)
            check_calibrated_input(policy, calibration, key=KEY)
            check_calibration(calibration, block_size=drafter.block_size)
        self.target, self.drafter, self.policy, self.calibration = target, drafter, policy, calibration
        self.temperature, self.max_new_tokens, self.precision = temperature, max_new_tokens, precision
        self.confidence = confidence  # serve.confidence (None: the head); one source across serve() calls
        self.stop_ids = frozenset(int(t) for t in target.stop_token_ids)
        self.max_positions = getattr(target.hf_config, "max_position_embeddings", None)
        self.kv: BatchedKVCache | None = None
        self.proposer: BatchedDSparkProposer | None = None
        self._policy_hook, self._max_drafts = drafting_hook(policy, calibration), draft_limit(policy)
        if step_overhead not in STEP_OVERHEADS:
            raise ValueError(f"serve.step_overhead={step_overhead!r}: choose one of {', '.join(STEP_OVERHEADS)}")
        # "measured": an SPS-planning policy plans with whole-step rates, its verify table plus this engine's own
        # drafting and per-row work per step (an EMA of the recorded seconds), not the verify forward alone
        self._verify_sps = getattr(policy, "sps", None) if step_overhead == "measured" else None
        self._overhead: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def serve(self, requests: list[ServeRequest], *, concurrency: int, seed: int, progress: bool = True) -> ServeResult:
        """Serve all `requests` keeping `concurrency` active; rejected requests finish alone with an error.

        Before serving: ValueError when concurrency < 1, request ids repeat, or min(concurrency, servable
        requests) KV caches of the longest request do not fit in memory (`kv.check_concurrency`).
        """
        self._check_serve_args(requests, concurrency)
        if self.policy is not None and hasattr(self.policy, "reset"):
            self.policy.reset()
        if self._verify_sps is not None:  # every serve starts from the verify table
            self._overhead = None
            self.policy.reprice(self._verify_sps)
        self.kv = BatchedKVCache(self.target)
        self.proposer = (
            BatchedDSparkProposer(self.drafter, precision=self.precision, confidence=self.confidence)
            if self.drafter is not None
            else None
        )
        steps: list[ServeStep] = []
        bar = tqdm(total=len(requests), desc="serving", unit="request", disable=not progress)
        run = _Run(queue=deque(requests), seed=seed, start=time.perf_counter(), bar=bar)
        with torch.no_grad(), bar:
            while run.queue or run.active:
                prefill_seconds = self._admit(run, concurrency)
                if run.active:
                    steps.append(self._step(run, index=len(steps), prefill_seconds=prefill_seconds))
                    self._reprice(steps[-1])
        wall = run.now()
        return ServeResult(
            requests=[run.results[r.request_id] for r in requests],
            steps=steps,
            wall_seconds=wall,
            concurrency=int(concurrency),
        )

    def _reprice(self, step: ServeStep) -> None:
        """serve.step_overhead=measured: fold this step's seconds outside the verify forward (drafting, per-row
        verification, commits, context extension; not prefill, which admitting requests costs whatever the plan)
        into an EMA and hand the policy its verify table with that overhead added to every step."""
        if self._verify_sps is None:
            return
        self._overhead = ema(self._overhead, step.seconds_draft + step.seconds_other)
        self.policy.reprice(self._verify_sps.with_step_overhead(self._overhead))

    def _check_serve_args(self, requests: list[ServeRequest], concurrency: int) -> None:
        if int(concurrency) < 1:
            raise ValueError(f"serve.concurrency={concurrency} must be >= 1 (requests kept active at once)")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("serve: request_id values must be unique (each seeds its own random generator)")
        lengths = [len(r.prompt_ids) + self._limit(r) for r in requests if self._reject_reason(r) is None]
        if lengths:
            budget = kv_budget(target=self.target, drafter=self.drafter, positions=max(lengths))
            check_concurrency(min(int(concurrency), len(lengths)), budget)

    def _limit(self, request: ServeRequest) -> int:
        return self.max_new_tokens if request.max_new_tokens is None else int(request.max_new_tokens)

    def _reject_reason(self, request: ServeRequest) -> str | None:
        """Why this request cannot be served (None when it can)."""
        return prompt_error(
            list(request.prompt_ids),
            limit=self._limit(request),
            vocab_size=self.target.vocab_size,
            max_positions=self.max_positions,
            key=KEY,
        )

    def _admit(self, run: _Run, concurrency: int) -> float:
        """0. Fill free slots from the queue: one prefill forward for all joiners; returns its seconds."""
        joiners: list[ServeRequest] = []
        while run.queue and len(run.active) + len(joiners) < concurrency:
            request = run.queue.popleft()
            error = self._reject_reason(request)
            if error is None:
                joiners.append(request)
            else:
                now = run.now()
                run.finish(
                    RequestResult(
                        request_id=request.request_id,
                        prompt_ids=list(request.prompt_ids),
                        new_tokens=[],
                        stop_reason=STOP_REJECTED,
                        error=error,
                        joined_at=now,
                        finished_at=now,
                        num_rounds=0,
                        domain=request.domain,
                    )
                )
        if not joiners:
            return 0.0
        start, joined_at = time.perf_counter(), run.now()
        batch = prefill(self.target, [list(r.prompt_ids) for r in joiners])
        probs = probs_from_logits(self.target.logits_from_hidden(batch.last_hidden), self.temperature)  # [J, V]
        states = []
        for j, request in enumerate(joiners):
            generator = request_generator(run.seed, request.request_id)
            first = sample_first(probs[j : j + 1], generator, greedy=self.greedy)
            state = _Active(
                request=request,
                generator=generator,
                limit=self._limit(request),
                anchor=first,
                position=len(request.prompt_ids),
                joined_at=joined_at,
                new_tokens=[first],
            )
            state.done = first in self.stop_ids or state.limit <= 1
            states.append(state)
        keep = [j for j, state in enumerate(states) if not state.done]
        self.kv.add_rows(batch, torch.tensor(keep, dtype=torch.long, device=batch.valid.device))
        if self.proposer is not None:
            self.proposer.add_rows([batch.features[j, : int(batch.lengths[j])] for j in keep])
        run.active.extend(states[j] for j in keep)
        for state in states:
            if state.done:
                self._finish(run, state)
        return time.perf_counter() - start

    def _step(self, run: _Run, *, index: int, prefill_seconds: float) -> ServeStep:
        start, active, device = time.perf_counter(), run.active, self.target.device
        anchors = torch.tensor([s.anchor for s in active], dtype=torch.long, device=device)
        positions = torch.tensor([s.position for s in active], dtype=torch.long, device=device)
        # 1. Draft for every row at once.
        proposal = self._propose(run, anchors, positions)
        drafted = time.perf_counter()
        # 2. Calibrated confidences → ℓ_r.
        calibrated, policy_input = step_confidences(self.policy, proposal.confidences, self.calibration)
        lengths = self._choose(proposal, policy_input, positions)
        # 3. One target forward over the padded verify blocks.
        ids, block_positions, block_valid = _verify_block(anchors, positions, proposal.tokens, lengths)
        verify_start = time.perf_counter()
        forward = self.kv.forward(ids, position_ids=block_positions, input_valid=block_valid)
        target_logits = self.target.logits_from_hidden(forward.final_hidden)
        synchronize(device)
        verified = time.perf_counter()
        # 4.–5. Verify and commit row by row (p_t rows only as far as each verifier reads them); keep the KV of
        #       p..p+A_r; extend the drafter's context.
        rounds, keep = [], []
        for r, state in enumerate(active):
            round_, kept = self._verify_row(
                state,
                proposal=proposal,
                row=r,
                target_logits=target_logits[r],
                length=int(lengths[r]),
                calibrated=calibrated,
                step=index,
            )
            rounds.append(round_)
            keep.append(kept)
        observe_round(
            self.proposer, verified=[x.num_verified for x in rounds], accepted=[x.num_accepted for x in rounds]
        )
        rows_verified = time.perf_counter()
        keep_tensor = torch.tensor(keep, dtype=torch.long, device=device)
        self.kv.keep_new(keep_tensor)
        if self.proposer is not None:
            self.proposer.extend(features=forward.features, counts=keep_tensor)
        synchronize(device)
        extended = time.perf_counter()
        # 6. Finished rows leave; the KV store compacts once holes pile up.
        self._retire(run)
        return ServeStep(
            step=index,
            num_active=len(active),
            batch_tokens=int(sum(1 + int(x) for x in lengths)),
            committed=sum(r.committed for r in rounds),
            seconds_draft=drafted - start,
            seconds_verify=verified - verify_start,
            seconds_other=(verify_start - drafted) + (time.perf_counter() - verified),
            seconds_prefill=prefill_seconds,
            seconds_draft_sequential=proposal.seconds_sequential,
            seconds_verify_rows=rows_verified - verified,
            seconds_extend=extended - rows_verified,
            rounds=rounds,
        )

    def _propose(self, run: _Run, anchors: Tensor, positions: Tensor) -> BatchProposal:
        if self.proposer is None:
            rows, device = anchors.shape[0], anchors.device
            return BatchProposal(
                torch.zeros(rows, 0, dtype=torch.long, device=device),
                torch.zeros(rows, 0, self.target.vocab_size, device=device),
                None,
                torch.zeros(rows, dtype=torch.long, device=device),
            )
        return self.proposer.propose(
            anchor_tokens=anchors,
            anchor_positions=positions,
            temperature=self.temperature,
            generators=[s.generator for s in run.active],
            stop_ids=self.stop_ids,
            policy_hook=self._policy_hook,
            max_drafts=self._max_drafts,
        )

    def _choose(self, proposal: BatchProposal, confidences: Tensor | None, positions: Tensor) -> Tensor:
        """ℓ_r [R] long (CPU) = min(policy's ℓ_r on what it reads, room left in the target's context)."""
        num_drafts = proposal.num_drafts.cpu()
        if self.proposer is None:
            return torch.zeros_like(num_drafts)
        chosen = torch.as_tensor(self.policy.choose(confidences=confidences, num_drafts=num_drafts)).long().cpu()
        if chosen.shape != num_drafts.shape or bool((chosen < 0).any()) or bool((chosen > num_drafts).any()):
            raise ValueError(
                f"serve.policy={self.policy.name} returned ℓ={chosen.tolist()}, outside [0, γ'] for "
                f"γ'={num_drafts.tolist()}"
            )
        if self.max_positions is not None:
            chosen = torch.minimum(chosen, (self.max_positions - 1 - positions.cpu()).clamp(min=0))
        return chosen

    def _verify_row(
        self,
        state: _Active,
        *,
        proposal: BatchProposal,
        row: int,
        target_logits: Tensor,
        length: int,
        calibrated: Tensor | None,
        step: int,
    ) -> tuple[ServeRound, int]:
        """Verify, commit and record one row; returns its round and how many block columns stay valid."""
        anchor_position = state.position
        # the token verifier by its module name: tests/test_serving_lossless.py swaps it to show its test can fail
        verify = verify_drafts_from_logits if self.verifier.name == "token" else self.verifier.from_logits
        result = verify(
            draft_tokens=proposal.tokens[row, :length],
            draft_probs=proposal.draft_probs[row, :length],
            target_logits=target_logits[: length + 1],
            temperature=self.temperature,
            generator=state.generator,
        )
        accepted, committed, extra = commit_verified(result, self.stop_ids)
        state.new_tokens.extend(committed)
        state.num_rounds += 1
        state.done = is_done(extra, stop_ids=self.stop_ids, committed=len(state.new_tokens), limit=state.limit)
        if not state.done:
            state.anchor, state.position = extra, anchor_position + len(accepted) + 1
        num_drafted = int(proposal.num_drafts[row])
        # a proposal the policy cut short says nothing about the drafts it did not draw: no accept_if_all then
        cut = proposal.policy_cut is not None and bool(proposal.policy_cut[row])
        confidences = None if proposal.confidences is None else proposal.confidences[row, :num_drafted].tolist()
        round_ = ServeRound(
            request_id=state.request.request_id,
            step=step,
            anchor_position=anchor_position,
            num_drafted=num_drafted,
            confidences=confidences,
            calibrated=None if calibrated is None else calibrated[row, :num_drafted].tolist(),
            num_verified=length,
            num_accepted=len(accepted),
            committed=len(committed),
            accept_if_all=len(accepted) if length == num_drafted and not cut else None,
        )
        return round_, 0 if state.done else len(accepted) + 1

    def _retire(self, run: _Run) -> None:
        """Drop finished rows from the KV store and the proposer; compact the store when holes pile up."""
        keep = [r for r, state in enumerate(run.active) if not state.done]
        if len(keep) < len(run.active):
            for state in run.active:
                if state.done:
                    self._finish(run, state)
            rows = torch.tensor(keep, dtype=torch.long, device=self.target.device)
            self.kv.remove_rows(rows)
            if self.proposer is not None:
                self.proposer.remove_rows(rows)
            run.active = [run.active[r] for r in keep]
        self.kv.maybe_compact()

    def _finish(self, run: _Run, state: _Active) -> None:
        new_tokens = state.new_tokens[: state.limit]
        reason = stop_reason(new_tokens, self.stop_ids)
        request = state.request
        run.finish(
            RequestResult(
                request_id=request.request_id,
                prompt_ids=list(request.prompt_ids),
                new_tokens=new_tokens,
                stop_reason=reason,
                error=None,
                joined_at=state.joined_at,
                finished_at=run.now(),
                num_rounds=state.num_rounds,
                domain=request.domain,
            )
        )


def _verify_block(anchors: Tensor, positions: Tensor, drafts: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded verify input: ids [R, L+1] = [x_0, x_1..x_ℓ_r, x_0…], positions p_r + j, valid j ≤ ℓ_r."""
    width = int(lengths.max()) + 1 if lengths.numel() else 1
    lengths = lengths.to(anchors.device)
    columns = torch.arange(width, device=anchors.device).unsqueeze(0)
    valid = columns <= lengths.unsqueeze(1)
    ids = anchors.unsqueeze(1).expand(-1, width).clone()  # padding repeats the anchor: any in-vocabulary id works
    if width > 1:
        ids[:, 1:] = torch.where(valid[:, 1:], drafts[:, : width - 1].to(anchors.device), ids[:, 1:])
    return ids, positions.unsqueeze(1) + columns, valid
