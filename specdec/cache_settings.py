"""How a call keeps its models' caches, and which models a cache serves.

:class:`CacheSettings` says which backend every model of a call gets (``specdec.kv``), compiled
or not, at which widths and lengths, on which engine. :func:`cache_problem` says why a model's
cache cannot be rolled back to the accepted prefix (then it cannot be decoded speculatively at
all), :func:`static_problem` why the static backend cannot serve it. Neither runs a forward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .compiled import check_compile_options
from .engines import resolve_engine_name

#: forward widths the compiled path pads to by default (each compiles once per batch size and
#: cache length); covers a verification of the drafts the policy usually picks
WIDTHS = (1, 2, 4, 8, 16)
IMPLEMENTATIONS = ("dynamic", "static")


@dataclass(frozen=True)
class CacheSettings:
    """How every model of a call keeps its cache: ``implementation`` "dynamic" or "static";
    ``compile`` False, True, or a dict of ``torch.compile`` options (static only). A static
    cache takes the shortest of ``lengths`` its call fits in (the lengths ``SpecDecoder.warmup``
    compiled: a call that fits one runs the graphs compiled for it), else a rung of the length
    ladder (see ``specdec.static_kv``). Attention reads every slot of a static cache, so a short call
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


#: models whose forward after a cache cannot take a block of new tokens, and why (each found by
#: running every causal-LM type transformers has: the block fails inside the model)
UNSTEPPABLE = {
    "CpmAntForCausalLM": "it steps one token at a time, its cache keeping the prompt's length in slots of its own",
    "ProphetNetForCausalLM": "it asserts that a cached forward feeds one token",
    "XLMWithLMHeadModel": "it takes the whole sequence at every step and cuts off what its cache holds",
    "xLSTMForCausalLM": "its cache is an xLSTMCache of recurrent states, which cannot be rolled back",
}


def cache_problem(model, batch_size: int) -> str | None:
    """Why this model cannot be decoded speculatively, or None. Runs no forward (``probes.py`` runs the
    checks that need one)."""
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder model; specdec decodes causal (decoder-only) language models"
    params = inspect.signature(model.forward).parameters
    if "past_key_values" not in params and "cache" not in params:
        return (f"{name}.forward takes no key/value cache (neither `past_key_values` nor `cache`): its state "
                "(if any) lives elsewhere, e.g. RWKV's `state` or XLNet's `mems`, and cannot be rolled back to "
                "the accepted prefix, so speculative decoding would be wrong")
    if name in UNSTEPPABLE:
        return f"{name}'s forward after a cache cannot verify a block of drafts: {UNSTEPPABLE[name]}"
    devices = {p.device.type for p in model.parameters()}
    # accelerate's offloading (a device_map with "cpu" or "disk" entries) keeps those weights on the
    # meta device between forwards: its hooks load them for each forward
    offloaded = any(getattr(getattr(m, "_hf_hook", None), "offload", False) for m in model.modules())
    if "meta" in devices and not offloaded:
        return f"{name} has weights on the meta device (never loaded); load its weights before decoding"
    try:
        layers = DynamicCache(config=model.config).layers  # the layer kinds the model asks for
    except Exception as exc:  # pragma: no cover - exotic configs
        return f"cannot build a cache for {type(model).__name__}: {exc}"
    recurrent = sorted({type(layer).__name__ for layer in layers
                        if not isinstance(layer, DynamicLayer) or getattr(layer, "is_linear", False)})
    config = model.config.get_text_config(decoder=True)
    if recurrent or any(t not in ("full_attention", "sliding_attention", "chunked_attention")
                        for t in (getattr(config, "layer_types", None) or [])):
        return (f"{type(model).__name__} has cache layers that cannot be rolled back to the accepted prefix "
                f"({recurrent or getattr(config, 'layer_types', [])}: recurrent, linear-attention, indexed or "
                "shared layers); speculative decoding must discard rejected drafts")
    return None
