"""Generation settings drawn at random, with every built-in generator, against ``generate()``.

Each case draws, from its own seed, an architecture, a left-padded batch of repetitive prompts, a
generator made to draft every step (a fixed schedule) or left to the policy, a cache, and a mix of
the settings users pass (EOS ids, minimum lengths, penalties, bad words, suppressed and forced
tokens): greedy output must be ``target.generate``'s, token for token, whatever the mix. The seeds
are fixed, so every machine runs the same cases; a mix ``generate()`` itself refuses is skipped.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from helpers import left_pad, tiny_pair

from specdec import SpecDecoder

ARCHS = ("llama", "gemma2", "gpt2")  # rotary positions, sliding-window layers, absolute positions
GENERATORS = ("none", "prompt_lookup", "suffix", "draft_model", "self_draft")
EOS = 256  # the tiny models' end-of-sequence id


@functools.cache
def models(arch: str):
    return tiny_pair(arch)


def prompts(rng: random.Random) -> list[torch.Tensor]:
    rows = []
    for _ in range(rng.randint(1, 3)):
        base = [rng.randrange(256) for _ in range(rng.randint(2, 8))]
        rows.append(torch.tensor((base * rng.randint(1, 4))[: rng.randint(2, 30)]))
    return rows


def mix(rng: random.Random, written: list[int], new: int) -> dict:
    """Up to four settings, some built from tokens the target writes on its own (``written``), for
    a call of ``new`` tokens."""
    pick = lambda: rng.choice(written)  # noqa: E731
    options = {
        "eos_token_id": lambda: rng.choice([None, pick(), [EOS, pick()]]),
        "min_new_tokens": lambda: rng.randint(1, new),
        "repetition_penalty": lambda: rng.choice([0.8, 1.3, 2.0]),
        "no_repeat_ngram_size": lambda: rng.randint(1, 3),
        # [[EOS]]: bad words generate() drops entirely (each one an EOS id)
        "bad_words_ids": lambda: rng.choice([[[EOS]], [[pick()], [pick(), pick()]]]),
        "suppress_tokens": lambda: sorted({pick(), pick()}),
        "forced_eos_token_id": pick,
    }
    return {name: options[name]() for name in rng.sample(sorted(options), rng.randint(0, 4))}


def decoder(rng: random.Random, arch: str) -> SpecDecoder:
    target, draft, tokenizer = models(arch)
    generator = rng.choice(GENERATORS)
    options = {}
    if generator != "none" and rng.random() < 0.6:
        options.update(schedule="fixed", num_tokens=rng.randint(1, 6))
    if generator in ("prompt_lookup", "draft_model") and rng.random() < 0.4:
        options["tree"] = True
    if generator == "self_draft":
        options.update(weights="bfloat16", compile_draft=False)
    drafter = {"none": None, "draft_model": draft}.get(generator, generator)
    cache = rng.choice(["dynamic", "static"])
    return SpecDecoder(target, drafter, tokenizer=tokenizer, cache_implementation=cache, **options)


@pytest.mark.parametrize("seed", range(40))
def test_random_settings_and_generators_equal_generate(seed):
    rng = random.Random(seed)
    arch = rng.choice(ARCHS)
    target, _, tokenizer = models(arch)
    ids, mask = left_pad(prompts(rng), tokenizer.pad_token_id)
    new = rng.randint(1, 24)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    written = sorted({t for t in plain[:, ids.shape[1]:].flatten().tolist() if t < EOS}) or [0]
    kwargs = mix(rng, written, new)
    try:
        want = target.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kwargs)
    except ValueError as refused:  # a mix generate() refuses itself (a forced EOS that is also suppressed, ...)
        pytest.skip(f"generate() refuses {kwargs}: {refused}")
    spec = decoder(rng, arch)
    out = spec.generate(ids, mask, max_new_tokens=new, **kwargs)
    assert torch.equal(out.sequences, want), (arch, type(spec.candidate_generator).__name__, kwargs)
