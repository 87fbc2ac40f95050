"""The ``llama_cpp`` engine: a model's forwards run by llama.cpp on a GGUF file of its weights.

``SpecDecoder(target, draft, engine="llama_cpp")`` runs the target's forwards (prefill and every
verification) in llama.cpp through ``llama-cpp-python``, built batch-invariant
(:data:`~.library.BUILD_FLAGS`); every generator that proposes from tokens (prompt lookup, suffix,
a draft model's own forwards on their engine), every processor, grammar and the draft-length
policy run on top unchanged. Its promise: output identical to llama.cpp's own plain decoding of
the same file (one token per forward). Whether that equals ``target.generate`` is measured, not
assumed (docs/engines.md), so ``engine="auto"`` never picks it.

Modules: :mod:`.library` (the bindings, contexts, the batch-invariance check), :mod:`.files`
(which GGUF file serves a model), :mod:`.kv` (the engine as ``ModelState``'s cache backend).
"""

from .files import QUANTS, attach_gguf, export_gguf, gguf_for, gguf_source, gguf_twin, missing_gguf, requantize
from .kv import LlamaCppKV

__all__ = ["LlamaCppKV", "QUANTS", "attach_gguf", "export_gguf", "gguf_for", "gguf_source", "gguf_twin", "missing_gguf", "requantize"]
