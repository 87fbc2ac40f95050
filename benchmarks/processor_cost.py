"""What applying generate()'s logits processors over a verified block costs, next to a target forward.

For SmolLM2-135M (49,152-token vocabulary) and the settings of benchmarks/configs/quick_processors.yaml
(``repetition_penalty=1.1, no_repeat_ngram_size=4``), after a context of ``--context`` tokens:
the seconds of ``BlockProcessors.apply`` over a block of k+1 positions (k = 0, 4, 10, 16), of the
check that drops a lookup's forbidden drafts (``allowed_drafts``), of the
same processors called position by position (what a loop over the block would cost), and of one
target forward feeding k+1 tokens, in CPU seconds of this process (one thread by default, so that
they count the work, not the waits of a shared machine). Prints one JSON line per k;
docs/generation.md quotes a run.

    python benchmarks/processor_cost.py [--context 300] [--repeats 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec import load_model, machine
from specdec.generation import build_processors, resolve_config
from specdec.processors import BlockProcessors

SETTINGS = {"repetition_penalty": 1.1, "no_repeat_ngram_size": 4, "do_sample": False}


def median_seconds(fn, repeats: int) -> float:
    """Median CPU seconds of ``fn()``: on a machine others share, wall time says more of them than of it."""
    times = []
    for _ in range(repeats):
        started = time.process_time()
        fn()
        times.append(time.process_time() - started)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_model("smollm2-135m")
    vocab = target.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 2000, (1, args.context), generator=g)
    config = resolve_config(target, None, dict(SETTINGS, max_new_tokens=64), prompt.shape[1])
    processors = BlockProcessors(build_processors(target, config, prompt, torch.ones_like(prompt)), prompt)
    plain = build_processors(target, config, prompt, torch.ones_like(prompt))
    with torch.no_grad():
        cache = target(prompt, use_cache=True).cache  # the prompt's keys and values
    print(json.dumps({"machine": machine.describe(), "threads": args.threads, "context": args.context,
                      "settings": SETTINGS}))
    for k in (0, 4, 10, 16):
        drafts = torch.randint(0, 2000, (1, k), generator=g)
        scores = torch.randn(1, k + 1, vocab, generator=g)
        lengths, rows = torch.tensor([args.context]), torch.tensor([0])
        pos = processors.positions(prompt, lengths, lengths, rows, drafts, torch.tensor([k + 1]))
        block = median_seconds(lambda: processors.apply(scores, pos), args.repeats)
        check = median_seconds(lambda: processors.allowed_drafts(drafts, torch.tensor([k]), pos, vocab), args.repeats)
        sequence = torch.cat([prompt, drafts], 1)
        per_position = median_seconds(lambda: [plain(sequence[:, : args.context + j], scores[:, j])
                                               for j in range(k + 1)], args.repeats)
        feed = torch.randint(0, 2000, (1, k + 1), generator=g)

        def forward():
            with torch.no_grad():
                target(feed, cache=cache, use_cache=True)
            cache.crop(-feed.shape[1])  # back to the prompt
        step = median_seconds(forward, max(3, args.repeats // 4))
        print(json.dumps({"k": k, "processors_cpu_ms": round(1e3 * block, 3),
                          "lookup_check_cpu_ms": round(1e3 * check, 3), "position_by_position_cpu_ms":
                          round(1e3 * per_position, 3), "forward_cpu_ms": round(1e3 * step, 2),
                          "share_of_forward": round(block / step, 4)}))


if __name__ == "__main__":
    main()
