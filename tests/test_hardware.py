"""bf16 detection (`dspark.hardware`): which CPU flags count, the override, and what `auto` precisions resolve to."""
from __future__ import annotations

import pytest

from dspark import hardware

ZEN4 = "flags : fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512_bf16 vaes"
SAPPHIRE_RAPIDS = "flags : fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"
ZEN3 = "flags : fpu sse2 avx2 fma vaes"
ICE_LAKE = "flags : fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16x"  # a near-miss must not count


@pytest.mark.parametrize("cpuinfo, unit", [(SAPPHIRE_RAPIDS, "amx_bf16"), (ZEN4, "avx512_bf16"), (ZEN3, None),
                                           (ICE_LAKE, None), ("", None)])
def test_bf16_unit_is_read_from_whole_cpu_flags(cpuinfo, unit):
    assert hardware.bf16_unit_from(cpuinfo) == unit


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
