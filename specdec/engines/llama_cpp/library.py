"""The llama.cpp library through ``llama-cpp-python``'s C bindings: loading, contexts, one decode.

Only this module touches ``llama_cpp``. It keeps, for the process:

* each GGUF file's loaded model (its weights are mapped once, whatever the number of calls);
* idle contexts, by (file, sequences, threads, KV type), cleared and handed to the next call
  that fits, since making one allocates its KV buffer and plans its graph;
* whether the build has AMX kernels, whose weight buffers this version crashes in (:func:`model_params`);
* whether the build is batch-invariant (:func:`check_batch_invariant`): a forward of several
  tokens gives each the logits a one-token forward gives it, bit for bit. Speculation is exact
  only then, so a build that fails it is refused, naming the build flag.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

#: what ``pip`` must be told to build the extra: llamafile's matrix kernels take a different
#: summation order for several tokens than the one-token kernel does (docs/engines.md)
BUILD_FLAGS = "-DGGML_LLAMAFILE=OFF"
#: how to install it (from source: PyPI has no wheel; --no-cache-dir keeps pip from reusing a wheel built without the flag)
INSTALL_HINT = f'CMAKE_ARGS="{BUILD_FLAGS}" pip install --no-cache-dir llama-cpp-python==0.3.36'
#: tokens per decode after the prefill: llama.cpp's CPU flash-attention kernel tiles its queries from 64
#: on, in another summation order. Flash attention is off here, so nothing depends on it today; the
#: split keeps that so if it is turned on, and costs nothing at verification widths
QUERY_TILE = 63
GGML_LOG_LEVEL_ERROR = 4  # ggml.h's enum ggml_log_level

_lock = threading.Lock()
_models: dict[str, "LoadedModel"] = {}
_idle: dict[tuple, list] = {}
_invariant: dict[str, bool] = {}
_log_callback = None
_amx: bool | None = None
_load_lock = threading.Lock()  # the loads that swap llama-cpp-python's default model parameters


def bindings():
    """The ``llama_cpp`` module, initialised once, its log kept to errors; a clear ImportError without it."""
    global _log_callback, _amx
    try:
        import llama_cpp
    except ImportError:
        raise ImportError("engine='llama_cpp' needs llama-cpp-python, built batch-invariant: " + INSTALL_HINT) from None
    with _lock:
        if _log_callback is None:
            def drop(level, text, user_data):  # llama.cpp logs every load and context at length
                if level == GGML_LOG_LEVEL_ERROR and text:
                    os.write(2, text)
            _log_callback = llama_cpp.llama_log_callback(drop)
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _amx = b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()
    return llama_cpp


def model_params():
    """``llama_model_params`` for loading a file: llama.cpp's defaults, except that a build with
    AMX kernels (compiled for a CPU that has AMX, as ``GGML_NATIVE`` does on a Xeon since Sapphire
    Rapids) loads without its extra buffer types. With them, quantized weights go to the AMX
    buffer, whose first decode crashed the process on such a Xeon (a segmentation fault in this
    version; ggml-org/llama.cpp#20824, and #16315 on wrong Q4_0/Q4_1 outputs there); without them
    they run on the CPU backend's own kernels. F32 weights never go there, so the engine's F32
    target is the same either way."""
    lib = bindings()
    params = lib.llama_model_default_params()
    if has_amx():
        params.use_extra_bufts = False
    return params


def has_amx() -> bool:
    """Whether this build of llama.cpp runs AMX kernels on this CPU."""
    bindings()
    return _amx


@contextlib.contextmanager
def loading_with_model_params():
    """Inside: llama-cpp-python's ``Llama(...)`` loads with :func:`model_params` (it builds its
    own from llama.cpp's defaults and takes no argument for the buffer types)."""
    from llama_cpp import llama as high_level

    module = high_level.llama_cpp
    with _load_lock:
        default = module.llama_model_default_params
        module.llama_model_default_params = model_params
        try:
            yield
        finally:
            module.llama_model_default_params = default


def version() -> str:
    return getattr(bindings(), "__version__", "?")


@dataclass
class LoadedModel:
    path: str
    handle: object
    vocab: int  # logits per token
    train_context: int

    def __del__(self):  # pragma: no cover - at exit
        try:
            bindings().llama_model_free(self.handle)
        except Exception:
            pass


def load(path: str) -> LoadedModel:
    """The model in GGUF file ``path``, loaded once per process."""
    path = os.path.abspath(path)
    lib, params = bindings(), model_params()
    with _lock:
        found = _models.get(path)
        if found is None:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no GGUF file at {path}")
            handle = lib.llama_model_load_from_file(path.encode(), params)
            if not handle:
                raise ValueError(f"llama.cpp could not load {path} (not a GGUF file, or an architecture it lacks)")
            vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(handle))
            found = _models[path] = LoadedModel(path, handle, int(vocab), int(lib.llama_model_n_ctx_train(handle)))
    return found


class Context:
    """One llama.cpp context: ``sequences`` rows, ``size`` KV cells shared by them, ``threads``."""

    def __init__(self, model: LoadedModel, sequences: int, size: int, threads: int, kv_type: str):
        lib = bindings()
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = size
        params.n_ubatch = min(size, 512)
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        kind = lib.GGML_TYPE_F32 if kv_type == "f32" else lib.GGML_TYPE_F16
        params.type_k = params.type_v = kind
        # a stream of cells per row: a row's token at position p sits in cell p, as when it decodes alone
        params.kv_unified = False
        # attention as llama-cpp-python's Llama runs it by default (no flash attention): on the CPU its
        # outputs agreed with transformers' more often than flash attention's, and it is batch-invariant too
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        self.handle = lib.llama_init_from_model(model.handle, params)
        if not self.handle:
            raise RuntimeError(f"llama.cpp could not make a context of {size} cells for {model.path}")
        self.model, self.sequences, self.size, self.threads, self.kv_type = model, sequences, size, threads, kv_type
        self.memory = lib.llama_get_memory(self.handle)
        self._batch, self._batch_size = None, 0

    @property
    def key(self) -> tuple:
        return (self.model.path, self.sequences, self.threads, self.kv_type)

    def remove(self, sequence: int, start: int) -> None:
        """Drop sequence ``sequence``'s tokens at positions ``start`` and after (all: ``start`` 0)."""
        bindings().llama_memory_seq_rm(self.memory, sequence, max(int(start), 0), -1)

    def decode(self, tokens: list[int], positions: list[int], sequences: list[int], wanted: list[bool],
               split: int | None = None) -> torch.Tensor:
        """Feed the tokens (one per entry) -> float32 logits ``[sum(wanted), vocab]``, in entry order.
        ``split`` feeds them in decodes of at most that many tokens (each decode's logits read before
        the next)."""
        lib = bindings()
        count = len(tokens)
        step = split or count
        out = []
        for lo in range(0, count, step):
            hi = min(lo + step, count)
            batch = self._batch_for(hi - lo)
            outputs = 0
            for i in range(lo, hi):
                j = i - lo
                batch.token[j], batch.pos[j] = tokens[i], positions[i]
                batch.n_seq_id[j], batch.seq_id[j][0] = 1, sequences[i]
                batch.logits[j] = 1 if wanted[i] else 0
                outputs += bool(wanted[i])
            batch.n_tokens = hi - lo
            status = lib.llama_decode(self.handle, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode failed (status {status}) feeding {hi - lo} tokens into a context of "
                                   f"{self.size} cells")
            if outputs:
                view = np.ctypeslib.as_array(lib.llama_get_logits(self.handle), shape=(outputs, self.model.vocab))
                out.append(torch.from_numpy(view.copy()))
        return torch.cat(out) if out else torch.empty(0, self.model.vocab)

    def _batch_for(self, count: int):
        if count > self._batch_size:
            lib = bindings()
            if self._batch is not None:
                lib.llama_batch_free(self._batch)
            self._batch, self._batch_size = lib.llama_batch_init(max(count, 64), 0, 1), max(count, 64)
        return self._batch

    def clear(self) -> None:
        bindings().llama_memory_clear(self.memory, True)

    def free(self) -> None:
        lib = bindings()
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self.handle:
            lib.llama_free(self.handle)
            self.handle = None


def context(path: str, sequences: int, size: int, threads: int, kv_type: str = "f32") -> Context:
    """A cleared context for ``sequences`` rows with at least ``size`` cells: an idle one that fits, else a new one."""
    model = load(path)
    size = -(-max(int(size), 64) // 256) * 256
    key = (model.path, sequences, threads, kv_type)
    with _lock:
        idle = _idle.get(key, [])
        fits = [c for c in idle if c.size >= size]
        if fits:
            chosen = min(fits, key=lambda c: c.size)
            idle.remove(chosen)
            return chosen
    return Context(model, sequences, size, threads, kv_type)


def give_back(ctx: Context) -> None:
    """A call is over with ``ctx``: cleared, kept for the next call (the largest two per key)."""
    ctx.clear()
    with _lock:
        idle = _idle.setdefault(ctx.key, [])
        idle.append(ctx)
        idle.sort(key=lambda c: -c.size)
        extra = idle[2:]
        del idle[2:]
    for spare in extra:
        spare.free()


def check_batch_invariant(path: str, threads: int, kv_type: str = "f32") -> None:
    """Refuse a build whose forward of several tokens gives any of them other logits than a forward
    of that token alone (checked once per file and KV type: 8 tokens after a 60-token prefix)."""
    key = f"{os.path.abspath(path)}|{kv_type}"
    if _invariant.get(key):
        return
    ctx = context(path, 1, 128, threads, kv_type)
    try:
        vocab = ctx.model.vocab
        # a prefix of 60 tokens, then 8 at once: the attended cells cross a multiple of 64
        prefix = [(7 * i + 3) % vocab for i in range(60)]
        probe = [(11 * i + 5) % vocab for i in range(8)]
        ctx.decode(prefix, list(range(60)), [0] * 60, [False] * 60)
        wide = ctx.decode(probe, list(range(60, 68)), [0] * 8, [True] * 8)
        ctx.remove(0, 60)
        for j, token in enumerate(probe):
            one = ctx.decode([token], [60 + j], [0], [True])[0]
            if not torch.equal(one, wide[j]):
                raise RuntimeError(
                    f"this llama.cpp build is not batch-invariant: a {len(probe)}-token forward gave token {j} logits "
                    f"that differ from a one-token forward's by up to {float((one - wide[j]).abs().max()):.3g}, so "
                    f"verified drafts could change the output. Rebuild it with {BUILD_FLAGS}: {INSTALL_HINT}")
        _invariant[key] = True
    finally:
        give_back(ctx)
