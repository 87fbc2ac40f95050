"""The target's forward of a few tokens through :class:`~specdec.engines.forwards.stack.LlamaStack`.

The stack runs the decoder layers in the model's own operations and order, without its modules
(``stack.py``, ``"float"`` linears). For one token and no padding it gives the model's own logits
bit for bit; with a mask (several tokens, a padded batch) the mask is the causal one over the
slots each row holds, as specdec's grouped attention computes it, so the logits differ from the
model's own at most in rounding, as a verification's always did.

:meth:`DirectForward.of` decides once per model and process whether the model gets it: a
float model on a CPU whose layers are the Llama layout (``stack.layout_problem``) with plain
``nn.Linear`` projections, whose direct one-token logits equal its own bit for bit on a probe
(anything a model does that the stack does not, e.g. a scaled embedding, fails here), and
whose direct steps timed faster than its own on that probe (medians of 5, taking turns); the
step that decides counts as one-time work (reported apart, pricing nothing). It serves a forward
(:meth:`DirectForward.serves`) on a :class:`specdec.growing.GrowingLayer` cache (specdec's dynamic
cache) of at most ``packed.MAX_ROWS`` rows (tokens x batch rows; their products through the
weights packed for MKL where ``packed.py`` packs them for the forward), asking for logits (and
hidden states, below), with no module hooks but specdec's own timers; anything else runs the
model's own forward.

Hidden states. A forward may ask for some of ``output_hidden_states`` (``hidden_layers``: index 0
the embeddings, index i < layers the residual stream before layer i, index ``layers`` the last
layer's output after the final norm, as ``transformers`` 5.25's ``LlamaModel`` with
``capture_outputs`` returns them): the stack keeps a reference to each asked state as it passes
(no copy, nothing kept when none is asked), for every fed column whatever ``logits_to_keep`` says.
They are the model's own up to the rounding its logits differ by.

The model is only read: its weights are used in place, nothing is stacked or copied.
"""

from __future__ import annotations

import statistics
import time
import weakref
from typing import Sequence

import torch

from ...compiled import one_time
from ...growing import GrowingLayer, new_dynamic_cache
from ...modelinfo import cache_argument
from ...model_plan import UNDECIDED, plan_of
from .packed import MAX_ROWS, PackedLinears
from .stack import LlamaStack
from .stack import layout_problem as stack_problem

#: the direct step is used only if it takes at most this share of the model's own
MIN_GAIN = 0.95
#: the keyword arguments it understands (any other sends the call to the model's own forward)
KNOWN = {"input_ids", "position_ids", "past_key_values", "cache", "attention_mask", "use_cache", "logits_to_keep"}


def layout_problem(model) -> str | None:
    """Why :class:`DirectForward` cannot compute ``model``'s forward, or None where it can: the
    stack's layout with plain float ``nn.Linear`` projections on a CPU."""
    problem = stack_problem(model)
    if problem is not None:
        return problem
    for layer in model.get_decoder().layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
            getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(lin.weight.data) is not torch.Tensor or not lin.weight.dtype.is_floating_point
               or lin.weight.device.type != "cpu" for lin in linears):
            return "projections other than plain float nn.Linear layers on a CPU"
    return None


def _hooked(model, direct: bool) -> bool:
    """Whether a forward hook would miss the direct forward or see it wrong: a global one, any on
    a module inside ``model`` (they would not run) but transformers' idle output capturing, or,
    unless the call is ``direct`` (the model's own hooks do not run then either), one on ``model``
    other than specdec's own timers (which ``head.model_logits`` runs around it: they only count)."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    modules = model.modules()
    next(modules)  # the model itself
    if any(not _capturing(hook) for m in modules for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())):
        return True
    return not direct and not all(getattr(getattr(hook, "__self__", None), "observes_only", False)
                                  for hook in (*model._forward_hooks.values(), *model._forward_pre_hooks.values()))


def _capturing(hook) -> bool:
    """Whether ``hook`` is one of the hooks ``transformers`` leaves on a model's layers once a
    forward asked for hidden states or attentions: they record only inside such a forward of the
    model's own (``capture_outputs`` sets their collector), and do nothing otherwise. Known by the
    module that defines them, not by a function's name; where that module is gone (another
    ``transformers``), no hook is taken for one, and a model with any runs its own forward."""
    return _CAPTURE_MODULE is not None and getattr(hook, "__module__", None) == _CAPTURE_MODULE


def _capture_module() -> str | None:
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    return output_capturing.__name__ if hasattr(output_capturing, "capture_outputs") else None


_CAPTURE_MODULE = _capture_module()


class DirectForward:
    """One model's direct forward (see the module doc)."""


    def __init__(self, model):
        self.stack = LlamaStack(model, "float")
        self.decoder, self.model = model.get_decoder(), weakref.ref(model)

    def tensors(self) -> tuple[list, list, list] | None:
        """The stack's tensors as the model holds them now (``LlamaStack.tensors``), or None where a
        projection is no longer a plain ``nn.Linear``."""
        return self.stack.tensors()

    @classmethod
    def of(cls, model) -> "DirectForward | None":
        """The model's direct forward, or None where it runs its own (decided once per model)."""
        return plan_of(model).decided("direct", lambda: cls._decide(model))

    @classmethod
    def pin(cls, model, use: bool) -> "DirectForward | None":
        """Decide for ``model`` without timing (for tests): True uses the direct forward where the
        model qualifies and its probe matches, False never. Returns what is now in use."""
        direct = cls._candidate(model) if use else None
        if direct is not None and not direct._matches(model):
            direct = None
        return plan_of(model).set("direct", direct)

    @classmethod
    def forget(cls, model) -> None:
        plan_of(model).set("direct", UNDECIDED)

    @classmethod
    def _candidate(cls, model) -> "DirectForward | None":
        if layout_problem(model) is not None:
            return None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return None  # a sharded model's layers gather through hooks and plans of their own
        return cls(model)

    @classmethod
    def _decide(cls, model) -> "DirectForward | None":
        direct = cls._candidate(model)
        if direct is None:
            return None
        with one_time():  # the step that probes is reported apart, and prices nothing
            return direct if all(direct._verdict(model)) else None

    # -- serving ------------------------------------------------------------------------------
    def serves(self, model, kwargs: dict, direct: bool) -> bool:
        """Whether this forward computes ``kwargs``' (a call of ``model.forward`` if ``direct``,
        else of ``model``)."""
        return self.plan(model, kwargs, direct) is not None

    def plan(self, model, kwargs: dict, direct: bool) -> tuple[list, list, list] | None:
        """:meth:`tensors` where this forward computes ``kwargs``' (see :meth:`serves`), else None."""
        ids, cache = kwargs.get("input_ids"), _cache(kwargs)
        if ids is None or ids.dim() != 2 or ids.numel() > MAX_ROWS or kwargs.get("position_ids") is None:
            return None
        if not set(kwargs) <= KNOWN or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2 and not (mask.dim() == 4 and mask.dtype == torch.bool
                                                         and mask.shape[2] == ids.shape[1]):
            return None  # a 2-D mask of real slots, or a boolean [B, 1, T, N] one (a tree's, engines/cpu.py)
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != len(self.stack.layers) or not all(type(layer) is GrowingLayer for layer in layers):
            return None
        return None if _hooked(model, direct) else self.tensors()

    def __call__(self, kwargs: dict, head, packed: bool = False, tensors: tuple | None = None,
                 hidden_layers: Sequence[int] = ()):
        """The logits of ``kwargs``' forward (served: :meth:`serves`); ``head`` maps the final
        hidden states [B, T, H] to logits; ``packed``: the products go through the model's weights
        packed for MKL (``packed.packed_linears`` said so for this forward); ``tensors``: what
        :meth:`plan` returned for it (read again where not given). With ``hidden_layers``
        (``output_hidden_states`` indices, 0 .. layers): ``(logits, {index: [B, T, H]})``, every fed
        column (``logits_to_keep`` cuts the logits only), as the model's own forward gives them
        (:func:`hidden_states`)."""
        ids, positions, cache = kwargs["input_ids"], kwargs["position_ids"], _cache(kwargs)
        batch, width = ids.shape
        layers = cache.layers
        start = layers[0].keys.shape[-2] if layers[0].is_initialized and layers[0].keys.dim() == 4 else 0
        end = start + width
        hidden = self.decoder.embed_tokens(ids)
        like = hidden.new_empty(batch, self.stack.kv_heads, width, self.stack.head_dim)
        buffers = [layer.reserve(like, end) for layer in layers]
        tensors = tensors if tensors is not None else self.tensors()
        weights = None
        if packed:
            state = PackedLinears.of(self.model())
            weights = [[state.packed_weight(linear) for linear in mine] for mine in tensors[0]]
        count = len(layers)
        capture = sorted({_layer_index(i, count) for i in hidden_layers})
        embedded = hidden
        hidden, captured = self.stack(hidden, positions, [k for k, _ in buffers], [v for _, v in buffers], start,
                                      kwargs.get("attention_mask"), tensors, weights, capture)
        for layer in layers:
            layer.filled(end)
        keep = kwargs.get("logits_to_keep", 0)
        if not hidden_layers:
            if isinstance(keep, int) and keep > 0:
                hidden = hidden[:, -keep:]
            return head(self.decoder.norm(hidden))
        norms_last = _norms_last(self.model())
        states = hidden_states(dict(zip(capture, captured)), embedded, self.decoder.norm, count, norms_last)
        final = states[count] if count in states and norms_last else self.decoder.norm(hidden)  # [B, T, H]
        if isinstance(keep, int) and keep > 0:
            final = final[:, -keep:]
        return head(final), {i: states[_layer_index(i, count)] for i in hidden_layers}

    # -- deciding -----------------------------------------------------------------------------
    def _probe(self, model, steps: int = 5) -> tuple[list, list, list, list]:
        """``steps`` one-token steps after a short prefix, the model's own and direct in turn on
        caches of their own: (own logits, direct logits, own seconds, direct seconds)."""
        vocab = model.get_input_embeddings().weight.shape[0]
        device = model.get_input_embeddings().weight.device
        ids = ((torch.arange(8 + steps, device=device) * 97 + 11) % vocab)[None]
        runs = (self._own_step, self._direct_step)
        logits: tuple[list, list] = ([], [])
        seconds: tuple[list, list] = ([], [])
        with torch.no_grad():
            caches = [new_dynamic_cache() for _ in runs]
            for cache in caches:
                model.forward(input_ids=ids[:, :8], **{cache_argument(model): cache}, use_cache=True)
            for i in range(8, 8 + steps):
                for which in ((0, 1) if i % 2 else (1, 0)):
                    started = time.perf_counter()
                    logits[which].append(runs[which](model, ids[:, i:i + 1], torch.tensor([[i]], device=device),
                                                     caches[which]))
                    seconds[which].append(time.perf_counter() - started)
        return logits[0], logits[1], seconds[0], seconds[1]

    @staticmethod
    def _own_step(model, ids, positions, cache):
        return model.forward(input_ids=ids, position_ids=positions, **{cache_argument(model): cache}, use_cache=True).logits

    def _direct_step(self, model, ids, positions, cache):
        return self({"input_ids": ids, "position_ids": positions, "past_key_values": cache},
                    model.get_output_embeddings())

    def _verdict(self, model) -> tuple[bool, bool]:
        """(whether the direct one-token logits equal the model's own bit for bit on a probe,
        whether its steps were faster there: medians, taking turns)."""
        try:
            own, mine, own_seconds, my_seconds = self._probe(model)
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError):
            return False, False
        equal = all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(own, mine))
        return equal, statistics.median(my_seconds) < MIN_GAIN * statistics.median(own_seconds)

    def _matches(self, model) -> bool:
        return self._verdict(model)[0]


def hidden_states(captured: dict, embedded: torch.Tensor, norm, count: int, norms_last: bool) -> dict:
    """The stack's ``captured`` states ({index: [B, T, H]}) as ``output_hidden_states``
    gives them: index ``count`` (the last layer's output) through the final ``norm`` where
    ``norms_last`` (``transformers``' ``capture_outputs`` replaces the last hidden state by the
    decoder's ``last_hidden_state``, the normed one, unless ``config.tie_last_hidden_states`` is
    False: transformers/utils/output_capturing.py), and ordinary tensors, not the inference
    tensors the stack made (a caller may change them in place; the embeddings are one already)."""
    states = {}
    for index, state in captured.items():
        if index == count and norms_last:
            state = norm(state)  # outside inference mode: an ordinary tensor
        elif state is not embedded and state.is_inference():
            state = state.clone()
        states[index] = state
    return states


def _norms_last(model) -> bool:
    """Whether ``model``'s last ``output_hidden_states`` entry is after the final norm (see
    :func:`hidden_states`)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "tie_last_hidden_states", None) is not False


def _layer_index(index: int, count: int) -> int:
    """An ``output_hidden_states`` index (negative ones from the end, as a tuple indexes) in 0 .. count."""
    if isinstance(index, bool) or not isinstance(index, int) or not -(count + 1) <= index <= count:
        raise ValueError(f"hidden_layers: {index!r} is not a hidden state of a {count}-layer decoder "
                         f"(0 .. {count}: the embeddings, then each layer's output)")
    return index % (count + 1)


def _cache(kwargs: dict):
    cache = kwargs.get("past_key_values")
    return cache if cache is not None else kwargs.get("cache")
