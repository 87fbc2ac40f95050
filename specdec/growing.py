"""A dynamic cache layer that appends in place instead of copying the whole cache every step.

transformers' ``DynamicLayer`` appends a forward's keys and values with ``torch.cat``: every
forward copies every slot cached so far, in every layer, so a one-token step costs more the
longer the context (what this saves on one machine: docs/performance.md, "Batches").
:class:`GrowingLayer` keeps each layer's keys and values in buffers with room to spare
(:data:`GROWTH` times what it needs whenever it runs out, never more than the slots the call can
reach where it is told them) and hands attention views of the slots filled so far.

Invariants: ``keys``/``values`` hold exactly what a ``DynamicLayer`` would (the same values in the
same slots, as views), so attention computes the same numbers; anything that replaces them by
other tensors (``crop`` keeps a view; a row selection or a trim makes new ones) is picked up at
the next update, which then starts new buffers from them.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer

#: a layer out of room takes buffers this many times the slots it needs
GROWTH = 1.5
#: the fewest slots a new buffer holds
MIN_SLOTS = 64


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose update writes into buffers (see the module doc); ``reach``: the
    most slots the call can use (0: unknown), which caps a buffer that holds what is needed."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None
    #: the views of the buffers last made ``keys``/``values`` (by an update or a crop): while they
    #: still are, the buffers need no other check than their room
    _handed: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, reach: int = 0):
        super().__init__()
        self.reach = reach

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._key_buffer = self._value_buffer = None
        held = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        end = held + key_states.shape[-2]
        if not (self._still_handed() and end <= self._key_buffer.shape[-2]) \
                and not self._writable(key_states, value_states, end):
            self._regrow(key_states, value_states, held, end)
        self._key_buffer[:, :, held:end] = key_states
        self._value_buffer[:, :, held:end] = value_states
        self.filled(end)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        handed = self._still_handed()
        super().crop(tokens_to_remove)
        if handed:  # shorter views of the same buffers
            self._handed = (self.keys, self.values)

    def _still_handed(self) -> bool:
        """Whether ``keys``/``values`` are the views this layer last made of its buffers."""
        handed = self._handed
        return handed is not None and self.keys is handed[0] and self.values is handed[1]

    def reserve(self, like: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers, with room for ``end`` slots and holding the slots cached so
        far, for a forward that writes its own slots into them (``like`` [B, heads, T, D]: their
        layout); :meth:`filled` then makes the first ``end`` slots the layer's keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
            self._key_buffer = self._value_buffer = None
        held = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        if not self._writable(like, like, end):
            self._regrow(like, like, held, end)
        return self._key_buffer, self._value_buffer

    def filled(self, end: int) -> None:
        """The first ``end`` slots of the buffers are the layer's keys and values (after :meth:`reserve`)."""
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        self._handed = (self.keys, self.values)

    def _writable(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> bool:
        """Whether the buffers have room for ``end`` slots and ``keys``/``values`` are still views of
        their first slots (nothing replaced them since the last update)."""
        keys, values, key_buffer, value_buffer = self.keys, self.values, self._key_buffer, self._value_buffer
        if key_buffer is None or end > key_buffer.shape[-2]:
            return False
        if key_buffer.shape[:2] != key_states.shape[:2] or key_buffer.shape[-1] != key_states.shape[-1] \
                or value_buffer.shape[:2] != value_states.shape[:2] or value_buffer.shape[-1] != value_states.shape[-1] \
                or key_buffer.dtype != key_states.dtype or key_buffer.device != key_states.device:
            return False
        if keys.dim() != 4:  # nothing held yet (a reset, or the first update)
            return True
        return (keys.data_ptr() == key_buffer.data_ptr() and values.data_ptr() == value_buffer.data_ptr()
                and keys.stride() == key_buffer.stride() and values.stride() == value_buffer.stride())

    def _regrow(self, key_states: torch.Tensor, value_states: torch.Tensor, held: int, end: int) -> None:
        """New buffers for at least ``end`` slots, holding the ``held`` slots cached so far."""
        slots = max(MIN_SLOTS, int(GROWTH * end))
        if self.reach >= end:
            slots = min(slots, self.reach)
        batch, heads = key_states.shape[:2]
        key_buffer = key_states.new_empty(batch, heads, slots, key_states.shape[-1])
        value_buffer = value_states.new_empty(batch, value_states.shape[1], slots, value_states.shape[-1])
        if held:
            key_buffer[:, :, :held] = self.keys
            value_buffer[:, :, :held] = self.values
        self._key_buffer, self._value_buffer = key_buffer, value_buffer


def new_dynamic_cache(layout: tuple[bool, ...] | None = None, reach: int = 0):
    """A ``DynamicCache`` of :class:`GrowingLayer` s (appending in place, their
    buffers never past ``reach`` slots where it covers what they hold); for a pipeline stage, with
    ``DummyLayer`` s where it holds no layer, so that masks are sized from a layer it holds (an
    empty first layer would size them from nothing)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = partial(GrowingLayer, reach)
    if layout is not None and not all(layout):
        cache.layers[:] = [GrowingLayer(reach) if held else DummyLayer() for held in layout]
        if not layout[0]:
            cache.layers[0] = _SizedGap(cache.layers[layout.index(True)])
    return cache


class _SizedGap(DummyLayer):
    """Layer 0 of a pipeline stage that does not hold it: it holds nothing, but gives sizes as the
    stage's first layer does (transformers sizes a sliding-window mask from layer 0 where no cache
    layer says it slides, and a ``DummyLayer`` has no length)."""

    def __init__(self, held: GrowingLayer):
        super().__init__()
        self.held = held

    def get_seq_length(self) -> int:
        return self.held.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held.get_mask_sizes(query_length)
