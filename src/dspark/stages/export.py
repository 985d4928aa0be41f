"""Stage `export` and the import path of `model.import_from` (docs/INTEROP.md).

    python experiments/run.py stage=export export.run_dir=outputs/runs/<run>   # that run's drafter.pt
    python experiments/run.py stage=export <the training overrides>           # this config's own trained run
    python experiments/run.py stage=eval model.import_from=DIR target=...     # evaluate an exported checkpoint

`stage=export` writes `config.json` + `model.safetensors` in the layout of `export.layout` (deepspec | speculators)
into `export.out_dir` (default `<run_dir>/export-<layout>`) and attaches the directory to the MLflow run as the
artifact `export/<layout>`. `model.import_from` turns such a directory (or an official DeepSpec / speculators
checkpoint) into this run's `drafter.pt` once, so evaluation, calibration caching and serving run unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from dspark.drafters.checkpoint import DRAFTER_FILE
from dspark.stages.context import StageContext

log = logging.getLogger("dspark")


def preflight_errors(cfg: Any) -> list[str]:
    """Cheap checks of export.* and model.import_from (no weights read), with the key and the fix."""
    from dspark.interop.layouts import LAYOUTS
    from dspark.interop.load import describe, read_export_config

    errors: list[str] = []
    if cfg.stage == "export":
        if cfg.export.layout not in LAYOUTS:
            errors.append(f"export.layout={cfg.export.layout!r} is not one of {', '.join(LAYOUTS)}")
        if cfg.export.run_dir and not (Path(cfg.export.run_dir).expanduser() / DRAFTER_FILE).is_file():
            errors.append(
                f"export.run_dir={cfg.export.run_dir} holds no {DRAFTER_FILE}; point it at a trained run "
                "directory (<paths.root>/runs/<run>) or drop it to export this config's own run"
            )
    if cfg.model.import_from:
        try:
            path = Path(cfg.model.import_from).expanduser()
            describe(read_export_config(path), source=f"model.import_from={path}")
        except (ValueError, OSError) as err:
            errors.append(str(err))
    return errors


def _run_context(ctx: StageContext, run_dir: Path) -> StageContext:
    """A context whose config is the one `run_dir` was trained with (its config.yaml), for loading its target."""
    from dspark.config import RunConfig
    from dspark.config.loader import apply_overrides, flatten, load_yaml

    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return ctx
    cfg = apply_overrides(RunConfig(), flatten(load_yaml(saved)), source=str(saved))
    cfg.paths = ctx.cfg.paths  # caches of this invocation
    return replace(ctx, rc=replace(ctx.rc, cfg=cfg), target=None)


def run_export(ctx: StageContext) -> Path:
    """Export the trained drafter of `export.run_dir` (or of this config) and log it as an MLflow artifact."""
    from dspark.drafters.checkpoint import load_drafter
    from dspark.interop import export_drafter

    cfg = ctx.cfg.export
    run_dir = Path(cfg.run_dir).expanduser() if cfg.run_dir else ctx.run_dir
    drafter_path = run_dir / DRAFTER_FILE
    if not drafter_path.is_file():
        raise ValueError(
            f"No trained drafter at {drafter_path}; run stage=train with the same overrides first, or "
            "set export.run_dir=<a run directory with drafter.pt>"
        )
    run_ctx = _run_context(ctx, run_dir) if cfg.run_dir else ctx
    target = run_ctx.load_target()
    drafter, spec, _ = load_drafter(drafter_path, target)
    out_dir = Path(cfg.out_dir).expanduser() if cfg.out_dir else run_dir / f"export-{cfg.layout}"
    export_drafter(
        drafter, spec, target, out_dir, layout=cfg.layout, dtype=cfg.dtype, num_anchors=run_ctx.cfg.data.max_anchors
    )
    log.info("exported %s (%s, %s) to %s", drafter_path, cfg.layout, cfg.dtype, out_dir)
    if ctx.store is not None and ctx.run_id is not None:
        ctx.store.client.log_artifacts(ctx.run_id, str(out_dir), artifact_path=f"export/{cfg.layout}")
        ctx.store.client.set_tag(ctx.run_id, "export.dir", str(out_dir))
    return out_dir


def import_to_run_dir(ctx: StageContext) -> Path:
    """`model.import_from`: import the checkpoint for this run's target once into `<run_dir>/drafter.pt`."""
    from dspark.drafters.checkpoint import read_checkpoint, save_drafter
    from dspark.interop import import_drafter

    source = Path(ctx.cfg.model.import_from).expanduser()
    path = ctx.run_dir / DRAFTER_FILE
    if path.is_file():  # imported before (and maybe calibrated since): the run key includes model.import_from
        log.info("reusing the imported drafter %s (from %s)", path, source)
    else:
        drafter, spec = import_drafter(source, ctx.load_target(), block_size=ctx.cfg.model.block_size)
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        save_drafter(path, spec=spec, state_dict=drafter.state_dict(), metrics={}, calibration=None)
        log.info(
            "imported %s as %s (%s, head %s, depth %d, γ %d)",
            source,
            path,
            spec.kind,
            spec.head,
            spec.depth,
            spec.block_size,
        )
    if ctx.store is not None and ctx.run_id is not None:  # what was imported (the model.* tags describe the config)
        spec = read_checkpoint(path)["spec"]
        for key, value in (
            ("import.from", source),
            ("import.kind", spec["kind"]),
            ("import.head", spec["head"]),
            ("import.depth", spec["depth"]),
        ):
            ctx.store.client.set_tag(ctx.run_id, key, str(value))
    return path
