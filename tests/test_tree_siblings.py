"""``draft_model``'s alternatives under sampling (``with_siblings``), verified by recursive rejection.

A chain token drawn from the draft's distribution q, alternatives beside it drawn without
replacement from what is left of q, and fewer nodes of room than alternatives drawn: which ones a
row offers must not depend on their own tokens, or an offered alternative is not distributed as
the ``probs`` it reports and the committed token is not the target's (a later alternative's value
depends on the token drawn before it; choosing between them by value once biased the first
committed token from 0.752 to 0.786 on the first case below). Checked against a fixed target
distribution P (the same after every node), chi-square on the first committed token.
"""

from __future__ import annotations

import pytest
import torch

from candidate_generators.draft_model import DraftModelGenerator, with_siblings
from specdec import SpecDecoder
from specdec.generators import Proposal
from specdec.sampling import SamplingParams
from specdec.verify import tree_speculative_sample

from test_sampling_lossless import (PROMPT, TINY_VOCAB, assert_same_distribution, exact_three_token_joint,
                                    joint_counts, tiny_vocab_llama)

ROWS = 100_000
#: (target P, draft q): the first step of a gemma2 case where the bias was found, and a draft far
#: from its target
PAIRS = {
    "found": ([0.0805, 0.7522, 0.0181, 0.0401, 0.0866, 0.0071, 0.0085, 0.0069],
              [0.0533, 0.6105, 0.0849, 0.0208, 0.0820, 0.0349, 0.0553, 0.0583]),
    "far": ([0.05, 0.05, 0.4, 0.3, 0.1, 0.05, 0.03, 0.02],
            [0.5, 0.2, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05]),
}


def first_committed(target: torch.Tensor, draft: torch.Tensor, width: int, budget: int, seed: int) -> torch.Tensor:
    """[ROWS] the first token each row commits: a one-token chain from ``draft`` with its
    alternatives (``width - 1`` drawn, ``budget`` nodes of room), verified against ``target``."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.numel()
    x = torch.multinomial(draft.expand(ROWS, vocab), 1, generator=g)  # [ROWS, 1] the chain's token
    chain = Proposal(x, torch.ones(ROWS, dtype=torch.long), probs=draft.expand(ROWS, 1, vocab).clone(),
                     confidence=draft[x])
    tree = with_siblings(chain, [draft.expand(ROWS, vocab).clone()], torch.full((ROWS,), budget), width, g)
    assert int(tree.lengths.max()) == min(budget, width)  # the room is what limits the alternatives
    verdict = tree_speculative_sample(target.expand(ROWS, tree.token_ids.shape[1] + 1, vocab).clone(),
                                      tree.token_ids, tree.parents, tree.lengths, tree.probs, g)
    accepted = tree.token_ids.gather(1, verdict.path[:, :1])[:, 0]
    return torch.where(verdict.accepted > 0, accepted, verdict.next_token)


@pytest.mark.parametrize("width, budget", [(3, 2), (4, 2), (4, 3)])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_alternatives_within_less_room_than_drawn_keep_the_target_distribution(pair, width, budget):
    target, draft = (torch.tensor(p) / sum(p) for p in PAIRS[pair])
    first = first_committed(target, draft, width, budget, seed=width * 10 + budget)
    assert_same_distribution(torch.bincount(first, minlength=target.numel())[None], target[None])


def test_a_draft_models_tree_samples_the_target_distribution_without_a_torch_generator():
    """A sampled call without ``generator=`` draws from torch's global generator: draft_model's trees
    took the missing generator for greedy decoding (their next-best tokens as alternatives, with the
    sampled chain's ``probs``) and crashed."""
    target, params, rows = tiny_vocab_llama(0), SamplingParams(True, 0.8, top_k=6), 20_000
    decoder = SpecDecoder(target, DraftModelGenerator(tiny_vocab_llama(3), tree=True, schedule="fixed", num_tokens=1))
    torch.manual_seed(3)
    out = decoder.generate(PROMPT.repeat(rows, 1), max_new_tokens=3, do_sample=True, temperature=params.temperature,
                           top_k=params.top_k)
    assert out.stats.tree_steps > 0 and out.stats.tree_nodes > out.stats.tree_depth
    assert_same_distribution(joint_counts(out.sequences[:, PROMPT.shape[1]:], TINY_VOCAB),
                             exact_three_token_joint(target, PROMPT, params))
