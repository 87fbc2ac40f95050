"""Batched speculative decoding vs transformers' batched ``generate``, side by side in one process.

    python benchmarks/batching.py [--batch-sizes 1 2 4 8 16] [--max-new-tokens 32] [--methods ...]

For each batch size, one left-padded batch of that many Spec-Bench prompts (grounded and
open-ended ones, taken in turn from ``--categories``) runs through transformers' batched
``target.generate(do_sample=False)`` and through ``SpecDecoder`` with each method's defaults:
``plain`` (no drafter: specdec's own loop, which isolates its cost from drafting's),
``prompt_lookup`` and ``self_draft``. Before anything is timed each method makes one short
untimed call on the batch (its one-time work: calibrating the policy's costs, building or
choosing a copy; reported apart); then every method runs once a round, the order rotating from
round to round (the machine may be shared), and the median of ``--repeats`` rounds is kept.
Throughput counts each row's real new tokens (up to and including its EOS); every method's rows
are compared with transformers' batched output.

The results (``results.json`` and ``report.md`` in ``--out``) name the machine
(``specdec.machine.describe()``) and the load it carried.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec import SpecDecoder, load_model, machine
from specdec.bench.runner import real_new_tokens
from specdec.modelinfo import eos_token_ids, pad_token_id
from specdec.prompts import DEFAULT_SPEC_BENCH, encode_chat, left_pad, load_questions

METHODS = {"plain": None, "prompt_lookup": "prompt_lookup", "self_draft": "self_draft"}


def prompts_for(tokenizer, dataset: str, categories: list[str], count: int, longest: int) -> list[torch.Tensor]:
    """``count`` chat-formatted prompts, the categories taken in turn, each cut to its last ``longest`` tokens."""
    questions = load_questions(dataset)
    per = {c: [q for q in questions if q["category"] == c] for c in categories}
    empty = [c for c, found in per.items() if not found]
    if empty:
        raise SystemExit(f"no Spec-Bench questions in categories {empty}")
    picked = [per[c][i] for i in range(count) for c in categories if i < len(per[c])][:count]
    return [encode_chat(tokenizer, [{"role": "user", "content": q["turns"][0]}])[0][-longest:] for q in picked]


def summarise(batch: int, results: dict, reference_rows: list, rows_of: dict) -> dict:
    """One batch size's row: per method its median seconds and tokens/s, and its speedup over
    transformers as the median of the rounds' ratios (each round ran both, close in time: a ratio
    within a round is the least touched by the machine's changing load), with their range."""
    base = results["transformers"]["seconds"]
    out = {"batch_size": batch}
    for name, r in results.items():
        seconds = statistics.median(r["seconds"])
        ratios = [b / s for b, s in zip(base, r["seconds"])]
        entry = {"seconds": seconds, "all_seconds": r["seconds"], "new_tokens": r["new_tokens"],
                 "tokens_per_second": r["new_tokens"] / seconds, "speedup": statistics.median(ratios),
                 "speedup_range": [min(ratios), max(ratios)], "one_time_seconds": r["one_time_seconds"],
                 "rows_identical_to_transformers": sum(a == b for a, b in zip(rows_of[name], reference_rows))}
        stats = r.get("stats")
        if stats is not None:
            entry.update(mean_accepted_length=stats.mean_accepted_length, skipped_share=stats.skipped_share,
                         drafts_verified=stats.drafts_verified, choices=stats.choices,
                         forwards_by_tokens={str(k): v[0] for k, v in sorted(stats.forward_costs.items())})
        out[name] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--categories", nargs="+", default=["summarization", "writing", "rag", "qa"],
                        help="Spec-Bench categories (mt_bench's are writing, roleplay, reasoning, ...)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=384, help="each prompt cut to its last N tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dataset", default=str(DEFAULT_SPEC_BENCH))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/batching"))
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    load = {"start": os.getloadavg()[0]}
    target, tokenizer = load_model(args.target)
    eos, pad = set(eos_token_ids(target)), pad_token_id(target)
    prompts = prompts_for(tokenizer, args.dataset, args.categories, max(args.batch_sizes), args.prompt_tokens)
    decoders = {name: SpecDecoder(target, METHODS[name], tokenizer=tokenizer) for name in args.methods}
    meta = {"machine": machine.describe(), "cpu_model": machine.cpu_model(), "cpu_capability": machine.cpu_capability(),
            "cpu_flags": machine.cpu_flags(), "isa_caps": machine.isa_caps(), "torch": torch.__version__,
            "target": args.target, "categories": args.categories, "max_new_tokens": args.max_new_tokens,
            "prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "threads": args.threads,
            "cores": os.cpu_count(), "load_average": load,
            "command": " ".join(["python benchmarks/batching.py", *sys.argv[1:]])}
    print(meta["machine"], flush=True)
    rows = []
    for batch in args.batch_sizes:
        ids, mask = left_pad(prompts[:batch], pad)
        results, rows_of = measure(target, decoders, ids, mask, args.max_new_tokens, args.repeats, eos)
        rows.append(summarise(batch, results, rows_of["transformers"], rows_of))
        load["end"] = os.getloadavg()[0]
        print(json.dumps({k: (round(v["speedup"], 3) if isinstance(v, dict) else v) for k, v in rows[-1].items()}),
              flush=True)
        write(args.out, meta, rows)


def measure(target, decoders: dict, ids, mask, new_tokens: int, repeats: int, eos: set) -> tuple[dict, dict]:
    """(results, rows_of): per method the seconds of each round, new tokens, one-time seconds and
    last stats; and each method's rows of real new tokens (see the module doc)."""
    def call(name: str, n: int):
        if name == "transformers":
            return target.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)[:, ids.shape[1]:], None
        out = decoders[name].generate(ids, mask, max_new_tokens=n)
        return out.sequences[:, ids.shape[1]:], out.stats

    names = ["transformers", *decoders]
    results, rows_of = {}, {}
    for name in names:  # one-time work, untimed in the rounds
        started = time.perf_counter()
        call(name, 2)
        results[name] = {"seconds": [], "one_time_seconds": time.perf_counter() - started}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            started = time.perf_counter()
            new, stats = call(name, new_tokens)
            results[name]["seconds"].append(time.perf_counter() - started)
            rows_of[name] = real_new_tokens(new, eos)
            results[name]["new_tokens"] = sum(len(row) for row in rows_of[name])
            if stats is not None:
                results[name]["stats"] = stats
    return results, rows_of


def write(out: Path, meta: dict, rows: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1, default=str))
    methods = [k for k in rows[0] if k not in ("batch_size", "transformers")]
    load = meta["load_average"]
    lines = ["# Batched decoding: specdec's defaults against transformers' batched generate", "",
             f"Machine: {meta['machine']}; shared with other jobs (1-minute load average {load['start']:.1f} at the "
             f"start, {load.get('end', float('nan')):.1f} at the end, on {meta['cores']} cores). torch {meta['torch']}; "
             f"{meta['threads']} threads; {meta['target']}; prompts from {', '.join(meta['categories'])} (last "
             f"{meta['prompt_tokens']} tokens each), {meta['max_new_tokens']} new tokens; median of "
             f"{meta['repeats']} rounds, the methods taking turns; each method's one-time work done first, untimed.", "",
             f"Command: `{meta['command']}`", "",
             "Speedup = transformers' batched generate time / the method's (same batch, same settings), the median "
             "of the rounds' ratios [their range]; MAL = mean accepted length; rows = rows identical to transformers' "
             "batched output.", "",
             "| batch | transformers tokens/s | " + " | ".join(f"{m} speedup [range] (MAL, rows)" for m in methods)
             + " |",
             "|---" * (len(methods) + 2) + "|"]
    for row in rows:
        cells = []
        for m in methods:
            r = row[m]
            mal = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-"
            lo, hi = r["speedup_range"]
            cells.append(f"{r['speedup']:.2f}x [{lo:.2f}-{hi:.2f}] ({mal}, "
                         f"{r['rows_identical_to_transformers']}/{row['batch_size']})")
        lines.append(f"| {row['batch_size']} | {row['transformers']['tokens_per_second']:.1f} | " + " | ".join(cells) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
