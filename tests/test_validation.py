"""Bad input gets one clear error before any forward; the user's objects are never modified.

Every refusal below runs with a :class:`ForwardRecorder` on the target and the draft: the
error must come with zero forwards of either model (validation happens before any work), its
message must name the problem, and the models (state dicts, configs, generation configs,
train/eval mode) must be exactly as before. A successful greedy and a successful sampled run
must leave the models and the caller's tensors and lists unchanged too.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

from candidate_generators.draft_model import DraftModelGenerator
from specdec import SpecDecoder
from specdec.tiny import byte_tokenizer, tiny_random

from helpers import ForwardRecorder, left_pad, perturbed_copy, repetitive_prompt




@pytest.fixture(scope="module")
def models():
    target, tokenizer = tiny_random("llama", seed=2)
    draft = perturbed_copy(target, 0.3, seed=7)
    return target, draft, tokenizer


def snapshot(model) -> dict:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "config": model.config.to_dict(),
        "generation_config": model.generation_config.to_dict(),
        "training": model.training,
        "requires_grad": [p.requires_grad for p in model.parameters()],
    }


def assert_unchanged(model, before: dict) -> None:
    after = snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    for name, tensor in before["state"].items():
        assert after["state"][name].shape == tensor.shape and torch.equal(after["state"][name], tensor), name
    for key in ("config", "generation_config", "training", "requires_grad"):
        assert after[key] == before[key], key


def mamba(vocab_size: int = 320) -> MambaForCausalLM:
    """A tiny recurrent model: its state cannot be rolled back to discard rejected drafts."""
    config = MambaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, state_size=4,
                         eos_token_id=256, bos_token_id=256, pad_token_id=257)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return MambaForCausalLM(config).eval()


def refuse(models_to_watch, call, match: str) -> Exception:
    """Run ``call``; it must raise one error matching ``match`` before any forward of any model."""
    before = [snapshot(m) for m in models_to_watch]
    recorders = [ForwardRecorder(m) for m in models_to_watch]
    try:
        with pytest.raises((ValueError, TypeError, KeyError)) as info:
            call()
    finally:
        for r in recorders:
            r.remove()
    assert re.search(match, str(info.value), re.IGNORECASE), str(info.value)
    for r in recorders:
        assert r.calls == [], f"{len(r.calls)} forwards before the error"
    for m, b in zip(models_to_watch, before):
        assert_unchanged(m, b)
    return info.value


PROMPT = repetitive_prompt(8, seed=1)  # [1, 20]


# -- the arguments of generate() -------------------------------------------------------------------
CALL_CASES = {
    "right_padded": (dict(input_ids=torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]]),
                          attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])),
                     r"right-padded.*left"),
    "max_new_tokens_zero": (dict(max_new_tokens=0), "max_new_tokens"),
    "max_new_tokens_negative": (dict(max_new_tokens=-3), "max_new_tokens"),
    "max_new_tokens_float": (dict(max_new_tokens=2.5), "max_new_tokens"),
    "empty_prompt": (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty"),
    "empty_row": (dict(input_ids=torch.tensor([[5, 6], [7, 8]]), attention_mask=torch.tensor([[1, 1], [0, 0]])),
                  "empty"),
    "temperature_zero": (dict(do_sample=True, temperature=0.0), "temperature"),
    "temperature_negative": (dict(do_sample=True, temperature=-1.0), "temperature"),
    "top_k_negative": (dict(do_sample=True, top_k=-1), "top_k"),
    "top_p_out_of_range": (dict(do_sample=True, top_p=1.5), "top_p"),
    "stop_strings_without_tokenizer": (dict(stop_strings=["ab"]), "tokenizer"),
    "streamer_with_batch": (dict(input_ids=torch.tensor([[5, 6], [7, 8]]), streamer=object()),
                            "streamer.*batch"),
    "ids_outside_vocabulary": (dict(input_ids=torch.tensor([[5, 6, 5000]])), "vocabulary"),
    "float_input_ids": (dict(input_ids=torch.tensor([[5.0, 6.0]])), "integer"),
    "unknown_model_input": (dict(not_an_input_of_llama=torch.ones(1)), "not_an_input_of_llama"),
}


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
@pytest.mark.parametrize("case", list(CALL_CASES))
def test_bad_arguments_are_refused_before_any_forward(models, case, drafter):
    target, draft, _ = models
    overrides, match = CALL_CASES[case]
    kwargs = {"input_ids": PROMPT, "max_new_tokens": 8, **overrides}
    decoder = SpecDecoder(target, draft if drafter == "draft_model" else drafter)  # no tokenizer
    inputs = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    refuse([target, draft], lambda: decoder.generate(**kwargs), match)
    for k, v in inputs.items():
        assert torch.equal(kwargs[k], v)


# -- models that cannot be paired or rolled back --------------------------------------------------
def test_draft_with_a_very_different_vocabulary_points_to_cross_tokenizer(models):
    target, _, _ = models
    big, _ = tiny_random("llama", seed=2, vocab_size=4096)
    refuse([target, big], lambda: SpecDecoder(target, big).generate(PROMPT, max_new_tokens=8),
           r"vocabular.*cross-tokenizer")


def test_draft_with_another_tokenizer_is_refused_by_draft_model(models):
    target, draft, tokenizer = models
    other = byte_tokenizer(extra_merges=[("a", "b"), ("c", "d")])  # same bytes, two merges more
    generator = DraftModelGenerator(draft)  # forced: draft_model itself must refuse
    decoder = SpecDecoder(target, generator, tokenizer=tokenizer, draft_tokenizer=other)
    refuse([target, draft], lambda: decoder.generate(PROMPT, max_new_tokens=8), r"tokenizer.*cross-tokenizer")


def test_draft_with_other_end_of_sequence_ids_is_refused(models):
    target, draft, _ = models
    odd = copy.deepcopy(draft)
    odd.generation_config.eos_token_id = 7
    refuse([target, odd], lambda: SpecDecoder(target, odd).generate(PROMPT, max_new_tokens=8), "end-of-sequence")


def test_recurrent_target_is_refused():
    target = mamba()
    refuse([target], lambda: SpecDecoder(target, "prompt_lookup").generate(PROMPT, max_new_tokens=8),
           r"target.*cannot be rolled back")


def test_recurrent_draft_is_refused(models):
    target, _, _ = models
    draft = mamba()
    refuse([target, draft], lambda: SpecDecoder(target, draft).generate(PROMPT, max_new_tokens=8),
           r"cannot be rolled back")


def test_options_without_a_draft_and_unknown_options_are_refused(models):
    target, draft, _ = models
    with pytest.raises(TypeError, match="num_tokens"):
        SpecDecoder(target, num_tokens=3)
    with pytest.raises(TypeError, match="prompt_lookup"):
        SpecDecoder(target, "prompt_lookup", no_such_option=3)
    with pytest.raises(TypeError, match="draft"):
        SpecDecoder(target, 3.5)


# -- nothing of the user's is modified -------------------------------------------------------------
def test_successful_runs_leave_models_configs_and_inputs_unchanged(models):
    target, draft, tokenizer = models
    before = [snapshot(target), snapshot(draft)]
    rows = [repetitive_prompt(n, seed=n)[0] for n in (6, 14)]
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    ids_copy, mask_copy, prompt_copy = ids.clone(), mask.clone(), PROMPT.clone()
    eos, stops, criteria = [256, 11], ["zz"], []
    eos_copy, stops_copy = list(eos), list(stops)

    SpecDecoder(target, "prompt_lookup").generate(ids, mask, max_new_tokens=12, eos_token_id=eos)
    SpecDecoder(target, draft, tokenizer=tokenizer, num_tokens=3).generate(
        PROMPT, max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
        generator=torch.Generator().manual_seed(0), eos_token_id=eos, stop_strings=stops,
        stopping_criteria=criteria)
    SpecDecoder(target, draft).generate(ids, mask, max_new_tokens=12)

    assert_unchanged(target, before[0])
    assert_unchanged(draft, before[1])
    assert torch.equal(ids, ids_copy) and torch.equal(mask, mask_copy) and torch.equal(PROMPT, prompt_copy)
    assert eos == eos_copy and stops == stops_copy and criteria == []


def test_a_train_mode_model_is_left_in_train_mode(models):
    """Decoding runs without gradients and does not flip the user's module modes."""
    target, _, _ = models
    trained = copy.deepcopy(target).train()
    before = snapshot(trained)
    out = SpecDecoder(trained, "prompt_lookup").generate(PROMPT, max_new_tokens=6)
    assert out.sequences.requires_grad is False
    assert_unchanged(trained, before)


def test_a_rope_that_changes_with_the_length_is_refused_past_where_it_does():
    """Dynamic NTK and LongRoPE rotate by frequencies of the sequence's length: past their limit,
    generate()'s one-token steps and a verified block disagree (found by a randomized comparison)."""
    from specdec.tiny import tiny_random

    dynamic, _ = tiny_random("qwen3", seed=1, max_position_embeddings=8,
                             rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    longrope, _ = tiny_random("phi3", seed=1, max_position_embeddings=128, original_max_position_embeddings=32,
                              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                               "short_factor": [1.0 + i / 10 for i in range(8)],
                                               "long_factor": [2.0 + i / 2 for i in range(8)],
                                               "original_max_position_embeddings": 32})
    for model, limit in ((dynamic, 8), (longrope, 32)):
        ids = torch.tensor([[5, 6, 5, 6]])
        # 4 + limit - 3 tokens: generate() feeds limit positions (never the last token), within the limit: exact
        want = model.generate(ids, max_new_tokens=limit - 3, do_sample=False)
        assert torch.equal(SpecDecoder(model, "prompt_lookup").generate(ids, max_new_tokens=limit - 3).sequences, want)
        with pytest.raises(ValueError, match=f"changes its frequencies past {limit} positions"):
            SpecDecoder(model, "prompt_lookup").generate(ids, max_new_tokens=limit - 2)
