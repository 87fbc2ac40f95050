"""The lean eager forward of a w8a8 copy (``specdec/engines/forwards/lean.py``).

It must compute what the copy's own forward computes: with exact products (the int8 layers'
product replaced by a float one over their de-quantized weights, so that no rounding of a
quantized activation can amplify a difference in the last bit) the logits and the cache it writes
match the model's own forward's to float precision, for one token and several, one row and a
left-padded batch; where it does not apply, the model's own forward runs."""

from __future__ import annotations

import pytest
import torch

from specdec.engines.forwards import int8, lean, stack
from specdec.engines.forwards.int8 import Int8Linear, stack_linears
from specdec.engines.forwards.lowbit import build_copy
from specdec.kv import CacheSettings, make_kv
from specdec.models import tiny_random
from specdec.modelinfo import cache_argument


def exact_product(x2, weight_int8, weight_scale, weight_offset, rowwise=1):
    """The int8 product with de-quantized weights and unquantized activations: no rounding to amplify."""
    return x2 @ (weight_int8.float() * weight_scale[:, None]).T


@pytest.fixture
def exact(monkeypatch):
    """Exact products in both forwards: the copy's own (``Int8Linear``) and the lean one (run as
    Python)."""
    monkeypatch.setattr(int8, "int8_product", exact_product)  # what Int8Linear and the lean layers both call
    # nothing is scripted meanwhile: TorchScript keeps what it compiled for the process
    monkeypatch.setattr(stack, "scripted_layers", lambda: None)


@pytest.fixture(scope="module")
def llama():
    return tiny_random("llama", seed=1)[0]


def stepped(model, ids: torch.Tensor, mask: torch.Tensor, widths: list[int]) -> tuple[list[torch.Tensor], list]:
    """Prefill ``model`` with all but the last sum(widths) columns of ``ids [B, L]`` on a static
    cache, then feed the rest ``widths`` tokens at a time. -> (logits per forward, the cache's layers)."""
    batch, length = ids.shape
    kv = make_kv(model, batch, length + 1, CacheSettings.make("static"))
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    start = length - sum(widths)
    out = []
    with torch.no_grad():
        for first, width in [(0, start)] + [(start + sum(widths[:i]), w) for i, w in enumerate(widths)]:
            kwargs = {"input_ids": ids[:, first:first + width], "position_ids": positions[:, first:first + width],
                      cache_argument(model): kv.cache, "use_cache": True, "logits_to_keep": width}
            logits = kv.forward(model, kwargs, first_slot=first, width=width, first=first == 0,
                                mask=lambda slots, end=first + width: torch.nn.functional.pad(mask[:, :end], (0, slots - end)),
                                needs_mask=False, direct=True)
            out.append(logits)
    return out[1:], kv.cache.layers


@pytest.mark.parametrize("batch", [1, 3])
def test_the_lean_forward_computes_the_copys_own(llama, batch, exact):
    copy = build_copy(llama, "w8a8")
    assert isinstance(copy.forward, lean.LeanForward) and not copy.forward.scripted
    assert all(layer.mlp.down_proj.rotation() is not None for layer in copy.model.layers)  # rotated inputs too
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (batch, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1:, :5] = 0  # left padding in the other rows
    widths = [1, 1, 4, 1, 3]
    mine, my_cache = stepped(copy, ids, mask, widths)
    own_forward = copy.forward
    copy.forward = own_forward.own  # the model's own forward, on the same weights
    try:
        want, cache = stepped(copy, ids, mask, widths)
    finally:
        copy.forward = own_forward
    for got, expected in zip(mine, want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    end = ids.shape[1]
    for a, b in zip(my_cache, cache):
        torch.testing.assert_close(a.keys[:, :, :end], b.keys[:, :, :end], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values[:, :, :end], b.values[:, :, :end], rtol=1e-5, atol=1e-5)
        assert int(a.cumulative_length) == int(b.cumulative_length) == end
        assert not (a.keys.is_inference() or a.values.is_inference())  # the stack runs in inference mode, the cache does not
    assert not any(logits.is_inference() for logits in mine)


def test_the_scripted_layers_compute_what_the_python_ones_do(llama):
    """The copy's layers run scripted (TorchScript, on this torch) and give the Python function's
    logits and cache: one row and a left-padded batch, one token and several."""
    copy = build_copy(llama, "w8a8")
    assert copy.forward.scripted
    ids = torch.randint(3, 250, (3, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1:, :5] = 0
    for rows in (1, 3):
        got, got_cache = stepped(copy, ids[:rows], mask[:rows], [1, 1, 4, 1, 3])
        scripted = copy.forward
        copy.forward = lean.LeanForward(copy, script=False)
        try:
            want, want_cache = stepped(copy, ids[:rows], mask[:rows], [1, 1, 4, 1, 3])
        finally:
            copy.forward = scripted
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_cache, want_cache):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)


def test_with_int8_products_it_stays_close_and_agrees(llama):
    copy = build_copy(llama, "w8a8")
    ids = torch.randint(3, 250, (1, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mine, _ = stepped(copy, ids, mask, [1, 1, 1, 1])
    own_forward = copy.forward
    copy.forward = own_forward.own
    try:
        want, _ = stepped(copy, ids, mask, [1, 1, 1, 1])
    finally:
        copy.forward = own_forward
    for got, expected in zip(mine, want):
        assert float((got - expected).norm() / expected.norm()) < 0.05


def test_other_calls_run_the_models_own_forward(llama, monkeypatch):
    copy = build_copy(llama, "w8a8")
    calls = []
    own = copy.forward.own
    monkeypatch.setattr(copy.forward, "own", lambda *a, **k: calls.append(k) or own(*a, **k))
    ids = torch.randint(3, 250, (1, lean.MAX_WIDTH + 4))
    with torch.no_grad():
        copy(ids)  # positional, no cache
        copy.forward(input_ids=ids, use_cache=False)
        copy.forward(input_ids=ids[:, :2], position_ids=torch.arange(2)[None], output_hidden_states=True)
    assert len(calls) == 3


def test_layouts_it_does_not_know_are_left_alone():
    qwen3 = tiny_random("qwen3", seed=2)[0]  # query/key norms inside attention
    mistral = tiny_random("mistral", seed=2)[0]  # a sliding window
    for model in (qwen3, mistral):
        copy = build_copy(model, "w8a8")
        assert lean.lean_problem(copy) is not None
        assert not isinstance(copy.forward, lean.LeanForward)
    assert lean.lean_problem(tiny_random("llama", seed=1)[0]) is not None  # float layers: not a w8a8 copy


def test_an_input_rotated_anywhere_but_the_mlp_output_is_not_served(llama):
    copy = build_copy(llama, "w8a8")
    attention = copy.model.layers[0].self_attn
    attention.o_proj = Int8Linear(torch.nn.Linear(attention.o_proj.in_features, attention.o_proj.out_features), rotate=True)
    assert "rotated" in lean.lean_problem(copy)


def test_stacked_layers_compute_their_parts_and_share_their_storage():
    torch.manual_seed(0)
    parts = [Int8Linear(torch.nn.Linear(32, n, bias=bias)) for n, bias in ((16, True), (8, False), (8, True))]
    x = torch.randn(3, 32)
    with torch.no_grad():
        before = [p(x) for p in parts]
        stacked = stack_linears(parts)
        torch.testing.assert_close(stacked(x), torch.cat(before, dim=-1), rtol=1e-6, atol=1e-6)
        for p, want in zip(parts, before):
            torch.testing.assert_close(p(x), want, rtol=0, atol=0)
    base = stacked.weight_int8.untyped_storage().data_ptr()
    assert all(p.weight_int8.untyped_storage().data_ptr() == base for p in parts)
    assert parts[1].bias is None and stacked.bias[16:24].abs().sum() == 0
    with pytest.raises(ValueError, match="rotated"):
        stack_linears([Int8Linear(torch.nn.Linear(32, 8), rotate=True), Int8Linear(torch.nn.Linear(32, 8))])


def test_a_token_whose_own_slot_is_masked_out_stays_finite(llama):
    """A padded column (its slot masked out for its row) attends to its own slot: no fully masked
    row, so no NaN in the cache for later forwards to read."""
    copy = build_copy(llama, "w8a8")
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :10] = 0  # row 1 is padding up to slot 9: its query there would see no slot at all
    logits, cache = stepped(copy, ids, mask, [1, 1, 1])
    assert all(bool(torch.isfinite(x).all()) for x in logits)
    assert all(bool(torch.isfinite(layer.keys[:, :, :12]).all()) for layer in cache)
