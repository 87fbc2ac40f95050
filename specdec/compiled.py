"""Compiled forwards: the process-wide registry of ``torch.compile`` d model forwards, and the
check that a compiled graph computes what the eager forward does.

A compiled forward is ``fn(model, **kwargs)`` for ``fn`` the compiled ``type(model).forward``.
There is one per (model class, device, options) for the process, so every model of a class
shares its graphs (dynamo's guards on the modules tell two models apart), except a model its
generator *owns* (a private copy that nothing changes), which gets a function of its own with
those guards dropped (:func:`compiled_forward`).

Invariants:

* Compiling never changes output: the first compiled forward of each (width, cache length) of a
  model is checked against an eager one (:func:`agrees`); a model whose graph disagrees is
  recorded as miscompiled and is never compiled again (the caller runs it eagerly).
* The registry holds models weakly: a model that goes away takes its records with it.

* Compiling is never silent and never priced as decoding: a forward that compiles says so on
  stderr (:func:`compiling`; ``SPECDEC_QUIET=1`` hushes it) and its seconds go on this thread's
  compile clock (:func:`compile_seconds`), which the run reads around each step, so that a step
  that compiled is reported apart and teaches the draft-length policy nothing of a forward's cost.

The static cache backend (``specdec.kv.StaticKV``) is the only caller at run time; this module
knows nothing of caches.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
import types
from contextlib import contextmanager
from typing import Any

import torch

from .model_plan import plan_of, planned

_COMPILED: dict[tuple, Any] = {}
_COMPILED_LOCK = threading.Lock()
# per model, in its plan (specdec.model_plan): the compiled functions of a model private to its
# generator (compiled_forward's ``owned``), the (width, cache length) graphs checked against eager
# forwards, and whether a compiled forward disagreed with the eager one (never compiled again)
#: inductor options that drop the generated code's checks of its kernels' outputs (owned models)
NO_ASSERTS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


def compile_option_names() -> tuple[str, ...]:
    """The keyword options ``torch.compile`` takes (read from its signature: they vary by version)."""
    params = inspect.signature(torch.compile).parameters.values()
    return tuple(sorted(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY))


def check_compile_options(options: dict, argument: str) -> None:
    """Refuse a dict of compile options (the argument ``argument``) that ``torch.compile`` does not take."""
    allowed = compile_option_names()
    unknown = sorted(str(k) for k in options if k not in allowed)
    if unknown:
        raise ValueError(f"{argument}: torch.compile takes no option {', '.join(map(repr, unknown))}; "
                         f"the options it takes are {', '.join(allowed)}")


def compiled_forward(model, options: dict, owned: bool = False):
    """``torch.compile`` of the model class's ``forward`` (called as ``fn(model, **kwargs)``), one
    per (class, options) for the process. Default options: ``fullgraph``, no dynamic shapes, and
    on CUDA the mode that captures CUDA graphs.

    ``owned``: the model is private to the generator that built it (a quantized copy of the
    target, say), so neither its modules nor their attributes ever change. It then gets a compiled
    function of its own that checks none of dynamo's guards on its modules: those guards are a
    visible share of a small model's step on a CPU, and they are what tells the graphs of two
    models of one class apart, so a function without them serves one model only. Its graphs also
    skip inductor's checks of the sizes and strides its kernels return (``NO_ASSERTS``). What both
    save is measured in docs/self_draft.md ("No module guards on the copy's compiled steps")."""
    device = next(model.parameters()).device.type
    settings = {"fullgraph": True, "dynamic": False}
    if device == "cuda":
        settings["mode"] = "reduce-overhead"
    settings.update(options)
    key = (type(model), device, tuple(sorted((k, repr(v)) for k, v in settings.items())))
    with _COMPILED_LOCK:
        if not owned:
            if key not in _COMPILED:
                _COMPILED[key] = torch.compile(type(model).forward, **settings)
            return _COMPILED[key]
        made = plan_of(model).compiled
        if key not in made:
            mode = settings.pop("mode", None)  # torch.compile takes a mode or options, not both
            inductor = {**(torch._inductor.list_mode_options(mode) if mode else {}),
                        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                        **NO_ASSERTS, **settings.pop("options", {})}
            made[key] = torch.compile(_own_forward(model), options=inductor, **settings)
        return made[key]


def _own_forward(model):
    """``type(model).forward`` behind a code object of its own: dynamo keeps graphs per code object."""
    def forward(module, **kwargs):
        return type(module).forward(module, **kwargs)

    code = forward.__code__.replace(co_name=f"forward_{type(model).__name__}_{id(model):x}")
    return types.FunctionType(code, forward.__globals__, code.co_name)


def run_compiled(fn, model, kwargs: dict, width: int) -> torch.Tensor:
    """``fn(model, **kwargs)`` for a compiled ``fn``; -> the logits of its first ``width`` columns
    ``[B, width, V]``, on CUDA copied out of the graph's output buffers (CUDA graphs reuse them)."""
    cuda = kwargs["input_ids"].device.type == "cuda"
    if cuda:
        torch.compiler.cudagraph_mark_step_begin()
    with recompile_room():
        logits = fn(model, **kwargs).logits[:, :width]
    return logits.clone() if cuda else logits  # a CPU graph returns tensors of its own


@contextmanager
def recompile_room():
    """Dynamo's recompile limits, raised for the duration of one compiled call: each (width, batch
    size, cache length) of each compiled model is a graph of its own, which the defaults (a few per
    function, a few hundred per process) would otherwise turn into silent eager fallbacks. Set and
    restored by hand: ``config.patch`` costs about 40 us a call, a visible share of a small step."""
    config = torch._dynamo.config
    limits = (config.recompile_limit, config.accumulated_recompile_limit)
    config.recompile_limit, config.accumulated_recompile_limit = max(1024, limits[0]), max(8192, limits[1])
    try:
        yield
    finally:
        config.recompile_limit, config.accumulated_recompile_limit = limits


# -- the first-use check --------------------------------------------------------------------------
def miscompiled(model) -> bool:
    """Whether ``model``'s compiled forward once disagreed with its eager one."""
    plan = planned(model)
    return plan is not None and plan.miscompiled


def checked(model, key: tuple) -> bool:
    """Whether ``model``'s compiled graph for ``key`` (width, cache length, rows) was checked already."""
    plan = planned(model)
    return plan is not None and key in plan.checked


def agrees(model, key: tuple, compiled: torch.Tensor, eager: torch.Tensor) -> bool:
    """Compare a compiled forward's logits with the eager forward's (both ``[B, W, V]``) and record
    the outcome for ``model``: ``key`` checked, or the model miscompiled. A compiled graph whose
    top token is not among the eager forward's top 5 anywhere is wrong (a miscompiled quantized
    kernel, say); rounding differences never move a token that far."""
    top = eager.topk(min(5, eager.shape[-1]), dim=-1).values[..., -1:]  # [B, W, 1] 5th-largest logit
    if bool((eager.gather(-1, compiled.argmax(-1, keepdim=True)) >= top).all()):
        plan_of(model).checked.add(key)
        return True
    plan_of(model).miscompiled = True
    return False


# -- compiling, made visible --------------------------------------------------------------------------
_CLOCK = threading.local()  # .seconds: this thread's seconds of one-time work in forwards; .warming: in warmup()
_ANNOUNCED: set = set()


def compile_seconds() -> float:
    """Seconds this thread has spent in forwards that compiled a graph (see :func:`compiling`) or
    did other one-time work (:func:`one_time`)."""
    return getattr(_CLOCK, "seconds", 0.0)


@contextmanager
def one_time():
    """Around one-time work inside a forward (packing a model's weights, ``engines/forwards/packed.py``):
    its seconds go on this thread's compile clock, so that the step is reported apart and teaches
    the draft-length policy nothing of a forward's cost."""
    started = time.perf_counter()
    try:
        yield
    finally:
        _CLOCK.seconds = compile_seconds() + time.perf_counter() - started


def say(message: str) -> None:
    """One line on stderr about one-time work a call is doing (compiling, measuring), unless
    ``SPECDEC_QUIET`` is set."""
    if os.environ.get("SPECDEC_QUIET", "").strip().lower() in ("", "0", "false", "no"):
        print(f"specdec: {message}", file=sys.stderr, flush=True)


@contextmanager
def compiling(model, key: tuple):
    """Around the first compiled forward of ``model`` for ``key`` (width, cache length, rows), which
    compiles its graph (or finds it in inductor's disk cache): says so on stderr, once per model
    class and key in the process, and puts its seconds on this thread's compile clock."""
    note = (type(model).__name__, *key)
    if note not in _ANNOUNCED:
        _ANNOUNCED.add(note)
        say(f"compiling {note[0]}'s forward of {key[0]} token(s) on a cache of {key[1]} slots for {key[2]} "
            "row(s) (once per process; minutes on a small CPU, less from inductor's disk cache; "
            "SpecDecoder.warmup() does it ahead of time) ...")
    started = time.perf_counter()
    try:
        with one_time():
            yield
    finally:
        seconds = time.perf_counter() - started
        if seconds > 1.0:
            say(f"... compiled in {seconds:.0f} s")


@contextmanager
def flagged(local: threading.local, name: str):
    """Sets the thread-local flag ``local.<name>`` inside the block, and back to what it was after."""
    before = getattr(local, name, False)
    setattr(local, name, True)
    try:
        yield
    finally:
        setattr(local, name, before)


def warming():
    """Marks this thread as warming up (``SpecDecoder.warmup``): forwards that compile only when
    warmed up (:func:`compiles_now`) compile inside it. A context manager."""
    return flagged(_CLOCK, "warming")


def compiles_now(model) -> bool:
    """Whether a forward that compiles only when warmed up should compile for ``model`` now: in
    ``SpecDecoder.warmup`` (:func:`warming`), or once any of its graphs was compiled and checked
    in this process (a call after a warm-up runs the graphs it made)."""
    plan = planned(model)
    return bool(getattr(_CLOCK, "warming", False) or (plan is not None and plan.checked))
