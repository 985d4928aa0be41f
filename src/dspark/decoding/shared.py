"""What the single-request engine (`dspark.decoding.engine`) and the batched serving engine (`dspark.serving.engine`)
share, so that the two mean the same thing (METHOD §5–§6): argument and prompt checks, the first token after the
prompt, the commit rule with its EOS handling, stop reasons, the policy's confidence check and the one place where
confidences are calibrated for a policy (also inside the proposers' drafting stop, `drafting_hook`)."""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import Tensor

from dspark.calibration.sts import STSCalibration
from dspark.decoding.policies import VerificationPolicy, calibrate_confidences, policy_confidences
from dspark.decoding.verify import VerifyResult, verify_drafts

STOP_EOS, STOP_MAX_NEW_TOKENS, STOP_REJECTED = "eos", "max_new_tokens", "rejected"


def check_temperature(temperature: float, key: str) -> float:
    if temperature < 0:
        raise ValueError(f"{key}.temperature={temperature} must be >= 0 (0 = greedy verification)")
    return float(temperature)


def check_max_new_tokens(max_new_tokens: int, key: str) -> int:
    if int(max_new_tokens) < 1:
        raise ValueError(f"{key}.max_new_tokens={max_new_tokens} must be >= 1")
    return int(max_new_tokens)


def prompt_error(
    prompt_ids: list[int], *, limit: int, vocab_size: int, max_positions: int | None, key: str
) -> str | None:
    """Why this prompt cannot be decoded with `limit` new tokens (None when it can)."""
    if not prompt_ids:
        return "the prompt is empty: give at least one token (e.g. the chat-templated user turn)"
    if limit < 1:
        return f"{key}.max_new_tokens={limit} must be >= 1"
    if any(not 0 <= int(t) < vocab_size for t in prompt_ids):
        return f"the prompt has token ids outside the target vocabulary [0, {vocab_size})"
    if max_positions is not None and len(prompt_ids) + limit > max_positions:
        return (
            f"prompt of {len(prompt_ids)} tokens + {key}.max_new_tokens={limit} exceeds the target's context "
            f"of {max_positions} positions (max_position_embeddings); shorten the prompt or lower "
            f"{key}.max_new_tokens"
        )
    return None


def check_policy_drafter(policy: VerificationPolicy | None, *, has_confidence: bool, key: str) -> None:
    """A policy that reads confidences needs a drafter with a confidence head (refused before any work)."""
    if policy is not None and getattr(policy, "needs_confidences", False) and not has_confidence:
        raise ValueError(
            f"{key}.policy={getattr(policy, 'name', policy)} needs c_k: a drafter with a confidence head "
            f"(drafter=dspark) or a head-less confidence source ({key}.confidence=draft_max_prob or online); "
            f"otherwise use {key}.policy=fixed, mtp1 or static"
        )


def check_calibrated_input(policy: VerificationPolicy | None, calibration: STSCalibration | None, *, key: str) -> None:
    """`calibrated_threshold` without a calibration would silently compare raw c_k with θ: refused. The planning
    policies (scheduler, async) also read c̃_k but may run on raw c_k as an ablation; the stages state it loudly."""
    if calibration is None and getattr(policy, "name", None) == "calibrated_threshold":
        raise ValueError(
            f"{key}.policy=calibrated_threshold reads STS-calibrated c̃_k but no calibration was given; fit one "
            f"(decode.calibrate=true) or use {key}.policy=threshold for raw c_k"
        )


def check_calibration(calibration: STSCalibration | None, *, block_size: int | None) -> None:
    if calibration is not None and block_size is not None and len(calibration.temperatures) != block_size:
        raise ValueError(
            f"the STS calibration was fitted for block_size={len(calibration.temperatures)} but the "
            f"drafter has block_size={block_size}; refit the calibration for this drafter"
        )


def sample_first(target_probs: Tensor, generator: torch.Generator | None, *, greedy: bool) -> int:
    """The token after the prompt from p_t [1, V], through the verifier with no drafts (one uniform; argmax when
    greedy) — not a round."""
    no_drafts = torch.zeros(0, dtype=torch.long, device=target_probs.device)
    return verify_drafts(
        draft_tokens=no_drafts,
        draft_probs=target_probs.new_zeros(0, target_probs.shape[-1]),
        target_probs=target_probs,
        generator=generator,
        greedy=greedy,
    ).next_token


def commit_verified(result: VerifyResult, stop_ids: Collection[int]) -> tuple[list[int], list[int], int | None]:
    """(accepted drafts, committed tokens, extra token or None) of one verified round (METHOD §5's EOS rule): an
    accepted stop id ends the round at it, with no extra token."""
    accepted = result.accepted_tokens.tolist()
    for k, token in enumerate(accepted):
        if token in stop_ids:
            return accepted[: k + 1], accepted[: k + 1], None
    return accepted, [*accepted, result.next_token], result.next_token


def is_done(extra: int | None, *, stop_ids: Collection[int], committed: int, limit: int) -> bool:
    """Generation ends at an accepted stop id (no extra token), a stop id as extra token, or max_new_tokens."""
    return extra is None or extra in stop_ids or committed >= limit


def stop_reason(new_tokens: list[int], stop_ids: Collection[int]) -> str:
    """ "eos" when the (truncated) output ends at a stop id, else "max_new_tokens"."""
    return STOP_EOS if new_tokens and new_tokens[-1] in stop_ids else STOP_MAX_NEW_TOKENS


def step_confidences(
    policy: VerificationPolicy | None,
    raw: Tensor | None,
    calibration: STSCalibration | None,
) -> tuple[Tensor | None, Tensor | None]:
    """(calibrated c̃ or None, what the policy reads) for raw confidences [R, γ'] (or [γ']): the engines' one
    calibration point, before the policy (`policies.policy_confidences`)."""
    if raw is None:
        return None, None
    raw = raw.float()
    calibrated = None if calibration is None else calibrate_confidences(calibration, raw)
    return calibrated, policy_confidences(policy, raw=raw, calibrated=calibrated)


def drafting_hook(
    policy: VerificationPolicy | None, calibration: STSCalibration | None
) -> Callable[[Tensor], bool] | None:
    """The policy's `stop_drafting` as the proposers call it, on raw c [k] / [R, k] (None when the policy has no
    drafting stop): calibrated first when the policy reads calibrated confidences, as `step_confidences` does."""
    stop = getattr(policy, "stop_drafting", None)
    if stop is None:
        return None
    if getattr(policy, "reads", "raw") == "calibrated" and calibration is not None:

        def calibrated_stop(confidences: Tensor) -> bool:
            if confidences.dim() == 1:  # one request, before every slot it drafts: plain floats (`apply_row`)
                row = calibration.apply_row(confidences.tolist())
                return stop(torch.tensor(row, dtype=torch.float64))
            return stop(calibrate_confidences(calibration, confidences.float()))

        return calibrated_stop
    return stop


def draft_limit(policy: VerificationPolicy | None) -> int | None:
    """The policy's `max_drafts` (no later slot is ever verified), None when every slot may be."""
    return getattr(policy, "max_drafts", None)
