"""The Llama layout's decoder stack as one function of tensors, for the target and for its copies.

A one-token step of a small model on a CPU spends a fifth or more of its time outside the
products (``transformers``' module calls, mask and cache bookkeeping, Python between thousands
of small tensor operations), and a low-bit copy's draft step most of it. :class:`LlamaStack` runs
a model's decoder layers as :func:`decoder_layers`, one function scripted by TorchScript once a
process, so that the whole stack runs without returning to Python between operations
(TorchScript fuses nothing on a CPU without LLVM: the scripted and the Python function give the
same numbers; docs/performance.md says what scripting still buys). What differs between models
is how their linear layers multiply, the stack's *linears* (:data:`KINDS`):

* ``"float"`` (the target, ``direct.py``): the model's own ``nn.Linear`` weights, read at every
  forward, in the model's own operations and order (RMSNorm in float32 then cast, query, key and
  value as three products, the rotary embedding as ``x cos + rotate_half(x) sin``, attention
  through ``scaled_dot_product_attention`` with grouped heads, the gated MLP), so that one token
  without padding gives the model's own logits bit for bit; each product through the weights
  packed for MKL where ``packed.py`` packs them for the forward (``"packed"``);
* ``"int8"`` and ``"int4"`` (a private copy's, ``lean.py``): the copy's own quantized layers,
  query-key-value and gate-up stacked into one product each (one activation quantization where
  there were three), the rotary embedding applied to queries and keys at once, and attention with
  the query heads of a key/value head as the rows of one product: the same function up to
  rounding, in fewer operations.

Both write each layer's keys and values for slots ``start:start+T`` into the buffers the caller
gives (a ``GrowingLayer``'s or a ``StaticLayer``'s) and attend over the slots up to there
(:meth:`LlamaStack.mask`: causal, only a row's real tokens, or a tree's ancestors where the
caller gives a 4-D mask). Indices are ``narrow`` s (TorchScript runs each ``:`` of an index as an
operation of its own), and the stack runs in inference mode.

:func:`layout_problem` says why a model is not this layout (one check for both); the model is
only read (a copy's stacked weights are views its own layers share).
"""

from __future__ import annotations

import threading
import warnings
from typing import List, Optional, Tuple

import torch

from . import int4, int8
from .int4 import int4_linear
from .int8 import int8_linear, rotate_input
from .packed import available as packed_available

#: how a stack's linear layers multiply (see the module doc); the index is ``decoder_layers``' ``kind``
KINDS = ("float", "packed", "int8", "int4")
FLOAT, PACKED, INT8, INT4 = range(len(KINDS))
assert INT8 == 2 and INT4 == 3  # decoder_layers spells them as numbers
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}
LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


if packed_available():
    def _float_product(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``F.linear``, or through the weight packed for MKL where ``packed`` is not empty (``packed.py``)."""
        if packed.numel() > 0:
            return torch.ops.mkl._mkl_linear(x.contiguous(), packed, weight, bias, x.numel() // x.shape[-1])
        return torch.nn.functional.linear(x, weight, bias)
else:
    def _float_product(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias)


def _low_bit_product(x2: torch.Tensor, weight: torch.Tensor, second: torch.Tensor, third: torch.Tensor,
                     bias: Optional[torch.Tensor], dtype: torch.dtype, rowwise: int) -> torch.Tensor:
    """A copy's linear layer on the rows ``x2 [M, K]``: int8 weights (``weight`` int8, its scales
    and offsets; up to ``rowwise`` rows one at a time, ``int8.ROWWISE_ROWS``) or int4 ones
    (``weight`` packed, ``second`` its scales and zeros)."""
    if weight.dtype == torch.int8:
        return int8_linear(x2, weight, second, third, bias, dtype, rowwise)
    return int4_linear(x2, weight, second, bias, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama layout's RMSNorm, operation for operation (in float32, then cast back): the
    target's stack needs the model's own numbers, and a copy's one-row steps ran faster with it
    than with ``F.rms_norm``'s fused kernel (docs/self_draft.md, "What limits it here")."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _float_layer(hidden: torch.Tensor, p: List[torch.Tensor], w: List[torch.Tensor], b: List[Optional[torch.Tensor]],
                 eps: float, eps_mlp: float, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor],
                 keys: torch.Tensor, values: torch.Tensor, start: int, heads: int, kv_heads: int, dim: int,
                 scaling: float) -> torch.Tensor:
    """One decoder layer in the model's own operations (``p``: the norms' scales, then the weights
    of q, k, v, o, gate, up, down; ``w``: those packed for MKL or empty; ``cos``/``sin`` [B, 1, T, D];
    ``mask`` [B, 1, T, end] boolean or None)."""
    batch, width = hidden.shape[0], hidden.shape[1]
    end = start + width
    x = rms_norm(hidden, p[0], eps)
    query = _float_product(x, p[2], w[0], b[0]).view(batch, width, heads, dim).transpose(1, 2)
    key = _float_product(x, p[3], w[1], b[1]).view(batch, width, kv_heads, dim).transpose(1, 2)
    value = _float_product(x, p[4], w[2], b[2]).view(batch, width, kv_heads, dim).transpose(1, 2)
    query = _rotate(query, cos, sin)
    keys.narrow(2, start, width).copy_(_rotate(key, cos, sin))
    values.narrow(2, start, width).copy_(value)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys.narrow(2, 0, end), values.narrow(2, 0, end), attn_mask=mask, scale=scaling, enable_gqa=True)
    out = out.transpose(1, 2).contiguous().reshape(batch, width, heads * dim)
    hidden = hidden + _float_product(out, p[5], w[3], b[3])
    x = rms_norm(hidden, p[1], eps_mlp)
    gated = torch.nn.functional.silu(_float_product(x, p[6], w[4], b[4])) * _float_product(x, p[7], w[5], b[5])
    return hidden + _float_product(gated, p[8], w[6], b[6])


def _low_bit_layer(hidden: torch.Tensor, p: List[torch.Tensor], b: List[Optional[torch.Tensor]], eps: float,
                   eps_mlp: float, cos: torch.Tensor, signed_sin: torch.Tensor, mask: Optional[torch.Tensor],
                   keys: torch.Tensor, values: torch.Tensor, start: int, heads: int, kv_heads: int, dim: int,
                   scaling: float, rowwise: int) -> torch.Tensor:
    """One decoder layer of a low-bit copy, stacked (``p``: the norms' scales, then three tensors for
    each of query-key-value, the attention output, gate-up and down, then the two factors down's
    input is rotated by or two empty tensors; ``cos``/``signed_sin`` [B, T, 1, D]; ``mask``
    [B, 1, groups * T, end] or None)."""
    batch, width, size = hidden.shape[0], hidden.shape[1], hidden.shape[2]
    end = start + width
    dtype = hidden.dtype
    groups, half, qk_cols, qk_heads = heads // kv_heads, dim // 2, (heads + kv_heads) * dim, heads + kv_heads
    x = rms_norm(hidden, p[0], eps).view(-1, size)
    qkv = _low_bit_product(x, p[2], p[3], p[4], b[0], dtype, rowwise).view(batch, width, -1)
    qk = qkv.narrow(2, 0, qk_cols).view(batch, width, qk_heads, dim)
    swapped = qk.view(batch, width, qk_heads, 2, half).flip(3).view(batch, width, qk_heads, dim)
    qk = torch.addcmul(qk * cos, swapped, signed_sin)  # rotary, queries and keys at once
    keys.narrow(2, start, width).copy_(qk.narrow(2, heads, kv_heads).transpose(1, 2))
    values.narrow(2, start, width).copy_(
        qkv.narrow(2, qk_cols, kv_heads * dim).view(batch, width, kv_heads, dim).transpose(1, 2))
    # the query heads of each key/value head as rows of one product: [B, kv, groups * T, D]
    if width == 1:  # already in that order: views, no copies
        query = qk.narrow(2, 0, heads).view(batch, kv_heads, groups, dim)
    else:
        query = qk.narrow(2, 0, heads).view(batch, width, kv_heads, groups, dim).permute(0, 2, 3, 1, 4).reshape(
            batch, kv_heads, groups * width, dim)
    out = torch.nn.functional.scaled_dot_product_attention(query, keys.narrow(2, 0, end), values.narrow(2, 0, end),
                                                           attn_mask=mask, scale=scaling)
    if width == 1:
        out = out.reshape(batch, heads * dim)
    else:
        out = out.view(batch, kv_heads, groups, width, dim).permute(0, 3, 1, 2, 4).reshape(batch * width, heads * dim)
    hidden = hidden + _low_bit_product(out, p[5], p[6], p[7], b[1], dtype, rowwise).view(batch, width, size)
    x = rms_norm(hidden, p[1], eps_mlp).view(-1, size)
    gate_up = _low_bit_product(x, p[8], p[9], p[10], b[2], dtype, rowwise)  # [B T, 2 I]
    inner = gate_up.shape[1] // 2
    gated = torch.nn.functional.silu(gate_up.narrow(1, 0, inner)) * gate_up.narrow(1, inner, inner)
    if p[14].numel() > 0:
        gated = rotate_input(gated.float(), p[14], p[15])  # in the factors' float32, as Int8Linear rotates
    return hidden + _low_bit_product(gated, p[11], p[12], p[13], b[3], dtype, rowwise).view(batch, width, size)


def decoder_layers(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor],
                   keys: List[torch.Tensor], values: List[torch.Tensor], start: int, kind: int,
                   parts: List[List[torch.Tensor]], packed: List[List[torch.Tensor]],
                   biases: List[List[Optional[torch.Tensor]]], eps: List[float], heads: int, kv_heads: int,
                   dim: int, scaling: float, rowwise: int, capture: List[int]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """``hidden [B, T, H]`` through every decoder layer (``kind``: :data:`KINDS`' index; layer i's
    tensors ``parts[i]``, ``packed[i]`` and ``biases[i]`` as :class:`LlamaStack` lays them out),
    writing layer i's keys and values for slots ``start:start+T`` into ``keys[i]`` / ``values[i]``
    [B, kv_heads, slots, dim] and attending over the slots up to there (``mask``, or None: all of
    them). ``cos``/``sin`` [B, T, D].

    -> (the last layer's output [B, T, H], before the final norm; the residual stream before each
    layer i in ``capture`` [B, T, H], ascending: i = 0 the input ``hidden`` itself, i = len(parts)
    the last layer's output, i.e. ``output_hidden_states`` index i without the final norm)."""
    captured: List[torch.Tensor] = []
    low_bit = kind >= 2  # INT8 or INT4 (a literal: TorchScript reads no global number)
    if low_bit:  # x cos + rotate_half(x) sin with the halves swapped, times a sine whose first half is negated
        half = dim // 2
        cos = cos[:, :, None]
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, :, None]
    else:
        cos, sin = cos[:, None], sin[:, None]
    for i in range(len(parts)):
        if i in capture:
            captured.append(hidden)
        if low_bit:
            hidden = _low_bit_layer(hidden, parts[i], biases[i], eps[2 * i], eps[2 * i + 1], cos, sin, mask, keys[i],
                                    values[i], start, heads, kv_heads, dim, scaling, rowwise)
        else:
            hidden = _float_layer(hidden, parts[i], packed[i], biases[i], eps[2 * i], eps[2 * i + 1], cos, sin, mask,
                                  keys[i], values[i], start, heads, kv_heads, dim, scaling)
    if len(parts) in capture:
        captured.append(hidden)
    return hidden, captured


_SCRIPTED: dict = {}
_SCRIPT_LOCK = threading.Lock()


def scripted_layers():
    """:func:`decoder_layers` scripted by TorchScript (once a process), or None where this torch
    cannot script it (the stack then runs it as Python). TorchScript is deprecated in favour of
    ``torch.compile``, which takes seconds to minutes where scripting takes a fraction of a second;
    here it only removes Python from between the operations. It runs without TorchScript's
    optimizing executor (``optimized_execution(False)``): that one profiles and re-optimizes for
    every new shape (the cache's length, the width), 50-150 ms a time, a cost a step would pay."""
    with _SCRIPT_LOCK:
        if decoder_layers not in _SCRIPTED:
            inline = torch._C._jit_get_inline_everything_mode()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    # every function it calls inlined: the unoptimized executor otherwise runs each
                    # call (a layer, a product, a norm) as a frame of its own, a few microseconds each
                    torch._C._jit_set_inline_everything_mode(True)
                    _SCRIPTED[decoder_layers] = torch.jit.script(decoder_layers)
            except Exception:  # a torch without TorchScript, or one that cannot script it
                _SCRIPTED[decoder_layers] = None
            finally:
                torch._C._jit_set_inline_everything_mode(inline)
        return _SCRIPTED[decoder_layers]


def text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_shape(model) -> tuple[int, int, int, float]:
    """(query heads, key/value heads, head size, attention scaling) of ``model``'s decoder layers."""
    config = text_config(model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim, float(model.get_decoder().layers[0].self_attn.scaling)


def layout_problem(model, linear_types: tuple = (torch.nn.Linear,),
                   head_types: tuple | None = (torch.nn.Linear,)) -> str | None:
    """Why :class:`LlamaStack` cannot compute ``model``'s decoder, or None where it can: Llama's
    layout (a decoder of layers with a rotary embedding, a token embedding and a final norm; each
    layer attention, a SiLU-gated MLP and two RMSNorms and nothing else), no sliding window, no
    partial rotary embedding, not a vision-language model, its projections of ``linear_types``
    (exactly) and its output layer of ``head_types`` (None: any)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    config = text_config(model)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "rotary_emb"):
        return "no decoder layers with a rotary embedding"
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "norm")):
        return "no token embedding or final norm on the decoder"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "a sliding attention window"
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return "a partial rotary embedding"
    if getattr(config, "vision_config", None) is not None:
        return "a vision-language model"
    if head_types is not None and type(model.get_output_embeddings()) not in head_types:
        return f"an output layer other than {' or '.join(t.__name__ for t in head_types)}"
    for layer in decoder.layers:
        problem = _layer_problem(layer, linear_types)
        if problem is not None:
            return problem
    return None


def _layer_problem(layer, linear_types: tuple) -> str | None:
    if {n for n, _ in layer.named_children()} != LAYER_PARTS:
        return "a decoder layer with parts other than the Llama layout's"
    attn, mlp = layer.self_attn, layer.mlp
    if {n for n, _ in attn.named_children()} != ATTENTION_PARTS or {n for n, _ in mlp.named_children()} != MLP_PARTS:
        return "attention or an MLP with parts other than Llama's"
    if any(type(lin) not in linear_types for lin in (*(getattr(attn, n) for n in sorted(ATTENTION_PARTS)),
                                                      mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        return f"projections other than {' or '.join(t.__name__ for t in linear_types)} layers"
    if getattr(attn, "sliding_window", None) or getattr(attn, "scaling", None) is None:
        return "attention with a sliding window, or without a scaling"
    if not isinstance(mlp.act_fn, torch.nn.SiLU) and type(mlp.act_fn).__name__ != "SiLUActivation":
        return f"an MLP activation other than SiLU ({type(mlp.act_fn).__name__})"
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
            return "norms other than the Llama layout's RMSNorm"
    return None


class LlamaStack(torch.nn.Module):
    """A model's decoder stack run as :func:`decoder_layers` (see the module doc), with its linear
    layers as ``linears`` says: ``"float"`` reads the model's ``nn.Linear`` weights at every forward
    (:meth:`tensors`; a product goes through its packed weight where the caller passes them);
    ``"int8"`` / ``"int4"`` stack a private copy's quantized layers once. Its children are the
    decoder's own modules (shared, never copied) and, for a copy, the stacked layers."""

    def __init__(self, model, linears: str = "float", script: bool = True):
        super().__init__()
        if linears not in ("float", "int8", "int4"):
            raise ValueError(f"linears must be 'float', 'int8' or 'int4', got {linears!r}")
        decoder = model.get_decoder()
        self.embed_tokens, self.rotary_emb, self.norm, self.layers = (
            decoder.embed_tokens, decoder.rotary_emb, decoder.norm, decoder.layers)
        self.heads, self.kv_heads, self.head_dim, self.scaling = attention_shape(model)
        self.kind = KINDS.index(linears)
        self.eps = [_eps(norm) for layer in decoder.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.function = (script and scripted_layers()) or decoder_layers
        self.scripted = self.function is not decoder_layers
        self.unpacked = [[torch.empty(0)] * 7 for _ in decoder.layers]
        self.stacked = torch.nn.ModuleList(_StackedLayer(layer) for layer in decoder.layers) if self.kind >= INT8 else None
        #: a copy's tensors, fixed once stacked (the copy is private: nothing replaces its layers)
        self._stacked_tensors = None if self.stacked is None else (
            [], [layer.parts for layer in self.stacked], [layer.biases for layer in self.stacked])

    @property
    def low_bit(self) -> bool:
        return self.kind >= INT8

    def tensors(self) -> tuple[list, list, list] | None:
        """(each layer's linear layers, :func:`decoder_layers`' ``parts`` and ``biases``): for a
        ``"float"`` stack read from the model as it holds them now, or None where a projection is no
        longer a plain ``nn.Linear`` (a layer replaced since, e.g. by an adapter), so a weight
        replaced or a module swapped is never computed stale; a copy's stacked ones otherwise."""
        if self._stacked_tensors is not None:
            return self._stacked_tensors
        linears, parts, biases = [], [], []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            mine = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            if any(type(lin) is not torch.nn.Linear for lin in mine):
                return None
            linears.append(mine)
            parts.append([layer.input_layernorm.weight, layer.post_attention_layernorm.weight] + [lin.weight for lin in mine])
            biases.append([lin.bias for lin in mine])
        return linears, parts, biases

    def mask(self, attention_mask: torch.Tensor | None, batch: int, width: int, start: int,
             end: int) -> torch.Tensor | None:
        """The slots each fed token sees, as this stack's attention takes them: [B, 1, T, end]
        boolean, or [B, 1, groups * T, end] for a low-bit stack; None where one token sees every slot
        (no padding). From ``attention_mask [B, N]`` (the row's real slots, None: all): causal, only
        the row's real tokens, its own slot always (so no row is fully masked); from a boolean
        ``attention_mask [B, 1, T, N]`` (a tree's, ``engines.tree_visibility``): as it says."""
        if attention_mask is not None and attention_mask.dim() == 4:
            allowed = attention_mask[:, 0, :, :end]  # [B, T, end]
        elif width == 1 and (attention_mask is None or bool(attention_mask[:, :end].all())):
            return None
        else:
            device = attention_mask.device if attention_mask is not None else self.embed_tokens.weight.device
            slots = torch.arange(end, device=device)
            mine = (start + torch.arange(width, device=device))[:, None]  # [T, 1] each token's own slot
            allowed = (slots[None, :] <= mine)[None]  # [1, T, end]: causal
            if attention_mask is not None:
                allowed = (allowed & attention_mask[:, None, :end].bool()) | (slots[None, :] == mine)[None]
        if not self.low_bit:
            return allowed[:, None]
        groups = self.heads // self.kv_heads
        return allowed.expand(batch, width, end)[:, None, None].expand(batch, 1, groups, width, end).reshape(
            batch, 1, groups * width, end)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, keys: list, values: list, start: int,
                attention_mask: torch.Tensor | None = None, tensors: tuple | None = None,
                packed: list | None = None, capture: list | None = None) -> tuple[torch.Tensor, list]:
        """``hidden [B, T, H]`` (the embedded tokens) at ``positions [B, T]`` through every layer,
        their keys and values written at slots ``start:`` of the buffers ``keys[i]`` /
        ``values[i]``; ``tensors``: :meth:`tensors` (read again where not given); ``packed``: each
        layer's 7 weights packed for MKL (a ``"float"`` stack; None: plain products); ``capture``:
        ``output_hidden_states`` indices in 0 .. layers to keep. -> (the last layer's output, before
        the final norm; the captured states, ascending)."""
        batch, width = hidden.shape[0], hidden.shape[1]
        cos, sin = self.rotary_emb(hidden, positions)  # [B, T, D]
        _, parts, biases = tensors if tensors is not None else self.tensors()
        kind = self.kind if packed is None or self.low_bit else PACKED
        with torch.jit.optimized_execution(False), torch.inference_mode():  # see scripted_layers
            return self.function(hidden, cos, sin, self.mask(attention_mask, batch, width, start, start + width), keys,
                                 values, start, kind, parts, packed if packed is not None else self.unpacked, biases,
                                 self.eps, self.heads, self.kv_heads, self.head_dim, self.scaling,
                                 int8.ROWWISE_ROWS, capture if capture is not None else [])


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class _StackedLayer(torch.nn.Module):
    """One decoder layer of a low-bit copy as :func:`_low_bit_layer` takes it: ``parts`` = the two
    norms' scales, then three tensors for each of query-key-value, the attention output, gate-up
    and down (int8 weights, scales and offsets; or int4 weights, scales-and-zeros and an empty
    tensor), then the two factors down's input is rotated by (``Int8Linear.rotation``; two empty
    tensors where it is not); ``biases`` = those four layers' biases (or None)."""

    def __init__(self, layer):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        kind = int8 if isinstance(attn.q_proj, int8.Int8Linear) else int4
        stack = int8.stack_linears if kind is int8 else int4.stack_int4
        self.qkv = stack([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = stack([mlp.gate_proj, mlp.up_proj])
        linears = (self.qkv, attn.o_proj, self.gate_up, mlp.down_proj)
        padding = [torch.empty(0)] * (3 - len(kind.WEIGHT_BUFFERS))  # three tensors a layer, whatever the kind
        rotation = mlp.down_proj.rotation() if kind is int8 else None
        self.parts = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight] + [
            tensor for lin in linears for tensor in [getattr(lin, name) for name in kind.WEIGHT_BUFFERS] + padding] + (
            rotation if rotation is not None else [torch.empty(0), torch.empty(0)])
        self.biases = [lin.bias for lin in linears]
