"""Where a step's time goes on each cache path: model forwards against everything else.

    python benchmarks/step_overhead.py [--threads 2] [--per-subtask 1] [--max-new-tokens 96]

SmolLM2-135M-Instruct, greedy, Spec-Bench prompts (one per subtask by default), methods
interleaved per prompt in one process:

* ``plain``: ``target.generate(do_sample=False)`` (the reference for speedups);
* ``pl-dynamic``, ``pl-static``, ``pl-static-compiled``: ``SpecDecoder(target, "prompt_lookup")``
  with ``cache_implementation`` "dynamic" (the default) or "static", without or with
  ``compile=True`` (compiled by ``warmup`` first; the compile seconds are reported apart).

For the SpecDecoder methods the seconds spent inside model forwards are measured by wrapping the
cache backends' ``forward`` (``specdec.kv``), which every forward of every model goes through,
compiled or not; the rest of the wall time is the per-step work around them (drafting, verifying,
committing, bookkeeping). Results: ``benchmarks/results/step_overhead/{rows.json,report.md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from specdec import SpecDecoder, load_model
from specdec import kv as kv_module
from specdec.prompts import DEFAULT_SPEC_BENCH, SUBTASKS, encode_chat, load_questions, subtask_of
from specdec.threads import configure_threads

OUT = Path(__file__).parent / "results" / "step_overhead"
METHODS = {"pl-dynamic": ("dynamic", False), "pl-static": ("static", False), "pl-static-compiled": ("static", True)}


class ForwardClock:
    """Seconds spent inside ``specdec.kv`` backends' ``forward`` while active."""

    def __init__(self):
        self.seconds = 0.0
        self._originals = {}

    def __enter__(self):
        for cls in (kv_module.DynamicKV, kv_module.StaticKV):
            original = cls.forward
            self._originals[cls] = original

            def timed(backend, *args, _original=original, **kwargs):
                started = time.perf_counter()
                try:
                    return _original(backend, *args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - started

            cls.forward = timed
        return self

    def __exit__(self, *exc):
        for cls, original in self._originals.items():
            cls.forward = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="2")
    parser.add_argument("--per-subtask", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    threads = configure_threads(args.threads)
    target, tokenizer = load_model("smollm2-135m")
    questions = load_questions(DEFAULT_SPEC_BENCH)
    picked = [q for s in SUBTASKS for q in [q for q in questions if subtask_of(q["category"]) == s][: args.per_subtask]]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in picked]
    decoders = {name: SpecDecoder(target, "prompt_lookup", cache_implementation=impl, compile=comp)
                for name, (impl, comp) in METHODS.items()}
    longest = max(p.shape[1] for p in prompts) + args.max_new_tokens
    compile_seconds = {name: d.warmup(max_length=longest) for name, d in decoders.items()}
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    with torch.no_grad():
        for q, ids in zip(picked, prompts):
            started = time.perf_counter()
            plain = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            rows.append({"method": "plain", "question": q["question_id"], "seconds": time.perf_counter() - started,
                         "new_tokens": plain.shape[1] - ids.shape[1], "forward_seconds": None, "identical": True})
            for name, decoder in decoders.items():
                with ForwardClock() as clock:
                    started = time.perf_counter()
                    out = decoder.generate(ids, max_new_tokens=args.max_new_tokens)
                    seconds = time.perf_counter() - started
                rows.append({"method": name, "question": q["question_id"], "seconds": seconds,
                             "new_tokens": out.sequences.shape[1] - ids.shape[1], "forward_seconds": clock.seconds,
                             "identical": bool(torch.equal(out.sequences, plain))})
                print(f"{q['question_id']} {name}: {rows[-1]['new_tokens'] / seconds:.1f} tok/s, outside forwards "
                      f"{1 - clock.seconds / seconds:.1%}", flush=True)
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": threads, "max_new_tokens": args.max_new_tokens,
            "questions": len(picked), "compile_seconds": compile_seconds}
    (OUT / "rows.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_report(rows, meta)


def write_report(rows: list[dict], meta: dict) -> None:
    plain = {r["question"]: r["seconds"] for r in rows if r["method"] == "plain"}
    lines = ["# Time outside model forwards, per cache path", "",
             f"SmolLM2-135M-Instruct fp32, {meta['threads']} threads, {meta['machine']}, torch {meta['torch']}, "
             f"transformers {meta['transformers']}; {meta['questions']} Spec-Bench prompts (one per subtask), "
             f"{meta['max_new_tokens']} new tokens, greedy; methods interleaved per prompt.", "",
             "| method | tok/s (all prompts) | speedup vs plain (sum of times) | outside forwards, median | "
             "outside forwards, max | identical | compile (s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for method in ["plain", *METHODS]:
        mine = [r for r in rows if r["method"] == method]
        seconds = sum(r["seconds"] for r in mine)
        tokens = sum(r["new_tokens"] for r in mine)
        speedup = sum(plain[r["question"]] for r in mine) / seconds
        outside = [1 - r["forward_seconds"] / r["seconds"] for r in mine if r["forward_seconds"] is not None]
        cells = (f"{statistics.median(outside):.1%}", f"{max(outside):.1%}") if outside else ("-", "-")
        same = sum(r["identical"] for r in mine)
        compiled = meta["compile_seconds"].get(method)
        lines.append(f"| `{method}` | {tokens / seconds:.1f} | {speedup:.2f}x | {cells[0]} | {cells[1]} | "
                     f"{same}/{len(mine)} | {f'{compiled:.0f}' if compiled else '-'} |")
    (OUT / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
