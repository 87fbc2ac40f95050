"""GGUF files for the llama.cpp engine: which file serves a model, made once and cached.

* A packaged model (``load_model("smollm2-135m")``) is de-quantized by ``transformers`` from its
  packaged GGUF file; llama.cpp's own quantizer re-writes that file as F32 (``allow_requantize``),
  which holds the same de-quantized weights, or as BF16, Q8_0 or Q4_1 for the bench's peer rows.
* Any other model is served from a file the user names with :func:`attach_gguf` (converted with
  llama.cpp's ``convert_hf_to_gguf.py``, say), or, for a Llama-architecture model, one
  :func:`export_gguf` writes (F32, no tokenizer: specdec feeds token ids).

Files are cached under ``$SPECDEC_CACHE/gguf`` (default ``~/.cache/specdec/gguf``), keyed by the
source file's path, size and time and the type asked; each is written to a temporary name and
renamed, so an interrupted conversion leaves nothing half-written behind.
"""

from __future__ import annotations

import copy
import ctypes
import hashlib
import os
import tempfile

import numpy as np
import torch

from ...compiled import say
from ...weight_cache import cache_home
from .library import bindings

#: weight types a packaged model's file can be re-quantized to (llama.cpp's file-type names)
QUANTS = ("F32", "BF16", "F16", "Q8_0", "Q4_0", "Q4_1")
_FTYPE = {"F32": "LLAMA_FTYPE_ALL_F32", "BF16": "LLAMA_FTYPE_MOSTLY_BF16", "F16": "LLAMA_FTYPE_MOSTLY_F16",
          "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1"}
#: the attribute :func:`attach_gguf` and ``load_model`` set on a model
ATTACHED, PACKAGED = "specdec_gguf", "specdec_packaged_gguf"


def cache_root() -> str:
    return str(cache_home() / "gguf")


def check_quant(quant: str) -> str:
    if quant not in QUANTS:
        raise ValueError(f"unknown GGUF weight type {quant!r}; known: {', '.join(QUANTS)}")
    return quant


def requantize(source: str, quant: str, folder: str | None = None) -> str:
    """``source`` re-written by llama.cpp's quantizer with weights of type ``quant`` (cached)."""
    check_quant(quant)
    stat = os.stat(source)
    key = hashlib.sha256(f"{os.path.abspath(source)}|{stat.st_size}|{stat.st_mtime_ns}|{quant}".encode()).hexdigest()
    folder = folder or cache_root()
    stem = os.path.splitext(os.path.basename(source))[0]
    path = os.path.join(folder, f"{stem}-{key[:12]}.{quant}.gguf")
    if os.path.isfile(path):
        return path
    os.makedirs(folder, exist_ok=True)
    say(f"writing a {quant} GGUF file of {os.path.basename(source)} for llama.cpp (once; cached in {folder}) ...")
    lib = bindings()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, _FTYPE[quant])
    params.allow_requantize = True
    params.nthread = max(torch.get_num_threads(), 1)
    handle, partial = tempfile.mkstemp(dir=folder, suffix=".partial")
    os.close(handle)
    try:
        status = lib.llama_model_quantize(source.encode(), partial.encode(), ctypes.byref(params))
        if status != 0:
            raise RuntimeError(f"llama.cpp could not re-quantize {source} to {quant} (status {status})")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


def attach_gguf(model, path: str):
    """Serve ``model`` from GGUF file ``path`` when a decoder runs it with ``engine="llama_cpp"``.
    The file must hold the same weights for the same vocabulary (checked: its logits width);
    specdec's output is then identical to llama.cpp's own plain decoding of that file. Returns ``model``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path}")
    setattr(model, ATTACHED, os.path.abspath(path))
    return model


def gguf_source(model) -> str | None:
    """The GGUF file ``model`` was attached to or loaded from, or None."""
    return getattr(model, ATTACHED, None) or getattr(model, PACKAGED, None)


def gguf_for(model, quant: str = "F32") -> str | None:
    """The GGUF file that serves ``model``: the one attached, else its packaged file re-quantized to
    ``quant``; None where it has neither."""
    attached = getattr(model, ATTACHED, None)
    if attached is not None:
        return attached
    packaged = getattr(model, PACKAGED, None)
    return requantize(packaged, quant) if packaged is not None else None


def gguf_twin(model, weights: str = "Q8_0"):
    """A draft for ``engine="llama_cpp"``: ``model`` 's twin (a shallow copy: the same modules and
    weights in torch, nothing copied) that llama.cpp serves from ``model`` 's GGUF file re-written
    with ``weights``: ``SpecDecoder(target, gguf_twin(target, "Q4_0"), engine="llama_cpp")`` drafts
    with the 4-bit file and verifies with the target's own."""
    source = gguf_source(model)
    if source is None:
        raise ValueError(missing_gguf(model))
    twin = copy.copy(model)
    setattr(twin, ATTACHED, requantize(source, check_quant(weights)))
    return twin


def missing_gguf(model) -> str:
    """What to do for a model no GGUF file serves (the error's text)."""
    return (f"engine='llama_cpp' runs a model from a GGUF file of its weights; {type(model).__name__} has none: "
            "load a packaged model (load_model('smollm2-135m')), or name a file with "
            "specdec.engines.attach_gguf(model, path) (llama.cpp's convert_hf_to_gguf.py writes one; "
            "specdec.engines.export_gguf writes one for a Llama-architecture model)")


# -- writing a Llama-architecture model ------------------------------------------------------------
#: each decoder layer's tensors: llama.cpp's name, transformers' (under ``model.layers.{i}.``), and
#: which head count re-orders its rows for llama.cpp's rotary layout (None: kept as it is)
_LAYER_TENSORS = (("attn_norm", "input_layernorm", None), ("attn_q", "self_attn.q_proj", "num_attention_heads"),
                  ("attn_k", "self_attn.k_proj", "num_key_value_heads"), ("attn_v", "self_attn.v_proj", None),
                  ("attn_output", "self_attn.o_proj", None), ("ffn_norm", "post_attention_layernorm", None),
                  ("ffn_gate", "mlp.gate_proj", None), ("ffn_up", "mlp.up_proj", None), ("ffn_down", "mlp.down_proj", None))


def export_gguf(model, path: str) -> str:
    """Write ``model`` (a ``transformers`` Llama-architecture causal LM) as an F32 GGUF file at
    ``path`` that llama.cpp's ``llama`` architecture reads, with no tokenizer (a vocabulary of
    placeholder tokens: specdec feeds ids). The query and key projections are re-ordered for
    llama.cpp's rotary layout, as its own converter does. Returns ``path``."""
    import gguf

    config = model.config.get_text_config()
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    window = getattr(config, "sliding_window", None)
    if config.model_type not in ("llama", "mistral") or getattr(config, "attention_bias", False) \
            or getattr(config, "mlp_bias", False) or rope.get("rope_type", "default") != "default" \
            or (window is not None and window < config.max_position_embeddings):
        raise ValueError(f"export_gguf writes plain Llama-architecture models (full attention, no biases, plain "
                         f"RoPE); {type(model).__name__} ({config.model_type}"
                         f"{f', sliding_window={window}' if window is not None else ''}) needs llama.cpp's "
                         "convert_hf_to_gguf.py")
    state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(path, "llama")
    _write_metadata(writer, config, vocab=state["model.embed_tokens.weight"].shape[0])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, tensor in _llama_tensors(state, config):
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer, config, vocab: int) -> None:
    """The ``llama`` architecture's keys for a transformers Llama ``config``, and no tokenizer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("none")


def _llama_tensors(state: dict, config):
    """(llama.cpp name, array) of every tensor of ``state`` (a Llama state dict as numpy arrays)."""
    def rotary(w: np.ndarray, n: int) -> np.ndarray:  # rotate-half pairs -> interleaved pairs
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    if not getattr(config, "tie_word_embeddings", False):
        yield "output.weight", state["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        for name, source, heads in _LAYER_TENSORS:
            tensor = state[f"model.layers.{i}.{source}.weight"]
            yield f"blk.{i}.{name}.weight", tensor if heads is None else rotary(tensor, getattr(config, heads))
