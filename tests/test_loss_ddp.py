"""DDP loss normalisation (issue 14, defect 5; METHOD §3): the DSpark loss's Σ w·ℓ and Σ w are pooled across
data-parallel ranks, so two gloo processes on an uneven split of a batch produce exactly the gradient one process
computes on the whole batch. Dividing by each rank's own Σ w (the old behaviour, kept here as the control) gives a
different gradient whenever the ranks hold different numbers of supervised slots.

The real training path runs in each process: `DrafterModule._run` (the step function, the loss, the
normaliser) inside torch's DistributedDataParallel, which averages gradients over ranks exactly as Lightning's
DDP strategy does.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from process_group import free_port, run_ranks
from torch import nn

import dspark.training.module as module_lib
from dspark.config import RunConfig
from dspark.config.schema import LossConfig, OptimConfig
from dspark.data.blocks import sample_anchors
from dspark.drafters.factory import build_drafter, drafter_spec_for
from dspark.targets import load_target
from dspark.training.module import DrafterModule

pytestmark = [pytest.mark.ddp, pytest.mark.slow]  # two gloo processes: the slow tier (make test-all)
TARGET_SEED = 2
WORLD = 2
SHARDS = (slice(0, 1), slice(1, 4))  # rank 0 holds one short sequence, rank 1 three long ones


def _target(root: Path):
    """The tiny target (weights fixed by TARGET_SEED), materialised once under `root` and loaded by every process."""
    return load_target("tiny", cache_dir=root / "target", seed=TARGET_SEED)


def _batch(target) -> dict[str, torch.Tensor]:
    """4 sequences; row 0 supervises few slots (short loss region, 2 anchors), rows 1-3 many (8 anchors)."""
    gen = torch.Generator().manual_seed(0)
    batch, length, anchors = 4, 80, 8
    ids = torch.randint(10, target.vocab_size - 10, (batch, length), generator=gen)
    ids[ids == target.mask_token_id] = 11
    loss_mask = torch.zeros(batch, length, dtype=torch.bool)
    loss_mask[0, 70:] = True
    loss_mask[1:, 20:] = True
    picked = torch.stack([sample_anchors(loss_mask[b], max_anchors=anchors, generator=gen) for b in range(batch)])
    valid = torch.ones_like(picked, dtype=torch.bool)
    valid[0, 2:] = False
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(loss_mask),
        "loss_mask": loss_mask,
        "anchors": picked,
        "anchor_valid": valid,
    }


def _module(target) -> DrafterModule:
    torch.manual_seed(0)
    cfg = RunConfig()
    cfg.model.head, cfg.model.depth, cfg.model.markov_rank = "markov", 1, 16
    spec = drafter_spec_for(kind="dspark", model_cfg=cfg.model, target=target)
    return DrafterModule(
        drafter=build_drafter(spec, target),
        target=target,
        drafter_kind="dspark",
        block_size=spec.block_size,
        loss=LossConfig(alpha_ce=0.1, alpha_tv=0.9, alpha_conf=1.0),
        optim=OptimConfig(lr=1e-3),
        drafter_config=spec.to_dict(),
    )


class _TrainStep(nn.Module):
    """What Lightning's DDP wrapper calls: the module's training step behind DDP's forward."""

    def __init__(self, module: DrafterModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.module._run(batch, "train")


def _gradients(module: DrafterModule) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.drafter.named_parameters() if p.grad is not None}


def _shard(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[SHARDS[rank]] for k, v in batch.items()}


def _worker(rank: int, port: int, out_dir: str) -> None:
    """One rank: rebuild the module from the parent's files, run both normalisers behind DDP, save the gradients."""
    torch.set_num_threads(1)
    inputs = torch.load(Path(out_dir) / "inputs.pt", weights_only=True)
    module, batch = _module(_target(Path(out_dir))), inputs["batch"]
    module.drafter.load_state_dict(inputs["initial"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    try:
        # One DDP wrapper for both steps: a second wrapper around the same parameters would leave two reducers'
        # hooks on them. The normaliser is looked up at call time, so swapping the module attribute switches it.
        step, out = nn.parallel.DistributedDataParallel(_TrainStep(module), find_unused_parameters=True), {}
        for label, normalizer in (("pooled", module_lib.pooled_weight_sum), ("per_rank", lambda local: local)):
            module_lib.pooled_weight_sum, saved = normalizer, module_lib.pooled_weight_sum  # the control: old rule
            try:
                module.drafter.zero_grad(set_to_none=True)
                step(_shard(batch, rank)).backward()  # DDP all-reduces and averages the gradients here
                out[label] = _gradients(module)
            finally:
                module_lib.pooled_weight_sum = saved
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # nobody tears down (rank 0 hosts the rendezvous store) while another rank still talks
    finally:
        dist.destroy_process_group()


def test_pooled_weight_sum_is_the_identity_on_one_process():
    local = torch.tensor(3.5)
    assert module_lib.pooled_weight_sum(local) is local


def test_two_gloo_ranks_give_the_single_process_gradient_of_the_whole_batch(tmp_path, one_thread):
    target = _target(tmp_path)
    module, batch = _module(target), _batch(target)
    initial = {k: v.clone() for k, v in module.drafter.state_dict().items()}
    torch.save({"batch": batch, "initial": initial}, tmp_path / "inputs.pt")
    module.drafter.zero_grad(set_to_none=True)
    module._run(batch, "train").backward()  # one process, the whole batch
    single = _gradients(module)
    run_ranks(_worker, args=(free_port(), str(tmp_path)), world=WORLD)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    assert single and results[0]["pooled"].keys() == single.keys()
    for name, grad in single.items():
        for result in results:  # DDP leaves the same averaged gradient on every rank
            torch.testing.assert_close(result["pooled"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    # the control: each rank dividing by its own Σ w gives another gradient (the defect this fixes)
    worst = max(float((results[0]["per_rank"][n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in single.items())
    assert worst > 0.05, worst
