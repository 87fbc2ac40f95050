"""A verification forward with the target's own linear products against packed weights (``specdec.engines.forwards.packed``).

    python benchmarks/packed_forward.py [--threads 2] [--shapes 1x1 1x2 1x4 1x8 1x10 1x16 2x2 4x2 8x2 8x3] [--reps 9]

SmolLM2-135M (fp32) behind a cached context of ``--context`` tokens a row, through specdec's
dynamic cache (``head.model_logits``, as a call's verification runs): for each ``rows x tokens``
shape, the median milliseconds of one forward feeding ``tokens`` tokens to each of ``rows`` rows
(logits for each) with packing off and on (``PackedLinears.pin``), the two taking turns within
every repetition, so a change of the machine's load skews neither; whether the logits' top
tokens agree; and what the one-time decision (``PackedLinears._decide``) says on this machine.
Shapes outside ``MIN_ROWS..MAX_ROWS`` rows run the model's own products either way (a control).

Results: ``benchmarks/results/packed_forward/{rows.json,report.md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

from specdec import load_model, machine
from specdec.engines.forwards.packed import MAX_ROWS, MIN_ROWS, PackedLinears
from specdec.kv import CacheSettings, make_kv
from specdec.modelinfo import cache_argument
from specdec.threads import configure_threads

OUT = Path(__file__).parent / "results" / "packed_forward"


def measure(model, shapes: list[tuple[int, int]], context: int, reps: int) -> dict:
    """{"rows x tokens": {own, packed: median ms, same_top: bool}}."""
    gen = torch.Generator().manual_seed(0)
    widest = max(tokens for _, tokens in shapes)
    ids = torch.randint(100, 5000, (max(rows for rows, _ in shapes), context + widest), generator=gen)
    cache_kwarg = cache_argument(model)
    out = {}
    with torch.no_grad():
        for rows, tokens in shapes:
            kv = make_kv(model, rows, context + widest + 1, CacheSettings())

            def forward(start: int, width: int) -> torch.Tensor:
                kwargs = {"input_ids": ids[:rows, start: start + width],
                          "position_ids": torch.arange(start, start + width)[None, :].expand(rows, -1),
                          cache_kwarg: kv.cache, "use_cache": True, "logits_to_keep": 1 if start == 0 else width}
                logits = kv.forward(model, kwargs, first_slot=start, width=width, first=start == 0, mask=None,
                                    needs_mask=False, direct=True)
                if start:
                    kv.crop(start + width, start)
                return logits

            PackedLinears.pin(model, False)
            forward(0, context)
            times, tops = {"own": [], "packed": []}, {}
            for rep in range(reps + 1):  # the first repetition warms up (and packs)
                for name in ("own", "packed") if rep % 2 else ("packed", "own"):
                    PackedLinears.pin(model, name == "packed")
                    started = time.perf_counter()
                    tops[name] = forward(context, tokens).argmax(-1)
                    if rep:
                        times[name].append(1000 * (time.perf_counter() - started))
            kv.release()
            out[f"{rows}x{tokens}"] = {**{name: statistics.median(t) for name, t in times.items()},
                                       "same_top": bool(torch.equal(tops["own"], tops["packed"]))}
            r = out[f"{rows}x{tokens}"]
            print(f"  {rows} x {tokens}: own {r['own']:.1f} ms, packed {r['packed']:.1f} ms "
                  f"({r['own'] / r['packed']:.2f}x), top tokens {'same' if r['same_top'] else 'DIFFER'}", flush=True)
    PackedLinears.forget(model)
    state = PackedLinears.of(model)
    decided, reason = state._decide()
    PackedLinears.forget(model)
    return {"shapes": out, "decision": {"use": decided, "reason": reason}}


def report(result: dict, meta: dict) -> None:
    lines = ["# A verification forward: the model's own linear products and packed weights", "",
             f"{meta['machine']}; torch {meta['torch']}, transformers {meta['transformers']}; {meta['threads']} "
             f"threads; SmolLM2-135M fp32; cached context {meta['context']} tokens a row; median of {meta['reps']} "
             "(variants taking turns). Reproduce: `python benchmarks/packed_forward.py`.", "",
             f"Packed products may serve forwards of {MIN_ROWS}-{MAX_ROWS} rows (tokens x batch rows); others run the "
             "model's own either way (controls). This machine's one-time decision: "
             f"{'use them' if result['decision']['use'] else 'do not use them'} ({result['decision']['reason']}).", "",
             "| rows x tokens | fed | own | packed | own / packed | top tokens |", "| --- | --- | --- | --- | --- | --- |"]
    for shape, r in result["shapes"].items():
        rows, tokens = map(int, shape.split("x"))
        lines.append(f"| {shape} | {rows * tokens} | {r['own']:.1f} ms | {r['packed']:.1f} ms | "
                     f"{r['own'] / r['packed']:.2f}x | {'same' if r['same_top'] else 'differ'} |")
    (OUT / "report.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="2")
    parser.add_argument("--shapes", nargs="+", default=["1x1", "1x2", "1x4", "1x8", "1x10", "1x16", "2x2", "4x2",
                                                        "8x2", "8x3"])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes]
    if any(len(s) != 2 or min(s) < 1 for s in shapes):
        parser.error("--shapes: each is ROWSxTOKENS, e.g. 1x8")
    threads = configure_threads(args.threads)
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine.describe(), "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": threads, "context": args.context, "reps": args.reps}
    model, _ = load_model("smollm2-135m")
    result = measure(model, shapes, args.context, args.reps)
    (OUT / "rows.json").write_text(json.dumps({"meta": meta, "result": result}, indent=1))
    report(result, meta)


if __name__ == "__main__":
    main()
