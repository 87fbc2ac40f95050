"""``model.generate(custom_generate=specdec.generate, draft=...)``, pipelines and the Hub-layout folder.

The same decode run as ``SpecDecoder.generate``: greedy output equals ``model.generate()``'s with
the same settings (processors included) for every kind of draft, one prompt and a left-padded
batch; ``return_dict_in_generate`` gives ``generate()``'s output type with the statistics; the
streamer gets the prompt once and then exactly the committed tokens; a text-generation pipeline
returns the plain pipeline's text; ``hub/specdec_custom_generate`` loads by local path (offline,
``trust_remote_code=True``); the drafter a call builds is kept per model, shared by threads, and
released on request; options holding an object (a head module) are never matched to an earlier
call's.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import StoppingCriteriaList, StopStringCriteria, pipeline
from transformers.generation.utils import GenerateDecoderOnlyOutput

import specdec
from specdec.integration import DRAFTERS, release
from specdec.models import tiny_random
from specdec.prompts import left_pad

from helpers import RecordingStreamer, perturbed_copy, pin_costs, repetitive_prompt

HUB = Path(__file__).resolve().parent.parent / "hub" / "specdec_custom_generate"
NEW = 16
MIX = {"repetition_penalty": 1.2, "no_repeat_ngram_size": 3, "min_new_tokens": 4, "bad_words_ids": [[17], [30, 31]]}


@pytest.fixture(scope="module")
def model():
    target, tokenizer = tiny_random("llama", seed=1)
    return pin_costs(target), perturbed_copy(target, 0.3, seed=101), tokenizer


@pytest.fixture(scope="module")
def prompts(model):
    target, _, tokenizer = model
    single = repetitive_prompt(10)
    rows = [repetitive_prompt(n, seed=n)[0] for n in (4, 10, 7)]
    batch = left_pad(rows, tokenizer.pad_token_id)
    references = {shape: target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **MIX)
                  for shape, (ids, mask) in {"single": (single, torch.ones_like(single)), "batch": batch}.items()}
    return {"single": (single, torch.ones_like(single)), "batch": batch}, references


def drafts(target, draft):
    return {"name": ("prompt_lookup", {"num_tokens": 4, "schedule": "fixed"}),
            "model": (draft, {"num_tokens": 4, "schedule": "fixed"}),
            "self_draft": ("self_draft", {"weights": "bfloat16", "compile_draft": False}),
            "instance": (specdec.get_candidate_generator("prompt_lookup")(num_tokens=3, schedule="fixed"), None),
            "none": (None, None)}


@pytest.mark.parametrize("shape", ["single", "batch"])
@pytest.mark.parametrize("kind", ["name", "model", "self_draft", "instance", "none"])
def test_custom_generate_equals_generate(model, prompts, kind, shape):
    target, draft, _ = model
    (ids, mask), references = prompts[0][shape], prompts[1]
    drafter, options = drafts(target, draft)[kind]
    out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, custom_generate=specdec.generate,
                          draft=drafter, draft_options=options, **MIX)
    assert torch.equal(out, references[shape])


@pytest.mark.parametrize("shape", ["single", "batch"])
def test_stop_strings_as_the_criterion_generate_builds_stop_as_generate_does(model, prompts, shape, module_cache):
    """generate() (5.25) gives a callable loop no ``tokenizer``, so stop strings reach it as the
    StopStringCriteria generate() would build; the Hub-layout folder builds it from
    ``stop_strings=`` and ``tokenizer=`` itself."""
    target, _, tokenizer = model
    ids, mask = prompts[0][shape]
    text = tokenizer.decode(target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)[0, -6:-4])
    common = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    want = target.generate(ids, stop_strings=[text], tokenizer=tokenizer, **common)
    drafting = dict(draft="prompt_lookup", draft_options={"num_tokens": 4, "schedule": "fixed"})
    got = target.generate(ids, custom_generate=specdec.generate,
                          stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, [text])]),
                          **drafting, **common)
    assert torch.equal(got, want)
    hub = target.generate(ids, custom_generate=str(HUB), trust_remote_code=True, stop_strings=[text],
                          tokenizer=tokenizer, **drafting, **common)
    assert torch.equal(hub, want)
    target.generation_config.stop_strings = [text]  # the config's, as a model may ship them
    try:
        hub = target.generate(ids, custom_generate=str(HUB), trust_remote_code=True, tokenizer=tokenizer, **drafting,
                              **common)
    finally:
        target.generation_config.stop_strings = None
    assert torch.equal(hub, want)


def test_a_misspelt_decoder_option_is_named_as_one(model, prompts):
    target, _, _ = model
    ids, mask = prompts[0]["single"]
    with pytest.raises(TypeError, match=r"decoder_options: unknown SpecDecoder setting\(s\) \['cache_implementaton'\]"
                                        r"\. Did you mean 'cache_implementation'\?"):
        target.generate(ids, attention_mask=mask, max_new_tokens=NEW, custom_generate=specdec.generate,
                        draft="prompt_lookup", decoder_options={"cache_implementaton": "static"})


def test_the_dict_output_is_generates_with_the_statistics(model, prompts):
    target, draft, _ = model
    ids, mask = prompts[0]["batch"]
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, return_dict_in_generate=True, output_scores=True, **MIX)
    out = target.generate(ids, custom_generate=specdec.generate, draft=draft,
                          draft_options={"num_tokens": 3, "schedule": "fixed"}, **kwargs)
    ref = target.generate(ids, do_sample=False, **kwargs)
    assert isinstance(out, GenerateDecoderOnlyOutput) and torch.equal(out.sequences, ref.sequences)
    assert out.stats.steps > 0 and out.stats.drafted_tokens > 0
    assert len(out.scores) == len(ref.scores) and out.logits is None
    full = (out.sequences[:, ids.shape[1]:] != target.generation_config.pad_token_id).all(1)  # rows that never ended
    for ours, theirs in zip(out.scores, ref.scores):
        assert torch.allclose(ours[full].nan_to_num(0, 0, 0), theirs[full].nan_to_num(0, 0, 0), atol=1e-4)


def test_the_streamer_gets_the_prompt_once_then_the_committed_tokens(model, prompts):
    """transformers 5.24 gives the streamer the prompt and leaves it out of the callable's arguments:
    the run finds it in generate()'s call."""
    target, _, _ = model
    ids, mask = prompts[0]["single"]
    streamer = RecordingStreamer()
    out = target.generate(ids, max_new_tokens=NEW, custom_generate=specdec.generate, draft="prompt_lookup",
                          streamer=streamer, **MIX)
    assert streamer.ended and torch.equal(torch.cat(streamer.puts), out[0])
    assert torch.equal(streamer.puts[0], ids[0])


def test_a_pipeline_returns_the_plain_pipelines_text(model):
    target, draft, tokenizer = model
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    text = "the theme of the theme of the"
    plain = pipe(text, max_new_tokens=NEW, do_sample=False, **MIX)
    for drafter in ("prompt_lookup", draft):
        assert pipe(text, max_new_tokens=NEW, do_sample=False, custom_generate=specdec.generate, draft=drafter,
                    **MIX) == plain
    # several sampled texts per prompt (top_k=1: each step draws the argmax, so the texts are known)
    several = dict(max_new_tokens=NEW, do_sample=True, top_k=1, num_return_sequences=3, **MIX)
    assert pipe(text, **several, custom_generate=specdec.generate, draft="prompt_lookup") == pipe(text, **several)


@pytest.fixture
def module_cache(tmp_path, monkeypatch):
    """transformers copies a custom_generate module into its modules cache: a temporary one here."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_hub_folder_loads_by_path_offline(model, prompts, module_cache):
    target, _, _ = model
    ids, mask = prompts[0]["batch"]
    out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, custom_generate=str(HUB),
                          trust_remote_code=True, draft="prompt_lookup", **MIX)
    assert torch.equal(out, prompts[1]["batch"])
    with pytest.raises(ValueError, match="trust_remote_code"):
        target.generate(ids, attention_mask=mask, max_new_tokens=NEW, custom_generate=str(HUB), draft="prompt_lookup")


def test_the_drafter_is_kept_per_model_shared_by_threads_and_released(model, prompts):
    target, _, _ = model
    ids, mask = prompts[0]["single"]
    release(target)
    call = lambda: target.generate(ids, max_new_tokens=NEW, custom_generate=specdec.generate,  # noqa: E731
                                   draft="self_draft", draft_options={"weights": "bfloat16", "compile_draft": False},
                                   **MIX)
    assert torch.equal(call(), prompts[1]["single"])
    (generator,) = DRAFTERS.generators(target)
    outputs = []
    threads = [threading.Thread(target=lambda: outputs.append(call())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outputs) == 4 and all(torch.equal(o, prompts[1]["single"]) for o in outputs)
    assert DRAFTERS.count(target) == 1 and DRAFTERS.generators(target) == [generator]
    assert len(generator._copies._made[target]) == 1  # the low-precision copy, built once
    release(target)
    assert DRAFTERS.count(target) == 0


@pytest.mark.parametrize("settings,name", [({"num_beams": 2}, "num_beams"),
                                           ({"output_hidden_states": True}, "output_hidden_states")])
def test_what_cannot_be_reproduced_is_refused_by_name(model, settings, name):
    target, _, _ = model
    with pytest.raises(ValueError, match=name):
        target.generate(repetitive_prompt(4), max_new_tokens=4, custom_generate=specdec.generate,
                        draft="prompt_lookup", **settings)


def test_a_draft_with_another_tokenizer_takes_both_tokenizers():
    """generate() keeps its own tokenizer argument from a callable: the cross-tokenizer draft gets
    them as target_tokenizer= and draft_tokenizer=."""
    from specdec.models import byte_tokenizer

    target_tok = byte_tokenizer([("Ġ", "t"), ("h", "e"), ("Ġt", "he")])
    draft_tok = byte_tokenizer([("t", "h"), ("th", "e"), ("Ġ", "the")])
    target = pin_costs(tiny_random("llama", seed=7, tokenizer=target_tok)[0])
    draft = perturbed_copy(target, 0.1, seed=8)  # the byte ids mean the same in both tokenizers
    ids = target_tok("the theme of the theme of the", return_tensors="pt").input_ids
    want = target.generate(ids, max_new_tokens=NEW, do_sample=False, **MIX)
    out = target.generate(ids, max_new_tokens=NEW, custom_generate=specdec.generate, draft=draft,
                          target_tokenizer=target_tok, draft_tokenizer=draft_tok,
                          draft_options={"num_tokens": 4, "schedule": "fixed"}, return_dict_in_generate=True, **MIX)
    assert torch.equal(out.sequences, want) and out.stats.generator["steps"] > 0  # the cross-tokenizer generator ran


def test_options_holding_a_module_draft_with_that_module_never_an_earlier_calls(model, prompts):
    """Two heads of one shape have the same ``repr``: the second call must draft with its own."""
    from candidate_generators.eagle3 import Eagle3Head, HeadConfig

    target, _, _ = model
    ids, _ = prompts[0]["single"]
    release(target)
    vocab = target.config.vocab_size
    used = {}
    heads = []
    for seed in (0, 1):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            head = Eagle3Head(HeadConfig.for_target(target.config, draft_vocab_size=vocab))
        head.set_vocab(torch.arange(vocab))
        for part in head.modules():  # drafting calls its parts
            part.register_forward_pre_hook(lambda *_, seed=seed: used.__setitem__(seed, used.get(seed, 0) + 1))
        heads.append(head.eval())
    for seed, head in enumerate(heads):
        out = target.generate(ids, max_new_tokens=NEW, custom_generate=specdec.generate, draft="eagle3",
                              draft_options={"head": head, "schedule": "fixed", "num_tokens": 3}, **MIX)
        assert torch.equal(out, prompts[1]["single"])
        assert used.get(seed, 0) > 0 and sum(used.values()) == used[seed], used  # this call's head alone drafted
        used.clear()
    assert DRAFTERS.count(target) == 0  # the caller's modules are not kept alive by the table


def test_arguments_generate_keeps_from_the_callable_are_still_read(model, prompts):
    """transformers leaves synced_gpus and assistant_model out of a custom_generate callable's
    arguments: both were ignored silently (the call ran without DeepSpeed's sync, or without the
    named assistant); they are read from generate()'s own frame, as the streamer is."""
    target, draft, _ = model
    ids, mask = prompts[0]["single"]
    call = dict(attention_mask=mask, max_new_tokens=4, custom_generate=specdec.generate, draft="prompt_lookup")
    with pytest.raises(ValueError, match="synced_gpus=True .* is not supported"):
        target.generate(ids, synced_gpus=True, **call)
    with pytest.raises(ValueError, match="assistant_model= is transformers' own assisted generation"):
        target.generate(ids, assistant_model=draft, **call)
