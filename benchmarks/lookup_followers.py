"""How often the tokens that followed the last token earlier hold the next one, where no longer suffix matched.

Prompt lookup drafts from the latest earlier occurrence of the context's last 2-4 tokens
(``min_ngram`` 2). Where none occurred before, the tokens that followed earlier occurrences of the
last token alone are what a one-token match (``min_ngram=1``) would draft, and a tree could offer
several of them side by side. Under greedy decoding every method commits the reference's tokens,
so a run's recorded outputs (``results.jsonl``) say, teacher-forced, how often the answer's next
token is among the k most frequent followers (ties: the latest first), for k = 1 to ``--top``.

    python benchmarks/lookup_followers.py benchmarks/configs/trees_min_ngram1_smollm2.yaml [--results DIR]
"""

from __future__ import annotations

import argparse
from collections import Counter

from specdec.bench.recorded import add_run_arguments, load_recorded_run


def longer_match(context: list[int], shortest: int, longest: int) -> bool:
    """Whether a suffix of ``shortest`` to ``longest`` tokens occurred earlier with a next token."""
    for n in range(longest, shortest - 1, -1):
        if len(context) > n:
            suffix = context[-n:]
            if any(context[i: i + n] == suffix for i in range(len(context) - n)):
                return True
    return False


def follower_rank(context: list[int], token: int) -> int | None:
    """The rank (0: first) of ``token`` among the tokens that followed earlier occurrences of the
    context's last token, most frequent first, ties the latest first; None if it is not among them,
    -1 if the last token has no earlier occurrence with a next token."""
    last, counts, latest = context[-1], Counter(), {}
    for i in range(len(context) - 1):
        if context[i] == last:
            counts[context[i + 1]] += 1
            latest[context[i + 1]] = i
    if not counts:
        return -1
    ranked = sorted(counts, key=lambda t: (-counts[t], -latest[t]))
    return ranked.index(token) if token in ranked else None


def tally(calls: list[tuple[list[int], list[int]]], top: int) -> tuple[Counter, Counter]:
    """Over every answer position with no 2-4 token match: how many (``unmatched``, and of those
    ``with followers``), and how many found the answer's token at each rank below ``top``."""
    totals, ranks = Counter(), Counter()
    for prompt, answer in calls:
        sequence = prompt + answer
        for t in range(len(prompt), len(sequence)):
            context = sequence[:t]
            if longer_match(context, 2, 4):
                continue
            totals["unmatched"] += 1
            rank = follower_rank(context, sequence[t])
            if rank != -1:
                totals["with followers"] += 1
                if rank is not None and rank < top:
                    ranks[rank] += 1
    return totals, ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--top", type=int, default=4, help="the most followers counted")
    args = parser.parse_args()
    run = load_recorded_run(args.config, args.results)
    totals, ranks = tally([(p, r["output_ids"]) for p, r in zip(run.prompts, run.turns)], args.top)
    print(f"{run.config.methods[0].name}'s {len(run.turns)} turns of {run.folder}: {totals['unmatched']} answer "
          f"positions with no earlier 2-4 token suffix, {totals['with followers']} of them with followers of the "
          "last token")
    print("| the answer's token among the first k followers | of those with followers | of all unmatched |")
    print("| --- | --- | --- |")
    found = 0
    for k in range(args.top):
        found += ranks[k]
        print(f"| k = {k + 1} | {found / max(1, totals['with followers']):.1%} | {found / max(1, totals['unmatched']):.1%} |")


if __name__ == "__main__":
    main()
