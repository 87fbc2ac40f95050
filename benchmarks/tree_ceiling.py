"""How much a token tree could add to a chain of drafts on a run's outputs, before any verify cost.

Under greedy decoding every method commits the reference's tokens, so a run's recorded outputs
(``results.jsonl``) fix what a drafter's drafts could have had accepted. This script replays the
reference method's turns, each step committing the accepted drafts (at most ``--depth``) plus the
target's own token, and counts the steps (target forwards) each way of drafting takes.

With no ``--copy``: drafts from the call's own text (its prompt and what it has committed) as
``prompt_lookup`` does, three ways:

* ``chain``: what followed the latest earlier occurrence of the longest suffix matched
  (``--max-ngram`` down to ``--min-ngram`` tokens): ``prompt_lookup``'s chain;
* ``tree``: the best of up to ``--branches`` distinct continuations taken in the order
  ``prompt_lookup(tree=True)`` takes them (the chain's, then older occurrences of that suffix,
  then shorter suffixes'): a trie of them accepts its best branch;
* ``all``: the best of every occurrence of every matched suffix length: no tree of
  ``prompt_lookup``'s continuations accepts more.

``--branch-min-ngram 1`` lets a tree add the continuations of shorter matches (down to one token)
beside a chain, while a step with no match of ``--min-ngram`` tokens still drafts nothing.

With ``--copy WEIGHTS`` (``w8a8``, ``int4``, ...): drafts from ``self_draft``'s copy of the target
at that precision (its lookup left out), read teacher-forced over each answer: a chain's accepted
drafts are the answer's tokens, so this is what it drafts up to its first miss (save that when
decoding the copy reads the target's keys and values of the committed tokens, here its own), four
ways:

* ``chain``: the copy's top token at each depth;
* ``tree``: the chain and, at each depth, the copy's second choice as a leaf beside it
  (``self_draft(tree=True)``'s alternatives, every one offered): where the chain misses, the
  second choice may still hold, and the step accepts one token more;
* ``branch``: the chain and one branch: the copy's second choice at the depth where it was least
  sure of its first, drafted on from there (a second chain; the chain's depth is ``--depth``);
* ``subtree``: as ``tree``, with the copy's own chain continuing from the second choice that held
  (a tree of the chain and one branch per depth, each drafted on): the first miss of a step is
  forgiven where the second choice holds, within ``--depth``.

The mean tokens a step of each, and their ratios to the chain's, bound what trees can save in
target forwards; a real tree also pays for verifying its extra nodes, and its policy verifies
fewer drafts than ``--depth`` where they are unlikely to hold.

    python benchmarks/tree_ceiling.py benchmarks/configs/spec_bench_smollm2.yaml [--depth 10]
    python benchmarks/tree_ceiling.py benchmarks/configs/spec_bench_smollm2.yaml --copy w8a8 --depth 16
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

import torch
from suffix_ceiling import Occurrences, _agree

from specdec.bench.recorded import add_run_arguments, load_recorded_run

WAYS = ("chain", "tree", "all")
COPY_WAYS = ("chain", "tree", "branch", "subtree")


def accepted(index: Occurrences, context: list[int], answer: list[int], args) -> dict[str, int]:
    """Drafts the target accepts at this step, each way (see the module docstring)."""
    sequence, found = index.sequences[0], []  # (n, start of what followed) from the longest suffix down
    shortest = min(args.min_ngram, args.branch_min_ngram or args.min_ngram)
    for n in range(min(args.max_ngram, len(context) - 1), shortest - 1, -1):
        found += [(n, at + n) for _, at in reversed(index.ends.get(tuple(context[len(context) - n:]), []))]
    if not found or found[0][0] < args.min_ngram:  # no chain: no drafts, tree or not
        return dict.fromkeys(WAYS, 0)
    agree = [min(_agree(sequence, start, answer), args.depth) for _, start in found]
    branches, best = [], 0
    for (_, start), a in zip(found, agree):
        branch = tuple(sequence[start: start + args.depth])
        if branch and branch not in branches and len(branches) < args.branches:
            branches.append(branch)
            best = max(best, a)
    return {"chain": agree[0], "tree": best, "all": max(agree)}


def lookup_steps(prompt: list[int], output: list[int], args) -> dict[str, int]:
    """Target forwards to commit ``output`` after ``prompt``, drafting by lookup each way."""
    steps = {}
    for way in WAYS:
        index = Occurrences(args.max_ngram)
        index.add(prompt)
        i = steps[way] = 0
        while i < len(output):
            took = accepted(index, prompt + output[:i], output[i:], args)[way]
            index.extend(output[i: i + took + 1])
            i, steps[way] = i + took + 1, steps[way] + 1
    return steps


@torch.no_grad()
def copy_steps(copy, prompt: list[int], output: list[int], args) -> dict[str, int]:
    """Target forwards to commit ``output`` after ``prompt``, drafting from ``copy``: its top two
    tokens at each answer position, teacher-forced."""
    ids = torch.tensor([prompt + output])
    probs = copy(input_ids=ids).logits[0, len(prompt) - 1: -1].float().softmax(dim=-1)
    top = probs.topk(2, dim=-1)  # [len(output), 2]
    first, second = [t[0] == o for t, o in zip(top.indices.tolist(), output)], [t[1] == o for t, o in zip(top.indices.tolist(), output)]
    sure = top.values[:, 0].tolist()  # the copy's probability of its top token, at each position
    steps = {}
    for way in COPY_WAYS:
        i = steps[way] = 0
        while i < len(output):
            end = min(i + args.depth, len(output))
            weakest = min(range(i, end), key=sure.__getitem__)  # where a "branch" tree branches
            took, rescues = 0, int(way != "chain")
            while i + took < end:
                if not first[i + took]:
                    if not (rescues and second[i + took] and (way != "branch" or i + took == weakest)):
                        break
                    rescues -= 1  # the chain missed here, its sibling holds
                    if way == "tree":
                        took += 1  # a leaf: the path ends with it
                        break
                took += 1
            i, steps[way] = i + took + 1, steps[way] + 1
    return steps


def replay(calls: list[tuple[str, list[int], list[int]]], args, copy=None) -> dict[str, dict[str, int]]:
    """calls: (subtask, prompt, output) -> {subtask: {"tokens": n, way: steps}}."""
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for subtask, prompt, output in calls:
        steps = lookup_steps(prompt, output, args) if copy is None else copy_steps(copy, prompt, output, args)
        for key in (subtask, "overall"):
            totals[key]["tokens"] += len(output)
            for way, n in steps.items():
                totals[key][way] += n
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--max-ngram", type=int, default=4, help="prompt_lookup's max_ngram (its default: 4)")
    parser.add_argument("--min-ngram", type=int, default=2, help="prompt_lookup's min_ngram (its default: 2)")
    parser.add_argument("--depth", type=int, default=10, help="the most drafts a step verifies (its max_tokens: 10)")
    parser.add_argument("--branches", type=int, default=4, help="continuations in a tree (its branches: 4)")
    parser.add_argument("--branch-min-ngram", type=int, help="shorter matches whose continuations a tree may add "
                        "beside a chain (default: --min-ngram)")
    parser.add_argument("--copy", help="draft from self_draft's copy at this precision (w8a8, int4, ...) instead")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the copy's forwards")
    args = parser.parse_args()
    run = load_recorded_run(args.config, args.results)
    calls = [(r["subtask"], prompt, r["output_ids"]) for r, prompt in zip(run.turns, run.prompts)]
    copy = None
    if args.copy:
        from specdec import load_model
        from specdec.engines.forwards.lowbit import build_copy

        torch.set_num_threads(args.threads)
        copy = build_copy(load_model(run.config.target)[0], args.copy)
    totals = replay(calls, args, copy)
    branch_n = f" (a tree's from {args.branch_min_ngram})" if args.branch_min_ngram else ""
    drafter = (f"the {args.copy} copy" if copy is not None
               else f"n-grams {args.min_ngram}-{args.max_ngram}{branch_n}, {args.branches} branches")
    folder = os.path.relpath(run.folder)
    print(f"{run.config.methods[0].name}'s {len(calls)} turns of {folder}; {drafter}, depth {args.depth}\n")
    ways = COPY_WAYS if copy is not None else WAYS
    print("| subtask | tokens | tokens a step: " + " | ".join(ways) + " | " + " | ".join(f"{w} / chain" for w in ways[1:]) + " |")
    print("| --- " * (2 + 2 * len(ways) - 1) + "|")
    for subtask, t in sorted(totals.items(), key=lambda kv: kv[0] == "overall"):
        per = [f"{t['tokens'] / t[w]:.2f}" for w in ways]
        gain = [f"{t['chain'] / t[w]:.3f}x" for w in ways[1:]]
        print(f"| {subtask} | {t['tokens']} | " + " | ".join(per + gain) + " |")


if __name__ == "__main__":
    main()
