"""The training progress bar: Lightning's tqdm bar, drawn right when a run resumes inside an epoch."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf


class ResumingTQDMProgressBar(TQDMProgressBar):
    """`TQDMProgressBar` that also sets up its bar for an epoch resumed from a mid-epoch checkpoint.

    Lightning skips `on_train_epoch_start` for an epoch it resumes in the middle (the epoch had started before the
    checkpoint), and that hook is where the tqdm bar learns the epoch's length and name: a resumed run drew
    `Training: 680/? [00:49, 13.62it/s]` — no total, no ETA, and a rate counting the skipped batches as done in the
    first seconds. Here the bar starts at the batches already done (tqdm's `initial`, so the rate and the ETA count
    only this process's batches) with the epoch's total and name, as an uninterrupted run shows it.
    """

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        loop = trainer.fit_loop
        if not getattr(loop, "restarted_mid_epoch", False) or self.train_progress_bar is None:
            return
        done = int(loop.epoch_loop.batch_progress.current.ready)
        bar = self.train_progress_bar
        bar.reset(total=convert_inf(self.total_train_batches))
        bar.initial = bar.n = done
        bar.set_description(f"Epoch {trainer.current_epoch}")
        bar.refresh()
