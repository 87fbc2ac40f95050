"""The loop's own cost where a forward is as cheap as a GPU's: a tiny llama on one CPU thread.

    python benchmarks/launch_bound.py [--repeats 7] [--max-new-tokens 128] [--regimes eager,compiled]

A GPU runs a small model's forward in a few milliseconds, so whatever a speculative step spends
outside the model (choosing drafts, admitting them, verifying, committing, bookkeeping, reading
the device) is a large share of it. This stands in for that regime on a CPU: ``tiny-random:llama``
(2 layers, hidden size 64) decoded greedily, 128 new tokens, one thread, in two regimes:

* ``eager``: ``target.generate`` with its dynamic cache, against ``SpecDecoder(engine="eager")``
  (the model's own forward, the same one ``generate`` runs);
* ``compiled``: ``target.generate(cache_implementation="static")`` with its forward compiled
  (``CompileConfig``, all devices), against ``SpecDecoder(cache_implementation="static",
  compile=True)``.

Per regime, interleaved per repeat in one process: ``plain`` (``generate``), ``loop`` (specdec with
no drafts: the loop's cost alone) and ``pl`` (prompt lookup on a ``fixed`` schedule, so every step
drafts what a match offers). Each specdec run also reports the seconds inside model forwards
(every forward passes ``specdec.kv``'s backends), so that ``host ms/step`` = (wall - forwards) /
steps. ``pl``'s *efficiency* is its speedup over ``plain`` divided by its mean tokens per step (1.0:
each step costs one plain step). Results: ``benchmarks/results/launch_bound/{rows.json,report.md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch
import transformers
from transformers import CompileConfig

import specdec
from specdec import SpecDecoder, load_model
from specdec.machine import describe
from specdec.threads import configure_threads
from step_overhead import ForwardClock  # seconds inside the cache backends' forwards (this folder's script)

OUT = Path(__file__).parent / "results" / "launch_bound"
#: a prompt the tiny model continues in loops, as small random models do, so a lookup finds matches
PROMPT = "the cat sat on the mat. the cat sat on the mat. the dog sat on the log. " * 3


def plain_settings(regime: str) -> dict:
    if regime == "eager":
        return {}
    config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    config._compile_all_devices = True  # generate() compiles on a CPU only when told to
    return {"cache_implementation": "static", "compile_config": config}


def decoders(target, regime: str) -> dict[str, SpecDecoder]:
    cache = {"engine": "eager"} if regime == "eager" else {"cache_implementation": "static", "compile": True}
    return {"loop": SpecDecoder(target, None, **cache),
            "pl": SpecDecoder(target, "prompt_lookup", schedule="fixed", num_tokens=4, **cache)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--regimes", default="eager,compiled")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    threads = configure_threads("1")
    target, tokenizer = load_model("tiny-random:llama")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    target.generation_config.eos_token_id = None  # every call decodes all its tokens, no stopping criterion
    n = args.max_new_tokens
    rows = []
    with torch.no_grad():
        for regime in args.regimes.split(","):
            specs = decoders(target, regime)
            plain_kwargs = dict(max_new_tokens=n, do_sample=False, **plain_settings(regime))
            # generate()'s compiled forward and specdec's graphs share dynamo's entries for the model's forward
            with torch._dynamo.config.patch(recompile_limit=64):
                reference = target.generate(ids, **plain_kwargs)  # compiles generate()'s forward once
            for decoder in specs.values():  # compiles (and calibrates) outside the timings
                decoder.warmup(max_length=ids.shape[1] + n + 16)
            for repeat in range(args.repeats):
                started = time.perf_counter()
                with torch._dynamo.config.patch(recompile_limit=64):
                    target.generate(ids, **plain_kwargs)
                rows.append({"regime": regime, "method": "plain", "repeat": repeat,
                             "seconds": time.perf_counter() - started, "new_tokens": n, "steps": n,
                             "forward_seconds": None, "identical": True})
                for name, decoder in specs.items():
                    with ForwardClock() as clock:
                        started = time.perf_counter()
                        out = decoder.generate(ids, max_new_tokens=n)
                        seconds = time.perf_counter() - started
                    rows.append({"regime": regime, "method": name, "repeat": repeat, "seconds": seconds,
                                 "new_tokens": out.sequences.shape[1] - ids.shape[1], "steps": out.stats.steps,
                                 "forward_seconds": clock.seconds,
                                 "identical": bool(torch.equal(out.sequences, reference))})
                print(f"{regime} repeat {repeat}: " + ", ".join(
                    f"{r['method']} {r['seconds'] * 1e3:.0f} ms" for r in rows[-3:]), flush=True)
    meta = {"machine": describe(), "capability": torch.backends.cpu.get_cpu_capability(), "commit": source_commit(),
            "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": threads, "max_new_tokens": n,
            "repeats": args.repeats, "prompt_tokens": ids.shape[1]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rows.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    report = summarize(rows, meta)
    (args.out / "report.md").write_text(report)
    print(report)


def source_commit() -> str:
    """The commit of the specdec this run imported (its checkout's HEAD), or "unknown"."""
    done = subprocess.run(["git", "-C", str(Path(specdec.__file__).parent), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def summarize(rows: list[dict], meta: dict) -> str:
    lines = ["# The loop's cost in a launch-bound stand-in", "",
             f"specdec at {meta.get('commit', 'unknown')}; "
             f"tiny-random:llama fp32, {meta['threads']} thread, {meta['machine']} "
             f"(torch capability {meta['capability']}), torch {meta['torch']}, transformers {meta['transformers']}; "
             f"{meta['prompt_tokens']}-token prompt, {meta['max_new_tokens']} new tokens, greedy, "
             f"{meta['repeats']} interleaved repeats (medians).", "",
             "| regime | method | ms/call | vs plain (time) | tokens/step | efficiency | forward ms/step | "
             "host ms/step | identical |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for regime in dict.fromkeys(r["regime"] for r in rows):
        plain = statistics.median(r["seconds"] for r in rows if r["regime"] == regime and r["method"] == "plain")
        for method in dict.fromkeys(r["method"] for r in rows if r["regime"] == regime):
            mine = [r for r in rows if r["regime"] == regime and r["method"] == method]
            seconds = statistics.median(r["seconds"] for r in mine)
            per_step = statistics.median(r["new_tokens"] / r["steps"] for r in mine)
            if mine[0]["forward_seconds"] is None:
                forward = host = "-"
                efficiency = "-"
            else:
                forward = statistics.median(r["forward_seconds"] / r["steps"] for r in mine) * 1e3
                host = statistics.median((r["seconds"] - r["forward_seconds"]) / r["steps"] for r in mine) * 1e3
                forward, host = f"{forward:.3f}", f"{host:.3f}"
                efficiency = f"{plain / seconds / per_step:.2f}"
            same = sum(r["identical"] for r in mine)
            lines.append(f"| {regime} | `{method}` | {seconds * 1e3:.1f} | {seconds / plain:.2f}x | {per_step:.2f} | "
                         f"{efficiency} | {forward} | {host} | {same}/{len(mine)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
