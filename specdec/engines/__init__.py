"""Engines: how one model's forward runs, behind one small protocol (docs/engines.md).

This module is the only part of ``specdec.engines`` that code outside the package may import
(``tests/test_layout.py`` checks it); an engine's own modules stay private to the package.

The protocol, for a batch of B rows feeding T columns each after the S slots their cache holds::

    engine.forward(input_ids [B, T], positions [B, T] (or [3, B, T]), *, layout=CAUSAL, cache=None,
                   attention_mask [B, N] = None, hidden_layers=(), logits_to_keep=None,
                   model_inputs=None) -> EngineOutput(logits [B, T, V], hidden {layer: [B, T, H]})

* :class:`Layout`: a causal block (``CAUSAL``) or a tree, ``Layout.tree(parents [B, K], start [B],
  lengths [B])`` with ``parents[b, i]`` node i's parent (-1: the pending token), parents before
  children, as ``Proposal.parents`` will carry it. A tree node sees the committed prefix and its
  ancestors only; its position is the root's plus its depth (``Layout.chain_columns``).
* :class:`EngineOutput`: the logits and the hidden states asked for, numbered as
  ``output_hidden_states`` numbers them.
* :class:`LayoutNotSupported`: an engine cannot run a layout on a model; it names the model and
  why. The caller runs a chain instead, never different logits.

Engines: ``"eager"``, the model's own ``forward`` and nothing else (:func:`make_engine`);
``"llama_cpp"``, llama.cpp on a GGUF file of the model's weights, which holds its own keys and
values and so takes the place of ``ModelState``'s cache backend (:mod:`.llama_cpp`; a model is
given its file by :func:`attach_gguf`, or :func:`export_gguf` writes one).

Choosing one (``SpecDecoder(..., engine=...)``, docs/engines.md, "Choosing an engine"):
:data:`ENGINE_CHOICES` are the names ``engine=`` takes, checked by :func:`resolve_engine_name`
before any forward; :func:`engine_report` says what a call ran (``out.stats.choices["engine"]``).
"auto" and "cpu" run the CPU engine's forwards where they serve (``forwards/``, each decided per
model by a probe and a timing and kept in the model's plan, ``specdec.model_plan``); "eager" runs
none of them for that decoder alone.

What the core and the plugins use of the CPU engine's parts is re-exported here, and nothing else:
:func:`model_logits` (a cache backend's causal forward through the fast paths), :func:`measuring`,
:func:`call_begins` and :func:`packed_weights_report` (the packed weights), :func:`build_copy`
with :func:`check_weights` and :func:`resolve_weights` (a low-precision copy, ``weights=``), and
:func:`import_torchao_quietly`.
"""

from __future__ import annotations

import os

from ..modelinfo import cache_argument
from ..names import ENGINE_CHOICES
from .base import CAUSAL, Engine, EngineOutput, Layout, LayoutNotSupported, forward_kwargs
from .cpu import CpuEngine
from .cpu import decisions as _cpu_decisions
from .eager import EagerEngine
from .forwards.head import model_logits
from .forwards.lowbit import EAGER_ONLY as EAGER_ONLY_WEIGHTS
from .forwards.lowbit import build_copy, check_copyable, check_weights, import_torchao_quietly, resolve_weights
from .forwards.packed import PackedLinears, measuring
from .llama_cpp import (LlamaCppKV, attach_gguf, export_gguf, gguf_for, gguf_source, gguf_twin, missing_gguf,
                        requantize)
from .llama_cpp import library as llama_cpp_library  # its contexts and checks, for tests and diagnostics
from .llama_cpp.library import INSTALL_HINT as LLAMA_CPP_INSTALL

#: engine name -> its class (constructed with the model it serves)
ENGINES = {EagerEngine.name: EagerEngine, CpuEngine.name: CpuEngine}


def make_engine(name: str, model, **options) -> Engine:
    """The engine called ``name``, serving ``model`` (``options``: its own, e.g. the CPU engine's
    ``fast_head``); an unknown name gets a ValueError with a hint."""
    from ..names import did_you_mean

    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}.{did_you_mean(name, ENGINES)} Known: {', '.join(ENGINES)}")
    return ENGINES[name](model, **options)


#: ENGINE_CHOICES, what ``engine=`` takes (named in specdec.names, torch-free, for the command
#: line): "auto" (the CPU engine's forwards where their probes and timings choose them, the
#: model's own elsewhere), "cpu" (the same, named: a model on a CPU only), "eager" (the model's
#: own forward and nothing else)


def resolve_engine_name(name) -> str:
    """``name`` checked against :data:`ENGINE_CHOICES` (a ValueError with a hint otherwise, a
    TypeError for a non-string), returned as given."""
    from ..names import did_you_mean

    if not isinstance(name, str):
        raise TypeError(f"engine must be a name, one of {', '.join(ENGINE_CHOICES)}; got {name!r}")
    if name not in ENGINE_CHOICES:
        raise ValueError(f"unknown engine {name!r}.{did_you_mean(name, ENGINE_CHOICES)} "
                         f"Known: {', '.join(ENGINE_CHOICES)}")
    return name


def check_engine(name: str, model) -> None:
    """Refuse an engine that cannot serve ``model`` (before any forward): "cpu" and "llama_cpp" need it
    on a CPU, "llama_cpp" a GGUF file of its weights."""
    param = next(model.parameters(), None)
    device = param.device.type if param is not None else "cpu"
    if name in ("cpu", "llama_cpp") and device != "cpu":
        raise ValueError(f"engine={name!r} runs models on a CPU; {type(model).__name__} is on {device} "
                         "(use engine='auto' or 'eager')")
    if name == "llama_cpp" and gguf_for(model) is None:
        raise ValueError(missing_gguf(model))


def engine_for(model, name: str, *, fast_head: bool = True, hooks: bool = True) -> Engine:
    """The engine that runs ``model``'s chain forwards under ``engine=name`` (checked): the eager
    engine for "eager" and for a model off the CPU, the CPU engine otherwise (under "llama_cpp" too,
    for the models llama.cpp does not run: the assistants). ``hooks=False``: forwards that run no
    module hooks (timed ones, which specdec's forward counters must not count)."""
    param = next(model.parameters(), None)
    on_cpu = param is None or param.device.type == "cpu"
    if name == "eager" or not on_cpu:
        return EagerEngine(model, hooks=hooks)
    return CpuEngine(model, fast_head=fast_head, hooks=hooks)


class ChainForward:
    """How a cache backend runs one model's chain (causal) forwards: through the engine that
    ``engine=name`` picks for the model (:func:`engine_for`), made at its first forward; one with
    module hooks and, for timed forwards (``direct``), one without.

    ``chain(kwargs, direct=False, hidden_layers=())`` takes the keywords of the model's forward
    (the cache under its own keyword) -> the logits, or ``(logits, {layer: [B, T, H]})`` where
    ``hidden_layers`` asks for hidden states; :meth:`engine` is the engine itself (a tree step's
    forward runs on it too)."""

    def __init__(self, model, name: str, fast_head: bool = True):
        self.model, self.name, self.fast_head = model, name, fast_head
        self.cache_key = cache_argument(model)
        self._engines: dict[bool, Engine] = {}

    def engine(self, direct: bool = False) -> Engine:
        engine = self._engines.get(direct)
        if engine is None:
            engine = self._engines[direct] = engine_for(self.model, self.name, fast_head=self.fast_head,
                                                        hooks=not direct)
        return engine

    def __call__(self, kwargs: dict, *, direct: bool = False, hidden_layers: tuple[int, ...] = ()):
        out = forward_kwargs(self.engine(direct), kwargs, self.cache_key, hidden_layers=hidden_layers)
        return (out.logits, out.hidden) if hidden_layers else out.logits


def call_begins(model) -> None:
    """A decoding call of ``model`` begins: the CPU engine packs the weights of a model called
    again (``forwards/packed.py``). Not under ``engine="eager"``, whose calls are no sign of use."""
    PackedLinears.calling(model)


def packed_weights_report(model) -> str | None:
    """What the CPU engine decided about packing ``model``'s weights, and why (``stats.choices
    ["packed_weights"]``), or None before it decided."""
    return PackedLinears.decision(model)


def llama_cpp_kv(model, batch: int, capacity: int, settings, reach: int = 0):
    """llama.cpp's cache backend for ``model`` (``engine="llama_cpp"``), or None where no GGUF file serves it."""
    path = gguf_for(model)
    return None if path is None else LlamaCppKV(model, path, batch, capacity, settings, reach)


def engine_report(model, name: str, fast_head: bool = True) -> str:
    """What engine ``name`` (checked) runs ``model``'s forwards with, in words (``stats.choices``):
    "eager: ..." or "cpu: ..." with what its forwards decided so far for the model (read only:
    nothing is probed or timed here)."""
    if name == "eager":
        return "eager: the model's own forward"
    if name == "llama_cpp":
        path = gguf_for(model)
        if path is not None:
            return f"llama_cpp: {os.path.basename(path)} (llama-cpp-python {llama_cpp_library.version()})"
        return "cpu (llama_cpp: no GGUF file for this model)"
    param = next(model.parameters(), None)
    if param is not None and param.device.type != "cpu":
        return f"eager ({name}: the CPU engine serves models on a CPU; this one is on {param.device.type})"
    said = _cpu_decisions(model)
    if not fast_head:
        said = said[: said.rindex("; fast output layer")] + "; fast output layer off (fast_head=False)"
    return f"cpu{' (auto)' if name == 'auto' else ''}: {said}"


__all__ = ["CAUSAL", "ENGINES", "CpuEngine", "EagerEngine", "Engine", "EngineOutput", "Layout", "LayoutNotSupported",
           "ENGINE_CHOICES", "check_engine", "engine_report", "make_engine", "resolve_engine_name",
           "LLAMA_CPP_INSTALL", "attach_gguf", "export_gguf", "gguf_for", "gguf_source", "gguf_twin", "llama_cpp_kv",
           "llama_cpp_library", "missing_gguf", "requantize",
           "ChainForward", "call_begins", "engine_for", "forward_kwargs", "measuring", "model_logits",
           "packed_weights_report",
           "EAGER_ONLY_WEIGHTS", "build_copy", "check_copyable", "check_weights", "import_torchao_quietly",
           "resolve_weights"]
