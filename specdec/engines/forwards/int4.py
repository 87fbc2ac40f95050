"""Int4 matrix products for a CPU draft copy: int4 weights in groups, bfloat16 activations.

A decoding step of a small model on a CPU is bound by reading its weights. This module stores a
linear layer's weights as 4-bit integers, a scale and an offset (bfloat16) for every
:data:`GROUP` consecutive weights of an output channel, and multiplies through torch's own int4
kernel for CPUs (``torch._weight_int4pack_mm_for_cpu``, with bfloat16 activations; no extra
package): an eighth of the fp32 bytes, half of an int8 copy's. A copy's output layer stays in
bfloat16 (:class:`Bfloat16Head`). It pays most on a CPU where int8 x uint8 products (``int8.py``)
cost more than fp32 ones (the measurements: docs/self_draft.md, "Measured on Spec-Bench").

The weights are quantized to their group's own range (``lo + scale * q``, q in 0..15), the
kernel's layout: it computes ``x @ ((q - 8) * scale + zero)^T`` with ``zero = lo + 8 scale``.

Only the draft uses these layers: a draft is checked token by token against the target, so
rounding changes which drafts are accepted, never the output.
"""

from __future__ import annotations

from typing import Optional

import torch

#: weights of an output channel that share one scale and offset
GROUP = 32
#: rows of a weight quantized at a time (``rotation.CHUNK_ROWS``: why)
CHUNK_ROWS = 4096
#: output widths that stack (``stack_int4``): the packing works in blocks of this many rows
STACK_ROWS = 64
#: an :class:`Int4Linear`'s weight buffers: the packed weights, one row per output channel, then
#: the scales and offsets [K / GROUP, N, 2] (what stacking concatenates, along different dims)
WEIGHT_BUFFERS = ("weight_int4", "scales_zeros")


def available() -> bool:
    """Whether this torch has the CPU int4 kernel."""
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


def int4_linear(x2: torch.Tensor, weight_int4: torch.Tensor, scales_zeros: torch.Tensor,
                bias: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """:class:`Int4Linear`'s forward on the 2-D rows ``x2 [M, K]`` from its buffers, the result in
    ``dtype``. A plain function of tensors (no module), so that ``lean.py`` can script it."""
    group = x2.shape[1] // scales_zeros.shape[0]
    y = torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), weight_int4, group, scales_zeros).to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)  # the float32 bias would promote a bfloat16 output
    return y


def quantize(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (q [N, K] int32 in 0..15, scales_zeros [K / group, N, 2] bfloat16)."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int32, device=weight.device)
    scales_zeros = torch.empty(k // group, n, 2, dtype=torch.bfloat16, device=weight.device)
    for first in range(0, n, CHUNK_ROWS):  # float temporaries of a few MB, whatever the layer's size
        rows = slice(first, first + CHUNK_ROWS)
        w = weight[rows].float().reshape(-1, k // group, group)
        lo, hi = torch.aminmax(w, dim=2, keepdim=True)
        scale = ((hi - lo) / 15).clamp_min_(1e-6)
        q[rows] = ((w - lo) / scale).round_().clamp_(0, 15).reshape(-1, k).to(torch.int32)
        scales_zeros[:, rows] = torch.cat([scale, lo + 8 * scale], dim=2).transpose(0, 1)
    return q, scales_zeros


class Int4Linear(torch.nn.Module):
    """``y = x W^T + b`` with W stored as int4 in groups of :data:`GROUP` along its input."""

    def __init__(self, linear: torch.nn.Linear, group: int = GROUP):
        super().__init__()
        if linear.in_features % group or linear.out_features % 16:
            raise ValueError(f"weights='int4': a linear layer of {linear.in_features} -> {linear.out_features} "
                             f"features, where torch's int4 kernel needs inputs in multiples of {group} and "
                             "outputs in multiples of 16; choose w8a8 or bfloat16")
        q, scales_zeros = quantize(linear.weight.detach(), group)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int4", torch._convert_weight_to_int4pack_for_cpu(q, 1))  # [N, K / 2]
        self.register_buffer("scales_zeros", scales_zeros)  # [K / group, N, 2]
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = int4_linear(x.reshape(-1, shape[-1]), self.weight_int4, self.scales_zeros, self.bias, x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = self.in_features // self.scales_zeros.shape[0]
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=int4 (groups of {group}), activations=bfloat16"


def stack_int4(parts: list[Int4Linear]) -> Int4Linear:
    """One :class:`Int4Linear` computing ``parts`` (which read the same input) as one product, their
    outputs side by side. Packing works row by row, so the stacked packed weights are the parts'
    side by side; each part's weights become a view of them (its scales stay its own: they are
    small, and a part's slice of the stacked ones would not be contiguous)."""
    stacked = Int4Linear.__new__(Int4Linear)
    torch.nn.Module.__init__(stacked)
    stacked.in_features, stacked.out_features = parts[0].in_features, sum(p.out_features for p in parts)
    stacked.register_buffer("weight_int4", torch.cat([p.weight_int4 for p in parts]))
    stacked.register_buffer("scales_zeros", torch.cat([p.scales_zeros for p in parts], dim=1))
    has_bias = any(p.bias is not None for p in parts)
    stacked.register_buffer("bias", torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features)
                                                for p in parts]) if has_bias else None)
    first = 0
    for part in parts:
        part.weight_int4 = stacked.weight_int4[first: first + part.out_features]
        first += part.out_features
    return stacked


class Bfloat16Head(torch.nn.Module):
    """An int4 copy's output layer, ``y = x W^T + b`` with W in bfloat16 (its input cast to
    bfloat16, its output back to the input's dtype). The output layer decides which token a draft
    is, among tens of thousands whose logits lie close together, and int4 rounding of it turned
    many of the copy's top tokens, for about the same step time (docs/self_draft.md, "How the copy
    drafts"). The weights are a copy: a tied input embedding keeps its own dtype."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16).contiguous())
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=bfloat16"


def quantize_linears(model: torch.nn.Module, group: int = GROUP, head: bool = True) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by an :class:`Int4Linear`, but its output
    layer (``model.get_output_embeddings()``) by a :class:`Bfloat16Head` where ``head``."""
    out = model.get_output_embeddings() if head and hasattr(model, "get_output_embeddings") else None
    if isinstance(out, torch.nn.Linear):
        model.set_output_embeddings(Bfloat16Head(out))
    _quantize(model, group)
    return model


def _quantize(module: torch.nn.Module, group: int) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, Int4Linear(child, group))
        else:
            _quantize(child, group)
