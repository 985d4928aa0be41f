"""Target-regenerated training data (METHOD §3 "Data"): prompts only, responses sampled by the target itself.

Each prompt becomes one sequence `input_ids = chat-template prompt ids + response ids through the end-of-turn
token`, with `loss_mask = 1` on exactly the assistant's tokens through end-of-turn (never on the template's
trailing newline), so the drafter learns to predict EOS. Multi-turn prompts are regenerated turn by turn, every
assistant turn masked in (`multi_turn`: off = first turns only; dataset = a prompt's own later turns; followup = those,
and one follow-up drawn from the other prompts of its domain for a prompt without any, `with_followups`).
A response that hits `max_new_tokens` gets the end-of-turn id appended and is marked `truncated`. Sequences are
cut at `max_length` (marked `clipped`) and dropped when fewer than `min_loss_tokens` (14) loss tokens remain.

On disk: `cache_dir/regen/<key>/` with `manifest.json` (recording every shard's sha256, `dspark.data.integrity`),
one parquet shard per prompt batch (written all-or-nothing by `dspark.files.atomic_output`, so a crash or a full
disk never leaves a corrupt shard), and a `COMPLETE` marker; a damaged shard is found on reuse and regenerated, and
concurrent builders of one cache take turns (lock file). `key` is the sha256 of everything that determines the
output; a rerun skips finished shards, and because batch `i` is sampled with a seed derived from `(seed, i)` alone, a
resumed run produces the same data as an uninterrupted one.

`precision="bf16"` samples under bf16 autocast (an fp32 target on a CPU with bf16 instructions; measured on an EPYC
Zen 4, one thread, 32 prompts × 64 new tokens at T = 1: 72 tok/s fp32, 99 tok/s bf16): the text is then the bf16
target's, as the feature cache's prefill is (mean TV of p_t against fp32 0.006, CPU_RECIPE.md), and the precision
is part of the cache key.

`backend` replaces the in-process sampling by another writer of the same sequences (data.regen_backend=openai:
`dspark.data.regen_server.ServerRegenerator`, an OpenAI-compatible server); its `record` (what the server serves,
how it is asked) enters the cache key in place of the in-process generation config and precision. The hf keys are
what they were.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm.auto import tqdm
from torch import Tensor
from transformers import DynamicCache, GenerationConfig

from dspark.config.schema import SamplingConfig
from dspark.data.integrity import COMPLETE, MANIFEST, building, read_cache_manifest, resumable, seal_cache
from dspark.files import atomic_output, atomic_write_bytes
from dspark.hardware import autocast_linear_weights

if TYPE_CHECKING:
    from dspark.data.prompts import PromptRecord
    from dspark.targets import Target

FORMAT_VERSION = 1  # bump when the on-disk layout or the sequence construction changes
STATS_KEY = b"dspark_stats"
_SENTINEL = "\u2063dspark-assistant\u2063"  # stands in for a finished assistant turn when rendering the next one
FEATURES = datasets.Features(
    {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "prompt_id": datasets.Value("string"),
        "domain": datasets.Value("string"),
        "truncated": datasets.Value("bool"),
        "clipped": datasets.Value("bool"),
    }
)


@dataclass
class RegeneratedSequence:
    """One training example (METHOD §3)."""

    input_ids: list[int]  # prompt (chat template) + response + end-of-turn, per turn
    loss_mask: list[int]  # 1 on the assistant's tokens through the end-of-turn token
    prompt_id: str = ""
    domain: str = ""
    truncated: bool = False  # some response hit max_new_tokens (end-of-turn appended)
    clipped: bool = False  # cut at max_length


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any parts (stable across processes and Python versions, unlike hash())."""
    digest = hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


MULTI_TURN_MODES = ("off", "dataset", "followup")  # data.multi_turn


def multi_turn_mode(multi_turn: bool | str) -> str:
    """`data.multi_turn` from its value or the older bool (False = off, True = dataset)."""
    mode = ("dataset" if multi_turn else "off") if isinstance(multi_turn, bool) else multi_turn
    if mode not in MULTI_TURN_MODES:
        raise ValueError(f"data.multi_turn={mode!r} must be one of {', '.join(MULTI_TURN_MODES)}")
    return mode


def sampling_record(sampling: SamplingConfig, *, multi_turn: bool | str) -> dict[str, Any]:
    """The sampling settings as the cache key and the manifest record them (`multi_turn` among them, as before the
    config and the regeneration shared one SamplingConfig: existing caches keep their keys; `sampler` only when it is
    not `generate`, for the same reason). `multi_turn` is recorded as the bool it was for off / dataset (so those
    keys are unchanged) and as "followup" for followup."""
    mode = multi_turn_mode(multi_turn)
    record = asdict(sampling) | {"multi_turn": mode if mode == "followup" else mode == "dataset"}
    if record["sampler"] == "generate":
        del record["sampler"]
    return record


def end_of_turn_id(target: Target) -> int:
    """The id closing an assistant turn: the tokenizer's eos when it is a stop id, else the first stop id."""
    eos = target.tokenizer.eos_token_id
    return int(eos) if eos in target.stop_token_ids else int(target.stop_token_ids[0])


def user_turns(prompt: Any, *, multi_turn: bool | str) -> list[str]:
    """The user turns to regenerate: `[prompt, *turns]` (PromptRecord.turns holds the later user turns); the first
    alone with multi_turn off. Follow-ups are in `turns` already (`with_followups`)."""
    later = list(getattr(prompt, "turns", None) or []) if multi_turn_mode(multi_turn) != "off" else []
    return [prompt.prompt, *later]


def with_followups(prompts: Sequence[PromptRecord], *, seed: int) -> list[PromptRecord]:
    """data.multi_turn=followup: each prompt without later turns of its own gets one follow-up user turn, the first
    turn of another prompt of the same domain among `prompts` (of any other prompt when its domain has no other).

    The draw is deterministic: candidates sorted by (id, text), index `derive_seed(seed, "followup", id) mod count`,
    so it does not depend on the order of `prompts` (prepare sorts them by length) and a resumed run draws the same.
    The follow-up is usually unrelated to the first exchange (a user moving on to a new question in one chat): what
    it trains is answering a later turn with the conversation so far in context. A prompt alone in the list stays
    single-turn. Prompts with their own later turns (mt-bench) keep them.
    """
    by_domain: dict[str, list[PromptRecord]] = {}
    for p in prompts:
        by_domain.setdefault(getattr(p, "domain", ""), []).append(p)
    everyone = sorted(prompts, key=lambda p: (p.id, p.prompt))
    out = []
    for p in prompts:
        same = sorted(by_domain[getattr(p, "domain", "")], key=lambda q: (q.id, q.prompt))
        pool = [q for q in (same if len(same) > 1 else everyone) if q is not p]
        if getattr(p, "turns", None) or not pool:
            out.append(p)
            continue
        drawn = pool[derive_seed(seed, "followup", p.id) % len(pool)]
        out.append(replace(p, turns=[drawn.prompt]))
    return out


def regen_cache_key(
    target: Target,
    prompts: Sequence[PromptRecord],
    *,
    sampling: SamplingConfig,
    seed: int,
    max_length: int,
    min_loss_tokens: int,
    multi_turn: bool | str = True,
    precision: str = "fp32",
    server: dict[str, Any] | None = None,
) -> str:
    """sha256 over everything that determines the regenerated data (`precision` only when it is not fp32, so the
    keys of fp32 caches stay what they were). `server`: a backend's record (`ServerRegenerator.record`: backend,
    API, the served model's id and what else the server reports of it, how sampling is asked); it replaces the
    in-process generation config and precision, which the server's text does not depend on. The target stays in
    the key: its tokenizer and chat template make the sequences."""
    payload: dict[str, Any] = {"format": FORMAT_VERSION, "target": target.fingerprint}
    if server is None:
        # knobs we do not set explicitly could still come from the model's generation config
        payload["generation_config"] = {
            k: v for k, v in target.model.generation_config.to_diff_dict().items() if k != "transformers_version"
        }
    else:
        payload["server"] = server
    payload |= {
        "prompts": [[p.id, getattr(p, "domain", ""), p.prompt, list(getattr(p, "turns", None) or [])] for p in prompts],
        "sampling": sampling_record(sampling, multi_turn=multi_turn),
        "seed": seed,
        "max_length": max_length,
        "min_loss_tokens": min_loss_tokens,
    }
    if precision != "fp32" and server is None:
        payload["precision"] = precision
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def regenerate_responses(
    target: Target,
    prompts: Sequence[PromptRecord],
    *,
    sampling: SamplingConfig,
    cache_dir: Path,
    seed: int,
    max_length: int = 4096,
    min_loss_tokens: int = 14,
    show_progress: bool = True,
    multi_turn: bool | str = True,
    precision: str = "fp32",
    backend: Any = None,
) -> Path:
    """Regenerate every prompt's response(s) with the target; return the cached dataset directory (resumable).

    prompts: objects with `.id`, `.prompt`, optional `.turns` and `.domain` (PromptRecord); later turns are
    regenerated one at a time unless `multi_turn` is off (False); "followup" first adds a drawn follow-up turn to the
    prompts without one (`with_followups`). `sampling.system_prompt` None keeps the chat template's own
    default (SmolLM2 inserts a system turn; the manifest records `template_default_system_prompt`). Finished shards of
    an earlier run with the same key are kept; a finished directory is returned without generating anything.
    precision: "fp32" (the target's own dtype) or "bf16" (autocast; module docstring), as
    `dspark.data.features.resolve_prefill_precision` resolves `data.regen_precision`; in-process only.
    backend: None = the target samples in this process; else an object with `record` (a JSON-able dict for the
    cache key), `manifest_record` (the same for the manifest, credentials masked) and `regenerate_shards` (the
    `ServerRegenerator` of dspark.data.regen_server), which writes the same sequences through `on_shard`.
    """
    if precision not in ("fp32", "bf16"):
        raise ValueError(
            f"data.regen_precision={precision!r}: resolve it to fp32 or bf16 first "
            "(dspark.data.features.resolve_prefill_precision)"
        )
    if max_length < 2:
        raise ValueError(f"data.max_length={max_length} must be >= 2; set the sequence length cap")
    if multi_turn_mode(multi_turn) == "followup":
        prompts = with_followups(prompts, seed=seed)
    key = regen_cache_key(
        target,
        prompts,
        sampling=sampling,
        seed=seed,
        max_length=max_length,
        min_loss_tokens=min_loss_tokens,
        multi_turn=multi_turn,
        precision=precision,
        server=None if backend is None else backend.record,
    )
    out_dir = Path(cache_dir) / "regen" / key
    with building(out_dir) as whole:  # one builder at a time; a damaged finished cache comes back unfinished
        if whole:
            return out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        batches = [prompts[i : i + sampling.batch_size] for i in range(0, len(prompts), sampling.batch_size)]
        manifest = _manifest(
            target,
            key=key,
            sampling=sampling,
            seed=seed,
            max_length=max_length,
            min_loss_tokens=min_loss_tokens,
            num_prompts=len(prompts),
            num_shards=len(batches),
            multi_turn=multi_turn,
            precision=precision,
        )
        if backend is not None:
            manifest |= {"backend": backend.manifest_record, "precision": None}
        atomic_write_bytes(out_dir / MANIFEST, json.dumps(manifest, indent=2).encode(), key="paths.root")
        todo = [i for i in range(len(batches)) if not shard_path(out_dir, i).exists()]
        bar = tqdm(
            total=len(batches),
            initial=len(batches) - len(todo),
            unit="batch",
            desc="regenerate",
            disable=not show_progress,
        )
        tokens, started_run = 0, time.perf_counter()

        def on_shard(index: int, rows: list[RegeneratedSequence], stats: dict[str, Any]) -> None:
            nonlocal tokens
            _write_shard(shard_path(out_dir, index), rows, stats)
            tokens += stats["generated_tokens"]
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - started_run, 1e-9):.1f}")

        if backend is not None:
            backend.regenerate_shards(
                target,
                {index: batches[index] for index in todo},
                sampling=sampling,
                seed=seed,
                max_length=max_length,
                min_loss_tokens=min_loss_tokens,
                multi_turn=multi_turn,
                on_shard=on_shard,
                out_dir=out_dir,
                num_shards=len(batches),
            )
        bf16 = precision == "bf16"
        for index in todo if backend is None else []:
            started = time.perf_counter()
            with (
                torch.autocast(device_type=target.device.type, dtype=torch.bfloat16, enabled=bf16),
                autocast_linear_weights(target.model, torch.bfloat16 if bf16 else None),
            ):
                rows, stats = regenerate_batch(
                    target,
                    batches[index],
                    sampling=sampling,
                    seed=derive_seed(seed, index),
                    max_length=max_length,
                    min_loss_tokens=min_loss_tokens,
                    multi_turn=multi_turn,
                )
            stats["seconds"] = time.perf_counter() - started
            on_shard(index, rows, stats)
        bar.close()
        manifest["stats"] = _sum_shard_stats(out_dir, len(batches))
        seal_cache(out_dir, manifest, [shard_path(out_dir, i).name for i in range(len(batches))])
    return out_dir


def _manifest(
    target: Target,
    *,
    key: str,
    sampling: SamplingConfig,
    seed: int,
    max_length: int,
    min_loss_tokens: int,
    num_prompts: int,
    num_shards: int,
    multi_turn: bool,
    precision: str,
) -> dict[str, Any]:
    """What the directory holds and how it was made (recorded with runs)."""
    return {
        "key": key,
        "format": FORMAT_VERSION,
        "target": target.name,
        "target_fingerprint": target.fingerprint,
        "sampling": sampling_record(sampling, multi_turn=multi_turn),
        "template_default_system_prompt": bool(getattr(target, "default_system_prompt", False)),
        "seed": seed,
        "max_length": max_length,
        "min_loss_tokens": min_loss_tokens,
        "precision": precision,
        "num_prompts": num_prompts,
        "num_shards": num_shards,
        "end_of_turn_id": end_of_turn_id(target),
        "pad_token_id": _pad_id(target),
    }


def shard_path(out_dir: Path, index: int) -> Path:
    return out_dir / f"shard-{index:05d}.parquet"


def regenerate_batch(
    target: Target,
    prompts: Sequence[PromptRecord],
    *,
    sampling: SamplingConfig,
    seed: int,
    max_length: int,
    min_loss_tokens: int,
    multi_turn: bool | str = True,
) -> tuple[list[RegeneratedSequence], dict[str, int]]:
    """Sample one batch of prompts turn by turn (first turns only without `multi_turn`); returns the kept sequences
    and counters for the manifest."""
    eot = end_of_turn_id(target)
    turns = [user_turns(p, multi_turn=multi_turn) for p in prompts]
    seqs = [RegeneratedSequence([], [], p.id, getattr(p, "domain", "")) for p in prompts]
    histories: list[list[dict[str, str]]] = [[] for _ in prompts]
    generated = 0
    with torch.random.fork_rng(devices=_rng_devices(target)):
        torch.manual_seed(seed)
        for turn in range(max(len(t) for t in turns)):
            active = [i for i, t in enumerate(turns) if turn < len(t) and len(seqs[i].input_ids) < max_length]
            if not active:
                break
            for i in active:
                ids = next_prompt_ids(target, histories[i], turns[i][turn], sampling=sampling, eot=eot)
                seqs[i].input_ids += ids
                seqs[i].loss_mask += [0] * len(ids)
            responses = sample_responses(target, [seqs[i].input_ids for i in active], sampling=sampling, eot=eot)
            for i, (response, hit_stop) in zip(active, responses):
                generated += len(response) - (0 if hit_stop else 1)
                seqs[i].input_ids += response
                seqs[i].loss_mask += [1] * len(response)
                seqs[i].truncated |= not hit_stop
                content = target.tokenizer.decode(response[:-1], skip_special_tokens=True)
                histories[i] += [{"role": "user", "content": turns[i][turn]}, {"role": "assistant", "content": content}]
    return finish_sequences(seqs, max_length=max_length, min_loss_tokens=min_loss_tokens, generated=generated)


def finish_sequences(
    seqs: Sequence[RegeneratedSequence], *, max_length: int, min_loss_tokens: int, generated: int
) -> tuple[list[RegeneratedSequence], dict[str, int]]:
    """One shard's sequences cut at `max_length` and without those under `min_loss_tokens` loss tokens, with the
    shard's counters (`generated`: tokens the target sampled, stop tokens included)."""
    kept = [s for s in map(lambda s: _clip(s, max_length), seqs) if sum(s.loss_mask) >= min_loss_tokens]
    stats = {
        "sequences": len(kept),
        "dropped": len(seqs) - len(kept),
        "generated_tokens": generated,
        "truncated": sum(s.truncated for s in kept),
        "clipped": sum(s.clipped for s in kept),
        "loss_tokens": sum(sum(s.loss_mask) for s in kept),
    }
    return kept, stats


def _clip(seq: RegeneratedSequence, max_length: int) -> RegeneratedSequence:
    if len(seq.input_ids) > max_length:
        seq.input_ids, seq.loss_mask, seq.clipped = seq.input_ids[:max_length], seq.loss_mask[:max_length], True
    return seq


def next_prompt_ids(
    target: Target, history: list[dict[str, str]], user_text: str, *, sampling: SamplingConfig, eot: int
) -> list[int]:
    """Ids to append before the next response: the whole prompt for turn 1, else the text between the previous
    end-of-turn and the next assistant header (the template's newline, the user turn, the header)."""
    if not history:
        return target.chat_prompt_ids(user_text, system_prompt=sampling.system_prompt)
    messages = [] if sampling.system_prompt is None else [{"role": "system", "content": sampling.system_prompt}]
    messages += history[:-1] + [{"role": "assistant", "content": _SENTINEL}, {"role": "user", "content": user_text}]
    text = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    eot_text = target.tokenizer.decode([eot])
    start = text.rfind(_SENTINEL)
    cut = text.find(eot_text, start) if start >= 0 else -1
    if cut < 0:
        raise ValueError(
            "multi-turn regeneration: the chat template does not close an assistant turn with the end-of-turn "
            f"token {eot_text!r}; regenerate first turns only (regenerate_responses(..., multi_turn=False)) or use "
            "single-turn prompt sets in data.train_sets"
        )
    return list(target.tokenizer(text[cut + len(eot_text) :], add_special_tokens=False)["input_ids"])


def sample_responses(
    target: Target, prompt_ids: Sequence[list[int]], *, sampling: SamplingConfig, eot: int
) -> list[tuple[list[int], bool]]:
    """Batched sampling (left-padded). Returns per prompt (response ids through the first stop id, hit_stop);
    a response without a stop id has `eot` appended and hit_stop False. `sampling.sampler` picks transformers'
    `generate` or `sample_lean` (the same distribution, another random stream)."""
    if sampling.sampler == "lean":
        return sample_lean(target, prompt_ids, sampling=sampling, eot=eot)
    pad = _pad_id(target)
    input_ids, attention_mask = _left_padded(target, prompt_ids)
    width = input_ids.shape[1]
    with torch.no_grad():
        out = target.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=_generation_config(target, sampling, pad=pad),
        )
    stops = set(target.stop_token_ids)
    results = []
    for row in out[:, width:].tolist():
        end = next((j for j, tok in enumerate(row) if tok in stops), None)
        results.append((row[: end + 1], True) if end is not None else (row + [eot], False))
    return results


def _left_padded(target: Target, prompt_ids: Sequence[list[int]]) -> tuple[Tensor, Tensor]:
    """input_ids and attention_mask [B, max length], left-padded with the pad id (both samplers' batch)."""
    pad, width = _pad_id(target), max(len(ids) for ids in prompt_ids)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in prompt_ids], device=target.device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], device=target.device)
    return input_ids, mask


def sample_lean(
    target: Target, prompt_ids: Sequence[list[int]], *, sampling: SamplingConfig, eot: int
) -> list[tuple[list[int], bool]]:
    """`sample_responses` in our own loop: what `generate` samples, at less cost per step (data.sampling.sampler=lean).

    Per step: one forward of the still-unfinished rows over the KV cache (last position's logits only), then
    `draw_tokens` (the suppressed MASK row, temperature, top-k, top-p: `generate`'s processors in its order, so the
    same distribution). Two costs of `generate` go: torch.multinomial draws V exponentials per row (13% of a
    batch-48 step on the Xeon, measured in benchmarks/results/data.md), where an inverse-CDF draw needs one uniform;
    and a finished row stays in `generate`'s batch until the last one ends, where here it leaves the batch and the
    cache (`DynamicCache.batch_select_indices`). The random stream is torch's global one (regenerate_batch seeds it
    per batch), so a batch is reproducible, but not the one `generate` draws.
    """
    device = target.device
    input_ids, mask = _left_padded(target, prompt_ids)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    stops = set(target.stop_token_ids)
    suppress = torch.tensor([int(target.mask_token_id)], device=device)
    responses: list[list[int]] = [[] for _ in prompt_ids]
    hit_stop = [False] * len(prompt_ids)
    rows = list(range(len(prompt_ids)))  # the batch's rows, by their index in prompt_ids
    cache = DynamicCache()
    with torch.no_grad():
        logits = target.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        next_position = positions[:, -1] + 1
        for step in range(sampling.max_new_tokens):
            tokens = draw_tokens(logits, sampling=sampling, suppress=suppress)
            keep = []
            for slot, (row, token) in enumerate(zip(rows, tokens.tolist())):
                responses[row].append(token)
                if token in stops:
                    hit_stop[row] = True
                else:
                    keep.append(slot)
            if not keep or step + 1 == sampling.max_new_tokens:
                break
            if len(keep) < len(rows):  # finished rows leave the batch and the cache
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                mask, next_position, tokens = mask[index], next_position[index], tokens[index]
                rows = [rows[slot] for slot in keep]
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            logits = target.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_position[:, None],
                cache=cache,
                use_cache=True,
            ).logits[:, -1]
            next_position = next_position + 1
    return [
        (response, True) if stopped else (response + [eot], False) for response, stopped in zip(responses, hit_stop)
    ]


def draw_tokens(
    logits: Tensor, *, sampling: SamplingConfig, suppress: Tensor | None = None, uniform: Tensor | None = None
) -> Tensor:
    """One token per row of logits [N, V] under `sampling` (what `_generation_config` makes `generate` sample):
    the `suppress` ids masked, then temperature, top-k, top-p (transformers' warpers, in its order and with its
    tie and keep-one rules); T = 0 is greedy. Returns [N] long.

    The draw is by inverse CDF: one uniform u per row, the first token whose cumulative probability exceeds
    u · total. A token of probability 0 spans an empty interval and is never drawn. `uniform` [N, 1] in [0, 1]
    replaces torch.rand's draws (tests).
    """
    scores = logits.float()
    if suppress is not None and suppress.numel():
        scores = scores.index_fill(-1, suppress, float("-inf"))
    if sampling.temperature == 0:
        return scores.argmax(dim=-1)
    scores = scores / sampling.temperature
    vocab = scores.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[..., -1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    cdf = scores.softmax(dim=-1).cumsum(dim=-1)
    total = cdf[..., -1:].contiguous()
    u = (torch.rand(total.shape, device=scores.device, dtype=cdf.dtype) if uniform is None else uniform) * total
    tokens = torch.searchsorted(cdf, u, right=True)
    # u·total can round up to total: fall back to the last token with mass (where the CDF first reaches its total)
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(tokens, last).squeeze(-1)


def _generation_config(target: Target, sampling: SamplingConfig, *, pad: int) -> GenerationConfig:
    """Every sampling knob set explicitly so the model's own generation defaults cannot leak in.

    The MASK row is suppressed: the data must never contain it (METHOD §2.1). A real target's MASK is a token it
    does not emit anyway; a random-weight `tiny` target would.
    """
    common = dict(
        max_new_tokens=sampling.max_new_tokens,
        pad_token_id=pad,
        eos_token_id=list(target.stop_token_ids),
        repetition_penalty=1.0,
        suppress_tokens=[int(target.mask_token_id)],
    )
    if sampling.temperature == 0:
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=0.0,
        **common,
    )


def _pad_id(target: Target) -> int:
    pad = target.tokenizer.pad_token_id
    return int(pad) if pad is not None else end_of_turn_id(target)


def _rng_devices(target: Target) -> list[int]:
    device = target.device
    return [device.index or 0] if device.type == "cuda" else []


def _write_shard(path: Path, rows: list[RegeneratedSequence], stats: dict[str, Any]) -> None:
    """Write one shard all-or-nothing, its counters in the parquet metadata (so shard and stats land together): a
    full disk leaves no shard and raises `OutputError` naming it (`dspark.files.atomic_output`)."""
    columns = {name: [getattr(r, name) for r in rows] for name in FEATURES}
    table = datasets.Dataset.from_dict(columns, features=FEATURES).data.table
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), STATS_KEY: json.dumps(stats).encode()})
    with resumable(), atomic_output(path, key="paths.root") as handle:
        pq.write_table(table, handle)


def _sum_shard_stats(out_dir: Path, num_shards: int) -> dict[str, float]:
    total: dict[str, float] = {}
    for index in range(num_shards):
        stats = json.loads(pq.read_schema(shard_path(out_dir, index)).metadata[STATS_KEY])
        for name, value in stats.items():
            total[name] = total.get(name, 0) + value
    return total


def load_regenerated(regen_dir: Path) -> datasets.Dataset:
    """The finished dataset: columns input_ids, loss_mask, prompt_id, domain, truncated, clipped (shard order)."""
    regen_dir = Path(regen_dir)
    if not (regen_dir / COMPLETE).exists():
        raise ValueError(
            f"data: {regen_dir} is not a complete regenerated dataset (no {COMPLETE} marker); rerun the prepare "
            "stage (regenerate_responses) to finish it"
        )
    num_shards = read_manifest(regen_dir)["num_shards"]
    tables = [pq.read_table(shard_path(regen_dir, i)) for i in range(num_shards)]
    table = pa.concat_tables(tables) if tables else FEATURES.arrow_schema.empty_table()
    return datasets.Dataset(table.replace_schema_metadata(None), info=datasets.DatasetInfo(features=FEATURES))


def read_manifest(regen_dir: Path) -> dict[str, Any]:
    """The manifest of a regenerated dataset directory (a ValueError naming it when unreadable)."""
    return read_cache_manifest(Path(regen_dir))
