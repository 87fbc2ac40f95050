"""Batched speculative decoding vs plain batched decoding, side by side in one process.

    python benchmarks/batching.py [--batch-sizes 1 4 8 16] [--max-new-tokens 96] [--categories summarization rag]

For each batch size, the same left-padded batches of Spec-Bench prompts run through plain
batched ``target.generate(do_sample=False)`` and ``SpecDecoder(target, "prompt_lookup")`` (and
``SpecDecoder(target, draft)`` when ``--draft`` names a model). Throughput counts each row's
real new tokens (up to and including its EOS). Exactness is checked per row against decoding
that row alone with ``target.generate`` (computed once per prompt). Results go to
benchmarks/results/batching/.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec import SpecDecoder, load_model
from specdec.bench.runner import real_new_tokens
from specdec.modelinfo import eos_token_ids, pad_token_id
from specdec.prompts import DEFAULT_SPEC_BENCH, encode_chat, left_pad, load_questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default=None, help="optional draft model name for draft_model")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--categories", nargs="+", default=["summarization", "rag"])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dataset", default=str(DEFAULT_SPEC_BENCH))
    parser.add_argument("--out", default="benchmarks/results/batching")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    target, tokenizer = load_model(args.target)
    eos = set(eos_token_ids(target))
    pad = pad_token_id(target)
    questions = load_questions(args.dataset)
    largest = max(args.batch_sizes)
    per_category = -(-largest // len(args.categories))
    picked = [q for c in args.categories for q in [q for q in questions if q["category"] == c][:per_category]]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q["turns"][0]}])[0] for q in picked][:largest]
    methods = {"specdec_prompt_lookup": SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer)}
    if args.draft:
        draft, _ = load_model(args.draft)
        methods["specdec_draft_model"] = SpecDecoder(target, draft, tokenizer=tokenizer)

    print(f"reference: each of {len(prompts)} prompts decoded alone with target.generate", flush=True)
    alone = [target.generate(p[None], max_new_tokens=args.max_new_tokens, do_sample=False)[0, p.numel():]
             for p in prompts]
    alone = [real_new_tokens(a[None], eos)[0] for a in alone]

    results = []
    for batch_size in args.batch_sizes:
        batches = [prompts[i: i + batch_size] for i in range(0, largest, batch_size)]
        timings = {"plain_batched_generate": 0.0, **{m: 0.0 for m in methods}}
        tokens = {m: 0 for m in timings}
        exact = {m: 0 for m in timings}
        mal = {}
        for batch_index, batch in enumerate(batches):
            ids, mask = left_pad(batch, pad)
            warm_ids, warm_mask = ids[:, -8:], mask[:, -8:].clone().fill_(1)
            target.generate(warm_ids, attention_mask=warm_mask, max_new_tokens=2, do_sample=False)
            start = time.perf_counter()
            plain = target.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False)
            timings["plain_batched_generate"] += time.perf_counter() - start
            outputs = {"plain_batched_generate": real_new_tokens(plain[:, ids.shape[1]:], eos)}
            for name, decoder in methods.items():
                start = time.perf_counter()
                out = decoder.generate(ids, mask, max_new_tokens=args.max_new_tokens)
                timings[name] += time.perf_counter() - start
                outputs[name] = real_new_tokens(out.sequences[:, ids.shape[1]:], eos)
                mal[name] = mal[name] + out.stats if name in mal else out.stats
            for name, rows in outputs.items():
                tokens[name] += sum(len(r) for r in rows)
                exact[name] += sum(r == alone[batch_index * batch_size + i] for i, r in enumerate(rows))
        row = {"batch_size": batch_size, "rows": largest}
        for name in timings:
            row[name] = {"tokens_per_second": tokens[name] / timings[name], "seconds": timings[name],
                         "new_tokens": tokens[name], "rows_identical_to_alone": exact[name] / largest}
            if name in mal:
                row[name]["mean_accepted_length"] = mal[name].mean_accepted_length
                row[name]["speedup_over_plain_batched"] = (tokens[name] / timings[name]) / (
                    tokens["plain_batched_generate"] / timings["plain_batched_generate"])
        results.append(row)
        print(json.dumps(row), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"target": args.target, "categories": args.categories,
                                                  "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                                                  "results": results}, indent=1))
    print(f"\n{'batch':>5} {'plain tok/s':>12} " + " ".join(f"{m + ' tok/s':>28} {'speedup':>8}" for m in methods))
    for row in results:
        print(f"{row['batch_size']:>5} {row['plain_batched_generate']['tokens_per_second']:>12.1f} " + " ".join(
            f"{row[m]['tokens_per_second']:>28.1f} {row[m]['speedup_over_plain_batched']:>7.2f}x" for m in methods))


if __name__ == "__main__":
    main()
