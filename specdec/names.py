"""Names a user types (a generator, a model, an option, a method) and what a wrong one gets back.

Every "unknown name" message in the project ends with the same hint, made here: the closest
known name (``difflib``'s default similarity cutoff) or nothing when none is close, so an
unrelated name is never answered with a random suggestion. This module imports nothing of
``specdec``, so the registry, the loader, the tiny test models and the bench schema can all
use it without an import cycle.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


# names a command line must know without importing torch: defined here once, used by the modules that own them
#: the entry-point group third-party candidate generators register under (``specdec.registry``)
ENTRY_POINT_GROUP = "specdec.candidate_generators"
#: the dtypes a model loads in, by name (``specdec.models.DTYPES`` maps them to torch's)
DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: the engines a decoder's forwards run on (``specdec.engines``)
ENGINE_CHOICES = ("auto", "cpu", "eager", "llama_cpp")
#: the weights a draft copy of the target may have (``specdec.engines.forwards.lowbit``)
WEIGHTS = ("auto", "bfloat16", "float16", "int8", "w8a8", "int4", "dynamic_int8")

class ModelNotAvailableError(RuntimeError):
    """A model name ``load_model`` cannot load: unknown, misspelt, or its package not installed."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``" Did you mean 'x'?"`` for the known name closest to ``name``, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""
