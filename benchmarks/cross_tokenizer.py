"""Cross-tokenizer drafting, side by side: Gemma-3-270M target, SmolLM2-135M draft, greedy.

    python benchmarks/cross_tokenizer.py [--per-subtask 1] [--max-new-tokens 64] [--threads 2]

Three methods on the same Spec-Bench prompts, interleaved per question so that machine noise
hits them alike:

* ``plain``: ``target.generate(do_sample=False)``;
* ``hf_uag``: transformers' universal assisted generation,
  ``target.generate(assistant_model=draft, tokenizer=..., assistant_tokenizer=...)`` with its
  default settings (it gets a deep copy of the draft: it writes to the assistant's generation
  config between calls);
* ``specdec``: ``SpecDecoder(target, draft, tokenizer=..., draft_tokenizer=...)``, which resolves
  to the ``cross_tokenizer`` generator with its defaults.

Gemma-3-270M is a base model, so prompts are plain text: ``Question: <first turn>\\nAnswer:``,
one question per Spec-Bench subtask (the first whose prompt fits ``--max-prompt-tokens``).

Reported: per-question speedup over ``plain`` (median, and the ratio of summed times), tokens
per target forward (counted with a forward hook; 1.0 for plain decoding), specdec's acceptance
rate, exactness (output token-identical to ``plain``), and what bounds the speedup on this pair:
the measured cost of a draft token and of verifying k positions, relative to one plain target
step. Results: ``benchmarks/results/cross_tokenizer/{rows.json,summary.json,report.md}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from specdec import SpecDecoder, load_model
from specdec.metrics import AcceptanceStats, theoretical_speedup
from specdec.modelinfo import ForwardTimer, cache_argument
from specdec.prompts import DEFAULT_SPEC_BENCH, SUBTASKS, load_questions, subtask_of

METHODS = ("plain", "hf_uag", "specdec")
DRAFTS = (2, 4, 8)


def forward_ms(model, positions: int, context: int = 128, reps: int = 5) -> float:
    """Median ms of one forward of ``positions`` new tokens after a cached ``context``, logits
    for each of them (as verification needs)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    times = []
    with torch.no_grad():
        for _ in range(reps):
            cache = DynamicCache()
            model(torch.randint(100, 5000, (1, context), generator=gen), **{cache_argument(model): cache},
                  use_cache=True, logits_to_keep=1)
            new = torch.randint(100, 5000, (1, positions), generator=gen)
            start = time.perf_counter()
            model(new, **{cache_argument(model): cache}, use_cache=True, logits_to_keep=positions)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def pick_questions(questions: list[dict], tokenizer, per_subtask: int, max_prompt_tokens: int) -> list[tuple[dict, str]]:
    picked = []
    for subtask in SUBTASKS:
        fitting = []
        for q in questions:
            if subtask_of(q["category"]) != subtask:
                continue
            text = f"Question: {q['turns'][0]}\nAnswer:"
            if len(tokenizer(text)["input_ids"]) <= max_prompt_tokens:
                fitting.append((q, text))
            if len(fitting) == per_subtask:
                break
        picked += fitting
    return picked


def load_average() -> list[float]:
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except OSError:  # pragma: no cover - not Linux
        return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-subtask", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=700, help="skip longer prompts (prefill time)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="at most this many questions (smoke runs)")
    parser.add_argument("--dataset", default=str(DEFAULT_SPEC_BENCH))
    parser.add_argument("--out", default="benchmarks/results/cross_tokenizer")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    load_before = load_average()
    started = time.perf_counter()
    target, target_tok = load_model("gemma3-270m")
    draft, draft_tok = load_model("smollm2-135m")
    draft_config_before = draft.generation_config.to_dict()
    hf_draft = copy.deepcopy(draft)  # transformers writes to its assistant's generation config
    decoder = SpecDecoder(target, draft, tokenizer=target_tok, draft_tokenizer=draft_tok)
    generator_name = type(decoder.candidate_generator).name
    gen = decoder.candidate_generator
    settings = {"num_tokens": gen.schedule.initial, "schedule": gen.schedule.kind, "max_tokens": gen.schedule.max_tokens,
                "min_confidence": gen.min_confidence}
    hf_keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    hf_settings = {k: getattr(hf_draft.generation_config, k, None) for k in hf_keys}  # None: transformers' default
    counter = ForwardTimer(target)  # target forwards: one per step, prefill included
    loaded = time.perf_counter() - started

    # what one draft token and one verification cost, relative to a plain target step
    costs = {"target_1": forward_ms(target, 1), "draft_1": forward_ms(draft, 1)}
    for k in DRAFTS:  # verifying k drafts scores k + 1 positions
        costs[f"target_{k + 1}"] = forward_ms(target, k + 1)
    print("forward ms:", {k: round(v, 1) for k, v in costs.items()}, flush=True)

    def run(method: str, ids: torch.Tensor, new_tokens: int):
        mask = torch.ones_like(ids)
        calls, start = counter.calls, time.perf_counter()
        stats = None
        if method == "plain":
            seq = target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
        elif method == "hf_uag":
            seq = target.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                  assistant_model=hf_draft, tokenizer=target_tok, assistant_tokenizer=draft_tok)
        else:
            out = decoder.generate(ids, mask, max_new_tokens=new_tokens)
            seq, stats = out.sequences, out.stats
        return seq, time.perf_counter() - start, counter.calls - calls, stats

    warm = target_tok("Question: What is the capital of France?\nAnswer:", return_tensors="pt").input_ids
    for method in METHODS:
        run(method, warm, 8)

    picked = pick_questions(load_questions(args.dataset), target_tok, args.per_subtask, args.max_prompt_tokens)
    picked = picked[: args.limit] if args.limit else picked
    rows, ours = [], AcceptanceStats()
    for q, text in picked:
        ids = target_tok(text, return_tensors="pt").input_ids
        results = {m: run(m, ids, args.max_new_tokens) for m in METHODS}
        ref = results["plain"][0]
        new = ref.shape[1] - ids.shape[1]
        stats = results["specdec"][3]
        ours = ours + stats
        row = {"question_id": q["question_id"], "subtask": subtask_of(q["category"]), "prompt_tokens": ids.shape[1],
               "new_tokens": new,
               **{f"{m}_seconds": r[1] for m, r in results.items()},
               **{f"{m}_target_forwards": r[2] for m, r in results.items()},
               **{f"{m}_identical": torch.equal(r[0], ref) for m, r in results.items() if m != "plain"},
               **{f"{m}_speedup": results["plain"][1] / r[1] for m, r in results.items() if m != "plain"},
               "specdec_acceptance_rate": stats.acceptance_rate,
               "specdec_mean_accepted_length": stats.mean_accepted_length,
               "specdec_drafts_per_step": stats.drafted_tokens / max(stats.steps, 1),
               "specdec_draft_seconds": stats.draft_seconds, "specdec_verify_seconds": stats.verify_seconds}
        rows.append(row)
        print(f"{row['question_id']:>4} {row['subtask']:>14} prompt {row['prompt_tokens']:>4} new {new:>3} | "
              f"plain {row['plain_seconds']:6.2f}s hf_uag {row['hf_uag_seconds']:6.2f}s "
              f"({row['hf_uag_speedup']:.2f}x, {'=' if row['hf_uag_identical'] else 'DIFFERENT'}) "
              f"specdec {row['specdec_seconds']:6.2f}s ({row['specdec_speedup']:.2f}x, "
              f"{'=' if row['specdec_identical'] else 'DIFFERENT'}) | acceptance {stats.acceptance_rate:.2f}, "
              f"accepted length {stats.mean_accepted_length:.2f}", flush=True)

    tokens = sum(r["new_tokens"] for r in rows)
    total = {m: sum(r[f"{m}_seconds"] for r in rows) for m in METHODS}
    forwards = {m: sum(r[f"{m}_target_forwards"] for r in rows) for m in METHODS}
    cost_ratio = costs["draft_1"] / costs["target_1"]
    verify_cost = {k: costs[f"target_{k + 1}"] / costs["target_1"] for k in DRAFTS}
    drafts_per_step = ours.drafted_tokens / max(ours.steps, 1)
    summary = {
        "target": "gemma3-270m", "draft": "smollm2-135m", "generator": generator_name, "specdec_settings": settings,
        "hf_assistant_settings": hf_settings,
        "hf_assistant_settings_after_run": {k: getattr(hf_draft.generation_config, k, None) for k in hf_keys},
        "questions": len(rows), "max_new_tokens": args.max_new_tokens,
        "threads": args.threads, "cpus": os.cpu_count(), "load_average_before": load_before,
        "load_average_after": load_average(), "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "load_seconds": loaded,
        "median_speedup": {m: statistics.median(r[f"{m}_speedup"] for r in rows) for m in METHODS if m != "plain"},
        "speedup_of_summed_time": {m: total["plain"] / total[m] for m in METHODS},
        "tokens_per_second": {m: tokens / total[m] for m in METHODS},
        "tokens_per_target_forward": {m: tokens / forwards[m] for m in METHODS},
        "identical_to_plain": {m: f"{sum(r[f'{m}_identical'] for r in rows)}/{len(rows)}" for m in METHODS if m != "plain"},
        "specdec_acceptance_rate": ours.acceptance_rate,
        "specdec_mean_accepted_length": ours.mean_accepted_length,
        "specdec_drafts_per_step": drafts_per_step,
        "specdec_draft_share_of_time": ours.draft_seconds / max(ours.total_seconds, 1e-9),
        "forward_ms": costs,
        "cost_ratio_draft_per_target_step": cost_ratio,
        "verify_cost_relative_to_one_step": verify_cost,
        "leviathan_bound": theoretical_speedup(ours.acceptance_rate, drafts_per_step, cost_ratio),
        "upper_bound_all_accepted": {k: (k + 1) / (k * cost_ratio + verify_cost[k]) for k in DRAFTS},
        "user_draft_generation_config_unchanged": draft.generation_config.to_dict() == draft_config_before,
        "total_seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "report.md").write_text(report(summary, rows, args))
    print(json.dumps(summary, indent=1))


def report(s: dict, rows: list[dict], args) -> str:
    pct = lambda x: f"{x:.0%}"  # noqa: E731
    lines = [
        "# Cross-tokenizer drafting: Gemma-3-270M target, SmolLM2-135M draft (greedy)",
        "",
        f"Command: `python benchmarks/cross_tokenizer.py --per-subtask {args.per_subtask} --max-new-tokens "
        f"{args.max_new_tokens} --max-prompt-tokens {args.max_prompt_tokens} --threads {args.threads}`  ",
        f"{s['questions']} Spec-Bench questions (one per subtask), {s['max_new_tokens']} new tokens, fp32, "
        f"{s['threads']} thread(s) on {s['cpus']} CPUs (load average before/after: {s['load_average_before']} / "
        f"{s['load_average_after']}), torch {s['torch']}, transformers {s['transformers']}.  ",
        f"specdec `{s['generator']}` settings {s['specdec_settings']}; transformers' assistant settings as set on the "
        f"draft {s['hf_assistant_settings']} (None: transformers' default; in 5.x 20 tokens, `constant`, confidence 0.4), "
        f"after the run {s['hf_assistant_settings_after_run']}.",
        "",
        "| method | median speedup | speedup (summed time) | tokens/s | tokens per target forward | identical to plain |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in METHODS:
        median = f"{s['median_speedup'][m]:.2f}x" if m in s["median_speedup"] else "1.00x"
        same = s["identical_to_plain"].get(m, "reference")
        lines.append(f"| {m} | {median} | {s['speedup_of_summed_time'][m]:.2f}x | {s['tokens_per_second'][m]:.1f} | "
                     f"{s['tokens_per_target_forward'][m]:.2f} | {same} |")
    lines += [
        "",
        f"specdec acceptance rate {pct(s['specdec_acceptance_rate'])}, mean accepted length "
        f"{s['specdec_mean_accepted_length']:.2f}, {s['specdec_drafts_per_step']:.2f} target-token drafts per step, "
        f"drafting {pct(s['specdec_draft_share_of_time'])} of its time.",
        "",
        "What bounds the speedup (one forward after a 128-token cached context, median of 5):",
        "",
        f"- draft token / target step cost ratio c = {s['cost_ratio_draft_per_target_step']:.2f} "
        f"({s['forward_ms']['draft_1']:.0f} ms vs {s['forward_ms']['target_1']:.0f} ms);",
        "- verifying k drafts (k + 1 positions) costs " + ", ".join(
            f"{v:.2f}x (k={k})" for k, v in s["verify_cost_relative_to_one_step"].items())
        + " a plain step (Gemma's 262,144-row output layer runs once per verified position);",
        f"- Leviathan et al.'s expected speedup at the measured acceptance and c: {s['leviathan_bound']:.2f}x "
        "(it assumes verification costs one step); with every draft accepted and the measured verification cost: "
        + ", ".join(f"{v:.2f}x (k={k})" for k, v in s["upper_bound_all_accepted"].items()) + ".",
        "",
        "| question | subtask | prompt tokens | plain s | hf_uag s | specdec s | specdec acceptance | identical (hf, specdec) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['question_id']} | {r['subtask']} | {r['prompt_tokens']} | {r['plain_seconds']:.2f} | "
                     f"{r['hf_uag_seconds']:.2f} | {r['specdec_seconds']:.2f} | {pct(r['specdec_acceptance_rate'])} | "
                     f"{r['hf_uag_identical']}, {r['specdec_identical']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
