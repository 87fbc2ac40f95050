"""What one call leaves for the next on the same target: nothing a user sees. specdec's one-time
decisions and probes must not draw from the global random generator a user seeds."""

from __future__ import annotations

import torch

from specdec import SpecDecoder
from specdec.tiny import tiny_random

IDS = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])


def test_one_time_probes_leave_the_global_generator_alone():
    """The packed-weights timing in a model's second call drew torch.randn from the global
    generator: the same torch.manual_seed gave that call another sample than the calls around it,
    and greedy calls moved the generator (generate() does not)."""
    target, tokenizer = tiny_random("llama", seed=1)
    decoder = SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer)
    for _ in range(3):
        torch.manual_seed(0)
        before = torch.random.get_rng_state()
        decoder.generate(IDS, max_new_tokens=8, do_sample=False)
        assert torch.equal(before, torch.random.get_rng_state())
    target, _ = tiny_random("llama", seed=1)
    decoder = SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer)
    samples = []
    for _ in range(4):
        torch.manual_seed(123)
        samples.append(decoder.generate(IDS, max_new_tokens=24, do_sample=True).sequences)
    assert all(torch.equal(s, samples[0]) for s in samples)


def test_a_tree_call_beside_another_threads_forward_still_verifies_trees():
    """A multi-token forward on the CPU runs the model's sdpa as grouped_sdpa by switching its
    config for the forward; a tree call starting in another thread meanwhile read that name and
    refused the tree layout (LayoutNotSupported)."""
    import threading

    target, tokenizer = tiny_random("llama", seed=1)
    draft, _ = tiny_random("llama", seed=2)
    decoder = SpecDecoder(target, draft, tokenizer=tokenizer, tree=True, schedule="fixed", num_tokens=2)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    want = target.generate(ids, max_new_tokens=12, do_sample=False)
    inside, other_done, results = threading.Event(), threading.Event(), {}

    def hold(module, args, output):  # keeps the first call inside a multi-token forward
        if not inside.is_set() and target.config._attn_implementation != "sdpa":
            inside.set()
            other_done.wait(timeout=60)

    def call(name):
        try:
            results[name] = decoder.generate(ids, max_new_tokens=12).sequences
        finally:
            other_done.set() if name == "second" else None

    handle = target.model.layers[0].register_forward_hook(hold)
    first = threading.Thread(target=call, args=("first",))
    first.start()
    assert inside.wait(timeout=60)
    handle.remove()
    call("second")
    first.join()
    assert torch.equal(results["first"], want) and torch.equal(results["second"], want)


def _pinned(seed: int = 1):
    """A tiny llama whose fast output layer and packed weights are pinned on (timing declines both
    on models this small; larger ones get them where they time faster)."""
    from specdec.engines.forwards.head import FastHead
    from specdec.engines.forwards.packed import PackedLinears

    target, tokenizer = tiny_random("llama", seed=seed)
    FastHead.pin(target, True)
    PackedLinears.pin(target, True)
    return target, tokenizer


def _exact(decoder, target, ids=IDS, new=16):
    return torch.equal(decoder.generate(ids, max_new_tokens=new).sequences,
                       target.generate(ids, max_new_tokens=new, do_sample=False))


def test_a_model_changed_between_calls_is_decided_again():
    """Another dtype (the packed-weights probe and the pooled static caches kept float32), a
    replaced output layer (the fast head kept the old one) and weights rewritten through .data
    (untracked: the packed copies kept the old values) each gave errors or other tokens."""
    import copy

    for cache in ("dynamic", "static"):
        target, tokenizer = _pinned()
        decoder = SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer, cache_implementation=cache)
        assert _exact(decoder, target)
        target.to(torch.float64)
        assert _exact(decoder, target) and _exact(SpecDecoder(target, "prompt_lookup", cache_implementation=cache),
                                                  target)
    target, tokenizer = _pinned()
    other, _ = tiny_random("llama", seed=2)
    decoder = SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer, schedule="fixed", num_tokens=6)
    assert _exact(decoder, target)
    target.lm_head = copy.deepcopy(other.lm_head)
    assert _exact(decoder, target)
    with torch.no_grad():  # e.g. a weight sync written through .data
        for mine, theirs in zip(target.parameters(), other.parameters()):
            mine.data.copy_(theirs.data)
    assert _exact(decoder, target)


def test_the_self_draft_copy_runs_none_of_the_targets_hooks():
    """The copy was deep-copied with the hooks on the target at its first call, and ran them in
    every later call after the user had removed them."""
    target, tokenizer = tiny_random("llama", seed=1)
    decoder = SpecDecoder(target, "self_draft", tokenizer=tokenizer, weights="bfloat16", compile_draft=False,
                          schedule="fixed", num_tokens=3)
    calls = []
    handle = target.register_forward_hook(lambda module, args, output: calls.append(1))
    decoder.generate(IDS, max_new_tokens=8)
    handle.remove()
    calls.clear()
    assert _exact(decoder, target, new=8) and not calls


def test_a_replaced_rotary_embedding_is_seen_by_the_scripted_stack():
    """The scripted decoder stack kept the rotary embedding it was set up with (a buffer, no
    parameter: another rope_theta gave other tokens)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    import copy

    target, tokenizer = tiny_random("qwen2", seed=1)
    ids = torch.tensor([[(7 * i) % 250 for i in range(60)]])  # positions far enough apart for rope_theta to matter
    decoder = SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer)
    assert _exact(decoder, target, ids)
    config = copy.deepcopy(target.config)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10.0}
    target.model.rotary_emb = Qwen2RotaryEmbedding(config=config)
    assert _exact(decoder, target, ids)


def test_a_norm_eps_changed_in_place_is_seen_by_the_scripted_stack():
    """The scripted decoder stack read each norm's eps once (a float attribute, no tensor: the
    layout check did not see it change, and the old eps gave other tokens)."""
    target, tokenizer = tiny_random("qwen2", seed=1)
    decoder = SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer)
    assert _exact(decoder, target)
    for layer in target.model.layers:
        layer.input_layernorm.variance_epsilon = 3.0
    assert _exact(decoder, target)
