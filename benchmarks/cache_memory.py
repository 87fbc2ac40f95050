"""Memory of the static cache across calls: the pool stays under its limit, RSS stays near one call's.

Issue 31's measurement, on its tiny model (a random llama, 4 layers, hidden size 256, 4 key/value
heads: 8 KiB of cache a slot and row in fp32), static cache, ``prompt_lookup``, greedy:

1. ``--calls`` calls of random shapes (batch 1-4, prompt 5-200 tokens, ``max_new_tokens`` up to
   10^6), each stopping early: half at an end-of-sequence id (the greedy token at a random
   position 2-40), half by a stopping criterion after 2-40 new tokens. After each call: the bytes
   of idle caches the pool keeps (``specdec.pooled_bytes``), the process's RSS, and the peak RSS
   during the call (``VmHWM``, reset before each call through ``/proc/self/clear_refs``). "One
   call's peak" is the peak RSS of the first call, made with the largest shape (batch 4, a
   200-token prompt) before the random ones.
2. One call with ``max_new_tokens=2_000_000`` that stops at EOS after a few tokens, on the static
   and on the dynamic cache (and, for reference, the static call asking only for the tokens it
   made): the cache bytes each allocates (static: the layers ``StaticLayer`` allocates; dynamic:
   the largest ``DynamicCache`` the call held, and the bytes all its growth allocated: specdec's
   ``GrowingLayer`` buffers, or a plain ``DynamicLayer``'s ``torch.cat`` s), the peak RSS over
   the RSS before, and the seconds (the median of 5 calls, the process warmed up).

    python benchmarks/cache_memory.py                       # the default limit, 50 calls
    python benchmarks/cache_memory.py --limit 8M --out benchmarks/results/cache_memory/limit_8M

Writes ``results.json`` and ``report.md`` to ``--out`` (default
``benchmarks/results/cache_memory/``), with the machine named (``specdec.machine.describe``).
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import transformers
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.generation import StoppingCriteria, StoppingCriteriaList

from specdec import SpecDecoder, cache_pool_limit, pooled_bytes, set_cache_pool_limit
from specdec.cache_pool import POOL, parse_bytes
from specdec.growing import GrowingLayer
from specdec.machine import describe
from specdec.tiny import tiny_random

OUT = Path(__file__).resolve().parent / "results" / "cache_memory"
MIB = 1 << 20


# -- measuring ------------------------------------------------------------------------------------
def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")  # resets VmHWM to the current RSS


class CacheBytes:
    """Bytes of cache a call allocates, by spying on the cache layers: transformers' static and
    dynamic ones, and specdec's ``GrowingLayer`` (a dynamic layer that grows buffers in place)."""

    def __init__(self):
        self.static = 0  # bytes of StaticLayer tensors allocated
        self.dynamic_peak = 0  # the largest DynamicCache held (all layers)
        self.dynamic_total = 0  # bytes every growth of a dynamic layer allocated
        self._held: dict[int, int] = {}
        self._static_init = StaticLayer.lazy_initialization
        self._dynamic_update = DynamicLayer.update
        self._regrow = GrowingLayer._regrow

    def _grown(self, layer, size: int) -> None:
        self.dynamic_total += size
        self._held[id(layer)] = size
        self.dynamic_peak = max(self.dynamic_peak, sum(self._held.values()))

    def __enter__(self):
        spy = self

        def init(layer, key_states, *args, **kwargs):
            out = spy._static_init(layer, key_states, *args, **kwargs)
            spy.static += 2 * layer.keys.numel() * layer.keys.element_size()
            return out

        def update(layer, key_states, value_states, *args, **kwargs):
            out = spy._dynamic_update(layer, key_states, value_states, *args, **kwargs)
            spy._grown(layer, 2 * layer.keys.numel() * layer.keys.element_size())
            return out

        def regrow(layer, *args, **kwargs):
            out = spy._regrow(layer, *args, **kwargs)
            buffers = (layer._key_buffer, layer._value_buffer)
            spy._grown(layer, sum(b.numel() * b.element_size() for b in buffers))
            return out

        StaticLayer.lazy_initialization, DynamicLayer.update, GrowingLayer._regrow = init, update, regrow
        return self

    def __exit__(self, *exc):
        StaticLayer.lazy_initialization, DynamicLayer.update = self._static_init, self._dynamic_update
        GrowingLayer._regrow = self._regrow


class StopAfter(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def model():
    target, _ = tiny_random("llama", seed=0, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=4)
    return target


def call(decoder, target, batch: int, length: int, new: int, stop: int, by_eos: bool, g: torch.Generator) -> dict:
    """One call of this shape that stops after about ``stop`` new tokens; -> its measurements."""
    ids = torch.randint(0, 250, (batch, length), generator=g)
    if by_eos:  # every row the same prompt, so every row meets the end-of-sequence id together
        ids = ids[:1].repeat(batch, 1)
        eos = int(target.generate(ids[:1], max_new_tokens=stop, do_sample=False)[0, -1])
        options = {"eos_token_id": eos}
    else:
        options = {"eos_token_id": None, "stopping_criteria": StoppingCriteriaList([StopAfter(length + stop)])}
    reset_peak()
    started = time.perf_counter()
    out = decoder.generate(ids, max_new_tokens=new, **options)
    return {"batch": batch, "prompt": length, "max_new_tokens": new, "stop": "eos" if by_eos else "criterion",
            "new_tokens": int(out.sequences.shape[1] - length), "seconds": time.perf_counter() - started,
            "peak_rss": _status("VmHWM"), "rss_after": _status("VmRSS"), "pooled_bytes": pooled_bytes(),
            "pooled_caches": POOL.count()}


# -- the two measurements -------------------------------------------------------------------------
def random_calls(target, calls: int, seed: int) -> dict:
    decoder = SpecDecoder(target, "prompt_lookup", cache_implementation="static")
    g = torch.Generator().manual_seed(seed)
    first = call(decoder, target, 4, 200, 10**6, 40, False, g)  # the largest shape: one call's peak
    rows = []
    for i in range(calls):
        batch = int(torch.randint(1, 5, (1,), generator=g))
        length = int(torch.randint(5, 201, (1,), generator=g))
        new = int(torch.randint(1, 10**6 + 1, (1,), generator=g))
        stop = int(torch.randint(2, 41, (1,), generator=g))
        rows.append(call(decoder, target, batch, length, new, stop, i % 2 == 1, g))
    return {"first": first, "calls": rows}


def huge_max_new_tokens(target) -> list[dict]:
    """One call asking for 2,000,000 new tokens that stops at EOS after a few, per cache."""
    for seed in range(100):  # a prompt whose 4th greedy token is new: EOS there ends the call after 4
        ids = torch.randint(0, 250, (1, 10), generator=torch.Generator().manual_seed(seed))
        greedy = target.generate(ids, max_new_tokens=4, do_sample=False)[0, 10:].tolist()
        if greedy[3] not in greedy[:3]:
            break
    eos = greedy[3]
    made = []
    for cache, new in (("static", 2_000_000), ("dynamic", 2_000_000), ("static", 4)):
        decoder = SpecDecoder(target, "prompt_lookup", cache_implementation=cache)
        decoder.generate(ids, max_new_tokens=new, eos_token_id=eos)  # warm: calibration, first-use costs
        POOL.clear()
        before = _status("VmRSS")
        reset_peak()
        with CacheBytes() as spy:
            out = decoder.generate(ids, max_new_tokens=new, eos_token_id=eos)
        peak = _status("VmHWM") - before
        seconds = []
        for _ in range(5):  # the median of 5, the pool warm (a shared machine's load moves single timings)
            started = time.perf_counter()
            decoder.generate(ids, max_new_tokens=new, eos_token_id=eos)
            seconds.append(time.perf_counter() - started)
        seconds = sorted(seconds)[2]
        made.append({"cache": cache, "max_new_tokens": new, "new_tokens": int(out.sequences.shape[1] - 10),
                     "seconds": seconds, "static_cache_bytes": spy.static, "dynamic_cache_peak_bytes": spy.dynamic_peak,
                     "dynamic_cache_allocated_bytes": spy.dynamic_total, "peak_rss_over_before": peak})
    return made


# -- the report -----------------------------------------------------------------------------------
def report(result: dict) -> str:
    runs, first, limit = result["random"]["calls"], result["random"]["first"], result["limit_bytes"]
    worst_pool = max(r["pooled_bytes"] for r in runs)
    worst_rss = max(r["rss_after"] for r in runs)
    worst_peak = max(r["peak_rss"] for r in runs)
    lines = [
        "# Static-cache memory across calls (`benchmarks/cache_memory.py`)", "",
        f"Machine: {result['machine']}; torch {result['torch']}, transformers {result['transformers']}, "
        f"{result['threads']} threads; load average at the end {result['load_average'][0]:.1f} (seconds move with "
        f"the machine's load; bytes do not). Model: {result['model']}. Static cache, `prompt_lookup`, greedy.", "",
        f"## {len(runs)} calls of random shapes (pool limit {limit / MIB:.0f} MiB)", "",
        "Batch 1-4, prompt 5-200 tokens, `max_new_tokens` up to 10^6, each stopped after 2-40 new tokens "
        "(EOS or a stopping criterion). One call's peak: the first call (batch 4, 200-token prompt).", "",
        "| measure | value |", "| --- | --- |",
        f"| one call's peak RSS | {first['peak_rss'] / MIB:.1f} MiB |",
        f"| largest pooled bytes after a call | {worst_pool / MIB:.2f} MiB ({worst_pool / limit:.1%} of the limit) |",
        f"| most caches pooled | {max(r['pooled_caches'] for r in runs)} |",
        f"| largest RSS after a call | {worst_rss / MIB:.1f} MiB ({worst_rss / first['peak_rss']:.3f}x one call's peak) |",
        f"| largest peak RSS during a call | {worst_peak / MIB:.1f} MiB ({worst_peak / first['peak_rss']:.3f}x) |",
        f"| RSS after the last call | {runs[-1]['rss_after'] / MIB:.1f} MiB |",
        "", "## One call asking for 2,000,000 new tokens that stops at EOS", "",
        "| cache | max_new_tokens | new tokens | static cache allocated | dynamic cache: largest held | "
        "dynamic cache: all growth allocated | peak RSS over the RSS before | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["huge"]:
        lines.append(f"| {r['cache']} | {r['max_new_tokens']:,} | {r['new_tokens']} | "
                     f"{r['static_cache_bytes'] / MIB:.2f} MiB | {r['dynamic_cache_peak_bytes'] / MIB:.3f} MiB | "
                     f"{r['dynamic_cache_allocated_bytes'] / MIB:.3f} MiB | {r['peak_rss_over_before'] / MIB:.2f} MiB | "
                     f"{r['seconds']:.3f} |")
    lines += ["", "Per call: `results.json`."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--limit", default=None, help="pool limit (bytes, or e.g. 8M); default: the pool's own")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.limit is not None:
        set_cache_pool_limit(parse_bytes(args.limit, "--limit"))
    target = model()
    huge = huge_max_new_tokens(target)
    POOL.clear()
    result = {"machine": describe(), "platform": platform.platform(), "torch": torch.__version__,
              "transformers": transformers.__version__, "threads": torch.get_num_threads(),
              "model": "tiny random llama (4 layers, hidden 256, 4 key/value heads, fp32)",
              "limit_bytes": cache_pool_limit(), "random": random_calls(target, args.calls, args.seed),
              "huge": huge, "load_average": os.getloadavg()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "report.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
