"""``prompt_lookup``: copy what followed the latest earlier occurrence of the current suffix.

For each row, try n-grams from ``max_ngram`` down to ``min_ngram``: take the row's last n tokens,
find their most recent earlier occurrence in prompt + generated text, and propose the tokens that
followed it. No model runs; the drafts are point masses, which the verifier handles losslessly.

How long a suffix matched, and whether its earlier occurrences agree on what follows it, say how
far a copy is likely to hold, so under the cost-aware policy each (match length, contested) pair
is a source of its own (``Proposal.sources``; source 0 the longest uncontested match): the policy
learns each one's acceptance apart and verifies long blocks after sure matches, short ones or
none after weak ones. A match is *contested* when the suffix occurred more than once before and
not every occurrence was followed by the same token (the latest one's is proposed). The
acceptance measured per source, from which ``NGRAM_PRIOR`` is rounded, is in
docs/draft_length.md ("Its inputs").

With ``tree=True`` a row proposes a token tree (docs/trees.md) instead of one copy: what followed
the latest match (the chain it would propose otherwise, node 0 on and first at every level, so
the tree's leading chain is that copy) merged with what followed up to ``branches - 1`` other
earlier occurrences of the suffix (older ones, then shorter suffixes'), as one trie (shared
prefixes once), within the step's draft budget: each other continuation adds at most a quarter of
the budget past where it leaves the trie, together at most half of it, and the first copy is
shortened to make room. Rows whose continuations all agree propose a chain, and a step where every
row does proposes no tree at all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.generators import (CandidateGenerator, DecodeContext, DraftingInfo, DraftLengthSchedule, Feedback,
                                Proposal, continuation_trie, host_ints, long_tensor)
from specdec.registry import register_candidate_generator


#: the acceptance prior of a draft that follows a match of n tokens (the longest listed for longer
#: ones), uncontested and contested: what the first draft after such a match scored in the run
#: quoted in the module docstring
NGRAM_PRIOR = {1: (0.4, 0.15), 2: (0.6, 0.25), 3: (0.7, 0.25), 4: (0.9, 0.5)}


class Match(NamedTuple):
    n: int  # tokens of the suffix matched (0: none)
    contested: bool  # the suffix's earlier occurrences were not all followed by the same token
    drafts: torch.Tensor | list[int]  # [<= count] the tokens that followed its latest earlier occurrence


def lookup_match(sequence: torch.Tensor, max_ngram: int, min_ngram: int, count: int) -> Match:
    """sequence [L] -> the longest suffix (``max_ngram`` down to ``min_ngram`` tokens) seen earlier:
    its length, whether its earlier occurrences disagree on the next token, and up to ``count``
    tokens that followed its latest earlier occurrence; ``Match(0, False, empty)`` when none is."""
    length = sequence.shape[0]
    for n in range(max_ngram, min_ngram - 1, -1):
        if length <= n:
            continue
        suffix = sequence[length - n:]
        windows = sequence[: length - 1].unfold(0, n, 1)  # [L-n, n]: windows with a next token
        hits = (windows == suffix).all(dim=1).nonzero().flatten()
        if hits.numel():
            following = sequence[hits + n]  # the token after each earlier occurrence
            start = int(hits[-1]) + n
            return Match(n, bool((following != following[-1]).any()), sequence[start: start + count])
    return Match(0, False, sequence[:0])


class NgramIndex:
    """:func:`lookup_match` kept up to date as rows grow, for a step that must not search each
    row's whole sequence: per row, the row's tokens as a list and, for every n-gram of
    ``min_ngram`` to ``max_ngram`` tokens that has a next token, where it last occurred and whether
    its occurrences disagree on that next token. A step reads only each row's new tokens (and the
    one before them, which must be what the index holds: a row that changed otherwise is re-read
    whole) and indexes the windows they complete; a match is then a few dictionary lookups."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.rows: list[list[int]] = []  # each row's tokens so far
        self.tables: list[dict[tuple[int, ...], list]] = []  # n-gram -> [latest start, next token, contested]

    def update(self, rows: list[list[int]]) -> None:
        """The rows now hold ``rows`` (host lists, read only): index what each gained since the last update."""
        if len(self.rows) != len(rows):
            self.rows, self.tables = [[] for _ in rows], [{} for _ in rows]
        for b, tokens in enumerate(rows):
            row, length = self.rows[b], len(tokens)
            known = len(row)
            new = tokens[max(known - 1, 0): length]
            if known and (length < known or new[0] != row[-1]):  # not a continuation of what is indexed
                self.rows[b], self.tables[b] = [], {}
                new, known, row = tokens[:length], 0, self.rows[b]
            elif known:
                new = new[1:]
            row.extend(new)
            table = self.tables[b]
            for n in range(self.min_ngram, self.max_ngram + 1):
                for following in range(max(known, n), len(row)):  # windows whose next token is new
                    key, token = tuple(row[following - n: following]), row[following]
                    entry = table.get(key)
                    if entry is None:
                        table[key] = [following - n, token, False]
                    else:
                        entry[0] = following - n
                        entry[2] = entry[2] or token != entry[1]

    def match(self, b: int, count: int) -> tuple[int, bool, list[int]]:
        """Row b's :func:`lookup_match`: (n, contested, up to ``count`` following tokens)."""
        row, table = self.rows[b], self.tables[b]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(row) <= n:
                continue
            entry = table.get(tuple(row[len(row) - n:]))
            if entry is not None:
                start = entry[0] + n
                return n, entry[2], row[start: start + count]
        return 0, False, []

    def select_rows(self, rows: list[int]) -> None:
        if self.rows:
            self.rows, self.tables = [self.rows[b] for b in rows], [self.tables[b] for b in rows]


def lookup(sequence: torch.Tensor, max_ngram: int, min_ngram: int, count: int) -> torch.Tensor:
    """sequence [L] -> up to ``count`` tokens that followed the latest earlier match of its suffix."""
    return lookup_match(sequence, max_ngram, min_ngram, count).drafts


def other_continuations(sequence: torch.Tensor, max_ngram: int, min_ngram: int, count: int,
                        limit: int) -> list[list[int]]:
    """sequence [L] -> up to ``limit`` distinct continuations (each up to ``count`` tokens) of the
    earlier occurrences of its suffix, the latest occurrence of the longest suffix first (the one
    :func:`lookup_match` proposes), then older ones, then shorter suffixes'."""
    length, found = sequence.shape[0], []
    for n in range(max_ngram, min_ngram - 1, -1):
        if length <= n:
            continue
        windows = sequence[: length - 1].unfold(0, n, 1)  # [L-n, n]: windows with a next token
        hits = (windows == sequence[length - n:]).all(dim=1).nonzero().flatten().tolist()
        for hit in reversed(hits):
            continuation = sequence[hit + n: hit + n + count].tolist()
            if continuation not in found:
                found.append(continuation)
                if len(found) == limit:
                    return found
    return found


def ngram_prior(n: int, contested: bool = False) -> float:
    return NGRAM_PRIOR[min(n, max(NGRAM_PRIOR))][int(contested)]


def ngram_source(max_ngram: int, n: int, contested: bool = False) -> int:
    """The source of a match of n tokens when n-grams up to ``max_ngram`` are tried: two per length,
    uncontested then contested, the longest first (0: the longest uncontested, and rows without a
    match, n = 0)."""
    return 2 * (max_ngram - n) + int(contested) if n else 0


@register_candidate_generator("prompt_lookup")
class PromptLookupGenerator(CandidateGenerator):
    # Defaults: matches of two to four tokens, the longest tried first. A one-token match is too
    # seldom right to pay for a wider forward, and replaying the policy on recorded outputs
    # (benchmarks/replay_policy.py) chose 4..2; the measurements are in docs/draft_length.md.
    def __init__(self, *, num_tokens: int = 4, max_ngram: int = 4, min_ngram: int = 2,
                 schedule: str = "auto", max_tokens: int = 10, tree: bool = False, branches: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not isinstance(tree, bool):
            raise TypeError(f"tree must be True or False, got {tree!r}")
        if not isinstance(branches, int) or isinstance(branches, bool) or branches < 1:
            raise ValueError(f"branches must be a positive int, got {branches!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tree, self.branches = tree, branches
        self.schedule = DraftLengthSchedule(num_tokens, schedule, max_tokens)
        self.index = NgramIndex(max_ngram, min_ngram)  # a fresh one each call (setup)

    def setup(self, ctx: DecodeContext) -> None:
        self.schedule.reset(ctx.batch_size)
        self.index = NgramIndex(self.max_ngram, self.min_ngram)

    def drafting(self) -> DraftingInfo:
        """Two sources per match length, the longest first, uncontested then contested
        (``Proposal.sources`` = :func:`ngram_source`)."""
        priors = tuple(ngram_prior(n, contested) for n in range(self.max_ngram, self.min_ngram - 1, -1)
                       for contested in (False, True))
        return DraftingInfo(priors, self.schedule.policy_drafts)

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        budget = [min(a, b) for a, b in zip(host_ints(self.schedule.current), host_ints(max_drafts))]
        tokens, lengths = ctx.tokens, host_ints(ctx.lengths)
        self.index.update(ctx.token_lists())
        found = [Match(*self.index.match(b, budget[b])) if budget[b] > 0 else Match(0, False, [])
                 for b in range(len(lengths))]
        trees = [self._tree(tokens[b, : lengths[b]], m, budget[b]) for b, m in enumerate(found)] if self.tree else None
        if trees is not None and any(any(parent != i - 1 for i, (_, parent) in enumerate(t)) for t in trees):
            proposal = Proposal.from_tree(trees, tokens.device)
        else:
            proposal = Proposal.from_rows([m.drafts for m in found], tokens.device)
        proposal.sources = long_tensor([ngram_source(self.max_ngram, m.n, m.contested) for m in found])
        return proposal

    def _tree(self, sequence: torch.Tensor, match: Match, budget: int) -> list[tuple[int, int]]:
        """One row's trie of continuations (:func:`continuation_trie`); its chain where there is one."""
        chain = [(int(t), i - 1) for i, t in enumerate(match.drafts)]
        if match.n == 0 or budget < 2 or self.branches == 1:
            return chain
        continuations = other_continuations(sequence, self.max_ngram, self.min_ngram, budget, self.branches)
        return continuation_trie(continuations, budget) if len(continuations) > 1 else chain

    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        self.schedule.update(feedback)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.schedule.select_rows(rows)
        self.index.select_rows(rows.tolist())
