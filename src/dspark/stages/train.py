"""Stage `train`: build the drafter, the DataModule and the Lightning Trainer; fit; export `drafter.pt`.

A run directory is keyed by everything that determines the drafter (`training_key`), so an identical config reuses
a finished drafter, and an interrupted one resumes from `checkpoints/last.ckpt` (saved at epoch ends and every
`trainer.checkpoint_every_min` minutes inside an epoch, with the position in the epoch: the resumed run trains on the
batches the uninterrupted one would have).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dspark.config import ResolvedConfig
from dspark.drafters.checkpoint import DRAFTER_FILE, read_checkpoint, save_drafter
from dspark.drafters.factory import DrafterSpec, build_drafter, drafter_spec_for
from dspark.stages.context import RunPaths, StageContext
from dspark.stages.prepare import PreparedData
from dspark.training.module import DrafterModule
from dspark.training.optim import count_parameters

log = logging.getLogger("dspark")


def build_datamodule(ctx: StageContext, data: PreparedData):
    from dspark.data.datamodule import DrafterDataModule

    d = ctx.cfg.data
    return DrafterDataModule(
        data.regen_dir,
        batch_size=d.batch_size,
        max_anchors=d.max_anchors,
        block_size=ctx.cfg.model.block_size,
        val_fraction=d.val_fraction,
        calibration_fraction=d.calib_fraction,
        seed=ctx.cfg.seed,
        split_seed=ctx.cfg.data_seed,
        feature_dir=data.feature_dir,
    )


def build_module(ctx: StageContext, spec: DrafterSpec, *, draft_vocab_ids=None) -> DrafterModule:
    target = ctx.load_target()
    drafter = build_drafter(spec, target, draft_vocab_ids=draft_vocab_ids)
    init_layers = list(ctx.cfg.model.init_layers)
    if init_layers:
        from dspark.drafters.init import copy_target_layers

        copy_target_layers(drafter.backbone.layers, target, init_layers)
        log.info("draft layers initialised from target layers %s (model.init_layers)", init_layers)
    return DrafterModule(
        drafter=drafter,
        target=target,
        drafter_kind=spec.kind,
        block_size=spec.block_size,
        loss=ctx.cfg.loss,
        optim=ctx.cfg.optim,
        drafter_config=spec.to_dict(),
    )


def training_progress_bar(log_every_n_steps: int, *, stream: Any = None):
    """Lightning's tqdm bar, explicitly: with `rich` installed (an mlflow dependency) Lightning defaults to its rich
    bar, which draws nothing when stdout is not a terminal, so `make run > log` showed no training progress for 20
    minutes. tqdm writes to files too; there it refreshes every `log_every_n_steps` steps (a readable log), on a
    terminal every step. A run resumed inside an epoch starts its bar at the batches already done."""
    from dspark.training.progress import ResumingTQDMProgressBar

    stream = sys.stdout if stream is None else stream
    interactive = bool(getattr(stream, "isatty", lambda: False)())
    return ResumingTQDMProgressBar(refresh_rate=1 if interactive else max(1, int(log_every_n_steps)))


def build_trainer(ctx: StageContext, run_dir: Path):
    import lightning as L

    from dspark.training.checkpointing import EpochAndTimeCheckpoint, ResumeLoaderPosition, checkpoint_interval

    cfg = ctx.cfg
    loggers: Any = False
    if ctx.store is not None:
        from lightning.pytorch.loggers import MLFlowLogger

        loggers = MLFlowLogger(
            experiment_name=cfg.tracking.experiment, tracking_uri=ctx.store.uri, run_id=ctx.run_id, log_model=False
        )
    # the latest checkpoint only (an epoch end or, mid-epoch, every trainer.checkpoint_every_min); last.ckpt links it
    checkpoint = EpochAndTimeCheckpoint(
        run_dir / "checkpoints", every_seconds=checkpoint_interval(cfg.trainer.checkpoint_every_min)
    )
    from dspark.hardware import resolve_precision

    t, o = cfg.trainer, cfg.optim
    precision = resolve_precision(t.precision, accelerator=t.accelerator)
    log.info("training precision: %s (trainer.precision=%s)", precision, t.precision)
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=t.strategy,
        num_nodes=t.num_nodes,
        precision=precision,
        max_epochs=o.epochs,
        max_steps=o.max_steps,
        accumulate_grad_batches=o.accumulate_grad_batches,
        gradient_clip_val=o.grad_clip,
        log_every_n_steps=t.log_every_n_steps,
        val_check_interval=t.val_check_interval,
        logger=loggers,
        default_root_dir=str(run_dir),
        callbacks=[
            checkpoint,
            ResumeLoaderPosition(),
            training_progress_bar(t.log_every_n_steps),
            *ctx.trainer_callbacks,
        ],
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=False,
    )


def run_train(ctx: StageContext, data: PreparedData) -> Path:
    """Train (or reuse / resume) the drafter of this config; returns the path of the exported `drafter.pt`.

    One trainer per run directory: two processes that reach the same training key at once (two sweeps sharing a
    store, say) would otherwise both train, the second "resuming" from the first one's checkpoint and overwriting
    its drafter.pt with one that has no validation metrics. The lock makes the second wait, then reuse.
    """
    with _training_lock(Path(ctx.paths.cache) / "locks" / f"train-{ctx.run_dir.name}.lock", ctx.run_dir.name):
        return _train_or_reuse(ctx, data)


@contextlib.contextmanager
def _training_lock(path: Path, name: str) -> Iterator[None]:
    """An exclusive file lock (`<paths.cache>/locks/train-<run dir>.lock`, outside the run tree), taken by the
    launching process only: under DDP the re-executed ranks (LOCAL_RANK/RANK > 0) must not wait on rank 0's."""
    if int(os.environ.get("LOCAL_RANK", "0") or 0) > 0 or int(os.environ.get("RANK", "0") or 0) > 0:
        yield
        return
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=1)
    except Timeout:
        log.info("another process is training %s; waiting for it (then its drafter is reused)", name)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _train_or_reuse(ctx: StageContext, data: PreparedData) -> Path:
    run_dir = ctx.run_dir
    exported = run_dir / DRAFTER_FILE
    if exported.exists():
        log.info("reusing the trained drafter %s (same training config)", exported)
        return exported
    target = ctx.load_target()
    spec = drafter_spec_for(kind=ctx.cfg.drafter, model_cfg=ctx.cfg.model, target=target)
    datamodule = build_datamodule(ctx, data)
    vocab_ids = None
    if spec.draft_vocab_size:
        datamodule.setup("fit")
        from dspark.data.draft_vocab import draft_vocab_from_data

        vocab_ids = draft_vocab_from_data(
            data.regen_dir,
            datamodule.split_index["train"],
            target=target,
            size=spec.draft_vocab_size,
            feature_dir=data.feature_dir,
        )
    module = build_module(ctx, spec, draft_vocab_ids=vocab_ids)
    log.info(
        "training %s: %.2fM trainable parameters, draft vocabulary %d of %d",
        spec.kind,
        count_parameters(module.drafter) / 1e6,
        module.drafter.draft_vocab_size,
        target.vocab_size,
    )
    trainer = build_trainer(ctx, run_dir)
    last = resumable_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    fit_interruptibly(trainer, module, datamodule=datamodule, ckpt_path=None if last is None else str(last))
    if module.validated_at_step != trainer.global_step:
        # optim.max_steps can end training between two validations (budget=cpu-ref stops mid-epoch): the held-out
        # metrics stored with the drafter must describe the drafter that is stored
        trainer.validate(module, datamodule=datamodule, verbose=False)
    if trainer.global_rank == 0:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        log.info(
            "trained: held-out teacher-forced τ_prob %s, slot-1 acceptance %s, slot-2 %s, draft-vocabulary "
            "coverage of p_t %s",
            *(
                _fmt(metrics.get(k))
                for k in ("val/tau_prob", "val/accept/pos1", "val/accept/pos2", "val/vocab_coverage")
            ),
        )
        save_drafter(exported, spec=spec, state_dict=module.drafter.state_dict(), metrics=metrics)
    return exported


def resumable_checkpoint(last: Path) -> Path | None:
    """`last.ckpt` when it holds a whole checkpoint (logged: training resumes there), else None (train from the
    start). Lightning writes checkpoints through a transaction, but a kill between saving and relinking leaves
    `last.ckpt` dangling, and a damaged disk or copy leaves a cut-off or bit-flipped zip: both are refused with
    a warning here instead of failing the load (or, worse, resuming from garbage); a damaged file is kept aside."""
    import zipfile

    if not last.exists():
        if last.is_symlink():
            log.warning("%s points at a missing checkpoint (%s); training from the start", last, os.readlink(last))
            last.unlink()
        return None
    try:
        with zipfile.ZipFile(last) as archive:
            damage = archive.testzip()  # reads every member and checks its CRC
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        damage = f"{type(err).__name__}: {err}"
    if damage is None:
        log.info("resuming training from %s", last.resolve())
        return last
    real = last.resolve()
    kept = real.with_name(real.name + ".damaged")
    os.replace(real, kept)
    if last.is_symlink():
        last.unlink()
    log.warning(
        "checkpoint %s is damaged (bad member: %s); training from the start, the file is kept as %s", real, damage, kept
    )
    return None


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def fit_interruptibly(trainer: Any, module: Any, **fit_args: Any) -> None:
    """`trainer.fit`, with Ctrl-C raised as KeyboardInterrupt again: Lightning turns it into `sys.exit(1)` (after
    its MLFlowLogger marked the run FAILED) and leaves SIGINT ignored for the rest of the process."""
    import signal
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main_thread else None
    try:
        trainer.fit(module, **fit_args)
    except SystemExit as err:
        if isinstance(err.__context__, KeyboardInterrupt):  # Lightning's sys.exit(1) inside its handler
            raise KeyboardInterrupt("training interrupted") from None
        raise
    finally:
        if main_thread and handler is not None:
            signal.signal(signal.SIGINT, handler)


def recorded_training_metrics(rc: ResolvedConfig) -> dict[str, float]:
    """The metrics stored in the config's exported drafter.pt at the end of its training ({} if none)."""
    path = StageContext(rc=rc, paths=RunPaths.from_config(rc.cfg)).run_dir / DRAFTER_FILE
    if not path.exists():
        return {}
    return {k: float(v) for k, v in (read_checkpoint(path).get("metrics") or {}).items()}
