"""Int8 matrix products for a CPU draft copy: int8 weights, uint8 activations.

A decoding step of a small model on a CPU is bound by reading its weights. This module stores a
linear layer's weights as int8 (one scale per output channel) and quantizes each token's
activations to uint8 on the fly (its own scale and zero point), so the product runs on the CPU's
int8 dot-product instructions (AVX512-VNNI / AMX) through ``torch._int_mm``, reading a quarter of
the fp32 bytes (measured: docs/self_draft.md, "How the copy drafts").

Why not torchao's int8-activation layers (``Int8DynamicActivationInt8WeightConfig``) here: on a
CPU with AMX they multiply int8 by int8, which for one row is much slower than uint8 by int8
(docs/self_draft.md); and compiled, inductor hands ``torch._int_mm`` their one-row operand as a
view with a zero row stride, for which the CPU kernel returns wrong numbers (torch 2.13). This layer quantizes the 2-D activations itself, so the compiled graph allocates
the operand with its real strides (``tests/test_int8.py`` checks compiled against eager).

Only the draft uses these layers: a draft is checked token by token against the target, so
rounding changes which drafts are accepted, never the output.
"""

from __future__ import annotations

import torch


class Int8Linear(torch.nn.Module):
    """``y = x W^T + b`` with W stored as int8 per output channel and x quantized per token to uint8."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [N]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", q)  # [N, K]
        self.register_buffer("weight_scale", scale)  # [N]
        self.register_buffer("weight_sum", q.sum(dim=1, dtype=torch.int32).float())  # [N]: the zero point's share
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()  # [M, K]
        lo = x2.amin(dim=1, keepdim=True).clamp(max=0.0)
        hi = x2.amax(dim=1, keepdim=True).clamp(min=0.0)
        scale = ((hi - lo) / 255).clamp_min(1e-12)  # [M, 1]
        zero = torch.round(-lo / scale)  # [M, 1] in 0..255
        q = (torch.round(x2 / scale) + zero).clamp(0, 255).to(torch.uint8)
        acc = torch._int_mm(q, self.weight_int8.t())  # [M, N] int32
        y = (acc.float() - zero * self.weight_sum) * (scale * self.weight_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=int8, activations=uint8"


def quantize_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by an :class:`Int8Linear`."""
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_linears(child)
    return model
