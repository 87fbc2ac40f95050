"""Token tries for tree proposals: ranked continuations merged into one tree under a node budget.

A generator that knows several continuations of a row (prompt lookup's earlier occurrences, suffix
decoding's two structures) proposes them as one token tree (docs/trees.md): shared prefixes once,
the best continuation leading. Re-exported by ``specdec.generators`` for plugins.
"""

from __future__ import annotations


def continuation_trie(continuations: list[list[int]], budget: int) -> list[tuple[int, int]]:
    """Continuations, best first -> at most ``budget`` trie nodes ``(token, parent)`` (parent -1: the
    root), parents first, the first continuation's nodes leading (the tree's leading chain): each
    other continuation adds at most a quarter of the budget past where it leaves the first, together
    at most half, the first shortened to make room; one that does not leave the first adds nothing.
    ``Proposal.from_tree`` takes a list of these, one a row."""
    if not continuations or budget <= 0:
        return []
    first, others = continuations[0], continuations[1:]
    share = max(1, budget // 4)  # the most nodes one other continuation adds
    plans = []  # (continuation, where it leaves the first, nodes it adds)
    for other in others:
        common = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))
        if common < len(other):
            plans.append((other, common, min(share, len(other) - common)))
    extra, kept = 0, []
    for plan in plans:
        if extra + plan[2] > budget // 2:
            break
        kept.append(plan)
        extra += plan[2]
    main = min(len(first), budget - extra)
    nodes: list[tuple[int, int]] = []
    child: dict[tuple[int, int], int] = {}

    def insert(tokens: list[int], adds: int) -> None:
        parent = -1
        for token in tokens:
            if (parent, token) not in child:
                if adds == 0 or len(nodes) == budget:
                    return
                child[(parent, token)] = len(nodes)
                nodes.append((token, parent))
                adds -= 1
            parent = child[(parent, token)]

    insert(first[:main], main)
    for other, common, adds in kept:
        if common < main:  # it leaves the (shortened) first copy inside the trie: an alternative
            insert(other, adds)
    return nodes
