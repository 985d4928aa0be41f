"""The exported drafter: one `drafter.pt` per trained drafter (in its run directory), written and read only here.

Payload (a dict): `spec` (`DrafterSpec.to_dict()`: what rebuilds the drafter around its target), `state_dict`
(the drafter's own weights, on CPU; the target's frozen embedding and LM head are never in it), `metrics` (the
final training metrics, floats) and `calibration` (STS fits keyed by decoding temperature, written by
`dspark.evaluation.calibrate`; None until the first fit).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark.drafters.factory import DrafterSpec, build_drafter, check_spec_matches
from dspark.files import atomic_output

DRAFTER_FILE = "drafter.pt"


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

    Read with `torch.load(weights_only=True)`: only tensors and plain containers (dict, list, str, numbers) are
    unpickled, so a crafted file cannot run code on load; it is refused with a ValueError naming the file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"No trained drafter at {path}; run stage=train first (or pass the run's drafter.pt).")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} was refused: it holds something other than tensors, numbers, strings, lists and dicts (or is "
            f"not a torch file), and unpickling that could run code (torch: {_refusal_reason(err)}). A drafter.pt "
            "written by DSpark Lab holds nothing else: if this one is yours, delete it and rerun the same command "
            "(training resumes from the run's checkpoints/last.ckpt and exports it again); else train a new "
            "drafter."
        ) from None
    except (RuntimeError, EOFError) as err:  # truncated, or not a zip archive
        raise ValueError(
            f"{path} is not a readable drafter.pt ({type(err).__name__}: {str(err).splitlines()[0]}); "
            "delete it and rerun the same command to export it again."
        ) from None
    if not isinstance(payload, dict) or not {"spec", "state_dict"} <= payload.keys():
        raise ValueError(
            f"{path} is not a drafter.pt of DSpark Lab (no 'spec' and 'state_dict'); pass the "
            f"{DRAFTER_FILE} of a run directory."
        )
    return payload


def load_drafter(
    path: str | Path, target: Any, *, block_size: int | None = None
) -> tuple[nn.Module, DrafterSpec, dict[str, Any]]:
    """Rebuild a drafter from `drafter.pt` around `target` (eval mode, on CPU); errors if it was trained for
    another target/γ. Returns the drafter, its spec and the whole payload. `target` is a `dspark.targets.Target`
    (not imported: targets sit above drafters)."""
    payload = read_checkpoint(path)
    spec = DrafterSpec.from_dict(payload["spec"])
    check_spec_matches(spec, target, block_size=block_size)
    drafter = build_drafter(spec, target)
    drafter.load_state_dict(payload["state_dict"])
    drafter.eval()
    return drafter, spec, payload


def _refusal_reason(err: Exception) -> str:
    """What torch's weights-only unpickler refused, without its advice (which is to load the file unsafely)."""
    text = str(err)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"it calls or builds {found.group(1)}"
    found = re.search(r"Unsupported operand \d+", text)
    return found.group(0) if found else "not a weights-only file"
