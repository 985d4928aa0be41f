"""Drafters only propose: the narrow interface between a drafter and the one verifier (METHOD §2, §4, §5).

A proposer keeps the drafter's context — the target features of every committed position before the anchor
(`kv < anchor`, METHOD §2.1) — and turns an anchor into a `Proposal`: drafted tokens, the exact distribution each
was sampled from (`p_d`, needed by the verifier) and, for DSpark, the confidences c_k. The engine owns everything
else (verification, commits, caches of the target).

`DSparkProposer` (also DFlash = head none) caches the fused context H_ctx once per committed token and, per draft
layer, the context keys (k-norm and RoPE applied) and values, so a round costs one block forward over γ queries
— no re-projection of the context — then the sequential loop (METHOD §2.2–§2.3):

    logits_k = U_k + B_k(x_{k-1}),  c_k = σ(w·[h_k; W_1[x_{k-1}]] + b),  x_k ~ softmax(logits_k / T)  (T = 0: argmax)

Both proposers draw no draft that cannot be verified: at most `max_drafts` slots (static / mtp1), and the DSpark loop
stops before sampling x_k when `policy_hook(c_1..c_k)` says slot k will not be verified (threshold, scheduler; the
engine builds the hook with `decoding.shared.drafting_hook`).

`Eagle3Proposer` keeps EAGLE-3's step-0 keys/values of the committed positions and runs step 0 only over the positions
committed since the last round, then the chain of γ one-token steps (`Eagle3Drafter.extend_context`, `draft_from`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from dspark.decoding.confidence import ConfidenceSource, source_has_confidence, top_probability
from dspark.decoding.drafting import (
    ParallelStage,
    draft_to_target,
    prepare_sequential_head,
    resolve_precision,
    to_target_probs,
    usable_logits,
)
from dspark.decoding.verify import probs_from_logits, sample_from_probs
from dspark.drafters.backbone import ExtendKV
from dspark.drafters.dspark import DSparkDrafter
from dspark.drafters.eagle3 import Eagle3Drafter
from dspark.timing import synchronize

PolicyHook = Callable[[Tensor], bool]  # c_1..c_k [k] → True: slot k will not be verified, stop before sampling x_k


@dataclass
class Proposal:
    """One round's drafts (γ' ≤ γ; fewer after a drafted stop id or a policy stop)."""

    tokens: Tensor  # [γ'] long, x_1..x_γ'
    draft_probs: Tensor  # [γ', V] float32, the distribution x_k was sampled from (one-hot when T = 0)
    confidences: Tensor | None  # [γ'] float32 raw c_k = σ(confidence logit); None without a confidence head
    seconds_parallel: float = 0.0
    seconds_sequential: float = 0.0


class Proposer(Protocol):
    """What the engine calls. Positions are absolute; features are the target's raw feature layers [1, n, m·d]."""

    block_size: int  # γ
    has_confidence: bool  # whether proposals carry confidences

    def start(self, *, features: Tensor, token_ids: list[int]) -> None:
        """Reset to the prompt: features and tokens of positions 0..S-1 (everything before the first anchor)."""

    def extend(self, *, features: Tensor, token_ids: list[int]) -> None:
        """Append newly committed positions (the anchor and accepted drafts; never rejected drafts)."""

    def propose(
        self,
        *,
        anchor_token: int,
        anchor_position: int,
        temperature: float,
        generator: torch.Generator | None,
        stop_ids: Collection[int],
        policy_hook: PolicyHook | None = None,
        max_drafts: int | None = None,
    ) -> Proposal:
        """Draft after `anchor_token` at `anchor_position` (== the number of context positions); at most
        `max_drafts` slots (the policy's `max_drafts`: no later slot would be verified), γ when None."""


def _sample(logits: Tensor, temperature: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """logits [1, V] → (token [1] long, the distribution it was drawn from [1, V] float32)."""
    probs = probs_from_logits(logits, temperature)
    token = probs.argmax(-1) if temperature == 0 else sample_from_probs(probs, generator, trusted=True)
    return token, probs


def _stack_proposal(
    tokens: list[Tensor], probs: list[Tensor], vocab_size: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Lists of per-slot [1] / [1, V] tensors → [γ'], [γ', V] (γ' may be 0)."""
    if not tokens:
        return (
            torch.zeros(0, dtype=torch.long, device=device),
            torch.zeros(0, vocab_size, dtype=torch.float32, device=device),
        )
    return torch.cat(tokens), torch.cat(probs)


class GrowingBuffer:
    """Append-only tensor along `dim` with doubling capacity; `spare(n)` exposes room past the end."""

    def __init__(self, dim: int) -> None:
        self.dim, self.length, self._data = dim, 0, None

    def reserve(self, extra: int, like: Tensor) -> None:
        """Make room for `extra` more entries shaped like `like` (except along `dim`)."""
        need = self.length + extra
        if self._data is not None and self._data.shape[self.dim] >= need:
            return
        shape = list(like.shape)
        shape[self.dim] = max(need, 2 * (0 if self._data is None else self._data.shape[self.dim]), 64)
        data = like.new_empty(shape)
        if self._data is not None:
            data.narrow(self.dim, 0, self.length).copy_(self.view())
        self._data = data

    def append(self, x: Tensor) -> None:
        self.reserve(x.shape[self.dim], x)
        self._data.narrow(self.dim, self.length, x.shape[self.dim]).copy_(x)
        self.length += x.shape[self.dim]

    def view(self, extra: int = 0) -> Tensor:
        """The stored entries plus `extra` reserved slots after them (written by the caller)."""
        return self._data.narrow(self.dim, 0, self.length + extra)


class DSparkProposer:
    """DSpark/DFlash proposer with cached H_ctx and per-layer context keys/values (see module docstring).

    `precision` is `decode.drafter_precision` (auto | fp32 | bf16; `dspark.decoding.drafting`): the parallel
    stage's dtype. fp32 by default so that library callers get the drafter's own numbers unless they ask.
    """

    def __init__(
        self, drafter: DSparkDrafter, *, precision: str = "fp32", confidence: ConfidenceSource | None = None
    ) -> None:
        self.drafter = drafter.eval()
        self.block_size = drafter.block_size
        # `confidence` (decode.confidence): where c_k comes from; None = the head, as before sources existed
        self.confidence = confidence
        self.has_confidence = source_has_confidence(confidence, has_head=drafter.confidence_head is not None)
        self.vocab_size = drafter.spec.vocab_size
        self.stage = ParallelStage(drafter, resolve_precision(precision, drafter.backbone.mask_embedding.device))
        prepare_sequential_head(drafter, self.stage.ids)
        # the draft → target id map as Python ints: the sampling loop maps one id per slot
        self._draft_id_list = None if self.stage.ids is None else self.stage.ids.tolist()
        self._reset()

    def _reset(self) -> None:
        layers = len(self.drafter.backbone.layers)
        self._context = GrowingBuffer(dim=1)  # H_ctx [1, S, d]
        self._keys = [GrowingBuffer(dim=2) for _ in range(layers)]  # [1, H_kv, S, hd], RoPE applied
        self._values = [GrowingBuffer(dim=2) for _ in range(layers)]  # [1, H_kv, S, hd]

    @property
    def context_length(self) -> int:
        return self._context.length

    @property
    def context(self) -> Tensor:
        """The cached fused context H_ctx [1, S, d] of positions 0..S-1."""
        return self._context.view()

    @torch.no_grad()
    def start(self, *, features: Tensor, token_ids: list[int] | None = None) -> None:
        self._reset()
        self.extend(features=features, token_ids=token_ids)

    @torch.no_grad()
    def extend(self, *, features: Tensor, token_ids: list[int] | None = None) -> None:
        """Fuse the new positions once and project them to every layer's keys/values (token ids unused)."""
        backbone = self.stage.backbone
        fused = backbone.fuse_context(features)  # [1, n, d]
        start = self.context_length
        positions = torch.arange(start, start + fused.shape[1], device=fused.device)
        rope = backbone.rotary(positions.unsqueeze(0))
        for layer, keys, values in zip(backbone.layers, self._keys, self._values):
            k, v = layer.context_kv(fused, rope)
            keys.append(k)
            values.append(v)
        self._context.append(fused)

    @torch.no_grad()
    def propose(
        self,
        *,
        anchor_token: int,
        anchor_position: int,
        temperature: float,
        generator: torch.Generator | None,
        stop_ids: Collection[int],
        policy_hook: PolicyHook | None = None,
        max_drafts: int | None = None,
    ) -> Proposal:
        if anchor_position != self.context_length:
            raise ValueError(
                f"DSparkProposer: anchor at position {anchor_position} but the context holds "
                f"{self.context_length} positions; it must hold exactly the positions before the anchor"
            )
        device = self.drafter.backbone.mask_embedding.device
        start = time.perf_counter()
        hidden = self.block_hidden(anchor_token, anchor_position)  # [γ, d] float32
        # U_k only for the slots that may be drafted: a policy that verifies at most `max_drafts` never reads the rest
        # (the block forward itself stays whole: every slot attends to the whole block)
        parallel_logits = self.stage.logits(hidden[: draft_count(self.block_size, max_drafts)])  # [γ'', Vd] float32
        synchronize(device)
        middle = time.perf_counter()
        tokens, probs, confidences = self._sequential(
            hidden,
            parallel_logits,
            anchor_token=anchor_token,
            temperature=temperature,
            generator=generator,
            stop_ids=stop_ids,
            policy_hook=policy_hook,
            max_drafts=max_drafts,
        )
        synchronize(device)
        return Proposal(
            tokens, probs, confidences, seconds_parallel=middle - start, seconds_sequential=time.perf_counter() - middle
        )

    def block_hidden(self, anchor_token: int, anchor_position: int) -> Tensor:
        """h_k [γ, d] (float32) of the block [x_0, MASK×(γ−1)] at positions anchor..anchor+γ−1 over the cached
        context (one forward of γ queries; the context is never re-projected)."""
        backbone, gamma = self.stage.backbone, self.block_size
        device = backbone.mask_embedding.device
        ids = torch.full((1, 1, gamma), self.drafter.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0, 0] = anchor_token
        hidden = backbone.embed_block(ids).flatten(1, 2)  # [1, γ, d]
        positions = torch.arange(anchor_position, anchor_position + gamma, device=device)
        rope = backbone.rotary(positions.unsqueeze(0))
        for layer, keys, values in zip(backbone.layers, self._keys, self._values):
            hidden = layer.forward_cached(hidden, rope=rope, extend_kv=_spare_room(keys, values))
        return backbone.norm(hidden)[0].float()

    def _sequential(
        self,
        hidden: Tensor,
        parallel_logits: Tensor,
        *,
        anchor_token: int,
        temperature: float,
        generator: torch.Generator | None,
        stop_ids: Collection[int],
        policy_hook: PolicyHook | None,
        max_drafts: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Left-to-right sampling over the draft vocabulary: x_k from U_k + B_k(x_{k-1}); c_k before x_k (so a hook
        may stop first); a slot with unusable logits ends the proposal before it is sampled (fault guard); at most
        `max_drafts` slots.

        Lean on purpose (it runs once per slot, ~3 slots a round): token ids and confidences are kept as Python
        numbers between slots, greedy slots take value and index from one `max` (the fault guard reads the value),
        and the one-hot rows of greedy drafts are written over the target's vocabulary once, at the end — each a
        tensor op fewer per slot than the general path, with the same drafts, p_d and c_k."""
        ids = self.stage.ids
        to_target = self._draft_id_list
        prev = torch.tensor([anchor_token], device=hidden.device)
        state, tokens, probs, confidences = None, [], [], []
        source = self.confidence
        if source is not None:
            source.reset(1)
        for k in range(draft_count(self.block_size, max_drafts)):
            logits, conf_logit, state = self.drafter.sequential_step(
                hidden_k=hidden[k : k + 1], parallel_logits_k=parallel_logits[k : k + 1], prev_token=prev, state=state
            )
            if temperature == 0:
                value, index = logits.max(dim=-1)  # the fault guard's amax and the greedy draft in one reduction
                if not math.isfinite(float(value)):
                    break
            elif not bool(usable_logits(logits)):
                break
            head = None if conf_logit is None else torch.sigmoid(conf_logit.float()).reshape(1)
            if source is not None and self.has_confidence:  # c_k from q_k (never from x_k: `confidence` module)
                head = source.slot(k, head=head, top_prob=top_probability(logits, temperature))
            if head is not None:
                confidence = float(head)
                confidences.append(confidence if confidence == confidence else 0.0)  # NaN reads as 0
                if policy_hook is not None and policy_hook(torch.tensor(confidences)):
                    break
            if temperature != 0:
                index, p = _sample(logits, temperature, generator)
                probs.append(p)  # over Vd; expanded to V (zero outside the draft vocabulary) below
            draft = int(index) if to_target is None else to_target[int(index)]
            tokens.append(draft)
            if draft in stop_ids:
                break
            prev = torch.tensor([draft], device=hidden.device)
        device = hidden.device
        drafted = torch.tensor(tokens, dtype=torch.long, device=device)
        if temperature == 0:  # one-hot p_d, written straight over the target's vocabulary
            p_d = torch.zeros(len(tokens), self.vocab_size, device=device).scatter_(-1, drafted.unsqueeze(-1), 1.0)
        else:
            drafted_probs = torch.cat(probs) if probs else parallel_logits.new_zeros(0, parallel_logits.shape[-1])
            p_d = to_target_probs(drafted_probs, ids, self.vocab_size)
        conf = (
            torch.tensor(confidences[: len(tokens)], dtype=torch.float32, device=device)
            if self.has_confidence
            else None
        )
        return drafted, p_d, conf


def draft_count(block_size: int, max_drafts: int | None) -> int:
    """Slots to draft: γ, or fewer when the policy verifies at most `max_drafts`."""
    if max_drafts is None:
        return block_size
    if int(max_drafts) < 0:
        raise ValueError(f"max_drafts must be >= 0 or None, got {max_drafts}")
    return min(block_size, int(max_drafts))


def _spare_room(keys: GrowingBuffer, values: GrowingBuffer) -> ExtendKV:
    """`extend_kv` for one layer: the block's keys/values go into the buffers' spare room past the committed
    context (not committed, so the next round overwrites them) and the attended keys are a view, never a copy;
    every context position is before the anchor, so no mask is needed."""

    def extend(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        length = k.shape[2]
        for buffer, block in ((keys, k), (values, v)):
            buffer.reserve(length, block)
            buffer.view(length).narrow(2, buffer.length, length).copy_(block)
        return keys.view(length), values.view(length)

    return extend


class Eagle3Proposer:
    """EAGLE-3 chain drafting (METHOD §4) on cached step-0 keys/values.

    Position i's step-0 output needs the token after it (x_{i+1}, the training shift), so committed positions wait
    in `_pending` until the next anchor is known; each `propose` runs step 0 over the waiting positions only
    (`Eagle3Drafter.extend_context`, timed as the parallel stage), then the chain (`draft_from`, sequential).
    """

    def __init__(
        self, drafter: Eagle3Drafter, *, precision: str = "fp32", confidence: ConfidenceSource | None = None
    ) -> None:
        # no head: confidences only from a head-less source (decode.confidence=draft_max_prob | online)
        self.confidence = confidence
        self.has_confidence = source_has_confidence(confidence, has_head=False)
        self.drafter = drafter.eval()
        self.block_size = drafter.block_size
        self.vocab_size = drafter.spec.vocab_size
        self._ids = draft_to_target(drafter)
        self._draft_vocab = self.vocab_size if self._ids is None else int(self._ids.numel())
        # EAGLE-3's chain is one small layer per draft: no bf16 copy (precision is accepted for symmetry and
        # checked, but the chain stays in the drafter's dtype).
        resolve_precision(precision)
        self._reset()

    def _reset(self) -> None:
        self._context: tuple[Tensor, Tensor] | None = None  # step-0 keys/values of the positions run so far
        self._pending = GrowingBuffer(dim=1)  # features of committed positions not yet run
        self._tokens: list[int] = []  # committed tokens x_0..x_{S-1}

    @property
    def context_length(self) -> int:
        return len(self._tokens)

    def start(self, *, features: Tensor, token_ids: list[int]) -> None:
        self._reset()
        self.extend(features=features, token_ids=token_ids)

    def extend(self, *, features: Tensor, token_ids: list[int]) -> None:
        if features.shape[1] != len(token_ids):
            raise ValueError(f"Eagle3Proposer.extend: {features.shape[1]} feature rows for {len(token_ids)} tokens")
        self._pending.append(features)
        self._tokens.extend(int(t) for t in token_ids)

    @torch.no_grad()
    def step0(self, anchor_token: int, anchor_position: int) -> Tensor:
        """Run step 0 over the positions committed since the last round (the anchor is the last one's next token)
        and return the last position's step-0 output [1, 1, d]; `context` then holds every position's keys/values."""
        if anchor_position != self.context_length:
            raise ValueError(
                f"Eagle3Proposer: anchor at position {anchor_position} but the context holds "
                f"{self.context_length} positions; it must hold exactly the positions before the anchor"
            )
        pending = self._pending.view()
        cached = self.context_length - pending.shape[1]
        next_ids = torch.tensor([[*self._tokens[cached + 1 :], anchor_token]], device=pending.device)
        self._context, last = self.drafter.extend_context(self._context, features=pending, next_ids=next_ids)
        self._pending = GrowingBuffer(dim=1)
        synchronize(pending.device)
        return last

    @property
    def context(self) -> tuple[Tensor, Tensor] | None:
        """Step-0 keys/values [1, H_kv, S, hd] of the positions run so far (`step0` brings them up to date)."""
        return self._context

    @torch.no_grad()
    def propose(
        self,
        *,
        anchor_token: int,
        anchor_position: int,
        temperature: float,
        generator: torch.Generator | None,
        stop_ids: Collection[int],
        policy_hook: PolicyHook | None = None,
        max_drafts: int | None = None,
    ) -> Proposal:
        """The chain runs at most `max_drafts` steps, over the draft vocabulary; a step with unusable logits ends it
        before it (`drafting` module). EAGLE-3 has no head: with a head-less `confidence` source each step's c_k is
        read from q_k before x_k is drawn, and `policy_hook` may stop the chain there, as in DSpark's loop."""
        start = time.perf_counter()
        last = self.step0(anchor_token, anchor_position)
        device = last.device
        chain_start = time.perf_counter()
        tokens, probs, confidences = [], [], []
        count = draft_count(self.block_size, max_drafts)
        source = self.confidence if self.has_confidence else None
        if source is not None:
            source.reset(1)

        def sample(logits: Tensor) -> tuple[Tensor, Tensor]:
            if not bool(usable_logits(logits).all()):
                raise _StopChain
            if source is not None:
                top = top_probability(logits.reshape(1, -1), temperature)
                confidences.append(float(source.slot(len(tokens), head=None, top_prob=top)))
                if policy_hook is not None and policy_hook(torch.tensor(confidences)):
                    raise _StopChain  # the policy verifies no later slot: the chain stops before drawing x_k
            index, p = _sample(logits, temperature, generator)  # a draft id; the chain maps it to a target id
            tokens.append((index if self._ids is None else self._ids[index]).reshape(1))
            probs.append(p.reshape(1, -1))
            return index, p

        try:
            if count > 0:
                self.drafter.draft_from(self._context, last, num_tokens=count, sample_fn=sample, stop_ids=stop_ids)
        except _StopChain:
            pass  # the drafts before the faulty step stand (each was sampled from its own, usable p_d)
        synchronize(device)
        tokens_, probs_ = _stack_proposal(tokens, probs, self._draft_vocab, device)
        conf = (
            torch.tensor(confidences[: len(tokens)], dtype=torch.float32, device=device) if source is not None else None
        )
        return Proposal(
            tokens_,
            to_target_probs(probs_.float(), self._ids, self.vocab_size),
            conf,
            seconds_parallel=chain_start - start,
            seconds_sequential=time.perf_counter() - chain_start,
        )


class _StopChain(Exception):
    """Raised inside EAGLE-3's chain to stop it before a step: its logits define no distribution, or the policy verifies no later slot."""


def build_proposer(
    drafter: nn.Module | None, *, precision: str = "fp32", confidence: ConfidenceSource | None = None
) -> DSparkProposer | Eagle3Proposer | None:
    """The proposer of a drafter module (None → None: target-only decoding); `precision` = decode.drafter_precision,
    `confidence` = the decode.confidence source (None: the head's c_k, when the drafter has one)."""
    if drafter is None:
        return None
    if isinstance(drafter, DSparkDrafter):
        return DSparkProposer(drafter, precision=precision, confidence=confidence)
    if isinstance(drafter, Eagle3Drafter):
        return Eagle3Proposer(drafter, precision=precision, confidence=confidence)
    raise ValueError(
        f"no proposer for a {type(drafter).__name__}; expected a DSparkDrafter (dspark, dflash) or an "
        "Eagle3Drafter (eagle3), e.g. from dspark.api.load_trained_drafter"
    )
