"""A copy of a model at lower precision: fewer bytes per weight, for drafting.

Decoding a small model on a CPU is bound by reading its weights, so a copy with fewer bytes per
weight steps faster and agrees with the model it was built from almost always. ``self_draft``
builds one from the target; ``draft_model`` and ``cross_tokenizer`` build one from their draft
model when given ``weights=``. The model a copy is built from is never modified.

``weights``:

* ``"auto"``: for a model on a CPU, the copy measured best on this machine (``specdec.copies.Copies``
  asks ``specdec/copies/choose.py``, within a time budget; :func:`build_copy` alone, which measures nothing,
  takes ``"w8a8"``), ``"bfloat16"`` elsewhere (no extra package);
* ``"bfloat16"`` / ``"float16"``: a cast copy (no extra package);
* ``"int8"``: int8 weight-only linear layers with bfloat16 activations, by ``torchao``
  (``pip install "specdec[quant]"``);
* ``"w8a8"``: int8 weights and activations quantized per token on the fly, everything else in
  the model's dtype: int8 matrix products, the fastest draft on a CPU with VNNI/AMX int8
  instructions (on a CPU ``int8.Int8Linear``, with the residual stream rotated first where the
  layout allows, see ``rotation.py``; no extra package; elsewhere ``torchao``;
  docs/self_draft.md has the measurements);
* ``"dynamic_int8"``: torch's own dynamic quantization (``torch.ao.quantization.quantize_dynamic``:
  int8 weights per output channel, activations quantized per tensor on the fly, fbgemm's kernels,
  which serve CPUs without VNNI too); CPU only, eager only (its packed weights do not compile);
* ``"int4"``: int4 weights in groups of 32 along the input, scales and offsets per group: on a CPU
  ``int4.Int4Linear`` (torch's own int4 kernel, bfloat16 activations; no extra package; the
  output layer in bfloat16, ``int4.Bfloat16Head``; the residual stream is not rotated: the
  rotated copy agreed with the target less), elsewhere
  ``torchao``'s int4 weight-only layers.

A copy drafts on a static cache with compiled one-token forwards (torchao's int8 layers are slower
than fp32 ones until compiled): ``specdec.copies.LowPrecisionDraft`` gives a generator the option,
and measures ``"auto"`` (``specdec/copies/``).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import sys
import warnings

import torch

from ...names import WEIGHTS
from .attention import GROUPED_SDPA, register_grouped_sdpa
from .int4 import available as int4_available
from .int4 import quantize_linears as quantize_int4
from .int8 import quantize_linears
from .lean import install as install_lean
from .rotation import mlp_outputs, rotatable, rotate_residual

QUANTIZED = ("int8", "w8a8", "int4")  # by torchao (w8a8 and int4 off the CPU)
OWN_ON_CPU = ("w8a8", "int4")  # on a CPU, specdec's own layers (int8.py, int4.py)
EAGER_ONLY = ("dynamic_int8",)  # copies whose layers torch.compile cannot trace (packed weights)


def check_weights(weights: str, who: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"{who}: weights must be one of {WEIGHTS}, got {weights!r}")


def resolve_weights(model, weights: str) -> str:
    """``weights``, with ``"auto"`` made concrete for ``model``'s device."""
    check_weights(weights, "a low-precision copy")
    if weights != "auto":
        return weights
    return "w8a8" if next(model.parameters()).device.type == "cpu" else "bfloat16"


def check_copyable(model) -> None:
    """A ValueError where no copy of ``model`` at any precision could draft (a vision-language model)."""
    if getattr(model.config, "vision_config", None) is not None or hasattr(model, "get_rope_index"):
        raise ValueError(f"a low-precision draft copy needs a text-only model; {type(model).__name__} is a "
                         "vision-language model (pass a text draft model instead)")


def build_copy(model, weights: str):
    """A copy of ``model`` with ``weights`` precision that runs a forward; ``model`` is only read."""
    weights = resolve_weights(model, weights)
    check_copyable(model)
    return _running(_built_copy(model, weights), weights, model)


def _running(draft, weights: str, model):
    """``draft``, once one two-token forward of it has run: a model's own code may read what the copy
    replaced (an MoE router's ``.weight`` of a layer that is now an int8 one), and that fails here
    with a ValueError naming the copy, not at the first draft inside a call."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    try:
        with torch.inference_mode():
            draft(input_ids=ids, use_cache=False)
    except Exception as exc:
        raise ValueError(f"a {weights} copy of {type(model).__name__} does not run ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:160]}): the model's code reads a layer the copy changed; "
                         "choose other weights= or another draft") from exc
    return draft


def _built_copy(model, weights: str):
    on_cpu = next(model.parameters()).device.type == "cpu"
    if weights in QUANTIZED and not (weights in OWN_ON_CPU and on_cpu):
        quantize, config = _torchao(weights)
    if weights == "dynamic_int8" and not on_cpu:
        raise ValueError("weights='dynamic_int8' (torch's quantize_dynamic) runs on a CPU only")
    dtype = next(model.parameters()).dtype
    if weights == "dynamic_int8" and dtype != torch.float32:
        raise ValueError(f"weights='dynamic_int8' (torch's quantize_dynamic) takes float32 activations; the target "
                         f"is {str(dtype).removeprefix('torch.')}: choose w8a8, int4 or bfloat16")
    draft = _plain_copy(model)
    if weights == "dynamic_int8":
        return _dynamic_int8(draft).eval()
    if weights == "w8a8" and on_cpu:  # int8 x uint8 products, the model's dtype elsewhere (int8.py)
        # a rotated residual stream is easier to quantize (rotation.py), where the layout allows
        if rotatable(draft) is None and not rotate_residual(draft, reference=model):
            draft = _plain_copy(model)  # the rotated copy failed its check: it is spoilt
        quantize_linears(draft, rotate=mlp_outputs(draft)).eval()  # the MLP's output layers read rotated inputs
        install_lean(draft)  # its eager steps in few operations (lean.py), where the layout allows
        return draft
    if weights == "int4" and on_cpu:  # int4 weights, bfloat16 activations (int4.py)
        if not int4_available():
            raise RuntimeError(f"weights='int4' on a CPU needs torch's CPU int4 kernel, which torch {torch.__version__} lacks")
        quantize_int4(draft).eval()
        install_lean(draft)
        return draft
    if weights != "w8a8":
        draft.to(torch.float16 if weights == "float16" else torch.bfloat16)
    if weights in QUANTIZED:
        quantize(draft, config)
    return draft.eval()


def _dynamic_int8(draft):
    """``draft`` (a copy) with its linear layers replaced by torch's dynamically quantized ones:
    int8 weights per output channel, activations quantized on the fly (fbgemm)."""
    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao, and still works
        warnings.simplefilter("ignore")
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        return quantize_dynamic(draft, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8,
                                inplace=True)


def _plain_copy(model):
    from ..llama_cpp.files import ATTACHED, PACKAGED

    draft = copy.deepcopy(model)
    for name in (ATTACHED, PACKAGED):  # the copy's weights are not the file's: llama.cpp never serves it
        draft.__dict__.pop(name, None)
    for module in draft.modules():  # the target's hooks are its user's, who may remove them; the copy runs none
        for hooks in (module._forward_hooks, module._forward_pre_hooks, module._forward_hooks_with_kwargs,
                      module._forward_hooks_always_called, module._forward_pre_hooks_with_kwargs):
            hooks.clear()
        module.__dict__.pop("_output_capturing_hooks_installed", None)  # transformers installs its own again
    if getattr(draft.config, "_attn_implementation", None) == "sdpa":
        register_grouped_sdpa()
        draft.set_attn_implementation(GROUPED_SDPA)  # the copy's config only: the model keeps its own
    return draft


#: what importing torchao says on a machine without its optional GPU kernels (harmless, and not the user's concern)
_IMPORT_NOISE = ("Failed to load", "register_constant() on Enum subclasses is deprecated")


#: the torchao modules imported when transformers loads a model (its torchao quantizer's imports)
_TORCHAO_ON_LOAD = ("torchao", "torchao.prototype.safetensors.safetensors_support")


class _ImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(noise in record.getMessage() for noise in _IMPORT_NOISE)


def import_torchao_quietly() -> None:
    """Import torchao, where installed, without the messages it logs on import (its GPU-only
    kernels that a CPU build cannot load, torch's notice about its enums). transformers imports it
    with its modeling code, so a command calls this before loading a model; any other message, and
    any error, still shows."""
    if "torchao" in sys.modules or importlib.util.find_spec("torchao") is None:
        return
    noise = _ImportNoise()
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    for logger in loggers:
        logger.addFilter(noise)
    try:
        for module in _TORCHAO_ON_LOAD:
            importlib.import_module(module)
    except Exception:  # a broken install is reported where torchao is used
        pass
    finally:
        for logger in loggers:
            logger.removeFilter(noise)


def _torchao(weights: str):
    import_torchao_quietly()
    try:
        from torchao.quantization import (Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                                          Int8WeightOnlyConfig, quantize_)
    except ImportError as exc:
        raise ImportError(f"a draft copy with weights={weights!r} needs torchao: pip install \"specdec[quant]\" "
                          "(or use weights='bfloat16', which needs no extra package)") from exc
    configs = {"int8": Int8WeightOnlyConfig, "w8a8": Int8DynamicActivationInt8WeightConfig,
               "int4": Int4WeightOnlyConfig}
    return quantize_, configs[weights]()
