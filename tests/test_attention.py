"""Grouped-query attention without copies of the cache (specdec/engines/forwards/attention.py): the same
numbers as transformers' ``sdpa``, used only inside specdec's own eager forwards on a CPU."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdec import SpecDecoder
from specdec.engines.forwards.attention import GROUPED_SDPA, folded_sdpa, grouped_attention, grouped_sdpa
from specdec.models import tiny_random

from helpers import DRAFTING_PAYS, pin_costs, repetitive_prompt


def _attention_inputs(queries: int, groups: int):
    """query [2, kv * groups, q, D], key/value [2, kv, S, D] and a causal mask [2, 1, q, S] with
    row 1 left-padded by 3 slots."""
    g = torch.Generator().manual_seed(queries * 10 + groups)
    batch, kv_heads, slots, dim = 2, 2, 11, 8
    query = torch.randn(batch, kv_heads * groups, queries, dim, generator=g)
    key, value = (torch.randn(batch, kv_heads, slots, dim, generator=g) for _ in range(2))
    causal = torch.arange(slots)[None, :] <= (slots - queries + torch.arange(queries))[:, None]  # [q, S]
    mask = causal[None, None] & (torch.arange(slots) >= torch.tensor([0, 3])[:, None])[:, None, None]
    return query, key, value, mask


@pytest.mark.parametrize("queries", [1, 2, 5])
@pytest.mark.parametrize("groups", [1, 3])
def test_grouped_sdpa_is_sdpa_bit_for_bit_on_a_cpu(queries, groups):
    """On a CPU the grouped attention gives exactly transformers' numbers (repeated keys and
    values for several queries, its own folding for one): the target's logits do not change."""
    query, key, value, mask = _attention_inputs(queries, groups)
    module = types.SimpleNamespace(num_key_value_groups=groups, is_causal=True)
    got, _ = grouped_sdpa(module, query, key, value, mask, scaling=8 ** -0.5)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=8 ** -0.5)
    assert got.shape == want.shape == (2, queries, 2 * groups, 8)
    assert torch.equal(got, want)


@pytest.mark.parametrize("queries", [1, 2, 5])
def test_folded_sdpa_is_sdpa(queries):
    """Query heads folded into rows of their key/value head (the copies' attention off a CPU, or
    compiled) is the same attention, up to rounding."""
    query, key, value, mask = _attention_inputs(queries, 3)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=8 ** -0.5)
    torch.testing.assert_close(folded_sdpa(query, key, value, mask, 3, scaling=8 ** -0.5), want)


def test_grouped_attention_holds_only_inside_its_block_and_only_on_a_cpu():
    model = tiny_random("llama")[0]
    config = model.config
    with grouped_attention(model, torch.device("cpu")):
        assert config._attn_implementation == GROUPED_SDPA
    assert config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"):
        with grouped_attention(model, torch.device("cpu")):
            raise RuntimeError("inside")
    assert config._attn_implementation == "sdpa"
    with grouped_attention(model, torch.device("meta")):  # another device: transformers' own
        assert config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    with grouped_attention(model, torch.device("cpu")):  # only sdpa is replaced
        assert config._attn_implementation == "eager"


def test_a_call_verifies_with_grouped_attention_and_leaves_the_model_as_it_was():
    target = pin_costs(tiny_random("llama", seed=1)[0], DRAFTING_PAYS, rate=0.0)  # drafting pays: drafts are verified
    assert target.model.layers[0].self_attn.num_key_value_groups > 1
    seen = []
    handle = target.register_forward_pre_hook(lambda module, args: seen.append(module.config._attn_implementation))
    ids = repetitive_prompt(12)
    try:
        out = SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=16)
    finally:
        handle.remove()
    assert GROUPED_SDPA in seen and target.config._attn_implementation == "sdpa"
    assert out.stats.drafts_verified[1:] and sum(out.stats.drafts_verified[1:]) > 0  # several-token forwards ran
    want = target.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(out.sequences, want)
