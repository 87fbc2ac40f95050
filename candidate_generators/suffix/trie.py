"""Bounded-depth suffix tries: every substring of up to ``max_depth`` tokens, with occurrence counts.

A trie (:class:`SuffixTrie`) holds every substring of up to ``max_depth`` tokens, each node
counting its occurrences: all a suffix tree answers here is the longest suffix of the context seen
before followed by something (the *match*, at most ``max_depth - 1`` tokens) and how often each
token followed it. A chain that runs past the depth is matched again with its drafts appended, so
drafts are not bounded by the depth. Presence is suffix-closed (a suffix of a stored substring is
stored: it starts one token later and ends at the same place), so the match is found by binary
search on its length. Nodes live in flat ``array``s and one dict ``(node, token) -> child``; their
bytes are measured with ``sys.getsizeof`` on every container and on the dict's keys and values.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field

#: edge keys are node * STRIDE + token: token ids must stay below it
STRIDE = 1 << 21
#: bytes of one int key / value object of the edge dict (keys reach 2**50, values stay below 2**30)
KEY_BYTES, VALUE_BYTES = sys.getsizeof(1 << 59), sys.getsizeof((1 << 30) - 1)


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
