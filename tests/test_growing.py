"""specdec.growing.GrowingLayer holds what transformers' DynamicLayer holds, appending in place."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from transformers.cache_utils import DynamicLayer

from specdec.cache_slots import shift_cache_rows
from specdec.kv import new_dynamic_cache
from specdec.growing import GrowingLayer

OPS = st.lists(st.one_of(st.tuples(st.just("update"), st.integers(1, 40)),
                         st.tuples(st.just("crop"), st.integers(1, 30)),
                         st.tuples(st.just("select"), st.just(0)),
                         st.tuples(st.just("trim"), st.integers(1, 5))), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(OPS, st.integers(0, 10_000), st.integers(0, 200))
def test_same_keys_and_values_as_a_dynamic_layer(ops, seed, reach):
    """Any sequence of appends, crops, row selections and trims leaves the same keys and values
    (shapes and numbers) in both layers, and update returns them, whatever reach it was told."""
    g = torch.Generator().manual_seed(seed)
    mine, theirs, batch = GrowingLayer(reach), DynamicLayer(), 3
    for op, n in ops:
        if op == "update":
            k, v = torch.randn(batch, 2, n, 4, generator=g), torch.randn(batch, 2, n, 4, generator=g)
            got, want = mine.update(k, v), theirs.update(k, v)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        elif op == "crop" and theirs.get_seq_length() > n:
            mine.crop(-n), theirs.crop(-n)
        elif op == "select" and theirs.get_seq_length() and batch > 1:
            rows = torch.tensor([batch - 1, 0])
            mine.batch_select_indices(rows), theirs.batch_select_indices(rows)
            batch = 2
        elif op == "trim" and theirs.get_seq_length() > n:  # specdec.kv's trim_left: a view past the start
            mine.keys, mine.values = mine.keys[:, :, n:], mine.values[:, :, n:]
            theirs.keys, theirs.values = theirs.keys[:, :, n:], theirs.values[:, :, n:]
        assert mine.get_seq_length() == theirs.get_seq_length()
        if theirs.get_seq_length():
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_appends_write_in_place():
    """One-slot appends reuse the layer's buffers until they are full, then take 1.5x as many slots."""
    layer = GrowingLayer()
    layer.update(torch.randn(1, 2, 100, 4), torch.randn(1, 2, 100, 4))
    buffer = layer._key_buffer
    assert buffer.shape[-2] == 150
    for _ in range(50):
        layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
        assert layer._key_buffer is buffer and layer.keys.data_ptr() == buffer.data_ptr()
    layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert layer._key_buffer is not buffer and layer.get_seq_length() == 151


def test_a_buffer_never_takes_more_than_the_call_can_reach():
    """Told the slots a call can reach, a layer's buffers stop there; past them, it grows again."""
    layer = GrowingLayer(reach=120)
    layer.update(torch.randn(2, 2, 100, 4), torch.randn(2, 2, 100, 4))
    assert layer._key_buffer.shape[-2] == 120
    for _ in range(21):
        layer.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    assert layer._key_buffer.shape[-2] == int(1.5 * 121) and layer.get_seq_length() == 121


def test_the_call_caches_grow_in_place():
    """specdec's dynamic caches (the target's) are made of growing layers, a pipeline stage's too."""
    cache = new_dynamic_cache(reach=70)
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), 0)
    assert isinstance(cache.layers[0], GrowingLayer) and cache.layers[0]._key_buffer.shape[-2] == 64
    staged = new_dynamic_cache((False, True))
    assert isinstance(staged.layers[1], GrowingLayer) and not isinstance(staged.layers[0], GrowingLayer)


def test_a_crop_keeps_the_buffers():
    """A crop (rejected drafts dropped) leaves shorter views of the same buffers, which the next
    update writes into; a view put there by someone else (a trim) makes the layer check again."""
    layer = GrowingLayer()
    layer.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4))
    buffer = layer._key_buffer
    layer.crop(-3)
    assert layer._still_handed() and layer.keys.shape[-2] == 7
    new = torch.randn(1, 2, 2, 4)
    keys, _ = layer.update(new, new)
    assert layer._key_buffer is buffer and keys.shape[-2] == 9 and torch.equal(keys[:, :, 7:], new)
    layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]  # specdec.kv's trim_left
    assert not layer._still_handed()
    keys, _ = layer.update(new, new)
    assert keys.shape[-2] == 10 and torch.equal(keys[:, :, 8:], new)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=5), st.integers(0, 10_000))
def test_shifting_rows_moves_each_row_right_in_place(shifts, seed):
    """shift_cache_rows moves row b's slots right by shifts[b] in the tensors the cache holds,
    zeroes the slots it leaves, and leaves other rows alone: what a per-row copy does."""
    g = torch.Generator().manual_seed(seed)
    batch, slots = len(shifts), 8
    cache = new_dynamic_cache()
    cache.update(torch.randn(batch, 2, slots, 4, generator=g), torch.randn(batch, 2, slots, 4, generator=g), 0)
    layer = cache.layers[0]
    held, before = (layer.keys, layer.values), (layer.keys.clone(), layer.values.clone())
    shift_cache_rows(cache, torch.tensor(shifts))
    assert layer.keys is held[0] and layer.values is held[1]
    for tensor, old in zip(held, before):
        for b, n in enumerate(shifts):
            n = min(n, slots)
            assert torch.equal(tensor[b, :, n:], old[b, :, : slots - n]) and not tensor[b, :, :n].any()
