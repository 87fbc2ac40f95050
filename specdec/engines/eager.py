"""The eager engine: the model's own ``forward`` and nothing else.

A causal layout passes the caller's 2-D ``attention_mask [B, N]`` through untouched, so the
logits are the model's own, bit for bit. Hidden states come from the same forward with
``output_hidden_states=True`` (asked for only when some layer is), keeping the layers asked.

A tree layout becomes a 4-D additive mask ``[B, 1, T, N]`` in the model's dtype (0: attend, the
dtype's minimum: not), as ``transformers`` builds for its eager attention and as its SDPA path
adds: query column q sees a key slot when the slot holds a real token of the row and either
precedes the fed block (the committed prefix) or is a fed column that q's layout lets it see (its
chain and its ancestors). ``transformers``' mask builders (``create_causal_mask``,
``create_sliding_window_causal_mask``) return a 4-D mask as they get it, so a mask must carry the
sliding window itself: for a sliding layer, a key at most ``window - 1`` slots behind the query
*in the query's own chain* (a node's slot being its root's plus its depth), as the model's own
mask counts them for that chain. A model whose config lists ``layer_types`` with a sliding layer
gets one mask per type, ``{"full_attention": ..., "sliding_attention": ...}`` (the form its
decoder takes, as ``generate`` prepares it); one without ``layer_types`` but with
``config.sliding_window`` slides on every layer (Mistral's and Phi-3's rule).

Whether a model honours such a mask is not guessed from its class: the first tree forward
checks the attention implementation (``eager`` or ``sdpa``: flash attention takes no arbitrary
mask), that every cache layer holds every slot (a sliding cache layer drops old ones, which the
mask would then misplace), and runs a probe once per engine: a two-token prefix and two sibling
nodes, whose logits must match the model's own forward over each root-to-node chain. A model
that fails any of them gets :class:`LayoutNotSupported` naming its class and the reason, never
logits from a mask it ignored.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

import torch

from ..modelinfo import cache_argument
from .base import CAUSAL, EngineOutput, Layout, LayoutNotSupported, model_kwargs, tree_visibility
from .forwards.attention import GROUPED_SDPA

#: attention implementations that apply an arbitrary 4-D additive mask
MASKED_ATTENTION = ("eager", "sdpa")
#: layer types whose mask this engine builds
KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")


class EagerEngine:
    """The model's own forward (see the module docstring). One instance per model."""

    name = "eager"

    def __init__(self, model, hooks: bool = True):
        self.model = model
        self.hooks = hooks  # False: ``model.forward``, no module hooks (forwards a timer must not count)
        self._cache_kwarg = cache_argument(model)  # ``cache`` where declared (past_key_values is deprecated there)
        self._tree_refusal: str | None = None
        self._probed = False

    # -- the protocol -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *, layout: Layout = CAUSAL,
                cache: Any = None, attention_mask: torch.Tensor | None = None,
                hidden_layers: Sequence[int] = (), logits_to_keep: int | None = None,
                model_inputs: Mapping[str, Any] | None = None) -> EngineOutput:
        return self._forward(input_ids, positions, layout, cache, attention_mask, hidden_layers, logits_to_keep,
                             model_inputs)

    def _forward(self, input_ids, positions, layout: Layout, cache, attention_mask, hidden_layers=(),
                 logits_to_keep=None, model_inputs=None, probing: bool = False) -> EngineOutput:
        """:meth:`forward`; ``probing``: the probe's own forward, which skips the check it establishes."""
        batch, width = input_ids.shape
        layers = _checked_layers(hidden_layers, self.model)
        if layout.is_tree:
            layout.check(width, batch)
            if not probing:
                self.check_tree_support(cache)
            attention_mask = self._tree_mask(layout, cache, attention_mask, batch, width, input_ids.device)
        kwargs = model_kwargs(input_ids, positions, self._cache_kwarg, cache, attention_mask, logits_to_keep,
                              model_inputs)
        if layers:
            kwargs["output_hidden_states"] = True
        out = (self.model if self.hooks else self.model.forward)(**kwargs)
        hidden = {layer: out.hidden_states[layer] for layer in layers}
        return EngineOutput(logits=out.logits, hidden=hidden)

    # -- trees ------------------------------------------------------------------------------------
    def tree_refusal(self) -> str | None:
        """Why this model cannot run a tree layout here (None: it can); probed once per engine."""
        if not self._probed:
            self._tree_refusal = self._static_refusal() or self._probe()
            self._probed = True
        return self._tree_refusal

    def check_tree_support(self, cache=None) -> None:
        """Raise :class:`LayoutNotSupported` unless this model, with ``cache``, runs a tree layout."""
        reason = self.tree_refusal()
        if reason is None and cache is not None:
            reason = _cache_refusal(cache)
        if reason is not None:
            raise LayoutNotSupported(f"the eager engine cannot run a tree layout on {type(self.model).__name__}: "
                                     f"{reason}")

    def _static_refusal(self) -> str | None:
        implementation = getattr(self.model.config, "_attn_implementation", None)
        # another thread's multi-token forward may be running sdpa as grouped_sdpa (forwards/attention.py)
        implementation = "sdpa" if implementation == GROUPED_SDPA else implementation
        if implementation not in MASKED_ATTENTION:
            return (f"its attention implementation {implementation!r} takes no custom 4-D mask "
                    f"(one of {', '.join(MASKED_ATTENTION)} does)")
        if "attention_mask" not in inspect.signature(self.model.forward).parameters:
            return "its forward takes no attention_mask"
        types = _layer_types(self.model)
        unknown = sorted(set(types or ()) - set(KNOWN_LAYER_TYPES))
        if unknown:
            return f"it has {', '.join(unknown)} layers, whose masks this engine does not build"
        if "sliding_attention" in (types or ()) and _window(self.model) is None:
            return "it has sliding layers and no config.sliding_window"
        return None

    def _probe(self) -> str | None:
        """Two sibling nodes after a two-token prefix must give the logits of each one's chain."""
        from transformers import DynamicCache

        model = self.model
        device = next(model.parameters()).device
        vocab = model.get_input_embeddings().weight.shape[0]
        ids = (torch.arange(4, device=device) * 7 + 3) % vocab  # [4]: prefix a b, siblings c d
        try:
            with torch.no_grad():
                cache = DynamicCache()
                self._forward(ids[None, :2], torch.arange(2, device=device)[None, :], CAUSAL, cache, None)
                tree = Layout(parents=torch.tensor([[-1, -1]], device=device))
                got = self._forward(ids[None, 2:], torch.tensor([[2, 2]], device=device), tree, cache, None,
                                    probing=True).logits[0]  # [2, V]
                chains = torch.stack([ids[[0, 1, 2]], ids[[0, 1, 3]]])  # [2, 3]
                want = model(input_ids=chains, position_ids=torch.arange(3, device=device)[None, :].repeat(2, 1),
                             use_cache=False).logits[:, -1]  # [2, V]
        except Exception as error:  # the model's forward rejected the mask: say how
            return f"a probe forward with the mask failed ({type(error).__name__}: {error})"
        tolerance = 1e-3 if got.dtype == torch.float32 else 5e-2
        scale = float(want.float().abs().max().clamp(min=1.0))
        error = float((got.float() - want.float()).abs().max()) / scale
        if error > tolerance:
            return f"it ignores or misreads a custom 4-D mask (a probe's tree logits are off by {error:.3g} relative)"
        return None

    def _tree_mask(self, layout: Layout, cache, attention_mask, batch: int, width: int, device):
        """The 4-D additive mask(s) of a tree forward (see the module docstring)."""
        cached = int(cache.get_seq_length()) if cache is not None else 0  # S: slots before the fed block
        allowed = tree_visibility(layout, cached, attention_mask, batch, width, device)  # [B, T, N]
        keys = allowed.shape[-1]
        dtype, types, window = self.model.dtype, _layer_types(self.model), _window(self.model)
        slides_all = types is None and window is not None  # Mistral's and Phi-3's rule: one mask, every layer
        slides_some = types is not None and "sliding_attention" in types
        if not (slides_all or slides_some):
            return _additive(allowed, dtype)  # [B, 1, T, N]: the one tensor every decoder takes
        sliding = _additive(allowed & _in_window(layout, cached, keys, batch, width, window, device), dtype)
        return sliding if slides_all else {"full_attention": _additive(allowed, dtype), "sliding_attention": sliding}


# -- pure helpers ---------------------------------------------------------------------------------
def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T, N]`` bool -> ``[B, 1, T, N]`` additive mask: 0 where allowed, the dtype's minimum
    elsewhere (finite, so a query that sees nothing softmaxes to a uniform row, not NaN)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def _in_window(layout: Layout, cached: int, keys: int, batch: int, width: int, window: int, device) -> torch.Tensor:
    """``[B, T, N]`` bool: the key lies within ``window`` slots of the query along the query's own
    chain (transformers' rule ``kv_idx > q_idx - window``, with a fed column at its chain slot)."""
    query = cached + layout.chain_columns(width, batch, device)  # [B, T] chain slot of each fed column
    key = torch.arange(keys, device=device)[None, :].repeat(batch, 1)  # [B, N]
    key[:, cached: cached + width] = query  # a fed key at its own chain slot (only ancestors are seen)
    return key[:, None, :] > query[:, :, None] - window


def _layer_types(model) -> tuple[str, ...] | None:
    types = getattr(model.config.get_text_config(), "layer_types", None)
    return tuple(types) if types is not None else None


def _window(model) -> int | None:
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    return int(window) if window else None


def _cache_refusal(cache) -> str | None:
    """Why a cache cannot back a tree forward: a layer that keeps only its last slots."""
    for i, layer in enumerate(getattr(cache, "layers", ())):
        if getattr(layer, "is_sliding", False):
            return (f"cache layer {i} ({type(layer).__name__}) keeps only its last slots; a tree mask needs every "
                    f"slot held (a DynamicCache made without a config holds them)")
    return None


def _checked_layers(hidden_layers: Sequence[int], model) -> tuple[int, ...]:
    """The asked layers, each an index into ``output_hidden_states`` (0 .. num_hidden_layers)."""
    if not hidden_layers:  # most forwards: no config to read
        return ()
    count = model.config.get_text_config().num_hidden_layers + 1
    for layer in hidden_layers:
        if not isinstance(layer, int) or not -count <= layer < count:
            raise ValueError(f"hidden_layers: {layer!r} is not a hidden state of {type(model).__name__} "
                             f"(0 .. {count - 1}: the embeddings, then each of its {count - 1} layers)")
    return tuple(dict.fromkeys(hidden_layers))
