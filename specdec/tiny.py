"""Tiny random test models: ``load_model("tiny-random:<arch>")``, built in code, never downloaded.

A tiny model is a ``transformers`` architecture from :data:`TINY_ARCHS` at toy size with random
weights, paired with a byte-level BPE tokenizer built in code (ids 0-255 the bytes, then
``<eos>``, ``<pad>``). The same ``seed`` gives the same weights, and building one never touches
the caller's random state. The output layer is scaled up so that greedy paths are decisive and a
draft agrees with its target some of the time, which the tests of acceptance need.
"""

from __future__ import annotations

import torch

from .names import ModelNotAvailableError, did_you_mean

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gpt2", "opt", "phi3")


def _byte_order() -> dict[str, int]:
    """GPT-2's byte -> printable-character map, inverted: character -> byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
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


def check_tiny_arch(arch: str) -> None:
    """Raise :class:`ModelNotAvailableError` unless ``arch`` is one of :data:`TINY_ARCHS`."""
    if arch not in TINY_ARCHS:
        raise ModelNotAvailableError(f"unknown tiny-random architecture {arch!r}.{did_you_mean(arch, TINY_ARCHS)} "
                                     f"Known: {', '.join(TINY_ARCHS)}")


def tiny_config(arch: str, vocab_size: int = 320, **overrides):
    from transformers import AutoConfig

    check_tiny_arch(arch)
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
    return AutoConfig.for_model(arch, **common)


def tiny_random(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, vocab_size: int = 320,
                tokenizer=None, **overrides):
    """A tiny random model of ``arch`` and a byte-level tokenizer (ids: 256 bytes, 256 <eos>, 257 <pad>)."""
    from transformers import AutoModelForCausalLM

    from .engines import import_torchao_quietly

    import_torchao_quietly()  # as load_model: transformers' modeling code imports it, with messages
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
