"""The de-quantized weight cache: a packaged GGUF model, de-quantized once, kept as a checkpoint.

De-quantizing a GGUF file is slow (README.md, "Models without a network"), so the first load
writes the result as a plain ``safetensors`` checkpoint (with its config and tokenizer) and later
loads read that instead. Invariants:

* one folder per source file (path, size, modification time), dtype and version of
  ``transformers`` and ``gguf`` (the de-quantizers): any change makes a new key, never a stale load;
* a folder is complete only with its marker file, written last, after the saved copy has loaded
  back to identical weights, config, generation config and tokenizer; the marker records the
  size and SHA-256 of every file in the folder;
* nothing in a folder is trusted unverified: a load hashes every file and compares it with the
  marker (:func:`folder_problem`; again in the same process only where a file's size, inode or
  modification time changed), and loads the tokenizer strictly. A folder that fails (a
  flipped byte, an edited config, a damaged tokenizer, a file added or missing, no marker or one
  from before the digests) is removed with a warning naming the file, and the caller
  de-quantizes again and rewrites it (:func:`load_cached`). Hashing SmolLM2-135M's 540 MB takes
  0.3-0.6 s (SHA-256, the fastest of hashlib's here: BLAKE2b 0.45 s where SHA-256 took 0.33 s; on
  the project's busy 2-core machine), of a verified load of 0.9 s from a warm page cache and
  seconds from a cold one; against minutes of decoding that is cheap enough to run on every load,
  where a size and modification time would miss bytes changed in place with the time kept;
* a folder appears whole or not at all (written beside it, then renamed into place; one left at
  the name without a valid marker is replaced), and any failure (a full disk, a read-only home)
  only warns: loading never depends on the cache.

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
#: the file that marks a cache folder complete (written last), with the digest of every other file
CACHE_MARKER = "specdec-weight-cache.json"
_CACHE_FORMAT = 1  # of the folder's key: the folders themselves are unchanged
_MARKER_FORMAT = 2  # 2: the size and SHA-256 of every file; 1 (none): unverifiable, rebuilt once

#: ``load(folder, dtype) -> (model, tokenizer)``: how a checkpoint folder is read back
Loader = Callable[[Path, torch.dtype], tuple]


def cache_home() -> Path:
    """specdec's cache folder: ``$SPECDEC_CACHE``, or ``~/.cache/specdec``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "specdec"))


def weight_cache_root() -> Path | None:
    """Where de-quantized packaged models are cached, or None when ``SPECDEC_NO_WEIGHT_CACHE`` is set."""
    if os.environ.get(NO_WEIGHT_CACHE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return None
    return cache_home() / "weights"


def cache_folder(name: str, source: str, dtype: torch.dtype) -> Path | None:
    """The cache folder of model ``name`` de-quantized from file ``source`` to ``dtype``, or None
    when the cache is off."""
    root = weight_cache_root()
    if root is None:
        return None
    return root / f"{name}-{_cache_key(name, source, dtype)[:16]}"


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` has a marker listing its files' digests (cheap: nothing is hashed; a load
    verifies them, :func:`folder_problem`)."""
    return _marker_files(folder) is not None


def _marker_files(folder: Path) -> dict | None:
    """``{relative path: {"bytes": n, "sha256": hex}}`` as the marker of ``folder`` records them,
    or None where it has no marker, or one this format cannot read."""
    try:
        data = json.loads((folder / CACHE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) and data.get("format") == _MARKER_FORMAT else None
    if not isinstance(files, dict) or not files or not all(
            isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)
            for entry in files.values()):
        return None
    return files


def _digest(path: Path) -> str:
    digest = hashlib.sha256()  # chunked by hand: hashlib.file_digest needs Python 3.11, the package 3.10
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    """Every file under ``folder`` but the marker, as paths relative to it (sorted)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != CACHE_MARKER)


def file_digests(folder: Path) -> dict[str, dict]:
    """What the marker records of ``folder``: ``{relative path: {"bytes": n, "sha256": hex}}``."""
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": _digest(folder / name)}
            for name in _files(folder)}


#: folder -> the stat of every file (marker included) when the process last found it as written: a
#: folder loaded again, unchanged since, is not hashed again (a rank's second check, a second load)
_VERIFIED: dict[str, tuple] = {}


def _stats(folder: Path) -> tuple:
    return tuple((str(p.relative_to(folder)), st.st_ino, st.st_size, st.st_mtime_ns)
                 for p in sorted(folder.rglob("*")) if p.is_file() for st in (p.stat(),))


def folder_problem(folder: Path) -> str | None:
    """Why cache folder ``folder`` cannot be trusted, naming the file, or None when every file is
    as written (size and SHA-256, as its marker records them) and none was added. A folder this
    process verified is hashed again only when a file's size, inode or modification time changed."""
    marker = folder / CACHE_MARKER
    if not marker.is_file():
        return f"{marker} is missing (the folder was never completed)"
    try:
        seen = _stats(folder)
    except OSError as exc:  # a file removed while listed
        return f"{folder} changed while it was read ({exc})"
    if _VERIFIED.get(str(folder)) == seen:
        return None
    problem = _hashed_problem(folder, marker)
    if problem is None:
        _VERIFIED[str(folder)] = seen
    else:
        _VERIFIED.pop(str(folder), None)
    return problem


def _hashed_problem(folder: Path, marker: Path) -> str | None:
    files = _marker_files(folder)
    if files is None:
        return f"{marker} lists no file digests (damaged, or written by an older specdec)"
    for name in _files(folder):
        if name not in files:
            return f"{folder / name} was not written with the cache"
    for name, entry in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{path} has {size} bytes, {entry['bytes']} when it was written"
        if _digest(path) != entry["sha256"]:
            return f"{path} differs from what was written (its SHA-256)"
    return None


def load_cached(name: str, cache: Path, dtype: torch.dtype, load: Loader) -> tuple | None:
    """``(model, tokenizer)`` of model ``name`` from cache folder ``cache``, verified first
    (:func:`folder_problem`); ``load`` must raise where the tokenizer does not load. None where
    there is no folder, or where it cannot be trusted: then it is removed, with a warning naming
    the file, for the caller to de-quantize again and rewrite."""
    if not cache.exists():
        return None
    problem = folder_problem(cache)
    if problem is None:
        try:
            model, tokenizer = load(cache, dtype)
            if tokenizer is not None:
                return model, tokenizer
            problem = f"the tokenizer in {cache} did not load"
        except Exception as exc:  # verified, yet unreadable (another transformers): rebuild all the same
            problem = f"{cache} did not load ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]})"
    warnings.warn(f"specdec: the cached weights of {name} cannot be used: {problem}; de-quantizing {name} "
                  f"again and rewriting the cache", stacklevel=3)
    remove(cache)
    return None


def remove(folder: Path) -> None:
    if folder.is_symlink():  # a cache linked in from another root (benchmarks/first_call.py): the link only
        folder.unlink(missing_ok=True)
        return
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
        marker = {"format": _MARKER_FORMAT, "model": name, "dtype": str(dtype), "files": file_digests(tmp)}
        (tmp / CACHE_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        try:
            os.rename(tmp, cache)
        except OSError:
            if is_complete(cache):  # another process cached it first
                return
            # a folder left at the name without a valid marker never completes by itself (a folder
            # is renamed into place with its marker): replace it, or every load de-quantizes again
            remove(cache)
            os.rename(tmp, cache)
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
