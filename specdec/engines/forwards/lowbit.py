"""Draft models at lower precision: a copy of a model with fewer bytes per weight.

Decoding a small model on a CPU is bound by reading its weights, so a copy with fewer bytes per
weight steps faster and agrees with the model it was built from almost always. ``self_draft``
builds one from the target; ``draft_model`` and ``cross_tokenizer`` build one from their draft
model when given ``weights=``. The model a copy is built from is never modified.

``weights``:

* ``"auto"``: for a model on a CPU, the copy measured best on this machine (:class:`Copies`
  asks ``choose.py``, within a time budget; :func:`build_copy` alone, which measures nothing,
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
than fp32 ones until compiled): :class:`LowPrecisionDraft` gives a generator the option.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import sys
import threading
import time
import warnings
import weakref

import torch

from ..compiled import check_compile_options, compiles_now
from ..names import WEIGHTS
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


def _device(model) -> str:
    return next(model.parameters()).device.type


def build_copy(model, weights: str):
    """A copy of ``model`` with ``weights`` precision; ``model`` is only read."""
    weights = resolve_weights(model, weights)
    if getattr(model.config, "vision_config", None) is not None or hasattr(model, "get_rope_index"):
        raise ValueError(f"a low-precision draft copy needs a text-only model; {type(model).__name__} is a "
                         "vision-language model (pass a text draft model instead)")
    on_cpu = next(model.parameters()).device.type == "cpu"
    if weights in QUANTIZED and not (weights in OWN_ON_CPU and on_cpu):
        quantize, config = _torchao(weights)
    if weights == "dynamic_int8" and not on_cpu:
        raise ValueError("weights='dynamic_int8' (torch's quantize_dynamic) runs on a CPU only")
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
    draft = copy.deepcopy(model)
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


class Copies:
    """The copies one configured generator built, per (model, weights); shared by its sessions."""

    def __init__(self):
        self._made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {weights: copy}
        self._choices: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> what "auto" chose
        self._lock = threading.Lock()

    def get(self, model, weights: str, prompt=None, draft_cache=None, tokenizer=None, budget: float | None = None,
            progress: bool | None = None):
        """The copy of ``model`` at ``weights``, built on first use. ``"auto"`` on a CPU is the copy
        measured best on this machine (``choose.py``), the first time for this machine and model
        (then remembered on disk), on a calibration text encoded by ``tokenizer`` or the model's own
        tokenizer where one is stored beside it, else on ``prompt`` (the call's first prompt row),
        within ``budget`` seconds (``choose.budget_seconds``), a progress bar as ``progress`` says."""
        with self._lock:
            made = self._made.setdefault(model, {})
            if weights not in made:
                made[weights] = self._build(model, weights, prompt, draft_cache, made, tokenizer, budget, progress)
            return made[weights]

    def _build(self, model, weights: str, prompt, draft_cache, made: dict, tokenizer, budget=None, progress=None):
        if weights == "auto" and _device(model) == "cpu":
            from . import choose

            device = next(model.parameters()).device
            sample = lambda: choose.calibration_ids(tokenizer, prompt, device, model=model)  # noqa: E731  only when measuring
            self._choices[model], built = choose.choose(model, sample, build_copy, draft_cache, budget=budget,
                                                        progress=progress)
            made.update(built)
            weights = self._choices[model].weights
        weights = resolve_weights(model, weights)
        if weights not in made:
            made[weights] = build_copy(model, weights)
        return made[weights]

    def choice(self, model):
        """What ``"auto"`` chose for ``model`` (a :class:`~specdec.forwards.choose.Choice`), or None."""
        return self._choices.get(model)


class LowPrecisionDraft:
    """A generator whose draft may run as a low-precision copy of itself (``weights=``), built
    once per configured generator (its sessions share it) and stepped on a static cache, compiled
    as ``compile_draft`` says: True (compile on first use, said on stderr), False (eager), a dict
    of ``torch.compile`` options, or ``"auto"`` (the default for a copy): compiled in
    ``SpecDecoder.warmup()`` and in the calls after one, eager otherwise, so that no call compiles
    for minutes unasked."""

    def _init_precision(self, weights: str | None, compile_draft: bool | dict | str | None) -> None:
        if weights is not None:
            check_weights(weights, type(self).name or type(self).__name__)
        if compile_draft is not None and compile_draft != "auto" and not isinstance(compile_draft, (bool, dict)):
            raise TypeError(f"compile_draft must be True, False, 'auto' or a dict of torch.compile options, "
                            f"got {compile_draft!r}")
        if isinstance(compile_draft, dict):
            check_compile_options(compile_draft, "compile_draft")
        self.weights = weights
        self.compile_draft = ("auto" if weights is not None else False) if compile_draft is None else compile_draft
        self._copies = Copies()
        # how "auto" measures, where a generator offers them (self_draft): the time budget (None: the
        # default, choose.budget_seconds) and the progress bar (None: where stderr is a terminal)
        self.choice_budget: float | None = None
        self.choice_progress: bool | None = None

    def session(self):
        fresh = super().session()
        fresh._copies = self._copies  # a copy is built once per decoder, not per call
        return fresh

    def drafting_model(self, model, ctx=None):
        """The model that drafts for ``model``: itself, or its copy at ``self.weights`` (``"auto"``:
        the copy measured best here, on a calibration text ``ctx``'s tokenizer, or the model's own,
        encodes, else on the call's first prompt row). The seconds spent building or choosing it now
        are reported."""
        if self.weights is None:
            self._model = model
            return model
        started = time.perf_counter()
        prompt = None if ctx is None else ctx.tokens[0, : int(ctx.lengths[0])]
        draft = self._copies.get(model, self.weights, prompt, draft_cache=self._timing_cache(),
                                 tokenizer=None if ctx is None else ctx.tokenizer,
                                 budget=self.choice_budget, progress=self.choice_progress)
        self._model = draft
        self._setup_seconds = getattr(self, "_setup_seconds", 0.0) + time.perf_counter() - started
        chosen = self._copies.choice(model)
        self.resolved_weights = chosen.weights if self.weights == "auto" and chosen else resolve_weights(
            model, self.weights)
        self._choice = chosen if self.weights == "auto" else None
        return draft

    def report(self) -> dict:
        return {**super().report(), **self.precision_report()}

    def _timing_cache(self):
        """The cache a copy's draft step is timed on when choosing: the kind it drafts on, eagerly."""
        from ..kv import CacheSettings

        return CacheSettings.make("static") if self.weights is not None else None

    def precision_report(self) -> dict:
        """What the call's ``stats`` should say of the copy: its precision (and, for ``"auto"``, why)
        and the seconds spent building or choosing it in this call."""
        if self.weights is None:
            return {}
        out = {"setup_seconds": getattr(self, "_setup_seconds", 0.0),
               "weights": getattr(self, "resolved_weights", self.weights)}
        if getattr(self, "_choice", None) is not None:
            out["weights_choice"] = self._choice.reason
        return out

    def precision_attach_options(self, widths: tuple[int, ...] = (1, 2)) -> dict:
        """How the drafting model keeps its cache: a copy's on a static cache, stepped compiled
        (``compile_draft``) at ``widths`` (what it feeds a step: a draft, or the target's token
        after the last draft; wider forwards run eagerly, which for a quantized copy costs about
        what the model itself does); the model as given, the call's own unless ``compile_draft``.
        A copy is this generator's own (built by it, changed by nothing), so its compiled steps
        skip dynamo's guards on its modules."""
        if self.weights is None and not self.compile_draft:
            return {}
        compiles = self.compile_draft
        if compiles == "auto":  # after (or in) a warm-up only: never a silent compile in a call
            compiles = getattr(self, "_model", None) is not None and compiles_now(self._model)
        compiles = compiles if getattr(self, "resolved_weights", None) not in EAGER_ONLY else False
        return {"cache_implementation": "static", "compile": compiles, "compile_widths": widths,
                "owned": self.weights is not None}
