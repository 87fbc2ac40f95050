"""Packed weights in multi-token forwards (specdec/engines/forwards/packed.py): the layers' own products up
to rounding, used only inside specdec's forwards of a few rows, once enough have run, where they
fit and timed faster; the model as it was outside them."""

from __future__ import annotations

import time

import pytest
import torch

from specdec import SpecDecoder
from specdec.compiled import compile_seconds
from specdec.engines.forwards import packed
from specdec.engines.forwards.packed import MAX_ROWS, MIN_ROWS, PACK_AFTER, PackedLinears, packed_linears
from specdec.models import tiny_random

from helpers import DRAFTING_PAYS, pin_costs, repetitive_prompt

needs_mkl = pytest.mark.skipif(not packed.available(), reason="this torch has no MKL packed products")
CPU = torch.device("cpu")


@pytest.fixture
def model():
    target = tiny_random("llama", seed=3)[0]
    yield target
    PackedLinears.forget(target)


@needs_mkl
@pytest.mark.parametrize("rows", [MIN_ROWS, 7, MAX_ROWS])
def test_a_packed_product_is_the_layers_own_up_to_rounding(rows):
    layer = torch.nn.Linear(96, 160, bias=True)
    state = PackedLinears(torch.nn.Sequential(layer))
    x = torch.randn(1, rows, 96)
    torch.testing.assert_close(state.product(layer, x), layer(x), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_a_weight_changed_in_place_is_packed_again():
    layer = torch.nn.Linear(64, 64, bias=False)
    state = PackedLinears(torch.nn.Sequential(layer))
    x = torch.randn(8, 64)
    state.product(layer, x)
    with torch.no_grad():
        layer.weight.mul_(2)
    torch.testing.assert_close(state.product(layer, x), layer(x), rtol=1e-5, atol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn(64, 64))  # replaced
    torch.testing.assert_close(state.product(layer, x), layer(x), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_the_switch_holds_only_inside_its_block_and_only_for_a_few_rows(model):
    PackedLinears.pin(model, True)
    layers = PackedLinears.of(model).layers
    assert layers and all("forward" not in layer.__dict__ for layer in layers)
    with packed_linears(model, 8, CPU) as used:
        assert used and all("forward" in layer.__dict__ for layer in layers)
    assert all("forward" not in layer.__dict__ for layer in layers)
    with pytest.raises(RuntimeError, match="inside"):
        with packed_linears(model, 8, CPU):
            raise RuntimeError("inside")
    assert all("forward" not in layer.__dict__ for layer in layers)
    for rows in (1, MIN_ROWS - 1, MAX_ROWS + 1, 300):  # a one-token step, a prefill: the model's own
        with packed_linears(model, rows, CPU) as used:
            assert not used and all("forward" not in layer.__dict__ for layer in layers)
    with packed_linears(model, 8, torch.device("meta")) as used:
        assert not used
    PackedLinears.pin(model, False)
    with packed_linears(model, 8, CPU) as used:
        assert not used


def test_packing_waits_for_enough_forwards_then_decides_once(model, monkeypatch):
    timed = []
    monkeypatch.setattr(packed, "available", lambda: True)
    monkeypatch.setattr(PackedLinears, "_time", lambda self, rows: timed.append(rows) or (0.5, 1.0))
    state = PackedLinears.of(model)
    assert [state.use(8) for _ in range(PACK_AFTER - 1)] == [False] * (PACK_AFTER - 1)
    assert not state.use(1) and not state.use(MAX_ROWS + 1)  # not counted
    assert state.use(8) and state.use(MIN_ROWS) and state.use(MAX_ROWS) and timed == list(packed.TIMED_ROWS)
    assert "8 rows 500.00 against 1000.00 ms" in state.reason


@pytest.mark.parametrize("gains, rows", [((8, 16), (8, MAX_ROWS)), ((4, 8), (MIN_ROWS, packed.MIDDLE_ROWS)),
                                         ((8,), (8, packed.MIDDLE_ROWS))])
def test_the_rows_served_are_those_that_timed_faster(model, monkeypatch, gains, rows):
    monkeypatch.setattr(packed, "available", lambda: True)
    monkeypatch.setattr(PackedLinears, "_time", lambda self, n: (0.5 if n in gains else 1.0, 1.0))
    monkeypatch.setattr(PackedLinears, "packed_weight", lambda self, layer: None)
    state = PackedLinears.of(model)
    state.forwards = PACK_AFTER
    assert state.use(8) and state.rows == rows
    assert [state.use(n) for n in (rows[0] - 1, rows[0], rows[1], rows[1] + 1)] == [False, True, True, False]
    assert f"{rows[0]}-{rows[1]} rows" in PackedLinears.decision(model)


def test_packing_is_declined_where_it_is_not_faster_or_does_not_fit(model, monkeypatch):
    monkeypatch.setattr(packed, "available", lambda: True)
    monkeypatch.setattr(PackedLinears, "_time", lambda self, rows: (0.95, 1.0))  # within MIN_GAIN: not worth it
    state = PackedLinears.of(model)
    state.forwards = PACK_AFTER
    assert not state.use(8) and state.decided is False
    PackedLinears.forget(model)
    monkeypatch.setattr(PackedLinears, "_time", lambda self, rows: (0.1, 1.0))
    monkeypatch.setattr(packed, "memory_available", lambda: PackedLinears.of(model).extra_bytes())  # twice the share
    state = PackedLinears.of(model)
    state.forwards = PACK_AFTER
    assert not state.use(8) and "would not fit" in state.reason


@needs_mkl
def test_a_call_verifies_through_packed_weights_and_keeps_generates_output(model, monkeypatch):
    target = pin_costs(model, DRAFTING_PAYS, rate=0.0)  # drafting pays: drafts are verified
    PackedLinears.pin(target, True)
    used = []
    product = PackedLinears.product
    monkeypatch.setattr(PackedLinears, "product", lambda self, layer, x: used.append(x.shape) or product(self, layer, x))
    ids = repetitive_prompt(12).repeat(2, 1)  # two rows: a forward of two tokens a row feeds four
    out = SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=24)
    assert used and all(MIN_ROWS <= s[:-1].numel() <= MAX_ROWS for s in used)
    assert all("forward" not in layer.__dict__ for layer in PackedLinears.of(target).layers)
    assert out.stats.choices["packed_weights"] == f"used for forwards of {MIN_ROWS}-{MAX_ROWS} rows: pinned"
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=24, do_sample=False))


@needs_mkl
def test_deciding_and_packing_are_one_time_work_and_said(model, monkeypatch):
    """The forward that decides and packs puts its seconds on the compile clock (the step is
    reported apart and prices nothing), and every layer is packed then, not in later forwards."""
    monkeypatch.setattr(PackedLinears, "_time", lambda self, rows: time.sleep(0.02) or (0.5, 1.0))
    state = PackedLinears.of(model)
    state.forwards = PACK_AFTER - 1
    assert PackedLinears.decision(model) is None
    before = compile_seconds()
    assert state.use(8)
    assert compile_seconds() - before >= 0.05
    assert len(state._packed) == len(state.layers)
    assert PackedLinears.decision(model) == (
        f"used for forwards of {MIN_ROWS}-{MAX_ROWS} rows: packed products timed faster here (4 rows 500.00 against "
        "1000.00 ms; 8 rows 500.00 against 1000.00 ms; 16 rows 500.00 against 1000.00 ms)")


def test_forwards_that_time_the_model_do_not_count_towards_packing(model):
    state = PackedLinears.of(model)
    with packed.measuring():
        assert not any(state.use(8) for _ in range(2 * PACK_AFTER))
    assert state.forwards == 0 and state.decided is None
    state.use(8)
    assert state.forwards == 1


def test_choosing_a_copy_and_calibrating_do_not_count_towards_packing(model):
    from specdec.copies.choose import StepTimer
    from specdec.kv import CacheSettings
    from specdec.policy.costs import calibrate

    timer = StepTimer(model, torch.arange(3, 40)[None, :], 8, CacheSettings())
    for width in (4, 8, 16):
        timer.time(width)
    timer.release()
    calibrate(model, torch.arange(3, 40))
    assert PackedLinears.of(model).forwards == 0


def test_a_model_called_again_is_packed_at_once(model, monkeypatch):
    monkeypatch.setattr(packed, "available", lambda: True)
    monkeypatch.setattr(PackedLinears, "_time", lambda self, rows: (0.5, 1.0))
    monkeypatch.setattr(PackedLinears, "packed_weight", lambda self, layer: None)
    PackedLinears.calling(model)
    state = PackedLinears.of(model)
    assert not state.use(8) and state.calls == 1  # a first call: only after PACK_AFTER forwards
    PackedLinears.calling(model)
    assert state.use(8) and state.calls == 2
