"""The CPU engine's forward (``specdec/engines/cpu.py``): a tree through the scripted stack.

A tree layout on a model the stack serves (Llama's layout, the direct forward decided for it,
specdec's dynamic cache) runs through ``LlamaStack`` with the tree's boolean mask; its logits
and hidden states are the eager engine's up to the order of sums (and so each node's its own
chain's). Anything else is the eager engine's forward, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from specdec.engines import CAUSAL, Layout, LayoutNotSupported, make_engine
from specdec.engines.forwards.direct import DirectForward
from specdec.kv import new_dynamic_cache
from specdec.modelinfo import cache_argument
from specdec.prompts import left_pad
from specdec.tiny import tiny_random

PAD = 257
TREES = [[-1, -1, 0, 1, 2, 0], [-1, 0, -1, 2, 1, 0]]


@pytest.fixture(scope="module")
def llama():
    model = tiny_random("llama", seed=4)[0]
    assert DirectForward.pin(model, True) is not None  # the stack serves it (decided without timing)
    yield model
    DirectForward.forget(model)


def _tree_inputs(model, batch: int):
    """A cache of each row but its pending root, and a tree of six nodes per row after it (row 1's
    last node padding) -> (cache, fed ids [B, 1 + K], positions, layout, attention mask [B, N])."""
    g = torch.Generator().manual_seed(11)
    rows = [torch.randint(0, 250, (n,), generator=g) for n in (12, 8)[:batch]]
    ids, mask = left_pad(rows, pad_id=PAD)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = new_dynamic_cache()
    with torch.no_grad():
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], use_cache=True,
              **{cache_argument(model): cache})
    counts = [6, 5][:batch]
    nodes = torch.randint(0, 250, (batch, 6), generator=g)
    fed = torch.cat([ids[:, -1:], nodes], dim=1)
    layout = Layout.tree(torch.tensor(TREES[:batch]), start=torch.ones(batch, dtype=torch.long),
                         lengths=torch.tensor(counts))
    fed_positions = positions[:, -1:] + layout.chain_columns(fed.shape[1], batch)
    real = torch.ones(batch, fed.shape[1], dtype=torch.long)
    for b, count in enumerate(counts):
        real[b, 1 + count:] = 0
    return cache, fed, fed_positions, layout, torch.cat([mask[:, :-1], real], dim=1)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_tree_runs_through_the_stack_as_the_eager_engine_computes_it(llama, batch, monkeypatch):
    engine = make_engine("cpu", llama)
    calls = []
    original = DirectForward.__call__
    monkeypatch.setattr(DirectForward, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    outputs = {}
    for name in ("cpu", "eager"):
        cache, fed, positions, layout, keys = _tree_inputs(llama, batch)
        assert make_engine("cpu", llama).serves_trees(cache)
        with torch.no_grad():
            outputs[name] = make_engine(name, llama).forward(fed, positions, layout=layout, cache=cache,
                                                             attention_mask=keys, hidden_layers=[0, 1, -1])
        assert cache.get_seq_length() == keys.shape[1]  # the forward filled the cache it was given
        if name == "cpu":
            assert len(calls) == 1  # through the stack
    assert engine.name == "cpu"
    mine, theirs = outputs["cpu"], outputs["eager"]
    torch.testing.assert_close(mine.logits, theirs.logits, rtol=1e-5, atol=1e-5)
    assert sorted(mine.hidden) == sorted(theirs.hidden) == [-1, 0, 1]
    for layer in mine.hidden:
        torch.testing.assert_close(mine.hidden[layer], theirs.hidden[layer], rtol=1e-5, atol=1e-5, msg=str(layer))


def test_a_causal_forward_takes_the_fast_paths_and_what_the_stack_does_not_serve_the_eager_engine(llama):
    from specdec.engines.forwards.head import model_logits

    cache, fed, positions, layout, keys = _tree_inputs(llama, 2)
    twin, *_ = _tree_inputs(llama, 2)
    third, *_ = _tree_inputs(llama, 2)
    with torch.no_grad():  # a causal layout: the fast paths' forward, the model's logits up to rounding
        got = make_engine("cpu", llama).forward(fed, positions, cache=cache, attention_mask=keys, layout=CAUSAL,
                                                hidden_layers=(1,))
        want = make_engine("eager", llama).forward(fed, positions, cache=twin, attention_mask=keys, layout=CAUSAL,
                                                   hidden_layers=(1,))
        fast, hidden = model_logits(llama, {"input_ids": fed, "position_ids": positions, "past_key_values": third,
                                            "use_cache": True, "attention_mask": keys}, hidden_layers=(1,))
    assert torch.equal(got.logits, fast) and torch.equal(got.hidden[1], hidden[1])  # model_logits, bit for bit
    real = keys[:, -fed.shape[1]:].bool()  # a padding column's logits are anything
    torch.testing.assert_close(got.logits[real], want.logits[real], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.hidden[1][real], want.hidden[1][real], atol=1e-5, rtol=1e-4)
    other = tiny_random("qwen3", seed=4)[0]  # query and key norms: not the stack's layout, trees through eager
    engine = make_engine("cpu", other)
    assert not engine.serves_trees()
    if make_engine("eager", other).tree_refusal() is None:  # the eager engine's verdict, as it gives it
        engine.check_tree_support()
    else:
        with pytest.raises(LayoutNotSupported, match="eager engine"):
            engine.check_tree_support()


def test_a_decoders_trees_run_through_the_stack_and_give_generates_tokens(llama, monkeypatch):
    """End to end: greedy prompt lookup with trees (and the hand-made right-branch tree) on a model
    the stack serves: every tree step's forward through the stack, the output ``generate``'s."""
    from specdec import SpecDecoder
    from specdec.engines import CpuEngine

    from helpers import left_pad as pad_rows
    from helpers import reference
    from test_trees import CONTESTED, Oracle

    served = []
    original = CpuEngine._stack_inputs
    monkeypatch.setattr(CpuEngine, "_stack_inputs",  # (through the stack, whether the cache held anything)
                        lambda self, *a: served.append((original(self, *a) is not None, a[3].get_seq_length() > 0))
                        or original(self, *a))
    ref = reference(llama, CONTESTED, 30)
    for generator, options in (("prompt_lookup", {"tree": True, "schedule": "fixed", "num_tokens": 6}),
                               (Oracle(ref, [0]), {})):
        out = SpecDecoder(llama, generator, **options).generate(CONTESTED, max_new_tokens=30)
        assert torch.equal(out.sequences, ref)
        assert out.stats.tree_steps > 0 and "trees" not in out.stats.choices
    rows = [CONTESTED[0], torch.tensor([20, 21, 22, 23, 20, 21, 24, 25, 20, 21, 22])]
    padded, mask = pad_rows(rows, pad_id=PAD)
    out = SpecDecoder(llama, "prompt_lookup", tree=True, schedule="fixed", num_tokens=6).generate(
        padded, mask, max_new_tokens=24)
    for b, row in enumerate(rows):
        want = reference(llama, row[None, :], 24)[0, row.numel():]
        assert torch.equal(out.sequences[b, padded.shape[1]: padded.shape[1] + want.numel()], want), b
    # every tree forward ran through the stack but a call's first, with its prompt (a prefill: the model's own)
    assert len(served) > 6 and all(through == cached for through, cached in served), served
