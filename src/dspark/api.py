"""Python API for researchers: load a target and a trained drafter, decode one prompt, inspect every round.

    from dspark.api import load_target, load_trained_drafter, speculative_generate
    target = load_target("smollm2-135m", cache_dir=Path("outputs/cache"))
    drafter = load_trained_drafter("outputs/runs/dspark-markov-d5-g7-s0-<key>", target)
    result = speculative_generate(target, drafter, "Write a haiku about rain.", policy="threshold", threshold=0.6)
    result.tau, [(r.drafts, r.num_verified, r.num_accepted, r.confidences) for r in result.rounds]

`schedule_verification` (Algorithm 1) is the pure scheduling function; its biased no-early-stop search is only
reachable with the explicit `allow_unsafe_full_search=True` flag (METHOD §6).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dspark.calibration.sts import STSCalibration
from dspark.decoding.engine import SpeculativeEngine
from dspark.decoding.policies import build_policy
from dspark.decoding.proposers import build_proposer
from dspark.decoding.records import GenerationResult
from dspark.drafters.checkpoint import drafter_file, load_drafter
from dspark.scheduling import SPSTable, schedule_verification
from dspark.targets import load_target

__all__ = ["load_target", "load_trained_drafter", "schedule_verification", "speculative_generate"]


def load_trained_drafter(run_dir_or_path: str | Path, target) -> nn.Module:
    """The trained drafter of a run directory (its `drafter.pt`) or of a `drafter.pt` file, around `target`
    (on the target's device, eval mode); errors if it was trained for another target."""
    drafter, _, _ = load_drafter(drafter_file(run_dir_or_path), target)
    return drafter.to(target.device).eval()


def speculative_generate(
    target,
    drafter: nn.Module | None,
    prompt: str | list[int],
    *,
    policy: str = "fixed",
    threshold: float = 0.5,
    static_k: int = 2,
    temperature: float = 1.0,
    max_new_tokens: int = 128,
    seed: int = 0,
    sps: SPSTable | None = None,
    calibration: STSCalibration | None = None,
    drafter_precision: str = "fp32",
    step_costs: str = "profile",
    chat_template: bool = True,
    verifier: str = "token",
    scheduler_stop: str = "first_non_improvement",
    bypass: str = "off",
) -> GenerationResult:
    """Decode one prompt (text, chat-templated unless `chat_template=False`, or token ids) with `drafter`
    (None: target-only). The result holds per-round drafts, confidences, ℓ_eff, A and τ (`GenerationResult`).

    The options are the `decode.*` keys of an evaluation, with the same names and checks: `policy` (fixed | mtp1 |
    static | threshold | calibrated_threshold | scheduler | async), `threshold` (θ), `static_k` (ℓ of static),
    `sps` (the SPS(B) table of scheduler / async), `step_costs` (profile | measured), `drafter_precision` (the
    drafter's parallel stage: auto | fp32 | bf16 | int8; fp32 here unless asked), `temperature`, `max_new_tokens`,
    `verifier` (token | block), `scheduler_stop` (first_non_improvement | global_argmax: lossy), `bypass` (off | cost);
    `calibration` is the STS fit the engine applies before the policy (`dspark.calibration.STSCalibration`)."""
    if isinstance(prompt, str):
        prompt_ids = (
            target.chat_prompt_ids(prompt)
            if chat_template
            else list(target.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        )
    else:
        prompt_ids = [int(t) for t in prompt]
    engine = SpeculativeEngine(
        target=target,
        proposer=build_proposer(drafter, precision=drafter_precision),
        policy=build_policy(policy, threshold=threshold, static_k=static_k, sps=sps, scheduler_stop=scheduler_stop),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        calibration=calibration,
        step_costs=step_costs,
        verifier=verifier,
        bypass=bypass,
    )
    generator = torch.Generator(device=target.device).manual_seed(seed)
    return engine.generate(prompt_ids, generator=generator)
