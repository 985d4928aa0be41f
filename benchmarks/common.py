"""What the benchmark and analysis scripts share: where they read and write, how a result file says what produced it,
how they open drafters, and how they reach a run's held-out data.

Every default path is derived from the repository root at run time (`REPO`): results go to `outputs/benchmarks/`,
targets and SPS tables to `outputs/cache` (or $DSPARK_BENCH_CACHE). What a script writes names paths relative to that
root (`repo_path`, `command_line`), so no result file carries one machine's checkout path. The scripts run as
`python benchmarks/<script>.py`, which puts this directory on sys.path: they `import common`.

Importing this module from such a script checks the paths its command line writes to before any work
(`check_output_arguments`): `--output` must be new or a result file of ours (and so its `.png` figure beside it),
`--cache-dir` (or $DSPARK_BENCH_CACHE) new, empty or a cache of ours; otherwise the script exits 2 naming it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

REPO = Path(__file__).resolve().parents[1]
#: where a script writes its results file unless --output says otherwise: under outputs/, like every run (the curated
#: record of what was measured is results/, written by hand or by `make results`, never by a run)
RESULTS = REPO / "outputs" / "benchmarks"
CACHE_ENV = "DSPARK_BENCH_CACHE"

if str(REPO / "src") not in sys.path:  # a checkout run without installing the package
    sys.path.insert(0, str(REPO / "src"))


# ---- paths ----


def default_cache_dir() -> Path:
    """The target / SPS cache of the benchmarks: $DSPARK_BENCH_CACHE, else `<repo>/outputs/cache` (the CLI's)."""
    return Path(os.environ.get(CACHE_ENV) or REPO / "outputs" / "cache")


def repo_path(path: str | Path) -> str:
    """`path` as a result file writes it: relative to the repository root when inside it, else only its name
    (`<outside the repository>/NAME`), never an absolute path of this machine."""
    path = Path(path)
    absolute = path if path.is_absolute() else (Path.cwd() / path)
    try:
        return absolute.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return path.as_posix() if not path.is_absolute() else f"<outside the repository>/{path.name}"


def without_repo_root(text: str) -> str:
    """`text` with every occurrence of the repository's absolute path made relative (command lines, messages)."""
    return text.replace(f"{REPO}/", "").replace(str(REPO), ".")


def relative_argument(token: str) -> str:
    """A command-line argument as a result file writes it: an absolute path (alone or as `KEY=PATH`) as `repo_path`
    writes it, anything else unchanged."""
    key, sep, value = token.partition("=")
    if sep and value.startswith("/"):
        return f"{key}={repo_path(value)}"
    return repo_path(token) if token.startswith("/") else token


def command_line(script: str, argv: list[str], *, prefix: str = "python") -> str:
    """`python benchmarks/SCRIPT ARGS…` as the result file records it (`relative_argument` on every argument)."""
    return " ".join([prefix, f"benchmarks/{script}", shlex.join(relative_argument(token) for token in argv)]).strip()


def add_target_arguments(parser: argparse.ArgumentParser, *, target: str = "smollm2-135m") -> None:
    """`--target` and `--cache-dir` (converted targets and SPS tables; default `default_cache_dir()`)."""
    parser.add_argument("--target", default=target)
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help=f"targets, SPS tables (default: ${CACHE_ENV} or <repo>/outputs/cache)",
    )


def write_result(text: str, output: Path) -> Path:
    """Echo a results file, then write it all-or-nothing (its folder made); a file there that is not one of our
    results is left as it is (`ForeignOutputError`, after the echo: the numbers are on the console)."""
    from dspark.files import atomic_write_text, check_output_file

    print(text)
    check_output_file(output, key="--output", ours=is_benchmark_result)
    atomic_write_text(output, text, key="--output")
    return output


# ---- what the command line may write over ----

#: A result file of ours names the script that wrote it (`command_line`) in its opening lines.
SCRIPT_NAMED = re.compile(r"benchmarks/[\w-]+\.py")


def is_benchmark_result(path: Path) -> bool:
    """A result file a benchmark script wrote: markdown naming its `benchmarks/<script>.py` command near the top,
    or a figure matplotlib drew."""
    from dspark.files import head_text, is_our_figure

    return is_our_figure(path) if path.suffix == ".png" else bool(SCRIPT_NAMED.search(head_text(path)))


def _flag_values(argv: list[str], flag: str) -> list[str]:
    """The values of `flag` in `argv`, written `--flag VALUE` or `--flag=VALUE`."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"{flag}=")]
    return values + [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def output_argument_errors(argv: list[str]) -> list[str]:
    """Refusals for what `argv` points a script's writes at: `--output` (and its `.png` figure) must be new or ours,
    `--cache-dir` / $DSPARK_BENCH_CACHE new, empty or a cache of ours (`dspark.stages.outputs.is_cache_entry`)."""
    from dspark.files import output_dir_error, output_file_error
    from dspark.stages.outputs import is_cache_entry

    errors = []
    for value in _flag_values(argv, "--output"):
        output = Path(value)
        for path in (output, output.with_suffix(".png")) if output.suffix != ".png" else (output,):
            errors.append(output_file_error(path, key="--output", ours=is_benchmark_result))
    caches = _flag_values(argv, "--cache-dir") + ([os.environ[CACHE_ENV]] if os.environ.get(CACHE_ENV) else [])
    errors += [output_dir_error(cache, key="--cache-dir", ours=is_cache_entry) for cache in caches]
    return [e for e in errors if e]


def check_output_arguments(argv: list[str]) -> None:
    """Exit 2 (before any work) when `output_argument_errors` refuses something."""
    errors = output_argument_errors(argv)
    if errors:
        print("error: " + "\n  - ".join(["refused before any work:", *errors]), file=sys.stderr)
        raise SystemExit(2)


# ---- provenance: the code, the machine, the load ----


def start_timing(threads: int) -> tuple[float, tuple[float, float, float]]:
    """Set torch's threads and keep freed memory as the CLI does (DSPARK_KEEP_FREED_MEMORY=0 measures glibc's
    default); returns (start time, load averages before this run's own work)."""
    from dspark.hardware import keep_freed_memory

    torch.set_num_threads(threads)
    keep_freed_memory()
    return time.time(), os.getloadavg()


def git_commit() -> str:
    """The short commit of the checkout, "(with uncommitted changes)" when tracked files differ; "unknown" without
    git. Read it at the start: the code a run imported, whatever is committed while it runs."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return commit + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_verdict(start_load: float, threads: int) -> str:
    """What the load average says: the start value is read before this run's own work (so it is other jobs'),
    the end value includes this run's own `threads`."""
    cores = os.cpu_count() or 1
    if start_load + threads > cores + 0.5:
        return (
            f"other jobs were running at the start (load {start_load:.1f}) beside this run's {threads} threads on "
            f"{cores} cores: absolute times are inflated, ratios between interleaved modes less so"
        )
    return f"the end value includes this run's own {threads} threads; no other load at the start"


def machine_line() -> str:
    """The machine in one line: `dspark.hardware.machine_summary` (CPU model, CPUs, bf16 unit, torch threads) and
    the torch build with its CPU capability."""
    from dspark.hardware import machine_summary

    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    return f"{machine_summary()}; torch {torch.__version__}" + (f" ({capability})" if capability else "")


def provenance_line(start_load: tuple[float, ...], *, threads: int, commit: str | None = None) -> str:
    """`Git commit …; <date>; 1-min load average a / b at the start / end (verdict).` for a results header."""
    end = os.getloadavg()[0]
    return (
        f"Git commit {commit or git_commit()}; {time.strftime('%Y-%m-%d %H:%M %Z')}; 1-min load average "
        f"{start_load[0]:.1f} / {end:.1f} at the start / end on {os.cpu_count()} cores "
        f"({load_verdict(start_load[0], threads)})."
    )


# ---- drafters ----


@dataclass
class Drafter:
    name: str
    module: torch.nn.Module
    trained: bool
    payload: dict = field(default_factory=dict)
    precision: str | None = None  # decode.drafter_precision of its rows; None = the script's --precision


def trained_drafters(target, specs: list[str]) -> list[Drafter]:
    """`NAME=PATH` items (a run directory or a drafter.pt) → drafters around `target`, on its device, eval mode."""
    from dspark.drafters.checkpoint import drafter_file, load_drafter

    drafters = []
    for item in specs:
        name, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"--drafter expects NAME=PATH (a run directory or drafter.pt), got {item!r}")
        module, spec, payload = load_drafter(drafter_file(path), target)
        drafters.append(
            Drafter(
                f"{name} ({spec.kind}-{spec.head}-d{spec.depth}-g{spec.block_size}, "
                f"Vd {getattr(module, 'draft_vocab_size', target.vocab_size)})",
                module.to(target.device).eval(),
                True,
                payload,
            )
        )
    return drafters


def untrained_drafter(
    target,
    *,
    kind: str = "dspark",
    head: str = "markov",
    depth: int,
    block_size: int,
    draft_vocab: int,
    seed: int = 0,
    markov_rank: int = 256,
) -> torch.nn.Module:
    """A random-weight drafter (timing does not depend on the weights) over the first `draft_vocab` ids (0 or ≥ V:
    the full vocabulary), seeded, on the target's device, eval mode."""
    from dspark.drafters.factory import DrafterSpec, build_drafter

    vd = draft_vocab if 0 < draft_vocab < target.vocab_size else 0
    spec = DrafterSpec(
        kind=kind,
        head=head,
        depth=depth,
        block_size=block_size,
        markov_rank=markov_rank if head != "none" else 0,
        feature_layers=tuple(target.feature_layer_ids),
        mask_token_id=target.mask_token_id,
        target_fingerprint=target.fingerprint,
        draft_vocab_size=vd,
    )
    torch.manual_seed(seed)
    return build_drafter(spec, target, draft_vocab_ids=torch.arange(vd) if vd else None).to(target.device).eval()


def untrained_drafters(target, *, depth: int, block_size: int, draft_vocab: int, seed: int = 0) -> list[Drafter]:
    """Random-weight stand-ins of DSpark-Markov, DFlash (both `depth` layers) and EAGLE-3; the first is DSpark's."""
    out = []
    for kind, head, layers in (("dspark", "markov", depth), ("dflash", "none", depth), ("eagle3", "none", 1)):
        module = untrained_drafter(
            target, kind=kind, head=head, depth=layers, block_size=block_size, draft_vocab=draft_vocab, seed=seed
        )
        label = f"{kind}-{head}-d{layers}" if kind != "eagle3" else "eagle3"
        out.append(Drafter(f"{label} (untrained, Vd {module.draft_vocab_size})", module, False))
    return out


# ---- a run's held-out data (the analysis scripts) ----


def locate_run(overrides: list[str]):
    """(ctx, prepared data) of the run that `experiments/run.py OVERRIDES` names; exits with what to run when its
    drafter does not exist yet. Loads neither the drafter nor the target."""
    from dspark.config import resolve_config
    from dspark.stages.context import RunPaths, StageContext
    from dspark.stages.prepare import run_prepare

    rc = resolve_config(overrides)
    ctx = StageContext(rc=rc, paths=RunPaths.from_config(rc.cfg))
    drafter_path = ctx.run_dir / "drafter.pt"
    if not drafter_path.exists():
        raise SystemExit(
            f"error: no trained drafter at {repo_path(drafter_path)}: run `python experiments/run.py "
            f"{' '.join(overrides)}` first (these arguments name the run by its training key)"
        )
    prepared = run_prepare(ctx)  # the caches exist: this only finds them (and verifies their checksums)
    return ctx, prepared


def load_validation(ctx, prepared):
    """(datamodule set up for validation, drafter, checkpoint payload) of a located run (`locate_run`)."""
    from dspark.drafters.checkpoint import load_drafter
    from dspark.stages.train import build_datamodule

    datamodule = build_datamodule(ctx, prepared)
    datamodule.setup("validate")
    drafter, _, payload = load_drafter(ctx.run_dir / "drafter.pt", ctx.load_target())
    return datamodule, drafter, payload


def load_run(overrides: list[str]):
    """(ctx, prepared data, datamodule set up for validation, drafter, checkpoint payload) of the run that
    `experiments/run.py OVERRIDES` names."""
    ctx, prepared = locate_run(overrides)
    return ctx, prepared, *load_validation(ctx, prepared)


def heldout_steps(ctx, drafter, datamodule, *, step=None, desc: str = "held-out blocks") -> Iterator[tuple[dict, Any]]:
    """The run's validation batches through `dspark.evaluation.heldout.teacher_forced_steps`: by default its own
    training step and loss weights (`validation_step`: what its `val/` metrics read), else `step`."""
    from dspark.evaluation.heldout import teacher_forced_steps, validation_step

    cfg = ctx.cfg
    return teacher_forced_steps(
        datamodule.val_dataloader(),
        drafter=drafter,
        target=ctx.load_target(),
        block_size=cfg.model.block_size,
        step=step or validation_step(cfg.drafter, cfg.loss),
        desc=desc,
    )


def reference_count(regen_dir: Path) -> int:
    """Sequences of the reference part of a mixed dataset (`data.responses=mix` stores it first); 0 for a single
    regenerated part."""
    import json

    from dspark.data.regenerate import read_manifest

    manifest = read_manifest(regen_dir)
    responses = manifest.get("part_responses") or [manifest.get("responses", "regenerate")]
    parts = manifest.get("parts") or [manifest["key"]]
    count = 0
    for key, kind in zip(parts, responses):
        if kind != "reference":
            break
        part = json.loads((regen_dir.parent / key / "manifest.json").read_text())
        count += int(part["stats"]["sequences"])
    return count


if Path(sys.argv[0]).resolve().parent == Path(__file__).resolve().parent:  # run as python benchmarks/<script>.py
    check_output_arguments(sys.argv[1:])
