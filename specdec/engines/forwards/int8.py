"""Int8 matrix products for a CPU draft copy: int8 weights, uint8 activations.

A decoding step of a small model on a CPU is bound by reading its weights. This module stores a
linear layer's weights as int8 (one scale per output channel) and quantizes each token's
activations to uint8 on the fly (256 levels over the token's own range), so the product runs on
the CPU's int8 dot-product instructions (AVX512-VNNI / AMX) through ``torch._int_mm``, reading a
quarter of the fp32 bytes (measured: docs/self_draft.md, "How the copy drafts").

Why not torchao's int8-activation layers (``Int8DynamicActivationInt8WeightConfig``) here: on a
CPU with AMX they multiply int8 by int8, which for one row is much slower than uint8 by int8
(docs/self_draft.md); and compiled, inductor hands ``torch._int_mm`` their one-row operand as a
view with a zero row stride, for which the CPU kernel returns wrong numbers (torch 2.13). This layer quantizes the 2-D activations itself, so the compiled graph allocates
the operand with its real strides (``tests/test_int8.py`` checks compiled against eager).

Only the draft uses these layers: a draft is checked token by token against the target, so
rounding changes which drafts are accepted, never the output.
"""

from __future__ import annotations

import statistics
import time
from typing import Container, List, Optional

import torch

from .rotation import rotate_columns, kron_orthogonal


#: the most rows :func:`int8_product` multiplies one at a time. On some CPUs torch's uint8 x int8
#: product has a fast path for a single row only (an Intel Xeon with AMX: 7 us for one row of a
#: 576 x 1536 weight, 47 us for two), so a few rows run faster one by one; where it has none,
#: the rows go together. Measured once a process, on the machine (:func:`measure_rowwise`), when
#: the first :class:`Int8Linear` is made.
ROWWISE_ROWS = 1
_MEASURED = False


def measure_rowwise(reps: int = 15) -> int:
    """Set :data:`ROWWISE_ROWS` from timings here (once a process): the most rows (up to 8) for
    which :func:`int8_product` one row at a time, and at every smaller count, took less than all
    rows at once, on a 576 x 1536 weight (medians of ``reps`` rounds, the variants in turn)."""
    global ROWWISE_ROWS, _MEASURED
    if _MEASURED:
        return ROWWISE_ROWS
    _MEASURED = True
    noise = torch.Generator().manual_seed(0)  # never the global generator a user's seeded sampling reads
    weight = torch.randint(-127, 128, (1536, 576), dtype=torch.int8, generator=noise)
    scale, offset = torch.rand(1536, generator=noise), torch.rand(1536, generator=noise)
    timed: dict[tuple[int, int], list[float]] = {(rows, way): [] for rows in range(2, 9) for way in (1, rows)}
    try:
        for _ in range(reps):
            for rows, way in timed:
                x = torch.randn(rows, 576, generator=noise)
                started = time.perf_counter()
                int8_product(x, weight, scale, offset, way)
                timed[rows, way].append(time.perf_counter() - started)
    except RuntimeError:  # no int8 product here: nothing to choose
        return ROWWISE_ROWS
    for rows in range(2, 9):
        if statistics.median(timed[rows, rows]) >= statistics.median(timed[rows, 1]):
            break
        ROWWISE_ROWS = rows
    return ROWWISE_ROWS


def int8_product(x2: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor,
                 weight_offset: torch.Tensor, rowwise: int = 1) -> torch.Tensor:
    """[M, N] ``x2 [M, K]`` (float32) times the int8 weights ``weight_int8 [N, K]`` (scales
    ``weight_scale [N]``, ``weight_offset [N]``: :class:`Int8Linear`'s buffers), each row of ``x2``
    quantized to uint8 over its own range: ``lo + scale * q``, q in 0..255, its lowest value exact;
    up to ``rowwise`` rows (:data:`ROWWISE_ROWS`) multiplied one at a time (integer sums: the same
    numbers). Where oneDNN has no int8 dot products (VNNI: an AVX2-only CPU, or a cap below it),
    its kernel adds pairs of products in 16 bits, which saturate: about 4% of SmolLM2's outputs
    then differ from the exact sums, by up to 8% of the largest (what the copy drafts changes,
    never the output; ``weights="auto"`` tries this copy last there). A plain function of tensors
    (no module), so that ``lean.py`` can script it."""
    lo, hi = torch.aminmax(x2, dim=1, keepdim=True)  # [M, 1] each
    scale = (hi - lo).mul_(1 / 255).clamp_min_(1e-12)  # [M, 1]
    q = (x2 - lo).div_(scale).round_().to(torch.uint8)  # [M, K]
    rows = q.shape[0]
    if 1 < rows <= rowwise:
        parts = []
        for i in range(rows):
            parts.append(torch._int_mm(q[i: i + 1], weight_int8.t()))
        products = torch.cat(parts)
    else:
        products = torch._int_mm(q, weight_int8.t())
    return (products * weight_scale).mul_(scale).addcmul_(lo, weight_offset)


def rotate_input(x2: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, m n] ``x2`` times ``kron(a, b)`` (``a [m, m]``, ``b [n, n]``), factor by factor: each row
    as an ``[m, n]`` matrix ``X`` becomes ``a^T X b``."""
    if x2.shape[0] == 1:  # two plain products: half the time of the batched ones for one row
        return torch.mm(torch.mm(a.t(), x2.view(a.shape[0], b.shape[0])), b).view(x2.shape)
    return torch.matmul(torch.matmul(a.t(), x2.reshape(-1, a.shape[0], b.shape[0])), b).reshape(x2.shape)


def int8_linear(x2: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor, weight_offset: torch.Tensor,
                bias: Optional[torch.Tensor], dtype: torch.dtype, rowwise: int = 1,
                rotation: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
    """:class:`Int8Linear`'s forward on the 2-D rows ``x2 [M, K]`` from its buffers, the result in
    ``dtype`` (the input's); ``rotation``: the factors its input is rotated by first (its weights
    were rotated alike), or None. A plain function, as :func:`int8_product`."""
    x2 = x2 if x2.dtype == torch.float32 else x2.float()
    if rotation is not None:
        x2 = rotate_input(x2, rotation[0], rotation[1])
    y = int8_product(x2, weight_int8, weight_scale, weight_offset, rowwise)
    if bias is not None:
        y = y.add_(bias)
    return y if y.dtype == dtype else y.to(dtype)


#: rows of a weight quantized at a time (``rotation.CHUNK_ROWS``: why)
CHUNK_ROWS = 4096

#: an :class:`Int8Linear`'s weight buffers, one row per output channel (what stacking concatenates)
WEIGHT_BUFFERS = ("weight_int8", "weight_scale", "weight_offset")
#: an :class:`Int8Linear`'s input rotation factors (both None where its input is not rotated)
ROTATION_BUFFERS = ("rotation_a", "rotation_b")


class Int8Linear(torch.nn.Module):
    """``y = x W^T + b`` with W stored as int8 per output channel and x quantized per token to uint8.

    With ``rotate=True`` the layer quantizes ``x Q`` and stores ``W Q`` (``Q`` an orthogonal
    Kronecker product, ``rotation.kron_orthogonal``): the same product in exact arithmetic, but a
    rotated token spreads its few large channels over all of them, so its 256 levels resolve the
    rest better. It costs two small products a token; a copy spends it where activations have
    such channels (the MLP's output layer, whose input is ``act(gate) * up``: docs/self_draft.md)."""

    def __init__(self, linear: torch.nn.Linear, rotate: bool = False):
        super().__init__()
        measure_rowwise()
        w = linear.weight.detach()  # [N, K]
        rotation = kron_orthogonal(w.shape[1]) if rotate else (None, None)
        if rotate:
            w = rotate_columns(w.float(), *rotation, out=torch.empty(w.shape, dtype=torch.float32, device=w.device))
        for name, factor in zip(ROTATION_BUFFERS, rotation):
            self.register_buffer(name, None if factor is None else factor.to(w.device))
        lo, hi = torch.aminmax(w, dim=1)  # the largest magnitude per row, without a copy of |w|
        scale = (torch.maximum(hi, -lo).float() / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [N]
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        for first in range(0, w.shape[0], CHUNK_ROWS):  # float temporaries of a few MB, whatever the layer's size
            rows = slice(first, first + CHUNK_ROWS)
            q[rows] = (w[rows].float() / scale[rows, None]).round_().clamp_(-127, 127)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", q)  # [N, K]
        self.register_buffer("weight_scale", scale)  # [N]
        # [N] what a row of ones contributes to each output: x = scale q + lo puts lo * this in every output
        self.register_buffer("weight_offset", q.sum(dim=1, dtype=torch.int32).float() * scale)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        # measured for a CPU; compiled, all rows at once: inductor may hand a one-row slice to the
        # product with a zero row stride (the module doc)
        rowwise = ROWWISE_ROWS if x.device.type == "cpu" and not torch.compiler.is_compiling() else 1
        y = int8_linear(x.reshape(-1, shape[-1]), self.weight_int8, self.weight_scale, self.weight_offset, self.bias,
                        x.dtype, rowwise, self.rotation())
        return y.reshape(*shape[:-1], self.out_features)

    def rotation(self) -> list[torch.Tensor] | None:
        """The factors the input is rotated by, or None."""
        return None if self.rotation_a is None else [self.rotation_a, self.rotation_b]

    def extra_repr(self) -> str:
        rotated = ", input rotated" if self.rotation_a is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=int8, activations=uint8{rotated}"


def stack_linears(parts: list[Int8Linear]) -> Int8Linear:
    """One :class:`Int8Linear` computing ``parts`` (which read the same input) as one product, their
    outputs side by side; each part's buffers become views of the stacked ones (nothing is stored
    twice, and the parts compute what they did: scales are per output channel)."""
    if any(p.rotation_a is not None for p in parts):
        raise ValueError("layers whose inputs are rotated do not stack")
    stacked = Int8Linear.__new__(Int8Linear)
    torch.nn.Module.__init__(stacked)
    for name in ROTATION_BUFFERS:
        stacked.register_buffer(name, None)
    stacked.in_features, stacked.out_features = parts[0].in_features, sum(p.out_features for p in parts)
    for name in WEIGHT_BUFFERS:
        stacked.register_buffer(name, torch.cat([getattr(p, name) for p in parts]))
    has_bias = any(p.bias is not None for p in parts)
    stacked.register_buffer("bias", torch.cat([p.bias if p.bias is not None else stacked.weight_scale.new_zeros(
        p.out_features) for p in parts]) if has_bias else None)
    first = 0
    for part in parts:
        rows = slice(first, first + part.out_features)
        for name in WEIGHT_BUFFERS:
            setattr(part, name, getattr(stacked, name)[rows])
        if part.bias is not None:
            part.bias = stacked.bias[rows]
        first += part.out_features
    return stacked


def quantize_linears(model: torch.nn.Module, rotate: Container[torch.nn.Module] = ()) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by an :class:`Int8Linear`, those in
    ``rotate`` with their inputs rotated."""
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(model, name, Int8Linear(child, rotate=child in rotate))
        else:
            quantize_linears(child, rotate)
    return model
