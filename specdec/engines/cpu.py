"""The CPU engine: specdec's faster forwards of a model on a CPU, and what it decided for a model.

Its forwards are this package's ``forwards/``: the decoder layers as one scripted stack
(``forwards/stack.py``, through ``forwards/direct.py`` for the target), the linear layers through
weights packed for MKL (``forwards/packed.py``) and the output layer as ``W @ h.T``
(``forwards/head.py``), each decided per model by a probe and a timing and kept in the
model's plan (``specdec.model_plan``). ``engine="auto"`` and
``engine="cpu"`` let them run where those decisions choose them; ``engine="eager"`` turns all of
them off for one decoder's forwards (``CacheSettings.engine``, read by ``forwards.head.model_logits``).

:class:`CpuEngine` is the protocol's forward on them: a tree layout runs through the stack with
the tree's boolean mask (:func:`~specdec.engines.base.tree_visibility`) where the stack serves the
model and the call (the direct forward decided for it, specdec's dynamic cache, no prefill-only
inputs), and through :class:`~specdec.engines.eager.EagerEngine` otherwise; a causal layout runs
through ``forwards.head.model_logits``, which takes each fast path that serves the forward (a
decoder's chain forwards come here from its cache backends, ``kv.py``).

:func:`decisions` only reads the plan: it never probes, times or packs, so reporting a
choice changes nothing another decoder of the same model does.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ..model_plan import UNDECIDED, planned
from ..modelinfo import cache_argument
from .forwards.direct import DirectForward
from .forwards.head import model_logits
from .base import CAUSAL, EngineOutput, Layout, model_kwargs, tree_visibility
from .eager import EagerEngine

def _said(decided, used: str = "used") -> str:
    return "not decided yet" if decided is UNDECIDED else (used if decided is not None else "not used")


def decisions(model) -> str:
    """What the CPU engine's forwards decided for ``model`` so far, in words: the scripted Llama
    stack, the packed weights and the fast output layer, each "used", "not used" or "not decided
    yet" (each is decided at its first use; the packed weights' reason is ``stats.choices
    ["packed_weights"]``)."""
    plan = planned(model)
    if plan is None:
        direct = head = packed = UNDECIDED
    else:
        with plan.lock:
            direct, head, state = plan.direct, plan.head, plan.packed
        packed = UNDECIDED if state is None or state.decided is None else (state if state.decided else None)
    rows = "used for forwards of %d-%d rows" % packed.rows if packed not in (None, UNDECIDED) else ""
    return (f"scripted Llama stack {_said(direct)}; packed weights {_said(packed, rows)}; "
            f"fast output layer {_said(head)}")


class CpuEngine:
    """See the module doc. One instance per model."""

    name = "cpu"

    def __init__(self, model, fast_head: bool = True, hooks: bool = True):
        self.model, self.fast_head = model, fast_head  # fast_head: the output layer as W @ h.T where it pays
        self.hooks = hooks  # False: no module hooks run (forwards a timer must not count)
        self.eager = EagerEngine(model, hooks=hooks)
        self._cache_kwarg = cache_argument(model)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *, layout: Layout = CAUSAL,
                cache: Any = None, attention_mask: torch.Tensor | None = None,
                hidden_layers: Sequence[int] = (), logits_to_keep: int | None = None,
                model_inputs: Mapping[str, Any] | None = None) -> EngineOutput:
        if layout.is_tree:
            kwargs = self._stack_inputs(input_ids, positions, layout, cache, attention_mask, logits_to_keep,
                                        model_inputs)
            if kwargs is None:
                return self.eager.forward(input_ids, positions, layout=layout, cache=cache,
                                          attention_mask=attention_mask, hidden_layers=hidden_layers,
                                          logits_to_keep=logits_to_keep, model_inputs=model_inputs)
        else:
            kwargs = model_kwargs(input_ids, positions, self._cache_kwarg, cache, attention_mask, logits_to_keep,
                                  model_inputs)
        out = model_logits(self.model, kwargs, direct=not self.hooks, fast_head=self.fast_head,
                           hidden_layers=tuple(hidden_layers))
        logits, hidden = out if hidden_layers else (out, {})
        return EngineOutput(logits=logits, hidden=hidden)

    def serves_trees(self, cache=None) -> bool:
        """Whether a tree forward on ``cache`` runs through the stack (not the eager engine)."""
        direct = DirectForward.of(self.model) if self._on_cpu() else None
        return direct is not None and (cache is None or all(
            type(layer).__name__ == "GrowingLayer" for layer in getattr(cache, "layers", ())))

    def check_tree_support(self, cache=None) -> None:
        """Raise ``LayoutNotSupported`` unless a tree forward on ``cache`` runs, through the stack
        (its mask is the stack's own: nothing to probe) or the eager engine (which probes)."""
        if not self.serves_trees(cache):
            self.eager.check_tree_support(cache)

    def _on_cpu(self) -> bool:
        param = next(self.model.parameters(), None)
        return param is not None and param.device.type == "cpu"

    def _stack_inputs(self, input_ids, positions, layout: Layout, cache, attention_mask, logits_to_keep,
                      model_inputs) -> dict | None:
        """The keyword arguments of a tree forward through the stack (its mask boolean, [B, 1, T, N]),
        or None where the eager engine runs it (other inputs, a model or cache the stack does not
        serve)."""
        if model_inputs or positions.dim() != 2 or not self.serves_trees(cache):
            return None
        batch, width = input_ids.shape
        layout.check(width, batch)
        cached = int(cache.get_seq_length())
        mask = tree_visibility(layout, cached, attention_mask, batch, width, input_ids.device)[:, None]
        kwargs = model_kwargs(input_ids, positions, self._cache_kwarg, cache, mask, logits_to_keep)
        direct = DirectForward.of(self.model)
        return kwargs if direct.plan(self.model, kwargs, direct=not self.hooks) is not None else None
