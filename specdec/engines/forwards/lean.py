"""An eager forward in few operations for a w8a8 or int4 copy of a pre-norm decoder (Llama's layout).

A draft step of a small model on a CPU runs thousands of tensor operations of a few microseconds
each; run eagerly through ``transformers``' modules, that dispatching, not the int8 products,
is most of the step (docs/self_draft.md, "How the copy drafts"). Compiling removes it, but
compiling takes minutes on a small CPU, which a first call must not spend. This forward runs the
copy's decoder layers through :class:`~specdec.engines.forwards.stack.LlamaStack` with ``"int8"`` or
``"int4"`` linears: query-key-value and gate-up stacked into one product each (the copy's own
layers keep views of the stacked weights, so no weight is stored twice; products per output
channel are unchanged by stacking), the rotary embedding applied to queries and keys at once, keys
and values written into the static cache's slots directly, attention over the slots up to the last
one written, the whole stack one scripted function.

It serves a copy's one-token-or-few steps on a ``transformers`` ``StaticCache`` (how a copy
drafts, ``specdec.kv.StaticKV``); any other call (no cache, another cache, more than
:data:`MAX_WIDTH` tokens, hidden states asked for) goes to the model's own forward. Compiled
forwards are the model class's own (``specdec.compiled``), untouched.

Invariants: the copy's outputs differ from its own forward's in rounding only (operations in
another order), which changes no output of a call (a copy only drafts); the copy's cache holds
what its own forward would have written there.
"""

from __future__ import annotations

import inspect
import types

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import int4
from .int4 import Int4Linear
from .int8 import Int8Linear
from .rotation import rotatable
from .stack import LlamaStack, layout_problem

#: widest forward this path runs (a draft step, a re-feed); wider ones (a prefill) run the model's own
MAX_WIDTH = 16
#: the keyword arguments this forward understands (others send the call to the model's own)
KNOWN = {"input_ids", "position_ids", "cache", "past_key_values", "attention_mask", "use_cache", "logits_to_keep",
         "cache_position"}


def lean_problem(model) -> str | None:
    """Why :func:`install` cannot serve ``model`` (a copy whose linear layers are all
    :class:`~specdec.engines.forwards.int8.Int8Linear`, or all :class:`~specdec.engines.forwards.int4.Int4Linear`
    but an output layer that may be a :class:`~specdec.engines.forwards.int4.Bfloat16Head`),
    or None where it can: rotation's layout, and no sliding window, partial rotary embedding or
    extra part of attention or MLP (and, for int4, output widths that stack: multiples of 64)."""
    problems = [rotatable(model, Int8Linear), rotatable(model, Int4Linear, head=(Int4Linear, int4.Bfloat16Head))]
    if all(problems):
        return problems[0]
    if problems[0] is not None and any(module.out_features % int4.STACK_ROWS for module in model.modules()
                                       if isinstance(module, Int4Linear)):
        return f"int4 layers whose output widths are not multiples of {int4.STACK_ROWS} (they would not stack)"
    kind = Int8Linear if problems[0] is None else Int4Linear
    problem = layout_problem(model, (kind,), head_types=None)
    if problem is not None:
        return problem
    for layer in model.get_decoder().layers:
        attn, mlp = layer.self_attn, layer.mlp
        if mlp.gate_proj.out_features != mlp.up_proj.out_features:
            return "gate and up projections of different widths"
        if any(getattr(lin, "rotation_a", None) is not None for lin in (*attn.children(), mlp.gate_proj, mlp.up_proj)):
            return "an input rotated other than the MLP output layer's"
    return None


class LeanForward:
    """The forward installed on a copy (:func:`install`): see the module doc."""

    def __init__(self, model, script: bool = True):
        self.own = types.MethodType(type(model).forward, model)  # the model's own forward
        self.__signature__ = inspect.signature(self.own)  # what callers inspect (the cache's argument name)
        low_bit = "int8" if isinstance(model.get_decoder().layers[0].self_attn.q_proj, Int8Linear) else "int4"
        self.stack = LlamaStack(model, low_bit, script=script)
        self.head = model.get_output_embeddings()
        self.scripted = self.stack.scripted

    def serves(self, kwargs: dict) -> bool:
        cache, ids = _cache(kwargs), kwargs.get("input_ids")
        if ids is None or ids.shape[1] > MAX_WIDTH or kwargs.get("position_ids") is None or not set(kwargs) <= KNOWN:
            return False
        if kwargs.get("attention_mask") is not None and kwargs["attention_mask"].dim() != 2:
            return False
        layers = getattr(cache, "layers", None)
        return (layers is not None and len(layers) == len(self.stack.layers)
                and all(type(layer).__name__ == "StaticLayer" and layer.is_initialized for layer in layers))

    def __call__(self, *args, **kwargs):
        if args or not self.serves(kwargs):
            return self.own(*args, **kwargs)
        with torch.no_grad():
            cache = _cache(kwargs)
            logits = self._forward(cache, kwargs["input_ids"], kwargs["position_ids"], kwargs.get("attention_mask"),
                                   kwargs.get("logits_to_keep", 0))
            return CausalLMOutputWithPast(logits=logits)

    def _forward(self, cache, input_ids, position_ids, attention_mask, logits_to_keep) -> torch.Tensor:
        caches = cache.layers
        start = int(caches[0].cumulative_length)  # the first slot this forward writes
        hidden = self.stack.embed_tokens(input_ids)  # [B, T, H]
        # the stack runs in inference mode: each of its small operations skips autograd's
        # bookkeeping (docs/performance.md); the caches it writes into stay ordinary tensors
        hidden, _ = self.stack(hidden, position_ids, [c.keys for c in caches], [c.values for c in caches], start,
                               attention_mask)
        for c in caches:
            c.cumulative_length.fill_(start + input_ids.shape[1])
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        return self.head(self.stack.norm(hidden))


def _cache(kwargs: dict):
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def install(model, script: bool = True) -> bool:
    """Give ``model`` (a private w8a8 copy) the lean forward where :func:`lean_problem` allows (its
    layers scripted where ``script`` and this torch can); returns whether it did. The model's class
    forward (what compiling traces) is unchanged."""
    if lean_problem(model) is not None:
        return False
    model.forward = LeanForward(model, script=script)
    return True
