"""The target's forward through its own modules against the direct forward (``specdec.engines.forwards.direct``).

    python benchmarks/direct_forward.py [--threads 2] [--shapes 1x1 1x2 1x3 1x4 1x8 1x16 2x2 4x2 8x2 8x3] [--reps 9]

SmolLM2-135M (fp32) behind a cached context of ``--context`` tokens a row, through specdec's
dynamic cache (``head.model_logits``, as a call's steps and verifications run, the packed
products of ``packed.py`` on in both variants): for each ``rows x tokens`` shape, the median
milliseconds of one forward feeding ``tokens`` tokens to each of ``rows`` rows through the
model's modules and directly (``DirectForward``), the two taking turns within every repetition,
so a change of the machine's load skews neither; whether their logits are equal bit for bit and
whether their top tokens agree; and what the one-time decision (``DirectForward._verdict``) says on
this machine. Shapes over ``packed.MAX_ROWS`` rows run the model's own forward either way (a control).

Results: ``benchmarks/results/direct_forward/{rows.json,report.md}``.
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
from specdec.engines.forwards.direct import DirectForward
from specdec.engines.forwards.packed import MAX_ROWS, PackedLinears
from specdec.kv import CacheSettings, make_kv
from specdec.model_plan import plan_of
from specdec.modelinfo import cache_argument
from specdec.threads import configure_threads

OUT = Path(__file__).parent / "results" / "direct_forward"


def measure(model, shapes: list[tuple[int, int]], context: int, reps: int) -> dict:
    """{"rows x tokens": {own, direct: median ms, equal: bool, same_top: bool}}."""
    gen = torch.Generator().manual_seed(0)
    widest = max(tokens for _, tokens in shapes)
    ids = torch.randint(100, 5000, (max(rows for rows, _ in shapes), context + widest), generator=gen)
    cache_kwarg = cache_argument(model)
    direct = DirectForward.pin(model, True)
    if direct is None:
        raise SystemExit("the direct forward does not reproduce this model's logits here")
    PackedLinears.pin(model, True)
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

            forward(0, context)
            times, logits = {"own": [], "direct": []}, {}
            for rep in range(reps + 1):  # the first repetition warms up (and packs)
                for name in ("own", "direct") if rep % 2 else ("direct", "own"):
                    plan_of(model).direct = direct if name == "direct" else None
                    started = time.perf_counter()
                    logits[name] = forward(context, tokens)
                    if rep:
                        times[name].append(1000 * (time.perf_counter() - started))
            kv.release()
            out[f"{rows}x{tokens}"] = {**{name: statistics.median(t) for name, t in times.items()},
                                       "equal": bool(torch.equal(logits["own"], logits["direct"])),
                                       "same_top": bool(torch.equal(logits["own"].argmax(-1), logits["direct"].argmax(-1)))}
            r = out[f"{rows}x{tokens}"]
            print(f"  {rows} x {tokens}: own {r['own']:.1f} ms, direct {r['direct']:.1f} ms "
                  f"({r['own'] / r['direct']:.2f}x), logits {'equal' if r['equal'] else 'differ'}, "
                  f"top tokens {'same' if r['same_top'] else 'DIFFER'}", flush=True)
    PackedLinears.forget(model)
    DirectForward.forget(model)
    return {"shapes": out, "decision": {"use": all(direct._verdict(model))}}


def report(result: dict, meta: dict) -> None:
    lines = ["# The target's forward: through its modules and direct", "",
             f"{meta['machine']}; torch {meta['torch']}, transformers {meta['transformers']}; {meta['threads']} "
             f"threads; SmolLM2-135M fp32; cached context {meta['context']} tokens a row; median of {meta['reps']} "
             "(variants taking turns); packed products on in both. Reproduce: `python benchmarks/direct_forward.py`.",
             "", f"The direct forward serves up to {MAX_ROWS} rows (tokens x batch rows); more run the model's own "
             "either way (controls). This machine's one-time decision: "
             f"{'use it' if result['decision']['use'] else 'do not use it'} (one-token steps timed).", "",
             "| rows x tokens | fed | own | direct | own / direct | logits | top tokens |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for shape, r in result["shapes"].items():
        rows, tokens = map(int, shape.split("x"))
        lines.append(f"| {shape} | {rows * tokens} | {r['own']:.1f} ms | {r['direct']:.1f} ms | "
                     f"{r['own'] / r['direct']:.2f}x | {'equal' if r['equal'] else 'differ'} | "
                     f"{'same' if r['same_top'] else 'differ'} |")
    (OUT / "report.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="2")
    parser.add_argument("--shapes", nargs="+", default=["1x1", "1x2", "1x3", "1x4", "1x8", "1x16", "2x2", "4x2",
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
