"""``Int8Linear``: int8 weights x uint8 activations (each token over its own range) on the CPU.

Close to the float layer it replaces, row by row independent, and the same compiled as eager for
a single row (inductor once handed ``torch._int_mm`` a one-row operand with a zero row stride, on
which the CPU kernel computes garbage)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specdec.engines.forwards import int8 as int8_module
from specdec.engines.forwards.int8 import Int8Linear, int8_product, quantize_linears, rotate_input
from specdec.engines.forwards.rotation import kron_orthogonal

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 9), bias=st.booleans(), seed=st.integers(0, 2**16), shift=st.floats(-3.0, 3.0))
def test_close_to_the_float_layer_and_rows_independent(rows, bias, seed, shift):
    g = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(96, 40, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=g) * 0.1)
        if bias:
            linear.bias.copy_(torch.randn(40, generator=g))
    layer = Int8Linear(linear)
    x = torch.randn(2, rows, 96, generator=g) + shift  # activations need not be centred: a row's own range covers it
    with torch.no_grad():
        want, got = linear(x), layer(x)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert relative_error(got, want) < 0.03
        assert torch.equal(layer(x[:, -1:]), got[:, -1:])  # each token is quantized on its own


def test_a_constant_row_is_exact_and_levels_stay_in_range():
    """A row whose values are all equal has no range (its scale floors at a tiny value): it must come
    out as the float product, not as garbage from dividing by nothing; rows whose lowest or highest
    value repeats reach levels 0 and 255 exactly, never past them."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 8, bias=False)
    layer = Int8Linear(linear)
    w = layer.weight_int8.float() * layer.weight_scale[:, None]  # the de-quantized weights
    with torch.no_grad():
        for value in (0.0, 1.5, -2.0):
            x = torch.full((1, 32), value)
            torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-6)
        x = torch.tensor([[-1.0, 3.0] * 16])  # two levels: 0 and 255, exact
        torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-5)


def test_the_compiled_layer_equals_the_eager_one_for_one_row():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 64, bias=False))
    quantize_linears(model, rotate={model[2]})
    assert all(isinstance(m, Int8Linear) for m in (model[0], model[2])) and model[2].rotation() is not None
    compiled = torch.compile(model, fullgraph=True)  # inductor: the backend that lays out the operands
    with torch.no_grad():
        for shape in [(1, 1, 64), (2, 3, 64)]:  # one row, then several (each shape compiles for seconds)
            x = torch.randn(shape)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_quantized_copy_keeps_its_shape_and_stores_a_quarter_of_the_bytes():
    linear = torch.nn.Linear(256, 512)
    layer = Int8Linear(linear)
    assert (layer.in_features, layer.out_features) == (256, 512)
    stored = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert stored < 0.3 * sum(p.numel() * p.element_size() for p in linear.parameters())
    assert "int8" in repr(layer)


def test_quantizing_in_chunks_of_rows_is_quantizing_whole(monkeypatch):
    from specdec.engines.forwards import int8

    linear = torch.nn.Linear(16, 10)
    whole = Int8Linear(linear)
    monkeypatch.setattr(int8, "CHUNK_ROWS", 3)
    chunked = Int8Linear(linear)
    for name in (*int8.WEIGHT_BUFFERS, "bias"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name))
    w = linear.weight.detach()
    assert torch.equal(whole.weight_scale, (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(0, 1000))
def test_rows_one_at_a_time_give_the_same_numbers(rows, rowwise, seed):
    """Up to ``rowwise`` rows are multiplied one at a time (a faster path on some CPUs): the
    integer sums, and so the layer's output, are the same numbers as one product of all rows."""
    g = torch.Generator().manual_seed(seed)
    layer = Int8Linear(torch.nn.Linear(48, 40).requires_grad_(False))
    x = torch.randn(rows, 48, generator=g)
    together = int8_product(x, layer.weight_int8, layer.weight_scale, layer.weight_offset, 1)
    assert torch.equal(int8_product(x, layer.weight_int8, layer.weight_scale, layer.weight_offset, rowwise), together)


def test_the_rows_taken_one_at_a_time_are_measured_here():
    """``measure_rowwise`` picks a count from timings on this machine, once a process, before the
    first layer is made."""
    Int8Linear(torch.nn.Linear(8, 8))
    assert int8_module._MEASURED and 1 <= int8_module.ROWWISE_ROWS <= 8
    assert int8_module.measure_rowwise() == int8_module.ROWWISE_ROWS


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 5), size=st.sampled_from([64, 96, 128, 1536]), seed=st.integers(0, 1000))
def test_a_rotated_input_is_the_input_times_the_kronecker_product(rows, size, seed):
    a, b = kron_orthogonal(size, seed)
    x = torch.randn(rows, size, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(rotate_input(x, a, b), x @ torch.kron(a, b), rtol=1e-4, atol=1e-4)


def test_a_rotated_layer_computes_the_same_product_and_resolves_an_outlier_channel_better():
    """Rotation is exact in real arithmetic (the weights are stored rotated by the factors the input
    is rotated by, and the rotation is orthogonal), and where one input channel is far larger than the rest the rotated layer's
    error is clearly smaller: the 256 levels are no longer spent on that channel alone (as in a
    language model, the large channel meets small weights, so the others make the output)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(192, 48).requires_grad_(False)
    linear.weight[:, 5] *= 0.01
    plain, rotated = Int8Linear(linear), Int8Linear(linear, rotate=True)
    assert rotated.rotation() is not None and plain.rotation() is None and "rotated" in repr(rotated)
    x = torch.randn(16, 192)
    x[:, 5] *= 60
    # the stored weights are W kron(a, b) for the factors the input is rotated by, to within half a level
    dequantized = rotated.weight_int8.float() * rotated.weight_scale[:, None]
    assert bool(((dequantized - linear.weight @ torch.kron(*rotated.rotation())).abs()
                 <= rotated.weight_scale[:, None] * 0.5 + 1e-6).all())
    want = linear(x)
    assert relative_error(rotated(x), want) * 1.3 < relative_error(plain(x), want)
