"""What scripting the CPU engine's decoder stack buys: ``LlamaStack`` scripted against run as Python.

    python benchmarks/stack_script.py [--threads 1] [--context 128] [--reps 41]

SmolLM2-135M: the fp32 target's one-token step through ``DirectForward`` (``"float"`` linears,
specdec's dynamic cache) and its w8a8 and int4 draft copies' one-token steps through
``LeanForward`` (``"int8"`` / ``"int4"`` linears, a static cache), each behind ``--context``
cached tokens, with the stack's function scripted by TorchScript and as plain Python, and the
model's own forward as the reference. The variants of a model take turns within every
repetition, so a change of the machine's load skews none of them; medians in milliseconds, and
the Python stack's time over the scripted one's. The logits of the two stacks are compared too
(TorchScript fuses nothing here, so they should be equal bit for bit).

A token tree's verifying forward too (the pending token and six nodes in two branches, behind
the same context): through the CPU engine (the stack with the tree's mask) against the eager
engine (the model's own forward with a 4-D additive mask), and the largest difference of their
logits.

Results: ``benchmarks/results/stack_script/threads<N>/{rows.json,report.md}``.
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
from transformers import StaticCache

from specdec import load_model, machine
from specdec.engines import Layout, make_engine
from specdec.engines.forwards import stack
from specdec.engines.forwards.direct import DirectForward
from specdec.engines.forwards.lean import LeanForward
from specdec.engines.forwards.lowbit import build_copy
from specdec.kv import new_dynamic_cache
from specdec.modelinfo import cache_argument
from specdec.threads import configure_threads

OUT = Path(__file__).parent / "results" / "stack_script"


def target_steps(model, context: int):
    """{variant: one-token step function} of the fp32 target, and a reset between steps."""
    ids = torch.randint(100, 5000, (1, context + 1), generator=torch.Generator().manual_seed(0))
    caches = {}
    scripted, python = DirectForward(model), DirectForward(model)
    python.stack.function = stack.decoder_layers
    head = model.get_output_embeddings()
    key = cache_argument(model)

    def run(name):
        cache = caches[name]
        kwargs = {"input_ids": ids[:, context:], "position_ids": torch.tensor([[context]]), "past_key_values": cache}
        if name == "own":
            out = model.forward(input_ids=kwargs["input_ids"], position_ids=kwargs["position_ids"],
                                **{key: cache}, use_cache=True).logits
        else:
            out = (scripted if name == "scripted" else python)(kwargs, head)
        cache.crop(-1)  # the step's token removed
        return out

    with torch.inference_mode():
        for name in ("own", "scripted", "python"):
            caches[name] = new_dynamic_cache()
            model.forward(input_ids=ids[:, :context], **{key: caches[name]}, use_cache=True)
    return {name: (lambda name=name: run(name)) for name in ("own", "scripted", "python")}


def copy_steps(copy, context: int):
    """{variant: one-token step function} of a draft copy on a static cache."""
    lean = copy.forward
    assert isinstance(lean, LeanForward), "the copy has no lean forward here"
    python = LeanForward(copy, script=False)
    ids = torch.randint(100, 5000, (1, context + 1), generator=torch.Generator().manual_seed(0))
    caches = {}
    key = cache_argument(copy)

    def run(name):
        cache = caches[name]
        step_ids, positions = ids[:, context:], torch.tensor([[context]])
        if name == "own":
            out = lean.own(input_ids=step_ids, position_ids=positions, **{key: cache}, use_cache=True).logits
        else:
            out = (lean if name == "scripted" else python)._forward(cache, step_ids, positions, None, 0)
        for layer in cache.layers:
            layer.cumulative_length.fill_(context)
        return out

    with torch.inference_mode():
        for name in ("own", "scripted", "python"):
            caches[name] = StaticCache(config=copy.config, max_cache_len=context + 8)
            lean.own(input_ids=ids[:, :context], position_ids=torch.arange(context)[None], **{key: caches[name]},
                     use_cache=True)
    return {name: (lambda name=name: run(name)) for name in ("own", "scripted", "python")}


def tree_steps(model, context: int):
    """{engine: one tree forward} of the fp32 target: the pending token and six nodes after ``context``."""
    ids = torch.randint(100, 5000, (1, context + 7), generator=torch.Generator().manual_seed(1))
    layout = Layout.tree(torch.tensor([[-1, 0, 1, -1, 3, 0]]), start=torch.ones(1, dtype=torch.long))
    positions = context + layout.chain_columns(7, 1)
    caches, engines = {}, {"cpu": make_engine("cpu", model), "eager": make_engine("eager", model)}
    key = cache_argument(model)

    def run(name):
        out = engines[name].forward(ids[:, context:], positions, layout=layout, cache=caches[name]).logits
        caches[name].crop(-7)
        return out

    with torch.inference_mode():
        for name in engines:
            caches[name] = new_dynamic_cache()
            model.forward(input_ids=ids[:, :context], **{key: caches[name]}, use_cache=True)
    assert engines["cpu"].serves_trees(caches["cpu"]), "the stack does not serve this model's trees here"
    return {name: (lambda name=name: run(name)) for name in engines}


def timed_trees(steps: dict, reps: int) -> dict:
    seconds = {name: [] for name in steps}
    with torch.inference_mode():
        outputs = {name: [step() for _ in range(3)][-1] for name, step in steps.items()}
        for rep in range(reps):
            for name in (list(steps) if rep % 2 else list(reversed(steps))):
                started = time.perf_counter()
                steps[name]()
                seconds[name].append(time.perf_counter() - started)
    row = {f"{name}_ms": round(1000 * statistics.median(s), 3) for name, s in seconds.items()}
    row["eager_over_cpu"] = round(row["eager_ms"] / row["cpu_ms"], 3)
    row["max_logit_difference"] = float((outputs["cpu"].float() - outputs["eager"].float()).abs().max())
    return row


def timed(steps: dict, reps: int) -> dict:
    seconds = {name: [] for name in steps}
    outputs = {}
    with torch.inference_mode():
        for name, step in steps.items():  # warm: the scripted function's first run, the allocator
            for _ in range(3):
                outputs[name] = step()
        for rep in range(reps):
            order = list(steps) if rep % 2 else list(reversed(steps))
            for name in order:
                started = time.perf_counter()
                steps[name]()
                seconds[name].append(time.perf_counter() - started)
    row = {f"{name}_ms": round(1000 * statistics.median(s), 3) for name, s in seconds.items()}
    row["python_over_scripted"] = round(row["python_ms"] / row["scripted_ms"], 3)
    row["scripted_over_own"] = round(row["scripted_ms"] / row["own_ms"], 3)
    row["equal_logits"] = bool(torch.equal(outputs["scripted"], outputs["python"]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--reps", type=int, default=41)
    args = parser.parse_args()
    configure_threads(args.threads)
    target, _ = load_model("smollm2-135m")
    target.eval()
    rows = {"target fp32": timed(target_steps(target, args.context), args.reps)}
    trees = timed_trees(tree_steps(target, args.context), args.reps)
    for weights in ("w8a8", "int4"):
        try:
            copy = build_copy(target, weights)
        except (RuntimeError, ValueError, ImportError) as exc:  # int4 needs its kernel on this torch/CPU
            rows[f"copy {weights}"] = {"skipped": f"{type(exc).__name__}: {exc}"}
            continue
        rows[f"copy {weights}"] = timed(copy_steps(copy, args.context), args.reps)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    meta = {"machine": machine.describe(), "capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "transformers": transformers.__version__, "threads": args.threads,
            "context": args.context, "reps": args.reps, "specdec_commit": commit}
    out = OUT / f"threads{args.threads}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps({"meta": meta, "rows": rows, "trees": trees}, indent=1) + "\n")
    lines = [f"# The stack scripted against run as Python ({meta['machine']}, capability {meta['capability']}, "
             f"{args.threads} thread(s), torch {meta['torch']}, specdec {commit})", "",
             f"One-token steps behind {args.context} cached tokens, medians of {args.reps} taking turns (ms).", "",
             "| model | own forward | stack scripted | stack as Python | Python / scripted | scripted / own "
             "| same logits |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} | | | | | |")
            continue
        lines.append(f"| {name} | {row['own_ms']:.2f} | {row['scripted_ms']:.2f} | {row['python_ms']:.2f} | "
                     f"{row['python_over_scripted']:.2f}x | {row['scripted_over_own']:.2f} | {row['equal_logits']} |")
    lines += ["", "A tree's verifying forward (the pending token and six nodes, the fp32 target), ms:", "",
              "| CPU engine (the stack) | eager engine | eager / CPU | largest logit difference |",
              "| --- | --- | --- | --- |",
              f"| {trees['cpu_ms']:.2f} | {trees['eager_ms']:.2f} | {trees['eager_over_cpu']:.2f}x | "
              f"{trees['max_logit_difference']:.2g} |"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
