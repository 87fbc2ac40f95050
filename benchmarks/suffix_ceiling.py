"""How much any lookup drafter could accept on a run's outputs: the call's own text against earlier calls too.

Under greedy decoding every method commits the reference's tokens, so a benchmark run's recorded
outputs (``results.jsonl``) fix what a drafter that looks text up could have had accepted. This
script replays the reference method's turns in the run's order (question by question, turn by
turn: the order the bench calls them) and, at every step, finds the longest suffix of the
context (up to ``--longest`` tokens) seen before in a source, and takes the best of all its
occurrences: the one whose continuation the target accepts furthest, with no limit on the draft's
length. Each step commits that many tokens plus the target's own. Two sources:

* ``own``: the call's prompt and what it has committed (what prompt lookup searches);
* ``memory``: that, or every earlier call's prompt and output, whichever matches the longer suffix
  (what suffix decoding searches).

The mean accepted length per step (tokens committed per target forward) of each is a ceiling:
no drafter that follows the longest match does better, and real ones do worse (they must pick an
occurrence before seeing the answer, and drafts cost verify time). Their ratio bounds how many
fewer steps remembering earlier calls can save on this workload.

    python benchmarks/suffix_ceiling.py benchmarks/configs/agent_smollm2.yaml [--skip-first 2]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from specdec.bench.recorded import add_run_arguments, load_recorded_run


class Occurrences:
    """Where every n-gram (1 to ``longest`` tokens) of some token sequences ends: the positions
    whose next token exists, per n-gram."""

    def __init__(self, longest: int):
        self.longest = longest
        self.sequences: list[list[int]] = []
        self.ends: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)

    def add(self, tokens: list[int]) -> None:
        """Index ``tokens`` as a new sequence."""
        self.sequences.append([])
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the last sequence and index the n-grams they give a next token."""
        s, seq = len(self.sequences) - 1, self.sequences[-1]
        for token in tokens:
            seq.append(token)
            end = len(seq) - 1
            for n in range(1, min(self.longest, end) + 1):
                self.ends[tuple(seq[end - n: end])].append((s, end - n))

    def best(self, context: list[int], answer: list[int]) -> tuple[int, int]:
        """(match length, most answer tokens any occurrence of the longest matched suffix predicts)."""
        for n in range(min(self.longest, len(context)), 0, -1):
            found = self.ends.get(tuple(context[len(context) - n:]))
            if found:
                return n, max(_agree(self.sequences[s], at + n, answer) for s, at in found)
        return 0, 0


def _agree(sequence: list[int], start: int, answer: list[int]) -> int:
    """How many leading tokens of ``answer`` ``sequence`` holds from ``start`` on."""
    k, most = 0, min(len(answer), len(sequence) - start)
    while k < most and sequence[start + k] == answer[k]:
        k += 1
    return k


def replay(calls: list[tuple[str, list[int], list[int]]], longest: int, skip_first: int) -> dict[str, list[int]]:
    """calls: (category, prompt, output) in run order -> {category: [tokens, own steps, memory steps]}."""
    memory = Occurrences(longest)
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for index, (category, prompt, output) in enumerate(calls):
        steps = []
        for use_memory in (False, True):
            own = Occurrences(longest)
            own.add(prompt)
            i = count = 0
            while i < len(output):
                context, answer = prompt + output[:i], output[i:]
                match, accepted = own.best(context, answer)
                if use_memory:
                    remembered, from_memory = memory.best(context, answer)
                    if remembered > match:
                        accepted = from_memory
                own.extend(output[i: i + accepted + 1])
                i, count = i + accepted + 1, count + 1
            steps.append(count)
        memory.add(prompt + output)
        if index >= skip_first:
            for key in (category, "overall"):
                totals[key][0] += len(output)
                totals[key][1] += steps[0]
                totals[key][2] += steps[1]
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--longest", type=int, default=23, help="the longest suffix matched (suffix's default)")
    parser.add_argument("--skip-first", type=int, default=0, help="leave the run's first calls out of the totals")
    args = parser.parse_args()
    run = load_recorded_run(args.config, args.results)
    calls = [(r["category"], prompt, r["output_ids"]) for r, prompt in zip(run.turns, run.prompts)]
    totals = replay(calls, args.longest, args.skip_first)
    print(f"{run.config.methods[0].name}'s {len(calls)} turns of {run.folder}, the first {args.skip_first} left "
          f"out; the longest suffix matched: {args.longest} tokens")
    print("| category | tokens | ceiling, own text | ceiling, with memory | memory / own |")
    print("| --- | --- | --- | --- | --- |")
    for category, (tokens, own, remembered) in sorted(totals.items(), key=lambda kv: kv[0] == "overall"):
        print(f"| {category} | {tokens} | {tokens / own:.2f} | {tokens / remembered:.2f} | {own / remembered:.2f}x |")


if __name__ == "__main__":
    main()
