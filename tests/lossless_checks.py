"""Shared checks of the lossless-decoding tests (tests/test_lossless.py, tests/test_serving_lossless.py).

Randomised probability integral transform: for a token x drawn from p (tokens ordered by p), u = F(x⁻) + V·p(x) with
V ~ U(0, 1) is exactly U(0, 1), independently across samples, when x ~ p. A 10-bin chi-square on the u's then tests
that generated tokens follow the target's own conditionals.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from dspark.decoding.verify import VerifyResult, draw_uniforms, probs_from_logits, sample_from_probs


def pit_values(target, prompt, sequences, rng: np.random.Generator) -> list[np.ndarray]:
    """Randomised PIT of every generated token under the exact target conditionals; one array per position."""
    length = max(len(s) for s in sequences)
    ids = torch.tensor([[*prompt, *s, *[0] * (length - len(s))] for s in sequences])  # right padding: causal
    with torch.no_grad():
        logits = target.forward(ids, return_logits=True).logits[:, len(prompt) - 1 : len(prompt) - 1 + length]
    probs = torch.softmax(logits.double(), dim=-1)  # [N, L, V]
    order = probs.argsort(dim=-1, descending=True, stable=True)
    rank = order.argsort(dim=-1)
    cumulative = probs.gather(-1, order).cumsum(-1)
    per_position = []
    for k in range(length):
        rows = [i for i, s in enumerate(sequences) if len(s) > k]
        tokens = torch.tensor([sequences[i][k] for i in rows])
        p = probs[rows, k, tokens]
        upper = cumulative[rows, k].gather(-1, rank[rows, k, tokens].unsqueeze(-1)).squeeze(-1)
        per_position.append((upper - p).numpy() + rng.random(len(rows)) * p.numpy())
    return per_position


def uniformity_p_values(groups: dict[str, np.ndarray]) -> dict[str, float]:
    """10-bin chi-square p-value of each group of PIT values against U(0, 1)."""
    return {name: stats.chisquare(np.histogram(u, bins=10, range=(0.0, 1.0))[0]).pvalue for name, u in groups.items()}


def residual_ignoring_verifier(*, draft_tokens, draft_probs, target_logits, temperature, generator):
    """A plausible bug: the correction after a rejection is drawn from p_t instead of norm(max(0, p_t − p_d)).
    (Stands in for `verify_drafts_from_logits`, the engines' verifier.)"""
    target_probs = probs_from_logits(target_logits, temperature)
    length = draft_tokens.shape[0]
    uniforms = draw_uniforms((length + 1,), generator, target_probs.device)
    accepted = 0
    while accepted < length:
        token = int(draft_tokens[accepted])
        if not uniforms[accepted] * draft_probs[accepted, token] < target_probs[accepted, token]:
            break
        accepted += 1
    token = sample_from_probs(target_probs[accepted], uniforms=uniforms[length])
    return VerifyResult(accepted, int(token), draft_tokens[:accepted])
