"""Key/value cache backends of :class:`~specdec.state.ModelState`: dynamic, or static and compiled.

``ModelState`` keeps the layout (which slot holds which row's token); a backend keeps the
tensors and runs the forward. Both backends hold ``transformers`` caches:

* :class:`DynamicKV`: a ``DynamicCache`` of plain full-length layers (sliding windows are applied
  by the mask). Rolling back is a crop.
* :class:`~specdec.static_kv.StaticKV`: a ``StaticCache`` of ``StaticLayer`` s, taken from the pool
  for the call and written in place, its forwards compiled with ``compile``; its cache lengths
  follow a ladder (``specdec.static_kv``).

:func:`make_kv` picks a model's backend from the call's :class:`~specdec.cache_settings.CacheSettings`
(re-exported here, as are the static backend, its length ladder and the cache factories).
"""

from __future__ import annotations

import copy

import torch

from .cache_pool import new_static_cache, release_caches
from .cache_settings import IMPLEMENTATIONS, WIDTHS, CacheSettings, static_problem
from .cache_slots import filled_layers, gather_cache_slots, shift_cache_rows
from .compiled import compiled_forward
from .distributed import stage_layout
from .engines import ChainForward, llama_cpp_kv
from .growing import new_dynamic_cache
from .model_plan import plan_of
from .static_kv import LENGTH_STEP, StaticKV, length_ladder

__all__ = ["IMPLEMENTATIONS", "LENGTH_STEP", "WIDTHS", "CacheSettings", "DynamicKV", "StaticKV", "compiled_forward",
           "length_ladder", "make_kv", "new_dynamic_cache", "new_static_cache", "static_problem"]


class DynamicKV:
    """A ``DynamicCache``; every row's slots ``[0, cached_slots)`` are stored, no more."""

    slots = 0  # grows with what it holds
    #: what a backend serves (the llama_cpp engine's backend serves neither): the hidden states of a
    #: forward (``hidden_layers``), and tree layouts (``runner``, ``gather_slots``)
    returns_hidden = trees = True

    def __init__(self, model, batch: int, capacity: int, settings: CacheSettings, reach: int = 0):
        self.settings, self.batch, self.reach = settings, batch, reach  # reach: slots the call can use
        self.layout = stage_layout(model)  # a pipeline stage: the layers it holds (specdec/distributed/)
        self.cache = new_dynamic_cache(self.layout, reach)
        self.chain = ChainForward(model, settings.engine, settings.fast_head)  # its causal forwards, on its engine

    def forward(self, model, kwargs: dict, *, first_slot: int, width: int, first: bool, mask,
                needs_mask: bool, direct: bool = False, runner=None, hidden_layers: tuple[int, ...] = ()):
        """Run the model on ``kwargs`` (ids/positions ``[B, fed]``, fed = :meth:`padded_width`);
        ``mask(slots)`` gives the ``[B, slots]`` attention mask, needed unless every slot holds a
        real token. ``direct`` calls ``model.forward`` (no module hooks); ``runner(model, kwargs)``,
        where given, runs the forward instead (a tree's, through an engine). -> logits of the first
        ``width`` columns (or fewer, with ``logits_to_keep``); with ``hidden_layers``
        (``output_hidden_states`` indices; not with a runner, which keeps its own) ``(logits,
        {index: [B, fed, H]})``, through the engine (``engines.ChainForward``)."""
        if needs_mask:
            kwargs["attention_mask"] = mask(first_slot + width)
        if runner is not None:
            return runner(model, kwargs)
        return self.chain(kwargs, direct=direct, hidden_layers=hidden_layers)

    def gather_slots(self, first: int, sources: torch.Tensor) -> None:
        """Slot ``first + j`` of row b takes what slot ``sources[b, j]`` holds (``sources [B, W]``):
        a tree's accepted nodes moved into chain order (docs/trees.md)."""
        gather_cache_slots(self.cache, first, sources)

    def padded_width(self, width: int, first: bool) -> int:
        return width

    def crop(self, old_slots: int, new_slots: int) -> None:
        if old_slots and new_slots != old_slots:  # full-length layers: cropping nothing changes nothing
            self.cache.crop(new_slots - old_slots)

    def shift_rows(self, shifts: torch.Tensor) -> None:
        """Move row b's cached entries right by ``shifts[b]`` slots, padding its start with zeros."""
        shift_cache_rows(self.cache, shifts)

    def trim_left(self, count: int, cached_slots: int) -> None:
        """Drop the first ``count`` slots of every row (padding common to all rows)."""
        for layer in filled_layers(self.cache):
            layer.keys, layer.values = layer.keys[:, :, count:], layer.values[:, :, count:]

    def select_rows(self, rows: torch.Tensor, cached_slots: int) -> None:
        if cached_slots:
            self.cache.batch_select_indices(rows)
        else:  # emptied layers keep their old batch size (batch_select_indices skips them)
            self.cache = new_dynamic_cache(self.layout, self.reach)

    def load(self, cache, slots: int, owned: bool = False) -> None:
        """Start from another cache holding ``slots`` slots (a prefix): a copy, or the cache itself
        where it is ``owned`` (made for this state alone)."""
        self.cache = cache if owned else copy.deepcopy(cache)

    def adopt(self, cache, slots: int, dtype: torch.dtype, start: int = 0, rows: torch.Tensor | None = None) -> None:
        """Hold another model's first ``slots`` slots, in ``dtype``: those from ``start`` are copied
        (the ones below are the same already), and all of ``rows`` (indices) where given."""
        held = self.cache.get_seq_length() if start else 0
        if start == 0 or held < start:  # nothing to keep (or less than assumed): copy everything
            self.cache, start = new_dynamic_cache(self.layout, self.reach), 0
        elif held > start:
            self.cache.crop(start - held)  # transformers' crop takes the (negative) count to remove
        if start and rows is not None:
            for mine, layer in zip(self.cache.layers, cache.layers):
                mine.keys[rows, :, :start] = layer.keys[rows, :, :start].to(dtype)
                mine.values[rows, :, :start] = layer.values[rows, :, :start].to(dtype)
        for i, layer in enumerate(cache.layers):
            self.cache.update(layer.keys[:, :, start:slots].to(dtype, copy=True),
                              layer.values[:, :, start:slots].to(dtype, copy=True), i)

    def release(self) -> None:
        pass



def make_kv(model, batch: int, capacity: int, settings: CacheSettings | None, reach: int | None = None):
    """A cache backend for ``batch`` rows: llama.cpp's for a model a GGUF file serves under
    ``engine="llama_cpp"`` (``specdec.engines.llama_cpp``); a static one starts with room for
    ``capacity`` slots and grows up to ``reach`` (``specdec.static_kv``); a dynamic one holds what it is given."""
    settings = settings or CacheSettings()
    if plan_of(model).changed(model):  # another dtype, device or layer since the last call: decide and pool anew
        release_caches(model)
    if settings.engine == "llama_cpp":  # a model with a GGUF file; any other runs as "auto" does
        kv = llama_cpp_kv(model, batch, capacity, settings, reach or 0)
        if kv is not None:
            return kv
    if settings.static:
        # compiled_forward read here, where tests may patch it (``specdec.kv.compiled_forward``)
        return StaticKV(model, batch, capacity, settings, reach, compiler=compiled_forward)
    return DynamicKV(model, batch, capacity, settings, reach or 0)
