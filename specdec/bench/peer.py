"""The peer a CPU user would pick instead: llama.cpp, through llama-cpp-python, as a bench method.

A ``llama_cpp`` method decodes the questions' chat-template ids with ``Llama.generate``, greedy
(temperature 0: llama.cpp's greedy sampler), on the target's GGUF file re-written by llama.cpp's
quantizer with weights of the method's type (``specdec.engines.llama_cpp.files``), at the bench's
thread count, plain or with llama-cpp-python's prompt-lookup decoding. It stops where
``target.generate`` would: at the target's end-of-sequence ids or ``max_new_tokens``.
"""

from __future__ import annotations

import torch

from ..engines import LLAMA_CPP_INSTALL, gguf_source, llama_cpp_library, missing_gguf, requantize


def llama_cpp_runner(options, target, gen):
    """``run(input_ids [1, L], seed, max_new_tokens=None, grammar=None) -> (new ids, None)``."""
    try:
        from llama_cpp import GGML_TYPE_F16, GGML_TYPE_F32, Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise ImportError(f"the llama_cpp bench method needs llama-cpp-python: {LLAMA_CPP_INSTALL}") from None
    source = gguf_source(target)
    if source is None:
        raise ValueError(missing_gguf(target))
    path = requantize(source, options.weights)
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    made: dict = {}

    def model_for(tokens: int):
        """One Llama for the run, remade larger when a call needs more context."""
        if made.get("n_ctx", 0) < tokens:
            n_ctx = max(2048, 1 << (tokens - 1).bit_length())
            threads = max(torch.get_num_threads(), 1)
            kind = GGML_TYPE_F32 if options.kv_type == "f32" else GGML_TYPE_F16
            draft = (LlamaPromptLookupDecoding(max_ngram_size=options.max_ngram, num_pred_tokens=options.lookup)
                     if options.lookup else None)
            with llama_cpp_library.loading_with_model_params():  # the engine's (no AMX buffers)
                llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, type_k=kind,
                            type_v=kind, draft_model=draft, verbose=False,
                            # with a draft, llama-cpp-python keeps every token's logits but
                            # sizes that table by n_batch unless logits_all is passed too
                            logits_all=draft is not None)
            made.update(n_ctx=n_ctx, llm=llm)
        return made["llm"]

    def run(input_ids, seed, max_new_tokens=None, grammar=None):
        limit = max_new_tokens or gen.max_new_tokens
        ids = input_ids[0].tolist()
        llm = model_for(len(ids) + limit + 16)
        out: list[int] = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0, repeat_penalty=1.0,
                                  reset=True):
            out.append(int(token))
            if token in eos or len(out) >= limit:
                break
        return out, None

    return run
