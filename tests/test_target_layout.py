"""`dspark.targets.layout`: the (W xᵀ)ᵀ few-row product, its row padding, and the per-machine choice a target
makes at load (measured, kept, overridable)."""

from __future__ import annotations

import pytest

from dspark.targets import layout


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_row_product_is_linear_up_to_summation_order(rows, with_bias):
    import torch

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 24, generator=gen)  # [B, T, K]: rows counts B·T
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen) if with_bias else None
    expected = torch.nn.functional.linear(x, weight, bias)
    got = layout.few_row_product(x, weight, bias)
    assert got.shape == expected.shape == (1, rows, 40)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Row-major like F.linear's: a strided output sends a ≥ 2-token forward's attention to SDPA's math kernel.
    assert got.is_contiguous() and got.stride() == expected.stride()
    if rows > layout.FEW_ROWS:  # beyond the few-row range it is F.linear itself
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
    got = layout.few_row_product(x, weight, bias, row_padding=table)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert got.shape == (rows, 40) and got.is_contiguous()
    if rows not in table or rows > layout.FEW_ROWS:
        assert torch.equal(got, layout.few_row_product(x, weight, bias))


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
            torch.testing.assert_close(
                layout.few_row_product(x, weight, row_padding=table),
                torch.nn.functional.linear(x, weight),
                rtol=1e-5,
                atol=1e-5,
            )
    x = torch.randn(1, 24, generator=gen, requires_grad=True)
    layout.few_row_product(x, weight, row_padding=table).sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0, keepdim=True), rtol=1e-5, atol=1e-5)


def test_padding_from_costs_pads_to_the_smallest_larger_count_cheaper_by_the_margin():
    # MKL-like costs on the Zen 3's LM head: one row (matrix-vector) and three rows dearer than two and four
    costs = {1: 9.0, 2: 6.0, 3: 7.0, 4: 5.8, 5: 6.3, 6: 8.0, 7: 10.3, 8: 9.3}
    # 1 → 2 (9.0 ≥ 1.1·6.0; 4 is cheaper still, but the smallest qualifying count is taken), 2 stays (6.0 < 1.1·5.8),
    # 3 → 4 (7.0 ≥ 6.38), 4 and 5 stay (nothing larger is cheaper), 6 stays (8.0 < 1.1·9.3), 7 → 8 (10.3 ≥ 10.23)
    assert layout.padding_from_costs(costs, margin=1.1) == {1: 2, 3: 4, 7: 8}
    assert layout.padding_from_costs(costs, margin=2.0) == {}
    assert layout.padding_from_costs({1: 5.0, 2: 5.0, 3: 5.0}) == {}  # ties never pad
    assert layout.padding_from_costs({1: 9.0, 2: 9.5, 3: 6.0}) == {1: 3, 2: 3}  # past a dearer count


def test_row_padding_is_measured_only_where_it_can_matter_and_follows_the_timings(monkeypatch):
    import torch

    monkeypatch.delenv(layout.ROW_PAD_ENV, raising=False)
    assert layout.row_padding(torch.randn(64, 32)) == ({}, {})  # in cache: never probed
    big = torch.zeros(layout.FEW_ROW_PROBE_MIN_ELEMENTS // 256, 256)
    assert layout.row_padding(big.bfloat16()) == ({}, {})
    # rows 1, 2, 3 per interleaved round; the median over rounds decides, so one noisy round does not
    timings = iter([9.0, 6.0, 6.1] + [9.2, 6.0, 9.0] + [8.8, 6.1, 6.0])
    monkeypatch.setattr(layout, "_median_ms", lambda fn, reps: next(timings))
    table, costs = layout.row_padding(big, max_rows=3, rounds=3)
    assert costs == {1: 9.0, 2: 6.0, 3: 6.1} and table == {1: 2}  # round 2's 9.0 at three rows is outvoted
    for forced, chosen in (("off", {}), ("1:2,3:4", {1: 2, 3: 4})):
        monkeypatch.setenv(layout.ROW_PAD_ENV, forced)
        assert layout.row_padding(big) == (chosen, {})
    for bad, message in (
        ("yes", "expected auto, off or n:m pairs"),
        ("3:2", "each n:m needs 1 <= n < m <= 16 \\(got 3:2\\)"),
        ("1:17", "each n:m needs .* \\(got 1:17\\)"),
    ):
        monkeypatch.setenv(layout.ROW_PAD_ENV, bad)
        with pytest.raises(ValueError, match=f"DSPARK_ROW_PADDING='{bad}': {message}"):
            layout.row_padding(big)


def test_row_padding_round_trips_through_its_text_form():
    for table in ({}, {1: 2}, {1: 4, 3: 4, 7: 8}):
        assert layout.parse_row_padding(layout.format_row_padding(table)) == table
    assert layout.format_row_padding({3: 4, 1: 2}) == "1:2,3:4"


def test_use_few_row_products_applies_the_padding_table_to_every_linear():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    x = torch.randn(3, 8)
    expected = model(x)
    calls = []
    real = layout.few_row_product

    def spy(x, weight, bias=None, *, row_padding=None):
        calls.append((x.shape[0], dict(row_padding or {})))
        return real(x, weight, bias, row_padding=row_padding)

    assert layout.use_few_row_products(model, row_padding={3: 4}) == 2
    original = layout.few_row_product
    layout.few_row_product = spy
    try:
        got = model(x)
    finally:
        layout.few_row_product = original
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert calls == [(3, {3: 4}), (3, {3: 4})]


def test_few_row_layout_is_measured_only_where_it_can_matter(monkeypatch):
    import torch

    monkeypatch.delenv(layout.FEW_ROW_LAYOUT_ENV, raising=False)
    small = torch.randn(64, 32)  # a tiny model's head: in cache, never probed
    assert layout.few_row_layout(small) == ("linear", 1.0)
    big_bf16 = torch.zeros(layout.FEW_ROW_PROBE_MIN_ELEMENTS // 512 + 1, 512, dtype=torch.bfloat16)
    assert layout.few_row_layout(big_bf16) == ("linear", 1.0)
    for forced in ("linear", "transposed"):
        monkeypatch.setenv(layout.FEW_ROW_LAYOUT_ENV, forced)
        assert layout.few_row_layout(small) == (forced, 1.0)
    monkeypatch.setenv(layout.FEW_ROW_LAYOUT_ENV, "fast")
    with pytest.raises(ValueError, match="DSPARK_FEW_ROW_LAYOUT='fast': expected auto, linear or transposed"):
        layout.few_row_layout(small)


def test_few_row_layout_follows_the_timings(monkeypatch):
    """The probe's rule: transposed only when it is FEW_ROW_MARGIN× faster at every probed row count."""
    import torch

    monkeypatch.delenv(layout.FEW_ROW_LAYOUT_ENV, raising=False)
    weight = torch.zeros(layout.FEW_ROW_PROBE_MIN_ELEMENTS // 256, 256)
    timings = iter([])

    def fake_median(fn, reps):
        return next(timings)

    monkeypatch.setattr(layout, "_median_ms", fake_median)
    timings = iter([30.0, 10.0, 40.0, 12.0])  # (shipped, transposed) at 2 and 4 rows: 3.0× and 3.3×
    assert layout.few_row_layout(weight) == ("transposed", 3.0)
    timings = iter([30.0, 10.0, 12.0, 10.0])  # 3.0× at 2 rows, only 1.2× at 4
    assert layout.few_row_layout(weight) == ("linear", pytest.approx(1.2))


def test_a_model_switched_to_few_row_products_computes_the_same_and_reads_its_current_weights():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4, bias=False))
    x = torch.randn(3, 8)
    before = model(x)
    assert layout.use_few_row_products(model) == 2
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)
    model[2].weight = torch.nn.Parameter(torch.zeros(4, 16))  # e.g. autocast_linear_weights' swap
    assert torch.equal(model(x), torch.zeros(3, 4))
    del model[0].forward, model[2].forward  # the class's forward again
    assert "forward" not in model[0].__dict__
    model[2].weight = torch.nn.Parameter(torch.randn(4, 16))
    before = model(x[:1])
    assert layout.use_few_row_products(model, row_padding={1: 2}) == 2
    torch.testing.assert_close(model(x[:1]), before, rtol=1e-5, atol=1e-6)  # one row: padded to two


def test_a_target_in_the_transposed_layout_gives_the_same_logits(monkeypatch, tmp_path):
    import torch

    from dspark.targets import load_target

    monkeypatch.setenv(layout.FEW_ROW_LAYOUT_ENV, "linear")
    shipped = load_target("tiny", cache_dir=tmp_path)
    monkeypatch.setenv(layout.FEW_ROW_LAYOUT_ENV, "transposed")
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

    monkeypatch.delenv(layout.FEW_ROW_LAYOUT_ENV, raising=False)
    monkeypatch.delenv(layout.ROW_PAD_ENV, raising=False)
    probes = []
    monkeypatch.setattr(layout, "few_row_layout", lambda w: probes.append("layout") or ("transposed", 2.5))
    monkeypatch.setattr(
        layout, "row_padding", lambda w: probes.append("padding") or ({1: 2, 3: 4}, {1: 9.0, 2: 6.0, 3: 7.0, 4: 5.8})
    )
    head = torch.zeros(layout.FEW_ROW_PROBE_MIN_ELEMENTS // 256, 256)  # big enough to be probed
    path = layout.few_row_decision_path(tmp_path, "f" * 64)
    assert path.parent == tmp_path / "hardware" and path.name.startswith("few-row-" + "f" * 16)

    def model():
        return torch.nn.Sequential(torch.nn.Linear(4, 4))

    assert layout.choose_few_row_layout(model(), head, path) == ("transposed", {1: 2, 3: 4})
    assert probes == ["layout", "padding"] and json.loads(path.read_text())["row_padding"] == "1:2,3:4"
    switched = model()
    assert layout.choose_few_row_layout(switched, head, path) == ("transposed", {1: 2, 3: 4})
    assert probes == ["layout", "padding"]  # read, not measured again
    assert "forward" in switched[0].__dict__  # and still applied to the model
    monkeypatch.setenv(layout.ROW_PAD_ENV, "off")  # an override wins over the file and is not written
    monkeypatch.setattr(layout, "row_padding", lambda w: ({}, {}))
    assert layout.choose_few_row_layout(model(), head, path) == ("transposed", {})
    assert json.loads(path.read_text())["row_padding"] == "1:2,3:4"
    monkeypatch.delenv(layout.ROW_PAD_ENV)
    path.write_text("{not json")
    assert layout.choose_few_row_layout(model(), head, path) == ("transposed", {})  # unreadable: measured again
    assert json.loads(path.read_text())["row_padding"] == "off"
    small = tmp_path / "small.json"
    assert layout.choose_few_row_layout(model(), torch.zeros(8, 4), small)[0] == "transposed"
    assert not small.exists()  # a weight the probe never measures leaves no decision behind


def test_a_few_row_choice_that_cannot_be_kept_only_warns(monkeypatch, tmp_path, caplog):
    import logging

    import torch

    monkeypatch.delenv(layout.FEW_ROW_LAYOUT_ENV, raising=False)
    monkeypatch.delenv(layout.ROW_PAD_ENV, raising=False)
    monkeypatch.setattr(layout, "few_row_layout", lambda w: ("linear", 1.2))
    blocker = tmp_path / "hardware"
    blocker.write_text("a file where the directory would go")
    head = torch.zeros(layout.FEW_ROW_PROBE_MIN_ELEMENTS // 256, 256)
    with caplog.at_level(logging.WARNING, logger="dspark"):
        assert layout.choose_few_row_layout(torch.nn.Linear(4, 4), head, blocker / "choice.json") == ("linear", {})
    assert "could not keep the few-row choice" in caplog.text
