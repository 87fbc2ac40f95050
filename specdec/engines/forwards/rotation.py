"""A rotation of the residual stream that makes a copy's activations easier to quantize.

Per-token activation quantization (``int8.Int8Linear``) spends its 256 levels on the token's
largest value; a few channels of a language model's residual stream are much larger than the
rest, so the other channels get few levels. An orthogonal change of basis ``Q`` spreads those
channels over all of them, and it can be folded into the weights so that the copy computes the
same function with no extra work per token:

* each RMSNorm's scale moves into the linear layers that read its output (its own scale becomes
  one), so the norm is ``x / rms(x)``, which commutes with ``Q``;
* layers that read the residual stream (embedding rows, query / key / value, gate / up, the
  output head) get ``W Q``; layers that write to it (attention output, down) get ``Q^T W``.

Keys and values come out of their projections unchanged, so a rotated copy can still take the
target's cached keys and values. ``Q`` is the Kronecker product of two seeded random orthogonal
matrices of about ``sqrt(hidden)`` rows, which spreads any one channel over all of them, and is
applied factor by factor, so building it costs far less than one dense ``hidden x hidden`` matrix.

Only the pre-norm decoder layout is rotated (transformers' Llama, Mistral, Qwen2/3 and similar:
``input_layernorm`` and ``post_attention_layernorm`` around ``self_attn.{q,k,v,o}_proj`` and
``mlp.{gate,up,down}_proj``); anything else is left as it is, and so is a copy whose rotated
forward does not reproduce the original's logits (:func:`rotate_residual` checks).
A rotated w8a8 copy agrees with the target more often than an unrotated one, which is its only
purpose (the agreement measured per variant: docs/self_draft.md, "How the copy drafts").

The input of each MLP's output layer (``act(gate) * up``) is not on the residual stream, and it
has the largest outlier channels of all; no rotation folds into the weights there (the product
of gate and up is elementwise). :func:`mlp_outputs` names those layers, and ``int8.Int8Linear``
rotates their input at run time by the same kind of Kronecker product: two small products a
token per layer (what they cost and gain: docs/self_draft.md).
"""

from __future__ import annotations

import torch

#: sublayers a rotatable decoder layer has (anything else, e.g. extra norms, is refused)
LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
READS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"))
READS_MLP = (("mlp", "gate_proj"), ("mlp", "up_proj"))
WRITES = (("self_attn", "o_proj"), ("mlp", "down_proj"))


def _get(module, path):
    for name in path:
        module = getattr(module, name, None)
    return module


def rotatable(model, linear: type = torch.nn.Linear, head: type | tuple[type, ...] | None = None) -> str | None:
    """Why ``model`` cannot be rotated, or None where it can: the pre-norm decoder layout this
    module knows, its linear layers of type ``linear`` and its output head of type ``head``
    (default: ``linear``; ``lean.py`` asks the same of a copy whose layers are ``Int8Linear`` or
    ``Int4Linear``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None or not isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        return f"{type(model).__name__} has no decoder with layers and a final norm"
    if not isinstance(model.get_output_embeddings(), head or linear):
        return f"no {linear.__name__} output head"
    for layer in layers:
        parts = {name for name, _ in layer.named_children()}
        if parts != LAYER_PARTS:
            return f"a decoder layer has {sorted(parts)}, not {sorted(LAYER_PARTS)}"
        for path in (*READS, *READS_MLP, *WRITES):
            if not isinstance(_get(layer, path), linear):
                return f"a decoder layer has no {linear.__name__} {'.'.join(path)}"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not isinstance(getattr(norm, "weight", None), torch.Tensor) or getattr(norm, "bias", None) is not None:
                return "a norm without a scale, or with a bias"
    return None


#: a layer's input is rotated online only where the smaller Kronecker factor has at least this
#: many rows: otherwise the other factor approaches a dense ``size x size`` product per token
MIN_FACTOR = 8


def mlp_outputs(model) -> list[torch.nn.Linear]:
    """The MLP output layers (``mlp.down_proj``) of ``model``'s decoder layers whose inputs a w8a8
    copy rotates online (``int8.Int8Linear``'s ``rotate``): their input, ``act(gate) * up``,
    has a few channels far larger than the rest, which the residual stream's rotation does not
    reach. Only linear layers whose input size has a Kronecker factor of :data:`MIN_FACTOR` or more."""
    found = []
    for layer in getattr(model.get_decoder(), "layers", ()):
        down = getattr(getattr(layer, "mlp", None), "down_proj", None)
        if isinstance(down, torch.nn.Linear) and smaller_factor(down.in_features) >= MIN_FACTOR:
            found.append(down)
    return found


def smaller_factor(size: int) -> int:
    """The largest divisor of ``size`` up to its square root (the rows of :func:`kron_orthogonal`'s ``a``)."""
    return max(d for d in range(1, int(size ** 0.5) + 1) if size % d == 0)


def kron_orthogonal(size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random orthogonal factors (a [m, m], b [n, n], m * n = size, m the largest divisor of
    ``size`` up to its square root) whose Kronecker product is the rotation."""
    m = smaller_factor(size)
    gen = torch.Generator().manual_seed(seed)
    factors = []
    for n in (m, size // m):
        q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        factors.append((q * torch.sign(torch.diagonal(r))[None, :]).float())  # Haar: signs fixed by r
    return factors[0], factors[1]


#: rows of a weight rotated at a time: the temporaries stay a few MB, so they reuse memory the
#: process holds (a fresh allocation of an embedding's size costs more, and varies more, on a
#: machine whose memory is faulted in by a hypervisor, than rotating it)
CHUNK_ROWS = 4096


def rotate_columns(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """weight [N, m*n] -> (weight * scale) @ kron(a, b), written to ``out`` (default: ``weight``
    itself), ``CHUNK_ROWS`` rows at a time."""
    out = weight if out is None else out
    for first in range(0, weight.shape[0], CHUNK_ROWS):
        rows = slice(first, first + CHUNK_ROWS)
        w = weight[rows].float()
        if scale is not None:
            w = w * scale[None, :]
        w = w.reshape(w.shape[0], a.shape[0], b.shape[0])
        out[rows] = torch.matmul(torch.matmul(a.T, w), b).reshape(w.shape[0], -1)  # two batched products
    return out


def _rotate_rows(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """weight [m*n, ...] -> kron(a, b)^T @ weight."""
    w = torch.einsum("abk,ai->ibk", weight.float().reshape(a.shape[0], b.shape[0], -1), a)
    return torch.einsum("ibk,bj->ijk", w, b).reshape(weight.shape).to(weight.dtype)


@torch.no_grad()
def rotate_residual(model, reference=None, seed: int = 0) -> bool:
    """Rotate ``model``'s residual stream in place; ``model`` must be a private copy (its weights
    change, its output head is untied from its embedding). Returns False, leaving ``model``
    untouched, where its layout is not one this module rotates; and False where ``reference`` (the
    model it was copied from) is given and the rotated logits on a few tokens differ from its: then
    ``model`` is spoilt, and the caller drops it."""
    if rotatable(model) is not None:
        return False
    decoder, head, embed = model.get_decoder(), model.get_output_embeddings(), model.get_input_embeddings()
    a, b = kron_orthogonal(embed.weight.shape[1], seed)
    final = decoder.norm.weight.float()
    # the head first, into a weight of its own: it may share its weight with the embedding, which
    # is rotated without the final norm's scale
    head.weight = torch.nn.Parameter(rotate_columns(head.weight, a, b, final, torch.empty_like(head.weight)),
                                     requires_grad=False)
    rotate_columns(embed.weight, a, b)
    decoder.norm.weight.fill_(1.0)
    for layer in decoder.layers:
        for norm, reads in ((layer.input_layernorm, READS), (layer.post_attention_layernorm, READS_MLP)):
            scale = norm.weight.float()
            for path in reads:
                rotate_columns(_get(layer, path).weight, a, b, scale)
            norm.weight.fill_(1.0)
        for path in WRITES:
            lin = _get(layer, path)
            lin.weight.copy_(_rotate_rows(lin.weight, a, b))
            if lin.bias is not None:
                lin.bias.copy_(_rotate_rows(lin.bias, a, b))
    if hasattr(model.config, "tie_word_embeddings"):
        model.config.tie_word_embeddings = False
    return reference is None or _same_logits(model, reference)


def _same_logits(model, reference, tokens: int = 8) -> bool:
    device = next(reference.parameters()).device
    vocab = reference.get_input_embeddings().weight.shape[0]
    ids = (torch.arange(tokens, device=device) * 7919 % vocab)[None, :]
    want = reference(input_ids=ids).logits.float()
    got = model(input_ids=ids).logits.float()
    return bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max())))
