"""The cost of one forward as a function of its width, per cache kind and weight precision.

    python benchmarks/forward_cost.py [--threads 2] [--widths 1 2 4 8 16] [--variants ...]

For the packaged SmolLM2-135M-Instruct (fp32 target) and the copies ``self_draft`` builds
(bfloat16, int8 weight-only, w8a8), on a cached context of ``--context`` tokens: the median milliseconds of one
forward feeding ``w`` new tokens (logits for each, as verification needs), through the same
cache backends ``SpecDecoder`` uses (``specdec.kv``), with compile time measured apart. Variants:

* ``fp32-dynamic``: the default path (``DynamicCache``, eager);
* ``fp32-static``, ``fp32-static-compiled``: ``cache_implementation="static"`` without / with
  ``compile=True``;
* ``bf16-*``, ``int8-*``, ``w8a8-*``: the draft copies ``self_draft`` builds
  (``specdec.forwards.lowbit.build_copy``), eager (dynamic cache) and compiled.

Results: ``benchmarks/results/forward_cost/{rows.json,report.md,forward_cost.png}``, written
after each variant (an interrupted run keeps what it measured).
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
from specdec.kv import CacheSettings, make_kv
from specdec.modelinfo import cache_argument
from specdec.threads import configure_threads

VARIANTS = ("fp32-dynamic", "fp32-static", "fp32-static-compiled", "bf16-dynamic", "bf16-static-compiled",
            "int8-dynamic", "int8-static-compiled", "w8a8-dynamic", "w8a8-static-compiled")
OUT = Path(__file__).parent / "results" / "forward_cost"


def model_for(variant: str, target):
    from specdec.forwards.lowbit import build_copy

    weights = variant.split("-")[0]
    return target if weights == "fp32" else build_copy(target, {"bf16": "bfloat16"}.get(weights, weights))


def settings_for(variant: str) -> CacheSettings:
    if variant.endswith("static-compiled"):
        return CacheSettings.make("static", True)
    return CacheSettings.make("static" if variant.endswith("static") else "dynamic")


def measure(model, cache: CacheSettings, widths: list[int], context: int, reps: int) -> dict:
    """Median ms per forward at each width (and the seconds of the first call at each: compile)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 5000, (1, context + max(widths)), generator=gen)
    kv = make_kv(model, 1, context + max(widths) + 1, cache)
    cache_kwarg = cache_argument(model)

    def forward(start: int, width: int, first: bool) -> None:
        fed = kv.padded_width(width, first)
        chunk = ids[:, start: start + fed]
        kwargs = {"input_ids": chunk, "position_ids": torch.arange(start, start + fed)[None, :],
                  cache_kwarg: kv.cache, "use_cache": True, "logits_to_keep": 1 if first else width}
        mask = lambda slots: (torch.arange(slots) < start + width).long()[None, :]  # noqa: E731
        kv.forward(model, kwargs, first_slot=start, width=width, first=first, mask=mask, needs_mask=False,
                   direct=True)

    result = {}
    with torch.no_grad():
        forward(0, context, True)
        for width in widths:
            started = time.perf_counter()
            forward(context, width, False)
            first_call = time.perf_counter() - started
            kv.crop(context + width, context)
            times = []
            for _ in range(reps):
                started = time.perf_counter()
                forward(context, width, False)
                times.append(time.perf_counter() - started)
                kv.crop(context + width, context)
            result[width] = {"ms": 1000 * statistics.median(times), "first_call_s": first_call}
            print(f"  width {width:2d}: {result[width]['ms']:.1f} ms (first call {first_call:.1f} s)", flush=True)
    kv.release()
    return result


def report(rows: dict, meta: dict) -> None:
    widths = sorted({int(w) for r in rows.values() for w in r})
    base = rows.get("fp32-dynamic", {}).get(widths[0], {}).get("ms")
    lines = ["# Forward cost by width", "", f"{meta['machine']}; torch {meta['torch']}, transformers "
             f"{meta['transformers']}; {meta['threads']} threads; SmolLM2-135M-Instruct; cached context "
             f"{meta['context']} tokens; median of {meta['reps']} forwards.", "",
             "Milliseconds per forward (in parentheses: relative to one fp32 dynamic one-token forward).", "",
             "| variant | " + " | ".join(f"w={w}" for w in widths) + " | first call at w=1 (s) |",
             "|---" * (len(widths) + 2) + "|"]
    for name, r in rows.items():
        cells = [f"{r[w]['ms']:.1f} ({r[w]['ms'] / base:.2f})" if w in r and base else "-" for w in widths]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r[widths[0]]['first_call_s']:.1f} |")
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in rows.items():
        ws = sorted(r)
        ax.plot(ws, [r[w]["ms"] for w in ws], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens fed by one forward")
    ax.set_ylabel("ms per forward")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "forward_cost.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="2")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                        help="forward widths (each compiles once per compiled variant: about a minute on 2 cores)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    threads = configure_threads(args.threads)
    target, _ = load_model("smollm2-135m")
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": threads, "context": args.context, "reps": args.reps}
    rows_path = OUT / "rows.json"
    rows = {}
    for variant in args.variants:
        print(variant, flush=True)
        rows[variant] = measure(model_for(variant, target), settings_for(variant), args.widths, args.context,
                                args.reps)
        rows_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        report(rows, meta)


if __name__ == "__main__":
    main()
