"""Decoding rollouts: prompts → chat-templated ids → one engine run each → per-prompt records (METHOD §5, §9).

Evaluation follows the paper's protocol (METHOD §9): the first user turn alone under the target's chat template
(`Target.chat_prompt_ids` with no system prompt of ours — a template that inserts its own default system turn, as
SmolLM2's does, keeps it), one generation per prompt. Each prompt gets its own generator seeded from
`(seed, dataset, prompt id)`, so speculative and target-only decoding of a prompt start from the same seed and a
rerun reproduces both.

A `PromptRollout` holds one prompt decoded in one mode (`speculative` or `target`); its `rounds` are the engine's
`RoundRecord`s as plain dicts (so summaries, reports and tests work from JSONL without the engine).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from dspark.data.regenerate import derive_seed
from dspark.files import atomic_output

if TYPE_CHECKING:
    from dspark.targets import Target

MODES = ("speculative", "target")


@dataclass
class EvalPrompt:
    """One evaluation prompt, ready for the engine."""

    dataset: str  # prompt-set name (gsm8k, mt-bench, ...)
    domain: str  # math | code | chat
    prompt_id: str
    input_ids: list[int]  # chat-templated first user turn, ending with the assistant header


@dataclass
class PromptRollout:
    """One prompt decoded once. `rounds` are RoundRecord dicts (empty for target-only decoding)."""

    dataset: str
    domain: str
    prompt_id: str
    mode: str  # speculative | target
    prompt_tokens: int
    new_tokens: list[int]
    stop_reason: str
    prefill_seconds: float
    total_seconds: float
    rounds: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the whole call (prefill included), NaN for a zero-time call."""
        return len(self.new_tokens) / self.total_seconds if self.total_seconds > 0 else float("nan")


def encode_prompts(
    target: Target, records_by_set: dict[str, Sequence[Any]], *, max_new_tokens: int, context_length: int | None = None
) -> list[EvalPrompt]:
    """Apply the chat template (no system prompt) to every record; clear errors for unusable prompts.

    records_by_set: prompt-set name → PromptRecords. context_length defaults to the target's
    `max_position_embeddings`; a prompt that cannot hold `max_new_tokens` more tokens is refused by name.
    """
    limit = context_length or getattr(target.hf_config, "max_position_embeddings", None)
    prompts = []
    for dataset, records in records_by_set.items():
        for record in records:
            if not record.prompt or not record.prompt.strip():
                raise ValueError(
                    f"decode.eval_sets: prompt '{record.id}' of set '{dataset}' is empty; remove it "
                    "from the prompt file or drop the set from decode.eval_sets."
                )
            ids = target.chat_prompt_ids(record.prompt)
            if limit is not None and len(ids) + max_new_tokens > limit:
                raise ValueError(
                    f"prompt '{record.id}' of set '{dataset}' has {len(ids)} tokens; with "
                    f"decode.max_new_tokens={max_new_tokens} it exceeds the target's context of {limit} tokens. "
                    "Lower decode.max_new_tokens or drop the prompt."
                )
            prompts.append(EvalPrompt(dataset, record.domain, record.id, ids))
    return prompts


def prompt_generator(*, seed: int, prompt: EvalPrompt, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of one prompt: the same for every mode and drafter, so comparisons share seeds."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, prompt.dataset, prompt.prompt_id))


def rollout_from_result(prompt: EvalPrompt, result: Any, *, mode: str, keep_rounds: bool = True) -> PromptRollout:
    """Convert an engine `GenerationResult` into a `PromptRollout` (rounds as dicts)."""
    if mode not in MODES:
        raise ValueError(f"rollout mode must be one of {MODES}, got {mode!r}")
    rounds = [asdict(r) for r in result.rounds] if keep_rounds else []
    return PromptRollout(
        dataset=prompt.dataset,
        domain=prompt.domain,
        prompt_id=prompt.prompt_id,
        mode=mode,
        prompt_tokens=len(prompt.input_ids),
        new_tokens=[int(t) for t in result.new_tokens],
        stop_reason=str(result.stop_reason),
        prefill_seconds=float(result.prefill_seconds),
        total_seconds=float(result.total_seconds),
        rounds=rounds,
    )


def run_rollouts(
    engines: Mapping[str, Any],
    prompts: Sequence[EvalPrompt],
    *,
    seed: int,
    desc: str = "decode",
    warmup: bool = True,
    show_progress: bool = True,
) -> list[PromptRollout]:
    """Decode every prompt once with each engine (mode → engine), the modes interleaved prompt by prompt.

    Interleaving keeps a speed-up fair when the machine's load drifts; `warmup` first runs each engine on a
    few tokens of the first prompt (discarded) so one-time costs do not land on the first measured prompt.
    A tqdm bar over prompts shows the speculative τ and tokens/s so far.
    """
    unknown = set(engines) - set(MODES)
    if unknown:
        raise ValueError(f"rollout modes must be among {MODES}, got {sorted(unknown)}")
    if warmup and prompts:
        for engine in engines.values():
            generator = prompt_generator(seed=seed, prompt=prompts[0], device=engine.target.device)
            engine.generate(prompts[0].input_ids, generator=generator, max_new_tokens=min(4, engine.max_new_tokens))
    rollouts: list[PromptRollout] = []
    totals = {mode: [0, 0.0] for mode in engines}
    committed = rounds = 0
    bar = tqdm(prompts, desc=desc, unit="prompt", disable=not show_progress)
    for prompt in bar:
        for mode, engine in engines.items():
            generator = prompt_generator(seed=seed, prompt=prompt, device=engine.target.device)
            result = engine.generate(prompt.input_ids, generator=generator)
            rollout = rollout_from_result(prompt, result, mode=mode, keep_rounds=mode == "speculative")
            rollouts.append(rollout)
            totals[mode][0] += len(rollout.new_tokens)
            totals[mode][1] += rollout.total_seconds
            committed += sum(int(r["committed"]) for r in rollout.rounds)
            rounds += len(rollout.rounds)
        postfix = {f"{mode}_tok_s": f"{n / max(s, 1e-9):.1f}" for mode, (n, s) in totals.items()}
        if rounds:
            postfix["tau"] = f"{committed / rounds:.2f}"
        bar.set_postfix(postfix)
    bar.close()
    return rollouts


def write_rollouts_jsonl(path: str | Path, rollouts: Iterable[PromptRollout]) -> Path:
    """One JSON object per rollout (its rounds inside); written to a temp file, then renamed."""
    path = Path(path)
    with atomic_output(path, mode="w") as handle:
        for rollout in rollouts:
            handle.write(json.dumps(asdict(rollout)) + "\n")
    return path


def read_rollouts_jsonl(path: str | Path) -> list[PromptRollout]:
    """Rollouts written by `write_rollouts_jsonl`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"No round records at {path}; run stage=eval first.")
    return [PromptRollout(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
