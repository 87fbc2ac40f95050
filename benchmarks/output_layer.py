"""The output layer as ``nn.Linear`` against ``W @ h.T`` (``specdec.engines.forwards.head``), alone and in whole forwards.

    python benchmarks/output_layer.py [--threads 2] [--models smollm2-135m gemma3-270m] [--widths 1 2 4 8 16]

For each packaged model (fp32): the median milliseconds of its output layer on ``w`` hidden
states as ``nn.Linear`` and as :class:`specdec.engines.forwards.head.FastHead`, and of one whole forward feeding
``w`` tokens after a cached context of ``--context`` tokens (logits for each, as verification
needs) through specdec's dynamic cache with ``fast_head`` off and on. The two variants take
turns within every repetition, so a change of the machine's load skews neither. Also whether
``FastHead.of`` chose the fast head for the model on this machine (its one-time probe).

Results: ``benchmarks/results/output_layer/{rows.json,report.md}``, written after each model.
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

from specdec import load_model
from specdec.engines.forwards.head import FastHead
from specdec.kv import CacheSettings, make_kv
from specdec.modelinfo import cache_argument
from specdec.threads import configure_threads

OUT = Path(__file__).parent / "results" / "output_layer"


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - started)


def measure(model, widths: list[int], context: int, reps: int) -> dict:
    """{width: {head_linear, head_fast, forward_own, forward_fast}: median ms}."""
    chosen = FastHead.of(model) is not None
    head = FastHead.pin(model, True)  # both variants below, whatever this machine chose
    if head is None:
        raise SystemExit(f"{type(model).__name__}: its output layer does not qualify for the fast head")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 5000, (1, context + max(widths)), generator=gen)
    kvs = {fast: make_kv(model, 1, context + max(widths) + 1, CacheSettings.make(fast_head=fast))
           for fast in (False, True)}
    cache_kwarg = cache_argument(model)

    def forward(kv, start: int, width: int) -> None:
        kwargs = {"input_ids": ids[:, start: start + width], "position_ids": torch.arange(start, start + width)[None, :],
                  cache_kwarg: kv.cache, "use_cache": True, "logits_to_keep": 1 if start == 0 else width}
        kv.forward(model, kwargs, first_slot=start, width=width, first=start == 0, mask=None, needs_mask=False,
                   direct=True)
        if start:
            kv.crop(start + width, start)

    rows = {}
    with torch.no_grad():
        for kv in kvs.values():
            forward(kv, 0, context)
        for width in widths:
            hidden = torch.randn(1, width, head.layer.weight.shape[1], generator=gen)
            runs = {name: [] for name in ("head_linear", "head_fast", "forward_own", "forward_fast")}
            for rep in range(reps + 1):  # the first repetition warms up
                got = {"head_linear": timed(lambda: head.layer(hidden)), "head_fast": timed(lambda: head(hidden)),
                       "forward_own": timed(lambda: forward(kvs[False], context, width)),
                       "forward_fast": timed(lambda: forward(kvs[True], context, width))}
                if rep:
                    for name, ms in got.items():
                        runs[name].append(ms)
            rows[width] = {name: statistics.median(ms) for name, ms in runs.items()}
            print(f"  width {width:2d}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in rows[width].items()), flush=True)
    for kv in kvs.values():
        kv.release()
    FastHead.forget(model)
    return {"chosen_here": chosen, "head": list(head.layer.weight.shape), "widths": rows}


def report(results: dict, meta: dict) -> None:
    lines = ["# The output layer as `nn.Linear` and as `W @ h.T`", "",
             f"{meta['machine']}; torch {meta['torch']}, transformers {meta['transformers']}; {meta['threads']} "
             f"threads; fp32; cached context {meta['context']} tokens; median of {meta['reps']} (variants taking "
             "turns). Reproduce: `python benchmarks/output_layer.py`.", "",
             "Milliseconds. Head: the output layer alone on `w` hidden states. Forward: a whole forward "
             "feeding `w` tokens (specdec's dynamic cache), the model's own head / the fast head; in parentheses "
             "relative to the model's own one-token forward.", ""]
    for name, r in results.items():
        one = r["widths"][min(r["widths"])]["forward_own"]
        lines += [f"## {name} (head {r['head'][0]} x {r['head'][1]}; chosen by the probe here: "
                  f"{'yes' if r['chosen_here'] else 'no'})", "",
                  "| tokens | head: nn.Linear | head: W @ h.T | forward: own head | forward: fast head |",
                  "| --- | --- | --- | --- | --- |"]
        for w, t in sorted(r["widths"].items()):
            lines.append(f"| {w} | {t['head_linear']:.1f} | {t['head_fast']:.1f} | {t['forward_own']:.1f} "
                         f"({t['forward_own'] / one:.2f}) | {t['forward_fast']:.1f} ({t['forward_fast'] / one:.2f}) |")
        lines.append("")
    (OUT / "report.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="2")
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    threads = configure_threads(args.threads)
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": threads, "context": args.context, "reps": args.reps}
    results = {}
    for name in args.models:
        print(name, flush=True)
        model, _ = load_model(name)
        results[name] = measure(model, args.widths, args.context, args.reps)
        (OUT / "rows.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        report(results, meta)


if __name__ == "__main__":
    main()
