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


@pytest.mark.parametrize("cpuinfo, unit", [(SAPPHIRE_RAPIDS, "amx_bf16"), (ZEN4, "avx512_bf16"), (ZEN3, None),
                                           (ICE_LAKE, None), ("", None)])
def test_bf16_unit_is_read_from_whole_cpu_flags(cpuinfo, unit):
    assert hardware.bf16_unit_from(cpuinfo) == unit


def test_the_machine_line_tells_cpu_generations_apart(monkeypatch):
    """Report headers and run tags name the CPU with its family/model numbers and bf16 unit: two EPYC generations
    share the model name "AMD EPYC" and differ in exactly those."""
    from pathlib import Path

    from dspark.tracking.store import git_provenance

    zen4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: zen4 if str(self) == "/proc/cpuinfo"
                        else real_read(self, *a, **k))
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


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="keep_freed_memory tunes glibc malloc only")
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


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="release_freed_memory trims glibc's heap only")
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
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                              max_new_tokens=12, pad_token_id=0)

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


# ---- few-row products: the (W xᵀ)ᵀ layout, chosen by measurement ----

@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_row_product_is_linear_up_to_summation_order(rows, with_bias):
    import torch

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 24, generator=gen)  # [B, T, K]: rows counts B·T
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen) if with_bias else None
    expected = torch.nn.functional.linear(x, weight, bias)
    got = hardware.few_row_product(x, weight, bias)
    assert got.shape == expected.shape == (1, rows, 40)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Row-major like F.linear's: a strided output sends a ≥ 2-token forward's attention to SDPA's math kernel.
    assert got.is_contiguous() and got.stride() == expected.stride()
    if rows > hardware.FEW_ROWS:  # beyond the few-row range it is F.linear itself
        assert torch.equal(got, expected)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17])
def test_a_row_padded_product_is_linear_up_to_summation_order(rows):
    """A row-padding table multiplies an n-row x as m rows (the extra ones zero) and keeps the n: the same numbers,
    row-major; row counts outside the table, and any beyond FEW_ROWS, are untouched by it."""
    import torch

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 24, generator=gen)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    table = {1: 2, 3: 4, 5: 16, 17: 20}  # 17: beyond FEW_ROWS, never padded
    got = hardware.few_row_product(x, weight, bias, row_padding=table)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert got.shape == (rows, 40) and got.is_contiguous()
    if rows not in table or rows > hardware.FEW_ROWS:
        assert torch.equal(got, hardware.few_row_product(x, weight, bias))


def test_padded_products_reuse_their_buffer_without_leaking_rows_and_keep_autograd():
    """The padding buffer is reused across calls: a 1-row product after a 3-row one (both padded into buffers) and
    after a different input must not see stale rows; under autograd the padded product still has gradients."""
    import torch

    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(40, 24, generator=gen)
    table = {1: 4, 3: 4}  # both pad into the same [4, 24] buffer
    with torch.no_grad():
        for rows in (3, 1, 3, 1):
            x = torch.randn(rows, 24, generator=gen)
            torch.testing.assert_close(hardware.few_row_product(x, weight, row_padding=table),
                                       torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    x = torch.randn(1, 24, generator=gen, requires_grad=True)
    hardware.few_row_product(x, weight, row_padding=table).sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0, keepdim=True), rtol=1e-5, atol=1e-5)


def test_padding_from_costs_pads_to_the_smallest_larger_count_cheaper_by_the_margin():
    # MKL-like costs on the Zen 3's LM head: one row (matrix-vector) and three rows dearer than two and four
    costs = {1: 9.0, 2: 6.0, 3: 7.0, 4: 5.8, 5: 6.3, 6: 8.0, 7: 10.3, 8: 9.3}
    # 1 → 2 (9.0 ≥ 1.1·6.0; 4 is cheaper still, but the smallest qualifying count is taken), 2 stays (6.0 < 1.1·5.8),
    # 3 → 4 (7.0 ≥ 6.38), 4 and 5 stay (nothing larger is cheaper), 6 stays (8.0 < 1.1·9.3), 7 → 8 (10.3 ≥ 10.23)
    assert hardware.padding_from_costs(costs, margin=1.1) == {1: 2, 3: 4, 7: 8}
    assert hardware.padding_from_costs(costs, margin=2.0) == {}
    assert hardware.padding_from_costs({1: 5.0, 2: 5.0, 3: 5.0}) == {}  # ties never pad
    assert hardware.padding_from_costs({1: 9.0, 2: 9.5, 3: 6.0}) == {1: 3, 2: 3}  # past a dearer count


def test_row_padding_is_measured_only_where_it_can_matter_and_follows_the_timings(monkeypatch):
    import torch

    monkeypatch.delenv(hardware.ROW_PAD_ENV, raising=False)
    assert hardware.row_padding(torch.randn(64, 32)) == ({}, {})  # in cache: never probed
    big = torch.zeros(hardware.FEW_ROW_PROBE_MIN_ELEMENTS // 256, 256)
    assert hardware.row_padding(big.bfloat16()) == ({}, {})
    # rows 1, 2, 3 per interleaved round; the median over rounds decides, so one noisy round does not
    timings = iter([9.0, 6.0, 6.1] + [9.2, 6.0, 9.0] + [8.8, 6.1, 6.0])
    monkeypatch.setattr(hardware, "_median_ms", lambda fn, reps: next(timings))
    table, costs = hardware.row_padding(big, max_rows=3, rounds=3)
    assert costs == {1: 9.0, 2: 6.0, 3: 6.1} and table == {1: 2}  # round 2's 9.0 at three rows is outvoted
    for forced, chosen in (("off", {}), ("1:2,3:4", {1: 2, 3: 4})):
        monkeypatch.setenv(hardware.ROW_PAD_ENV, forced)
        assert hardware.row_padding(big) == (chosen, {})
    for bad, message in (("yes", "expected auto, off or n:m pairs"),
                         ("3:2", "each n:m needs 1 <= n < m <= 16 \\(got 3:2\\)"),
                         ("1:17", "each n:m needs .* \\(got 1:17\\)")):
        monkeypatch.setenv(hardware.ROW_PAD_ENV, bad)
        with pytest.raises(ValueError, match=f"DSPARK_ROW_PADDING='{bad}': {message}"):
            hardware.row_padding(big)


def test_row_padding_round_trips_through_its_text_form():
    for table in ({}, {1: 2}, {1: 4, 3: 4, 7: 8}):
        assert hardware.parse_row_padding(hardware.format_row_padding(table)) == table
    assert hardware.format_row_padding({3: 4, 1: 2}) == "1:2,3:4"


def test_use_few_row_products_applies_the_padding_table_to_every_linear():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    x = torch.randn(3, 8)
    expected = model(x)
    calls = []
    real = hardware.few_row_product

    def spy(x, weight, bias=None, *, row_padding=None):
        calls.append((x.shape[0], dict(row_padding or {})))
        return real(x, weight, bias, row_padding=row_padding)

    assert hardware.use_few_row_products(model, row_padding={3: 4}) == 2
    original = hardware.few_row_product
    hardware.few_row_product = spy
    try:
        got = model(x)
    finally:
        hardware.few_row_product = original
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert calls == [(3, {3: 4}), (3, {3: 4})]


def test_few_row_layout_is_measured_only_where_it_can_matter(monkeypatch):
    import torch

    monkeypatch.delenv(hardware.FEW_ROW_LAYOUT_ENV, raising=False)
    small = torch.randn(64, 32)  # a tiny model's head: in cache, never probed
    assert hardware.few_row_layout(small) == ("linear", 1.0)
    big_bf16 = torch.zeros(hardware.FEW_ROW_PROBE_MIN_ELEMENTS // 512 + 1, 512, dtype=torch.bfloat16)
    assert hardware.few_row_layout(big_bf16) == ("linear", 1.0)
    for forced in ("linear", "transposed"):
        monkeypatch.setenv(hardware.FEW_ROW_LAYOUT_ENV, forced)
        assert hardware.few_row_layout(small) == (forced, 1.0)
    monkeypatch.setenv(hardware.FEW_ROW_LAYOUT_ENV, "fast")
    with pytest.raises(ValueError, match="DSPARK_FEW_ROW_LAYOUT='fast': expected auto, linear or transposed"):
        hardware.few_row_layout(small)


def test_few_row_layout_follows_the_timings(monkeypatch):
    """The probe's rule: transposed only when it is FEW_ROW_MARGIN× faster at every probed row count."""
    import torch

    monkeypatch.delenv(hardware.FEW_ROW_LAYOUT_ENV, raising=False)
    weight = torch.zeros(hardware.FEW_ROW_PROBE_MIN_ELEMENTS // 256, 256)
    timings = iter([])

    def fake_median(fn, reps):
        return next(timings)

    monkeypatch.setattr(hardware, "_median_ms", fake_median)
    timings = iter([30.0, 10.0, 40.0, 12.0])  # (shipped, transposed) at 2 and 4 rows: 3.0× and 3.3×
    assert hardware.few_row_layout(weight) == ("transposed", 3.0)
    timings = iter([30.0, 10.0, 12.0, 10.0])  # 3.0× at 2 rows, only 1.2× at 4
    assert hardware.few_row_layout(weight) == ("linear", pytest.approx(1.2))


def test_a_model_switched_to_few_row_products_computes_the_same_and_reads_its_current_weights():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4, bias=False))
    x = torch.randn(3, 8)
    before = model(x)
    assert hardware.use_few_row_products(model) == 2
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)
    model[2].weight = torch.nn.Parameter(torch.zeros(4, 16))  # e.g. autocast_linear_weights' swap
    assert torch.equal(model(x), torch.zeros(3, 4))
    del model[0].forward, model[2].forward  # the class's forward again
    assert "forward" not in model[0].__dict__
    model[2].weight = torch.nn.Parameter(torch.randn(4, 16))
    before = model(x[:1])
    assert hardware.use_few_row_products(model, row_padding={1: 2}) == 2
    torch.testing.assert_close(model(x[:1]), before, rtol=1e-5, atol=1e-6)  # one row: padded to two


def test_a_target_in_the_transposed_layout_gives_the_same_logits(monkeypatch, tmp_path):
    import torch

    from dspark.targets import load_target

    monkeypatch.setenv(hardware.FEW_ROW_LAYOUT_ENV, "linear")
    shipped = load_target("tiny", cache_dir=tmp_path)
    monkeypatch.setenv(hardware.FEW_ROW_LAYOUT_ENV, "transposed")
    transposed = load_target("tiny", cache_dir=tmp_path)
    assert (shipped.few_row_layout, transposed.few_row_layout) == ("linear", "transposed")
    assert "forward" in transposed.lm_head.__dict__ and "forward" not in shipped.lm_head.__dict__
    ids = torch.randint(10, shipped.vocab_size - 10, (1, 5), generator=torch.Generator().manual_seed(0))
    for target_ids in (ids[:, :1], ids[:, :3]):  # a plain step and a verify of two drafts
        a = shipped(target_ids, return_logits=True)
        b = transposed(target_ids, return_logits=True)
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.features, a.features, rtol=1e-4, atol=1e-5)


def test_a_measured_few_row_choice_is_kept_per_machine_and_read_instead_of_measuring_again(monkeypatch, tmp_path):
    """The load-time probe's choice is written once and read back on later loads, so runs on one machine compare the
    same forward path; env overrides bypass the file, an unreadable one is measured again, unprobed weights write
    nothing."""
    import json

    import torch

    import dspark.targets.base as base

    monkeypatch.delenv(hardware.FEW_ROW_LAYOUT_ENV, raising=False)
    monkeypatch.delenv(hardware.ROW_PAD_ENV, raising=False)
    probes = []
    monkeypatch.setattr(base, "few_row_layout", lambda w: probes.append("layout") or ("transposed", 2.5))
    monkeypatch.setattr(base, "row_padding", lambda w: probes.append("padding") or ({1: 2, 3: 4}, {1: 9.0, 2: 6.0,
                                                                                                   3: 7.0, 4: 5.8}))
    head = torch.zeros(hardware.FEW_ROW_PROBE_MIN_ELEMENTS // 256, 256)  # big enough to be probed
    path = base.few_row_decision_path(tmp_path, "f" * 64)
    assert path.parent == tmp_path / "hardware" and path.name.startswith("few-row-" + "f" * 16)

    def model():
        return torch.nn.Sequential(torch.nn.Linear(4, 4))

    assert base._choose_few_row_layout(model(), head, path) == ("transposed", {1: 2, 3: 4})
    assert probes == ["layout", "padding"] and json.loads(path.read_text())["row_padding"] == "1:2,3:4"
    switched = model()
    assert base._choose_few_row_layout(switched, head, path) == ("transposed", {1: 2, 3: 4})
    assert probes == ["layout", "padding"]  # read, not measured again
    assert "forward" in switched[0].__dict__  # and still applied to the model
    monkeypatch.setenv(hardware.ROW_PAD_ENV, "off")  # an override wins over the file and is not written
    monkeypatch.setattr(base, "row_padding", lambda w: ({}, {}))
    assert base._choose_few_row_layout(model(), head, path) == ("transposed", {})
    assert json.loads(path.read_text())["row_padding"] == "1:2,3:4"
    monkeypatch.delenv(hardware.ROW_PAD_ENV)
    path.write_text("{not json")
    assert base._choose_few_row_layout(model(), head, path) == ("transposed", {})  # unreadable: measured again
    assert json.loads(path.read_text())["row_padding"] == "off"
    small = tmp_path / "small.json"
    assert base._choose_few_row_layout(model(), torch.zeros(8, 4), small)[0] == "transposed"
    assert not small.exists()  # a weight the probe never measures leaves no decision behind


def test_a_few_row_choice_that_cannot_be_kept_only_warns(monkeypatch, tmp_path, caplog):
    import logging

    import torch

    import dspark.targets.base as base

    monkeypatch.delenv(hardware.FEW_ROW_LAYOUT_ENV, raising=False)
    monkeypatch.delenv(hardware.ROW_PAD_ENV, raising=False)
    monkeypatch.setattr(base, "few_row_layout", lambda w: ("linear", 1.2))
    blocker = tmp_path / "hardware"
    blocker.write_text("a file where the directory would go")
    head = torch.zeros(hardware.FEW_ROW_PROBE_MIN_ELEMENTS // 256, 256)
    with caplog.at_level(logging.WARNING, logger="dspark"):
        assert base._choose_few_row_layout(torch.nn.Linear(4, 4), head, blocker / "choice.json") == ("linear", {})
    assert "could not keep the few-row choice" in caplog.text
