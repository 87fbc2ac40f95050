"""Architectures beyond the tiny test set that a speculative run must either reproduce or refuse.

Each was found by building every causal-LM type transformers has at toy size and comparing
specdec with ``generate()``: a BERT-like model loaded without ``is_decoder=True`` attends both
ways (a block of drafts would see later tokens); BART-like decoders number tokens by their cache
slots (rows that accept different numbers of drafts move; BLOOM, without position_ids too, does
not); CPM-Ant's cached forward takes one token at a time; Gemma 4 gives head sizes per layer;
``generate()`` passes an empty ``mm_encoder_outputs`` to models that take one.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdec import SpecDecoder
from specdec.call_inputs import prefill_only
from specdec.modelinfo import kv_layout

from helpers import repetitive_prompt


def _tiny(model_type: str, **config):
    settings = dict(vocab_size=320, eos_token_id=256, pad_token_id=257, bos_token_id=256)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings, **config)).eval()


def _generate(model, ids, mask=None):
    return model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=257)


BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)


def test_a_model_that_attends_both_ways_is_refused_and_decodes_once_loaded_as_a_decoder():
    ids = repetitive_prompt(12)
    with pytest.raises(ValueError, match="BertLMHeadModel attends both ways .*is_decoder=True"):
        SpecDecoder(_tiny("bert", **BERT), "prompt_lookup").generate(ids, max_new_tokens=12)
    causal = _tiny("bert", is_decoder=True, **BERT)
    out = SpecDecoder(causal, "prompt_lookup").generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, _generate(causal, ids))


def test_a_model_numbering_tokens_by_cache_slot_decodes_one_row_at_a_time():
    model = _tiny("bart", d_model=32, decoder_layers=2, encoder_layers=2, decoder_attention_heads=2,
                  encoder_attention_heads=2, decoder_ffn_dim=64, encoder_ffn_dim=64, max_position_embeddings=128)
    ids = torch.cat([repetitive_prompt(12, seed=0), repetitive_prompt(12, seed=1)])
    with pytest.raises(ValueError, match="BartForCausalLM.forward takes no position_ids and numbers tokens by their cache slots.*one row at a time"):
        SpecDecoder(model, "prompt_lookup").generate(ids, max_new_tokens=12)
    out = SpecDecoder(model, "prompt_lookup").generate(ids[:1], max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, _generate(model, ids[:1]))


def test_a_model_without_position_ids_that_does_not_count_slots_decodes_batches():
    model = _tiny("bloom", hidden_size=32, n_layer=2, n_head=2)  # ALiBi from the mask: no position_ids taken
    ids = torch.cat([repetitive_prompt(12, seed=0), repetitive_prompt(12, seed=1)])
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 257, 0
    out = SpecDecoder(model, "prompt_lookup").generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, _generate(model, ids, mask))


def test_a_model_stepping_one_token_at_a_time_is_refused_by_name():
    model = _tiny("cpmant", hidden_size=32, num_attention_heads=2, dim_head=16, dim_ff=64, num_hidden_layers=2,
                  prompt_length=4, position_bias_num_buckets=8, position_bias_max_distance=64)
    with pytest.raises(ValueError, match="CpmAntForCausalLM's forward after a cache cannot verify a block of drafts"):
        SpecDecoder(model, "prompt_lookup").generate(repetitive_prompt(12), max_new_tokens=4)


@pytest.mark.parametrize("model_type, config, name", [
    ("xlm", dict(emb_dim=32, n_layers=2, n_heads=2, max_position_embeddings=128), "XLMWithLMHeadModel"),
    ("xlstm", dict(embedding_dim=128, hidden_size=128, num_heads=8, num_hidden_layers=2), "xLSTMForCausalLM"),
])
def test_models_whose_forward_cannot_take_a_block_after_a_cache_are_refused_by_name(model_type, config, name):
    model = _tiny(model_type, **config)  # XLM re-feeds the whole sequence; xLSTM's cache is recurrent
    with pytest.raises(ValueError, match=f"{name}'s forward after a cache cannot verify a block of drafts"):
        SpecDecoder(model, "prompt_lookup").generate(repetitive_prompt(12), max_new_tokens=4)


def test_self_draft_on_a_model_with_head_sizes_per_layer():
    model = _tiny("gemma4_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, global_head_dim=32, max_position_embeddings=256,
                  layer_types=["sliding_attention", "full_attention"], sliding_window=16, hidden_size_per_layer_input=16)
    assert kv_layout(model) == (2, (2, 2), (16, 32))
    ids = repetitive_prompt(12)
    out = SpecDecoder(model, "self_draft", weights="bfloat16").generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, _generate(model, ids))


def test_empty_model_inputs_count_as_left_out():
    model = _tiny("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    mask = torch.ones(1, 4, dtype=torch.long)
    assert prefill_only(model, {"mm_encoder_outputs": {}, "pixel_values": None}, mask, prepared=True) == {}
