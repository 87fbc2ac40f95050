"""One model's plan: everything this process decided and measured about running that model.

Each decision specdec makes about how a model runs on this machine, and each measurement it keeps
for that, is a field of the model's one :class:`ModelPlan` (:func:`plan_of`), nowhere else:

* the CPU engine's (``specdec/engines/``): the forward through the scripted stack (``direct``), the
  output layer as ``W @ h.T`` (``head``) and the packed weights (``packed``), each decided at its
  first use by a probe and a timing, or pinned;
* the compiled forwards of a model private to its generator and the (width, cache length) graphs
  checked against eager forwards (``compiled``, ``checked``), and whether a compiled forward ever
  disagreed (``miscompiled``): ``specdec.compiled``;
* the forward costs the draft-length policy starts from (``costs``, ``specdec.policy.costs``) and,
  for an assistant, its last measured drafting cost (``drafting_share``, ``specdec.policy.memory``).

A plan lives as long as its model (held weakly: a plan never keeps a model alive) and is shared by
every decoder of that model in the process, so two decoders of one target pack its weights once
and time it once. :meth:`ModelPlan.forget` decides everything again at the next use, as a call does
for a model whose parameters changed since the last (:meth:`ModelPlan.changed`). Across
processes, the copy a generator drafts with is remembered on disk (``specdec/copies/choice_file.py``);
nothing else is.

This module imports nothing of specdec's: the fields are filled by the modules named above.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

#: a decision not made yet (``ModelPlan.direct`` and ``ModelPlan.head``; None means "decided: not used")
UNDECIDED: Any = type("Undecided", (), {"__repr__": lambda self: "UNDECIDED", "__bool__": lambda self: False})()


class ModelPlan:
    """What this process decided and measured for one model (see the module doc). ``lock`` guards
    every field; a decision that probes or times is made outside it and stored under it, the first
    one stored winning."""

    def __init__(self):
        self.lock = threading.RLock()
        self.layout: tuple | None = None  # the parameters the decisions were made for (see changed)
        self.forget()

    def changed(self, model) -> bool:
        """Whether ``model``'s parameters and buffers differ from those at the last check (another
        dtype or device, a resized or replaced layer, a replaced rotary embedding); a plan made for
        others is forgotten (the caller drops what it keeps outside the plan: ``specdec.kv.make_kv``
        its pooled static caches). Float attributes of its modules (a norm's eps, an attention's
        scaling, which the scripted stack reads once) count too; tensor values changed in place do not
        (the packed weights compare samples of theirs at each call)."""
        layout = tuple((p.dtype, p.device, p.shape, 0 if p.is_meta else id(p))  # meta: offloaded, swapped in
                       for tensors in (model.parameters(), model.buffers()) for p in tensors)
        layout += tuple(value for module in model.modules() for value in vars(module).values()
                        if type(value) is float)
        with self.lock:
            changed = self.layout is not None and layout != self.layout
            if changed:
                self.forget()
            self.layout = layout
        return changed

    def forget(self) -> None:
        """Decide and measure everything again at the model's next use."""
        with self.lock:
            self.direct: Any = UNDECIDED  # the engine's DirectForward, or None: the model's own decoder
            self.head: Any = UNDECIDED  # the engine's FastHead, or None: the model's own output layer
            self.packed: Any = None  # the engine's PackedLinears (made at the first forward that asks)
            self.compiled: dict[tuple, Any] = {}  # (class, options) -> compiled forward, for an owned model
            self.checked: set[tuple] = set()  # (width, cache length, rows) graphs that agreed with eager forwards
            self.miscompiled = False  # a compiled forward disagreed once: never compiled again
            self.costs: dict[tuple, Any] = {}  # cost key -> the policy's CostModel
            self.drafting_share: float | None = None  # as an assistant: drafting cost / target step

    def decided(self, name: str, decide: Callable[[], Any]) -> Any:
        """The decision ``name`` (``direct``, ``head``), made by ``decide()`` where still UNDECIDED:
        outside the lock (it may probe and time), the first one stored standing."""
        with self.lock:
            if getattr(self, name) is not UNDECIDED:
                return getattr(self, name)
        made = decide()
        with self.lock:
            if getattr(self, name) is UNDECIDED:  # another thread may have decided meanwhile
                setattr(self, name, made)
            return getattr(self, name)

    def set(self, name: str, value: Any) -> Any:
        """Set the field ``name`` (a decision pinned, or UNDECIDED to decide again); returns ``value``."""
        with self.lock:
            setattr(self, name, value)
        return value


_PLANS: "weakref.WeakKeyDictionary[Any, ModelPlan]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def plan_of(model) -> ModelPlan:
    """``model``'s plan (made empty at the first ask)."""
    with _LOCK:
        plan = _PLANS.get(model)
        if plan is None:
            plan = _PLANS[model] = ModelPlan()
        return plan


def planned(model) -> ModelPlan | None:
    """``model``'s plan where one was made, else None (reading makes none)."""
    with _LOCK:
        return _PLANS.get(model)
