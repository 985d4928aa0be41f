"""The one verifier: speculative rejection sampling and greedy matching (METHOD §5).

For drafts `x_1..x_ℓ` sampled from `p_d_k` and target distributions `p_t_1..p_t_{ℓ+1}` from one verify forward
over `[x_0, x_1..x_ℓ]`:

    accept x_k  with probability  min(1, p_t_k(x_k) / p_d_k(x_k))            k = 1..ℓ, stop at the first rejection
    correction  y ~ norm(max(0, p_t_k − p_d_k))   (p_t_k when that mass < 1e-12)
    bonus       y ~ p_t_{ℓ+1}                      when all ℓ drafts are accepted

so the committed tokens are distributed exactly as the target's own samples, whatever the drafter. Greedy mode
accepts while `x_k == argmax p_t_k` and takes the target's argmax as the extra token.

Random numbers. Every random choice is a comparison with, or an inverse-CDF lookup of, a float64 uniform in
[0, 1). A round with ℓ drafts uses ℓ+1 uniforms: `u[k-1]` tests slot k, `u[ℓ]` samples the extra token (whether it
is a correction or a bonus). The batched verifier draws `[R, L+1]` uniforms in one call (L = padded draft width)
and request r reads row r with the same layout, so `verify_drafts(..., uniforms=U[r, :ℓ_r+1])` reproduces request
r of `verify_drafts_batched(..., uniforms=U)` exactly.

Stop handling is not done here: if an accepted draft is a stop id, the engine truncates the round at it and
discards `next_token` (METHOD §5, "End of sequence").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

RESIDUAL_MIN_MASS = 1e-12  # below this the residual is numerically empty: fall back to p_t (p_d ≈ p_t there)


@dataclass
class VerifyResult:
    """Outcome of one verification round."""

    num_accepted: int  # A, drafts accepted (0..ℓ)
    next_token: int  # y, the target's correction (A < ℓ) or bonus (A = ℓ)
    accepted_tokens: Tensor  # [A] long, x_1..x_A

    @property
    def tokens(self) -> list[int]:
        """Committed tokens of the round before stop handling: x_1..x_A then y (τ = A + 1)."""
        return [*self.accepted_tokens.tolist(), self.next_token]


@dataclass
class BatchVerifyResult:
    """Outcome of R verification rounds verified together (shape symbols: R requests, L padded draft width)."""

    num_accepted: Tensor  # [R] long, A_r
    next_tokens: Tensor  # [R] long, y_r
    draft_tokens: Tensor  # [R, L] long, the padded drafts; x_{r,1..A_r} are the accepted ones

    def accepted_tokens(self, r: int) -> Tensor:
        """[A_r] long, the accepted drafts of request r."""
        return self.draft_tokens[r, : int(self.num_accepted[r])]

    def unbatch(self) -> list[VerifyResult]:
        """One `VerifyResult` per request."""
        return [
            VerifyResult(int(self.num_accepted[r]), int(self.next_tokens[r]), self.accepted_tokens(r))
            for r in range(self.num_accepted.shape[0])
        ]


def probs_from_logits(logits: Tensor, temperature: float) -> Tensor:
    """[..., V] logits → [..., V] float32 probabilities; temperature 0 gives the one-hot argmax (greedy)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 selects greedy decoding), got {temperature}")
    if temperature == 0:
        index = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, index, 1.0)
    return torch.softmax(logits.float() / temperature, dim=-1)


def draw_uniforms(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> Tensor:
    """float64 uniforms in [0, 1) drawn on the generator's device, then moved to `device`."""
    return torch.rand(shape, generator=generator, device=generator.device, dtype=torch.float64).to(device)


def sample_from_probs(
    probs: Tensor, generator: torch.Generator | None = None, *, uniforms: Tensor | None = None, trusted: bool = False
) -> Tensor:
    """Sample one index per row of `probs` [..., V] (non-negative, need not sum to 1) → [...] long.

    Inverse CDF in float64 with one uniform per row (`uniforms` [...] if given, else drawn from `generator`);
    indices of zero weight are never returned, even when rounding puts the uniform at the top of the CDF.
    `trusted=True` (the verifier's and proposers' own rows: softmax outputs and clamped residuals, non-negative by
    construction) skips the per-element sign check, a full pass over V per call; positive, finite mass is still
    checked. The index drawn is the same either way.
    """
    if uniforms is None:
        if generator is None:
            raise ValueError("sample_from_probs needs a torch.Generator or pre-drawn uniforms")
        uniforms = draw_uniforms(tuple(probs.shape[:-1]), generator, probs.device)
    weights = probs.to(torch.float64)
    cdf = weights.cumsum(-1)
    total = cdf[..., -1]
    # One host sync for both checks (total mass ≤ 0 or NaN, any negative weight): this runs once per drafted slot.
    invalid = (total <= 0) | total.isnan()
    if not trusted:
        invalid = invalid | (weights.amin(-1) < 0)
    if bool(invalid.any()):
        raise ValueError("sample_from_probs: every row needs non-negative weights with positive mass")
    target = (uniforms.to(torch.float64) * total).unsqueeze(-1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # searchsorted(right=True) lands on an index of positive weight unless x·total rounds up to total itself (index
    # V, or past the last positive weight): only then clamp to the last index that has weight.
    index = index.clamp_(max=weights.shape[-1] - 1)
    if bool((weights.gather(-1, index.unsqueeze(-1)).squeeze(-1) <= 0).any()):
        positions = torch.arange(weights.shape[-1], device=weights.device)
        last_positive = torch.where(weights > 0, positions, -1).amax(-1)
        index = torch.minimum(index, last_positive)
    return index


def _extra_token_weights(target_row: Tensor, draft_row: Tensor | None) -> Tensor:
    """Weights of the extra token: residual max(0, p_t − p_d) after a rejection, else p_t (rows [..., V]), float64.
    The residual is formed in place in one float64 copy of p_t (float32 p_d widens exactly, so the values are those
    of p_t64 − p_d64); p_t is re-read only for rows whose residual is empty."""
    weights = target_row.to(torch.float64, copy=True)
    if draft_row is None:
        return weights
    weights.sub_(draft_row).clamp_min_(0.0)
    empty = weights.sum(-1, keepdim=True) < RESIDUAL_MIN_MASS
    return torch.where(empty, target_row.to(torch.float64), weights) if bool(empty.any()) else weights


def _check_single(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_rows: Tensor,
    *,
    caller: str = "verify_drafts",
    rows_name: str = "target_probs",
) -> int:
    """ℓ after checking draft_tokens [ℓ], draft_probs [ℓ, V] and the target's rows [ℓ+1, V] (probabilities or
    logits); errors name the caller and its argument."""
    length = draft_tokens.shape[0] if draft_tokens.dim() == 1 else -1
    if length < 0 or target_rows.dim() != 2 or target_rows.shape[0] != length + 1:
        raise ValueError(
            f"{caller}: expected draft_tokens [ℓ] and {rows_name} [ℓ+1, V], got "
            f"{tuple(draft_tokens.shape)} and {tuple(target_rows.shape)}"
        )
    if tuple(draft_probs.shape) != (length, target_rows.shape[1]):
        raise ValueError(
            f"{caller}: draft_probs must be [ℓ, V] = {(length, target_rows.shape[1])}, got {tuple(draft_probs.shape)}"
        )
    return length


def _greedy_result(best: list[int], draft_tokens: Tensor) -> VerifyResult:
    """Greedy verification from the target's argmax per slot `best` [ℓ+1]: accept while x_k == best[k]."""
    length = draft_tokens.shape[0]
    accepted = next((k for k, token in enumerate(draft_tokens.tolist()) if token != best[k]), length)
    return VerifyResult(accepted, best[accepted], draft_tokens[:accepted])


def _single_uniforms(
    uniforms: Tensor | None, generator: torch.Generator | None, *, length: int, device: torch.device, caller: str
) -> Tensor:
    """The round's ℓ+1 float64 uniforms (module docstring layout): the given ones, checked, or drawn."""
    if uniforms is None:
        if generator is None:
            raise ValueError(f"{caller}: sampling mode needs a torch.Generator or pre-drawn uniforms")
        uniforms = draw_uniforms((length + 1,), generator, device)
    uniforms = uniforms.to(device=device, dtype=torch.float64)
    if tuple(uniforms.shape) != (length + 1,):
        raise ValueError(f"{caller}: uniforms must be [ℓ+1] = {(length + 1,)}, got {tuple(uniforms.shape)}")
    return uniforms


def verify_drafts(
    *,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    uniforms: Tensor | None = None,
) -> VerifyResult:
    """Verify one request's drafts (METHOD §5).

    draft_tokens [ℓ] long (ℓ = 0 allowed); draft_probs [ℓ, V] the draft distribution each x_k was sampled from, at
    the sampling temperature; target_probs [ℓ+1, V] the target's distributions for slots 1..ℓ+1 at the same
    temperature. `uniforms` [ℓ+1] (layout in the module docstring) replaces draws from `generator`. In greedy mode
    draft_probs and the random numbers are unused.
    """
    length = _check_single(draft_tokens, draft_probs, target_probs)
    if greedy:
        return _greedy_result(target_probs.argmax(-1).tolist(), draft_tokens)  # one reduction, one host sync
    uniforms = _single_uniforms(uniforms, generator, length=length, device=target_probs.device, caller="verify_drafts")
    # every slot's test at once (the batched verifier's float64 arithmetic); A = the leading run of passes
    passed = _rejection_tests(
        draft_tokens.unsqueeze(0),
        draft_probs.unsqueeze(0),
        target_probs[:length].unsqueeze(0),
        uniforms[:length].unsqueeze(0),
    )[0].tolist()
    accepted = next((k for k, ok in enumerate(passed) if not ok), length)
    weights = _extra_token_weights(target_probs[accepted], draft_probs[accepted] if accepted < length else None)
    next_token = sample_from_probs(weights, uniforms=uniforms[length], trusted=True)
    return VerifyResult(accepted, int(next_token), draft_tokens[:accepted])


def verify_drafts_from_logits(
    *,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_logits: Tensor,
    temperature: float,
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,
) -> VerifyResult:
    """`verify_drafts(target_probs=probs_from_logits(target_logits, temperature), ...)`, the same result for the
    same random numbers, computing p_t only for the rows the verifier reads.

    target_logits [ℓ+1, V]: the target's logits for slots 1..ℓ+1. Why: slot k's p_t row is read only when slots
    1..k−1 were accepted, so with τ ≈ 1.5 a round needs ~1.5 of its ℓ+1 softmaxes over V (each a full pass with an
    exp per entry; at ℓ = 7 the whole [8, V] softmax was the verifier's largest cost on a CPU). Greedy mode takes
    the argmax of the logits (that of the one-hot p_t). Uniforms: the module docstring's layout, drawn up front.
    """
    caller = "verify_drafts_from_logits"
    length = _check_single(draft_tokens, draft_probs, target_logits, caller=caller, rows_name="target_logits")
    if temperature == 0:
        return _greedy_result(target_logits.argmax(-1).tolist(), draft_tokens)
    uniforms = _single_uniforms(uniforms, generator, length=length, device=target_logits.device, caller=caller)
    tokens, thresholds = (
        draft_tokens.tolist(),
        (uniforms[:length] * draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1).to(torch.float64)).tolist(),
    )  # u_k · p_d(x_k), as in the tests
    for k in range(length + 1):
        row = probs_from_logits(target_logits[k : k + 1], temperature)[0]  # [V], the row verify_drafts would read
        if k == length:
            next_token = sample_from_probs(_extra_token_weights(row, None), uniforms=uniforms[length], trusted=True)
            return VerifyResult(length, int(next_token), draft_tokens)
        if not thresholds[k] < float(row[tokens[k]]):  # float32 p_t widens exactly: _rejection_tests' comparison
            weights = _extra_token_weights(row, draft_probs[k])
            next_token = sample_from_probs(weights, uniforms=uniforms[length], trusted=True)
            return VerifyResult(k, int(next_token), draft_tokens[:k])
    raise AssertionError("unreachable")


def _check_batched(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, lengths: Tensor) -> None:
    if draft_tokens.dim() != 2 or target_probs.dim() != 3:
        raise ValueError(
            "verify_drafts_batched: expected draft_tokens [R, L] and target_probs [R, L+1, V], got "
            f"{tuple(draft_tokens.shape)} and {tuple(target_probs.shape)}"
        )
    num_requests, width = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if tuple(target_probs.shape) != (num_requests, width + 1, vocab):
        raise ValueError(
            f"verify_drafts_batched: target_probs must be [R, L+1, V] = {(num_requests, width + 1, vocab)}"
            f", got {tuple(target_probs.shape)}"
        )
    if tuple(draft_probs.shape) != (num_requests, width, vocab):
        raise ValueError(
            f"verify_drafts_batched: draft_probs must be [R, L, V] = {(num_requests, width, vocab)}, "
            f"got {tuple(draft_probs.shape)}"
        )
    if tuple(lengths.shape) != (num_requests,) or bool((lengths < 0).any()) or bool((lengths > width).any()):
        raise ValueError(f"verify_drafts_batched: lengths must be [R] with 0 <= ℓ_r <= L = {width}, got {lengths}")


def _rejection_tests(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, uniforms: Tensor) -> Tensor:
    """[R, L] bool: u · p_d(x) < p_t(x) per slot (same float64 arithmetic as the single verifier)."""
    index = draft_tokens.unsqueeze(-1)
    p_draft = draft_probs.gather(-1, index).squeeze(-1).to(torch.float64)
    p_target = target_probs.gather(-1, index).squeeze(-1).to(torch.float64)
    return uniforms * p_draft < p_target


def verify_drafts_batched(
    *,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    lengths: Tensor,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    uniforms: Tensor | None = None,
) -> BatchVerifyResult:
    """Verify R requests at once, vectorised over requests and slots (METHOD §5).

    draft_tokens [R, L] long, draft_probs [R, L, V], target_probs [R, L+1, V], right-padded to the largest ℓ_r;
    lengths [R] long holds ℓ_r (padding is never read as a draft). `uniforms` [R, L+1] (module docstring layout)
    replaces one draw of that shape from `generator`; request r then equals
    `verify_drafts(..., uniforms=uniforms[r, :ℓ_r+1])`.
    """
    _check_batched(draft_tokens, draft_probs, target_probs, lengths)
    num_requests, width = draft_tokens.shape
    lengths = lengths.to(draft_tokens.device)
    rows = torch.arange(num_requests, device=draft_tokens.device)
    in_range = torch.arange(width, device=draft_tokens.device).unsqueeze(0) < lengths.unsqueeze(1)
    if greedy:
        passed = draft_tokens == target_probs[:, :width].argmax(-1)
    else:
        if uniforms is None:
            if generator is None:
                raise ValueError("verify_drafts_batched: sampling mode needs a torch.Generator or pre-drawn uniforms")
            uniforms = draw_uniforms((num_requests, width + 1), generator, target_probs.device)
        uniforms = uniforms.to(device=target_probs.device, dtype=torch.float64)
        if tuple(uniforms.shape) != (num_requests, width + 1):
            raise ValueError(
                f"verify_drafts_batched: uniforms must be [R, L+1] = {(num_requests, width + 1)}, "
                f"got {tuple(uniforms.shape)}"
            )
        passed = _rejection_tests(draft_tokens, draft_probs, target_probs[:, :width], uniforms[:, :width])
    # A_r = length of the leading run of accepted slots.
    accepted = (passed & in_range).to(torch.long).cumprod(dim=1).sum(dim=1)
    target_rows = target_probs[rows, accepted]
    if greedy:
        return BatchVerifyResult(accepted, target_rows.argmax(-1), draft_tokens)
    rejected = (accepted < lengths).unsqueeze(-1)
    draft_rows = draft_probs[rows, accepted.clamp(max=max(width - 1, 0))] if width > 0 else target_rows
    weights = torch.where(rejected, _extra_token_weights(target_rows, draft_rows), target_rows.to(torch.float64))
    next_tokens = sample_from_probs(weights, uniforms=uniforms[rows, lengths], trusted=True)
    return BatchVerifyResult(accepted, next_tokens, draft_tokens)
