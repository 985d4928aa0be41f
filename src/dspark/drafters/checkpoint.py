"""The exported drafter: one `drafter.pt` per trained drafter (in its run directory), written and read only here.

Payload (a dict): `spec` (`DrafterSpec.to_dict()`: what rebuilds the drafter around its target), `state_dict`
(the drafter's own weights, on CPU; the target's frozen embedding and LM head are never in it), `metrics` (the
final training metrics, floats) and `calibration` (STS fits keyed by decoding temperature, written by
`dspark.evaluation.calibrate`; None until the first fit).
"""

from __future__ import annotations

import pickle
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark.drafters.factory import DrafterSpec, build_drafter, check_spec_matches, state_shapes
from dspark.files import atomic_output

DRAFTER_FILE = "drafter.pt"
QUOTE_LIMIT = 80  # characters of torch's message an error quotes
LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.")  # a draft layer's parameters (backbone.layers.<i>.)
REEXPORT_FIX = (
    "A drafter.pt written by DSpark Lab holds nothing else: if this one is yours, delete it and rerun the same "
    "command (training resumes from the run's checkpoints/last.ckpt and exports it again); else train a new drafter."
)


def drafter_file(run_dir_or_path: str | Path) -> Path:
    """The checkpoint of a run directory (`<dir>/drafter.pt`), or the path itself when it is a file."""
    path = Path(run_dir_or_path)
    return path / DRAFTER_FILE if path.is_dir() else path


def save_drafter(
    path: Path, *, spec: DrafterSpec, state_dict: dict, metrics: dict[str, float], calibration: dict | None = None
) -> None:
    """Write the exported drafter (spec + weights [+ STS temperatures]) all-or-nothing (`dspark.files`): a full
    disk or a read-only directory raises `OutputError` naming the path, and any previous drafter.pt is unchanged."""
    payload = {
        "spec": spec.to_dict(),
        "state_dict": {k: v.cpu() for k, v in state_dict.items()},
        "metrics": metrics,
        "calibration": calibration,
    }
    with atomic_output(path) as handle:
        torch.save(payload, handle)


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The payload of a `drafter.pt` (module docstring), without building the drafter.

    Read with `torch.load(weights_only=True)` (`load_weights_only`): only tensors and plain containers (dict, list,
    str, numbers) are unpickled, so a crafted file cannot run code on load; it is refused with a ValueError naming the
    file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"No trained drafter at {path}; run stage=train first (or pass the run's drafter.pt).")
    payload = load_weights_only(path, fix=REEXPORT_FIX)
    if not isinstance(payload, dict) or not {"spec", "state_dict"} <= payload.keys():
        raise ValueError(
            f"{path} is not a drafter.pt of DSpark Lab (no 'spec' and 'state_dict'); pass the "
            f"{DRAFTER_FILE} of a run directory."
        )
    return payload


def load_weights_only(path: Path, *, fix: str, mmap: bool = False) -> Any:
    """`torch.load(path, weights_only=True)` on the CPU, every failure a ValueError naming `path` and `fix`: a file
    holding other objects is refused without torch's advice (which is to load it unsafely), a damaged one named.
    `mmap=True` maps the tensors instead of reading them (a preflight check of a large file)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} was refused: it holds something other than tensors, numbers, strings, lists and dicts (or is "
            f"not a torch file), and unpickling that could run code (torch: {_refusal_reason(err)}). {fix}"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:  # truncated, not a zip archive, unreadable
        reason = (str(err).splitlines() or [""])[0][:QUOTE_LIMIT]
        raise ValueError(f"{path} is not a readable {path.name} ({type(err).__name__}: {reason}). {fix}") from None


def load_drafter(
    path: str | Path, target: Any, *, block_size: int | None = None
) -> tuple[nn.Module, DrafterSpec, dict[str, Any]]:
    """Rebuild a drafter from `drafter.pt` around `target` (eval mode, on CPU); errors if it was trained for
    another target/γ. Returns the drafter, its spec and the whole payload. `target` is a `dspark.targets.Target`
    (not imported: targets sit above drafters).

    The spec's sizes are checked against the stored weights before the build (`check_state_fits`), so a spec that
    claims more layers or a larger head than the file holds is refused instead of allocated."""
    payload = read_checkpoint(path)
    spec = DrafterSpec.from_dict(payload["spec"], source=str(path), fix=REEXPORT_FIX)
    check_spec_matches(spec, target, block_size=block_size)
    check_state_fits(spec, payload["state_dict"], target, source=str(path))
    drafter = build_drafter(spec, target)
    drafter.load_state_dict(payload["state_dict"])
    drafter.eval()
    return drafter, spec, payload


def check_state_fits(spec: DrafterSpec, state_dict: Any, target: Any, *, source: str) -> None:
    """Every tensor the drafter of `spec` has is in `state_dict` with its shape, and nothing else: the depth first
    (counted from the layer names, so the meta build of `state_shapes` stays bounded), then every shape."""
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ValueError(f"{source}: its state_dict is not a dict of tensors. {REEXPORT_FIX}")
    layers = sorted({int(found.group(1)) for name in state_dict if (found := LAYER_NAME.search(str(name)))})
    if layers and (len(layers) != spec.depth or layers[-1] != spec.depth - 1):
        raise ValueError(
            f"{source}: its spec says depth={spec.depth} but its weights hold {len(layers)} draft layer(s). "
            f"{REEXPORT_FIX}"
        )
    misfit = _misfit(state_shapes(replace(spec, depth=max(len(layers), 1)), target), state_dict)
    if misfit is not None:
        raise ValueError(f"{source}: its weights do not fit the drafter its spec describes: {misfit}. {REEXPORT_FIX}")


def _misfit(expected: dict[str, tuple[int, ...]], state_dict: dict) -> str | None:
    """The first disagreement of `state_dict` with the expected names and shapes, or None."""
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        return f"it lacks {_quote(missing)}"
    extra = sorted(str(name) for name in set(state_dict) - set(expected))
    if extra:
        return f"nothing in the drafter takes {_quote(extra)}"
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != shape:
            return f"{name} is {tuple(state_dict[name].shape)}, the spec makes it {shape}"
    return None


def _quote(names: list[str]) -> str:
    """At most three names, each cut to QUOTE_LIMIT characters."""
    shown = ", ".join(name[:QUOTE_LIMIT] for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _refusal_reason(err: Exception) -> str:
    """What torch's weights-only unpickler refused, without its advice (which is to load the file unsafely)."""
    text = str(err)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"it calls or builds {found.group(1)[:QUOTE_LIMIT]}"
    found = re.search(r"Unsupported operand \d+", text)
    return found.group(0) if found else "not a weights-only file"
