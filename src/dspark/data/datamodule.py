"""`DrafterDataModule`: regenerated sequences → batches of sequences with per-sequence anchors (METHOD §3).

Splits (deterministic by `seed`): sequences are ranked by a seeded hash of their prompt id; the first
`val_fraction` (at least one) form `val`, the next `calibration_fraction` form `calibration` (held out for
Sequential Temperature Scaling, METHOD §6), the rest `train`. A prompt keeps its split when other prompts are added.

Anchors: up to `max_anchors` (K) per sequence, uniform without replacement among positions with
`loss_mask[a] = loss_mask[a+1] = 1`. Training anchors are redrawn every epoch from a generator seeded by
`(seed, epoch, sequence index)`; the epoch travels with each index from `EpochSampler` (Lightning calls its
`set_epoch` at every epoch start, also through its DDP wrapper), so workers and resumed runs agree. Validation
and calibration anchors are fixed (epoch-independent) so their metrics compare across epochs.

Batch (ARCHITECTURE.md): input_ids [B,T] long (right-padded with the pad id), attention_mask [B,T] bool,
loss_mask [B,T] bool, anchors [B,N] long (padded with 0), anchor_valid [B,N] bool, sequence_index [B] long;
plus features [B,T,m·d] and final_hidden [B,T,d] (zero-padded) when a feature cache is given, and
log_normalizer [B,T] fp32 (log Σ_V exp z of the target's logits) when the cache has it.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Iterator, Sequence

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from dspark.data.blocks import sample_anchors
from dspark.data.features import FeatureCache
from dspark.data.regenerate import derive_seed, load_regenerated, read_manifest

SPLITS = ("train", "val", "calibration")


def split_indices(
    prompt_ids: Sequence[str], *, val_fraction: float, calibration_fraction: float, seed: int
) -> dict[str, list[int]]:
    """Disjoint sorted index lists for train / val / calibration (see the module docstring)."""
    n = len(prompt_ids)
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1); the default is 0.05")
    if not 0 <= calibration_fraction < 1:
        raise ValueError(f"data.calibration_fraction={calibration_fraction} must be in [0, 1); use 0 for none")
    n_val = max(1, round(val_fraction * n))
    n_cal = max(1, round(calibration_fraction * n)) if calibration_fraction > 0 else 0
    if n - n_val - n_cal < 1:
        raise ValueError(
            f"data: {n} sequences cannot give {n_val} val + {n_cal} calibration sequences and a non-empty train "
            "split; regenerate more prompts or lower data.val_fraction / data.calibration_fraction"
        )
    ranked = sorted(range(n), key=lambda i: (derive_seed(seed, "split", prompt_ids[i]), i))
    return {
        "val": sorted(ranked[:n_val]),
        "calibration": sorted(ranked[n_val : n_val + n_cal]),
        "train": sorted(ranked[n_val + n_cal :]),
    }


class EpochSampler(Sampler):
    """Yields `(position, epoch)`: a fresh seeded permutation of `range(num_items)` per epoch (or identity)."""

    def __init__(self, num_items: int, *, seed: int, shuffle: bool = True) -> None:
        self.num_items, self.seed, self.shuffle, self.epoch = num_items, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(derive_seed(self.seed, "order", self.epoch))
            order = torch.randperm(self.num_items, generator=gen).tolist()
        else:
            order = list(range(self.num_items))
        return iter([(position, self.epoch) for position in order])

    def __len__(self) -> int:
        return self.num_items


class ResumableLoader(DataLoader):
    """A DataLoader whose position inside an epoch travels in Lightning's checkpoints, so a run killed mid-epoch
    resumes at the next batch instead of re-reading the epoch from its start (or, with a cosine schedule annealing
    over one epoch, ending with the wrong batches).

    Lightning saves `state_dict()` of every train loader that has one with each checkpoint and hands it back through
    `load_state_dict` before the resumed epoch's iterator is created. The state is the number of batches the
    current epoch's iterator has yielded (the training loop takes them one by one: Lightning does not prefetch from
    a loader of known length). The next iteration skips that many batches of the same index stream — the sampler's
    epoch is set before the first batch is drawn, so the stream is the interrupted epoch's — without loading them
    where the single-process iterator allows it. Training data are a pure function of (seed, epoch, position), so
    the resumed run trains on exactly the batches the uninterrupted one would have.

    No `__init__` of its own: Lightning re-creates a loader from its constructor arguments (DDP's distributed
    sampler), which a changed signature would break; the state lives in attributes set on first use.
    """

    def state_dict(self) -> dict[str, int]:
        return {"batches": int(getattr(self, "_batches_taken", 0))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        batches = int(state_dict.get("batches", 0))
        if batches < 0 or batches > len(self):
            raise ValueError(
                f"train loader state: {batches} batches taken, but an epoch has {len(self)}; the "
                "checkpoint belongs to other data (delete the run's checkpoints/ to train afresh)"
            )
        self._resume_skip = batches

    def __iter__(self) -> Iterator[Any]:
        # a generator: nothing runs until the first batch is asked for, i.e. after Lightning set the sampler's epoch
        skip, self._resume_skip = int(getattr(self, "_resume_skip", 0)), 0
        iterator = super().__iter__()
        self._batches_taken = 0
        index_stream = getattr(iterator, "_sampler_iter", None) if self.num_workers == 0 else None
        for _ in range(skip):
            if index_stream is not None:
                next(index_stream)  # the batch's indices only: nothing is loaded
            else:
                next(iterator)  # worker processes prefetch their indices: load and drop the batch
            self._batches_taken += 1
        for batch in iterator:
            self._batches_taken += 1
            yield batch


class AnchoredSequences(Dataset):
    """One split's sequences with sampled anchors. `item` is a position or `(position, epoch)`.

    `fixed_anchors=True` ignores the epoch (validation / calibration). Returns input_ids [T] long, loss_mask [T]
    bool, anchors [n ≤ K] long, index (global sequence index), and features / final_hidden when cached.
    """

    def __init__(
        self,
        data: Any,
        indices: list[int],
        *,
        max_anchors: int,
        seed: int,
        stream: str,
        fixed_anchors: bool,
        features: FeatureCache | None = None,
    ) -> None:
        self.data, self.indices, self.max_anchors = data, indices, max_anchors
        self.seed, self.stream, self.fixed_anchors, self.features = seed, stream, fixed_anchors, features

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item: int | tuple[int, int]) -> dict[str, Any]:
        position, epoch = item if isinstance(item, tuple) else (item, 0)
        index = self.indices[position]
        row = self.data[index]
        loss_mask = row["loss_mask"].bool()
        epoch_part = "fixed" if self.fixed_anchors else epoch
        gen = torch.Generator().manual_seed(derive_seed(self.seed, self.stream, epoch_part, index))
        out = {
            "input_ids": row["input_ids"].long(),
            "loss_mask": loss_mask,
            "index": index,
            "anchors": sample_anchors(loss_mask, max_anchors=self.max_anchors, generator=gen),
        }
        if self.features is not None:
            out["features"], out["final_hidden"] = self.features[index]
            log_z = self.features.log_normalizer(index)
            if log_z is not None:
                out["log_normalizer"] = log_z
        return out


def collate_sequences(
    items: list[dict[str, Any]], *, pad_token_id: int, feature_dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """Right-pad a list of `AnchoredSequences` items into the batch dict of the module docstring."""
    length = max(len(it["input_ids"]) for it in items)
    num_anchors = max(1, max(len(it["anchors"]) for it in items))
    batch = len(items)
    out = {
        "input_ids": torch.full((batch, length), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros(batch, length, dtype=torch.bool),
        "loss_mask": torch.zeros(batch, length, dtype=torch.bool),
        "anchors": torch.zeros(batch, num_anchors, dtype=torch.long),
        "anchor_valid": torch.zeros(batch, num_anchors, dtype=torch.bool),
        "sequence_index": torch.tensor([it["index"] for it in items], dtype=torch.long),
    }
    for b, it in enumerate(items):
        t, n = len(it["input_ids"]), len(it["anchors"])
        out["input_ids"][b, :t] = it["input_ids"]
        out["attention_mask"][b, :t] = True
        out["loss_mask"][b, :t] = it["loss_mask"]
        out["anchors"][b, :n] = it["anchors"]
        out["anchor_valid"][b, :n] = True
    if "log_normalizer" in items[0]:
        out["log_normalizer"] = torch.zeros(batch, length, dtype=torch.float32)
        for b, it in enumerate(items):
            out["log_normalizer"][b, : len(it["log_normalizer"])] = it["log_normalizer"]
    if "features" in items[0]:
        for name in ("features", "final_hidden"):
            width = items[0][name].shape[-1]
            out[name] = torch.zeros(batch, length, width, dtype=feature_dtype)
            for b, it in enumerate(items):
                out[name][b, : len(it[name])] = it[name].to(feature_dtype)
    return out


class DrafterDataModule(L.LightningDataModule):
    """Batches of regenerated sequences with anchors for drafter training (METHOD §3).

    Args:
        regen_dir: a finished `regenerate_responses` directory.
        batch_size: sequences per batch (B).
        max_anchors: K, anchors per sequence (DeepSpec 512).
        block_size: γ; recorded with the data hyper-parameters (blocks are built from the batch by
            `dspark.data.blocks.build_blocks`, which needs it).
        val_fraction / calibration_fraction: held-out shares (see `split_indices`).
        feature_dir: a finished `cache_features` directory; adds features / final_hidden to each batch.
        pad_token_id: padding id; None takes the regeneration manifest's.
    """

    def __init__(
        self,
        regen_dir: Path,
        *,
        batch_size: int,
        max_anchors: int,
        block_size: int,
        val_fraction: float = 0.05,
        calibration_fraction: float = 0.0,
        num_workers: int = 0,
        seed: int = 0,
        feature_dir: Path | None = None,
        pad_token_id: int | None = None,
        feature_dtype: torch.dtype = torch.float32,
        split_seed: int | None = None,
    ) -> None:
        super().__init__()
        for key, value in (("batch_size", batch_size), ("max_anchors", max_anchors), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"data.{key}={value} must be >= 1")
        self.regen_dir, self.feature_dir = Path(regen_dir), feature_dir
        self.batch_size, self.max_anchors, self.block_size = batch_size, max_anchors, block_size
        self.val_fraction, self.calibration_fraction = val_fraction, calibration_fraction
        self.num_workers, self.seed, self.feature_dtype = num_workers, seed, feature_dtype
        # the split and the held-out splits' fixed anchors follow the data's seed (`data.seed`), training order and
        # anchors the run's: seed replicates on shared data are measured on the same held-out blocks
        self.split_seed = seed if split_seed is None else split_seed
        self.manifest = read_manifest(self.regen_dir)
        self.pad_token_id = int(self.manifest["pad_token_id"] if pad_token_id is None else pad_token_id)
        self.splits: dict[str, AnchoredSequences] = {}
        self.split_index: dict[str, list[int]] = {}
        self.train_sampler: EpochSampler | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        data = load_regenerated(self.regen_dir)
        features = FeatureCache(self.feature_dir) if self.feature_dir is not None else None
        if features is not None and len(features) != len(data):
            raise ValueError(
                f"data.feature_dir: {len(features)} cached sequences but {len(data)} regenerated; "
                "rebuild the feature cache for this regenerated dataset"
            )
        self.split_index = split_indices(
            data["prompt_id"],
            val_fraction=self.val_fraction,
            calibration_fraction=self.calibration_fraction,
            seed=self.split_seed,
        )
        data = data.with_format("torch", columns=["input_ids", "loss_mask"])
        for name in SPLITS:
            self.splits[name] = AnchoredSequences(
                data,
                self.split_index[name],
                max_anchors=self.max_anchors,
                seed=self.seed if name == "train" else self.split_seed,
                stream=name,
                fixed_anchors=name != "train",
                features=features,
            )
        self.train_sampler = EpochSampler(len(self.split_index["train"]), seed=self.seed, shuffle=True)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose anchors and order the train loader yields (Lightning does this itself)."""
        self._require_setup().set_epoch(epoch)

    def train_dataloader(self) -> DataLoader:
        sampler = self._require_setup()
        return self._loader(self.splits["train"], sampler=sampler, resumable=True)

    def val_dataloader(self) -> DataLoader:
        self._require_setup()
        return self._loader(self.splits["val"], sampler=None)

    def calibration_dataloader(self) -> DataLoader:
        self._require_setup()
        return self._loader(self.splits["calibration"], sampler=None)

    def prompt_ids(self, split: str) -> list[list[int]]:
        """Each sequence's tokens before its first loss token (the templated first prompt), e.g. for STS rounds."""
        dataset = self.splits[split] if self.splits else None
        if dataset is None:
            raise ValueError(f"data split {split!r}: call setup() first; splits are {SPLITS}")
        rows = [dataset.data[i] for i in dataset.indices]
        return [row["input_ids"][: int(row["loss_mask"].long().argmax())].tolist() for row in rows]

    def _loader(self, dataset: AnchoredSequences, *, sampler: Sampler | None, resumable: bool = False) -> DataLoader:
        # a partial, not a lambda, so that spawned DataLoader workers can pickle it
        collate = partial(collate_sequences, pad_token_id=self.pad_token_id, feature_dtype=self.feature_dtype)
        loader = ResumableLoader if resumable else DataLoader
        return loader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            collate_fn=collate,
        )

    def _require_setup(self) -> EpochSampler:
        if self.train_sampler is None:
            raise ValueError("DrafterDataModule: call setup() (or let the Trainer do it) before asking for loaders")
        return self.train_sampler
