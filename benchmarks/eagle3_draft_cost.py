"""What scoring one greedy ``eagle3`` draft costs: over the draft vocabulary, or over the target's.

    python benchmarks/eagle3_draft_cost.py [--threads 1] [--repeats 15] [--calls 200]

With no logits processors, ``Eagle3Generator.propose`` takes the argmax over the head's own draft
logits and maps that one id to the target's vocabulary. With processors it first scatters the
draft logits into the target's vocabulary (every other id at -inf) for them to score. This times
both on the head shipped for SmolLM2-135M: ``--calls`` scorings of one hidden state per
repetition, the two ways taking turns, and prints the medians, their ratio and the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import load_model
from specdec.engines import import_torchao_quietly
from specdec.machine import describe
from specdec.threads import configure_threads

import_torchao_quietly()

from candidate_generators.eagle3.generator import shipped_head  # noqa: E402
from candidate_generators.eagle3.layouts import load_head  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1", help="torch threads (a number, or 'auto')")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    configure_threads(args.threads)
    target, _ = load_model("smollm2-135m")
    head = load_head(shipped_head(target), target.config).float().eval()
    vocab = target.config.vocab_size
    to_target = head.target_ids(torch.arange(head.config.draft_vocab_size))
    hidden = torch.randn(1, head.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def target_vocabulary() -> torch.Tensor:
        draft = head.logits(hidden).float()
        scores = draft.new_full((1, vocab), float("-inf"))
        scores[:, to_target] = draft
        top, token = scores.max(dim=-1)
        torch.exp(scores - top[:, None]).sum(dim=-1).reciprocal()
        return token

    def draft_vocabulary() -> torch.Tensor:
        scores = head.logits(hidden).float()
        top, index = scores.max(dim=-1)
        torch.exp(scores - top[:, None]).sum(dim=-1).reciprocal()
        return to_target[index]

    times = {target_vocabulary: [], draft_vocabulary: []}
    with torch.inference_mode():
        assert torch.equal(target_vocabulary(), draft_vocabulary())
        for _ in range(args.repeats):
            for way, seen in times.items():
                started = time.perf_counter()
                for _ in range(args.calls):
                    way()
                seen.append(1000 * (time.perf_counter() - started) / args.calls)
    full, own = (statistics.median(seen) for seen in times.values())
    print(f"{describe()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"one draft scored over the target's {vocab} ids: {full:.3f} ms; over the draft vocabulary's "
          f"{head.config.draft_vocab_size}: {own:.3f} ms ({full / own:.2f}x)")


if __name__ == "__main__":
    main()
