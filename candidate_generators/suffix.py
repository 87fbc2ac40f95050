"""``suffix``: drafts from everything the decoder has already written, across calls (suffix decoding).

Two structures answer each row: a suffix trie over the call's own row (its prompt and what it has
committed so far, extended as tokens commit), and the decoder's :class:`SuffixMemory`, a trie per
scope over the prompts and outputs of its earlier calls, bounded in bytes (oldest calls dropped
first). Each gives its most frequent chain after the longest suffix of the row it has seen
(:class:`Branch`); the row drafts the one with more drafts expected to be accepted. No model runs:
the drafts are point masses, which the verifier handles losslessly under greedy decoding and
sampling alike.

The tries (:class:`SuffixTrie`) hold every substring of up to ``max_depth`` tokens, each node
counting its occurrences: all a suffix tree answers here is the longest suffix of the context seen
before followed by something (the *match*, at most ``max_depth - 1`` tokens) and how often each
token followed it. A chain that runs past the depth is matched again with its drafts appended, so
drafts are not bounded by the depth. Presence is suffix-closed (a suffix of a stored substring is
stored: it starts one token later and ends at the same place), so the match is found by binary
search on its length. Nodes live in flat ``array``s and one dict ``(node, token) -> child``; their
bytes are measured with ``sys.getsizeof`` on every container and on the dict's keys and values.
Counts only grow: the store forgets by dropping its oldest calls (of any scope) until about half
its bound is used and rebuilding the tries that lost calls (arrays and dicts never shrink in
place, so a rebuild is what makes the measured bytes honest again).

Draft lengths: a chain stops where its next token followed the match less than ``min_prob`` of
the time, and at ``match_factor`` times the match's length; each draft's frequency is its
``Proposal.confidence`` and the match length picks its source (four buckets, longest first), so
the core's cost-aware policy learns how often such drafts are accepted and verifies only the part
of a block that pays (docs/draft_length.md).

Memory: the instance the user built (the decoder's configuration) holds the store; ``session()``
gives each call its own per-call state and the same store, so the calls of one decoder share it
(and only they: ``SpecDecoder(target, "suffix")`` builds a store per decoder). A call joins the
store when it ends (its ``report``), every row with its prompt; ``generate(..., memory_scope="x")``
(a per-call option, ``call_options``) keeps calls of different scopes apart. The store's lock
serves concurrent calls from several threads. ``save``, ``load``, ``clear`` and the sizes in
``out.stats.generator`` are what a service needs (docs/suffix.md).

One deliberate limit: specdec's ``Proposal`` holds one chain per row (token trees are issue 49), so
a row proposes its single best chain. :meth:`SuffixTrie.children` already ranks every
continuation, so proposing a tree changes :meth:`SuffixGenerator.propose` only.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import threading
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.generators import (CandidateGenerator, DecodeContext, DraftingInfo, DraftLengthSchedule, Feedback,
                                Proposal)
from specdec.registry import register_candidate_generator

# -- the structures: bounded-depth suffix tries, the store of earlier calls -------------------------
#: edge keys are node * STRIDE + token: token ids must stay below it
STRIDE = 1 << 21
#: bytes of one int key / value object of the edge dict (keys reach 2**50, values stay below 2**30)
KEY_BYTES, VALUE_BYTES = sys.getsizeof(1 << 59), sys.getsizeof((1 << 30) - 1)
#: the save file's first line names it; VERSION changes with its layout
FORMAT, VERSION = "specdec-suffix-memory", 1


@dataclass
class Branch:
    """One chain of drafts: its tokens, each one's frequency after what preceded it (its
    probability as the counts estimate it), and the length of the match it started from."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match: int = 0

    def score(self) -> float:
        """Expected drafts accepted if each is right with its probability (the sum of the
        running products): how the generator chooses between its structures' branches."""
        total, running = 0.0, 1.0
        for p in self.probs:
            running *= p
            total += running
        return total


class SuffixTrie:
    """Every substring of up to ``max_depth`` tokens of the sequences added, with occurrence counts."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.count = array("i", [0])  # per node: occurrences (the root: tokens added)
        self.token = array("i", [-1])  # per node: the token of the edge into it
        self.first_child = array("i", [-1])
        self.next_sibling = array("i", [-1])
        self.edges: dict[int, int] = {}  # node * STRIDE + token -> child

    def _child(self, node: int, token: int) -> int:
        key = node * STRIDE + token
        child = self.edges.get(key)
        if child is None:
            child = len(self.count)
            self.count.append(0)
            self.token.append(token)
            self.first_child.append(-1)
            self.next_sibling.append(self.first_child[node])
            self.first_child[node] = child
            self.edges[key] = child
        return child

    def start(self) -> list[int]:
        """The state of a new sequence: the nodes of its suffixes of length 0 .. max_depth - 1."""
        return [0]

    def extend(self, active: list[int], tokens) -> list[int]:
        """Append ``tokens`` to the sequence whose suffixes end at ``active`` (``active[i]`` the
        node of its last i tokens); returns the state after them. Each token counts one more
        occurrence of every substring of up to ``max_depth`` tokens that ends at it."""
        depth, count, child = self.max_depth, self.count, self._child
        for token in tokens:
            token = int(token)
            if not 0 <= token < STRIDE:
                raise ValueError(f"suffix: token id {token} outside [0, {STRIDE})")
            count[0] += 1
            nxt = [0]
            for node in active:
                c = child(node, token)
                count[c] += 1
                if len(nxt) < depth:
                    nxt.append(c)
            active = nxt
        return active

    def find(self, tokens) -> int:
        """The node of ``tokens`` (a substring), -1 when it was never seen."""
        node, edges = 0, self.edges
        for token in tokens:
            node = edges.get(node * STRIDE + token, -1)
            if node < 0:
                return -1
        return node

    def children(self, node: int) -> list[tuple[int, int]]:
        """[(count, child)] of ``node``, the most frequent first (ties: the latest created first)."""
        out, child = [], self.first_child[node]
        while child >= 0:
            out.append((self.count[child], child))
            child = self.next_sibling[child]
        out.sort(key=lambda pair: -pair[0])  # stable: among equal counts the latest created stays first
        return out

    def top_child(self, node: int) -> tuple[int, int, int]:
        """(count, child, the children's total count) of ``node``'s most frequent child (ties: the
        latest created), child -1 where it has none: :meth:`children`'s first, in one pass (drafting
        asks it for every token; no list, no sort)."""
        best_count, best, total, child = 0, -1, 0, self.first_child[node]
        while child >= 0:
            c = self.count[child]
            total += c
            if c > best_count:
                best_count, best = c, child
            child = self.next_sibling[child]
        return best_count, best, total

    def match(self, context: list[int], longest: int) -> tuple[int, int]:
        """(node, length): the longest suffix of ``context``, at most ``longest`` tokens, that was
        seen followed by something (the node has a child). Binary search: that property holds for
        every shorter suffix too. (0, 0) when not even one token was."""
        lo, hi, best = 1, min(longest, self.max_depth - 1, len(context)), (0, 0)
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self.find(context[len(context) - mid:])
            if node >= 0 and self.first_child[node] >= 0:
                best, lo = (node, mid), mid + 1
            else:
                hi = mid - 1
        return best

    def draft(self, context: list[int], limit: int, longest: int, min_match: int, min_prob: float,
              factor: float) -> Branch:
        """The most frequent chain after ``context``: from its longest match, the most frequent
        child at each step while its frequency is at least ``min_prob``; matched again (drafts
        appended) where the trie's depth ends. At most ``limit`` drafts, and at most ``factor``
        times the first match's length (a short match is seldom followed for long)."""
        node, m = self.match(context, longest)
        if m < min_match:
            return Branch()
        branch = Branch(match=m)
        limit = min(limit, max(1, int(factor * m)))
        depth, seq = m, list(context)
        while len(branch.tokens) < limit:
            if depth >= self.max_depth:  # the trie ends here: match again, the drafts appended
                node, depth = self.match(seq, longest)
                if depth < min_match:
                    break
            count, top, total = self.top_child(node)
            if top < 0:
                break
            node = top
            if count / total < min_prob:
                break
            branch.tokens.append(self.token[node])
            branch.probs.append(count / total)
            seq.append(self.token[node])
            depth += 1
        return branch

    def nbytes(self) -> int:
        """Bytes held: the arrays, the edge dict, and its int keys and values."""
        arrays = self.count, self.token, self.first_child, self.next_sibling
        return (sum(sys.getsizeof(a) for a in arrays) + sys.getsizeof(self.edges)
                + len(self.edges) * (KEY_BYTES + VALUE_BYTES) + sys.getsizeof(self))


@dataclass
class _Call:
    scope: str | None
    rows: list[array]  # each row's tokens (prompt and output)

    def nbytes(self) -> int:
        return sys.getsizeof(self) + sys.getsizeof(self.rows) + sum(sys.getsizeof(r) for r in self.rows)

    def tokens(self) -> int:
        return sum(len(r) for r in self.rows)


def check_scope(scope) -> str | None:
    if scope is not None and not isinstance(scope, str):
        raise TypeError(f"memory_scope must be a str or None, got {type(scope).__name__}")
    return scope


class SuffixMemory:
    """The earlier calls of one decoder, per scope, within ``memory_bytes``; thread-safe."""

    def __init__(self, memory_bytes: int, max_depth: int):
        self.limit, self.max_depth = memory_bytes, max_depth
        self.lock = threading.Lock()
        self.calls: deque[_Call] = deque()  # oldest first
        self.tries: dict[str | None, SuffixTrie] = {}
        self.evicted = 0  # calls dropped to stay within the bound, since the store was made

    # -- reading and adding ----------------------------------------------------------------------
    def draft(self, scope: str | None, context: list[int], **how) -> Branch:
        """:meth:`SuffixTrie.draft` on the scope's trie (an empty branch when it holds none)."""
        with self.lock:
            trie = self.tries.get(scope)
            return trie.draft(context, **how) if trie is not None else Branch()

    def add(self, scope: str | None, rows: list[list[int]]) -> None:
        """Remember one call's rows (prompt and output each), then keep within the bound."""
        if self.limit <= 0 or not rows:
            return
        call = _Call(scope, [array("i", r) for r in rows])
        with self.lock:
            self.calls.append(call)
            self._insert(call)
            self._bound()

    def _insert(self, call: _Call) -> None:
        trie = self.tries.setdefault(call.scope, SuffixTrie(self.max_depth))
        for row in call.rows:
            trie.extend(trie.start(), row)

    def _bound(self) -> None:
        """Drop the oldest calls until the bytes are within the bound (to about half of it, so that
        the rebuild this takes is paid seldom)."""
        used = self._nbytes()
        while used > self.limit and self.calls:
            held = sum(c.tokens() for c in self.calls)
            keep = held * min(0.5 * self.limit / used, 0.9)  # tokens to keep, bytes taken as proportional
            dropped: set[str | None] = set()
            while self.calls and (held > keep or not held):
                call = self.calls.popleft()
                held -= call.tokens()
                dropped.add(call.scope)
                self.evicted += 1
            for scope in dropped:  # arrays and dicts never shrink in place: rebuild what lost calls
                self.tries.pop(scope, None)
                for call in self.calls:
                    if call.scope == scope:
                        self._insert(call)
            used = self._nbytes()

    def _nbytes(self) -> int:
        return (sum(t.nbytes() for t in self.tries.values()) + sum(c.nbytes() for c in self.calls)
                + sys.getsizeof(self.calls) + sys.getsizeof(self.tries))

    # -- what a service needs ----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self.lock:
            return {"memory_bytes": self._nbytes(), "memory_calls": len(self.calls),
                    "memory_tokens": sum(c.tokens() for c in self.calls), "memory_scopes": len(self.tries),
                    "memory_evicted": self.evicted}

    def clear(self) -> None:
        with self.lock:
            self.calls.clear()
            self.tries.clear()

    def save(self, path: str | os.PathLike) -> None:
        """Write every call held, oldest first: a header line (format, version, depth, calls, the
        sha256 of what follows), then one JSON line per call; atomically (a temporary file renamed)."""
        with self.lock:
            lines = [json.dumps({"scope": c.scope, "rows": [r.tolist() for r in c.rows]}) for c in self.calls]
        body = "".join(line + "\n" for line in lines).encode()
        header = {"format": FORMAT, "version": VERSION, "max_depth": self.max_depth, "calls": len(lines),
                  "sha256": hashlib.sha256(body).hexdigest()}
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n" + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: str | os.PathLike) -> None:
        """Replace what is held by the calls saved in ``path`` (then keep within this store's bound).
        A file that is not one, of another version, or damaged (its digest, its calls) is refused
        with a ValueError naming it; the store is left as it was."""
        calls = read_calls(Path(path))
        with self.lock:
            self.calls = deque(calls)
            self.tries = {}
            for call in self.calls:
                self._insert(call)
            self._bound()


def read_calls(path: Path) -> list[_Call]:
    """The calls of a file :meth:`SuffixMemory.save` wrote, validated."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"suffix memory file {str(path)!r} refused: {why}")

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise refuse(f"cannot read it ({exc.strerror or exc})") from None
    head, _, body = data.partition(b"\n")
    try:
        header = json.loads(head)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise refuse("its first line is not a suffix memory header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise refuse(f"not a {FORMAT} file")
    if header.get("version") != VERSION:
        raise refuse(f"version {header.get('version')!r}, this specdec reads version {VERSION}")
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise refuse("damaged (its content does not match the digest in its header)")
    calls = []
    for n, line in enumerate(body.splitlines(), start=2):
        try:
            item = json.loads(line)
            scope, rows = check_scope(item["scope"]), item["rows"]
            if not isinstance(rows, list) or not all(
                    isinstance(r, list) and all(type(t) is int and 0 <= t < STRIDE for t in r) for r in rows):
                raise ValueError("rows must be lists of token ids")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise refuse(f"line {n}: {exc}") from None
        calls.append(_Call(scope, [array("i", r) for r in rows]))
    if len(calls) != header.get("calls"):
        raise refuse(f"{len(calls)} calls, its header says {header.get('calls')!r}")
    return calls



# -- the generator ----------------------------------------------------------------------------------
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
    most), ``memory_bytes`` (the store's bound; 0: no memory across calls), and the draft-length
    schedule of prompt_lookup (``schedule``, ``num_tokens``, ``max_tokens``)."""

    #: keyword arguments of ``generate()`` this generator takes per call (SpecDecoder passes them to for_call)
    call_options = ("memory_scope",)

    def __init__(self, *, max_depth: int = 24, min_match: int = 2, min_prob: float = 0.1, match_factor: float = 2.0,
                 memory_bytes: int = 64 << 20, num_tokens: int = 4, schedule: str = "auto", max_tokens: int = 16):
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
        """One source per bucket of match lengths (:data:`SOURCE_MATCH`), the longest first."""
        return DraftingInfo(SOURCE_PRIOR, self.schedule.policy_drafts)

    def setup(self, ctx: DecodeContext) -> None:
        self.schedule.reset(ctx.batch_size)
        lengths = ctx.lengths.tolist()
        self.rows = [ctx.tokens[b, : lengths[b]].tolist() for b in range(ctx.batch_size)]  # committed, per row
        self.tries = [SuffixTrie(self.max_depth) for _ in self.rows]  # the call's own, per row
        self.active = [trie.extend(trie.start(), row) for trie, row in zip(self.tries, self.rows)]
        self.done: list[list[int]] = []  # rows that left the batch, kept for the memory
        self.counters = {"drafted_call": 0, "drafted_memory": 0, "matched_tokens": 0, "matches": 0}

    def branch(self, row: list[int], trie: SuffixTrie, limit: int) -> tuple[Branch, str]:
        """The better of the row's own chain and the memory's, and which it is."""
        how = dict(limit=limit, longest=self.max_depth - 1, min_match=self.min_match, min_prob=self.min_prob,
                   factor=self.match_factor)
        own = trie.draft(row, **how)
        remembered = self.memory.draft(self.scope, row, **how) if self.memory.limit else Branch()
        if remembered.score() > own.score():
            return remembered, "drafted_memory"
        return own, "drafted_call"

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        budget = torch.minimum(self.schedule.current, max_drafts.cpu()).tolist()  # [B]
        chosen = []
        for b, row in enumerate(self.rows):
            branch, where = self.branch(row, self.tries[b], budget[b]) if budget[b] > 0 else (Branch(), "")
            if branch.tokens:
                self.counters[where] += len(branch.tokens)
                self.counters["matches"] += 1
                self.counters["matched_tokens"] += branch.match
            chosen.append(branch)
        device = ctx.tokens.device
        proposal = Proposal.from_rows([b.tokens for b in chosen], device)
        k = proposal.token_ids.shape[1]
        confidence = torch.full((len(chosen), k), float("nan"))  # [B, K] each draft's frequency after its context
        for b, branch in enumerate(chosen):
            confidence[b, : len(branch.probs)] = torch.tensor(branch.probs)
        proposal.confidence = confidence.to(device)
        proposal.sources = torch.tensor([match_source(b.match) for b in chosen], dtype=torch.long)
        return proposal

    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        self.schedule.update(feedback)
        lengths = ctx.lengths.tolist()
        for b, row in enumerate(self.rows):  # the tokens just committed join the row and its trie
            new = ctx.tokens[b, len(row): lengths[b]].tolist()
            row.extend(new)
            self.active[b] = self.tries[b].extend(self.active[b], new)

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
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
