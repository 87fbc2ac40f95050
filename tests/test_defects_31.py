"""Regression tests for the defects of issue 31 (a second adversarial round), one or more per defect.

1. The static-cache pool: bounded in bytes, releasable, and a call's cache sized by what it can
   reach (a huge ``max_new_tokens`` that stops early allocates one short cache, calibration
   included).
2. An assistant whose cache mirrors the target's (``prefill_from_target=True``) on both caches.
3. Generation settings ``generate()`` applies are refused, naming the setting, or honoured (the same
   output as ``generate()``), never silently ignored.
4. Learned-position limits (GPT-2, OPT): a prompt that does not fit is refused before any forward;
   new tokens run to where ``generate()`` runs and stop the call where it raises.
5. Argument checks naming the argument and the allowed values.

Names added by the fix are imported inside the tests, so the module also runs against the code
before it (where these tests fail rather than error at collection).
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import StaticLayer

from candidate_generators.draft_model import DraftModelGenerator
from specdec import SpecDecoder
from specdec.models import tiny_random

from helpers import FAST_COMPILE, left_pad, perturbed_copy, pin_costs, repetitive_prompt


@pytest.fixture(scope="module")
def llama():
    return pin_costs(tiny_random("llama", seed=1)[0])


@pytest.fixture
def static_slots(monkeypatch):
    """Every static cache layer allocated while the test runs: [(batch, slots)] (calibration's too)."""
    made = []
    original = StaticLayer.lazy_initialization

    def spy(self, key_states, *args, **kwargs):
        made.append((int(key_states.shape[0]), int(self.max_cache_len)))
        return original(self, key_states, *args, **kwargs)

    monkeypatch.setattr(StaticLayer, "lazy_initialization", spy)
    return made


def first_token(model, ids) -> int:
    return int(model.generate(ids, max_new_tokens=1, do_sample=False)[0, -1])


# -- 1. the static-cache pool ---------------------------------------------------------------------
def test_pooled_caches_stay_under_the_limit(llama):
    from specdec.cache_pool import pooled_bytes, release_caches, set_cache_pool_limit

    release_caches()
    old = set_cache_pool_limit(1 << 20)  # a 256-slot cache of this model: 128 KiB a row
    try:
        decoder = SpecDecoder(llama, "prompt_lookup", cache_implementation="static")
        for batch, length, new in [(1, 10, 5), (2, 30, 250), (3, 8, 600), (4, 12, 5), (2, 200, 40), (1, 5, 300)]:
            rows = [repetitive_prompt(length // 2 + 1, seed=b)[0][:length] for b in range(batch)]
            ids, mask = left_pad(rows, pad_id=257)
            decoder.generate(ids, mask, max_new_tokens=new, eos_token_id=None)
            assert pooled_bytes() <= 1 << 20
    finally:
        set_cache_pool_limit(old)


def test_a_models_pooled_caches_can_be_released(llama):
    from specdec import release_caches
    from specdec.cache_pool import pooled_bytes

    SpecDecoder(llama, "prompt_lookup", cache_implementation="static").generate(repetitive_prompt(6), max_new_tokens=4)
    assert pooled_bytes(llama) > 0
    assert release_caches(llama) > 0
    assert pooled_bytes(llama) == 0


def test_a_huge_max_new_tokens_that_stops_early_allocates_one_short_cache(llama, static_slots):
    ids = repetitive_prompt(5)
    eos = first_token(llama, ids)
    out = SpecDecoder(llama, "prompt_lookup", cache_implementation="static").generate(
        ids, max_new_tokens=2_000_000, eos_token_id=eos)
    assert out.sequences[0, ids.shape[1]:].tolist() == [eos]
    assert static_slots and max(slots for _, slots in static_slots) == 128  # the eager ladder's rung holding the prompt and 64 new tokens


def test_calibration_reuses_the_calls_cache(static_slots):
    """The policy's first-call calibration (costs not pinned) times its forwards on the call's own
    cache: one cache's layers are allocated in all, sized by the call, not by max_new_tokens."""
    target = tiny_random("llama", seed=4)[0]  # costs not pinned: the first greedy call calibrates
    layers = target.config.num_hidden_layers
    ids = repetitive_prompt(5)
    eos = first_token(target, ids)
    out = SpecDecoder(target, "prompt_lookup", cache_implementation="static").generate(
        ids, max_new_tokens=100_000, eos_token_id=eos)
    assert out.stats.calibration_seconds > 0
    assert static_slots == [(1, 128)] * layers


# -- 2. mirroring the target's cache --------------------------------------------------------------
class Mirroring(DraftModelGenerator):
    """A draft with the target's cache layout whose cache mirrors the target's."""

    def attach_options(self):
        return {"prefill_from_target": True}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_mirroring_assistant_is_exact_on_both_caches(llama, cache):
    draft = perturbed_copy(llama, 0.3, seed=7)  # the same layout; disagrees sometimes
    decoder = SpecDecoder(llama, Mirroring(draft, schedule="fixed", num_tokens=3), cache_implementation=cache)
    ids = repetitive_prompt(12)
    out = decoder.generate(ids, max_new_tokens=40)
    assert torch.equal(out.sequences, llama.generate(ids, max_new_tokens=40, do_sample=False))
    assert out.stats.drafted_tokens > out.stats.accepted_tokens > 0  # mirrored after partial acceptance
    rows = [repetitive_prompt(8, seed=3)[0], torch.randint(0, 250, (9,), generator=torch.Generator().manual_seed(4))]
    padded, mask = left_pad(rows, pad_id=257)
    out = decoder.generate(padded, mask, max_new_tokens=24)
    for b, row in enumerate(rows):
        want = llama.generate(row[None, :], max_new_tokens=24, do_sample=False)[0, row.numel():]
        assert torch.equal(out.sequences[b, padded.shape[1]: padded.shape[1] + want.numel()], want)


def test_self_draft_mirrors_on_the_static_cache(llama):
    decoder = SpecDecoder(llama, "self_draft", weights="bfloat16", compile_draft=False, cache_implementation="static")
    ids = repetitive_prompt(10)
    out = decoder.generate(ids, max_new_tokens=30)
    assert torch.equal(out.sequences, llama.generate(ids, max_new_tokens=30, do_sample=False))


# -- 3. generation settings generate() applies ----------------------------------------------------
def refused_or_honoured(decode, expected: torch.Tensor, name: str) -> None:
    """``decode()`` either refuses the setting ``name`` (a ValueError naming it) or gives ``expected``
    (generate()'s output): never silently something else."""
    try:
        out = decode()
    except ValueError as exc:
        assert name in str(exc), exc
        return
    assert torch.equal(out.sequences, expected)


def test_encoder_repetition_penalty_is_refused_or_honoured():
    """generate() applies it to a decoder-only model (the prompt is its encoder_input_ids): greedy
    tokens change."""
    target, tokenizer = tiny_random("llama", seed=1)
    pin_costs(target)
    ids = repetitive_prompt(6)
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    target.generation_config.encoder_repetition_penalty = 1.5
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    assert not torch.equal(expected, plain)
    refused_or_honoured(lambda: SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=20), expected,
                        "encoder_repetition_penalty")


def test_stop_strings_of_the_generation_config_are_refused_or_honoured():
    target, tokenizer = tiny_random("llama", seed=1)
    pin_costs(target)
    ids = repetitive_prompt(6)
    new = target.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1]:].tolist()
    stop = next(t for t in new[3:] if tokenizer.decode([t]).isascii() and tokenizer.decode([t]).isalnum())
    target.generation_config.stop_strings = [tokenizer.decode([stop])]
    expected = target.generate(ids, max_new_tokens=30, do_sample=False, tokenizer=tokenizer)
    assert expected.shape[1] < ids.shape[1] + 30  # generate() stops at the string
    decoder = SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer)
    refused_or_honoured(lambda: decoder.generate(ids, max_new_tokens=30), expected, "stop_strings")


@pytest.mark.parametrize("name, value", [("token_healing", True), ("num_return_sequences", 2)])
def test_settings_that_make_generate_raise_are_refused(name, value):
    target = pin_costs(tiny_random("llama", seed=1)[0])
    setattr(target.generation_config, name, value)
    ids = repetitive_prompt(6)
    with pytest.raises(Exception):  # transformers refuses them here (without a tokenizer; greedy)
        target.generate(ids, max_new_tokens=8)
    with pytest.raises(ValueError, match=name):
        SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=8)


# -- 4. learned positions -------------------------------------------------------------------------
def positioned(arch: str, limit: int = 64):
    key = "n_positions" if arch == "gpt2" else "max_position_embeddings"
    return pin_costs(tiny_random(arch, seed=1, **{key: limit})[0])


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_a_prompt_past_the_learned_positions_is_refused_before_any_forward(arch):
    target = positioned(arch)
    forwards = []
    handle = target.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="max_position_embeddings=64"):
            SpecDecoder(target, "prompt_lookup").generate(torch.randint(0, 250, (1, 65)), max_new_tokens=3)
    finally:
        handle.remove()
    assert forwards == []


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_new_tokens_run_to_the_learned_positions_and_stop_where_generate_raises(arch, cache):
    target = positioned(arch)
    draft = perturbed_copy(target, 0.1, seed=5)
    ids = torch.randint(0, 250, (1, 50), generator=torch.Generator().manual_seed(0))
    for drafter in ("prompt_lookup", draft):
        decoder = SpecDecoder(target, drafter, cache_implementation=cache)
        # 50 + 15 = 65 tokens: the last is never fed, so it fits 64 positions
        out = decoder.generate(ids, max_new_tokens=15, eos_token_id=None)
        assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=15, do_sample=False, eos_token_id=None))
        with pytest.raises(IndexError):  # transformers 5.24 raises inside the forward that needs position 64
            target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
        with pytest.raises(ValueError, match="position 64"):  # specdec stops before that forward, saying why
            decoder.generate(ids, max_new_tokens=16, eos_token_id=None)


def test_a_draft_models_position_table_limits_its_drafts_not_the_call():
    """A draft model with learned positions behind a target without them (or a longer table): a
    prompt past the draft's table was refused naming the draft's class, and a batch whose finished
    row reached past it failed mid-call, where generate() decodes. The draft now reads such tokens
    at its table's last position: drafts only."""
    target, _ = tiny_random("llama", seed=1)
    draft = positioned("gpt2", limit=32)
    rows = [torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 40)]
    ids, mask = left_pad(rows, pad_id=0)
    want = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    out = SpecDecoder(target, draft).generate(ids, mask, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(out.sequences, want)


# -- 5. argument checks ---------------------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    ({"weights": None}, r"weights must be one of \('auto'"),
    ({"lookup": "yes"}, "lookup must be True or False"),
    ({"max_tokens": 0}, "max_tokens must be a positive int"),
    ({"max_tokens": -3}, "max_tokens must be a positive int"),
])
def test_self_draft_arguments_are_checked(llama, options, match):
    with pytest.raises((TypeError, ValueError), match=match):
        SpecDecoder(llama, "self_draft", **options)


def test_fast_head_must_be_a_bool(llama):
    with pytest.raises(TypeError, match="fast_head must be True or False"):
        SpecDecoder(llama, "prompt_lookup", fast_head="no")


def test_compile_options_are_checked_against_torch_compile(llama):
    with pytest.raises(ValueError, match="torch.compile takes no option 'bogus'.*backend"):
        SpecDecoder(llama, "prompt_lookup", cache_implementation="static", compile={"bogus": 1})
    with pytest.raises(ValueError, match="compile_draft: torch.compile takes no option 'bogus'"):
        SpecDecoder(llama, "self_draft", compile_draft={"bogus": 1})


@pytest.mark.parametrize("max_length", [0, -5, 1.5, "64"])
def test_warmup_max_length_must_be_a_positive_int(llama, max_length):
    decoder = SpecDecoder(llama, "prompt_lookup", cache_implementation="static", compile=FAST_COMPILE)
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        decoder.warmup(max_length=max_length)
