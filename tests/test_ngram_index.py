"""prompt_lookup's NgramIndex: each step's match equals lookup_match's search of the whole row."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from candidate_generators.prompt_lookup import NgramIndex, lookup_match


def _same(index: NgramIndex, b: int, row: list[int], max_ngram: int, min_ngram: int, count: int) -> None:
    expected = lookup_match(torch.tensor(row, dtype=torch.long), max_ngram, min_ngram, count)
    assert index.match(b, count) == (expected.n, expected.contested, expected.drafts.tolist())


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=3),
       steps=st.lists(st.integers(0, 4), min_size=1, max_size=12), ngrams=st.sampled_from([(4, 2), (3, 1), (2, 2)]),
       count=st.integers(1, 6))
def test_the_index_matches_a_search_of_the_whole_row_as_rows_grow(rows, steps, ngrams, count):
    """Rows grow by a few tokens a step (small vocabulary: many repeats, contested and not); after
    every update each row's match is lookup_match's on its whole sequence."""
    max_ngram, min_ngram = ngrams
    width = max(len(r) for r in rows) + sum(steps)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    lengths = [len(r) for r in rows]
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = torch.tensor(r)
    index = NgramIndex(max_ngram, min_ngram)
    generator = torch.Generator().manual_seed(len(steps))
    for grow in [0, *steps]:
        for b in range(len(rows)):
            tokens[b, lengths[b]: lengths[b] + grow] = torch.randint(0, 4, (grow,), generator=generator)
            lengths[b] += grow
        index.update([tokens[b, :n].tolist() for b, n in enumerate(lengths)])
        for b in range(len(rows)):
            _same(index, b, tokens[b, : lengths[b]].tolist(), max_ngram, min_ngram, count)


def test_a_row_that_changed_is_read_again_and_rows_follow_a_selection():
    """A row whose last indexed token differs (not a continuation) or that got shorter is re-read
    whole; select_rows keeps the chosen rows' indexes in their new order."""
    rows = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5, 6]]
    index = NgramIndex(3, 2)
    index.update(rows)
    _same(index, 0, [1, 2, 3, 1, 2, 3, 1, 2], 3, 2, 4)
    index.update([[1, 2, 3, 1, 2, 3, 1, 9], rows[1]])  # rewritten under the index
    _same(index, 0, [1, 2, 3, 1, 2, 3, 1, 9], 3, 2, 4)
    index.update([[1, 2, 3, 1, 2], rows[1]])  # shorter
    _same(index, 0, [1, 2, 3, 1, 2], 3, 2, 4)
    index.select_rows([1])
    _same(index, 0, [5, 6, 5, 6, 5, 6], 3, 2, 4)
    index.update([[5, 6, 5, 6, 5, 6, 0]])
    _same(index, 0, [5, 6, 5, 6, 5, 6, 0], 3, 2, 4)
