"""Stage `export` and the import path of `model.import_from` (docs/INTEROP.md).

    python experiments/run.py stage=export export.run_dir=outputs/runs/<run>   # that run's drafter.pt
    python experiments/run.py stage=export <the training overrides>           # this config's own trained run
    python experiments/run.py stage=eval model.import_from=DIR target=...     # evaluate an exported checkpoint

`stage=export` writes `config.json` + `model.safetensors` in the layout of `export.layout` (deepspec | speculators)
into `export.out_dir` (default `<run_dir>/export-<layout>`) and attaches exactly those two files to the MLflow run
under the artifact path `export/<layout>`. An `export.out_dir` holding anything we did not write (someone's model,
notes) is refused by preflight, before the target is loaded, and left as it is. `model.import_from` turns such a
directory (or an official DeepSpec / speculators checkpoint) into this run's `drafter.pt` once, so evaluation,
calibration caching and serving run unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from dspark.config.ranges import quote
from dspark.drafters.checkpoint import DRAFTER_FILE
from dspark.files import ForeignOutputError
from dspark.stages.context import RunPaths, StageContext, run_name, training_key

log = logging.getLogger("dspark")


def preflight_errors(cfg: Any) -> list[str]:
    """Cheap checks of export.* and model.import_from (no weights read), with the key and the fix."""
    from dspark.interop.export import out_dir_error
    from dspark.interop.layouts import LAYOUTS
    from dspark.interop.load import check_import_dir

    errors: list[str] = []
    if cfg.stage == "export":
        if cfg.export.layout not in LAYOUTS:
            errors.append(f"export.layout={cfg.export.layout!r} is not one of {', '.join(LAYOUTS)}")
        if cfg.export.run_dir and not (Path(cfg.export.run_dir).expanduser() / DRAFTER_FILE).is_file():
            errors.append(
                f"export.run_dir={cfg.export.run_dir} holds no {DRAFTER_FILE}; point it at a trained run "
                "directory (<paths.root>/runs/<run>) or drop it to export this config's own run"
            )
        elif error := out_dir_error(export_dir(cfg, run_dir=export_run_dir(cfg))):
            errors.append(error)  # someone's model or notes there: refused before the target is loaded
        elif cfg.export.run_dir:
            errors += _readable_drafter_errors(Path(cfg.export.run_dir).expanduser() / DRAFTER_FILE)
    if cfg.model.import_from:
        try:  # config against the safetensors header: absurd sizes and damaged weights refused before any build
            fields, _ = check_import_dir(Path(cfg.model.import_from).expanduser())
        except (ValueError, OSError) as err:
            errors.append(f"model.import_from: {err}")
        else:
            errors += _block_size_errors(fields, cfg)
    return errors


def _block_size_errors(fields: dict[str, Any], cfg: Any) -> list[str]:
    """The imported drafter's block size against model.block_size, before the target is loaded."""
    claimed = fields["block_size"]
    if claimed == cfg.model.block_size:
        return []
    fix = f"set model.block_size={claimed}" if 1 <= claimed <= 64 else "use a drafter with a sensible block size"
    return [
        f"model.import_from={cfg.model.import_from}: the drafter drafts blocks of {quote(claimed)} but "
        f"model.block_size={cfg.model.block_size}; {fix}"
    ]


def _readable_drafter_errors(path: Path) -> list[str]:
    """A drafter.pt that is not a safe torch file of tensors (pickled objects, damaged), found in preflight: the
    file is memory-mapped, so no weights are read."""
    from dspark.drafters.checkpoint import REEXPORT_FIX, load_weights_only

    try:
        load_weights_only(path, fix=f"export.run_dir: {REEXPORT_FIX}", mmap=True)
    except ValueError as err:
        return [str(err)]
    return []


def export_run_dir(cfg: Any) -> Path:
    """The run directory exported: `export.run_dir`, else this config's own (`StageContext.run_dir`)."""
    if cfg.export.run_dir:
        return Path(cfg.export.run_dir).expanduser()
    return RunPaths.from_config(cfg).runs / f"{run_name(cfg)}-{training_key(cfg)}"


def export_dir(cfg: Any, *, run_dir: Path) -> Path:
    """Where the export of `run_dir` goes: `export.out_dir`, else `<run_dir>/export-<layout>`."""
    return Path(cfg.export.out_dir).expanduser() if cfg.export.out_dir else run_dir / f"export-{cfg.export.layout}"


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
    from dspark.interop.export import EXPORT_FILES, out_dir_error
    from dspark.tracking.artifacts import log_files

    cfg = ctx.cfg.export
    run_dir = Path(cfg.run_dir).expanduser() if cfg.run_dir else ctx.run_dir
    drafter_path = run_dir / DRAFTER_FILE
    if not drafter_path.is_file():
        raise ValueError(
            f"No trained drafter at {drafter_path}; run stage=train with the same overrides first, or "
            "set export.run_dir=<a run directory with drafter.pt>"
        )
    out_dir = export_dir(ctx.cfg, run_dir=run_dir)
    if error := out_dir_error(out_dir):  # preflight said so already; this guards a caller that skipped it
        raise ForeignOutputError(error)
    run_ctx = _run_context(ctx, run_dir) if cfg.run_dir else ctx
    target = run_ctx.load_target()
    drafter, spec, _ = load_drafter(drafter_path, target)
    export_drafter(
        drafter, spec, target, out_dir, layout=cfg.layout, dtype=cfg.dtype, num_anchors=run_ctx.cfg.data.max_anchors
    )
    log.info("exported %s (%s, %s) to %s", drafter_path, cfg.layout, cfg.dtype, out_dir)
    if ctx.store is not None and ctx.run_id is not None:  # the files written, not whatever else the folder holds
        log_files(
            ctx.store, ctx.run_id, [out_dir / name for name in EXPORT_FILES], artifact_path=f"export/{cfg.layout}"
        )
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
