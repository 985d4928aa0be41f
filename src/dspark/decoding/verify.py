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

Block verification (`decode.verifier=block`, `serve.verifier=block`; Sun et al. 2024, arXiv 2403.10444, their
Algorithm 2, written from the paper's equations). The block is verified jointly instead of slot by slot. With
q_i = p_d_i(x_i) and p_i = p_t_i(x_i), the weights

    w_0 = 1,    w_i = min(1, w_{i-1} · p_i / q_i)                                          i = 1..ℓ
    r_i = Σ_v max(0, w_i · p_t_{i+1}(v) − p_d_{i+1}(v))                                    i = 0..ℓ-1
    h_i = r_i / (r_i + 1 − w_i)   (1 when w_i = 1),    h_ℓ = w_ℓ

give τ = the largest i ∈ 1..ℓ with u[i-1] < h_i (0 when there is none): x_1..x_τ are accepted, and the extra token is
a bonus y ~ p_t_{ℓ+1} when τ = ℓ, else y ~ norm(max(0, w_τ · p_t_{τ+1} − p_d_{τ+1})) (p_t_{τ+1} when that mass
< 1e-12). At τ = 0 (w_0 = 1) the correction is token verification's residual, and at ℓ = 1 the two verifiers
coincide. Unlike the token verifier, x_1's fate depends on the drafts after it, so every p_t row 1..ℓ+1 is formed.
What it buys: given the accepted-so-far prefix x_1..x_i, the block verifier keeps it with probability exactly w_i
(`block_survival`; tests/test_block_verify.py checks this by exact enumeration), and w_i ≥ Π_{k≤i} min(1, p_k/q_k),
token verification's keep probability — so E[τ] is never smaller than token verification's, in expectation over the
drafts, for every length rule below (the paper proves the fixed-ℓ case). For one particular draft block it can be
smaller: the gain is not per block. Uniforms: the same layout as the token verifier (u[i-1] decides η_i, u[ℓ] the
extra token), so the same draws feed either verifier and `verify_block_batched` row r equals `verify_block` on row r.

Why block verification stays exact when ℓ depends on the drafts. A policy chooses ℓ after drafting, from confidences
c_k that depend on x_<k (METHOD §6): "ℓ ≥ k" is decided from x_<k alone — a stopping time of the draft sequence. The
paper's theorem is for a fixed length γ and any autoregressive drafter. Run that fixed-γ verifier on a modified
drafter that, once the rule has stopped at ℓ, drafts slots ℓ+1..γ from p_t itself (still autoregressive: the switch
is decided by x_<ℓ+1). On those slots p_i/q_i = 1, so w_i = w_ℓ, r_i = 0 and h_i = 0 for ℓ ≤ i < γ (w_ℓ < 1;
at w_ℓ = 1 both rounds accept every slot), and h_γ = w_ℓ:
the fixed-γ round accepts past ℓ exactly when the length-ℓ round has τ = ℓ (probability w_ℓ), and then commits
x_1..x_ℓ followed by target samples — what the length-ℓ round's bonus and the next rounds produce. Below ℓ both
rounds use the same h_i and residuals. So the length-ℓ verifier's output, continued by the target, has the law of
the fixed-γ verifier's on a valid drafter: the target's. The same argument fails when "ℓ ≥ k" reads x_k itself (the
scheduler's global argmax, paper Appendix A): the modified drafter would have to know x_k before deciding how to
sample it. Greedy mode (T = 0) is token verification's greedy matching for both verifiers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dspark.registry import Registry, unknown_name_message

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


def _extra_token_weights(target_row: Tensor, draft_row: Tensor | None, scale: Tensor | None = None) -> Tensor:
    """Weights of the extra token: residual max(0, p_t − p_d) after a rejection, else p_t (rows [..., V]), float64.
    The residual is formed in place in one float64 copy of p_t (float32 p_d widens exactly, so the values are those
    of p_t64 − p_d64); p_t is re-read only for rows whose residual is empty. `scale` [..., 1] float64: the block
    verifier's residual max(0, w·p_t − p_d) (module docstring); None leaves p_t as it is (token verification)."""
    weights = target_row.to(torch.float64, copy=True)
    if draft_row is None:
        return weights
    if scale is not None:
        weights.mul_(scale)
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


def _check_batched(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    lengths: Tensor,
    *,
    caller: str = "verify_drafts_batched",
) -> None:
    if draft_tokens.dim() != 2 or target_probs.dim() != 3:
        raise ValueError(
            f"{caller}: expected draft_tokens [R, L] and target_probs [R, L+1, V], got "
            f"{tuple(draft_tokens.shape)} and {tuple(target_probs.shape)}"
        )
    num_requests, width = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if tuple(target_probs.shape) != (num_requests, width + 1, vocab):
        raise ValueError(
            f"{caller}: target_probs must be [R, L+1, V] = {(num_requests, width + 1, vocab)}"
            f", got {tuple(target_probs.shape)}"
        )
    if tuple(draft_probs.shape) != (num_requests, width, vocab):
        raise ValueError(
            f"{caller}: draft_probs must be [R, L, V] = {(num_requests, width, vocab)}, got {tuple(draft_probs.shape)}"
        )
    if tuple(lengths.shape) != (num_requests,) or bool((lengths < 0).any()) or bool((lengths > width).any()):
        raise ValueError(f"{caller}: lengths must be [R] with 0 <= ℓ_r <= L = {width}, got {lengths}")


def _batched_uniforms(
    uniforms: Tensor | None,
    generator: torch.Generator | None,
    *,
    shape: tuple[int, int],
    device: torch.device,
    caller: str,
) -> Tensor:
    """The step's [R, L+1] float64 uniforms (module docstring layout): the given ones, checked, or one draw."""
    if uniforms is None:
        if generator is None:
            raise ValueError(f"{caller}: sampling mode needs a torch.Generator or pre-drawn uniforms")
        uniforms = draw_uniforms(shape, generator, device)
    uniforms = uniforms.to(device=device, dtype=torch.float64)
    if tuple(uniforms.shape) != shape:
        raise ValueError(f"{caller}: uniforms must be [R, L+1] = {shape}, got {tuple(uniforms.shape)}")
    return uniforms


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
        uniforms = _batched_uniforms(
            uniforms,
            generator,
            shape=(num_requests, width + 1),
            device=target_probs.device,
            caller="verify_drafts_batched",
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


# ---- block verification (module docstring) ----


def _block_weights(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor) -> Tensor:
    """w [R, L+1] float64: w_0 = 1, w_i = min(1, w_{i-1}·p_i/q_i) for every padded slot (rows read past ℓ_r are
    ignored by the callers). A draft the target forbids (p_i = 0) gives w_i = 0 even where q_i = 0, as the token
    verifier rejects it; q_i = 0 < p_i gives 1 (an infinite ratio)."""
    index = draft_tokens.unsqueeze(-1)
    q = draft_probs.gather(-1, index).squeeze(-1).to(torch.float64)  # [R, L]
    p = target_probs[:, : draft_tokens.shape[1]].gather(-1, index).squeeze(-1).to(torch.float64)
    columns = [torch.ones(draft_tokens.shape[0], dtype=torch.float64, device=draft_tokens.device)]
    for i in range(draft_tokens.shape[1]):  # a running min(1, ·): L ≤ γ small steps over [R]
        kept = columns[-1] * p[:, i]
        ratio = kept / q[:, i].clamp_min(torch.finfo(torch.float64).tiny)
        columns.append(torch.where(kept >= q[:, i], (kept > 0).to(torch.float64), ratio))
    return torch.stack(columns, dim=1)


def _block_tau(weights: Tensor, draft_probs: Tensor, target_probs: Tensor, lengths: Tensor, uniforms: Tensor) -> Tensor:
    """τ [R] long: the largest i ∈ 1..ℓ_r with u[i-1] < h_i, else 0 (module docstring), from w [R, L+1].

    Why this shape: the test of i = ℓ (h_ℓ = w_ℓ) needs no sum over V, and when it passes τ = ℓ whatever the others
    say, so the residual masses r_1..r_{ℓ-1} — a float64 pass over ℓ-1 rows of V each, the block verifier's main
    cost — are formed only for the rows whose last test failed (none, in a round that keeps the whole block).
    """
    num_requests, width = draft_probs.shape[:2]
    rows = torch.arange(num_requests, device=lengths.device)
    last = (lengths - 1).clamp(min=0)
    kept_all = (lengths > 0) & (uniforms[rows, last] < weights[rows, lengths])  # η_ℓ = 1
    tau = torch.where(kept_all, lengths, torch.zeros_like(lengths))
    need = ~kept_all & (lengths > 1)
    if not bool(need.any()):
        return tau
    sel = need.nonzero().squeeze(-1)
    everyone = sel.shape[0] == num_requests  # slices (views) instead of gathered copies of [·, L-1, V]
    targets, drafts = (target_probs, draft_probs) if everyone else (target_probs[sel], draft_probs[sel])
    scale = weights[sel, 1:width]  # w_1..w_{L-1}
    # r_i = Σ_v max(0, w_i·p_t_{i+1} − p_d_{i+1}), i = 1..L-1: the product lands in one float64 buffer (float32 rows
    # widen exactly), then in place
    residual = torch.mul(targets[:, 1:width], scale.unsqueeze(-1))
    residual.sub_(drafts[:, 1:width]).clamp_min_(0.0)
    mass = residual.sum(-1)
    # h_i = r_i / (r_i + 1 − w_i), and 1 where w_i = 1 (the prefix is kept for sure)
    h = torch.where(scale >= 1.0, 1.0, mass / (mass + 1.0 - scale).clamp_min(1e-300))
    slots = torch.arange(1, width, device=lengths.device).unsqueeze(0)  # i = 1..L-1
    passed = (uniforms[sel, : width - 1] < h) & (slots < lengths[sel].unsqueeze(1))
    tau[sel] = (passed.to(torch.long) * slots).amax(dim=1)
    return tau


def _verify_block_rows(
    draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, lengths: Tensor, uniforms: Tensor
) -> tuple[Tensor, Tensor]:
    """(τ [R], y [R]) of block verification on checked, padded inputs and [R, L+1] float64 uniforms."""
    num_requests, width = draft_tokens.shape
    rows = torch.arange(num_requests, device=draft_tokens.device)
    weights = _block_weights(draft_tokens, draft_probs, target_probs)
    accepted = _block_tau(weights, draft_probs, target_probs, lengths, uniforms)
    target_rows = target_probs[rows, accepted]
    draft_rows = draft_probs[rows, accepted.clamp(max=max(width - 1, 0))] if width > 0 else target_rows
    residual = _extra_token_weights(target_rows, draft_rows, weights[rows, accepted].unsqueeze(-1))
    bonus = (accepted == lengths).unsqueeze(-1)
    weights_y = torch.where(bonus, target_rows.to(torch.float64), residual)
    return accepted, sample_from_probs(weights_y, uniforms=uniforms[rows, lengths], trusted=True)


def block_survival(*, draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor) -> Tensor:
    """[ℓ+1] float64 w_0..w_ℓ of one block (draft_tokens [ℓ], draft_probs [ℓ, V], target_probs [ℓ+1, V]): under block
    verification P(τ ≥ i | x_1..x_i) = w_i, whatever is drafted after x_i (token verification: Π_{k≤i} min(1, p/q))."""
    _check_single(draft_tokens, draft_probs, target_probs, caller="block_survival")
    return _block_weights(draft_tokens.unsqueeze(0), draft_probs.unsqueeze(0), target_probs.unsqueeze(0))[0]


def verify_block(
    *,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    uniforms: Tensor | None = None,
) -> VerifyResult:
    """Block verification of one request's drafts (module docstring); the arguments are `verify_drafts`'.

    draft_tokens [ℓ] long, draft_probs [ℓ, V], target_probs [ℓ+1, V] at the sampling temperature; `uniforms` [ℓ+1]
    (the token verifier's layout) replaces draws from `generator`. Greedy mode is `verify_drafts`' greedy matching.
    """
    length = _check_single(draft_tokens, draft_probs, target_probs, caller="verify_block")
    if greedy:
        return _greedy_result(target_probs.argmax(-1).tolist(), draft_tokens)
    uniforms = _single_uniforms(uniforms, generator, length=length, device=target_probs.device, caller="verify_block")
    accepted, next_token = _verify_block_rows(
        draft_tokens.unsqueeze(0),
        draft_probs.unsqueeze(0),
        target_probs.unsqueeze(0),
        torch.tensor([length], device=draft_tokens.device),
        uniforms.unsqueeze(0),
    )
    count = int(accepted[0])
    return VerifyResult(count, int(next_token[0]), draft_tokens[:count])


def verify_block_from_logits(
    *,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_logits: Tensor,
    temperature: float,
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,
) -> VerifyResult:
    """`verify_block(target_probs=probs_from_logits(target_logits, temperature), ...)`: the engines' entry point,
    with `verify_drafts_from_logits`' arguments. Every p_t row is formed (x_1's fate depends on the later rows);
    temperature 0 is greedy matching on the logits; the ℓ+1 uniforms are drawn up front, as the token verifier's."""
    caller = "verify_block_from_logits"
    length = _check_single(draft_tokens, draft_probs, target_logits, caller=caller, rows_name="target_logits")
    if temperature == 0:
        return _greedy_result(target_logits.argmax(-1).tolist(), draft_tokens)
    uniforms = _single_uniforms(uniforms, generator, length=length, device=target_logits.device, caller=caller)
    return verify_block(
        draft_tokens=draft_tokens,
        draft_probs=draft_probs,
        target_probs=probs_from_logits(target_logits, temperature),
        uniforms=uniforms,
    )


def verify_block_batched(
    *,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    lengths: Tensor,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    uniforms: Tensor | None = None,
) -> BatchVerifyResult:
    """Block verification of R requests at once; the arguments and shapes are `verify_drafts_batched`'. Row r with
    `uniforms` [R, L+1] equals `verify_block(..., uniforms=uniforms[r, :ℓ_r+1])` (padding is never read: slots past
    ℓ_r get h = 0 and their weights are not used). Greedy mode is the token verifier's greedy matching."""
    caller = "verify_block_batched"
    _check_batched(draft_tokens, draft_probs, target_probs, lengths, caller=caller)
    if greedy:
        return verify_drafts_batched(
            draft_tokens=draft_tokens, draft_probs=draft_probs, target_probs=target_probs, lengths=lengths, greedy=True
        )
    num_requests, width = draft_tokens.shape
    lengths = lengths.to(draft_tokens.device)
    uniforms = _batched_uniforms(
        uniforms, generator, shape=(num_requests, width + 1), device=target_probs.device, caller=caller
    )
    accepted, next_tokens = _verify_block_rows(draft_tokens, draft_probs, target_probs, lengths, uniforms)
    return BatchVerifyResult(accepted, next_tokens, draft_tokens)


@dataclass(frozen=True)
class Verifier:
    """One lossless verifier under its `decode.verifier` / `serve.verifier` name: the same three entry points, the
    same arguments and the same uniforms layout for each."""

    name: str
    verify: Callable[..., VerifyResult]  # `verify_drafts`' arguments (target probabilities)
    from_logits: Callable[..., VerifyResult]  # `verify_drafts_from_logits`' arguments (the engines')
    batched: Callable[..., BatchVerifyResult]  # `verify_drafts_batched`' arguments


VERIFIERS: Registry[Verifier] = Registry("decode.verifier / serve.verifier")
VERIFIERS.add("token", Verifier("token", verify_drafts, verify_drafts_from_logits, verify_drafts_batched))
VERIFIERS.add("block", Verifier("block", verify_block, verify_block_from_logits, verify_block_batched))


def resolve_verifier(name: str, *, key: str = "decode") -> Verifier:
    """The verifier named by `<key>.verifier`; the error lists the names."""
    if name not in VERIFIERS:
        raise ValueError(unknown_name_message(f"{key}.verifier", name, VERIFIERS.names()))
    return VERIFIERS.resolve(name)
