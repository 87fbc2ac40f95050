"""The cost of one forward as a function of its width, per cache kind and weight precision.

    python benchmarks/forward_cost.py [--threads 2] [--widths 1 4] [--variants ...] [--rounds 9] [--out DIR]

For the packaged SmolLM2-135M-Instruct (fp32 target) and the copies ``self_draft`` can build, on
a cached context of ``--context`` tokens: the median milliseconds of one forward feeding ``w`` new
tokens (logits for each, as verification needs), through the same cache backends ``SpecDecoder``
uses (``specdec.kv``), with each variant's first forward at each width (compiling, for compiled
variants) timed apart. A variant is ``<weights>-<cache>``:

* weights: ``fp32`` (the target), ``bf16``, ``int8`` (torchao weight-only), ``w8a8`` (int8 x uint8
  products, ``specdec.engines.forwards.int8``), ``dyn8`` (torch's ``quantize_dynamic``, fbgemm), ``int4``
  (torchao): the copies of ``specdec.engines.forwards.lowbit.build_copy``;
* cache: ``dynamic`` (eager, the default path), ``static`` (eager), ``static-compiled``.

Every variant is built and warmed up first; then each round times every (width, variant) once,
the variants' order rotating from round to round, so a change of the machine's load (it is
shared) moves every variant alike: compare the ratios to ``fp32-dynamic`` at one token, which
the report gives beside each figure. The CPU is named with ``specdec.machine.describe()``,
including any instruction-set caps set in the environment (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``, ...; docs/performance.md, "Emulating another CPU").

Results: ``DIR/{rows.json,report.md}`` (default ``benchmarks/results/forward_cost``), written after
the warm-up and after every round (an interrupted run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import transformers

from specdec import load_model, machine
from specdec.kv import CacheSettings, make_kv
from specdec.modelinfo import cache_argument
from specdec.threads import configure_threads

WEIGHTS = {"fp32": None, "bf16": "bfloat16", "int8": "int8", "w8a8": "w8a8", "dyn8": "dynamic_int8", "int4": "int4"}
CACHES = ("dynamic", "static", "static-compiled")
VARIANTS = tuple(f"{w}-{c}" for w in WEIGHTS for c in CACHES)
DEFAULT_VARIANTS = ("fp32-dynamic", "bf16-dynamic", "w8a8-dynamic", "int8-dynamic", "dyn8-dynamic")
OUT = Path(__file__).parent / "results" / "forward_cost"


def model_for(weights: str, target, built: dict):
    """The target itself or its copy at ``weights`` (built once per weights)."""
    from specdec.engines.forwards.lowbit import build_copy

    if WEIGHTS[weights] is None:
        return target
    if weights not in built:
        built[weights] = build_copy(target, WEIGHTS[weights])
    return built[weights]


def settings_for(variant: str) -> CacheSettings:
    if variant.endswith("static-compiled"):
        return CacheSettings.make("static", True)
    return CacheSettings.make("static" if variant.endswith("static") else "dynamic")


class Timed:
    """One variant: its model on a cache holding ``context`` tokens, ready to time a forward of any width."""

    def __init__(self, model, cache: CacheSettings, ids: torch.Tensor, context: int):
        self.model, self.ids, self.context = model, ids, context  # ids [1, context + widest]
        self.kv = make_kv(model, 1, ids.shape[1] + 1, cache)
        self.cache_kwarg = cache_argument(model)
        self.forward(0, context, True)

    def forward(self, start: int, width: int, first: bool) -> None:
        fed = self.kv.padded_width(width, first)
        kwargs = {"input_ids": self.ids[:, start: start + fed], "position_ids": torch.arange(start, start + fed)[None, :],
                  self.cache_kwarg: self.kv.cache, "use_cache": True, "logits_to_keep": 1 if first else width}
        mask = lambda slots: (torch.arange(slots) < start + width).long()[None, :]  # noqa: E731
        self.kv.forward(self.model, kwargs, first_slot=start, width=width, first=first, mask=mask, needs_mask=False,
                        direct=True)

    def time(self, width: int) -> float:
        """Seconds of one forward of ``width`` tokens after the context (then rolled back)."""
        started = time.perf_counter()
        with torch.no_grad():
            self.forward(self.context, width, False)
        seconds = time.perf_counter() - started
        self.kv.crop(self.context + width, self.context)
        return seconds


def build(variants: list[str], widths: list[int], context: int) -> tuple[dict, dict]:
    """Every variant built and warmed up at every width: ({variant: Timed}, {variant: {width: first-call s}})."""
    target, _ = load_model("smollm2-135m")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 5000, (1, context + max(widths)), generator=gen)
    built, timed, first = {}, {}, {}
    for variant in variants:
        weights, cache = variant.split("-", 1)
        print(f"{variant}: building and warming up", flush=True)
        with torch.no_grad():
            timed[variant] = Timed(model_for(weights, target, built), settings_for(variant), ids, context)
        first[variant] = {w: timed[variant].time(w) for w in widths}
        print("  first call " + ", ".join(f"w={w}: {s:.1f} s" for w, s in first[variant].items()), flush=True)
    return timed, first


def measure(timed: dict, widths: list[int], rounds: int, save) -> dict:
    """{variant: {width: [seconds per round]}}, every (width, variant) timed once a round, the
    variants' order rotating."""
    names = list(timed)
    times = {v: {w: [] for w in widths} for v in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for width in widths:
            for variant in order:
                times[variant][width].append(timed[variant].time(width))
        save(times)
    return times


def rows_of(times: dict, first: dict) -> dict:
    """Per variant and width: the median and the fastest forward (ms; the fastest is the one least
    slowed by other jobs), the first call (s) and the number timed."""
    return {v: {w: {"ms": 1000 * statistics.median(t), "min_ms": 1000 * min(t), "first_call_s": first[v][w],
                    "n": len(t)} for w, t in per_width.items() if t} for v, per_width in times.items()}


def report(rows: dict, meta: dict, out: Path) -> None:
    widths = sorted({int(w) for r in rows.values() for w in r})
    base = rows.get("fp32-dynamic", {}).get(widths[0], {}).get("ms") if widths else None
    caps = ", ".join(f"`{k}={v}`" for k, v in meta["isa_caps"].items()) or "none"
    load = meta.get("load_average", {})
    lines = ["# Forward cost by width", "",
             f"Machine: {meta['machine']} (torch's CPU capability {meta['cpu_capability']}; instruction-set caps "
             f"in the environment: {caps}); shared with other jobs while measuring (1-minute load average "
             f"{load.get('start', float('nan')):.1f} at the start, {load.get('end', float('nan')):.1f} at the end, "
             f"on {meta.get('cores', '?')} cores). torch {meta['torch']}, "
             f"transformers {meta['transformers']}; {meta['threads']} threads; SmolLM2-135M-Instruct; cached "
             f"context {meta['context']} tokens; median of {meta['rounds']} forwards, the variants taking turns.", "",
             f"Command: `{meta['command']}`", "",
             "Milliseconds per forward (in parentheses: relative to one fp32 dynamic one-token forward in the same "
             "run).", "",
             "| variant | " + " | ".join(f"w={w}" for w in widths) + " | first call at w=1 (s) |",
             "|---" * (len(widths) + 2) + "|"]
    for name, r in rows.items():
        cells = [f"{r[w]['ms']:.1f} ({r[w]['ms'] / base:.2f})" if w in r and base else "-" for w in widths]
        first = r[widths[0]]["first_call_s"] if widths[0] in r else float("nan")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {first:.1f} |")
    best = rows.get("fp32-dynamic", {}).get(widths[0], {}).get("min_ms") if widths else None
    lines += ["", "The fastest of each variant's forwards (ms; in parentheses relative to the fastest fp32 dynamic "
              "one-token forward): the figure least slowed by the other jobs.", "",
              "| variant | " + " | ".join(f"w={w}" for w in widths) + " |", "|---" * (len(widths) + 1) + "|"]
    for name, r in rows.items():
        cells = [f"{r[w]['min_ms']:.1f} ({r[w]['min_ms'] / best:.2f})" if w in r and best else "-" for w in widths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="2")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4],
                        help="forward widths (each compiles once per compiled variant: about a minute on 2 cores)")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    threads = configure_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine.describe(), "cpu_model": machine.cpu_model(), "cpu_capability": machine.cpu_capability(),
            "cpu_flags": machine.cpu_flags(), "isa_caps": machine.isa_caps(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": threads, "context": args.context,
            "rounds": args.rounds, "command": " ".join(["python benchmarks/forward_cost.py", *sys.argv[1:]]),
            "cores": os.cpu_count(), "load_average": {"start": os.getloadavg()[0]}}
    print(meta["machine"], flush=True)
    timed, first = build(args.variants, args.widths, args.context)

    def save(times: dict) -> None:
        meta["load_average"]["end"] = os.getloadavg()[0]
        rows = rows_of(times, first)
        (args.out / "rows.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        report(rows, meta, args.out)

    measure(timed, args.widths, args.rounds, save)
    print((args.out / "report.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
