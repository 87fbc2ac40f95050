"""Key/value cache backends of :class:`~specdec.state.ModelState`: dynamic, or static and compiled.

``ModelState`` keeps the layout (which slot holds which row's token); a backend keeps the
tensors and runs the forward. Both backends hold ``transformers`` caches:

* :class:`DynamicKV`: a ``DynamicCache`` of plain full-length layers. Rolling back is a crop.
* :class:`StaticKV`: a ``StaticCache`` of ``StaticLayer`` s, taken from the pool for the call. The
  slot the next forward writes at is each layer's ``cumulative_length``, set before every forward,
  so rolling back is moving that position: rejected slots stay in memory, masked out, and are
  overwritten by the next forward. Rows that leave the batch are dropped in place: the kept rows
  move up inside the same tensors, and the layers hold views of them until the cache goes back to
  the pool whole. Sliding-window layers get full-length ``StaticLayer`` s too
  (the window is applied by the mask, from the model config): ``StaticSlidingWindowLayer`` keeps
  only the last window and would lose the slots a rollback returns to.

With ``compile`` the static backend runs ``torch.compile`` d forwards. Widths are padded to
:data:`WIDTHS` (padded columns feed the pad token at slots past every row's end, masked out,
their logits dropped), the mask always spans the whole cache, and caches are reused across calls
from a pool bounded in bytes (``specdec.cache_pool``), so each (width, batch, cache length)
compiles once per process. A first forward (the prefill) and any forward wider than the widest bucket run eagerly, as in
``transformers``, and so does one that asks for hidden states (a compiled graph returns logits
only). Compiled forwards bypass ``nn.Module`` hooks. The first compiled forward of each width
is checked against an eager one: a model whose compiled graph disagrees (seen with torchao's
int8-activation layers under inductor on CPU) runs eagerly from then on, with a warning.
Which compiled function a model gets, and that check, live in :mod:`specdec.compiled`; this
module keeps the caches and decides when to call it.

Cache lengths. A static cache holds what its call can reach (``reach``: the prompt, the new tokens
that ``max_new_tokens`` and the model's positions allow, and the call margin), but is not
allocated for all of it up front: it starts at the shortest length that holds the prompt and a
little headroom, and grows (copying what it holds) when a forward needs more. Lengths are taken
from a ladder, so that few distinct lengths exist (each is a compiled graph, and the pool reuses
a cache only at its exact length): a length ``SpecDecoder.warmup`` compiled if one holds the
slots, else the shortest doubling of ``LENGTH_STEP`` that does, never past ``reach`` (rounded up
to ``LENGTH_STEP``). Growth at least doubles the length (up to ``reach``), so a call copies its
cache O(log n) times and O(n) slots in all.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from .cache_pool import POOL, new_static_cache  # noqa: F401  (new_static_cache: re-exported)
from .compiled import (agrees, check_compile_options, checked, compiled_forward, compiling, miscompiled,
                       run_compiled)
from .distributed import stage_layout
from .engines import llama_cpp_kv, resolve_engine_name
from .forwards.head import model_logits
from .growing import new_dynamic_cache  # noqa: F401  (re-exported: where caches are made)

#: forward widths the compiled path pads to by default (each compiles once per batch size and
#: cache length); covers a verification of the drafts the policy usually picks
WIDTHS = (1, 2, 4, 8, 16)
#: a static cache's length is a multiple of this (a compiled graph is specific to the length)
LENGTH_STEP = 256
IMPLEMENTATIONS = ("dynamic", "static")


@dataclass(frozen=True)
class CacheSettings:
    """How every model of a call keeps its cache: ``implementation`` "dynamic" or "static";
    ``compile`` False, True, or a dict of ``torch.compile`` options (static only). A static
    cache takes the shortest of ``lengths`` its call fits in (the lengths ``SpecDecoder.warmup``
    compiled: a call that fits one runs the graphs compiled for it), else a rung of the length
    ladder (see the module doc). Attention reads every slot of a static cache, so a short call
    runs faster on a short cache."""

    implementation: str = "dynamic"
    compile: Any = False
    options: dict = field(default_factory=dict, compare=False, hash=False)
    lengths: tuple[int, ...] = ()
    widths: tuple[int, ...] = WIDTHS  # the widths compiled forwards pad to; wider ones run eagerly
    owned: bool = False  # the model is private to its generator: see compiled_forward
    fast_head: bool = True  # eager forwards compute the output layer as ``head.FastHead`` where it pays
    #: the engine the forwards run on (``specdec.engines.ENGINE_CHOICES``): "eager" keeps every
    #: forward of this decoder's models the model's own (no scripted stack, packed weights or fast
    #: output layer), per decoder, whatever another decoder of the same model runs
    engine: str = "auto"

    @classmethod
    def make(cls, implementation: str = "dynamic", compile: Any = False,
             widths: tuple[int, ...] = WIDTHS, fast_head: bool = True, engine: str = "auto") -> "CacheSettings":
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"cache_implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        if not isinstance(compile, (bool, dict)):
            raise TypeError(f"compile must be True, False or a dict of torch.compile options, got {compile!r}")
        if isinstance(compile, dict):
            check_compile_options(compile, "compile")
        if not isinstance(fast_head, bool):
            raise TypeError(f"fast_head must be True or False, got {fast_head!r}")
        resolve_engine_name(engine)
        if engine == "llama_cpp" and (implementation != "dynamic" or compile is not False):
            raise ValueError("engine='llama_cpp' keeps its own keys and values: it takes neither "
                             "cache_implementation='static' nor compile")
        if compile is not False and implementation != "static":
            raise ValueError("compile=True needs cache_implementation='static' (a dynamic cache changes shape "
                             "every step, so compiled forwards would recompile)")
        if not widths or any(not isinstance(w, int) or w < 1 for w in widths):
            raise ValueError(f"compiled widths must be positive ints, got {widths!r}")
        options = dict(compile) if isinstance(compile, dict) else {}
        return cls(implementation, bool(compile is not False), options, widths=tuple(sorted(set(widths))),
                   fast_head=bool(fast_head), engine=engine)

    @property
    def static(self) -> bool:
        return self.implementation == "static"

    @property
    def own_forward(self) -> bool:
        """Whether every forward is the model's own (``engine="eager"``)."""
        return self.engine == "eager"

    @property
    def key(self) -> tuple:
        """What a forward's cost depends on besides the model, device and dtype ("auto" and "cpu"
        run the same forwards)."""
        return (self.implementation, self.compile, self.fast_head, self.own_forward, self.engine == "llama_cpp")


def static_problem(model, prefill_inputs: bool) -> str | None:
    """Why the static path cannot serve ``model``, or None."""
    if prefill_inputs or hasattr(model, "get_rope_index") or hasattr(model.config, "vision_config"):
        return (f"cache_implementation='static' serves text-only models; {type(model).__name__} takes image "
                "inputs (use the default dynamic cache)")
    return None


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

    def forward(self, model, kwargs: dict, *, first_slot: int, width: int, first: bool, mask,
                needs_mask: bool, direct: bool = False, runner=None, hidden_layers: tuple[int, ...] = ()):
        """Run the model on ``kwargs`` (ids/positions ``[B, fed]``, fed = :meth:`padded_width`);
        ``mask(slots)`` gives the ``[B, slots]`` attention mask, needed unless every slot holds a
        real token. ``direct`` calls ``model.forward`` (no module hooks); ``runner(model, kwargs)``,
        where given, runs the forward instead (a tree's, through an engine). -> logits of the first
        ``width`` columns (or fewer, with ``logits_to_keep``); with ``hidden_layers``
        (``output_hidden_states`` indices; not with a runner, which keeps its own) ``(logits,
        {index: [B, fed, H]})``, through the same fast paths (``head.model_logits``)."""
        if needs_mask:
            kwargs["attention_mask"] = mask(first_slot + width)
        if runner is not None:
            return runner(model, kwargs)
        return model_logits(model, kwargs, direct=direct, fast_head=self.settings.fast_head,
                            own=self.settings.own_forward, hidden_layers=hidden_layers)

    def gather_slots(self, first: int, sources: torch.Tensor) -> None:
        """Slot ``first + j`` of row b takes what slot ``sources[b, j]`` holds (``sources [B, W]``):
        a tree's accepted nodes moved into chain order (docs/trees.md)."""
        _gather_slots(self.cache, first, sources)

    def padded_width(self, width: int, first: bool) -> int:
        return width

    def crop(self, old_slots: int, new_slots: int) -> None:
        if old_slots:
            self.cache.crop(new_slots - old_slots)

    def shift_rows(self, shifts: torch.Tensor) -> None:
        """Move row b's cached entries right by ``shifts[b]`` slots, padding its start with zeros."""
        _shift_rows(self.cache, shifts)

    def trim_left(self, count: int, cached_slots: int) -> None:
        """Drop the first ``count`` slots of every row (padding common to all rows)."""
        for layer in _layers(self.cache):
            layer.keys, layer.values = layer.keys[:, :, count:], layer.values[:, :, count:]

    def select_rows(self, rows: torch.Tensor, cached_slots: int) -> None:
        if cached_slots:
            self.cache.batch_select_indices(rows)
        else:  # emptied layers keep their old batch size (batch_select_indices skips them)
            self.cache = new_dynamic_cache(self.layout, self.reach)

    def load(self, cache, slots: int) -> None:
        """Start from a copy of another cache holding ``slots`` slots (a prefix)."""
        self.cache = copy.deepcopy(cache)

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


class StaticKV:
    """A ``StaticCache`` of full-length ``StaticLayer`` s, written in place (see the module doc)."""

    returns_hidden = trees = True  # as DynamicKV's

    def __init__(self, model, batch: int, capacity: int, settings: CacheSettings, reach: int | None = None):
        self.model_ref = weakref.ref(model)
        self.settings, self.batch = settings, batch  # batch: the rows it was made for
        self.reach = max(reach or capacity, capacity)  # slots the call can reach: lengths stop there
        self.length = self._length_for(capacity)
        self.cache = POOL.acquire(model, batch, self.length)
        self._full: dict[int, tuple] = {}  # id(layer) -> (layer, keys, values) of layers narrowed by select_rows
        compiles = settings.compile and not miscompiled(model)
        # looked up in this module's namespace, so tests may patch ``specdec.kv.compiled_forward``
        self.compiled = compiled_forward(model, settings.options, owned=settings.owned) if compiles else None

    def forward(self, model, kwargs: dict, *, first_slot: int, width: int, first: bool, mask,
                needs_mask: bool, direct: bool = False, runner=None, hidden_layers: tuple[int, ...] = ()):
        """As :meth:`DynamicKV.forward`, on the static cache (compiled where it may be)."""
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
            return model_logits(model, kwargs, direct=direct, fast_head=self.settings.fast_head,
                                own=self.settings.own_forward, hidden_layers=hidden_layers)
        kwargs.pop("logits_to_keep", None)  # an int argument would compile one graph per value
        if checked(model, (fed, self.length)):
            return run_compiled(self.compiled, model, kwargs, width)  # [B, width, V]
        with compiling(model, (fed, self.length)):  # the first use compiles: said, and timed apart
            logits = run_compiled(self.compiled, model, kwargs, width)
            return self._check(model, kwargs, first_slot, fed, logits)

    def _check(self, model, kwargs: dict, first_slot: int, fed: int, logits: torch.Tensor) -> torch.Tensor:
        """The first compiled forward of each width is run eagerly too (same slots, same inputs,
        :func:`specdec.compiled.agrees`); a model that disagrees runs eagerly from then on."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(first_slot)
        eager = model.forward(**kwargs).logits[:, : logits.shape[1]]  # [B, width, V]
        if agrees(model, (fed, self.length), logits, eager):
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
        rung = LENGTH_STEP
        while rung < slots:
            rung *= 2
        return max(min(rung, _round_up(self.reach, LENGTH_STEP)), _round_up(slots, LENGTH_STEP))

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
        """As :meth:`DynamicKV.gather_slots`, in place in the static tensors."""
        _gather_slots(self.cache, first, sources)

    def crop(self, old_slots: int, new_slots: int) -> None:
        pass  # the write position is set before every forward; stale slots are masked, then overwritten

    def shift_rows(self, shifts: torch.Tensor) -> None:
        _shift_rows(self.cache, shifts)

    def trim_left(self, count: int, cached_slots: int) -> None:
        for layer in _layers(self.cache):
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
        for layer in _layers(self.cache):
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

    def load(self, cache, slots: int) -> None:
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
    layers = _layers(cache)
    return int(layers[0].keys.shape[0]) if layers else 0


def _ensure_initialized(new_layer, like, batch: int, dtype: torch.dtype | None = None) -> None:
    if not new_layer.is_initialized:
        shape = (batch, like.keys.shape[1], 1)  # lazy_initialization reads batch, heads and head size
        keys = like.keys.new_zeros((*shape, like.keys.shape[-1]), dtype=dtype)
        values = like.values.new_zeros((*shape, like.values.shape[-1]), dtype=dtype)
        new_layer.lazy_initialization(keys, values)


def _layers(cache: DynamicCache):
    return [layer for layer in cache.layers
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel()]


def _gather_slots(cache, first: int, sources: torch.Tensor) -> None:
    """Every layer's slots ``first .. first + W - 1`` of row b take slots ``sources [B, W]``: one
    gather per tensor along the slot dimension (sources may point inside or past the window)."""
    width = sources.shape[1]
    if width == 0:
        return
    for layer in _layers(cache):
        for tensor in (layer.keys, layer.values):  # [B, heads, slots, dim]
            index = sources.to(tensor.device)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
            tensor[:, :, first: first + width] = tensor.gather(2, index)


def _shift_rows(cache, shifts: torch.Tensor) -> None:
    """Move row b's cached entries right by ``shifts[b]`` slots inside the same tensors; the slots
    it leaves are zeroed (a static cache masks them anyway)."""
    moves = [(b, int(n)) for b, n in enumerate(shifts.tolist()) if n > 0]
    for layer in _layers(cache):
        for tensor in (layer.keys, layer.values):  # [B, heads, slots, dim]
            for b, n in moves:
                tensor[b, :, n:] = tensor[b, :, : tensor.shape[2] - n].clone()
                tensor[b, :, :n] = 0


def make_kv(model, batch: int, capacity: int, settings: CacheSettings | None, reach: int | None = None):
    """A cache backend for ``batch`` rows: llama.cpp's for a model a GGUF file serves under
    ``engine="llama_cpp"`` (``specdec.engines.llama_cpp``); a static one starts with room for
    ``capacity`` slots and grows up to ``reach`` (see the module doc); a dynamic one holds what it is given."""
    settings = settings or CacheSettings()
    if settings.engine == "llama_cpp":  # a model with a GGUF file; any other runs as "auto" does
        kv = llama_cpp_kv(model, batch, capacity, settings, reach or 0)
        if kv is not None:
            return kv
    if settings.static:
        return StaticKV(model, batch, capacity, settings, reach)
    return DynamicKV(model, batch, capacity, settings, reach or 0)
