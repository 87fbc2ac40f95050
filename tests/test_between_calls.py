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
