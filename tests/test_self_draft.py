"""``self_draft``: a lower-precision copy of the target drafts for it (optionally after prompt lookup).

Exactness with tiny models: greedy output equals ``target.generate(do_sample=False)`` with
bfloat16 and int8 copies, with and without prompt lookup first, batch 1 and batches; on a target
with flat logits the copy really disagrees (rejections occur) and output stays exact. Sampling
stays lossless (``test_sampling_lossless`` runs its end-to-end check with ``self_draft`` too).
The user's model is never modified; the copy is built once per decoder; its memory is reported.
"""

from __future__ import annotations

import builtins

import pytest
import torch

from candidate_generators.draft_model import DraftModelGenerator
from specdec.engines.forwards.int8 import Int8Linear
from specdec.engines.forwards.attention import GROUPED_SDPA
from specdec.engines.forwards.lowbit import build_copy
from candidate_generators.self_draft import merge, tensor_bytes
from specdec import SpecDecoder
from specdec.generators import Proposal
from specdec.kv import DynamicKV, StaticKV
from specdec.models import tiny_random
from specdec.policy import COST_GRID
from specdec.state import ModelState

from helpers import (DRAFTING_PAYS, FAST_COMPILE, assert_batch_is_exact, left_pad, pin_costs, repetitive_prompt, tiny_llava,
                     weights_checksum)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")
# int8 and w8a8 copies need torchao: the test command installs the quant extra


@pytest.fixture(scope="module")
def target():
    """A tiny Llama whose forwards are priced so that drafting always pays: the tests that assert
    drafts were accepted then hold whatever the machine's load (the policy's choices under real
    timings are test_policy's)."""
    return pin_costs(tiny_random("llama", seed=1)[0], DRAFTING_PAYS, rate=0.0)


@pytest.fixture(scope="module")
def flat_target():
    """Every output row has a near twin (1% apart), so the top two logits are close and a rounded
    copy often picks the other token of the pair (the copy reads the target's exact prompt keys
    and values, so rounding the hidden states alone must flip it)."""
    model = tiny_random("qwen3", seed=2)[0]
    with torch.no_grad():
        weight = model.get_output_embeddings().weight  # [V, H], V even
        noise = torch.randn(weight[1::2].shape, generator=torch.Generator().manual_seed(0))
        weight[1::2] = weight[0::2] * (1 + 1e-2 * noise)
    return model


@pytest.mark.parametrize("lookup", [False, True])
@pytest.mark.parametrize("weights", ["bfloat16", "int8", "w8a8"])
def test_self_draft_is_exact(target, weights, lookup):
    before = weights_checksum(target)
    decoder = SpecDecoder(target, "self_draft", weights=weights, lookup=lookup, compile_draft=FAST_COMPILE)
    ids = repetitive_prompt(12)
    out = decoder.generate(ids, max_new_tokens=40)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=40, do_sample=False))
    assert out.stats.accepted_tokens > 0
    assert_batch_is_exact(decoder, target)
    assert weights_checksum(target) == before  # the user's model is only read


def test_the_w8a8_copy_compiles_with_inductor_and_stays_exact(target):
    """A w8a8 copy whose one-token forwards inductor compiles, as a warm-up or ``compile_draft=True``
    runs it (the other tests here compile with aot_eager, or not at all); the compiling is timed
    apart from decoding."""
    decoder = SpecDecoder(target, "self_draft", weights="w8a8", compile_draft=True)
    ids = repetitive_prompt(20)
    out = decoder.generate(ids, max_new_tokens=32)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=32, do_sample=False))
    assert out.stats.accepted_tokens > 0 and out.stats.compile_seconds > 0
    assert any(isinstance(m, Int8Linear) for m in decoder.candidate_generator._copies.get(target, "w8a8").modules())


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "w8a8"])
def test_a_disagreeing_copy_is_rejected_and_output_stays_exact(flat_target, weights):
    decoder = SpecDecoder(flat_target, "self_draft", weights=weights, compile_draft=False, schedule="fixed",
                          num_tokens=6)
    ids = torch.randint(0, 250, (1, 20), generator=torch.Generator().manual_seed(0))
    out = decoder.generate(ids, max_new_tokens=60)
    assert torch.equal(out.sequences, flat_target.generate(ids, max_new_tokens=60, do_sample=False))
    assert 0 < out.stats.accepted_tokens < out.stats.drafted_tokens  # real rejections happened


def test_the_copy_is_built_once_per_decoder_and_its_memory_reported(target):
    decoder = SpecDecoder(target, "self_draft", weights="bfloat16", compile_draft=False)
    ids = repetitive_prompt(6)
    decoder.generate(ids, max_new_tokens=8)
    copies = decoder.candidate_generator._copies
    made = copies.get(target, "bfloat16")
    decoder.generate(ids, max_new_tokens=8)
    assert copies.get(target, "bfloat16") is made
    memory = decoder.candidate_generator.memory(target)
    stored = [*target.parameters(), *target.buffers()]  # fp32, nothing tied
    assert memory["target_bytes"] == sum(t.numel() * t.element_size() for t in stored)
    assert abs(memory["draft_bytes"] / memory["target_bytes"] - 0.5) < 0.01  # bfloat16: half of fp32
    int8 = tensor_bytes(build_copy(target, "int8"))
    assert int8 < memory["draft_bytes"]  # int8 linear weights: smaller again


def test_missing_torchao_names_the_extra(target, monkeypatch):
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(ImportError, match=r"specdec\[quant\]"):
        build_copy(target, "int8")
    build_copy(target, "bfloat16")  # needs no extra


def test_bad_options_and_vision_language_targets_are_refused(target):
    with pytest.raises(ValueError, match="weights must be one of"):
        SpecDecoder(target, "self_draft", weights="int3")
    with pytest.raises(TypeError, match="compile_draft"):
        SpecDecoder(target, "self_draft", compile_draft="always")
    with pytest.raises(ValueError, match="text-only"):
        build_copy(tiny_llava(), "bfloat16")
    narrow, _ = tiny_random("llama", seed=1, num_attention_heads=8, num_key_value_heads=1)  # k, v: 64 -> 8
    with pytest.raises(ValueError, match="weights='int4': a linear layer of 64 -> 8 features"):
        build_copy(narrow, "int4")  # torch's kernel raised from inside its packing


def _tiny_moe_reading_its_router_weight():
    """A tiny HunYuan MoE: its router reads ``self.wg.weight.dtype``, which an int8 layer lacks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("hunyuan_v1_moe", vocab_size=320, hidden_size=64, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  num_experts=4, moe_topk=2, max_position_embeddings=256, eos_token_id=256,
                                  pad_token_id=257, bos_token_id=256)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()


def test_a_copy_whose_forward_fails_is_refused_by_name_and_auto_takes_the_next():
    model = _tiny_moe_reading_its_router_weight()
    with pytest.raises(ValueError, match="a w8a8 copy of HunYuanMoEV1ForCausalLM does not run .*'Int8Linear'"):
        build_copy(model, "w8a8")  # not an AttributeError from inside the first draft of a call
    ids = repetitive_prompt(1, 36)
    decoder = SpecDecoder(model, "self_draft")
    out = decoder.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=257))
    made = out.stats.choices
    assert made["weights"] not in ("w8a8", "int4"), made
    assert "w8a8: not built (ValueError: a w8a8 copy of HunYuanMoEV1ForCausalLM does not run" in made["weights_choice"]


def test_self_draft_refuses_a_vision_language_target_before_trying_copies():
    with pytest.raises(ValueError, match="text-only"):  # was a RuntimeError after every candidate failed alike
        SpecDecoder(tiny_llava(), "self_draft").generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=2)


def test_merge_takes_each_row_from_its_source():
    lookup = Proposal(torch.tensor([[5, 6, 7], [0, 0, 0]]), torch.tensor([3, 0]))
    drafted = Proposal(torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 2]),
                       torch.softmax(torch.randn(2, 2, 10), dim=-1))
    merged = merge(lookup, drafted, use_second=torch.tensor([False, True]), vocab=10)
    assert merged.token_ids.tolist() == [[5, 6, 7], [3, 4, 0]]
    assert merged.lengths.tolist() == [3, 2]
    assert torch.equal(merged.probs[0, :3], torch.nn.functional.one_hot(torch.tensor([5, 6, 7]), 10).float())
    assert torch.equal(merged.probs[1, :2], drafted.probs[1])


@pytest.mark.parametrize("lookup_rates, chosen", [
    ([1.2, 0.8], [0, 0]),  # row 1 drafts from the copy, so the copy steps row 0 too: its drafts beat the match as made
    ([1.6, 0.8], [2, 0]),  # a match that beats even the copy's drafts as made is taken
    ([1.2, 1.2], [2, 2]),  # every row takes its match: the copy does not run, and its drafts cost their time
])
def test_the_hybrid_takes_a_match_only_where_it_beats_the_copys_drafts(monkeypatch, lookup_rates, chosen):
    """A row takes its prompt-lookup match where the policy expects it to pay at least as well as
    the copy; in a batch where the copy drafts for some row anyway (and so steps every row), it
    must beat the copy's drafts counted as made (``ctx.draft_rate(..., paid=True)``)."""
    from types import SimpleNamespace

    from candidate_generators.self_draft import SelfDraftGenerator

    gen = SelfDraftGenerator(weights="bfloat16", lookup=True)
    matches = Proposal(torch.tensor([[5, 6], [7, 8]]), torch.tensor([2, 2]), sources=torch.tensor([1, 1]))
    monkeypatch.setattr(gen.lookup, "propose", lambda ctx, max_drafts: matches)
    monkeypatch.setattr(DraftModelGenerator, "propose", lambda self, ctx, max_drafts: Proposal(
        torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([3, 3])))

    def draft_rate(counts, source=0, paid=False):
        if source == 0:
            return torch.full((2,), 1.5 if paid else 1.0, dtype=torch.float64)
        return torch.tensor(lookup_rates, dtype=torch.float64)

    ctx = SimpleNamespace(draft_rate=draft_rate, target_vocab_size=10)
    proposal = gen.propose(ctx, torch.tensor([3, 3]))
    assert proposal.sources.tolist() == chosen
    drafts = [row[:n] for row, n in zip(proposal.token_ids.tolist(), proposal.lengths.tolist())]
    assert drafts == [[[5, 6], [7, 8]][b] if source else [1, 2, 3] for b, source in enumerate(chosen)]


def test_warmup_compiles_the_draft_steps_and_nothing_later(target):
    from torch._dynamo.utils import counters

    decoder = SpecDecoder(target, "self_draft", weights="bfloat16", compile_draft=FAST_COMPILE, lookup=True)
    assert decoder.warmup(max_length=300) > 0  # the target stays eager; its draft compiles
    graphs = counters["stats"]["unique_graphs"]
    for seed, length in [(0, 5), (1, 40)]:
        ids = repetitive_prompt(length, seed=seed)
        out = decoder.generate(ids, max_new_tokens=40)
        assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=40, do_sample=False))
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("model,weights,refeed_limit,stop", [
    ("target", "bfloat16", 16, False), ("target", "w8a8", 16, False), ("target", "bfloat16", 0, False),
    ("flat_target", "w8a8", 0, False), ("flat_target", "w8a8", 0, True)])
def test_the_copy_mirrors_the_targets_cache(request, model, weights, refeed_limit, stop, monkeypatch):
    """The copy never feeds the prompt or a committed token: its cache starts as a copy of the
    target's prefill keys and values (in the copy's dtype) and takes the target's keys and values
    of each verified block; the first step verifies no drafts, and output stays exact, also when
    rows that drift apart are shifted in the cache every step (``REFEED_LIMIT`` 0; the flat target's
    rows accept different numbers of drafts): then a mirror copies the shifted rows whole and the
    others from where the last mirror left off, also after a row stopped at its end of sequence
    (``stop``) and left the batch."""
    target = request.getfixturevalue(model)
    monkeypatch.setattr(ModelState, "REFEED_LIMIT", refeed_limit)
    mirror, mirrored, partial, batches = ModelState.mirror, [], [], []
    for kind in (DynamicKV, StaticKV):
        def adopt(self, cache, slots, dtype, start=0, rows=None, _adopt=kind.adopt):
            batches.append((cache.layers[0].keys.shape[0], start))
            if start and rows is not None:
                partial.append(rows.numel() < cache.layers[0].keys.shape[0])
            _adopt(self, cache, slots, dtype, start=start, rows=rows)
        monkeypatch.setattr(kind, "adopt", adopt)

    def checked_mirror(self, other):  # after each mirror the copy holds exactly the target's slots
        mirror(self, other)
        slots = other.cached_slots
        for mine, theirs in zip(self.kv.cache.layers, other.kv.cache.layers):
            assert torch.equal(mine.keys[:, :, :slots], theirs.keys[:, :, :slots].to(mine.keys.dtype))
            assert torch.equal(mine.values[:, :, :slots], theirs.values[:, :, :slots].to(mine.values.dtype))
        mirrored.append(slots)

    monkeypatch.setattr(ModelState, "mirror", checked_mirror)
    decoder = SpecDecoder(target, "self_draft", weights=weights, compile_draft=False, schedule="fixed", num_tokens=3)
    copy = decoder.candidate_generator._copies.get(target, weights)
    fed: list[int] = []
    hook = copy.register_forward_pre_hook(lambda _m, _a, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    rows = [repetitive_prompt(30, seed=5)[0], repetitive_prompt(17, seed=6)[0], repetitive_prompt(24, seed=7)[0]]
    # an end of sequence the second row reaches early (the others may not)
    eos = int(target.generate(rows[1][None], max_new_tokens=6, do_sample=False)[0, -1]) if stop else []
    padded, mask = left_pad(rows, pad_id=257)
    try:
        out = decoder.generate(padded, mask, max_new_tokens=20, eos_token_id=eos)
    finally:
        hook.remove()
    for b, row in enumerate(rows):
        want = target.generate(row[None, :], max_new_tokens=20, do_sample=False, eos_token_id=eos)[0, row.numel():]
        assert torch.equal(out.sequences[b, padded.shape[1]: padded.shape[1] + want.numel()], want)
    assert len(mirrored) >= 2
    assert all(partial) and (bool(partial) or model != "flat_target")  # shifted rows copied alone
    if stop:  # after a row left, mirrors go on from where they left off
        assert next(start for batch, start in batches if batch == len(rows) - 1) > 0
    assert fed[0] == 1 and max(fed) <= 1 + refeed_limit  # the target's new token (and short re-feeds in a batch)
    assert out.stats.drafts_verified[0] >= 2  # the first step (both rows) verified no drafts
    assert out.stats.accepted_tokens > 0


def test_a_call_that_never_drafts_never_copies_the_targets_cache(monkeypatch):
    """The copy takes the target's cache the first time the policy asks for drafts: where a
    forward of more than one token a row costs far more than drafts could save, no step asks, and
    the cache is never copied; the output is the target's."""
    target = pin_costs(tiny_random("llama", seed=9)[0], tuple(float(x) ** 3 for x in COST_GRID), rate=0.0)
    mirror, mirrored = ModelState.mirror, []
    monkeypatch.setattr(ModelState, "mirror", lambda self, other: (mirrored.append(1), mirror(self, other)))
    rows = [repetitive_prompt(20, seed=3)[0], repetitive_prompt(12, seed=4)[0]]
    padded, mask = left_pad(rows, pad_id=257)
    out = SpecDecoder(target, "self_draft", weights="bfloat16", compile_draft=False).generate(
        padded, mask, max_new_tokens=12)
    for b, row in enumerate(rows):
        want = target.generate(row[None, :], max_new_tokens=12, do_sample=False)[0, row.numel():]
        assert torch.equal(out.sequences[b, padded.shape[1]: padded.shape[1] + want.numel()], want)
    assert out.stats.drafted_tokens == 0 and not mirrored


def test_prefill_from_target_refuses_another_cache_layout(target):
    other = tiny_random("llama", seed=3, num_hidden_layers=3)[0]

    class Borrower(DraftModelGenerator):
        def attach_options(self):
            return {"prefill_from_target": True}

    with pytest.raises(ValueError, match="cache layout"):
        SpecDecoder(target, Borrower(other)).generate(repetitive_prompt(6), max_new_tokens=4)


def test_the_copy_uses_grouped_sdpa_and_the_target_keeps_its_attention(target):
    made = build_copy(target, "bfloat16")
    assert made.config._attn_implementation == GROUPED_SDPA
    assert target.config._attn_implementation == "sdpa"


def test_weights_auto_is_the_copy_measured_best_on_a_cpu(target):
    decoder = SpecDecoder(target, "self_draft", compile_draft=False)
    copies = decoder.candidate_generator._copies
    made = copies.get(target, "auto")
    chosen = copies.choice(target).weights  # measured here (tests/test_auto_weights.py: how)
    assert any(isinstance(m, Int8Linear) for m in made.modules()) == (chosen == "w8a8")
    assert copies.get(target, chosen) is made  # one copy, whichever name asked for it
    ids = repetitive_prompt(10)
    out = decoder.generate(ids, max_new_tokens=24)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=24, do_sample=False))


def test_the_policy_prices_a_copy_by_the_bytes_its_steps_read(target):
    """A step reads a row of an input embedding table that the head does not share: the w8a8
    copy's fp32 table must not make it look as costly as half the target."""
    from specdec.modelinfo import step_bytes

    copy_ = build_copy(target, "w8a8")
    embed = tensor_bytes(copy_.get_input_embeddings())
    assert step_bytes(copy_) == tensor_bytes(copy_) - embed
    assert step_bytes(copy_) < 0.3 * step_bytes(target)
    tied = tiny_random("llama", seed=1, tie_word_embeddings=True)[0]
    assert step_bytes(tied) == tensor_bytes(tied)  # the head reads the whole shared table


@pytest.mark.parametrize("arch, weights", [("llama", "w8a8"), ("qwen2", "int4"), ("llama", "auto")])
def test_low_bit_copies_of_a_bfloat16_target_draft(arch, weights):
    """A bfloat16 target: the w8a8 copy rotated its bfloat16 MLP activations by float32 factors,
    and the int4 copy's float32 biases promoted its keys and values to float32; both raised at the
    first draft, and so did weights="auto" (it tries w8a8 first where int8 products are fast).
    dynamic_int8 (float32 activations only) is refused by name, and never tried by "auto"."""
    from specdec.copies.choose import candidates

    target, tokenizer = tiny_random(arch, seed=1, dtype=torch.bfloat16)
    ids = repetitive_prompt(24)
    out = SpecDecoder(target, "self_draft", tokenizer=tokenizer, weights=weights, compile_draft=False,
                      choice_budget=5, schedule="fixed", num_tokens=3).generate(ids, max_new_tokens=12)
    assert out.stats.drafted_tokens > 0  # bfloat16 rounds a verification apart at near ties: no output compared
    assert "dynamic_int8" not in candidates(target)
    with pytest.raises(ValueError, match="weights='dynamic_int8' .* takes float32 activations; the target is bfloat16"):
        SpecDecoder(target, "self_draft", tokenizer=tokenizer, weights="dynamic_int8").generate(ids, max_new_tokens=2)
