"""Training checkpoints at every epoch end and, inside an epoch, every few minutes of training.

A reference cell trains one epoch of ~760 steps (15-80 minutes on a 2-core CPU): with checkpoints at epoch ends only,
a process killed near the end (a session's time limit, a reboot, Ctrl-C) lost the whole epoch. With a checkpoint every
`trainer.checkpoint_every_min` minutes, rerunning the same command resumes from the last one and loses at most that
much; together with `ResumableLoader` (the position in the epoch travels with the checkpoint) and data that are a pure
function of (seed, epoch, position), the resumed run ends with the same drafter as an uninterrupted one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint


class EpochAndTimeCheckpoint(ModelCheckpoint):
    """Lightning's `ModelCheckpoint` at every epoch end (the latest kept, `last.ckpt` linked to it), plus a save
    after the first training batch that ends `every_seconds` or more after the previous save (or the start of
    training).

    Lightning's own triggers are exclusive (epochs *or* a time interval), and a time trigger alone leaves the epoch's
    end unsaved; this adds the time trigger beside the epoch one through the class's own save methods, so both kinds
    of file replace each other under one `save_top_k=1` and one `last.ckpt` link. `every_seconds=None` saves at
    epoch ends only. Under DDP the time decision is rank 0's, broadcast, so every rank enters the save together.
    """

    def __init__(self, dirpath: Path | str, *, every_seconds: float | None) -> None:
        super().__init__(
            dirpath=dirpath, save_last="link", save_top_k=1, every_n_epochs=1, save_on_train_epoch_end=True
        )
        self.every_seconds = every_seconds
        self._since: float | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        self._since = time.monotonic()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.every_seconds is None or self._since is None:
            return
        due = trainer.strategy.broadcast(time.monotonic() - self._since >= self.every_seconds)
        # the epoch's last batch is saved by the epoch trigger right after this hook
        if not due or trainer.fit_loop.epoch_loop._num_ready_batches_reached():
            return
        if self._should_skip_saving_checkpoint(trainer):  # sanity checks, fast_dev_run, this step already saved
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        self._since = time.monotonic()


class ResumeLoaderPosition(Callback):
    """Hands the train loader its saved position when a run resumes mid-epoch.

    Lightning stores a stateful train loader's `state_dict` with each checkpoint and loads it back when it builds
    the loader, but only if the loop state is restored by then. `configure_optimizers` asks for
    `trainer.estimated_stepping_batches` (the cosine schedule's length), which builds the train loader first, before
    the checkpoint's loop state is restored, so the saved position would never reach the loader and the resumed epoch
    would restart at its first batch. At `on_train_start` the loop state is restored and no batch has been drawn
    (`ResumableLoader` reads its skip at the first batch): this calls the fit loop's own loading step there. It is a
    no-op unless the run restarts inside an epoch.
    """

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        load = getattr(trainer.fit_loop, "_load_combined_loader_states", None)
        if load is None:  # a Lightning without it: resuming mid-epoch would silently repeat batches
            raise RuntimeError(
                "this Lightning version has no FitLoop._load_combined_loader_states: a run resumed "
                "mid-epoch cannot restore its data position; pin lightning<=2.6 or set "
                "trainer.checkpoint_every_min=0"
            )
        load()


def checkpoint_interval(minutes: float) -> float | None:
    """`trainer.checkpoint_every_min` as the callback's interval in seconds: None for 0 (epoch ends only)."""
    if minutes < 0:
        raise ValueError(
            f"trainer.checkpoint_every_min={minutes}: must be >= 0 (0 = checkpoints at epoch ends "
            "only), e.g. trainer.checkpoint_every_min=10"
        )
    return 60.0 * minutes if minutes > 0 else None
