"""An eager forward in few operations for a w8a8 copy of a pre-norm decoder (Llama's layout).

A draft step of a small model on a CPU runs thousands of tensor operations of a few microseconds
each; run eagerly through ``transformers``' modules, that dispatching, not the int8 products,
is most of the step (docs/self_draft.md, "How the copy drafts"). Compiling removes it, but
compiling takes minutes on a small CPU, which a first call must not spend. This forward computes
the same function as the copy's own in about 60% of the operations (SmolLM2-135M: 4,200 against
7,000 a one-token step, as ``torch.profiler`` counts them):

* query, key and value are one int8 product, and gate and up another (their weights stacked; the
  copy's own layers keep views of the stacked weights, so nothing is stored twice; products per
  output channel are unchanged by stacking);
* the rotary embedding is applied to queries and keys together, once;
* keys and values are written into the static cache's slots directly, and attention reads only the
  slots up to the last one written, the query heads of a key/value head as rows of one product;
* RMSNorm is ``torch.nn.functional.rms_norm``.

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

from .int8 import Int8Linear, stack_linears
from .rotation import rotatable

#: widest forward this path runs (a draft step, a re-feed); wider ones (a prefill) run the model's own
MAX_WIDTH = 16
#: what a Llama-layout attention module may hold besides its projections (and nothing else)
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}
#: the keyword arguments this forward understands (others send the call to the model's own)
KNOWN = {"input_ids", "position_ids", "cache", "past_key_values", "attention_mask", "use_cache", "logits_to_keep",
         "cache_position"}


def lean_problem(model) -> str | None:
    """Why :func:`install` cannot serve ``model`` (a copy whose linear layers are
    :class:`~specdec.forwards.int8.Int8Linear`), or None where it can: rotation's layout, and no
    sliding window, partial rotary embedding or extra part of attention or MLP."""
    problem = rotatable(model, Int8Linear)
    if problem is not None:
        return problem
    decoder = model.get_decoder()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "a sliding attention window"
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return "a partial rotary embedding"
    if not hasattr(decoder, "rotary_emb") or not hasattr(decoder, "embed_tokens"):
        return "no rotary embedding or token embedding on the decoder"
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if {n for n, _ in attn.named_children()} != ATTENTION_PARTS or {n for n, _ in mlp.named_children()} != MLP_PARTS:
            return "attention or an MLP with parts other than Llama's"
        if getattr(attn, "sliding_window", None) or getattr(attn, "scaling", None) is None:
            return "attention with a sliding window, or without a scaling"
    return None


class _Layer:
    """One decoder layer's parts, as this forward uses them."""

    def __init__(self, layer, heads: int, kv_heads: int, head_dim: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = stack_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = stack_linears([mlp.gate_proj, mlp.up_proj])
        self.o, self.down, self.act = attn.o_proj, mlp.down_proj, mlp.act_fn
        self.norm1, self.eps1 = layer.input_layernorm.weight, _eps(layer.input_layernorm)
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, _eps(layer.post_attention_layernorm)
        self.scaling = float(attn.scaling)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.intermediate = mlp.gate_proj.out_features


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class LeanForward:
    """The forward installed on a copy (:func:`install`): see the module doc."""

    def __init__(self, model):
        decoder = model.get_decoder()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.own = types.MethodType(type(model).forward, model)  # the model's own forward
        self.__signature__ = inspect.signature(self.own)  # what callers inspect (the cache's argument name)
        self.embed, self.rotary, self.norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        self.head = model.get_output_embeddings()
        self.layers = [_Layer(layer, heads, kv_heads, head_dim) for layer in decoder.layers]
        self.hidden = config.hidden_size

    def serves(self, kwargs: dict) -> bool:
        cache, ids = _cache(kwargs), kwargs.get("input_ids")
        if ids is None or ids.shape[1] > MAX_WIDTH or kwargs.get("position_ids") is None or not set(kwargs) <= KNOWN:
            return False
        if kwargs.get("attention_mask") is not None and kwargs["attention_mask"].dim() != 2:
            return False
        layers = getattr(cache, "layers", None)
        return (layers is not None and len(layers) == len(self.layers)
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
        batch, width = input_ids.shape
        caches = cache.layers
        start = int(caches[0].cumulative_length)  # the first slot this forward writes
        end = start + width
        hidden = self.embed(input_ids)  # [B, T, H]
        cos, sin = self.rotary(hidden, position_ids)  # [B, T, D]
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, D]
        mask = self._mask(attention_mask, batch, width, start, end)
        for layer, cache in zip(self.layers, caches):
            hidden = hidden + self._attention(layer, cache, hidden, cos, sin, mask, start, end)
            x = torch.nn.functional.rms_norm(hidden, (self.hidden,), layer.norm2, layer.eps2)
            gate_up = layer.gate_up(x)
            hidden = hidden + layer.down(layer.act(gate_up[..., : layer.intermediate]) * gate_up[..., layer.intermediate:])
            cache.cumulative_length.fill_(end)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        return self.head(self.norm(hidden))

    def _mask(self, attention_mask, batch: int, width: int, start: int, end: int) -> torch.Tensor | None:
        """[B, 1, groups * T, end] the slots each query row sees, or None where every row sees every
        slot written so far (one token, no padding: attention needs no mask)."""
        if width == 1 and (attention_mask is None or bool(attention_mask[:, :end].all())):
            return None
        device = self.embed.weight.device
        slots = torch.arange(end, device=device)
        mine = (start + torch.arange(width, device=device))[:, None]  # [T, 1] each token's own slot
        allowed = (slots[None, :] <= mine)[None]  # [1, T, end]: causal
        if attention_mask is not None:  # a token always sees its own slot: no fully masked row (NaN)
            allowed = (allowed & attention_mask[:, None, :end].bool()) | (slots[None, :] == mine)[None]
        groups = self.layers[0].heads // self.layers[0].kv_heads
        return allowed.expand(batch, width, end)[:, None, None].expand(batch, 1, groups, width, end).reshape(
            batch, 1, groups * width, end)

    @staticmethod
    def _attention(layer: _Layer, cache, hidden, cos, sin, mask, start: int, end: int) -> torch.Tensor:
        batch, width, _ = hidden.shape
        heads, kv_heads, dim = layer.heads, layer.kv_heads, layer.head_dim
        x = torch.nn.functional.rms_norm(hidden, (hidden.shape[-1],), layer.norm1, layer.eps1)
        qkv = layer.qkv(x)  # [B, T, (heads + 2 kv_heads) * dim]
        qk = qkv[..., : (heads + kv_heads) * dim].view(batch, width, heads + kv_heads, dim)
        half = dim // 2
        qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin  # rotary, queries and keys at once
        values = qkv[..., (heads + kv_heads) * dim:].view(batch, width, kv_heads, dim)
        cache.keys[:, :, start:end] = qk[:, :, heads:].transpose(1, 2)
        cache.values[:, :, start:end] = values.transpose(1, 2)
        groups = heads // kv_heads
        # the query heads of each key/value head as rows of one product: [B, kv, groups * T, D]
        query = qk[:, :, :heads].view(batch, width, kv_heads, groups, dim).permute(0, 2, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(batch, kv_heads, groups * width, dim), cache.keys[:, :, :end], cache.values[:, :, :end],
            attn_mask=mask, scale=layer.scaling)  # [B, kv, groups * T, D]
        out = out.view(batch, kv_heads, groups, width, dim).permute(0, 3, 1, 2, 4).reshape(batch, width, heads * dim)
        return layer.o(out)


def _cache(kwargs: dict):
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def install(model) -> bool:
    """Give ``model`` (a private w8a8 copy) the lean forward where :func:`lean_problem` allows;
    returns whether it did. The model's class forward (what compiling traces) is unchanged."""
    if lean_problem(model) is not None:
        return False
    model.forward = LeanForward(model)
    return True
