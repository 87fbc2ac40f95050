"""Draft models at lower precision: a copy of a model with fewer bytes per weight.

Decoding a small model on a CPU is bound by reading its weights, so a copy with fewer bytes per
weight steps faster and agrees with the model it was built from almost always. ``self_draft``
builds one from the target; ``draft_model`` and ``cross_tokenizer`` build one from their draft
model when given ``weights=``. The model a copy is built from is never modified.

``weights``:

* ``"auto"``: ``"w8a8"`` for a model on a CPU (the fastest copy measured there, no extra
  package), ``"bfloat16"`` elsewhere (no extra package);
* ``"bfloat16"`` / ``"float16"``: a cast copy (no extra package);
* ``"int8"``: int8 weight-only linear layers with bfloat16 activations, by ``torchao``
  (``pip install "specdec[quant]"``);
* ``"w8a8"``: int8 weights and activations quantized per token on the fly, everything else in
  the model's dtype: int8 matrix products, the fastest draft on a CPU with VNNI/AMX int8
  instructions (on a CPU ``int8.Int8Linear``, with the residual stream rotated first where the
  layout allows, see ``rotation.py``; no extra package; elsewhere ``torchao``;
  docs/self_draft.md has the measurements);
* ``"int4"``: int4 weight-only (``torchao``; needs a backend with int4 kernels).

A copy drafts on a static cache with compiled one-token forwards (torchao's int8 layers are slower
than fp32 ones until compiled): :class:`LowPrecisionDraft` gives a generator the option.
"""

from __future__ import annotations

import copy
import threading
import weakref

import torch

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..compiled import check_compile_options
from .int8 import quantize_linears
from .rotation import rotatable, rotate_residual

WEIGHTS = ("auto", "bfloat16", "float16", "int8", "w8a8", "int4")
QUANTIZED = ("int8", "w8a8", "int4")


def check_weights(weights: str, who: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"{who}: weights must be one of {WEIGHTS}, got {weights!r}")


def resolve_weights(model, weights: str) -> str:
    """``weights``, with ``"auto"`` made concrete for ``model``'s device."""
    check_weights(weights, "a low-precision copy")
    if weights != "auto":
        return weights
    return "w8a8" if next(model.parameters()).device.type == "cpu" else "bfloat16"


def build_copy(model, weights: str):
    """A copy of ``model`` with ``weights`` precision; ``model`` is only read."""
    weights = resolve_weights(model, weights)
    if getattr(model.config, "vision_config", None) is not None or hasattr(model, "get_rope_index"):
        raise ValueError(f"a low-precision draft copy needs a text-only model; {type(model).__name__} is a "
                         "vision-language model (pass a text draft model instead)")
    on_cpu = next(model.parameters()).device.type == "cpu"
    if weights in QUANTIZED and not (weights == "w8a8" and on_cpu):
        quantize, config = _torchao(weights)
    draft = _plain_copy(model)
    if weights == "w8a8" and on_cpu:  # int8 x uint8 products, the model's dtype elsewhere (int8.py)
        # a rotated residual stream is easier to quantize (rotation.py), where the layout allows
        if rotatable(draft) is None and not rotate_residual(draft, reference=model):
            draft = _plain_copy(model)  # the rotated copy failed its check: it is spoilt
        return quantize_linears(draft).eval()
    if weights != "w8a8":
        draft.to(torch.float16 if weights == "float16" else torch.bfloat16)
    if weights in QUANTIZED:
        quantize(draft, config)
    return draft.eval()


def _plain_copy(model):
    draft = copy.deepcopy(model)
    if getattr(draft.config, "_attn_implementation", None) == "sdpa":
        draft.set_attn_implementation(GROUPED_SDPA)  # the copy's config only: the model keeps its own
    return draft


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """SDPA for grouped-query attention without repeating keys and values per query head.

    transformers' ``sdpa`` repeats each key/value head for its group of query heads whenever a
    mask is given and the forward is compiled: the copy's draft steps (compiled, always masked)
    would read a static cache of S slots ``groups`` times over. Here the group's query heads
    become extra query rows of their key/value head instead (``[B, kv, groups * q, D]``, the
    mask repeated to match), which is the same attention. Anything else goes to ``sdpa``."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (groups == 1 or attention_mask is None or attention_mask.shape[1] != 1
             or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    batch, heads, q, dim = query.shape
    mask_batch, slots = attention_mask.shape[0], attention_mask.shape[-1]
    mask = attention_mask[:, :, None].expand(mask_batch, 1, groups, q, slots).reshape(mask_batch, 1, groups * q, slots)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(batch, heads // groups, groups * q, dim),
                                                           key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, q, dim).transpose(1, 2).contiguous(), None


GROUPED_SDPA = "specdec_grouped_sdpa"
AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def _torchao(weights: str):
    try:
        from torchao.quantization import (Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                                          Int8WeightOnlyConfig, quantize_)
    except ImportError as exc:
        raise ImportError(f"a draft copy with weights={weights!r} needs torchao: pip install \"specdec[quant]\" "
                          "(or use weights='bfloat16', which needs no extra package)") from exc
    configs = {"int8": Int8WeightOnlyConfig, "w8a8": Int8DynamicActivationInt8WeightConfig,
               "int4": Int4WeightOnlyConfig}
    return quantize_, configs[weights]()


class Copies:
    """The copies one configured generator built, per (model, weights); shared by its sessions."""

    def __init__(self):
        self._made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {weights: copy}
        self._lock = threading.Lock()

    def get(self, model, weights: str):
        weights = resolve_weights(model, weights)
        with self._lock:
            made = self._made.setdefault(model, {})
            if weights not in made:
                made[weights] = build_copy(model, weights)
            return made[weights]


class LowPrecisionDraft:
    """A generator whose draft may run as a low-precision copy of itself (``weights=``), built
    once per configured generator (its sessions share it) and stepped compiled on a static cache
    (``compile_draft``, default on for a copy)."""

    def _init_precision(self, weights: str | None, compile_draft: bool | dict | None) -> None:
        if weights is not None:
            check_weights(weights, type(self).name or type(self).__name__)
        if compile_draft is not None and not isinstance(compile_draft, (bool, dict)):
            raise TypeError(f"compile_draft must be True, False or a dict of torch.compile options, "
                            f"got {compile_draft!r}")
        if isinstance(compile_draft, dict):
            check_compile_options(compile_draft, "compile_draft")
        self.weights = weights
        self.compile_draft = (weights is not None) if compile_draft is None else compile_draft
        self._copies = Copies()

    def session(self):
        fresh = super().session()
        fresh._copies = self._copies  # a copy is built once per decoder, not per call
        return fresh

    def drafting_model(self, model):
        """The model that drafts for ``model``: itself, or its copy at ``self.weights``."""
        return model if self.weights is None else self._copies.get(model, self.weights)

    def precision_attach_options(self, widths: tuple[int, ...] = (1, 2)) -> dict:
        """How the drafting model keeps its cache: a copy's on a static cache, stepped compiled
        (``compile_draft``) at ``widths`` (what it feeds a step: a draft, or the target's token
        after the last draft; wider forwards run eagerly, which for a quantized copy costs about
        what the model itself does); the model as given, the call's own unless ``compile_draft``.
        A copy is this generator's own (built by it, changed by nothing), so its compiled steps
        skip dynamo's guards on its modules."""
        if self.weights is None and not self.compile_draft:
            return {}
        return {"cache_implementation": "static", "compile": self.compile_draft, "compile_widths": widths,
                "owned": self.weights is not None}
