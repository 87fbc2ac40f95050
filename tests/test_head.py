"""The output layer as ``W @ h.T`` (``specdec.engines.forwards.head``).

Its logits match the model's own on every tiny architecture (Gemma 2's soft-capping included);
decoding with it is token for token ``target.generate``; a model that changes its logits in any
other way, a forward hook that could see or rewrite them, a head below the size threshold and
``fast_head=False`` all keep the model's own head. Tiny heads are below the size threshold, so
these tests pin the decision (``FastHead.pin``); the real-model test is in test_real_smollm2.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from specdec import SpecDecoder
import specdec.engines.forwards.head as head_module
from specdec.engines.forwards.head import FastHead, model_logits
from specdec.modelinfo import ForwardTimer
from specdec.models import TINY_ARCHS, tiny_config, tiny_random

from helpers import left_pad, repetitive_prompt, tiny_pair

# balanced into the second process of a split session (tests/conftest.py)
pytestmark = pytest.mark.split_second


@pytest.fixture
def pin():
    """``pin(model, use=True)`` -> the head in use; every pinned model decides afresh afterwards."""
    pinned = []

    def pin_one(model, use: bool = True):
        pinned.append(model)
        return FastHead.pin(model, use)

    yield pin_one
    for model in pinned:
        FastHead.forget(model)


@pytest.fixture
def head_calls(monkeypatch):
    """The shapes of the hidden states a fast head turned into logits, one per call."""
    calls = []
    original = FastHead.__call__

    def counted(self, hidden):
        calls.append(hidden.shape)
        return original(self, hidden)

    monkeypatch.setattr(FastHead, "__call__", counted)
    return calls


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logits_match_the_models_own(arch, pin):
    model, _ = tiny_random(arch)
    assert pin(model) is not None, arch
    ids = repetitive_prompt(6)
    with torch.no_grad():
        own = model(ids).logits
        for kwargs, want in (({}, own), ({"logits_to_keep": 3}, own[:, -3:]), ({"logits_to_keep": 1}, own[:, -1:])):
            got = model_logits(model, {"input_ids": ids, **kwargs})
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(own.abs().max()))
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        one = model_logits(model, {"input_ids": ids[:, :1]})  # one token: padded to two columns inside
        torch.testing.assert_close(one, model(ids[:, :1]).logits, rtol=1e-4, atol=1e-4 * float(own.abs().max()))


def test_soft_capping_is_applied_and_checked(pin):
    model, _ = tiny_random("gemma2")
    head = pin(model)
    assert head is not None and head.softcap == model.config.final_logit_softcapping
    assert not FastHead(head.layer, None)._matches(model)  # without it the probe tells the difference


def test_a_model_that_changes_its_logits_keeps_its_own_head(pin):
    class Scaled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if out.logits is not None:
                out.logits = out.logits * 2
            return out

    model = Scaled(tiny_config("llama")).eval()
    assert pin(model) is None
    assert FastHead.of(model) is None


def test_small_heads_are_not_probed():
    model, _ = tiny_random("llama")
    FastHead.forget(model)
    with ForwardTimer(model) as timer:
        assert FastHead.of(model) is None
    assert timer.calls == 0  # decided from the head's size alone: no probe, no timing
    FastHead.forget(model)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
@pytest.mark.parametrize("draft_kind", ["none", "prompt_lookup", "draft_model", "self_draft"])
def test_greedy_output_is_the_targets_own(arch, draft_kind, pin, head_calls):
    target, draft, tokenizer = tiny_pair(arch)
    pin(target)
    pin(draft)
    head_calls.clear()  # pinning probes
    drafter = {"none": None, "prompt_lookup": "prompt_lookup", "draft_model": draft, "self_draft": "self_draft"}[draft_kind]
    # the copy runs uncompiled: the head is under test here (test_self_draft compiles copies)
    decoder = SpecDecoder(target, drafter, **({"compile_draft": False} if draft_kind == "self_draft" else {}))
    for seed in (0, 1):
        ids = repetitive_prompt(20, seed=seed)
        ref = target.generate(ids, max_new_tokens=32, do_sample=False)
        assert torch.equal(decoder.generate(ids, max_new_tokens=32).sequences, ref), seed
    rows = [repetitive_prompt(n, seed=n)[0] for n in (3, 17)]
    padded, mask = left_pad(rows, tokenizer.pad_token_id)
    out = decoder.generate(padded, mask, max_new_tokens=24)
    for b, row in enumerate(rows):
        want = target.generate(row[None], max_new_tokens=24, do_sample=False)[0, row.numel():]
        assert torch.equal(out.sequences[b, padded.shape[1]: padded.shape[1] + want.numel()], want), b
    assert head_calls


def test_hooks_that_may_read_the_logits_keep_the_models_head(pin, head_calls):
    model, _ = tiny_random("llama")
    pin(model)
    head_calls.clear()  # pinning probes
    ids = repetitive_prompt(6)

    def boost(module, args, out):  # rewrites the logits the model returns
        out.logits[..., 7] += 100.0
        return out

    handle = model.register_forward_hook(boost)
    try:
        got = model_logits(model, {"input_ids": ids})
    finally:
        handle.remove()
    assert bool((got.argmax(-1) == 7).all()) and not head_calls
    with ForwardTimer(model) as timer:  # specdec's own timers only count: the fast head stays
        model_logits(model, {"input_ids": ids})
    assert timer.calls == 1 and len(head_calls) == 1


def test_fast_head_false_keeps_the_models_head(pin, head_calls):
    target, _, _ = tiny_pair("llama")
    pin(target)
    head_calls.clear()  # pinning probes
    ids = repetitive_prompt(20)
    out = SpecDecoder(target, "prompt_lookup", fast_head=False).generate(ids, max_new_tokens=16)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=16, do_sample=False))
    assert not head_calls


def test_long_forwards_keep_the_models_head(pin, head_calls, monkeypatch):
    """A prefill of more than ``MAX_TOKENS`` tokens would return every layer's hidden states."""
    monkeypatch.setattr(head_module, "MAX_TOKENS", 4)
    model, _ = tiny_random("llama")
    pin(model)
    head_calls.clear()  # pinning probes
    ids = repetitive_prompt(6)
    model_logits(model, {"input_ids": ids[:, :5]})
    assert not head_calls
    model_logits(model, {"input_ids": ids[:, :4]})
    assert len(head_calls) == 1
