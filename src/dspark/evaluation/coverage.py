"""How much of the target's distribution a draft vocabulary covers on text the target writes itself.

Coverage at a position is Σ_{x ∈ Vd} p_t(x): the ceiling of any slot's acceptance there (a draft outside Vd has
probability 0). Measured on the target-only rollouts of evaluation (the target's own generations at the evaluation
temperature), per domain, with one teacher-forced target forward per rollout over prompt + generated tokens; the
positions that predicted generated tokens are the ones counted. The issue's guidance: size Vd so that coverage is
≥ 0.95 in every domain you care about (the full vocabulary gives 1).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch


@torch.no_grad()
def draft_vocab_coverage(
    *, target: Any, drafter: Any, prompts: Sequence[Any], rollouts: Sequence[Any], temperature: float = 1.0
) -> dict[str, float]:
    """{domain: mean coverage over generated positions, "all": pooled} from the `mode == "target"` rollouts (or,
    without a target-only baseline, the speculative ones: lossless decoding writes the target's distribution too).

    prompts: the `EvalPrompt`s decoded (input_ids of each (dataset, prompt_id)); temperature as decoded (0 counts
    whether the target's argmax is inside Vd)."""
    head = getattr(drafter, "draft_head", None)
    if head is None or head.is_full:
        return {}
    ids = head.draft_to_target.to(target.device)
    by_key = {(p.dataset, p.prompt_id): p for p in prompts}
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    mode = "target" if any(r.mode == "target" for r in rollouts) else "speculative"
    for rollout in rollouts:
        prompt = by_key.get((rollout.dataset, rollout.prompt_id))
        if rollout.mode != mode or prompt is None or not rollout.new_tokens:
            continue
        sequence = torch.tensor([list(prompt.input_ids) + list(rollout.new_tokens)], device=target.device)
        out = target.forward(sequence, return_logits=True)
        start = len(prompt.input_ids) - 1  # logits at position i predict token i + 1
        logits = out.logits[0, start : start + len(rollout.new_tokens)].float()
        if temperature == 0:
            covered = torch.isin(logits.argmax(-1), ids).float()
        else:
            covered = torch.softmax(logits / temperature, dim=-1)[:, ids].sum(-1)
        for key in (rollout.domain, "all"):
            sums[key][0] += float(covered.sum())
            sums[key][1] += covered.numel()
    return {key: total / count for key, (total, count) in sums.items() if count}
