"""The static cache path (``cache_implementation="static"``) and compiled forwards (``compile``).

Exactness: greedy output equals ``target.generate(do_sample=False)`` for several architectures,
sliding windows smaller than the generation included (mistral, gemma2), with ``prompt_lookup``
and ``draft_model``, batch 1 and left-padded batches whose rows accept different drafts.
Compiled runs use dynamo with the ``aot_eager`` backend where the claim is that compiled forwards
are exact (the same graphs, capture, guards and AOTAutograd tracing as inductor, without its code
generation, which takes seconds a graph on CPU), plus one run with inductor itself; with the
``eager`` backend where it is what dynamo decides (which graphs a call compiles, their guards).
Sampling stays lossless on the static path: ``test_sampling_lossless`` runs its end-to-end check
on both caches.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import StaticCache

from specdec import SpecDecoder
from specdec.kv import WIDTHS, compiled_forward

from helpers import AOT_COMPILE, FAST_COMPILE, left_pad, repetitive_prompt, tiny_llava, tiny_pair
from helpers import reference as greedy

ARCHS = ["llama", "qwen3", "gemma2", "mistral"]  # gemma2 and mistral: sliding window 8

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(scope="module")
def pairs():
    return {arch: tiny_pair(arch) for arch in ARCHS}


def reference(target, rows: list[torch.Tensor], max_new_tokens: int) -> list[torch.Tensor]:
    """Each row's own ``target.generate`` (computed once per model and row: ``helpers.reference``)."""
    return [greedy(target, r[None, :], max_new_tokens)[0, r.numel():] for r in rows]


def batch_rows(seed: int = 0) -> list[torch.Tensor]:
    """Three rows of different lengths; the repetitive ones give prompt lookup long matches."""
    g = torch.Generator().manual_seed(seed)
    return [repetitive_prompt(10, seed=seed)[0], torch.randint(0, 250, (7,), generator=g),
            repetitive_prompt(6, seed=seed + 1)[0]]


def check_rows(decoder, target, rows, max_new_tokens=30):
    ids, mask = left_pad(rows, pad_id=257)
    out = decoder.generate(ids, mask, max_new_tokens=max_new_tokens)
    expected = reference(target, rows, max_new_tokens)
    width = ids.shape[1]
    for b, want in enumerate(expected):
        got = out.sequences[b, width: width + want.numel()]
        assert torch.equal(got, want), f"row {b}"
    return out


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_cache_is_exact(pairs, arch, drafter):
    target, draft, _ = pairs[arch]
    decoder = SpecDecoder(target, draft if drafter == "draft_model" else drafter, cache_implementation="static")
    ids = repetitive_prompt(12)
    out = decoder.generate(ids, max_new_tokens=40)  # longer than every sliding window
    assert torch.equal(out.sequences, greedy(target, ids, 40))
    check_rows(decoder, target, batch_rows())


@pytest.mark.parametrize("arch, drafter", [("llama", "prompt_lookup"), ("qwen3", "prompt_lookup"), ("gemma2", "prompt_lookup"),
                                           ("llama", "draft_model"), ("gemma2", "draft_model")])
def test_compiled_static_path_is_exact(pairs, arch, drafter):
    """A left-padded batch whose rows accept different drafts (each batch size and width compiles
    its own graphs: batch 1 runs compiled in test_no_graph_compiles_after_warmup). Prompt lookup on
    two full-attention architectures (one with query and key norms) and a sliding-window one, a
    compiled draft model on one of each (each compile costs seconds; test_static_cache_is_exact
    runs every architecture with both drafters uncompiled)."""
    target, draft, _ = pairs[arch]
    decoder = SpecDecoder(target, draft if drafter == "draft_model" else drafter, cache_implementation="static",
                          compile=AOT_COMPILE, schedule="fixed", num_tokens=3)
    out = check_rows(decoder, target, batch_rows(3))  # 30 new tokens: longer than every sliding window
    assert sum(out.stats.drafts_verified[1:]) > 0  # blocks of drafts went through the compiled verify
    assert out.stats.accepted_tokens > 0


def test_inductor_compiled_path_is_exact(pairs):
    """One run through inductor's generated code (fp32 on CPU): the same tokens as transformers."""
    target, _, _ = pairs["llama"]
    decoder = SpecDecoder(target, "prompt_lookup", cache_implementation="static", compile=True,
                          schedule="fixed", num_tokens=3)
    ids = repetitive_prompt(12)
    out = decoder.generate(ids, max_new_tokens=30)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=30, do_sample=False))
    assert out.stats.accepted_tokens > 0


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
def test_no_graph_compiles_after_warmup(pairs, drafter):
    """After ``warmup`` no call compiles a new graph, whatever its prompt length or acceptance."""
    target, draft, _ = pairs["llama"]
    decoder = SpecDecoder(target, draft if drafter == "draft_model" else drafter, cache_implementation="static",
                          compile=FAST_COMPILE)
    seconds = decoder.warmup(max_length=400)
    assert seconds > 0
    assert decoder.cache.lengths == (256, 512)  # 400 tokens and the margin fit 512 slots (768: test_cache_pool)
    graphs = counters["stats"]["unique_graphs"]
    slots = []  # the prefill runs eagerly, so a hook sees each call's cache
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: slots.append(getattr(kwargs["cache"].layers[0], "max_cache_len", None)),
        with_kwargs=True)  # None: target.generate's dynamic cache
    try:
        for seed, length in [(0, 5), (1, 30), (2, 60), (3, 17), (4, 120)]:  # 120: a 300-token prompt
            ids = repetitive_prompt(length, seed=seed)
            out = decoder.generate(ids, max_new_tokens=50)
            assert torch.equal(out.sequences, greedy(target, ids, 50))
    finally:
        handle.remove()
    assert counters["stats"]["unique_graphs"] == graphs
    assert set(slots) - {None} == {256, 512}  # each call took the shortest warmed-up cache it fits in
    # warming again still finds the compiled forwards (0.0 would mean nothing compiles), compiles
    # nothing new and keeps the warmed-up lengths
    assert decoder.warmup(max_length=400) > 0 and decoder.cache.lengths == (256, 512)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_graph_compiled_for_another_batch_size_is_reported_and_checked():
    """torch.compile makes a graph per batch size too: a call whose rows compile new graphs says so
    (compile_seconds, apart from decoding) and checks them against the eager forward, as for a new
    width; the graphs were taken for checked where another batch size had been."""
    from specdec.model_plan import plan_of
    from specdec.tiny import tiny_random

    target, _ = tiny_random("llama", seed=7)
    decoder = SpecDecoder(target, "prompt_lookup", cache_implementation="static", compile=FAST_COMPILE,
                          num_tokens=1, schedule="fixed")
    ids = repetitive_prompt(6, seed=1)
    seconds = []
    for rows in (1, 2, 2):
        out = decoder.generate(ids.repeat(rows, 1), max_new_tokens=6)
        assert torch.equal(out.sequences, greedy(target, ids.repeat(rows, 1), 6))
        seconds.append(out.stats.compile_seconds)
    assert seconds[0] > 0 and seconds[1] > 0 and seconds[2] == 0.0
    assert {graph[2] for graph in plan_of(target).checked} == {1, 2}


def test_warmup_compiles_the_widths_a_call_can_feed():
    """A fixed schedule of 3 drafts feeds at most 4 tokens a step: its warm-up compiles widths 1,
    2 and 4, not 8 and 16, and a call whose grammar forces long runs of tokens (drafts the
    grammar adds past the generator's, verified eagerly) compiles nothing new; 4 drafts: 1, 2, 4
    and 5 (the widest step pads nothing); drafting nothing: width 1."""
    from specdec.compiled import planned
    from specdec.generators import NoDraft
    from specdec.grammar import Grammar
    from specdec.tiny import tiny_random

    for draft, options, widths in (("prompt_lookup", dict(schedule="fixed", num_tokens=3), {1, 2, 4}),
                                   ("prompt_lookup", dict(schedule="fixed", num_tokens=4), {1, 2, 4, 5}),
                                   (NoDraft(), {}, {1})):
        target, tokenizer = tiny_random("llama", seed=11)  # a model of its own: no graph checked yet
        decoder = SpecDecoder(target, draft, tokenizer=tokenizer, cache_implementation="static",
                              compile=FAST_COMPILE, **options)
        assert decoder.warmup(max_length=100) > 0
        assert {width for width, *_ in planned(target).checked} == widths, options
    ids = tokenizer("say abababab", return_tensors="pt").input_ids
    decoder = SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer, cache_implementation="static",
                          compile=FAST_COMPILE, schedule="fixed", num_tokens=3)
    decoder.warmup(max_length=100)
    graphs = counters["stats"]["unique_graphs"]
    out = decoder.generate(ids, max_new_tokens=40, grammar=Grammar.regex("(abcdefgh){6}"))
    assert tokenizer.decode(out.sequences[0, ids.shape[1]:]) == "abcdefgh" * 5
    assert out.stats.grammar_drafts > 20 and out.stats.steps < 5  # forced runs verified whole
    assert {width for width, *_ in planned(target).checked} == {1, 2, 4}
    assert counters["stats"]["unique_graphs"] == graphs


def test_rollback_moves_the_write_position_and_never_reallocates(pairs):
    """Every forward of a call sees the same StaticCache tensors; rejected blocks only move the
    position the next forward writes at."""
    target, draft, _ = pairs["llama"]
    seen = []

    def hook(module, args, kwargs):
        cache = kwargs["cache"]
        seen.append((type(cache), cache.layers[0].keys.data_ptr() if cache.layers[0].is_initialized else None,
                     int(cache.layers[0].cumulative_length)))

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        decoder = SpecDecoder(target, draft, cache_implementation="static", schedule="fixed", num_tokens=4)
        ids = repetitive_prompt(12)
        out = decoder.generate(ids, max_new_tokens=30)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=30, do_sample=False))
    assert out.stats.drafted_tokens > out.stats.accepted_tokens  # some blocks were rejected
    assert {kind for kind, _, _ in seen} == {StaticCache}
    assert len({ptr for _, ptr, _ in seen[1:]}) == 1  # allocated by the prefill, then only written
    starts = [start for _, _, start in seen]
    assert starts[0] == 0 and all(b > a for a, b in zip(starts, starts[1:]))


def test_rows_finishing_early_keep_exact_on_the_static_path(pairs):
    target, _, tokenizer = pairs["gemma2"]
    rows = batch_rows(5)
    ids, mask = left_pad(rows, pad_id=257)
    decoder = SpecDecoder(target, "prompt_lookup", cache_implementation="static")
    eos = int(target.generate(rows[1][None, :], max_new_tokens=5, do_sample=False)[0, -1])  # row 1 stops early
    out = decoder.generate(ids, mask, max_new_tokens=25, eos_token_id=eos)
    plain = SpecDecoder(target, "prompt_lookup").generate(ids, mask, max_new_tokens=25, eos_token_id=eos)
    assert torch.equal(out.sequences, plain.sequences)


def test_rows_that_leave_are_dropped_in_place_and_the_pool_gets_the_whole_cache_back(pairs):
    """When a row finishes, the kept rows move up inside the same tensors (no cache is allocated);
    the cache returns to the pool at its full batch size, and the next call of that size reuses it."""
    from specdec.cache_pool import POOL, cache_bytes

    target, _, _ = pairs["llama"]
    rows = batch_rows(5)
    ids, mask = left_pad(rows, pad_id=257)
    eos = int(greedy(target, rows[1][None, :], 5)[0, -1])  # the middle row stops early: the last one moves up
    seen = []

    def hook(module, args, kwargs):
        layer = kwargs["cache"].layers[0]
        if layer.is_initialized:
            seen.append((layer.keys.shape[0], layer.keys.untyped_storage().data_ptr()))

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        decoder = SpecDecoder(target, "prompt_lookup", cache_implementation="static")
        out = decoder.generate(ids, mask, max_new_tokens=25, eos_token_id=eos)
    finally:
        handle.remove()
    plain = SpecDecoder(target, "prompt_lookup").generate(ids, mask, max_new_tokens=25, eos_token_id=eos)
    assert torch.equal(out.sequences, plain.sequences)
    batches = [batch for batch, _ in seen]
    assert batches[0] == 3 and 2 in batches and batches == sorted(batches, reverse=True)  # rows left
    assert len({storage for _, storage in seen}) == 1
    pooled = [cache for _, shape, cache, _ in POOL._idle.values() if shape[0] == 3 and cache.layers[0].is_initialized
              and cache.layers[0].keys.untyped_storage().data_ptr() == seen[0][1]]
    assert len(pooled) == 1 and pooled[0].layers[0].keys.shape[0] == 3
    assert cache_bytes(pooled[0]) == sum(t.untyped_storage().nbytes() for layer in pooled[0].layers
                                         for t in (layer.keys, layer.values))
    seen.clear()
    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        assert torch.equal(decoder.generate(ids, mask, max_new_tokens=25, eos_token_id=eos).sequences, out.sequences)
    finally:
        handle.remove()
    assert seen[0] == (3, pooled[0].layers[0].keys.untyped_storage().data_ptr())  # the next call took it whole


def test_static_settings_are_checked(pairs):
    target, _, _ = pairs["llama"]
    with pytest.raises(ValueError, match="cache_implementation must be one of"):
        SpecDecoder(target, "prompt_lookup", cache_implementation="offloaded")
    with pytest.raises(ValueError, match="needs cache_implementation='static'"):
        SpecDecoder(target, "prompt_lookup", compile=True)
    with pytest.raises(TypeError, match="compile must be"):
        SpecDecoder(target, "prompt_lookup", cache_implementation="static", compile="yes")
    decoder = SpecDecoder(target, "prompt_lookup", cache_implementation="static")
    with pytest.raises(ValueError, match="dynamic cache"):
        decoder.prefill(torch.tensor([[1, 2, 3]]))
    assert decoder.warmup() == 0.0  # nothing compiles


def test_vision_language_targets_are_refused_on_the_static_path():
    with pytest.raises(ValueError, match="text-only"):
        SpecDecoder(tiny_llava(), "prompt_lookup", cache_implementation="static")


def test_compiled_widths_are_checked_and_sorted():
    from specdec.kv import CacheSettings

    assert WIDTHS == tuple(sorted(WIDTHS)) and WIDTHS[0] == 1
    assert CacheSettings.make("static", True, widths=(2, 1, 2)).widths == (1, 2)
    with pytest.raises(ValueError, match="positive ints"):
        CacheSettings.make("static", True, widths=(0,))


def test_a_miscompiled_forward_is_caught_and_run_eagerly():
    """A compiled graph whose outputs disagree with the eager forward (here a backend that negates
    the logits) is detected at its first use: output stays exact and the model stops compiling."""
    target, _, _ = tiny_pair("llama", seed=7)
    vocab = target.config.vocab_size

    def wrong_backend(graph, example_inputs):
        def run(*args):
            return [-o if isinstance(o, torch.Tensor) and o.is_floating_point() and o.shape[-1] == vocab else o
                    for o in graph(*args)]
        return run

    decoder = SpecDecoder(target, "prompt_lookup", cache_implementation="static", compile={"backend": wrong_backend})
    ids = repetitive_prompt(12)
    with pytest.warns(RuntimeWarning, match="disagree with its eager forward"):
        out = decoder.generate(ids, max_new_tokens=30)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=30, do_sample=False))
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(decoder.generate(ids, max_new_tokens=30).sequences, out.sequences)
    assert counters["stats"]["unique_graphs"] == graphs  # never compiled again


def test_an_owned_model_compiles_a_function_of_its_own():
    """A model its generator owns (``attach(..., owned=True)``) runs compiled graphs that check no
    guards on its modules, so it needs a function of its own: here two models differ only in a
    constant their graphs bake in (a norm's epsilon), which only module guards would tell apart."""
    a = tiny_pair("llama", seed=5)[0]
    b = copy.deepcopy(a)
    b.model.norm.variance_epsilon = 10.0
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        for model in (a, b, a):
            compiled = compiled_forward(model, FAST_COMPILE, owned=True)
            got = compiled(model, input_ids=ids, use_cache=False).logits
            assert torch.allclose(got, model(input_ids=ids, use_cache=False).logits, atol=1e-5)
    assert compiled_forward(a, FAST_COMPILE, owned=True) is compiled_forward(a, FAST_COMPILE, owned=True)
    assert compiled_forward(a, FAST_COMPILE, owned=True) is not compiled_forward(b, FAST_COMPILE, owned=True)
    assert compiled_forward(a, FAST_COMPILE, owned=True) is not compiled_forward(a, FAST_COMPILE)
    # a mode (CUDA's default is "reduce-overhead") becomes options: torch.compile takes one or the other
    with torch.no_grad():
        compiled = compiled_forward(a, {**FAST_COMPILE, "mode": "reduce-overhead"}, owned=True)
        assert torch.allclose(compiled(a, input_ids=ids, use_cache=False).logits,
                              a(input_ids=ids, use_cache=False).logits, atol=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_what_a_call_returns_is_the_callers_to_edit(pairs, cache):
    """Calls run in inference mode; their sequences, scores and logits are ordinary tensors
    (editable in place outside it), and a static cache that grew during a call serves the next
    call from the pool."""
    target = pairs["llama"][0]
    ids = repetitive_prompt(10, seed=3)
    decoder = SpecDecoder(target, "prompt_lookup", cache_implementation=cache)
    for new in (8, 300):  # the second call outgrows the first cache
        out = decoder.generate(ids, max_new_tokens=new, output_scores=True, output_logits=True,
                               return_dict_in_generate=True)
        for tensor in (out.sequences, out.scores[0], out.logits[-1]):
            assert not tensor.is_inference()
            tensor.add_(1)
    again = decoder.generate(ids, max_new_tokens=20)
    assert torch.equal(again.sequences[0, ids.shape[1]:], greedy(target, ids, 20)[0, ids.shape[1]:])
