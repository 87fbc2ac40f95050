"""The target's decoder stack as one scripted function (``specdec/engines/forwards/direct.py``).

For one token it gives the model's own logits bit for bit (so plain steps stay ``generate``'s),
and for several tokens or a padded batch the model's own up to rounding, with the same keys and
values cached; models it does not know, hooks it would skip and caches it does not fill run the
model's own forward; specdec's forward counters still count its forwards."""

from __future__ import annotations

import pytest
import torch

from specdec import SpecDecoder
from specdec.kv import new_dynamic_cache
from specdec.engines.forwards import direct as direct_module
from specdec.engines.forwards.direct import DirectForward, layout_problem
from specdec.engines.forwards.head import model_logits
from specdec.modelinfo import ForwardTimer
from specdec.models import tiny_random

from helpers import left_pad, repetitive_prompt, tiny_pair


@pytest.fixture
def pin():
    pinned = []

    def pin_one(model, use: bool = True):
        pinned.append(model)
        return DirectForward.pin(model, use)

    yield pin_one
    for model in pinned:
        DirectForward.forget(model)


def steps(model, ids: torch.Tensor, mask: torch.Tensor, widths: list[int], use_direct: bool):
    """Prefill all but the last sum(widths) columns of ``ids [B, L]`` with the model's own forward,
    then feed the rest ``widths`` tokens at a time (directly, or through the model's own forward).
    -> (logits per forward, the cache)."""
    cache = new_dynamic_cache()
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    start = ids.shape[1] - sum(widths)
    out = []
    with torch.no_grad():
        model.forward(input_ids=ids[:, :start], attention_mask=mask[:, :start], position_ids=positions[:, :start],
                      cache=cache, use_cache=True)
        first = start
        for width in widths:
            kwargs = {"input_ids": ids[:, first:first + width], "position_ids": positions[:, first:first + width],
                      "cache": cache, "use_cache": True, "logits_to_keep": width}
            if not bool(mask[:, :first + width].all()):
                kwargs["attention_mask"] = mask[:, :first + width]
            forward = DirectForward.of(model)
            if use_direct:
                assert forward is not None and forward.serves(model, kwargs, direct=True)
                out.append(forward(kwargs, model.get_output_embeddings()))
            else:
                out.append(model.forward(**kwargs).logits)
            first += width
    return out, cache


def test_one_token_steps_are_the_models_own_bit_for_bit(smollm2, pin):
    target, _ = smollm2
    assert pin(target) is not None
    ids = torch.randint(5, 40000, (1, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mine, my_cache = steps(target, ids, mask, [1] * 6, use_direct=True)
    own, cache = steps(target, ids, mask, [1] * 6, use_direct=False)
    assert all(torch.equal(a, b) for a, b in zip(mine, own))
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(my_cache.layers, cache.layers))
    # the stack runs in inference mode, but what it writes and returns are ordinary tensors
    assert not any(t.is_inference() for t in mine + [my_cache.layers[0].keys, my_cache.layers[0].values])
    mine[0].add_(1.0)  # an inference tensor would refuse an in-place change outside inference mode


@pytest.mark.parametrize("rows, widths", [(1, [3, 1, 2]), (3, [1, 1])])
def test_several_tokens_and_padded_rows_are_the_models_own_up_to_rounding(rows, widths, pin):
    model = tiny_random("llama", seed=3)[0]
    assert pin(model) is not None
    ids = torch.randint(3, 250, (rows, 20), generator=torch.Generator().manual_seed(rows))
    mask = torch.ones_like(ids)
    mask[1:, :4] = 0  # left padding in the other rows
    mine, my_cache = steps(model, ids, mask, widths, use_direct=True)
    own, cache = steps(model, ids, mask, widths, use_direct=False)
    for a, b in zip(mine, own):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(my_cache.layers, cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


def test_products_through_packed_weights_are_the_models_own_up_to_rounding(pin):
    """In a forward that ``packed.py`` packs weights for, the direct products go through them."""
    from specdec.engines.forwards.packed import PackedLinears, available

    if not available():
        pytest.skip("this torch has no MKL packed products")
    model = tiny_random("llama", seed=6)[0]
    forward = pin(model)
    state = PackedLinears.pin(model, True)
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(6))
    cache = new_dynamic_cache()
    with torch.no_grad():
        model.forward(input_ids=ids[:, :10], cache=cache, use_cache=True)
        want = model.forward(input_ids=ids, use_cache=False).logits[:, 10:]
        kwargs = {"input_ids": ids[:, 10:], "position_ids": torch.arange(10, 16).expand(2, 6), "cache": cache}
        assert forward.serves(model, kwargs, direct=True)
        got = forward(kwargs, model.get_output_embeddings(), packed=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(state._packed) >= 7 * len(model.model.layers)  # every decoder layer's products were packed
    PackedLinears.forget(model)


def test_layouts_it_does_not_compute_are_left_to_the_model():
    assert layout_problem(tiny_random("llama", seed=1)[0]) is None
    for arch in ("qwen3", "mistral", "gemma2"):  # query/key norms; a sliding window; other norms
        assert layout_problem(tiny_random(arch, seed=1)[0]) is not None, arch


def test_hooks_it_would_skip_send_the_call_to_the_model(pin):
    model = tiny_random("llama", seed=4)[0]
    assert pin(model) is not None
    seen = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: seen.append(1))
    cache = new_dynamic_cache()
    ids = torch.randint(3, 250, (1, 9))
    with torch.no_grad():
        model.forward(input_ids=ids[:, :8], cache=cache, use_cache=True)
        kwargs = {"input_ids": ids[:, 8:], "position_ids": torch.tensor([[8]]), "cache": cache}
        assert not DirectForward.of(model).serves(model, kwargs, direct=True)
        seen.clear()
        model_logits(model, kwargs, direct=True)
    handle.remove()
    assert seen == [1]  # the model's own forward ran, hook and all
    user = model.register_forward_pre_hook(lambda *a: None)  # on the model: skipped by a call that is not direct
    with torch.no_grad():
        assert not DirectForward.of(model).serves(model, kwargs, direct=False)
        assert DirectForward.of(model).serves(model, kwargs, direct=True)
    user.remove()


def test_weights_and_layers_replaced_after_deciding_are_never_computed_stale(pin):
    model = tiny_random("llama", seed=7)[0]
    forward = pin(model)
    ids = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight = torch.nn.Parameter(torch.randn_like(model.model.layers[1].mlp.up_proj.weight))
    mine, _ = steps(model, ids, mask, [1, 1], use_direct=True)
    own, _ = steps(model, ids, mask, [1, 1], use_direct=False)
    assert all(torch.equal(a, b) for a, b in zip(mine, own))  # the new weight, read at the forward
    attention = model.model.layers[0].self_attn

    class Adapter(torch.nn.Module):  # a layer wrapped after deciding, as an adapter library does
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, x):
            return self.base(x) * 2

    attention.q_proj = Adapter(attention.q_proj)
    cache = new_dynamic_cache()
    with torch.no_grad():
        model.forward(input_ids=ids[:, :8], cache=cache, use_cache=True)
        assert not forward.serves(model, {"input_ids": ids[:, 8:9], "position_ids": torch.tensor([[8]]),
                                          "cache": cache}, direct=True)


def test_it_serves_few_rows_on_specdecs_dynamic_cache_only(pin):
    model = tiny_random("llama", seed=5)[0]
    forward = pin(model)
    from transformers import DynamicCache

    def kwargs(batch, width, cache):
        return {"input_ids": torch.ones(batch, width, dtype=torch.long), "position_ids": torch.zeros(batch, width, dtype=torch.long),
                "cache": cache}

    grown = new_dynamic_cache()
    with torch.no_grad():
        model.forward(input_ids=torch.ones(1, 4, dtype=torch.long), cache=grown, use_cache=True)
        plain = DynamicCache(config=model.config)
        model.forward(input_ids=torch.ones(1, 4, dtype=torch.long), cache=plain, use_cache=True)
    with torch.no_grad():
        assert forward.serves(model, kwargs(1, direct_module.MAX_ROWS, grown), direct=True)
        assert not forward.serves(model, kwargs(1, direct_module.MAX_ROWS + 1, grown), direct=True)  # a prefill: the model's own
        assert not forward.serves(model, kwargs(1, 1, plain), direct=True)  # transformers' own layers
        assert not forward.serves(model, {**kwargs(1, 1, grown), "output_hidden_states": True}, direct=True)
    assert not forward.serves(model, kwargs(1, 1, grown), direct=True)  # a forward autograd records
    with torch.no_grad():  # transformers' output-capturing hooks, left on the layers by a forward that asked for
        model.forward(input_ids=torch.ones(1, 3, dtype=torch.long), output_hidden_states=True)  # hidden states,
        assert any(layer._forward_hooks for layer in model.model.layers)  # record nothing outside such a forward
        assert forward.serves(model, kwargs(1, 1, grown), direct=False)


def test_decoding_with_it_is_token_for_token_generate_and_its_forwards_are_counted(pin, monkeypatch):
    target, draft, tokenizer = tiny_pair("llama")
    rows = [repetitive_prompt(n, seed=n)[0] for n in (6, 19)]
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    want = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    served = []
    call = DirectForward.__call__
    monkeypatch.setattr(DirectForward, "__call__", lambda self, *a: served.append(1) or call(self, *a))
    counts = {}
    pin(draft, False)  # the target's forwards only
    for use in (True, False):
        assert (pin(target, use) is not None) == use
        served.clear()
        with ForwardTimer(target) as timer:
            for generator in ("prompt_lookup", draft):
                out = SpecDecoder(target, generator, num_tokens=2, schedule="fixed").generate(ids, mask, max_new_tokens=24)
                assert torch.equal(out.sequences, want)
        counts[use] = timer.calls
        assert bool(served) == use
    assert counts[True] == counts[False] > 0
