"""The static cache backend of ``specdec.kv``: a pooled ``StaticCache``, optionally with compiled forwards.

The cache holds ``StaticLayer`` s, taken from the pool (``specdec.cache_pool``) for the call. The
slot the next forward writes at is each layer's ``cumulative_length``, set before every forward,
so rolling back is moving that position: rejected slots stay in memory, masked out, and are
overwritten by the next forward. Rows that leave the batch are dropped in place: the kept rows
move up inside the same tensors, and the layers hold views of them until the cache goes back to
the pool whole. Sliding-window layers get full-length ``StaticLayer`` s too (the window is
applied by the mask, from the model config): ``StaticSlidingWindowLayer`` keeps only the last
window and would lose the slots a rollback returns to.

With ``compile`` the forwards run ``torch.compile`` d. Widths are padded to the settings'
``widths`` (:data:`~specdec.cache_settings.WIDTHS` by default; padded columns feed the pad token
at slots past every row's end, masked out, their logits dropped), the mask always spans the
whole cache, and caches are reused across calls from a pool bounded in bytes, so each (width,
batch, cache length) compiles once per process. A first forward (the prefill) and any forward
wider than the widest bucket run eagerly, as in ``transformers``, and so does one that asks for
hidden states (a compiled graph returns logits only). Compiled forwards bypass ``nn.Module``
hooks. The first compiled forward of each width is checked against an eager one: a model whose
compiled graph disagrees (seen with torchao's int8-activation layers under inductor on CPU) runs
eagerly from then on, with a warning. Which compiled function a model gets, and that check, live
in :mod:`specdec.compiled`; this module keeps the caches and decides when to call it.

Cache lengths. A static cache holds what its call can reach (``reach``: the prompt, the new tokens
that ``max_new_tokens`` and the model's positions allow, and the call margin), but is not
allocated for all of it up front: it starts at the shortest length that holds the prompt and a
little headroom, and grows (copying what it holds) when a forward needs more. Lengths are taken
from a ladder, so that few distinct lengths exist (each is a compiled graph, and the pool reuses
a cache only at its exact length): a length ``SpecDecoder.warmup`` compiled if one holds the
slots, else the shortest doubling of ``LENGTH_STEP`` (``EAGER_LENGTH_STEP`` where the forwards
are not compiled) that does, never past ``reach`` (rounded up to that step). Growth at least
doubles the length (up to ``reach``), so a call copies its cache O(log n) times and O(n) slots in
all.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from .cache_pool import POOL
from .cache_settings import CacheSettings
from .cache_slots import filled_layers, gather_cache_slots, shift_cache_rows
from .compiled import agrees, checked, compiled_forward, compiling, miscompiled, run_compiled
from .engines import ChainForward

#: a compiled static cache's length is a multiple of this (a compiled graph is specific to the length)
LENGTH_STEP = 256
#: an eager static cache's: no graph depends on it, and a big batch of short rows holds less
EAGER_LENGTH_STEP = 64


class StaticKV:
    """A ``StaticCache`` of full-length ``StaticLayer`` s, written in place (see the module doc)."""

    returns_hidden = trees = True  # as DynamicKV's (specdec.kv)

    def __init__(self, model, batch: int, capacity: int, settings: CacheSettings, reach: int | None = None,
                 compiler=compiled_forward):
        self.model_ref = weakref.ref(model)
        self.settings, self.batch = settings, batch  # batch: the rows it was made for
        self.reach = max(reach or capacity, capacity)  # slots the call can reach: lengths stop there
        self.length = self._length_for(capacity)
        self.cache = POOL.acquire(model, batch, self.length)
        self._full: dict[int, tuple] = {}  # id(layer) -> (layer, keys, values) of layers narrowed by select_rows
        compiles = settings.compile and not miscompiled(model)
        # compiler: make_kv passes ``specdec.kv.compiled_forward``, so tests may patch it there
        self.compiled = compiler(model, settings.options, owned=settings.owned) if compiles else None
        self.chain = ChainForward(model, settings.engine, settings.fast_head)  # its eager causal forwards, on its engine

    def forward(self, model, kwargs: dict, *, first_slot: int, width: int, first: bool, mask,
                needs_mask: bool, direct: bool = False, runner=None, hidden_layers: tuple[int, ...] = ()):
        """As :meth:`~specdec.kv.DynamicKV.forward`, on the static cache (compiled where it may be)."""
        fed = kwargs["input_ids"].shape[1]
        held = self.cache
        self._reserve(model, first_slot + fed)
        if self.cache is not held:  # grown: the forward writes to the new cache
            kwargs.update({key: self.cache for key, value in kwargs.items() if value is held})
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(first_slot)
            else:
                layer.cumulative_length = torch.tensor(first_slot)
        kwargs["attention_mask"] = mask(self.length)  # always: slots past the rows' ends hold stale entries
        if runner is not None:  # a tree's forward, through an engine: never compiled
            return runner(model, kwargs)
        # a compiled graph returns logits only: a forward that asks for hidden states runs eagerly
        if self.compiled is None or first or fed not in self.settings.widths or hidden_layers:
            return self.chain(kwargs, direct=direct, hidden_layers=hidden_layers)
        kwargs.pop("logits_to_keep", None)  # an int argument would compile one graph per value
        graph = (fed, self.length, kwargs["input_ids"].shape[0])  # a graph per width, cache length and rows
        if checked(model, graph):
            return run_compiled(self.compiled, model, kwargs, width)  # [B, width, V]
        with compiling(model, graph):  # the first use compiles: said, and timed apart
            logits = run_compiled(self.compiled, model, kwargs, width)
            return self._check(model, kwargs, first_slot, graph, logits)

    def _check(self, model, kwargs: dict, first_slot: int, graph: tuple, logits: torch.Tensor) -> torch.Tensor:
        """The first compiled forward of each ``graph`` (width, cache length, rows) is run eagerly
        too (same slots, same inputs, :func:`specdec.compiled.agrees`); a model that disagrees runs
        eagerly from then on."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(first_slot)
        eager = model.forward(**kwargs).logits[:, : logits.shape[1]]  # [B, width, V]
        if agrees(model, graph, logits, eager):
            return logits
        self.compiled = None
        warnings.warn(f"torch.compile gave {type(model).__name__} outputs that disagree with its eager forward; "
                      "it runs eagerly from now on", RuntimeWarning, stacklevel=2)
        return eager

    @property
    def slots(self) -> int:
        return self.length

    def padded_width(self, width: int, first: bool) -> int:
        """Columns the next forward feeds for ``width`` real ones."""
        if self.compiled is None or first:
            return width
        return next((w for w in self.settings.widths if w >= width), width)

    def _length_for(self, slots: int) -> int:
        """The length of a cache for ``slots``: the shortest warmed-up length that holds them, else the
        shortest rung of ``length_ladder`` that does, capped at the call's reach (see the module doc)."""
        warmed = next((n for n in sorted(self.settings.lengths) if n >= slots), None)
        if warmed is not None:
            return warmed
        step = LENGTH_STEP if self.settings.compile else EAGER_LENGTH_STEP
        rung = step
        while rung < slots:
            rung *= 2
        return max(min(rung, _round_up(self.reach, step)), _round_up(slots, step))

    def _reserve(self, model, slots: int) -> None:
        """Grow the cache (copying what it holds) if ``slots`` do not fit: to at least twice its
        length (up to the call's reach), so growing costs O(1) copies per slot."""
        if slots <= self.length:
            return
        old, old_length = self.cache, self.length
        batch = _batch_of(old)
        self.length = self._length_for(max(slots, min(2 * old_length, self.reach)))
        self.cache = POOL.acquire(model, batch, self.length)
        for new_layer, old_layer in zip(self.cache.layers, old.layers):
            if old_layer.is_initialized:
                _ensure_initialized(new_layer, old_layer, batch)
                new_layer.keys[:, :, :old_length].copy_(old_layer.keys)
                new_layer.values[:, :, :old_length].copy_(old_layer.values)
        self._give_back(model, old)

    def gather_slots(self, first: int, sources: torch.Tensor) -> None:
        """As :meth:`~specdec.kv.DynamicKV.gather_slots`, in place in the static tensors."""
        gather_cache_slots(self.cache, first, sources)

    def crop(self, old_slots: int, new_slots: int) -> None:
        pass  # the write position is set before every forward; stale slots are masked, then overwritten

    def shift_rows(self, shifts: torch.Tensor) -> None:
        shift_cache_rows(self.cache, shifts)

    def trim_left(self, count: int, cached_slots: int) -> None:
        for layer in filled_layers(self.cache):
            for tensor in (layer.keys, layer.values):
                tensor[:, :, : cached_slots - count] = tensor[:, :, count: cached_slots].clone()

    def select_rows(self, rows: torch.Tensor, cached_slots: int) -> None:
        """Keep ``rows`` (indices), in place: the kept rows' cached slots move up to the first
        ``len(rows)`` rows, from the first that moves, and every layer's tensors become a view of
        those rows. No cache is allocated; the full tensors go back to the pool with the cache."""
        kept = rows.numel()
        rows = rows.to(torch.long).cpu()
        moved = (rows != torch.arange(kept)).nonzero()
        first = int(moved[0]) if moved.numel() else kept
        for layer in filled_layers(self.cache):
            self._full.setdefault(id(layer), (layer, layer.keys, layer.values))
            for tensor in (layer.keys, layer.values):  # [B, heads, slots, dim]
                if first < kept and cached_slots:
                    tensor[first:kept, :, :cached_slots] = tensor[rows[first:], :, :cached_slots]
            layer.keys, layer.values, layer.batch_size = layer.keys[:kept], layer.values[:kept], kept

    def _give_back(self, model, cache) -> None:
        """Return ``cache`` to the pool with its layers' full tensors (see ``select_rows``)."""
        for layer, keys, values in self._full.values():
            layer.keys, layer.values, layer.batch_size = keys, values, int(keys.shape[0])
        self._full.clear()
        POOL.release(model, cache)

    def adopt(self, cache, slots: int, dtype: torch.dtype, start: int = 0, rows: torch.Tensor | None = None) -> None:
        """Hold another model's first ``slots`` slots, in ``dtype``: those from ``start`` are copied
        (the ones below are the same already; slots past ``slots`` are masked out), and all of
        ``rows`` (indices) where given."""
        self._reserve(self.model_ref(), slots)
        batch = int(cache.layers[0].keys.shape[0])
        for new_layer, layer in zip(self.cache.layers, cache.layers):
            _ensure_initialized(new_layer, layer, batch, dtype)
            if start and rows is not None:
                new_layer.keys[rows, :, :start] = layer.keys[rows, :, :start].to(dtype)
                new_layer.values[rows, :, :start] = layer.values[rows, :, :start].to(dtype)
            new_layer.keys[:, :, start:slots].copy_(layer.keys[:, :, start:slots])
            new_layer.values[:, :, start:slots].copy_(layer.values[:, :, start:slots])

    def load(self, cache, slots: int, owned: bool = False) -> None:
        raise ValueError("a prefix cannot continue on the static cache (use the default dynamic cache)")

    def release(self) -> None:
        """Return the cache to the pool (the next call of this model may reuse it)."""
        model = self.model_ref()
        if model is not None and self.cache is not None:
            self._give_back(model, self.cache)
        self.cache = None


def _round_up(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


def length_ladder(max_length: int) -> tuple[int, ...]:
    """The static cache lengths a warm-up compiles for calls up to ``max_length`` slots: doublings
    of ``LENGTH_STEP`` up to ``max_length`` rounded up (1024 -> 256, 512, 1024; 300 -> 256, 512)."""
    top, ladder, n = _round_up(max_length, LENGTH_STEP), [], LENGTH_STEP
    while n < top:
        ladder.append(n)
        n *= 2
    return (*ladder, top)


def _batch_of(cache) -> int:
    layers = filled_layers(cache)
    return int(layers[0].keys.shape[0]) if layers else 0


def _ensure_initialized(new_layer, like, batch: int, dtype: torch.dtype | None = None) -> None:
    if not new_layer.is_initialized:
        shape = (batch, like.keys.shape[1], 1)  # lazy_initialization reads batch, heads and head size
        keys = like.keys.new_zeros((*shape, like.keys.shape[-1]), dtype=dtype)
        values = like.values.new_zeros((*shape, like.values.shape[-1]), dtype=dtype)
        new_layer.lazy_initialization(keys, values)
