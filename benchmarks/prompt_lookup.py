"""Prompt lookup, side by side in one process: plain decoding, transformers' prompt lookup, specdec's.

    python benchmarks/prompt_lookup.py [--per-category 2] [--max-new-tokens 128] [--num-tokens 10]

For every question (interleaved, so machine noise hits all methods alike) it runs
``target.generate(do_sample=False)``, ``target.generate(prompt_lookup_num_tokens=K)`` and
``SpecDecoder(target, "prompt_lookup")`` twice: with transformers' settings (fixed K, n-grams of 1
to 2 tokens) and with specdec's defaults (K chosen each step by the cost-aware policy, n-grams of 4 down to 2). It checks that every
output is identical to plain decoding, and reports tokens/s, speedup over plain decoding (ratio of summed times), mean
accepted length, and the share of specdec's wall time spent outside model forwards (timed with
forward hooks on the target). Results go to benchmarks/results/prompt_lookup/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec import SpecDecoder, load_model
from specdec.modelinfo import ForwardTimer
from specdec.prompts import DEFAULT_SPEC_BENCH, encode_chat, load_questions

CATEGORIES = ("summarization", "rag", "coding", "translation", "qa", "math_reasoning", "writing", "extraction")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-tokens", type=int, default=10, help="K for both prompt-lookup implementations")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dataset", default=str(DEFAULT_SPEC_BENCH))
    parser.add_argument("--out", default="benchmarks/results/prompt_lookup")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    target, tokenizer = load_model(args.target)
    questions = load_questions(args.dataset)
    picked = [q for c in CATEGORIES for q in [q for q in questions if q["category"] == c][: args.per_category]]
    k = args.num_tokens
    ours = {
        "specdec_prompt_lookup": SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer, num_tokens=k,
                                             schedule="fixed", min_ngram=1, max_ngram=2),
        "specdec_prompt_lookup_default": SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer),
    }
    methods = ("baseline", "hf_prompt_lookup", *ours)
    timer = ForwardTimer(target)

    def run(method: str, ids: torch.Tensor):
        start = time.perf_counter()
        if method == "baseline":
            seq, stats = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False), None
        elif method == "hf_prompt_lookup":
            seq, stats = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                         prompt_lookup_num_tokens=k), None
        else:
            forward_before = timer.seconds
            out = ours[method].generate(ids, max_new_tokens=args.max_new_tokens)
            seq, stats = out.sequences, out.stats
            stats.forward_seconds = timer.seconds - forward_before
        return seq, time.perf_counter() - start, stats

    warm = encode_chat(tokenizer, [{"role": "user", "content": "Say hello."}])
    for method in methods:
        run(method, warm)

    rows = []
    for q in picked:
        ids = encode_chat(tokenizer, [{"role": "user", "content": q["turns"][0]}])
        results = {m: run(m, ids) for m in methods}
        ref = results["baseline"][0]
        stats = results["specdec_prompt_lookup"][2]
        default_stats = results["specdec_prompt_lookup_default"][2]
        row = {"question_id": q["question_id"], "category": q["category"], "prompt_tokens": ids.shape[1],
               "new_tokens": ref.shape[1] - ids.shape[1],
               **{f"{m}_seconds": r[1] for m, r in results.items()},
               **{f"{m}_identical": torch.equal(r[0], ref) for m, r in results.items() if m != "baseline"},
               "mean_accepted_length": stats.mean_accepted_length, "acceptance_rate": stats.acceptance_rate,
               "default_mean_accepted_length": default_stats.mean_accepted_length,
               "outside_forward_share": 1 - stats.forward_seconds / results["specdec_prompt_lookup"][1]}
        rows.append(row)
        print(f"{q['question_id']:>4} {q['category']:>14} prompt {row['prompt_tokens']:>5} | plain {row['baseline_seconds']:6.2f}s "
              f"hf {row['hf_prompt_lookup_seconds']:6.2f}s ours {row['specdec_prompt_lookup_seconds']:6.2f}s "
              f"ours-default {row['specdec_prompt_lookup_default_seconds']:6.2f}s | accepted len "
              f"{row['mean_accepted_length']:.2f}/{row['default_mean_accepted_length']:.2f} | identical "
              f"{all(v for key, v in row.items() if key.endswith('_identical'))} | outside forwards "
              f"{row['outside_forward_share']:.1%}", flush=True)

    total = {m: sum(r[f"{m}_seconds"] for r in rows) for m in methods}
    tokens = sum(r["new_tokens"] for r in rows)
    summary = {
        "target": args.target, "num_tokens": k, "max_new_tokens": args.max_new_tokens, "questions": len(rows),
        "threads": args.threads, "torch": torch.__version__,
        "tokens_per_second": {m: tokens / t for m, t in total.items()},
        "speedup_over_plain": {m: total["baseline"] / t for m, t in total.items()},
        "specdec_vs_hf_prompt_lookup": total["hf_prompt_lookup"] / total["specdec_prompt_lookup"],
        "median_per_question_ratio_specdec_vs_hf": statistics.median(
            r["hf_prompt_lookup_seconds"] / r["specdec_prompt_lookup_seconds"] for r in rows),
        "mean_accepted_length": statistics.mean(r["mean_accepted_length"] for r in rows),
        "all_identical": all(v for r in rows for key, v in r.items() if key.endswith("_identical")),
        "median_outside_forward_share": statistics.median(r["outside_forward_share"] for r in rows),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
