"""Edges of what a call passes, through both doors (``SpecDecoder.generate`` and
``model.generate(custom_generate=specdec.generate)``): a prompt with no mask, pad and EOS ids, the
model keywords ``generate()`` handles per step (``specdec/call_inputs.py``), and settings read
their own way (an explicit ``stop_strings=None``, a quantized cache). Each case equals
``generate()`` or is refused by name before any forward."""

from __future__ import annotations

import pytest
import torch
from helpers import left_pad

import specdec
from specdec import SpecDecoder, load_model

PAD = 257  # tiny-random:llama: pad 257, EOS 256


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny-random:llama")[0]


def both_doors(model, ids, draft="prompt_lookup", mask=None, **settings):
    """-> (SpecDecoder's sequences, custom_generate's sequences)."""
    ours = SpecDecoder(model, draft).generate(ids, mask, **settings).sequences
    hooked = model.generate(ids, attention_mask=mask, do_sample=False, custom_generate=specdec.generate, draft=draft,
                            **settings)
    return ours, hooked


def test_a_padded_batch_without_its_mask_is_unpadded_as_generate_does(llama):
    """generate() takes the pad id's columns as padding when no mask is given (unless the pad id is
    an EOS id); SpecDecoder fed them as tokens."""
    ids = torch.tensor([[PAD, PAD, PAD, 5, 6, 5], [1, 2, 3, 4, 1, 2]])
    want = llama.generate(ids, max_new_tokens=8, do_sample=False)
    for got in both_doors(llama, ids, max_new_tokens=8):
        assert torch.equal(got, want)
    as_eos = llama.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=PAD)  # no inference: all tokens
    assert torch.equal(SpecDecoder(llama, "prompt_lookup").generate(ids, max_new_tokens=8, eos_token_id=PAD).sequences,
                       as_eos)
    with pytest.raises(ValueError, match="row 0 has a hole .*no attention_mask was given.*pad_token_id"):
        SpecDecoder(llama).generate(torch.tensor([[1, 2, PAD, 4]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="right-padded.*no attention_mask was given.*pad_token_id"):
        SpecDecoder(llama).prefill(torch.tensor([[1, 2, 4, PAD]]))  # a prefix ending in the pad id
    decoder = SpecDecoder(llama, "prompt_lookup")  # a prefix given without its mask is read the same way
    prefix = decoder.prefill(ids[:, :4])
    assert torch.equal(decoder.generate(ids, max_new_tokens=8, prefix=prefix).sequences, want)


def test_finished_rows_are_padded_with_the_first_eos_as_listed(llama):
    """With no pad id, generate() pads with eos_token_id[0] as the list gives it; custom_generate
    took the smallest id."""
    ids, mask = left_pad([torch.tensor([5]), torch.tensor([1, 2, 3, 4])], pad_id=PAD)
    first = int(llama.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, eos_token_id=None)[0, -1])
    settings = dict(max_new_tokens=5, eos_token_id=[first, 3], pad_token_id=None)
    want = llama.generate(ids, attention_mask=mask, do_sample=False, **settings)
    assert want[0, -1] == first != 3  # row 0 stopped at once and was padded with the first id
    for got in both_doors(llama, ids, mask=mask, **settings):
        assert torch.equal(got, want)


def test_a_pad_id_past_the_vocabulary_only_pads_the_output(llama):
    """generate() writes the pad id into finished rows only; specdec filled its own unattended
    slots with it and the embedding lookup failed."""
    ids, mask = left_pad([torch.tensor([3, 4]), torch.tensor([5, 6, 7, 8])], pad_id=0)
    want = llama.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=1000)
    for got in both_doors(llama, ids, mask=mask, max_new_tokens=6, pad_token_id=1000):
        assert torch.equal(got, want)


@pytest.mark.parametrize("keyword", ["labels", "use_cache", "logits_to_keep", "position_ids"])
def test_model_keywords_that_change_no_token_are_dropped(llama, keyword):
    ids, mask = left_pad([torch.tensor([5, 6, 7, 5, 6]), torch.tensor([1, 2, 3, 1, 2, 3, 1])], pad_id=PAD)
    value = {"labels": ids, "use_cache": False, "logits_to_keep": 1,
             "position_ids": (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)}[keyword]
    want = llama.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **{keyword: value})
    for got in both_doors(llama, ids, mask=mask, max_new_tokens=8, **{keyword: value}):
        assert torch.equal(got, want)


def test_model_keywords_that_change_tokens_are_refused_by_name(llama):
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    embeds = llama.get_input_embeddings()(ids).detach()
    shifted = torch.arange(5)[None] + 3
    for door in (lambda **kw: SpecDecoder(llama).generate(ids, max_new_tokens=2, **kw),
                 lambda **kw: llama.generate(ids, max_new_tokens=2, custom_generate=specdec.generate, **kw)):
        with pytest.raises(ValueError, match="inputs_embeds: specdec decodes from token ids"):
            door(inputs_embeds=embeds)
        with pytest.raises(ValueError, match="position_ids other than the attention mask's running count"):
            door(position_ids=shifted)
    with pytest.raises(ValueError, match="inputs_embeds: specdec decodes from token ids"):  # no input_ids at all
        llama.generate(inputs_embeds=embeds, max_new_tokens=2, custom_generate=specdec.generate)
    with pytest.raises(ValueError, match="logits_to_keep as a tensor"):
        SpecDecoder(llama).generate(ids, max_new_tokens=2, logits_to_keep=torch.tensor([4]))
    with pytest.raises(ValueError, match="cache_position: specdec places every token itself"):
        SpecDecoder(llama).generate(ids, max_new_tokens=2, cache_position=torch.arange(5))


def test_token_types_of_a_text_model_are_refused():
    """GPT-2 adds a token-type embedding at every position, and generate() extends the types with
    each row's last one; specdec passed them at the prefill only, and the output differed."""
    gpt2 = load_model("tiny-random:gpt2")[0]
    ids = torch.tensor([[215, 20, 132, 248, 207, 155]])
    types = torch.tensor([[50, 2, 1, 1, 2, 1]])
    assert not torch.equal(gpt2.generate(ids, token_type_ids=types, max_new_tokens=8, do_sample=False),
                           gpt2.generate(ids, max_new_tokens=8, do_sample=False))  # the types matter here
    for door in (lambda: SpecDecoder(gpt2).generate(ids, max_new_tokens=2, token_type_ids=types),
                 lambda: gpt2.generate(ids, token_type_ids=types, max_new_tokens=2, custom_generate=specdec.generate)):
        with pytest.raises(ValueError, match="token_type_ids on GPT2LMHeadModel"):
            door()


def test_stop_strings_none_on_the_call_overrides_the_config_and_the_calls_tokenizer_reads_them(llama):
    tokenizer = load_model("tiny-random:llama")[1]
    ids = torch.tensor([list(b"hello hello")])
    free = llama.generate(ids, max_new_tokens=12, do_sample=False)
    stop = tokenizer.decode(free[0, ids.shape[1] + 2:ids.shape[1] + 3])  # the third new token's text
    llama.generation_config.stop_strings = [stop]
    try:
        decoder = SpecDecoder(llama, "prompt_lookup", tokenizer=tokenizer)
        assert decoder.generate(ids, max_new_tokens=12).sequences.shape[1] <= ids.shape[1] + 3  # the config's
        assert torch.equal(decoder.generate(ids, max_new_tokens=12, stop_strings=None).sequences, free)
        want = llama.generate(ids, max_new_tokens=12, do_sample=False, tokenizer=tokenizer)  # generate()'s keyword
        assert torch.equal(SpecDecoder(llama, "prompt_lookup").generate(ids, max_new_tokens=12,
                                                                        tokenizer=tokenizer).sequences, want)
    finally:
        llama.generation_config.stop_strings = None


def test_a_quantized_cache_is_refused(llama):
    with pytest.raises(ValueError, match="cache_implementation='quantized' .a quantized key/value cache"):
        SpecDecoder(llama).generate(torch.tensor([[5, 6]]), max_new_tokens=2, cache_implementation="quantized")
