"""Greedy speculative output equals target.generate(do_sample=False), token for token.

Every tiny architecture with every kind of draft and schedule, and left-padded batches. One
(target, draft) pair per architecture serves the whole module, and each reference
``target.generate`` is computed once per model and prompt (``helpers.reference``): greedy output
depends on nothing else, so the seven decoders of an architecture compare with the same two.
"""

import pytest
import torch

from specdec import SpecDecoder
from specdec.models import TINY_ARCHS

from helpers import left_pad, reference, repetitive_prompt

# balanced into the second process of a split session (tests/conftest.py)
pytestmark = pytest.mark.split_second

ARCHS = list(TINY_ARCHS)  # llama, mistral (sliding), qwen2, gemma2 & gemma3 (sliding), gpt2, opt, phi3


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, pairs):
    return pairs(request.param)


@pytest.mark.parametrize("draft_kind,schedule", [
    ("prompt_lookup", "fixed"), ("prompt_lookup", "adaptive"), ("draft_model", "fixed"),
    ("draft_model", "adaptive"), ("self", "fixed"), ("self", "adaptive"), ("none", None)])
def test_greedy_matches_generate(pair, draft_kind, schedule):
    target, draft, _ = pair
    for seed in (0, 1):
        ids = repetitive_prompt(24, seed=seed)
        ref = reference(target, ids, 40)
        if draft_kind == "none":
            decoder = SpecDecoder(target)
        else:
            drafter = {"prompt_lookup": "prompt_lookup", "draft_model": draft, "self": target}[draft_kind]
            decoder = SpecDecoder(target, drafter, num_tokens=4, schedule=schedule)
        out = decoder.generate(ids, max_new_tokens=40)
        assert torch.equal(out.sequences, ref), f"seed {seed}"
        if draft_kind == "self":  # the target drafting for itself accepts everything
            assert out.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text", "gpt2"])
@pytest.mark.parametrize("draft_kind", ["prompt_lookup", "draft_model"])
@pytest.mark.parametrize("refeed_limit", [16, 0])
def test_batched_rows_match_single_row_generate(pairs, arch, draft_kind, refeed_limit, monkeypatch):
    """Left-padded rows of very different lengths, each equal to decoding that row alone.

    refeed_limit=0 forces the cache to shift lagging rows at every step."""
    from specdec.state import ModelState

    monkeypatch.setattr(ModelState, "REFEED_LIMIT", refeed_limit)
    target, draft, tokenizer = pairs(arch)
    rows = [repetitive_prompt(n, seed=n)[0] for n in (3, 40, 11, 25)]
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    drafter = "prompt_lookup" if draft_kind == "prompt_lookup" else draft
    out = SpecDecoder(target, drafter, num_tokens=4).generate(ids, mask, max_new_tokens=30)
    for i, row in enumerate(rows):
        ref = reference(target, row[None], 30)[0, row.numel():]
        got = out.sequences[i, ids.shape[1]:]
        assert torch.equal(got[: ref.numel()], ref), f"row {i}"
        assert bool((got[ref.numel():] == tokenizer.pad_token_id).all())
