"""The choice ``weights="auto"`` made (``choose.py``), kept on disk: its key and its file.

One JSON file per machine and model under the weight cache root (``specdec.weight_cache``):
``<root>/auto-weights/<key>.json``. Invariants:

* the key is the machine's (CPU model, core count, torch's CPU capability, instruction-set caps
  set in the environment, torch's and torchao's versions) and the model's (class, config less the
  entries that say where it was loaded from, parameter count, dtype, a digest of a sample of every
  weight), and nothing of how the model was called: not the thread count (the command line sets
  it from the cores idle at the moment, and measured again under another key for it), nor the
  folder it was read from (a GGUF package's on a first load, the weight cache's after). So
  ``specdec generate`` and the API share one choice;
* a file is written whole (beside it, then renamed) with its key and a SHA-256 of its contents;
  one read back otherwise (unreadable, edited, another shape: :func:`choice_problem`) is said in a
  warning naming it and ignored, so the caller measures again and :func:`save` replaces it. No
  file on disk can make a call crash or choose a copy it did not measure.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..names import WEIGHTS

_FORMAT = 10  # 10: each candidate's target step, timed beside it; 9: the file's key and digest, the time budget; the key without threads or the model's folder; 8: the int4 copy's output layer in bfloat16; 7: agreement over the prefilled calibration tokens too; 6: the w8a8 copy rotates its MLP output layers' inputs; 5: int4 among the candidates; 4: Int8Linear quantizes to a row's own range; 3: the lean forward


def cache_key(model) -> str:
    """The machine and the model a choice holds for (see the module doc): nothing of how the model
    was called (threads) or where it was read from (its folder)."""
    return hashlib.sha256(json.dumps(dict(format=_FORMAT, machine=_machine_key(), model=_model_key(model)),
                                     sort_keys=True).encode()).hexdigest()[:24]


def _machine_key() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    from .. import machine

    try:
        torchao = version("torchao") if importlib.util.find_spec("torchao") is not None else None
    except PackageNotFoundError:
        torchao = None
    return dict(cpu=machine.cpu_model(), cores=os.cpu_count(), capability=machine.cpu_capability(),
                caps=machine.isa_caps(), torch=torch.__version__, torchao=torchao)


#: config entries that say where or how a model was loaded, not what it is
_NOT_THE_MODEL = ("_name_or_path", "transformers_version", "quantization_config", "_commit_hash")
#: elements hashed from each end of every parameter (the weights' digest samples, not reads, them)
_SAMPLE = 1024


def _model_key(model) -> dict:
    """The model's class, config (less where it was loaded from), parameter count, dtype, and a
    digest of the first and last :data:`_SAMPLE` elements of every parameter."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _NOT_THE_MODEL}
    params = list(model.parameters())
    digest = hashlib.sha256()
    with torch.no_grad():
        for p in params:
            flat = p.detach().reshape(-1)
            digest.update(repr((tuple(p.shape), str(p.dtype))).encode())
            for part in (flat[:_SAMPLE], flat[-_SAMPLE:]):
                digest.update(part.to("cpu", torch.float64).numpy().tobytes())
    return dict(model=type(model).__name__, config=hashlib.sha256(json.dumps(config, sort_keys=True, default=str)
                                                                  .encode()).hexdigest(),
                parameters=sum(p.numel() for p in params), dtype=str(params[0].dtype), weights=digest.hexdigest())


def cache_file(key: str) -> Path | None:
    """Where the choice for ``key`` is kept, or None when the weight cache is off."""
    from ..weight_cache import weight_cache_root

    root = weight_cache_root()
    return None if root is None else root / "auto-weights" / f"{key}.json"


def _contents_digest(data: dict) -> str:
    """The SHA-256 of a choice file's contents but its digest."""
    rest = {k: v for k, v in data.items() if k != "digest"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _number(value, none: bool = True) -> bool:
    if value is None:
        return none
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_CANDIDATE_FIELDS = {"weights": lambda v: isinstance(v, str), "step_seconds": _number, "agreement": _number,
                     "expected_speedup": _number, "drafts": lambda v: type(v) is int,
                     "problem": lambda v: v is None or isinstance(v, str), "steps": lambda v: type(v) is int,
                     "positions": lambda v: type(v) is int, "cut": lambda v: isinstance(v, bool),
                     "target_step_seconds": _number}


def choice_problem(data, key: str) -> str | None:
    """What is wrong with the contents ``data`` of the choice file for ``key``, or None when they
    are a choice as :func:`save` writes it: its format, its key, its digest, and every field's shape."""
    if not isinstance(data, dict):
        return f"holds a JSON {type(data).__name__}, not an object"
    if data.get("format") != _FORMAT:
        return f"has format {data.get('format')!r}, not {_FORMAT}"
    if data.get("key") != key:
        return f"is keyed {data.get('key')!r}, not {key!r}"
    if data.get("digest") != _contents_digest(data):
        return "does not match its digest (edited or damaged since it was written)"
    candidates = data.get("candidates")
    if not isinstance(candidates, list) or not candidates:
        return "has no list of candidates"
    for c in candidates:
        if not isinstance(c, dict) or set(c) != set(_CANDIDATE_FIELDS):
            return f"has a candidate that is not one: {str(c)[:80]}"
        bad = [name for name, ok in _CANDIDATE_FIELDS.items() if not ok(c[name])]
        figures = ("step_seconds", "agreement", "expected_speedup")  # a measured copy's, which its reason shows
        if c["problem"] is None and not all(_number(c[n], none=False) for n in figures):
            bad.append("/".join(figures))
        if bad:
            return f"has a candidate {c.get('weights')!r} whose {', '.join(bad)} are not of their type"
    measured = [c["weights"] for c in candidates if c["problem"] is None]
    if data.get("weights") not in measured or data["weights"] not in WEIGHTS or data["weights"] == "auto":
        return f"chose {data.get('weights')!r}, not one of the copies it measured ({', '.join(measured)})"
    if not _number(data.get("target_seconds"), none=False) or not isinstance(data.get("machine"), str):
        return "has no target_seconds or machine"
    if not _number(data.get("budget"), none=False) or not isinstance(data.get("cut_short"), bool):
        return "has no budget or cut_short"
    return None


def read(key: str) -> dict | None:
    """The choice kept for ``key`` as :func:`save` wrote it (checked: ``choose.load`` makes it a
    ``Choice``), or None where there is none; one that does not read back as written
    (:func:`choice_problem`) is said, naming the file, and ignored: the caller measures again and
    :func:`save` replaces it."""
    path = cache_file(key)
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        problem = choice_problem(data, key)
    except (OSError, ValueError) as exc:  # unreadable, or not JSON
        problem = f"cannot be read ({type(exc).__name__}: {exc})"
    if problem is None:
        return data
    warnings.warn(f"specdec: the auto-weights choice file {path} {problem}; measuring the copies again "
                  "and replacing it", stacklevel=2)
    return None


def save(key: str, choice: Any) -> None:
    """Write ``choice`` (a ``choose.Choice``) atomically, with its key and a digest of its contents; a full disk or a
    read-only home only loses the cache."""
    path = cache_file(key)
    if path is None:
        return
    data = {"format": _FORMAT, "key": key, **asdict(choice), "measured_seconds": choice.seconds}
    data["digest"] = _contents_digest(data)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass
