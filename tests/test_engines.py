"""The engine protocol and the eager engine (docs/engines.md), on tiny random models.

* A causal block after a cached prefix: the eager engine's logits, and its hidden states for the
  layers asked, are the model's own forward's, bit for bit (batch 1 and a left-padded batch).
* A tree: the logits (and last hidden state) at each node equal the model's own forward over the committed prefix plus
  that node's root-to-node path as a plain chain (the real criterion), with prefixes longer than
  the tiny models' sliding windows, batch 1 and 2 with a different tree per row, on a DynamicCache and
  on a StaticCache of full-length layers (stale slots past the fed block, as specdec's pool holds them).
* Malformed trees and models or caches that cannot honour a tree mask are refused, saying why.

Only ``specdec.engines`` (the package root) is imported, as the layout rule asks of everyone.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from specdec.engines import CAUSAL, Engine, EngineOutput, Layout, LayoutNotSupported, make_engine
from specdec.prompts import left_pad
from specdec.tiny import TINY_ARCHS, tiny_random

PAD = 257


@pytest.fixture(scope="module", params=TINY_ARCHS)
def model(request):
    return tiny_random(request.param, seed=3)[0]


def _cache(model, cache) -> dict:
    """``{keyword: cache}`` by the keyword the model's forward declares (``cache``, else ``past_key_values``)."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def _rows(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=g) for n in lengths]


def _prefilled(model, rows: list[torch.Tensor], drop_last: int = 0, capacity: int | None = None):
    """A cache of full-length layers holding each row but its last ``drop_last`` tokens, left-padded:
    a DynamicCache, or a StaticCache of ``capacity`` slots (as specdec's pool makes them) ->
    (cache, padded ids [B, L], mask [B, L], positions [B, L])."""
    ids, mask = left_pad(rows, pad_id=PAD)
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # [B, L] each row's token index (padding at 0)
    held = ids.shape[1] - drop_last
    keys = mask[:, :held]
    if capacity is None:
        cache = DynamicCache()
    else:
        cache = StaticCache(config=model.config, max_cache_len=capacity)
        cache.layers = [StaticLayer(max_cache_len=capacity) for _ in cache.layers]  # no sliding layers
        keys = torch.cat([keys, torch.zeros(len(rows), capacity - held, dtype=keys.dtype)], dim=1)
    with torch.no_grad():
        model(input_ids=ids[:, :held], attention_mask=keys, position_ids=positions[:, :held], use_cache=True,
              **_cache(model, cache))
    return cache, ids, mask, positions


# -- causal blocks: the model's own forward, bit for bit --------------------------------------------
@pytest.mark.parametrize("lengths", [[11], [11, 7]], ids=["batch1", "left_padded"])
def test_a_causal_block_after_a_cached_prefix_is_the_models_own_forward(model, lengths):
    rows = _rows(lengths)
    cache, ids, mask, positions = _prefilled(model, rows, drop_last=3)
    block, block_positions = ids[:, -3:], positions[:, -3:]  # [B, 3]
    engine = make_engine("eager", model)
    assert isinstance(engine, Engine) and engine.name == "eager"
    with torch.no_grad():
        want = model(input_ids=block, position_ids=block_positions, attention_mask=mask, use_cache=True,
                     **_cache(model, copy.deepcopy(cache))).logits
        got = engine.forward(block, block_positions, cache=cache, attention_mask=mask)
    assert isinstance(got, EngineOutput) and got.hidden == {}
    assert torch.equal(got.logits, want)
    assert cache.get_seq_length() == ids.shape[1]  # the engine's forward filled the cache it was given


@pytest.mark.parametrize("lengths", [[9], [9, 6]], ids=["batch1", "left_padded"])
def test_hidden_states_are_output_hidden_states_of_the_models_own_forward(model, lengths):
    rows = _rows(lengths, seed=1)
    cache, ids, mask, positions = _prefilled(model, rows, drop_last=2)
    block, block_positions = ids[:, -2:], positions[:, -2:]
    layers = model.config.get_text_config().num_hidden_layers
    asked = [0, 1, layers, -1]
    with torch.no_grad():
        want = model(input_ids=block, position_ids=block_positions, attention_mask=mask,
                     use_cache=True, output_hidden_states=True, logits_to_keep=1, **_cache(model, copy.deepcopy(cache)))
        got = make_engine("eager", model).forward(block, block_positions, cache=cache, attention_mask=mask,
                                                  hidden_layers=asked, logits_to_keep=1)
    assert sorted(got.hidden) == sorted(asked)
    for layer in asked:
        assert got.hidden[layer].shape == (len(rows), 2, want.hidden_states[layer].shape[-1])
        assert torch.equal(got.hidden[layer], want.hidden_states[layer]), layer
    assert got.logits.shape[1] == 1 and torch.equal(got.logits[:, -1], want.logits[:, -1])


def test_hidden_layers_out_of_range_are_refused(model):
    count = model.config.get_text_config().num_hidden_layers + 1
    engine = make_engine("eager", model)
    with pytest.raises(ValueError, match="is not a hidden state of"):
        engine.forward(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), hidden_layers=[count])


# -- trees: each node's logits are its own chain's ------------------------------------------------
#: two trees of six nodes (two branches each; parents before children), and a five-node one padded to six
TREES = [[-1, 0, 1, -1, 3, 4], [-1, -1, 0, 1, 2, 0], [-1, 0, -1, 2, 1, 0]]


def _path(parents: list[int], node: int) -> list[int]:
    """Node indices from the root's child down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_tree_forward_gives_each_node_the_logits_of_its_own_chain(model, batch, static):
    rows = _rows([13, 10][:batch], seed=5)  # committed tokens, longer than the sliding windows (8)
    trees = TREES[:batch] if batch == 1 else [TREES[1], TREES[2]]
    node_counts = [6, 5][:batch]  # row 1's last node is padding
    nodes = torch.randint(0, 250, (batch, 6), generator=torch.Generator().manual_seed(7))  # [B, K] draft ids
    capacity = 32 if static else None  # a static cache spans stale slots past the fed block too
    cache, ids, mask, _ = _prefilled(model, rows, drop_last=1, capacity=capacity)  # the pending root not cached
    fed = torch.cat([ids[:, -1:], nodes], dim=1)  # [B, 1 + K]: root, then the nodes
    layout = Layout.tree(torch.tensor(trees), start=torch.ones(batch, dtype=torch.long),
                         lengths=torch.tensor(node_counts))
    roots = torch.tensor([len(r) - 1 for r in rows])  # [B] the root's token index
    positions = roots[:, None] + layout.chain_columns(fed.shape[1], batch)  # [B, 1 + K]: root + depth
    real = torch.ones(batch, fed.shape[1], dtype=torch.long)
    for b, count in enumerate(node_counts):
        real[b, 1 + count:] = 0  # padding nodes hold no token of the row
    engine = make_engine("eager", model)
    assert engine.tree_refusal() is None, engine.tree_refusal()
    keys = torch.cat([mask[:, :-1], real], dim=1)  # [B, S + 1 + K]: the cached slots, then the fed columns
    if static:
        keys = torch.cat([keys, torch.zeros(batch, capacity - keys.shape[1], dtype=keys.dtype)], dim=1)  # [B, N]
    with torch.no_grad():
        got = engine.forward(fed, positions, layout=layout, cache=cache, attention_mask=keys, hidden_layers=[-1])
        for b, row in enumerate(rows):
            for node in range(-1, node_counts[b]):
                path = nodes[b, _path(trees[b], node)] if node >= 0 else row[:0]
                chain = torch.cat([row, path])[None, :]
                want = model(input_ids=chain, position_ids=torch.arange(chain.shape[1])[None, :],
                             output_hidden_states=True)
                for name, mine, theirs in (("logits", got.logits, want.logits), ("hidden", got.hidden[-1],
                                                                                   want.hidden_states[-1])):
                    torch.testing.assert_close(mine[b, 1 + node], theirs[0, -1], rtol=1e-4, atol=1e-4,
                                               msg=lambda m: f"{name}, row {b}, node {node}: {m}")


def test_a_tree_and_a_chain_layout_agree_on_a_chain(model):
    """A tree whose nodes form one chain is the causal block: the same logits, up to sum order."""
    rows = _rows([12], seed=9)
    cache, ids, mask, positions = _prefilled(model, rows, drop_last=4)
    block, at = ids[:, -4:], positions[:, -4:]
    engine = make_engine("eager", model)
    with torch.no_grad():
        chain = engine.forward(block, at, cache=copy.deepcopy(cache), attention_mask=mask).logits
        tree = engine.forward(block, at, layout=Layout.tree(torch.tensor([[-1, 0, 1]])), cache=cache,
                              attention_mask=mask).logits
    torch.testing.assert_close(tree, chain, rtol=1e-4, atol=1e-4)


# -- malformed trees and what cannot run a tree are refused ---------------------------------------
@pytest.mark.parametrize("parents, said", [
    ([[-1, 2, 0]], "row 0, node 1 has parent 2, at or after its child"),
    ([[-1, 1]], "row 0, node 1 has parent 1, at or after its child"),  # itself: a cycle
    ([[-1, 0, 5]], "row 0, node 2 has parent 5, out of range"),
    ([[-1, -2]], "row 0, node 1 has parent -2, out of range"),
    ([[-1, 0], [0, -1]], "row 1, node 0 has parent 0, at or after its child"),
])
def test_a_malformed_tree_is_refused(parents, said):
    with pytest.raises(ValueError, match="malformed tree: " + said):
        Layout.tree(torch.tensor(parents))


def test_a_tree_that_does_not_fit_the_forward_is_refused():
    model = tiny_random("llama", seed=3)[0]
    engine = make_engine("eager", model)
    with pytest.raises(ValueError, match="integer tensor"):
        Layout.tree(torch.tensor([[-1.0, 0.0]]))
    with pytest.raises(ValueError, match="lengths"):
        Layout.tree(torch.tensor([[-1, 0]]), lengths=torch.tensor([3]))
    unchecked = Layout(parents=torch.tensor([[-1, 1]]))  # built without Layout.tree: the engine checks it
    with pytest.raises(ValueError, match="malformed tree"):
        engine.forward(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 1]]), layout=unchecked)
    with pytest.raises(ValueError, match="start"):  # three nodes from column 1 need four columns
        engine.forward(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 1]]),
                       layout=Layout.tree(torch.tensor([[-1, 0, 0]]), start=torch.tensor([1])))
    with pytest.raises(ValueError, match="rows for a batch of 2"):
        engine.forward(torch.tensor([[1, 2], [3, 4]]), torch.tensor([[0, 1], [0, 1]]),
                       layout=Layout.tree(torch.tensor([[-1]])))
    with pytest.raises(ValueError, match="unknown engine 'eagre'. Did you mean 'eager'"):
        make_engine("eagre", model)


def test_a_model_that_ignores_the_4d_mask_is_refused_by_the_probe():
    model = tiny_random("llama", seed=3)[0]

    class IgnoresCustomMasks(type(model)):
        def forward(self, input_ids=None, attention_mask=None, cache=None, **kwargs):
            if attention_mask is not None and attention_mask.dim() == 4:
                attention_mask = None  # as a model would that only reads padding masks
            return super().forward(input_ids, attention_mask=attention_mask, cache=cache, **kwargs)

    model.__class__ = IgnoresCustomMasks
    engine = make_engine("eager", model)
    assert torch.equal(engine.forward(torch.tensor([[1, 2]]), torch.tensor([[0, 1]])).logits,
                       model(input_ids=torch.tensor([[1, 2]])).logits)  # causal blocks still run
    with pytest.raises(LayoutNotSupported, match="IgnoresCustomMasks: it ignores or misreads a custom 4-D mask"):
        engine.forward(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 1]]),
                       layout=Layout.tree(torch.tensor([[-1, -1]])))


def test_an_attention_without_custom_masks_or_a_sliding_cache_is_refused():
    model = tiny_random("llama", seed=3)[0]
    model.config._attn_implementation = "flash_attention_2"  # attribute only: nothing runs with it
    engine = make_engine("eager", model)
    with pytest.raises(LayoutNotSupported, match="LlamaForCausalLM: its attention implementation 'flash_attention_2'"):
        engine.check_tree_support()
    mistral = tiny_random("mistral", seed=3)[0]
    sliding = DynamicCache(config=mistral.config)  # keeps each layer's last window only
    with torch.no_grad():
        mistral(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **_cache(mistral, sliding))
    with pytest.raises(LayoutNotSupported, match="MistralForCausalLM: cache layer 0 .* keeps only its last slots"):
        make_engine("eager", mistral).forward(torch.tensor([[4, 5]]), torch.tensor([[3, 3]]), cache=sliding,
                                              layout=Layout.tree(torch.tensor([[-1, -1]]), start=torch.tensor([0])))
    assert CAUSAL.is_tree is False
