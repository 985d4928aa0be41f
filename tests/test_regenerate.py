"""Response regeneration (METHOD §3) on the random-weight `tiny` target: masks, caching, resume, cache keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dspark.data.prompts import PromptRecord
from dspark.data.regenerate import (
    COMPLETE,
    SamplingConfig,
    load_regenerated,
    read_manifest,
    regen_cache_key,
    regenerate_batch,
    draw_tokens,
    regenerate_responses,
    sample_lean,
    sample_responses,
    with_followups,
)

SAMPLING = SamplingConfig(max_new_tokens=6, batch_size=2)
PROMPTS = [
    PromptRecord("a", "math", "What is 3 + 4?"),
    PromptRecord("b", "chat", "Say hello.", turns=["Now say it in French."]),
    PromptRecord("c", "code", "def add(a, b):"),
    PromptRecord("d", "chat", "Give three tips."),
    PromptRecord("e", "math", "Solve 3x + 5 = 20."),
]


# one thread: the tiny model's ops are too small to gain from more, and on a busy 2-core machine the extra thread's
# synchronisation makes generation ~10x slower (the `tiny` fixture's options, tests/conftest.py)
TINY_TARGET = {"threads": 1}


class GenerateCounter:
    """Wraps `model.generate`, counting calls; optionally raising once a shard exists (a simulated crash)."""

    def __init__(self, generate, *, crash_when_shard_in: Path | None = None):
        self.generate, self.calls, self.crash_dir = generate, 0, crash_when_shard_in

    def __call__(self, *args, **kwargs):
        if self.crash_dir is not None and any(self.crash_dir.glob("regen/*/shard-*.parquet")):
            raise RuntimeError("simulated crash")
        self.calls += 1
        return self.generate(*args, **kwargs)


def run(tiny, cache_dir: Path, **overrides) -> Path:
    kwargs = dict(sampling=SAMPLING, cache_dir=cache_dir, seed=0, min_loss_tokens=1, show_progress=False)
    return regenerate_responses(tiny, PROMPTS, **{**kwargs, **overrides})


@pytest.fixture(scope="module")
def finished(tiny, tmp_path_factory) -> Path:
    return run(tiny, tmp_path_factory.mktemp("full"))


def test_complete_and_cached_rerun(tiny, finished, monkeypatch) -> None:
    assert (finished / COMPLETE).exists()
    assert sorted(p.name for p in finished.glob("shard-*.parquet")) == [f"shard-0000{i}.parquet" for i in range(3)]
    counter = GenerateCounter(tiny.model.generate)
    monkeypatch.setattr(tiny.model, "generate", counter)
    assert run(tiny, finished.parent.parent) == finished
    assert counter.calls == 0
    manifest = read_manifest(finished)
    assert manifest["sampling"]["temperature"] == 0.7 and manifest["end_of_turn_id"] == tiny.tokenizer.eos_token_id
    assert manifest["stats"]["sequences"] == len(PROMPTS)


def test_loss_mask_is_response_through_end_of_turn(tiny, finished) -> None:
    """Catches a mask that includes the template's newline or the prompt, or misses the end-of-turn token."""
    data = load_regenerated(finished)
    assert data.column_names[:4] == ["input_ids", "loss_mask", "prompt_id", "domain"]
    eot, tok = tiny.tokenizer.eos_token_id, tiny.tokenizer
    for row, prompt in zip(data, PROMPTS):
        ids, mask = row["input_ids"], row["loss_mask"]
        assert row["prompt_id"] == prompt.id and row["domain"] == prompt.domain
        assert tiny.mask_token_id not in ids  # MASK never enters the data
        spans = _masked_spans(mask)
        assert len(spans) == 1 + len(prompt.turns)
        first = tiny.chat_prompt_ids(prompt.prompt)
        assert ids[: spans[0][0]] == first
        for start, end in spans:
            response = ids[start:end]
            assert response[-1] == eot and eot not in response[:-1]
            assert len(response) <= SAMPLING.max_new_tokens + 1
        assert spans[-1][1] == len(ids)  # nothing after the last end-of-turn
        if prompt.turns:
            between = tok.decode(ids[spans[0][1] : spans[1][0]])
            assert between == f"\n<|im_start|>user\n{prompt.turns[0]}<|im_end|>\n<|im_start|>assistant\n"


def _masked_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_crash_then_resume_equals_uninterrupted(tiny, finished, tmp_path, monkeypatch) -> None:
    crashing = GenerateCounter(tiny.model.generate, crash_when_shard_in=tmp_path)
    monkeypatch.setattr(tiny.model, "generate", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tiny, tmp_path)
    (partial,) = list((tmp_path / "regen").iterdir())
    assert not (partial / COMPLETE).exists()
    assert [p.name for p in partial.iterdir() if p.suffix == ".parquet"] == ["shard-00000.parquet"]
    resumed = GenerateCounter(crashing.generate)
    monkeypatch.setattr(tiny.model, "generate", resumed)
    assert run(tiny, tmp_path) == partial
    assert resumed.calls == 2  # batches 1 and 2 are single-turn: one generate call each
    assert load_regenerated(partial).to_dict() == load_regenerated(finished).to_dict()


def test_cache_key_changes_with_what_determines_output(tiny) -> None:
    base = dict(sampling=SAMPLING, seed=0, max_length=4096, min_loss_tokens=14)
    key = regen_cache_key(tiny, PROMPTS, **base)
    assert key == regen_cache_key(tiny, list(PROMPTS), **base)
    variants = [
        {**base, "seed": 1},
        {**base, "sampling": dataclasses.replace(SAMPLING, temperature=1.0)},
        {**base, "sampling": dataclasses.replace(SAMPLING, system_prompt="You are helpful.")},
        {**base, "max_length": 512},
        {**base, "precision": "bf16"},
        {**base, "sampling": dataclasses.replace(SAMPLING, sampler="lean")},
    ]
    for variant in variants:
        assert regen_cache_key(tiny, PROMPTS, **variant) != key
    edited = [dataclasses.replace(PROMPTS[0], prompt="What is 3 + 5?"), *PROMPTS[1:]]
    assert regen_cache_key(tiny, edited, **base) != key
    assert regen_cache_key(tiny, PROMPTS, **base, precision="fp32") == key  # fp32 caches keep their old keys


def test_bf16_regeneration_is_recorded_and_refuses_unresolved_precision(tiny, tmp_path) -> None:
    out = run(tiny, tmp_path, precision="bf16")
    assert read_manifest(out)["precision"] == "bf16"
    assert len(load_regenerated(out)) == len(PROMPTS)
    with pytest.raises(ValueError, match="data.regen_precision='auto'"):
        run(tiny, tmp_path, precision="auto")


def test_different_seed_gives_different_responses(tiny, tmp_path) -> None:
    prompts = [PROMPTS[0], PROMPTS[2]]
    a = load_regenerated(
        regenerate_responses(
            tiny, prompts, sampling=SAMPLING, cache_dir=tmp_path, seed=0, min_loss_tokens=1, show_progress=False
        )
    )
    b = load_regenerated(
        regenerate_responses(
            tiny, prompts, sampling=SAMPLING, cache_dir=tmp_path, seed=1, min_loss_tokens=1, show_progress=False
        )
    )
    assert a["input_ids"] != b["input_ids"]


def fake_generate(rows: list[list[int]]):
    """A stand-in for `model.generate` that appends fixed new tokens to the (left-padded) input."""

    def generate(*, input_ids, attention_mask, generation_config):
        return torch.cat([input_ids, torch.tensor(rows)[: len(input_ids)]], dim=1)

    return generate


def test_sample_responses_stops_and_appends_end_of_turn(tiny, monkeypatch) -> None:
    eot, pad = tiny.tokenizer.eos_token_id, tiny.tokenizer.pad_token_id
    monkeypatch.setattr(tiny.model, "generate", fake_generate([[40, 41, eot, pad, pad], [40, 41, 42, 43, 44]]))
    out = sample_responses(tiny, [[7, 8, 9], [7]], sampling=SAMPLING, eot=eot)
    assert out == [([40, 41, eot], True), ([40, 41, 42, 43, 44, eot], False)]


def test_regenerate_batch_truncation_clipping_and_dropping(tiny, monkeypatch) -> None:
    eot, pad = tiny.tokenizer.eos_token_id, tiny.tokenizer.pad_token_id
    monkeypatch.setattr(tiny.model, "generate", fake_generate([[40] * 3 + [eot, pad], [41] * 5]))
    sampling = dict(sampling=SAMPLING, multi_turn=False)
    prompts = PROMPTS[:2]
    rows, stats = regenerate_batch(tiny, prompts, **sampling, seed=0, max_length=4096, min_loss_tokens=1)
    assert [r.truncated for r in rows] == [False, True]
    assert [sum(r.loss_mask) for r in rows] == [4, 6]  # 3 tokens + eot; 5 tokens + appended eot
    assert stats["generated_tokens"] == 4 + 5
    prompt_len = len(tiny.chat_prompt_ids(prompts[1].prompt))
    rows, _ = regenerate_batch(tiny, prompts, **sampling, seed=0, max_length=prompt_len + 2, min_loss_tokens=1)
    assert all(len(r.input_ids) <= prompt_len + 2 for r in rows) and rows[1].clipped
    rows, stats = regenerate_batch(tiny, prompts, **sampling, seed=0, max_length=4096, min_loss_tokens=5)
    assert [r.prompt_id for r in rows] == ["b"] and stats["dropped"] == 1  # 4 loss tokens < 5


def test_sampling_config_validation() -> None:
    with pytest.raises(ValueError, match="data.sampling.top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="data.sampling.batch_size"):
        SamplingConfig(batch_size=0)


def test_load_incomplete_dir_fails(tmp_path) -> None:
    with pytest.raises(ValueError, match="COMPLETE"):
        load_regenerated(tmp_path)


def _warped_probabilities(logits: torch.Tensor, sampling: SamplingConfig, suppress: list[int]) -> torch.Tensor:
    """The distribution `generate` samples from, built with transformers' own processors (the reference)."""
    from transformers.generation.logits_process import (
        SuppressTokensLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = SuppressTokensLogitsProcessor(suppress)(torch.zeros(1, 1, dtype=torch.long), logits.clone())
    for warper in (
        TemperatureLogitsWarper(sampling.temperature),
        TopKLogitsWarper(sampling.top_k or logits.shape[-1]),
        TopPLogitsWarper(sampling.top_p),
    ):
        scores = warper(torch.zeros(1, 1, dtype=torch.long), scores)
    return scores.softmax(dim=-1)[0].double()


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1.0, top_p=1.0, top_k=0),
        dict(temperature=0.7, top_p=0.8, top_k=20),
        dict(temperature=1.3, top_p=0.6, top_k=0),
        dict(temperature=0.5, top_p=1.0, top_k=4),
    ],
)
def test_draw_tokens_samples_generates_distribution(settings) -> None:
    """draw_tokens (inverse CDF) against transformers' processors: chi-square over 60,000 draws, and no draw ever
    falls on a token the processors give probability 0."""
    from scipy.stats import chisquare

    sampling = SamplingConfig(**settings)
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 30, generator=gen) * 2.0
    expected = _warped_probabilities(logits, sampling, suppress=[3])
    torch.manual_seed(11)
    draws = draw_tokens(logits.expand(60_000, -1), sampling=sampling, suppress=torch.tensor([3]))
    counts = torch.bincount(draws, minlength=30).double()
    assert counts[expected == 0].sum() == 0
    support = expected > 0
    assert support.sum() >= 2 and counts[3] == 0
    observed, wanted = counts[support], expected[support] * 60_000
    assert chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue > 1e-3


def test_draw_tokens_greedy_and_rounding_edge() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.5], [5.0, 0.0, 0.0, 0.0]])
    assert draw_tokens(logits, sampling=SamplingConfig(temperature=0)).tolist() == [3, 0]
    # a uniform that rounds up to the total must still land on a token with mass, never on a masked tail token
    masked = torch.tensor([[1.0, 1.0, float("-inf"), float("-inf")]])
    full = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0)
    assert draw_tokens(masked, sampling=full, uniform=torch.ones(1, 1)).item() == 1
    assert draw_tokens(masked, sampling=full, uniform=torch.zeros(1, 1)).item() == 0


def test_lean_sampler_greedy_equals_generate_with_rows_leaving_the_batch(tiny, tmp_path, monkeypatch) -> None:
    """At T = 0 the lean loop's tokens are generate's, token for token, over left-padded prompts of unequal length
    while rows finish early and leave the batch and its KV cache (a mid-response token made a stop id). The tiny
    target of seed 1: seed 0's greedy text is one token repeated, which would hide a misplaced position."""
    from dspark.targets import load_target

    tiny = load_target("tiny", cache_dir=tmp_path, seed=1)
    greedy = dataclasses.replace(SAMPLING, temperature=0.0, max_new_tokens=10)
    prompts = [tiny.chat_prompt_ids(p.prompt) for p in PROMPTS]
    eot = tiny.tokenizer.eos_token_id
    free = [response for response, _ in sample_responses(tiny, prompts, sampling=greedy, eot=eot)]
    # a token that first appears mid-response in one row and never in another: that row ends there, the other not
    row, index = next(
        (r, j)
        for r, resp in enumerate(free)
        for j in range(1, 8)
        if resp[j] not in resp[:j] and any(resp[j] not in other for other in free)
    )
    stop = free[row][index]
    monkeypatch.setattr(tiny, "stop_token_ids", [*tiny.stop_token_ids, stop])
    reference = sample_responses(tiny, prompts, sampling=greedy, eot=eot)
    lean = sample_responses(tiny, prompts, sampling=dataclasses.replace(greedy, sampler="lean"), eot=eot)
    assert lean == reference
    assert reference[row] == (free[row][: index + 1], True)
    assert any(not hit for _, hit in reference)  # some rows ran the full length after others left


def test_lean_regeneration_end_to_end(tiny, tmp_path) -> None:
    lean = dataclasses.replace(SAMPLING, sampler="lean")
    out = run(tiny, tmp_path, sampling=lean)
    data = load_regenerated(out)
    assert len(data) == len(PROMPTS) and read_manifest(out)["sampling"]["sampler"] == "lean"
    again = load_regenerated(run(tiny, tmp_path / "again", sampling=lean))
    assert data.to_dict() == again.to_dict()  # seeded per batch: reproducible
    with pytest.raises(ValueError, match="data.sampling.sampler"):
        SamplingConfig(sampler="beam")


def test_lean_sampler_logits_equal_a_full_recomputation(tiny, monkeypatch) -> None:
    """Every step of the lean loop samples from the logits a cache-free forward over prompt + response so far gives,
    row by row without padding (positions, masks and the KV cache right while rows leave the batch: a wrong position
    alone moves the tiny target's logits by ~2e-3, far above the 1e-4 tolerance)."""
    import dspark.data.regenerate as regenerate_module

    seen: list[torch.Tensor] = []
    real_draw = regenerate_module.draw_tokens

    def spy(logits, **kwargs):
        seen.append(logits.detach().clone())
        return real_draw(logits, **kwargs)

    monkeypatch.setattr(regenerate_module, "draw_tokens", spy)
    monkeypatch.setattr(tiny, "stop_token_ids", [*tiny.stop_token_ids, *range(100, 160)])  # rows end early
    sampling = dataclasses.replace(SAMPLING, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, sampler="lean")
    prompts = [tiny.chat_prompt_ids(p.prompt) for p in PROMPTS]
    torch.manual_seed(3)
    out = sample_lean(tiny, prompts, sampling=sampling, eot=tiny.tokenizer.eos_token_id)
    steps = [len(response) - (0 if hit else 1) for response, hit in out]  # the steps each row took part in
    assert any(hit for _, hit in out) and any(not hit for _, hit in out) and len(set(steps)) > 1
    for row, (prompt, (response, _)) in enumerate(zip(prompts, out)):
        ids = torch.tensor([prompt + response[: steps[row]]])
        with torch.no_grad():
            full = tiny.model(input_ids=ids).logits[0, len(prompt) - 1 :]
        for step in range(steps[row]):
            slot = sum(1 for other in range(row) if steps[other] > step)  # rows keep their order as others leave
            assert torch.allclose(seen[step][slot], full[step], atol=1e-4), (row, step)


def test_followup_draw_is_seeded_same_domain_and_order_free() -> None:
    """data.multi_turn=followup: a prompt without later turns gets the first turn of another prompt of its domain,
    the same one for the same seed whatever the order of the list; another seed draws differently somewhere."""
    prompts = [PromptRecord(f"m{i}", "math", f"math question {i}") for i in range(6)] + [
        PromptRecord(f"c{i}", "code", f"code task {i}") for i in range(6)
    ]
    prompts.append(PromptRecord("own", "chat", "Hi.", turns=["And then?"]))
    drawn = with_followups(prompts, seed=0)
    for before, after in zip(prompts[:12], drawn):
        (follow,) = after.turns
        source = next(p for p in prompts if p.prompt == follow)
        assert source.domain == before.domain and source.id != before.id and after.prompt == before.prompt
    assert drawn[-1] == prompts[-1]  # its own later turn is kept, nothing drawn
    assert {p.id: p.turns for p in with_followups(prompts[::-1], seed=0)} == {p.id: p.turns for p in drawn}
    assert [p.turns for p in with_followups(prompts, seed=1)] != [p.turns for p in drawn]
    assert with_followups(prompts[:1], seed=0) == prompts[:1]  # alone: nothing to draw from


def test_multi_turn_modes_keys_and_every_assistant_span_trained(tiny, tmp_path) -> None:
    """off / dataset keep the keys of the bool they replace, followup has its own; a followup conversation has two
    assistant spans in its loss mask and training blocks are supervised inside both (never across the user turn)."""
    from dspark.data.blocks import build_blocks, eligible_anchor_positions

    base = dict(sampling=SAMPLING, seed=0, max_length=4096, min_loss_tokens=14)
    assert regen_cache_key(tiny, PROMPTS, **base, multi_turn="dataset") == regen_cache_key(tiny, PROMPTS, **base)
    off = regen_cache_key(tiny, PROMPTS, **base, multi_turn="off")
    assert off == regen_cache_key(tiny, PROMPTS, **base, multi_turn=False) != regen_cache_key(tiny, PROMPTS, **base)
    assert regen_cache_key(tiny, PROMPTS, **base, multi_turn="followup") not in (
        off,
        regen_cache_key(tiny, PROMPTS, **base),
    )
    with pytest.raises(ValueError, match="data.multi_turn"):
        regen_cache_key(tiny, PROMPTS, **base, multi_turn="sometimes")
    single = load_regenerated(run(tiny, tmp_path, multi_turn="off"))
    data = load_regenerated(run(tiny, tmp_path, multi_turn="followup"))
    assert read_manifest(run(tiny, tmp_path, multi_turn="followup"))["sampling"]["multi_turn"] == "followup"
    assert all(len(_masked_spans(m)) == 1 for m in single["loss_mask"])  # the control: first turns only
    for row in data:
        spans = _masked_spans(row["loss_mask"])
        assert len(spans) == 2
        ids, mask = torch.tensor([row["input_ids"]]), torch.tensor([row["loss_mask"]])
        anchors = eligible_anchor_positions(mask[0])[None]
        blocks = build_blocks(
            ids,
            mask,
            anchors,
            torch.ones_like(anchors, dtype=torch.bool),
            block_size=4,
            mask_token_id=tiny.mask_token_id,
        )
        supervised = (blocks.positions + 1)[blocks.label_valid]  # the positions of the labels trained on
        for start, end in spans:
            assert ((supervised >= start) & (supervised < end)).any()
        assert all(any(start <= int(p) < end for start, end in spans) for p in supervised)
