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
