"""specdec: lossless speculative decoding for Hugging Face transformers causal LMs.

The public names below are imported on first use (PEP 562's module ``__getattr__``), not with the
package: ``import specdec.cli`` (the ``specdec`` command) then costs no ``torch`` or
``transformers`` import, which a command such as ``specdec --help`` never needs and which takes
seconds on a busy machine. ``from specdec import SpecDecoder`` and ``specdec.generate`` work as
with eager imports.
"""

from __future__ import annotations

import importlib

#: public name -> the submodule that defines it
_EXPORTS = {
    "cache_pool_limit": "cache_pool", "pooled_bytes": "cache_pool", "release_caches": "cache_pool",
    "set_cache_pool_limit": "cache_pool",
    "SpecDecoder": "decoder", "SpecOutput": "decoder",
    "CandidateGenerator": "generators", "DecodeContext": "generators", "DraftLengthSchedule": "generators",
    "Feedback": "generators", "NoDraft": "generators", "Proposal": "generators",
    "Grammar": "grammar",
    "generate": "integration",
    "AcceptanceStats": "metrics", "theoretical_speedup": "metrics",
    "load_model": "models",
    "available_generators": "registry", "get_candidate_generator": "registry",
    "register_candidate_generator": "registry",
    "SamplingParams": "sampling",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
