"""Regression tests for defects found by trying to break the core (issue 9, part B).

Each refusal is checked with a :class:`ForwardRecorder`: the error comes before any forward.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import (OpenAIGPTConfig, OpenAIGPTLMHeadModel, ReformerConfig, ReformerModelWithLMHead, RwkvConfig,
                          RwkvForCausalLM, XLNetConfig, XLNetLMHeadModel)
from transformers.generation import WatermarkingConfig

from candidate_generators.draft_model import DraftModelGenerator
from specdec import Proposal, SpecDecoder
from specdec.generators import CandidateGenerator
from specdec.state import ModelState
from specdec.tiny import tiny_random

from helpers import ForwardRecorder, perturbed_copy, repetitive_prompt


@pytest.fixture(scope="module")
def llama():
    target, tokenizer = tiny_random("llama", seed=3)
    return target, tokenizer


def refused(model, call, match: str, error=ValueError):
    """``call()`` raises ``error`` matching ``match`` and ``model`` runs no forward."""
    recorder = ForwardRecorder(model)
    try:
        with pytest.raises(error, match=match):
            call()
    finally:
        recorder.remove()
    assert recorder.calls == [], "refused only after a forward"


# -- 1. generation_config settings that change target.generate() ---------------------------------
def test_generation_modes_other_than_greedy_and_sampling_are_refused():
    target, _ = tiny_random("llama", seed=3)
    target.generation_config.num_beams = 3
    refused(target, lambda: SpecDecoder(target, "prompt_lookup").generate(repetitive_prompt(8), max_new_tokens=4),
            "num_beams")


@pytest.mark.parametrize("setting,value,prompt_length", [
    ("forced_bos_token_id", 5, 1),  # applies when the prompt is one token long
    ("watermarking_config", WatermarkingConfig(), 8),
    ("remove_invalid_values", True, 8),
    ("min_length", 30, 8),
])
def test_generation_settings_that_change_greedy_output_are_honoured(setting, value, prompt_length):
    """Each applies at every verified position (docs/generation.md): generate()'s output exactly."""
    target, _ = tiny_random("llama", seed=3)
    setattr(target.generation_config, setting, value)
    ids = repetitive_prompt(8)[:, :prompt_length]
    out = SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=6)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=6, do_sample=False))


def test_settings_that_depend_on_eos_follow_the_call(llama):
    """min_new_tokens suppresses EOS; with no EOS for this call it changes nothing, as in generate()."""
    target, _ = tiny_random("llama", seed=3)
    target.generation_config.min_new_tokens = 5
    ids = repetitive_prompt(8)
    out = SpecDecoder(target).generate(ids, max_new_tokens=8)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=8, do_sample=False))
    out = SpecDecoder(target).generate(ids, max_new_tokens=8, eos_token_id=None)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None))


# -- 2. models whose state is not a rollable KV cache ---------------------------------------------
def _tiny(config_cls, model_cls, **config):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return model_cls(config_cls(**config)).eval()


NO_CACHE_MODELS = {
    "rwkv": lambda: _tiny(RwkvConfig, RwkvForCausalLM, vocab_size=64, hidden_size=16, num_hidden_layers=2,
                          attention_hidden_size=16, intermediate_size=32, context_length=64),
    "xlnet": lambda: _tiny(XLNetConfig, XLNetLMHeadModel, vocab_size=64, d_model=16, n_layer=1, n_head=2, d_inner=32),
    "openai-gpt": lambda: _tiny(OpenAIGPTConfig, OpenAIGPTLMHeadModel, vocab_size=64, n_embd=16, n_layer=1, n_head=2,
                                n_positions=64),
    "reformer": lambda: _tiny(ReformerConfig, ReformerModelWithLMHead, vocab_size=64, hidden_size=16,
                              attention_head_size=8, num_attention_heads=2, feed_forward_size=32,
                              attn_layers=["local"], axial_pos_embds=False, max_position_embeddings=64,
                              is_decoder=True),
}


@pytest.mark.parametrize("name", sorted(NO_CACHE_MODELS))
def test_models_without_a_rollable_kv_cache_are_refused(name):
    model = NO_CACHE_MODELS[name]()
    ids = torch.tensor([[1, 2, 3, 4]])
    refused(model, lambda: SpecDecoder(model, "prompt_lookup").generate(ids, max_new_tokens=4),
            f"{type(model).__name__}.*no key/value cache")


# -- 3. argument checks -----------------------------------------------------------------------------
def test_a_fractional_attention_mask_is_refused_not_rounded(llama):
    target, _ = llama
    ids = repetitive_prompt(4)
    mask = torch.ones(ids.shape)
    mask[0, 0] = 0.4
    refused(target, lambda: SpecDecoder(target).generate(ids, mask, max_new_tokens=4), "only 0 and 1")
    # a float mask of exact 0s and 1s is fine
    mask[0, 0] = 0.0
    assert SpecDecoder(target).generate(ids, mask, max_new_tokens=2).sequences.shape[1] == ids.shape[1] + 2


def test_a_mask_with_a_hole_is_named_as_such(llama):
    target, _ = llama
    ids = torch.tensor([[5, 6, 7]])
    refused(target, lambda: SpecDecoder(target).generate(ids, torch.tensor([[1, 0, 1]]), max_new_tokens=2), "hole")
    refused(target, lambda: SpecDecoder(target).generate(ids, torch.tensor([[0, 1, 0]]), max_new_tokens=2),
            "right-padded")


@pytest.mark.parametrize("kwargs,match", [
    (dict(do_sample=True, top_k=2.5), "top_k must be an int"),
    (dict(do_sample=True, top_p="0.9"), "top_p must be a number"),
    (dict(do_sample=True, temperature=None), "temperature must be a number"),
    (dict(eos_token_id="12"), "token ids must be ints"),
    (dict(eos_token_id=[3, -1]), "token ids must be >= 0"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be a positive int"),
])
def test_bad_argument_types_are_refused_before_any_forward(llama, kwargs, match):
    target, _ = llama
    call = {"max_new_tokens": 4, **kwargs}
    refused(target, lambda: SpecDecoder(target, "prompt_lookup").generate(repetitive_prompt(4), **call), match,
            error=(TypeError, ValueError))


def test_a_draft_on_the_meta_device_is_refused(llama):
    target, _ = llama
    with torch.device("meta"):
        draft, _ = tiny_random("llama", seed=3)
    refused(target, lambda: SpecDecoder(target, draft).generate(repetitive_prompt(4), max_new_tokens=4), "meta device")


def test_explicit_eos_none_means_no_eos_as_in_transformers(llama):
    target, _ = tiny_random("llama", seed=3)
    ids = repetitive_prompt(8)
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    target.generation_config.eos_token_id = int(plain[0, ids.shape[1] + 2])  # EOS after three new tokens
    for kwargs in ({}, {"eos_token_id": None}):
        ref = target.generate(ids, max_new_tokens=20, do_sample=False, **kwargs)
        out = SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=20, **kwargs)
        assert torch.equal(out.sequences, ref), kwargs
    assert out.sequences.shape[1] == ids.shape[1] + 20  # no EOS: the full length


# -- 4. malformed proposals ---------------------------------------------------------------------------
def _returns(make):
    class Malformed(CandidateGenerator):
        def propose(self, ctx, max_drafts):
            return make(ctx.batch_size)

    return Malformed()


MALFORMED = {
    "lengths beyond K": (lambda b: Proposal(torch.full((b, 1), 7), torch.full((b,), 2)), "lengths .* must lie in"),
    "None": (lambda b: None, "must return a Proposal"),
    "a tuple": (lambda b: (torch.zeros(b, 2, dtype=torch.long), torch.ones(b, dtype=torch.long)), "must return a Proposal"),
    "wrong batch": (lambda b: Proposal(torch.zeros(b + 1, 2, dtype=torch.long), torch.ones(b + 1, dtype=torch.long)),
                    "token_ids must be an integer tensor"),
    "1-D ids": (lambda b: Proposal(torch.zeros(2, dtype=torch.long), torch.ones(b, dtype=torch.long)),
                "token_ids must be an integer tensor"),
    "float ids": (lambda b: Proposal(torch.zeros(b, 2), torch.ones(b, dtype=torch.long)),
                  "token_ids must be an integer tensor"),
    "lengths as a list": (lambda b: Proposal(torch.zeros(b, 2, dtype=torch.long), [1] * b),
                          "lengths must be an integer tensor"),
    "probs of the wrong shape": (lambda b: Proposal(torch.zeros(b, 2, dtype=torch.long), torch.ones(b, dtype=torch.long),
                                                    torch.full((b, 2, 7), 0.1)), "probs must be None or a float tensor"),
    "probs 0 at its own draft": (lambda b: Proposal(torch.zeros(b, 1, dtype=torch.long), torch.ones(b, dtype=torch.long),
                                                    torch.zeros(b, 1, 320)), "probability 0"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_proposals_are_refused_naming_the_plugin(llama, case):
    target, _ = llama
    make, match = MALFORMED[case]
    decoder = SpecDecoder(target, _returns(make))
    with pytest.raises((TypeError, ValueError), match=f"candidate generator 'Malformed'.*{match}"):
        decoder.generate(repetitive_prompt(4), max_new_tokens=4, do_sample=True, generator=torch.Generator().manual_seed(0))


# -- 5. memory follows what is generated, not max_new_tokens ---------------------------------------
def test_a_huge_max_new_tokens_allocates_nothing_up_front(llama, monkeypatch):
    target, _ = llama
    ids = repetitive_prompt(8)
    first = int(target.generate(ids, max_new_tokens=1, do_sample=False)[0, -1])
    widths = []
    forward = ModelState.forward

    def spy(self, start):
        widths.append(self.tokens.shape[1])
        return forward(self, start)

    monkeypatch.setattr(ModelState, "forward", spy)
    # 10^12 new tokens would be 8 TB of token buffer if allocated up front; EOS comes at once
    out = SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=10**12, eos_token_id=first)
    assert out.sequences[0, ids.shape[1]:].tolist() == [first]
    assert max(widths) <= ids.shape[1] + ModelState.HEADROOM


def test_token_buffers_grow_by_doubling(llama):
    target, _ = llama
    state = ModelState(target, torch.tensor([[1, 2, 3]]), torch.tensor([3]), capacity=4)
    seen = set()
    for _ in range(100):
        state.append(torch.tensor([[9]]))
        seen.add(state.tokens.shape[1])
    # 8 first: an append keeps one column free past what it writes (the token a commit writes there)
    assert sorted(seen) == [8, 16, 32, 64, 128]


# -- 7. one decoder, several threads ----------------------------------------------------------------
def test_one_decoder_serves_concurrent_calls_exactly():
    target, _ = tiny_random("llama", seed=5)
    draft = perturbed_copy(target, 0.2, seed=6)
    decoder = SpecDecoder(target, draft, num_tokens=3, schedule="fixed")  # a draft this large would not run under auto
    prompts = [repetitive_prompt(6 + 2 * i, seed=i) for i in range(6)]
    refs = [target.generate(p, max_new_tokens=24, do_sample=False) for p in prompts]
    outputs, errors = [None] * len(prompts), []
    barrier = threading.Barrier(len(prompts))

    def work(i):
        try:
            barrier.wait()
            outputs[i] = decoder.generate(prompts[i], max_new_tokens=24)
        except Exception as exc:  # reported below with the thread's index
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for out, ref in zip(outputs, refs):
        assert torch.equal(out.sequences, ref)
    assert sum(out.stats.accepted_tokens for out in outputs) > 0


def test_each_call_gets_a_fresh_session():
    target, _ = tiny_random("llama", seed=5)
    decoder = SpecDecoder(target, DraftModelGenerator(perturbed_copy(target, 0.2, seed=6), num_tokens=3))
    made = []
    make = decoder.candidate_generator.session
    decoder.candidate_generator.session = lambda: made.append(make()) or made[-1]
    for _ in range(2):
        decoder.generate(repetitive_prompt(6), max_new_tokens=8)
    assert len(made) == 2 and made[0] is not made[1]
    assert made[0].draft is made[1].draft is decoder.candidate_generator.draft  # models shared, never copied
    assert decoder.candidate_generator.assistant is None  # the configuration itself never ran
