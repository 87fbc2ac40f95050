"""The de-quantized weight cache: a packaged GGUF model, de-quantized once, kept as a checkpoint.

De-quantizing a GGUF file is slow (README.md, "Models without a network"), so the first load
writes the result as a plain ``safetensors`` checkpoint (with its config and tokenizer) and later
loads read that instead. Invariants:

* one folder per source file (path, size, modification time), dtype and version of
  ``transformers`` and ``gguf`` (the de-quantizers): any change makes a new key, never a stale load;
* a folder is complete only with its marker file, written last, after the saved copy has loaded
  back to identical weights, config, generation config and tokenizer;
* a folder appears whole or not at all (written beside it, then renamed into place), and any
  failure (a full disk, a read-only home) only warns: loading never depends on the cache.

Where: ``$SPECDEC_CACHE/weights`` or ``~/.cache/specdec/weights``; ``SPECDEC_NO_WEIGHT_CACHE=1``
turns the cache off. This module knows nothing of packaged models: :mod:`specdec.models` passes
the source file and the function that loads a checkpoint folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch

NO_WEIGHT_CACHE_ENV = "SPECDEC_NO_WEIGHT_CACHE"
CACHE_DIR_ENV = "SPECDEC_CACHE"
#: the file that marks a cache folder complete (written last)
CACHE_MARKER = "specdec-weight-cache.json"
_CACHE_FORMAT = 1

#: ``load(folder, dtype) -> (model, tokenizer)``: how a checkpoint folder is read back
Loader = Callable[[Path, torch.dtype], tuple]


def weight_cache_root() -> Path | None:
    """Where de-quantized packaged models are cached, or None when ``SPECDEC_NO_WEIGHT_CACHE`` is set."""
    if os.environ.get(NO_WEIGHT_CACHE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return None
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    return Path(root) / "weights"


def cache_folder(name: str, source: str, dtype: torch.dtype) -> Path | None:
    """The cache folder of model ``name`` de-quantized from file ``source`` to ``dtype``, or None
    when the cache is off."""
    root = weight_cache_root()
    if root is None:
        return None
    return root / f"{name}-{_cache_key(name, source, dtype)[:16]}"


def is_complete(folder: Path) -> bool:
    return (folder / CACHE_MARKER).is_file()


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _cache_key(name: str, source: str, dtype: torch.dtype) -> str:
    from importlib.metadata import PackageNotFoundError, version

    path = os.path.realpath(source)
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


def write_weight_cache(name: str, model, tokenizer, cache: Path, dtype: torch.dtype, load: Loader) -> None:
    """Save ``model`` and ``tokenizer`` to ``cache`` as a plain checkpoint, atomically (a temporary
    folder beside it, renamed into place), and only if ``load`` reads it back identical. Any failure
    leaves no cache and only warns."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and getattr(quantizer, "packed_modules", None):
        return  # weights kept packed by a GGUF kernel: nothing de-quantized to cache
    tmp = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", suffix=".tmp", dir=cache.parent))
        _save(model, tokenizer, tmp)
        problem = _round_trip_problem(model, tokenizer, *load(tmp, dtype))
        if problem:
            warnings.warn(f"specdec: not caching {name}'s weights: the saved copy differs ({problem})", stacklevel=4)
            return
        (tmp / CACHE_MARKER).write_text(json.dumps({"model": name, "dtype": str(dtype)}) + "\n")
        try:
            os.rename(tmp, cache)
        except OSError:  # another process cached it first
            if not is_complete(cache):
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
            remove(tmp)


def _save(model, tokenizer, folder: Path) -> None:
    """``save_pretrained`` of a model loaded through the GGUF quantizer, whose weights are plain now:
    the quantizer and its config are set aside for the save and put back after."""
    quantizer = getattr(model, "hf_quantizer", None)
    config = model.config
    quant_config = config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None  # save_pretrained refuses a model loaded through the GGUF quantizer
    try:
        model.save_pretrained(folder)
    finally:
        model.hf_quantizer = quantizer
        if quant_config is not None:
            config.quantization_config = quant_config
    tokenizer.save_pretrained(folder)


def _round_trip_problem(model, tokenizer, loaded, loaded_tok) -> str | None:
    """What differs between ``model``/``tokenizer`` and their saved copy ``loaded``/``loaded_tok``, or None."""
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
    return _tokenizer_difference(tokenizer, loaded_tok)


def _tokenizer_difference(tokenizer, loaded_tok) -> str | None:
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
