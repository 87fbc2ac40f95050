"""The output layer as ``W @ h.T``: the orientation a CPU multiplies a large head fastest in.

A causal LM's logits are ``h @ W.T`` with ``W [V, H]`` its output embedding. ``nn.Linear`` runs
that on a CPU as a matrix-vector product for one token and as a matrix product with ``W``
transposed for several, and with a large ``W`` both read it far slower than memory allows; the
same product as ``W @ h.T`` (one token padded to two columns) reads it much closer to memory speed,
which matters most for large vocabularies (the measurements, from ``benchmarks/output_layer.py``:
docs/performance.md, "The output layer on a CPU").

:func:`model_logits` runs the model with ``logits_to_keep`` an empty index (the model computes no
logits) and ``output_hidden_states=True``, and applies the head to the last hidden state itself,
Gemma's final soft-capping included. Whether a model gets this is decided once per model for the
process (:meth:`FastHead.of`): a CPU model whose output layer is a plain ``nn.Linear`` of at least
``MIN_ELEMENTS`` weights, whose logits this way match its own forward's on a probe (same top
token everywhere, within ``TOLERANCE`` of the largest logit: anything a model does to its logits
besides the soft-capping, such as a scale, fails here), and on which ``W @ h.T`` timed faster
than ``nn.Linear`` at one and at four tokens. Forward hooks could read or rewrite the logits the
model no longer computes, so a model with any (other than specdec's own timers, which only
count) runs its own head, and so does a forward of more than ``MAX_TOKENS`` tokens (a prompt's
prefill: the model would return every layer's hidden states for it).

Every forward it runs takes its cache by the keyword the model's forward declares
(:func:`with_current_cache_keyword`: ``cache``, where ``transformers`` deprecates
``past_key_values``).

The logits differ from the model's own only in rounding (one matmul in another order), as the
logits of a multi-token verification already differ from those of one-token steps.
"""

from __future__ import annotations

import functools
import inspect
import statistics
import time
from typing import Sequence

import torch

from ...model_plan import UNDECIDED, plan_of
from .attention import grouped_attention
from .direct import DirectForward
from .packed import packed_linears

#: heads smaller than this (vocabulary x hidden size) run as the model runs them: a small head
#: costs little either way
MIN_ELEMENTS = 1 << 22
#: largest difference from the model's own logits, relative to their largest magnitude, by weight dtype
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
HALF_TOLERANCE = 2e-2
#: the head is used only if it takes at most this share of ``nn.Linear``'s time
MIN_GAIN = 0.9
#: most tokens (width x batch) a forward may feed to get the fast head: the model returns every
#: layer's hidden states for it, so a long prompt's prefill (which needs its last logits only) runs
#: the model's own head
MAX_TOKENS = 256
_NO_LOGITS = torch.zeros(0, dtype=torch.long)


class FastHead:
    """``W @ h.T`` (+ bias, then soft-capping) for one model's output layer."""


    def __init__(self, layer: torch.nn.Linear, softcap: float | None):
        self.layer, self.softcap = layer, softcap

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> logits [B, T, V]."""
        b, t, h = hidden.shape
        flat = hidden.reshape(b * t, h)
        if b * t == 1:  # two columns: one would run as the slow matrix-vector product
            flat = flat.expand(2, h).contiguous()
        logits = torch.matmul(self.layer.weight, flat.T).T[: b * t]  # [B*T, V], a transposed view
        if self.layer.bias is not None:
            logits = logits + self.layer.bias
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.reshape(b, t, -1)

    @classmethod
    def of(cls, model) -> "FastHead | None":
        """The model's fast head, or None where it runs its own (decided once per model)."""
        return plan_of(model).decided("head", lambda: cls._decide(model))

    @classmethod
    def pin(cls, model, use: bool) -> "FastHead | None":
        """Decide for ``model`` without timing: True uses the fast head whatever the head's size
        where the model qualifies otherwise (its logits match), False the model's own head. For
        tests, and for machines measured offline. Returns the head now in use."""
        head = cls._candidate(model, min_elements=0) if use else None
        if head is not None and not head._matches(model):
            head = None
        return plan_of(model).set("head", head)

    @classmethod
    def forget(cls, model) -> None:
        """Decide again at ``model``'s next forward."""
        plan_of(model).set("head", UNDECIDED)

    @classmethod
    def _candidate(cls, model, min_elements: int = MIN_ELEMENTS) -> "FastHead | None":
        layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if type(layer) is not torch.nn.Linear:
            return None
        weight = layer.weight
        if (type(weight.data) is not torch.Tensor or not weight.dtype.is_floating_point
                or weight.device.type != "cpu" or weight.numel() < min_elements):
            return None
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        return cls(layer, getattr(config, "final_logit_softcapping", None))

    @classmethod
    def _decide(cls, model) -> "FastHead | None":
        head = cls._candidate(model)
        if head is None or not head._matches(model):
            return None
        return head if head._faster() else None

    def _matches(self, model) -> bool:
        """Whether this head reproduces the model's own logits on a short probe."""
        vocab = self.layer.weight.shape[0]
        ids = (torch.arange(7, device=self.layer.weight.device) * 97 + 11)[None, :] % vocab
        try:
            with torch.no_grad():
                own = model.forward(input_ids=ids, use_cache=False).logits
                out = model.forward(input_ids=ids, use_cache=False, logits_to_keep=_NO_LOGITS,
                                    output_hidden_states=True)
                if (out.logits is not None and out.logits.shape[1] != 0) or not out.hidden_states:
                    return False  # the model ignores logits_to_keep, or gives no hidden states
                mine = self(out.hidden_states[-1])
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError):
            return False
        if mine.shape != own.shape:
            return False
        tolerance = TOLERANCE.get(own.dtype, HALF_TOLERANCE)
        close = float((mine - own).abs().max()) <= tolerance * float(own.abs().max())
        return close and bool((mine.argmax(-1) == own.argmax(-1)).all())

    def _faster(self, reps: int = 3) -> bool:
        """Whether ``W @ h.T`` beats ``nn.Linear`` on this machine at one and four tokens together."""
        weight = self.layer.weight

        def median_seconds(fn) -> float:
            fn()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        linear = mine = 0.0
        with torch.no_grad():
            noise = torch.Generator().manual_seed(0)  # never the global generator a user's seeded sampling reads
            for tokens in (1, 4):
                hidden = torch.randn(1, tokens, weight.shape[1], generator=noise).to(weight.device, weight.dtype)
                linear += median_seconds(lambda: self.layer(hidden))
                mine += median_seconds(lambda: self(hidden))
        return mine < MIN_GAIN * linear


def _observers_only(module: torch.nn.Module) -> bool:
    """Whether every forward hook on ``module`` only observes (specdec's timers), none global."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return False
    hooks = list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values())
    return all(getattr(getattr(h, "__self__", None), "observes_only", False) for h in hooks)


def _observed(model: torch.nn.Module, run):
    """``run()`` between ``model``'s forward hooks, all of them specdec's timers (they only count:
    they are called with no arguments to read)."""
    for hook in list(model._forward_pre_hooks.values()):
        hook(model, ())
    out = run()
    for hook in list(model._forward_hooks.values()):
        hook(model, (), None)
    return out


def model_logits(model, kwargs: dict, *, direct: bool = False, fast_head: bool = True,
                 own: bool = False, hidden_layers: Sequence[int] = ()):
    """``model(**kwargs).logits`` (``model.forward`` if ``direct``: no module hooks), with the output
    layer as :class:`FastHead` where ``fast_head`` and the model qualifies, grouped-query
    attention without copies of the cache on a CPU (``attention.grouped_attention``), a
    forward of a few tokens through packed weights where they pay (``packed.packed_linears``,
    the output layer's among them: no fast head then), and otherwise the decoder's layers as one
    scripted function where the model qualifies (``direct.DirectForward``). ``own`` (the
    caller's ``engine="eager"``) runs the model's forward and none of these: nothing is decided,
    counted or packed for the model by such a call.

    ``hidden_layers`` (``output_hidden_states`` indices) -> ``(logits, {index: [B, T, H]})`` from
    whichever of these runs, the states of every fed column as the model's own
    ``output_hidden_states`` gives them; empty (the default): the logits alone, as ever."""
    kwargs = with_current_cache_keyword(model, kwargs)
    if own:
        call = model.forward if direct else model
        if hidden_layers:
            return _kept(call(**{**kwargs, "output_hidden_states": True}), hidden_layers)
        return call(**kwargs).logits
    fed = kwargs.get("input_ids")
    fed = kwargs.get("inputs_embeds") if fed is None else fed
    device = model.device if fed is None else fed.device
    rows = 0 if fed is None else fed.shape[0] * fed.shape[1]
    width = fed.shape[1] if fed is not None and fed.dim() >= 2 else None
    with grouped_attention(model, device, width), packed_linears(model, rows, device) as packed:
        return _logits(model, kwargs, direct, fast_head and not packed, packed, tuple(hidden_layers))


def with_current_cache_keyword(model, kwargs: dict) -> dict:
    """``kwargs`` with a cache given as ``past_key_values`` passed as ``cache`` where the model's
    forward declares ``cache`` (``transformers`` 5.25 deprecates the old name there, to be removed
    in 5.40); unchanged otherwise, and for a forward that declares only the old name. Specdec's
    own callers name the cache by :func:`~specdec.modelinfo.cache_argument` already; every eager
    decoding forward passes through here, so a caller that does not (a plugin, a test) never makes
    specdec call a forward by the deprecated name."""
    if "past_key_values" not in kwargs or "cache" in kwargs or not _declares_cache(model.forward):
        return kwargs
    renamed = dict(kwargs)
    renamed["cache"] = renamed.pop("past_key_values")
    return renamed


def _declares_cache(forward) -> bool:
    """Whether ``forward`` (a model's bound forward, or what replaced it) takes ``cache`` by name,
    read from its signature (a model class's function once a process)."""
    function = getattr(forward, "__func__", None)
    if inspect.isfunction(function):  # a class's own forward: its signature cannot change
        return _function_declares_cache(function)
    return "cache" in inspect.signature(forward).parameters


@functools.lru_cache(maxsize=256)
def _function_declares_cache(function) -> bool:
    return "cache" in inspect.signature(function).parameters


def _logits(model, kwargs: dict, direct: bool, fast_head: bool, packed: bool, hidden_layers: tuple = ()):
    """:func:`model_logits` once the contexts are entered: logits, or (logits, hidden states)
    where ``hidden_layers`` asks for some."""
    call = model.forward if direct else model
    head = FastHead.of(model) if fast_head else None
    forward = DirectForward.of(model) if kwargs.get("input_ids") is not None else None
    tensors = forward.plan(model, kwargs, direct) if forward is not None else None
    if tensors is not None:
        run = lambda: forward(kwargs, head if head is not None else model.get_output_embeddings(), packed,  # noqa: E731
                              tensors, hidden_layers)
        return run() if direct else _observed(model, run)
    layer = head.layer if head is not None else None
    ids = kwargs.get("input_ids")
    if (head is None or ids is None or ids.numel() > MAX_TOKENS or layer._forward_hooks or layer._forward_pre_hooks
            or not (direct or _observers_only(model))):
        if hidden_layers:
            return _kept(call(**{**kwargs, "output_hidden_states": True}), hidden_layers)
        return call(**kwargs).logits
    keep = kwargs.get("logits_to_keep", 0)
    out = call(**{**kwargs, "logits_to_keep": _NO_LOGITS, "output_hidden_states": True})
    hidden = out.hidden_states[-1]
    if isinstance(keep, int) and keep > 0:
        hidden = hidden[:, -keep:]
    if hidden_layers:
        return head(hidden), _hidden(out, hidden_layers)
    return head(hidden)


def _kept(out, hidden_layers: tuple) -> tuple[torch.Tensor, dict]:
    """(logits, the asked hidden states) of a model output computed with ``output_hidden_states``."""
    return out.logits, _hidden(out, hidden_layers)


def _hidden(out, hidden_layers: tuple) -> dict:
    """{index: [B, T, H]} of ``out.hidden_states`` (the model's own output_hidden_states)."""
    states = out.hidden_states
    if not states:
        raise ValueError("hidden states were asked of a forward that returned none (its model ignores "
                         "output_hidden_states)")
    return {i: states[i] for i in hidden_layers}
