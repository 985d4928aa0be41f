"""DrafterDataModule (METHOD §3 anchors, held-out splits) and the optional target-feature cache."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from dspark.data.datamodule import DrafterDataModule, split_indices
from dspark.data.features import FeatureCache, cache_features, compute_features
from dspark.data.prompts import PromptRecord
from dspark.data.regenerate import SamplingConfig, load_regenerated, regenerate_responses

NUM_PROMPTS = 12
MAX_ANCHORS = 6


TINY_TARGET = {"threads": 1}  # tiny ops: a second thread only adds synchronisation cost (tests/conftest.py)


def random_generate(eot: int):
    """Fast stand-in for `model.generate`: random non-special tokens (from the seeded global RNG), lengths
    varying with an early end-of-turn in some rows, so sequences and anchor counts differ."""

    def generate(*, input_ids, attention_mask, generation_config):
        n = generation_config.max_new_tokens
        new = torch.randint(10, 300, (len(input_ids), n))
        for row in range(len(input_ids)):
            stop = int(torch.randint(n // 2, n + 4, ()))
            if stop < n:
                new[row, stop] = eot
                new[row, stop + 1 :] = generation_config.pad_token_id
        return torch.cat([input_ids, new], dim=1)

    return generate


@pytest.fixture(scope="module")
def regen_dir(tiny, tmp_path_factory):
    prompts = [PromptRecord(f"p{i}", "chat", f"Question number {i}?") for i in range(NUM_PROMPTS)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny.model, "generate", random_generate(tiny.tokenizer.eos_token_id))
        return regenerate_responses(
            tiny,
            prompts,
            sampling=SamplingConfig(max_new_tokens=40, batch_size=4),
            cache_dir=tmp_path_factory.mktemp("cache"),
            seed=0,
            show_progress=False,
        )


def make_dm(regen_dir, **overrides) -> DrafterDataModule:
    kwargs = dict(batch_size=4, max_anchors=MAX_ANCHORS, block_size=3, val_fraction=0.2, calibration_fraction=0.1)
    dm = DrafterDataModule(regen_dir, **{**kwargs, **overrides})
    dm.setup("fit")
    return dm


def epoch_anchors(dm: DrafterDataModule, epoch: int) -> dict[int, list[int]]:
    dm.set_epoch(epoch)
    return _anchors_by_sequence(dm.train_dataloader())


def _anchors_by_sequence(loader) -> dict[int, list[int]]:
    out = {}
    for batch in loader:
        for b, index in enumerate(batch["sequence_index"].tolist()):
            out[index] = batch["anchors"][b][batch["anchor_valid"][b]].tolist()
    return out


def test_batch_shapes_dtypes_and_anchor_eligibility(regen_dir) -> None:
    dm = make_dm(regen_dir)
    batch = next(iter(dm.train_dataloader()))
    B, T = batch["input_ids"].shape
    assert B == 4 and batch["input_ids"].dtype == torch.long
    for name in ("attention_mask", "loss_mask"):
        assert batch[name].shape == (B, T) and batch[name].dtype == torch.bool
    N = batch["anchors"].shape[1]
    assert 1 <= N <= MAX_ANCHORS and batch["anchors"].dtype == torch.long
    assert batch["anchor_valid"].shape == (B, N) and batch["anchor_valid"].dtype == torch.bool
    assert (batch["input_ids"][~batch["attention_mask"]] == dm.pad_token_id).all()
    assert not batch["loss_mask"][~batch["attention_mask"]].any()
    assert (batch["anchors"][~batch["anchor_valid"]] == 0).all()
    for b in range(B):
        anchors = batch["anchors"][b][batch["anchor_valid"][b]]
        assert batch["loss_mask"][b, anchors].all() and batch["loss_mask"][b, anchors + 1].all()


def test_splits_disjoint_and_deterministic(regen_dir) -> None:
    dm = make_dm(regen_dir)
    parts = [set(dm.split_index[name]) for name in ("train", "val", "calibration")]
    assert all(parts) and sum(map(len, parts)) == NUM_PROMPTS and len(set.union(*parts)) == NUM_PROMPTS
    assert dm.split_index == make_dm(regen_dir).split_index
    assert dm.split_index != make_dm(regen_dir, seed=1).split_index
    ids = [f"q{i}" for i in range(30)]
    tiny_val = split_indices(ids, val_fraction=0.001, calibration_fraction=0.0, seed=0)
    assert len(tiny_val["val"]) == 1 and tiny_val["calibration"] == []
    with pytest.raises(ValueError, match="data.val_fraction"):
        split_indices(ids, val_fraction=0.0, calibration_fraction=0.0, seed=0)


def test_seed_replicates_on_a_fixed_data_seed_share_the_split_and_held_out_anchors(regen_dir) -> None:
    """data.seed fixed (budget=cpu-ref): seeds 0 and 1 see the same split and held-out blocks, other training draws."""
    zero, one = make_dm(regen_dir, seed=0, split_seed=0), make_dm(regen_dir, seed=1, split_seed=0)
    assert zero.split_index == one.split_index
    assert _anchors_by_sequence(zero.val_dataloader()) == _anchors_by_sequence(one.val_dataloader())
    assert epoch_anchors(zero, 0) != epoch_anchors(one, 0)
    assert make_dm(regen_dir, seed=1).split_index == make_dm(regen_dir, seed=1, split_seed=1).split_index


def test_train_anchors_change_across_epochs_val_anchors_do_not(regen_dir) -> None:
    dm = make_dm(regen_dir)
    first, again, second = epoch_anchors(dm, 0), epoch_anchors(dm, 0), epoch_anchors(dm, 1)
    assert first == again  # a given epoch is reproducible (resume)
    assert first != second
    val_before = _anchors_by_sequence(dm.val_dataloader())
    dm.set_epoch(5)
    assert _anchors_by_sequence(dm.val_dataloader()) == val_before
    assert set(val_before) == set(dm.split_index["val"])


def test_workers_give_the_same_batches(regen_dir) -> None:
    plain, workers = make_dm(regen_dir), make_dm(regen_dir, num_workers=1)
    assert epoch_anchors(plain, 2) == epoch_anchors(workers, 2)


def test_prompt_ids_are_the_templated_prompts(tiny, regen_dir) -> None:
    dm = make_dm(regen_dir)
    data = load_regenerated(regen_dir)
    for index, ids in zip(dm.split_index["calibration"], dm.prompt_ids("calibration")):
        assert ids == tiny.chat_prompt_ids(f"Question number {data[index]['prompt_id'][1:]}?")


class AnchorRecorder(L.LightningModule):
    """Minimal module recording each epoch's anchors (checks that the Trainer drives `set_epoch`)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[dict[int, list[int]]] = []

    def on_train_epoch_start(self) -> None:
        self.seen.append({})

    def training_step(self, batch, batch_idx):
        for b, index in enumerate(batch["sequence_index"].tolist()):
            self.seen[-1][index] = batch["anchors"][b][batch["anchor_valid"][b]].tolist()
        return (self.weight * batch["anchor_valid"].sum()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader`")
def test_trainer_resamples_anchors_each_epoch(regen_dir) -> None:
    dm = DrafterDataModule(regen_dir, batch_size=4, max_anchors=MAX_ANCHORS, block_size=3, val_fraction=0.2)
    module = AnchorRecorder()
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=dm)
    assert len(module.seen) == 2 and module.seen[0].keys() == module.seen[1].keys()
    assert module.seen[0] != module.seen[1]
    assert module.seen[1] == epoch_anchors(make_dm(regen_dir, calibration_fraction=0.0), 1)


def test_feature_cache_matches_online_and_feeds_batches(tiny, regen_dir, tmp_path, monkeypatch) -> None:
    feature_dir = cache_features(
        tiny, regen_dir, cache_dir=tmp_path, batch_size=3, shard_size=5, show_progress=False, precision="fp32"
    )
    cache = FeatureCache(feature_dir)
    data = load_regenerated(regen_dir)
    assert len(cache) == len(data) == NUM_PROMPTS
    m, d = len(tiny.feature_layer_ids), tiny.hidden_size
    for index in (0, 6, 11):
        ids = torch.tensor([data[index]["input_ids"]])
        features, final_hidden = compute_features(tiny, ids, attention_mask=torch.ones_like(ids, dtype=torch.bool))
        cached_f, cached_h = cache[index]
        assert cached_f.dtype == torch.float16 and cached_f.shape == (ids.shape[1], m * d)
        torch.testing.assert_close(cached_f.float(), features[0], atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(cached_h.float(), final_hidden[0], atol=1e-2, rtol=1e-2)
    monkeypatch.setattr(tiny, "forward", lambda *a, **k: pytest.fail("a finished cache must not recompute"))
    assert cache_features(tiny, regen_dir, cache_dir=tmp_path, show_progress=False, precision="fp32") == feature_dir
    # the log-normaliser matches the full-vocabulary logits of the stored hidden states
    _, cached_h = cache[6]
    torch.testing.assert_close(
        cache.log_normalizer(6), torch.logsumexp(tiny.lm_head(cached_h.float()).float(), dim=-1), atol=1e-5, rtol=1e-5
    )
    # the expected token mass: Σ p_t over the positions that predict a supervised token, over every sequence
    expected = torch.zeros(tiny.vocab_size)
    for index in range(len(cache)):
        _, hidden = cache[index]
        probs = torch.softmax(tiny.lm_head(hidden.float()).float(), dim=-1)
        mask = torch.tensor(data[index]["loss_mask"]).bool()
        expected += probs[:-1][mask[1:]].sum(0)
    torch.testing.assert_close(cache.target_mass(), expected, atol=1e-3, rtol=1e-4)
    batch = next(iter(make_dm(regen_dir, feature_dir=feature_dir).train_dataloader()))
    B, T = batch["input_ids"].shape
    assert batch["features"].shape == (B, T, m * d) and batch["final_hidden"].shape == (B, T, d)
    assert batch["features"].dtype == torch.float32
    assert (batch["features"][~batch["attention_mask"]] == 0).all()
    index, length = int(batch["sequence_index"][0]), int(batch["attention_mask"][0].sum())
    torch.testing.assert_close(batch["final_hidden"][0, :length], cache[index][1].float())
    torch.testing.assert_close(batch["log_normalizer"][0, :length], cache.log_normalizer(index))


def test_draft_vocabulary_follows_the_target_mass_else_the_training_split_counts(tiny, regen_dir, tmp_path) -> None:
    """`model.draft_vocab_size`'s ids: the largest expected target mass of the feature cache when there is one, else
    the most frequent supervised tokens of the given rows only (the training split), stop ids always in."""
    from dspark.data.draft_vocab import draft_vocab_from_data

    data = load_regenerated(regen_dir)
    train, size = [0, 2, 5, 7], 24
    counts = torch.zeros(tiny.vocab_size, dtype=torch.long)
    for index in train:
        ids, mask = torch.tensor(data[index]["input_ids"]), torch.tensor(data[index]["loss_mask"]).bool()
        counts += torch.bincount(ids[mask], minlength=tiny.vocab_size)
    by_count = draft_vocab_from_data(regen_dir, train, target=tiny, size=size)
    assert by_count.numel() == size and set(tiny.stop_token_ids) <= set(by_count.tolist())
    chosen = torch.zeros(tiny.vocab_size, dtype=torch.bool)
    chosen[by_count] = True
    chosen_by_count = chosen.clone()
    chosen_by_count[tiny.stop_token_ids] = False  # forced in, whatever their count
    assert int(counts[chosen_by_count].min()) >= int(counts[~chosen].max())
    assert by_count.tolist() == sorted(by_count.tolist())
    feature_dir = cache_features(
        tiny, regen_dir, cache_dir=tmp_path, batch_size=4, show_progress=False, precision="fp32"
    )
    mass = FeatureCache(feature_dir).target_mass()
    by_mass = draft_vocab_from_data(regen_dir, train, target=tiny, size=size, feature_dir=feature_dir)
    assert set(tiny.stop_token_ids) <= set(by_mass.tolist()) and by_mass.numel() == size
    chosen = torch.zeros(tiny.vocab_size, dtype=torch.bool)
    chosen[by_mass] = True
    chosen_by_mass = chosen.clone()
    chosen_by_mass[tiny.stop_token_ids] = False
    assert float(mass[chosen_by_mass].min()) >= float(mass[~chosen].max())  # the mass, not the split's counts


def test_bf16_log_normalizer_and_mass_stay_close_to_fp32(tiny) -> None:
    """A bf16 prefill takes log Z and the token mass from a bf16 lm-head product and recomputes the logits near
    each row's maximum in fp32: log Z within a few thousandths of fp32 even where the logits are large enough
    (|z| ≈ 20–40, as SmolLM2's) for bf16 rounding alone to move it by hundredths (the training step reads p_t's
    draft-vocabulary rows in fp32, so an unrefined log Z made p_t sum past 1)."""
    from dspark.data.features import log_normalizer_and_mass

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, tiny.hidden_size, generator=gen)
    logits = tiny.lm_head(hidden).float()
    hidden = hidden * (30.0 / logits.abs().amax(-1, keepdim=True))  # lm_head has no bias: the largest |z| is 30
    rows = torch.arange(64) % 3 == 0
    ref_z, ref_mass = log_normalizer_and_mass(tiny, hidden, mass_rows=rows)
    torch.testing.assert_close(ref_z, torch.logsumexp(tiny.lm_head(hidden).float(), dim=-1), atol=1e-5, rtol=0)
    bf16_head = tiny.lm_head.weight.bfloat16()
    plain = torch.logsumexp(torch.nn.functional.linear(hidden.bfloat16(), bf16_head).float(), dim=-1)
    assert (plain - ref_z).abs().max() > 2e-2  # what the product alone gives: the case the refinement is for
    z, mass = log_normalizer_and_mass(tiny, hidden, mass_rows=rows, weight=bf16_head, chunk=8)
    assert z.dtype == torch.float32 and mass.dtype == torch.float32
    torch.testing.assert_close(z, ref_z, atol=5e-3, rtol=0)
    torch.testing.assert_close(mass, ref_mass, atol=1e-2, rtol=0)
    assert mass.sum().item() == pytest.approx(int(rows.sum()), rel=1e-4)  # each selected row's p_t sums to 1


def test_bf16_feature_cache_log_normalizer_is_exact_at_large_logits(tiny, regen_dir, tmp_path, monkeypatch) -> None:
    """The whole bf16 prefill: `cache_features(precision="bf16")` runs the target with bf16 copies of its linear
    weights (`autocast_linear_weights`), the LM head's included; the stored log Z must still be the fp32 logsumexp of
    the stored hidden states. The head is scaled so the logits reach SmolLM2's |z| ≈ 30, where a bf16 head product
    moves log Z by hundredths; the first fix refined with the swapped-in bf16 head and stayed ~8× off (now the
    refinement reads `hardware.uncast_weight`)."""
    head = tiny.lm_head.weight.detach()
    ids = torch.tensor([load_regenerated(regen_dir)[0]["input_ids"]])
    _, hidden = compute_features(tiny, ids, attention_mask=torch.ones_like(ids, dtype=torch.bool))
    scale = 30.0 / (hidden[0] @ head.T).abs().amax().item()
    monkeypatch.setattr(tiny.lm_head, "weight", torch.nn.Parameter(head * scale, requires_grad=False))
    feature_dir = cache_features(
        tiny, regen_dir, cache_dir=tmp_path, batch_size=3, shard_size=5, show_progress=False, precision="bf16"
    )
    assert torch.equal(tiny.lm_head.weight, head * scale)  # the swap put the fp32 head back
    cache = FeatureCache(feature_dir)
    errors, plain_errors = [], []
    for index in range(len(cache)):
        hidden = cache[index][1].float()
        exact = torch.logsumexp(hidden @ tiny.lm_head.weight.T, dim=-1)
        errors.append((cache.log_normalizer(index) - exact).abs())
        bf16_logits = torch.nn.functional.linear(hidden.bfloat16(), tiny.lm_head.weight.bfloat16()).float()
        plain_errors.append((torch.logsumexp(bf16_logits, dim=-1) - exact).abs())
    assert torch.cat(plain_errors).max() > 2e-2  # the logits are large enough for the bf16 product to be off
    assert torch.cat(errors).max() < 5e-3


def test_refine_top_logits_recomputes_exactly_the_entries_near_the_maximum() -> None:
    from dspark.data.features import refine_top_logits

    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(5, 16, generator=gen), torch.randn(40, 16, generator=gen)
    exact = hidden @ weight.T
    rough = exact + 0.5 * torch.rand(exact.shape, generator=gen)  # a low-precision product's errors
    near = rough > rough.amax(-1, keepdim=True) - 3.0
    out = refine_top_logits(rough.clone(), hidden, weight, nats=3.0)
    torch.testing.assert_close(out[near], exact[near])
    assert torch.equal(out[~near], rough[~near])


def test_length_batches_respect_row_and_token_caps() -> None:
    from dspark.data.features import length_batches

    lengths = [5, 50, 7, 300, 6, 48, 51]
    batches = length_batches(lengths, batch_size=3, token_budget=160)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 160
    assert [3] in batches  # the 300-token row alone


def test_datamodule_rejects_bad_arguments(regen_dir) -> None:
    with pytest.raises(ValueError, match="data.max_anchors"):
        DrafterDataModule(regen_dir, batch_size=2, max_anchors=0, block_size=3)
    with pytest.raises(ValueError, match="setup"):
        DrafterDataModule(regen_dir, batch_size=2, max_anchors=2, block_size=3).train_dataloader()
