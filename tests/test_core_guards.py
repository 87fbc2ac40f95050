"""Guards around the loop: padded vocabularies, generation-config processors honoured, bad proposals, top_k=0."""

import pytest
import torch

from specdec import Proposal, SpecDecoder
from specdec.generators import CandidateGenerator
from specdec.models import tiny_random

from helpers import repetitive_prompt


def test_draft_with_a_smaller_padded_vocabulary():
    """A target whose head is padded past the draft's embedding may emit ids the draft lacks."""
    target, _ = tiny_random("llama", seed=1, vocab_size=320)
    draft, _ = tiny_random("llama", seed=1, vocab_size=300)
    ids = repetitive_prompt(20, seed=3)
    ref = target.generate(ids, max_new_tokens=60, do_sample=False)
    assert bool((ref[0, ids.shape[1]:] >= 300).any()), "the reference should use ids the draft lacks"
    out = SpecDecoder(target, draft, num_tokens=3).generate(ids, max_new_tokens=60)
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("setting,value", [("repetition_penalty", 1.3), ("no_repeat_ngram_size", 2),
                                           ("min_new_tokens", 5), ("suppress_tokens", [3])])
def test_generation_config_processors_are_honoured(setting, value):
    """A logits processor the target's generation config asks for applies at every verified
    position: the output is target.generate()'s (docs/generation.md)."""
    target, _ = tiny_random("llama", seed=1)
    setattr(target.generation_config, setting, value)
    ids = repetitive_prompt(8)
    out = SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=12)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=12, do_sample=False))


class OutOfVocabulary(CandidateGenerator):
    def propose(self, ctx, max_drafts):
        return Proposal(torch.full((ctx.batch_size, 2), 10_000), torch.full((ctx.batch_size,), 2))


def test_a_generator_proposing_ids_outside_the_vocabulary_is_named():
    target, _ = tiny_random("llama", seed=1)
    with pytest.raises(ValueError, match="OutOfVocabulary.*outside the target's vocabulary"):
        SpecDecoder(target, OutOfVocabulary()).generate(repetitive_prompt(8), max_new_tokens=4)


def test_top_k_zero_means_no_top_k():
    target, _ = tiny_random("llama", seed=1)
    ids = repetitive_prompt(8)
    runs = [SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=12, do_sample=True, top_k=k,
                                                         generator=torch.Generator().manual_seed(5)).sequences
            for k in (0, None)]
    assert torch.equal(runs[0], runs[1])
