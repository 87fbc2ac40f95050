"""benchmarks/tree_ceiling.py: the steps each way of drafting takes on a known answer."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from tree_ceiling import copy_steps, lookup_steps  # noqa: E402

VOCAB = 10


class Scripted(torch.nn.Module):
    """A "copy" whose top two tokens at answer position j are ``picks[j]`` (first, second), the
    first with probability about ``sure[j]`` (its second's is lower)."""

    def __init__(self, prompt_length: int, picks: list[tuple[int, int]], sure: list[float]):
        super().__init__()
        self.prompt_length, self.picks, self.sure = prompt_length, picks, sure

    def forward(self, input_ids):
        logits = torch.full((1, input_ids.shape[1], VOCAB), -30.0)
        for j, ((a, b), p) in enumerate(zip(self.picks, self.sure)):
            logits[0, self.prompt_length - 1 + j, [a, b]] = torch.tensor([p, (1 - p) / 2]).log()
        return SimpleNamespace(logits=logits)


def steps(picks, sure, depth=6):
    prompt, output = [1, 2], [3, 4, 5, 6][: len(picks)]
    return copy_steps(Scripted(len(prompt), picks, sure), prompt, output, SimpleNamespace(depth=depth))


def test_a_sibling_that_holds_ends_the_path_as_a_leaf_or_is_drafted_on():
    # the answer 3 4 5; the copy: 3, then 0 with the answer 4 second, then 5
    picks = [(3, 0), (0, 4), (5, 0)]
    # chain: 3 accepted, the target's 4; then 5 and the end: 2 steps. A tree: 3, 4 (the sibling) and the
    # target's 5: 1 step; drafting on from the sibling (at the least sure depth) takes 5 too: 1 step
    assert steps(picks, [0.9, 0.6, 0.9]) == {"chain": 2, "tree": 1, "branch": 1, "subtree": 1}
    assert steps(picks, [0.9, 0.6, 0.9], depth=1) == {"chain": 2, "tree": 2, "branch": 2, "subtree": 2}


def test_a_branch_grows_only_where_the_copy_was_least_sure():
    # the answer 3 4 5 6; the copy misses 4 (its second choice) but is least sure at 5, which it gets right
    picks = [(3, 0), (0, 4), (5, 0), (6, 0)]
    # chain: 3 (+4), then 5 6: 2 steps; tree: 3 4 (+5), then 6: 2 steps; branch: grows at 5, so as the chain;
    # subtree: 3, 4 (the sibling), 5, 6 drafted on from it: 1 step
    assert steps(picks, [0.9, 0.6, 0.45, 0.9]) == {"chain": 2, "tree": 2, "branch": 2, "subtree": 1}


def test_lookup_ways_take_the_latest_match_then_any_continuation():
    # "1 2" occurred twice: followed by 3 9 0 (older) and 3 4 0 (latest); the answer goes 3 9 0 7
    prompt = [1, 2, 3, 9, 0, 1, 2, 3, 4, 0, 1, 2]
    args = SimpleNamespace(max_ngram=2, min_ngram=2, depth=10, branches=4, branch_min_ngram=None)
    # chain: the latest continuation holds 3 (+9); then "3 9" was followed by 0: 0 (+7): 2 steps.
    # tree and all: the older continuation holds 3 9 0 (+7): 1 step
    assert lookup_steps(prompt, [3, 9, 0, 7], args) == {"chain": 2, "tree": 1, "all": 1}
    assert lookup_steps(prompt, [3, 9, 0, 7], SimpleNamespace(**{**vars(args), "branches": 1}))["tree"] == 2


def test_shorter_matches_add_branches_only_beside_a_chain():
    one = SimpleNamespace(max_ngram=2, min_ngram=2, depth=10, branches=4, branch_min_ngram=1)
    two = SimpleNamespace(**{**vars(one), "branch_min_ngram": None})
    # "1 2" was followed by 4 7; "2" alone also by 3 8; the answer goes 3 8 6. The chain misses (+3),
    # then "2 3" gives 8 (+6): 2 steps; a tree with the one-token match's continuation: 3 8 (+6)
    prompt = [9, 2, 3, 8, 1, 2, 4, 7, 1, 2]
    assert lookup_steps(prompt, [3, 8, 6], one) == {"chain": 2, "tree": 1, "all": 1}
    assert lookup_steps(prompt, [3, 8, 6], two) == {"chain": 2, "tree": 2, "all": 2}
    # no two-token match at the end ("7 2"): no drafts at all, though "2" alone was followed by 3 8
    assert lookup_steps([5, 1, 2, 3, 8, 1, 2, 4, 7, 2], [3, 8], one) == {"chain": 2, "tree": 2, "all": 2}
