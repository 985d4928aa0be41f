"""The real training path on `target=tiny`: every drafter's loss goes down over a few optimiser steps on a fixed batch,
and the frozen target (embeddings and LM head included) is bit-identical afterwards."""

from __future__ import annotations

import pytest
import torch

from dspark.config import RunConfig
from dspark.config.schema import FIXED_HEAD, LossConfig, OptimConfig
from dspark.data.blocks import sample_anchors
from dspark.drafters.factory import DRAFTER_BUILDERS, build_drafter, drafter_spec_for
from dspark.drafters.heads import SEQUENTIAL_HEADS
from dspark.targets import load_target
from dspark.training.module import DrafterModule


TINY_TARGET = {"seed": 1}  # the `tiny` fixture's options (tests/conftest.py)


def _batch(target, *, batch=2, length=96, anchors=8) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, target.vocab_size - 10, (batch, length), generator=gen)
    ids[ids == target.mask_token_id] = 11
    loss_mask = torch.zeros(batch, length, dtype=torch.bool)
    loss_mask[:, length // 3 :] = True
    picked = torch.stack([sample_anchors(loss_mask[b], max_anchors=anchors, generator=gen) for b in range(batch)])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(loss_mask),
        "loss_mask": loss_mask,
        "anchors": picked,
        "anchor_valid": torch.ones_like(picked, dtype=torch.bool),
    }


# Every registered drafter with the paper's loss (each registered head where model.head chooses it), then D-PARD and
# a confidence head without W_1 on a few of them.
PAPER_CASES = [
    (kind, head, "paper")
    for kind in DRAFTER_BUILDERS.ordered()
    for head in ([FIXED_HEAD[kind]] if FIXED_HEAD.get(kind) else SEQUENTIAL_HEADS.ordered())
]


@pytest.mark.parametrize(
    "kind, head, objective",
    PAPER_CASES
    + [
        ("dspark", "markov", "dpard"),
        ("dspark", "gated", "dpard"),
        ("dflash", "none", "dpard"),
        ("dspark", "markov", "paper-conf-no-markov"),
    ],
)
def test_loss_goes_down_and_target_stays_frozen(tiny, kind, head, objective, one_thread):
    torch.manual_seed(0)
    cfg = RunConfig()
    cfg.model.head, cfg.model.depth, cfg.model.markov_rank = head, 1, 32
    cfg.model.confidence_with_markov = objective != "paper-conf-no-markov"
    spec = drafter_spec_for(kind=kind, model_cfg=cfg.model, target=tiny)
    weights = {"alpha_ce": 0.1, "alpha_tv": 0.9, "alpha_conf": 1.0 if kind == "dspark" else 0.0, "decay": 4.0}
    if kind == "dflash":
        weights.update(alpha_ce=1.0, alpha_tv=0.0)
    if objective == "dpard":
        weights.update(kind="dpard", dpard_alpha=0.5)
    module = DrafterModule(
        drafter=build_drafter(spec, tiny),
        target=tiny,
        drafter_kind=kind,
        block_size=spec.block_size,
        loss=LossConfig(**weights),
        optim=OptimConfig(lr=3e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, warmup_fraction=0.0),
        drafter_config=spec.to_dict(),
    )
    frozen_before = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    assert not any(p is q for p in module.parameters() for q in tiny.model.parameters())
    optimizer = torch.optim.AdamW(module.drafter.parameters(), lr=3e-3)
    batch = _batch(tiny)
    losses = []
    for _ in range(12):
        loss = module._run(batch, "train")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Soft targets from a near-uniform random target put a high floor under CE/KL-type losses (EAGLE-3 sits close
    # to the target entropy), so require a clear, steady decrease rather than a fixed ratio.
    assert losses[-1] < losses[0] and max(losses[-3:]) < min(losses[:3]), losses
    if kind == "dspark":
        assert losses[-1] < 0.9 * losses[0], losses
    for name, value in tiny.model.state_dict().items():
        assert torch.equal(value, frozen_before[name]), f"target parameter {name} changed"
    assert all(p.grad is None for p in tiny.model.parameters())


def test_checkpoint_for_another_target_or_block_size_is_refused(tiny, tmp_path):
    """A drafter.pt trained for one target / γ cannot be loaded for another (clear error, not wrong numbers)."""
    from dspark.drafters.checkpoint import load_drafter, save_drafter

    cfg = RunConfig()
    cfg.model.depth, cfg.model.markov_rank = 1, 16
    spec = drafter_spec_for(kind="dspark", model_cfg=cfg.model, target=tiny)
    path = tmp_path / "drafter.pt"
    save_drafter(path, spec=spec, state_dict=build_drafter(spec, tiny).state_dict(), metrics={})
    drafter, loaded, _ = load_drafter(path, tiny, block_size=spec.block_size)
    assert loaded == spec
    with pytest.raises(ValueError, match="model.block_size"):
        load_drafter(path, tiny, block_size=spec.block_size + 4)
    other = load_target("tiny", cache_dir=tmp_path / "targets", seed=7)
    with pytest.raises(ValueError, match="another target"):
        load_drafter(path, other)
    with pytest.raises(ValueError, match="stage=train"):
        load_drafter(tmp_path / "missing.pt", tiny)


def test_fused_cpu_optimizer_is_clipped_under_bf16_autocast(tiny, one_thread, monkeypatch, tmp_path):
    """The recipe's fused CPU AdamW with Lightning's bf16-mixed precision and gradient clipping: Lightning's plugin
    refuses to clip fused optimizers, so the module clips itself — the step runs and the norm is clipped."""
    import lightning as L

    torch.manual_seed(0)
    cfg = RunConfig()
    cfg.model.depth, cfg.model.markov_rank = 1, 16
    spec = drafter_spec_for(kind="dspark", model_cfg=cfg.model, target=tiny)
    module = DrafterModule(
        drafter=build_drafter(spec, tiny),
        target=tiny,
        drafter_kind="dspark",
        block_size=spec.block_size,
        loss=LossConfig(),
        optim=OptimConfig(lr=1e-3),
        drafter_config=spec.to_dict(),
    )
    clipped: list[float] = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *args, **kwargs):
        total = real_clip(params, max_norm, *args, **kwargs)
        clipped.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))))
        return total

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    trainer = L.Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        max_steps=2,
        gradient_clip_val=1e-3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([_batch(tiny)] * 2, batch_size=None))
    assert trainer.optimizers[0].defaults["fused"]
    assert len(clipped) == 2 and max(clipped) <= 1e-3 * 1.01, clipped
