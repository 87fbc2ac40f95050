"""The static-cache pool (``specdec.cache_pool``) and static cache lengths (``specdec.kv``).

The pool: idle caches only, least recently used out first, never more than the limit in bytes
(a cache larger than the limit is not kept), a model's caches released on demand or when the
model goes away; the limit set by ``SPECDEC_CACHE_POOL_BYTES`` or ``set_cache_pool_limit``.

Lengths: a call's cache starts short and grows along the ladder (doublings of 256 for compiled
forwards, of 64 for eager ones, or the lengths ``warmup`` compiled), never past what the call can reach; output stays exact across
growth (eager, compiled, batches whose rows shift, a copy that mirrors the target's cache), and
calls after ``warmup`` that grow compile nothing new. A fast version of the memory goal: calls of
random shapes, a huge ``max_new_tokens`` stopping early, the pool under its limit after each.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters
from transformers.cache_utils import StaticLayer
from transformers.generation import StoppingCriteria, StoppingCriteriaList

from specdec import SpecDecoder, pooled_bytes, release_caches, set_cache_pool_limit
from specdec.cache_pool import CachePool, cache_bytes, new_static_cache, parse_bytes
from specdec.kv import CacheSettings, StaticKV
from specdec.models import tiny_random

from helpers import FAST_COMPILE, left_pad, pin_costs, repetitive_prompt

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(scope="module")
def llama():
    return pin_costs(tiny_random("llama", seed=1)[0])


@pytest.fixture
def limit():
    """Restore the pool's limit after a test that changes it; start from an empty pool."""
    release_caches()
    old = set_cache_pool_limit(256 << 20)
    yield
    set_cache_pool_limit(old)
    release_caches()


def written(model, batch: int, length: int):
    """A cache of this shape whose tensors exist (as after a forward)."""
    cache = new_static_cache(model, batch, length)
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(batch, heads, 1, dim), torch.zeros(batch, heads, 1, dim))
    return cache


# -- the pool -------------------------------------------------------------------------------------
def test_the_pool_evicts_the_least_recently_used_within_its_limit(llama):
    one = cache_bytes(written(llama, 1, 256))
    pool = CachePool(limit=3 * one)
    a, b, c, d = (written(llama, 1, 256) for _ in range(4))
    for cache in (a, b, c):
        pool.release(llama, cache)
    assert pool.held() == 3 * one and pool.count() == 3
    assert pool.acquire(llama, 1, 256) is c  # the most recently released first
    pool.release(llama, c)
    pool.release(llama, d)  # a fourth: the oldest (a) goes
    assert pool.held() == 3 * one
    got = {id(pool.acquire(llama, 1, 256)) for _ in range(3)}
    assert got == {id(b), id(c), id(d)}
    assert pool.acquire(llama, 1, 256) is not a  # a new one
    pool.release(llama, written(llama, 4, 1024))  # larger than the whole limit: not kept
    assert pool.held() == 0


def test_the_pool_keys_caches_by_model_batch_and_length(llama):
    other = tiny_random("llama", seed=2)[0]
    pool = CachePool(limit=1 << 30)
    cache = written(llama, 2, 512)
    pool.release(llama, cache)
    assert pool.acquire(other, 2, 512) is not cache
    assert pool.acquire(llama, 1, 512) is not cache
    assert pool.acquire(llama, 2, 256) is not cache
    assert pool.acquire(llama, 2, 512) is cache
    pool.release(llama, new_static_cache(llama, 1, 256))  # never written: nothing worth keeping
    assert pool.count() == 0


def test_release_and_the_limit_act_at_once(llama):
    pool = CachePool(limit=1 << 30)
    other = tiny_random("llama", seed=2)[0]
    for model in (llama, other, llama):
        pool.release(model, written(model, 1, 256))
    one = cache_bytes(written(llama, 1, 256))
    assert pool.held(llama) == 2 * one and pool.held(other) == one
    assert pool.clear(other) == one and pool.held() == 2 * one
    assert pool.set_limit(one) == 1 << 30 and pool.held() == one
    assert pool.clear() == one and pool.count() == 0


def test_a_collected_model_takes_its_caches_along():
    model = tiny_random("llama", seed=3)[0]
    pool = CachePool(limit=1 << 30)
    pool.release(model, written(model, 1, 256))
    assert pool.held() > 0
    del model
    gc.collect()
    assert pool.held() == 0 and pool.count() == 0


def test_the_limit_knob():
    assert parse_bytes("268435456") == 256 << 20
    assert parse_bytes("256M") == parse_bytes("256MiB") == parse_bytes("256mb") == 256 << 20
    assert parse_bytes("1G") == 1 << 30 and parse_bytes("0") == 0
    with pytest.raises(ValueError, match="SPECDEC_CACHE_POOL_BYTES must be a number of bytes"):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="non-negative number of bytes"):
        set_cache_pool_limit(-1)
    code = "from specdec.cache_pool import cache_pool_limit, DEFAULT_POOL_BYTES; print(cache_pool_limit(), DEFAULT_POOL_BYTES)"
    env = {**os.environ, "SPECDEC_CACHE_POOL_BYTES": "64M"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == str(64 << 20)


def test_set_cache_pool_limit_bounds_what_calls_leave(llama, limit):
    decoder = SpecDecoder(llama, "prompt_lookup", cache_implementation="static")
    for batch in (1, 2, 3):
        decoder.generate(repetitive_prompt(6).repeat(batch, 1), max_new_tokens=4)
    assert pooled_bytes(llama) > 0
    kept = pooled_bytes()
    set_cache_pool_limit(kept // 2)
    assert pooled_bytes() <= kept // 2
    set_cache_pool_limit("0")
    assert pooled_bytes() == 0
    decoder.generate(repetitive_prompt(6), max_new_tokens=4)
    assert pooled_bytes() == 0  # a limit of 0 keeps nothing


# -- lengths: start short, grow along the ladder --------------------------------------------------
def static_kv(model, capacity: int, reach: int, lengths=()) -> StaticKV:
    return StaticKV(model, 1, capacity, CacheSettings.make("static"), reach) if not lengths else StaticKV(
        model, 1, capacity, CacheSettings(implementation="static", lengths=tuple(lengths)), reach)


def test_lengths_follow_the_ladder_and_stop_at_the_reach(llama):
    kv = static_kv(llama, 100, 10**9)  # eager forwards: doublings of 64
    assert kv.length == 128
    assert [kv._length_for(n) for n in (257, 513, 1100, 5000)] == [512, 1024, 2048, 8192]
    near = static_kv(llama, 100, 600)  # a call that can reach 600 slots never takes more than 640
    assert [near._length_for(n) for n in (257, 513)] == [512, 640]
    compiled = StaticKV(llama, 1, 100, CacheSettings.make("static", compile=True), 600,
                        compiler=lambda *args, **kwargs: None)  # each length a graph: doublings of 256
    assert compiled.length == 256 and [compiled._length_for(n) for n in (257, 513)] == [512, 768]
    warmed = static_kv(llama, 100, 10**9, lengths=(256, 512, 768))
    assert [warmed._length_for(n) for n in (100, 300, 700, 800)] == [256, 512, 768, 1024]


def cache_lengths(model):
    """Forward pre-hook recording each eager forward's static cache length (compiled ones skip hooks)."""
    seen = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(getattr(kwargs["cache"].layers[0], "max_cache_len", None)),
        with_kwargs=True)
    return seen, handle


@pytest.mark.parametrize("drafter", ["prompt_lookup", "self_draft"])
def test_output_stays_exact_as_the_cache_grows(llama, drafter, limit):
    options = {"weights": "bfloat16", "compile_draft": False} if drafter == "self_draft" else {}
    decoder = SpecDecoder(llama, drafter, cache_implementation="static", **options)
    rows = [repetitive_prompt(80, seed=1)[0], torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(2))]
    ids, mask = left_pad(rows, pad_id=257)
    seen, handle = cache_lengths(llama)
    try:
        out = decoder.generate(ids, mask, max_new_tokens=400)
    finally:
        handle.remove()
    # 200 prompt slots start on 512; 633 reachable (400 new tokens and the margin): grown to 640, not 1024
    assert set(seen) == {512, 640}
    for b, row in enumerate(rows):
        want = llama.generate(row[None, :], max_new_tokens=400, do_sample=False)[0, row.numel():]
        assert torch.equal(out.sequences[b, ids.shape[1]: ids.shape[1] + want.numel()], want), b


def test_a_warmed_up_call_grows_through_warmed_lengths_and_compiles_nothing(llama, limit):
    decoder = SpecDecoder(llama, "prompt_lookup", cache_implementation="static", compile=FAST_COMPILE,
                          schedule="fixed", num_tokens=1)  # widths 1 and 2
    decoder.warmup(max_length=256)
    assert decoder.cache.lengths == (256, 512)
    graphs = counters["stats"]["unique_graphs"]
    seen, handle = cache_lengths(llama)
    ids = repetitive_prompt(4)
    try:
        out = decoder.generate(ids, max_new_tokens=300)  # grows past 256 slots
    finally:
        handle.remove()
    assert torch.equal(out.sequences, llama.generate(ids, max_new_tokens=300, do_sample=False))
    assert counters["stats"]["unique_graphs"] == graphs
    assert set(seen) - {None} <= {256, 512}


# -- the memory goal, fast ------------------------------------------------------------------------
class StopAfter(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_random_calls_keep_the_pool_under_its_limit_and_allocate_what_they_use(llama, limit, monkeypatch):
    allocated = []
    original = StaticLayer.lazy_initialization

    def spy(self, key_states, *args, **kwargs):
        allocated.append(int(key_states.shape[0]) * int(self.max_cache_len))
        return original(self, key_states, *args, **kwargs)

    monkeypatch.setattr(StaticLayer, "lazy_initialization", spy)
    bound = 1 << 20
    set_cache_pool_limit(bound)
    decoder = SpecDecoder(llama, "prompt_lookup", cache_implementation="static")
    g = torch.Generator().manual_seed(0)
    for call in range(10):
        batch = int(torch.randint(1, 5, (1,), generator=g))
        length = int(torch.randint(5, 201, (1,), generator=g))
        new = int(torch.randint(1, 10**6, (1,), generator=g))
        stop = int(torch.randint(2, 40, (1,), generator=g))
        ids = torch.randint(0, 250, (batch, length), generator=g)
        allocated.clear()
        if call % 2:  # stopped by EOS: the greedy token at position `stop` (every row the same prompt)
            ids = ids[:1].repeat(batch, 1)
            eos = int(llama.generate(ids[:1], max_new_tokens=stop, do_sample=False)[0, -1])
            decoder.generate(ids, max_new_tokens=new, eos_token_id=eos)
        else:  # stopped by a criterion after `stop` new tokens
            decoder.generate(ids, max_new_tokens=new, eos_token_id=None,
                             stopping_criteria=StoppingCriteriaList([StopAfter(length + stop)]))
        assert pooled_bytes() <= bound
        # slots allocated this call: at most a cache that holds what it generated, per layer
        assert max(allocated, default=0) <= batch * 512, (batch, length, stop, allocated)
