"""Int4 weights with bfloat16 activations for a CPU draft copy (``specdec/engines/forwards/int4.py``): the
product is the de-quantized weights' up to bfloat16 rounding, stacking keeps each part's product,
and a copy of them drafts through the lean forward with the target's output unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec import SpecDecoder
from specdec.engines.forwards import int4, lean
from specdec.engines.forwards.int4 import Bfloat16Head, Int4Linear, quantize, quantize_linears, stack_int4
from specdec.engines.forwards.lowbit import build_copy
from specdec.models import tiny_random

from helpers import repetitive_prompt
from test_lean import stepped

pytestmark = pytest.mark.skipif(not int4.available(), reason="this torch has no CPU int4 kernel")


def dequantized(layer: Int4Linear, q: torch.Tensor) -> torch.Tensor:
    """[N, K] the weights ``layer`` multiplies by, from its integers ``q`` and scales and zeros."""
    scales, zeros = layer.scales_zeros.float().unbind(-1)  # [K / g, N] each
    group = layer.in_features // scales.shape[0]
    return ((q.float() - 8) * scales.T.repeat_interleave(group, dim=1)) + zeros.T.repeat_interleave(group, dim=1)


def test_quantized_weights_are_within_half_a_step_of_the_originals():
    weight = torch.randn(64, 96) * torch.linspace(0.1, 3, 96)
    q, scales_zeros = quantize(weight, group=32)
    assert q.min() >= 0 and q.max() <= 15
    layer = Int4Linear(torch.nn.Linear(96, 64))
    layer.scales_zeros = scales_zeros
    step = scales_zeros[..., 0].float().T.repeat_interleave(32, dim=1)  # [N, K]
    # within half a step, plus the bfloat16 rounding of the scale and the offset
    assert bool(((dequantized(layer, q) - weight).abs() <= 0.5 * step + 0.02 * weight.abs().amax()).all())


def test_the_product_is_the_dequantized_weights_up_to_bfloat16_rounding():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 192, bias=True)
    layer = Int4Linear(linear)
    q, _ = quantize(linear.weight.detach())
    x = torch.randn(5, 128)
    want = x.to(torch.bfloat16).float() @ dequantized(layer, q).T + linear.bias.detach()
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (5, 192)
    assert float((got - want).norm() / want.norm()) < 1e-2


def test_stacked_layers_compute_their_parts_and_share_their_weights():
    torch.manual_seed(1)
    parts = [Int4Linear(torch.nn.Linear(64, n, bias=bias)) for n, bias in ((128, True), (64, False), (64, True))]
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = [p(x) for p in parts]
        stacked = stack_int4(parts)
        torch.testing.assert_close(stacked(x), torch.cat(before, dim=-1), rtol=1e-2, atol=1e-2)
        for p, want in zip(parts, before):
            torch.testing.assert_close(p(x), want, rtol=0, atol=0)
    base = stacked.weight_int4.untyped_storage().data_ptr()
    assert all(p.weight_int4.untyped_storage().data_ptr() == base for p in parts)


@pytest.fixture(scope="module")
def wide_llama():
    """A tiny Llama whose layer widths are multiples of 64 (what int4 layers stack in)."""
    return tiny_random("llama", seed=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2)[0]


def test_an_int4_copy_steps_through_the_lean_forward_close_to_its_own(wide_llama):
    copy = build_copy(wide_llama, "int4")
    assert isinstance(copy.forward, lean.LeanForward) and copy.forward.scripted
    assert isinstance(copy.model.layers[0].mlp.down_proj, Int4Linear)
    assert isinstance(copy.get_output_embeddings(), Bfloat16Head)  # the output layer stays finer
    assert copy.model.embed_tokens.weight.dtype == torch.float32  # a tied embedding keeps its dtype
    ids = torch.randint(3, 250, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1:, :4] = 0
    mine, _ = stepped(copy, ids, mask, [1, 1, 3, 1])
    lean_forward = copy.forward
    copy.forward = lean_forward.own
    try:
        want, _ = stepped(copy, ids, mask, [1, 1, 3, 1])
    finally:
        copy.forward = lean_forward
    for got, expected in zip(mine, want):
        assert float((got - expected).norm() / expected.norm()) < 2e-2


def test_widths_that_do_not_stack_keep_the_models_own_forward():
    model = tiny_random("llama", seed=4)[0]  # key/value projections 32 wide
    copy = build_copy(model, "int4")
    assert "multiples of 64" in lean.lean_problem(copy)
    assert not isinstance(copy.forward, lean.LeanForward)


def test_self_draft_with_an_int4_copy_keeps_generates_output(wide_llama):
    ids = repetitive_prompt(10)
    out = SpecDecoder(wide_llama, "self_draft", weights="int4").generate(ids, max_new_tokens=24)
    assert out.stats.choices["weights"] == "int4"
    assert out.stats.drafted_tokens > 0
    assert torch.equal(out.sequences, wide_llama.generate(ids, max_new_tokens=24, do_sample=False))


def test_the_output_layer_in_bfloat16_computes_the_linear_layer_rounded():
    linear = torch.nn.Linear(64, 320, bias=True)
    head = Bfloat16Head(linear)
    x = torch.randn(3, 5, 64)
    got = head(x)
    assert got.dtype == torch.float32 and got.shape == (3, 5, 320)
    torch.testing.assert_close(got, linear(x), rtol=2e-2, atol=2e-2)
    assert head.weight.dtype == torch.bfloat16 and linear.weight.dtype == torch.float32  # a copy


def test_an_int4_copy_may_keep_an_int4_output_layer(wide_llama):
    model = quantize_linears(copy.deepcopy(wide_llama), head=False)
    assert isinstance(model.get_output_embeddings(), Int4Linear)
