"""An eager forward in few operations for a w8a8 or int4 copy of a pre-norm decoder (Llama's layout).

A draft step of a small model on a CPU runs thousands of tensor operations of a few microseconds
each; run eagerly through ``transformers``' modules, that dispatching, not the int8 products,
is most of the step (docs/self_draft.md, "How the copy drafts"). Compiling removes it, but
compiling takes minutes on a small CPU, which a first call must not spend. This forward computes
the same function as the copy's own in fewer operations, and runs them without Python in between
(the copy's step at 0.40 of the fp32 target's, against 0.72 through ``transformers``' modules,
on the Xeon of docs/self_draft.md):

* query, key and value are one int8 (or int4) product, and gate and up another (their weights
  stacked; the copy's own layers keep views of the stacked weights, so no weight is stored twice;
  products per output channel are unchanged by stacking);
* the rotary embedding is applied to queries and keys together, once;
* keys and values are written into the static cache's slots directly, and attention reads only the
  slots up to the last one written, the query heads of a key/value head as rows of one product;
* RMSNorm is the model's own formula (:func:`rms_norm`), which takes one row in less time than
  ``torch.nn.functional.rms_norm``'s fused kernel;
* indices are ``narrow`` s (TorchScript runs each ``:`` of an index as an operation of its own),
  and the stack runs in inference mode (no autograd bookkeeping on any of its operations);
* the decoder layers are one function of tensors (:func:`decoder_layers`), scripted by TorchScript
  where this torch can (a fraction of a second, once a process): the whole stack then runs without
  returning to Python between operations, the same operations in the same order (TorchScript fuses
  nothing on a CPU without LLVM), so the scripted and the Python function give the same numbers.

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
import threading
import types
import warnings
from typing import List, Optional

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import int4, int8
from .int4 import Int4Linear, int4_linear
from .int8 import Int8Linear, int8_linear, rotate_input
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
    """Why :func:`install` cannot serve ``model`` (a copy whose linear layers are all
    :class:`~specdec.forwards.int8.Int8Linear`, or all :class:`~specdec.forwards.int4.Int4Linear`
    but an output layer that may be a :class:`~specdec.forwards.int4.Bfloat16Head`),
    or None where it can: rotation's layout, and no sliding window, partial rotary embedding or
    extra part of attention or MLP (and, for int4, output widths that stack: multiples of 64)."""
    problems = [rotatable(model, Int8Linear), rotatable(model, Int4Linear, head=(Int4Linear, int4.Bfloat16Head))]
    if all(problems):
        return problems[0]
    if problems[0] is not None and any(module.out_features % int4.STACK_ROWS for module in model.modules()
                                       if isinstance(module, Int4Linear)):
        return f"int4 layers whose output widths are not multiples of {int4.STACK_ROWS} (they would not stack)"
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
        if not isinstance(mlp.act_fn, torch.nn.SiLU) and type(mlp.act_fn).__name__ != "SiLUActivation":
            return f"an MLP activation other than SiLU ({type(mlp.act_fn).__name__})"
        if mlp.gate_proj.out_features != mlp.up_proj.out_features:
            return "gate and up projections of different widths"
        if any(getattr(lin, "rotation_a", None) is not None for lin in (*attn.children(), mlp.gate_proj, mlp.up_proj)):
            return "an input rotated other than the MLP output layer's"
    return None


class _Layer:
    """One decoder layer's tensors as :func:`decoder_layers` takes them: ``parts`` = the two norms'
    scales, then three tensors for each of query-key-value, the attention output, gate-up and
    down (:func:`product`'s: int8 weights, scales and offsets; or int4 weights, scales-and-zeros
    and an empty tensor), then the two factors down's input is rotated by (``Int8Linear``'s
    ``rotate``; two empty tensors where it is not); ``biases`` = those four layers' biases (or None); ``eps`` = the norms'."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        kind = int8 if isinstance(attn.q_proj, Int8Linear) else int4
        stack = int8.stack_linears if kind is int8 else int4.stack_int4
        qkv = stack([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = stack([mlp.gate_proj, mlp.up_proj])
        linears = (qkv, attn.o_proj, gate_up, mlp.down_proj)
        padding = [torch.empty(0)] * (3 - len(kind.WEIGHT_BUFFERS))  # three tensors a layer, whatever the kind
        rotation = mlp.down_proj.rotation() if kind is int8 else None
        self.parts = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight] + [
            tensor for lin in linears for tensor in [getattr(lin, name) for name in kind.WEIGHT_BUFFERS] + padding] + (
            rotation if rotation is not None else [torch.empty(0), torch.empty(0)])
        self.biases = [lin.bias for lin in linears]
        self.eps = [_eps(layer.input_layernorm), _eps(layer.post_attention_layernorm)]


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def product(x2: torch.Tensor, weight: torch.Tensor, second: torch.Tensor, third: torch.Tensor,
            bias: Optional[torch.Tensor], dtype: torch.dtype, rowwise: int) -> torch.Tensor:
    """A copy's linear layer on the rows ``x2 [M, K]``: int8 weights (``weight`` int8, its scales
    and offsets; up to ``rowwise`` rows one at a time, ``int8.ROWWISE_ROWS``) or int4 ones
    (``weight`` packed, ``second`` its scales and zeros)."""
    if weight.dtype == torch.int8:
        return int8_linear(x2, weight, second, third, bias, dtype, rowwise)
    return int4_linear(x2, weight, second, bias, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama layout's RMSNorm, operation for operation (in float32, then cast back): the
    direct forward needs the model's own numbers, and a copy's one-row steps ran faster with it
    than with ``F.rms_norm``'s fused kernel (docs/self_draft.md, "What limits it here")."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def decoder_layers(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor],
                   keys: List[torch.Tensor], values: List[torch.Tensor], start: int, end: int,
                   parts: List[List[torch.Tensor]], biases: List[List[Optional[torch.Tensor]]], eps: List[float],
                   heads: int, kv_heads: int, dim: int, scaling: float, rowwise: int) -> torch.Tensor:
    """``hidden [B, T, H]`` through every decoder layer (``parts[i]``, ``biases[i]``: layer i's
    tensors, :class:`_Layer`), writing each layer's keys and values for slots ``start:end`` into
    ``keys[i]`` / ``values[i]`` [B, kv_heads, slots, dim] and attending over slots ``:end`` (``mask``
    [B, 1, groups * T, end] or None: every slot). ``cos``/``sin`` [B, T, 1, dim]; ``rowwise``: see
    :func:`product`. A plain function
    of tensors, lists and numbers, so that it can be scripted: one call runs the whole stack without
    returning to Python between operations."""
    batch, width, size = hidden.shape[0], hidden.shape[1], hidden.shape[2]
    dtype = hidden.dtype
    groups, half, qk_cols, qk_heads = heads // kv_heads, dim // 2, (heads + kv_heads) * dim, heads + kv_heads
    # rotary: x cos + rotate_half(x) sin, with rotate_half(x) = (-x2, x1) written as the halves
    # swapped, (x2, x1), times the sine with its first half negated (once, for every layer)
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    for i in range(len(parts)):
        p, b = parts[i], biases[i]
        x = rms_norm(hidden, p[0], eps[2 * i]).view(-1, size)
        qkv = product(x, p[2], p[3], p[4], b[0], dtype, rowwise).view(batch, width, -1)  # [B, T, (heads + 2 kv) dim]
        qk = qkv.narrow(2, 0, qk_cols).view(batch, width, qk_heads, dim)
        swapped = qk.view(batch, width, qk_heads, 2, half).flip(3).view(batch, width, qk_heads, dim)
        qk = torch.addcmul(qk * cos, swapped, signed_sin)  # rotary, queries and keys at once
        # narrow, not slices: TorchScript runs each ':' of an index as an operation of its own
        keys[i].narrow(2, start, width).copy_(qk.narrow(2, heads, kv_heads).transpose(1, 2))
        values[i].narrow(2, start, width).copy_(
            qkv.narrow(2, qk_cols, kv_heads * dim).view(batch, width, kv_heads, dim).transpose(1, 2))
        # the query heads of each key/value head as rows of one product: [B, kv, groups * T, D]
        if width == 1:  # already in that order: views, no copies
            query = qk.narrow(2, 0, heads).view(batch, kv_heads, groups, dim)
        else:
            query = qk.narrow(2, 0, heads).view(batch, width, kv_heads, groups, dim).permute(0, 2, 3, 1, 4).reshape(
                batch, kv_heads, groups * width, dim)
        out = torch.nn.functional.scaled_dot_product_attention(query, keys[i].narrow(2, 0, end), values[i].narrow(2, 0, end),
                                                               attn_mask=mask, scale=scaling)
        if width == 1:
            out = out.reshape(batch, heads * dim)
        else:
            out = out.view(batch, kv_heads, groups, width, dim).permute(0, 3, 1, 2, 4).reshape(batch * width, heads * dim)
        hidden = hidden + product(out, p[5], p[6], p[7], b[1], dtype, rowwise).view(batch, width, size)
        x = rms_norm(hidden, p[1], eps[2 * i + 1]).view(-1, size)
        gate_up = product(x, p[8], p[9], p[10], b[2], dtype, rowwise)  # [B T, 2 I]
        inner = gate_up.shape[1] // 2
        gated = torch.nn.functional.silu(gate_up.narrow(1, 0, inner)) * gate_up.narrow(1, inner, inner)
        if p[14].numel() > 0:
            gated = rotate_input(gated, p[14], p[15])
        hidden = hidden + product(gated, p[11], p[12], p[13], b[3], dtype, rowwise).view(batch, width, size)
    return hidden


_SCRIPTED: dict = {}
_SCRIPT_LOCK = threading.Lock()


def scripted_layers():
    """:func:`decoder_layers` compiled by TorchScript (once a process), or None where this torch
    cannot script it. TorchScript is deprecated in favour of ``torch.compile``, which takes
    seconds to minutes where scripting takes a fraction of a second; here it only removes Python
    from between the operations (no fusion), and the function is the same either way. It runs
    without TorchScript's optimizing executor (``optimized_execution(False)``): that one profiles
    and re-optimizes for every new shape (the cache's length, the width), 50-150 ms a time, a cost
    a draft step would pay and the policy would take for a draft's; and a graph it optimized for
    other shapes ran slower than the plain one (SmolLM2-135M's w8a8 copy: 17-18 ms a step against
    15 ms)."""
    return script_once(decoder_layers)


def script_once(function):
    """``function`` scripted by TorchScript, once a process, or None where this torch cannot
    script it (the caller then runs it as Python)."""
    with _SCRIPT_LOCK:
        if function not in _SCRIPTED:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _SCRIPTED[function] = torch.jit.script(function)
            except Exception:  # a torch without TorchScript, or one that cannot script it
                _SCRIPTED[function] = None
        return _SCRIPTED[function]


def attention_shape(model) -> tuple[int, int, int, float]:
    """(query heads, key/value heads, head size, attention scaling) of ``model``'s decoder layers."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim, float(model.get_decoder().layers[0].self_attn.scaling)


class LeanForward:
    """The forward installed on a copy (:func:`install`): see the module doc."""

    def __init__(self, model, script: bool = True):
        decoder = model.get_decoder()
        self.heads, self.kv_heads, self.head_dim, self.scaling = attention_shape(model)
        self.own = types.MethodType(type(model).forward, model)  # the model's own forward
        self.__signature__ = inspect.signature(self.own)  # what callers inspect (the cache's argument name)
        self.embed, self.rotary, self.norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        self.head = model.get_output_embeddings()
        layers = [_Layer(layer) for layer in decoder.layers]
        self.parts = [layer.parts for layer in layers]
        self.biases = [layer.biases for layer in layers]
        self.eps = [e for layer in layers for e in layer.eps]
        self.layers = (script and scripted_layers()) or decoder_layers
        self.scripted = self.layers is not decoder_layers

    def serves(self, kwargs: dict) -> bool:
        cache, ids = _cache(kwargs), kwargs.get("input_ids")
        if ids is None or ids.shape[1] > MAX_WIDTH or kwargs.get("position_ids") is None or not set(kwargs) <= KNOWN:
            return False
        if kwargs.get("attention_mask") is not None and kwargs["attention_mask"].dim() != 2:
            return False
        layers = getattr(cache, "layers", None)
        return (layers is not None and len(layers) == len(self.parts)
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
        # inference mode: each of the stack's small operations skips autograd's bookkeeping (version
        # counters, view tracking; docs/performance.md); the caches it writes into stay ordinary
        # tensors, and only the hidden states it returns are inference tensors
        with torch.jit.optimized_execution(False), torch.inference_mode():  # see scripted_layers
            hidden = self.layers(hidden, cos[:, :, None], sin[:, :, None],
                                 self._mask(attention_mask, batch, width, start, end), [c.keys for c in caches],
                                 [c.values for c in caches], start, end, self.parts, self.biases, self.eps, self.heads,
                                 self.kv_heads, self.head_dim, self.scaling, int8.ROWWISE_ROWS)
        for c in caches:
            c.cumulative_length.fill_(end)
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
        groups = self.heads // self.kv_heads
        return allowed.expand(batch, width, end)[:, None, None].expand(batch, 1, groups, width, end).reshape(
            batch, 1, groups * width, end)


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
