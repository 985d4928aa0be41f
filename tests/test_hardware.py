"""`dspark.hardware`: which CPU flags count as bf16, the override, what `auto` precisions resolve to, and the
allocator setting that keeps large freed blocks."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from dspark import hardware

ZEN4 = "flags : fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512_bf16 vaes"
SAPPHIRE_RAPIDS = "flags : fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"
ZEN3 = "flags : fpu sse2 avx2 fma vaes"
ICE_LAKE = "flags : fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16x"  # a near-miss must not count


@pytest.mark.parametrize(
    "cpuinfo, unit", [(SAPPHIRE_RAPIDS, "amx_bf16"), (ZEN4, "avx512_bf16"), (ZEN3, None), (ICE_LAKE, None), ("", None)]
)
def test_bf16_unit_is_read_from_whole_cpu_flags(cpuinfo, unit):
    assert hardware.bf16_unit_from(cpuinfo) == unit


def test_the_machine_line_tells_cpu_generations_apart(monkeypatch):
    """Report headers and run tags name the CPU with its family/model numbers and bf16 unit: two EPYC generations
    share the model name "AMD EPYC" and differ in exactly those."""
    from pathlib import Path

    from dspark.tracking.store import git_provenance

    zen4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    real_read = Path.read_text
    monkeypatch.setattr(
        Path, "read_text", lambda self, *a, **k: zen4 if str(self) == "/proc/cpuinfo" else real_read(self, *a, **k)
    )
    monkeypatch.setenv("DSPARK_CPU_BF16", "0")
    hardware.cpu_bf16_unit.cache_clear()
    try:
        line = hardware.machine_summary()
        assert line.startswith("AMD EPYC (family 25 model 17), ") and "bf16 unit none" in line
        assert line in git_provenance(Path(__file__).parent)["machine"]
    finally:
        hardware.cpu_bf16_unit.cache_clear()


def test_torch_capability_names_amx_when_cpuinfo_is_unreadable():
    assert hardware.bf16_unit_from("", capability="AMX") == "amx_bf16"
    assert hardware.bf16_unit_from("", capability="AVX512") is None


@pytest.mark.parametrize("forced, fast", [("1", True), ("0", False)])
def test_environment_override_wins_and_drives_auto_precisions(monkeypatch, forced, fast):
    monkeypatch.setenv("DSPARK_CPU_BF16", forced)
    hardware.cpu_bf16_unit.cache_clear()
    try:
        assert hardware.cpu_has_fast_bf16() is fast
        assert hardware.resolve_precision("auto", accelerator="cpu") == ("bf16-mixed" if fast else "32-true")
        assert hardware.resolve_precision("32-true", accelerator="cpu") == "32-true"
    finally:
        hardware.cpu_bf16_unit.cache_clear()


_FAULTS_SCRIPT = """
import resource, sys, torch
from dspark.hardware import keep_freed_memory
kept = keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    block = torch.empty(16 * 2**20)  # 64 MiB, above glibc's largest mmap threshold
    block.fill_(1.0)
    del block  # freed at once, as a training step frees its activations
for _ in range(12):  # warm-up: the heap settles after a few rounds (torch's own small allocations interleave)
    step()
rounds = []
for _ in range(6):
    before = faults()
    step()
    rounds.append(faults() - before)
print(int(kept), *rounds)
"""


def _page_faults(keep: str) -> tuple[bool, list[int]]:
    """Whether the setting took effect, and the minor page faults of each of six 64 MiB allocate-fill-free rounds."""
    env = {**os.environ, "DSPARK_KEEP_FREED_MEMORY": keep}
    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT], env=env, capture_output=True, text=True, check=True)
    kept, *rounds = out.stdout.split()
    return kept == "1", [int(faults) for faults in rounds]


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="keep_freed_memory tunes glibc malloc only",
)
def test_keep_freed_memory_reuses_large_blocks_instead_of_faulting_them_in_again():
    kept, faults_kept = _page_faults("1")
    off, faults_default = _page_faults("0")
    assert kept and not off
    pages = 64 * 2**20 // 4096
    # glibc's default maps and unmaps each 64 MiB block: every round faults all its pages in again; kept, the
    # settled heap serves the same block without a fault. Judged per round, by majority: on a busy CI machine one
    # kept round once faulted a whole block in (the heap had not settled yet: torch's small allocations interleave),
    # which a sum over rounds read as failure
    assert sum(faults >= pages for faults in faults_default) >= 5, faults_default
    assert sum(faults <= pages // 2 for faults in faults_kept) >= 4, faults_kept


_TRIM_SCRIPT = """
import torch
from dspark.hardware import keep_freed_memory, release_freed_memory
def resident_mib():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096 / 2**20
keep_freed_memory()
blocks = [torch.ones(8 * 2**20) for _ in range(8)]  # 8 × 32 MiB, kept by the heap once freed
del blocks
kept = resident_mib()
released = release_freed_memory()
print(int(released), kept - resident_mib())
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="release_freed_memory trims glibc's heap only",
)
def test_release_freed_memory_returns_kept_blocks_to_the_os():
    env = {**os.environ, "DSPARK_KEEP_FREED_MEMORY": "1"}
    out = subprocess.run([sys.executable, "-c", _TRIM_SCRIPT], env=env, capture_output=True, text=True, check=True)
    released, freed_mib = out.stdout.split()
    assert released == "1"
    assert float(freed_mib) > 200  # most of the 256 MiB the heap had kept


def test_autocast_linear_weights_is_bit_identical_and_restores_the_weights(tiny):
    """Pre-cast linear weights give exactly autocast's numbers (sampled text and features), leave a tied embedding
    in fp32, and put the original fp32 parameters back, also when the body raises."""
    import torch

    model = tiny.model
    originals = {name: p for name, p in model.named_parameters()}
    ids = torch.tensor([[5, 9, 17, 33, 2, 41, 7, 12]])

    def sample():
        torch.manual_seed(3)
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=12, pad_token_id=0
        )

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain_text, plain = sample(), tiny.forward(ids)
        with hardware.autocast_linear_weights(model) as cast:
            assert cast is model
            assert all(m.weight.dtype == torch.bfloat16 for m in model.modules() if isinstance(m, torch.nn.Linear))
            assert model.get_input_embeddings().weight.dtype == torch.float32
            fast_text, fast = sample(), tiny.forward(ids)
            # the full-precision originals stay reachable (and out of the parameters and the state_dict)
            head = tiny.lm_head
            assert hardware.uncast_weight(head).data_ptr() == originals["lm_head.weight"].data_ptr()
            assert hardware.uncast_weight(head).dtype == torch.float32
            assert set(dict(model.named_parameters())) == set(originals)
            assert not any("before_cast" in key for key in model.state_dict())
    assert torch.equal(plain_text, fast_text)
    assert hardware.uncast_weight(tiny.lm_head) is originals["lm_head.weight"]
    assert not any("weight_before_cast" in vars(m) for m in model.modules())
    assert torch.equal(plain.features, fast.features) and torch.equal(plain.final_hidden, fast.final_hidden)
    assert all(p is originals[name] for name, p in model.named_parameters())
    with pytest.raises(RuntimeError, match="boom"), hardware.autocast_linear_weights(model):
        raise RuntimeError("boom")
    assert all(p is originals[name] for name, p in model.named_parameters())
    with hardware.autocast_linear_weights(model, None):
        assert all(p is originals[name] for name, p in model.named_parameters())
