"""``suffix``: drafts from everything the decoder has already written, across calls (suffix decoding).

Two structures answer each row: a suffix trie over the call's own row (its prompt and what it has
committed so far, extended as tokens commit), and the decoder's :class:`SuffixMemory`, a trie per
scope over the prompts and outputs of its earlier calls, bounded in bytes (oldest calls dropped
first). Each gives its most frequent chain after the longest suffix of the row it has seen
(:class:`Branch`); the row drafts the one with more drafts expected to be accepted. No model runs:
the drafts are point masses, which the verifier handles losslessly under greedy decoding and
sampling alike. The tries are in ``trie.py``, the store in ``memory.py``; this module holds the generator.

Draft lengths: a chain stops where its next token followed the match less than ``min_prob`` of
the time, and at ``match_factor`` times the match's length; each draft's frequency is its
``Proposal.confidence`` and the match length picks its source (four buckets, longest first), so
the core's cost-aware policy learns how often such drafts are accepted and verifies only the part
of a block that pays (docs/draft_length.md); drafts are free (``DraftingInfo.free``), so a row is
asked for all it may take and that part is sized by its own source.

Memory: the instance the user built (the decoder's configuration) holds the store; ``session()``
gives each call its own per-call state and the same store, so the calls of one decoder share it
(and only they: ``SpecDecoder(target, "suffix")`` builds a store per decoder). A call joins the
store when it ends (its ``report``), every row with its prompt; ``generate(..., memory_scope="x")``
(a per-call option, ``call_options``) keeps calls of different scopes apart. The store's lock
serves concurrent calls from several threads. ``save``, ``load``, ``clear`` and the sizes in
``out.stats.generator`` are what a service needs (docs/suffix.md).

Trees (``tree=True``, default False): where the row's own chain and the memory's differ, the row
proposes both as one token tree (``specdec.generators.continuation_trie``: the better leading, the
other from where it leaves it, within the step's budget; docs/trees.md); where they agree, or one
has nothing, its chain.
"""

from __future__ import annotations

import copy
import os

import torch

from specdec.generators import (CandidateGenerator, DecodeContext, DraftingInfo, DraftLengthSchedule, Feedback,
                                Proposal, continuation_trie, host_ints, long_tensor)
from specdec.registry import register_candidate_generator

from .memory import SuffixMemory, check_scope
from .trie import Branch, SuffixTrie

__all__ = ["Branch", "SuffixGenerator", "SuffixMemory", "SuffixTrie"]

#: a match of at least this many tokens drafts from each source, the longest first
SOURCE_MATCH = (12, 6, 3, 1)
#: the acceptance prior of each source (guesses until a call measures them: the policy's records take
#: over within a few steps, docs/draft_length.md)
SOURCE_PRIOR = (0.9, 0.8, 0.6, 0.3)


def match_source(match: int) -> int:
    """The source of drafts after a match of ``match`` tokens (0: the longest; also rows without a match)."""
    return next((s for s, least in enumerate(SOURCE_MATCH) if match >= least), 0)


@register_candidate_generator("suffix")
class SuffixGenerator(CandidateGenerator):
    """Suffix decoding; see the module docstring. Options: ``max_depth`` (trie depth: the longest
    match is one token less), ``min_match`` (the shortest match that drafts), ``min_prob`` (a chain
    ends at a continuation less frequent than this), ``match_factor`` (drafts per matched token at
    most), ``memory_bytes`` (the store's bound; 0: no memory across calls), ``tree`` (both
    structures' chains as one tree where they differ), and the draft-length schedule of
    prompt_lookup (``schedule``, ``num_tokens``, ``max_tokens``)."""

    #: keyword arguments of ``generate()`` this generator takes per call (SpecDecoder passes them to for_call)
    call_options = ("memory_scope",)

    def __init__(self, *, max_depth: int = 24, min_match: int = 1, min_prob: float = 0.1, match_factor: float = 2.0,
                 memory_bytes: int = 64 << 20, num_tokens: int = 4, schedule: str = "auto", max_tokens: int = 16,
                 tree: bool = False):
        if not isinstance(max_depth, int) or max_depth < 2:
            raise ValueError(f"max_depth must be an int >= 2, got {max_depth!r}")
        if not isinstance(min_match, int) or not 1 <= min_match < max_depth:
            raise ValueError(f"min_match must be an int in [1, max_depth), got {min_match!r}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob!r}")
        if not match_factor > 0:
            raise ValueError(f"match_factor must be > 0, got {match_factor!r}")
        if not isinstance(memory_bytes, int) or memory_bytes < 0:
            raise ValueError(f"memory_bytes must be an int >= 0, got {memory_bytes!r}")
        if not isinstance(tree, bool):
            raise TypeError(f"tree must be True or False, got {tree!r}")
        self.tree = tree
        self.max_depth, self.min_match, self.min_prob, self.match_factor = max_depth, min_match, min_prob, match_factor
        self.schedule = DraftLengthSchedule(num_tokens, schedule, max_tokens)
        self.memory = SuffixMemory(memory_bytes, max_depth)  # the decoder's: every session shares it
        self.scope: str | None = None

    # -- configuration: the calls of one decoder --------------------------------------------------
    def session(self) -> "SuffixGenerator":
        """A call's generator: this configuration's store and scope, per-call state of its own (set in setup)."""
        session = copy.copy(self)
        session.schedule = copy.deepcopy(self.schedule)
        return session

    def for_call(self, memory_scope: str | None = None) -> "SuffixGenerator":
        """The configuration of a call given ``memory_scope``: the same store, read and written in that scope."""
        bound = copy.copy(self)
        bound.scope = check_scope(memory_scope)
        return bound

    def save(self, path: str | os.PathLike) -> None:
        """Write the store to ``path`` (versioned, with a digest) for a later process to :meth:`load`."""
        self.memory.save(path)

    def load(self, path: str | os.PathLike) -> None:
        """Replace the store by the one saved at ``path``; a damaged file is refused, naming it."""
        self.memory.load(path)

    def clear(self) -> None:
        """Forget every earlier call (of every scope)."""
        self.memory.clear()

    # -- one call --------------------------------------------------------------------------------
    def drafting(self) -> DraftingInfo:
        """One source per bucket of match lengths (:data:`SOURCE_MATCH`), the longest first; drafts
        are free (dict reads), so each row's own source and frequencies size what is verified."""
        return DraftingInfo(SOURCE_PRIOR, self.schedule.policy_drafts, free=True)

    def setup(self, ctx: DecodeContext) -> None:
        self.schedule.reset(ctx.batch_size)
        self.rows = [list(row) for row in ctx.token_lists()]  # committed, per row (own copies: they grow)
        self.tries = [SuffixTrie(self.max_depth) for _ in self.rows]  # the call's own, per row
        self.active = [trie.extend(trie.start(), row) for trie, row in zip(self.tries, self.rows)]
        self.done: list[list[int]] = []  # rows that left the batch, kept for the memory
        self.counters = {"drafted_call": 0, "drafted_memory": 0, "matched_tokens": 0, "matches": 0}
        if self.tree:
            self.counters["trees"] = 0  # steps that proposed a tree

    def branch(self, row: list[int], trie: SuffixTrie, limit: int) -> tuple[Branch, str, Branch]:
        """The better of the row's own chain and the memory's, which it is, and the other."""
        how = dict(limit=limit, longest=self.max_depth - 1, min_match=self.min_match, min_prob=self.min_prob,
                   factor=self.match_factor)
        own = trie.draft(row, **how)
        remembered = self.memory.draft(self.scope, row, **how) if self.memory.limit else Branch()
        if remembered.score() > own.score():
            return remembered, "drafted_memory", own
        return own, "drafted_call", remembered

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        budget = [min(a, b) for a, b in zip(host_ints(self.schedule.current), host_ints(max_drafts))]  # [B]
        chosen, trees = [], []
        for b, row in enumerate(self.rows):
            branch, where, other = self.branch(row, self.tries[b], budget[b]) if budget[b] > 0 else (
                Branch(), "", Branch())
            if branch.tokens:
                self.counters[where] += len(branch.tokens)
                self.counters["matches"] += 1
                self.counters["matched_tokens"] += branch.match
            chosen.append(branch)
            if self.tree:
                trees.append(continuation_trie([branch.tokens, other.tokens] if other.tokens else [branch.tokens],
                                               budget[b]))
        device = ctx.tokens.device
        leads = [len(b.tokens) for b in chosen]  # each row's leading chain: the drafts its confidences describe
        if any(_lead(nodes) < len(nodes) for nodes in trees):
            proposal = Proposal.from_tree(trees, device)
            leads = [_lead(nodes) for nodes in trees]
            self.counters["trees"] += 1
        else:
            proposal = Proposal.from_rows([b.tokens for b in chosen], device)
        k = proposal.token_ids.shape[1]
        confidence = torch.full((len(chosen), k), float("nan"))  # [B, K] each draft's frequency after its context
        for b, branch in enumerate(chosen):
            confidence[b, : leads[b]] = torch.tensor(branch.probs[: leads[b]])
        proposal.confidence = confidence.to(device)
        proposal.sources = long_tensor([match_source(b.match) for b in chosen])
        return proposal

    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        self.schedule.update(feedback)
        for b, (row, now) in enumerate(zip(self.rows, ctx.token_lists())):  # the tokens just committed join the row and its trie
            new = now[len(row):]
            row.extend(new)
            self.active[b] = self.tries[b].extend(self.active[b], new)

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = host_ints(rows)
        kept = set(keep)
        self.done += [row for b, row in enumerate(self.rows) if b not in kept]
        self.rows = [self.rows[i] for i in keep]
        self.tries = [self.tries[i] for i in keep]
        self.active = [self.active[i] for i in keep]
        self.schedule.select_rows(rows)

    def report(self) -> dict:
        """The call's counters and the store's size, after this call's rows joined it."""
        self.memory.add(self.scope, self.done + self.rows)
        self.done, self.rows = [], []
        return {**self.counters, **self.memory.stats()}


def _lead(nodes: list[tuple[int, int]]) -> int:
    """How many of a trie's nodes, in order, form its leading chain (each the child of the one before)."""
    return next((i for i, (_, parent) in enumerate(nodes) if parent != i - 1), len(nodes))
