"""Which kernel each kind of copy's matrix product runs on this CPU, and what one row costs.

    python benchmarks/isa_kernels.py [--threads 2] [--rounds 31] [--out DIR]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        FBGEMM_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/isa_kernels.py --out DIR

A decoding step of SmolLM2-135M is mostly one-row matrix products (a token's activations times
each linear layer's weights). For the layer shapes of that model, this times one row through each
product a draft copy can use, interleaved (every product once a round, the order rotating; the
machine may be shared): fp32 (the target: MKL's sgemm), bfloat16 (oneDNN where the CPU has
bfloat16 instructions, else ATen's own kernel), int8 x uint8 ``torch._int_mm`` (oneDNN's int8
gemm: the w8a8 copy), torch's dynamic int8 layer (fbgemm: ``quantize_dynamic``) and torchao's
int8 weight-only product (``torch._weight_int8pack_mm``: an ATen kernel), each summed over the
model's layers. A child process with ``ONEDNN_VERBOSE=1`` and ``MKL_VERBOSE=1`` records which
implementation oneDNN and MKL picked (e.g. ``brg_matmul:avx10_1_512_amx``, ``gemm_api``,
``SGEMM`` with MKL's code path), so a run under instruction-set caps (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``, ``FBGEMM_ENABLE_INSTRUCTIONS``) shows what
the caps changed. Results: ``DIR/kernels.json`` and ``DIR/kernels.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

#: (rows out, rows in, count per step) of SmolLM2-135M's linear layers: 30 layers of q, k, v, o, gate, up, down, and the head
SHAPES = ((576, 576, 60), (192, 576, 60), (1536, 576, 60), (576, 1536, 30), (49152, 576, 1))


def products() -> dict:
    """{name: [(fn, count)]}: one-row products of each kind, for each layer shape."""
    gen = torch.Generator().manual_seed(0)
    made: dict[str, list] = {"fp32": [], "bf16": [], "int_mm u8s8 (w8a8)": [], "fbgemm dynamic int8": [],
                             "int8 weight-only (torchao's op)": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    for out_f, in_f, count in SHAPES:
        w = torch.randn(out_f, in_f, generator=gen)
        x = torch.randn(1, in_f, generator=gen)
        wb, xb = w.bfloat16(), x.bfloat16()
        q = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, generator=gen)
        a = torch.randint(0, 256, (1, in_f), dtype=torch.uint8, generator=gen)
        qt = q.t()
        dyn = DynamicLinear(in_f, out_f, dtype=torch.qint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dyn.set_weight_bias(torch.quantize_per_channel(w, (w.abs().amax(1) / 127).clamp_min(1e-8),
                                                           torch.zeros(out_f, dtype=torch.long), 0, torch.qint8), None)
        scales = torch.rand(out_f, dtype=torch.bfloat16) + 0.5
        made["fp32"].append((lambda x=x, w=w: torch.nn.functional.linear(x, w), count))
        made["bf16"].append((lambda x=xb, w=wb: torch.nn.functional.linear(x, w), count))
        made["int_mm u8s8 (w8a8)"].append((lambda a=a, qt=qt: torch._int_mm(a, qt), count))
        made["fbgemm dynamic int8"].append((lambda x=x, dyn=dyn: dyn(x), count))
        made["int8 weight-only (torchao's op)"].append(
            (lambda x=xb, q=q, s=scales: torch.ops.aten._weight_int8pack_mm(x, q, s), count))
    return made


def time_step(fns: list, reps: int = 1) -> float:
    """Seconds of one decoding step's products of one kind (each layer shape times its count)."""
    started = time.perf_counter()
    with torch.no_grad():
        for fn, count in fns:
            for _ in range(count * reps):
                fn()
    return (time.perf_counter() - started) / reps


def measure(rounds: int) -> dict:
    made = products()
    for fns in made.values():
        time_step(fns)  # first use: kernel selection, JIT, packing
    times = {name: [] for name in made}
    names = list(made)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(time_step(made[name]))
    return {name: {"ms": 1000 * statistics.median(t), "min_ms": 1000 * min(t)} for name, t in times.items()}


def implementations() -> dict:
    """{product: [what oneDNN / MKL said they ran]}, from a child process with their verbose logs on."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1"}
    code = ("import benchmarks.isa_kernels as k, torch, sys, warnings\n"
            "warnings.filterwarnings('ignore')\n"
            "made = k.products()\n"
            "for name, fns in made.items():\n"
            "    print('@@', name, flush=True); sys.stdout.flush()\n"
            "    fns[0][0]()\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    found: dict[str, list] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("@@ "):
            current = line[3:]
            found[current] = []
        elif current and line.startswith("onednn_verbose") and ",exec," in line:
            fields = line.split(",")
            found[current].append(f"oneDNN {fields[5]} {fields[6]}".strip())
        elif line.startswith("MKL_VERBOSE oneMKL"):
            found.setdefault("MKL code path", []).append(line.split(" for ")[-1][:160])
        elif current and line.startswith("MKL_VERBOSE") and "(" in line:
            found[current].append("MKL " + line.split()[1].split("(")[0])
        elif line.startswith("onednn_verbose") and ",info,cpu,isa:" in line:
            found.setdefault("oneDNN ISA", []).append(line.split("isa:")[-1])
    return found


def main() -> None:
    from specdec import machine

    warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "forward_cost_isa")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = [os.getloadavg()[0]]
    rows = measure(args.rounds)
    load.append(os.getloadavg()[0])
    impl = implementations()
    meta = {"machine": machine.describe(), "cpu_model": machine.cpu_model(), "cpu_capability": machine.cpu_capability(),
            "cpu_flags": machine.cpu_flags(), "isa_caps": machine.isa_caps(), "torch": torch.__version__,
            "threads": args.threads, "rounds": args.rounds, "load_average": load, "cores": os.cpu_count(),
            "command": " ".join(["python benchmarks/isa_kernels.py", *sys.argv[1:]])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps({"meta": meta, "rows": rows, "implementations": impl}, indent=1))
    base, best = rows["fp32"]["ms"], rows["fp32"]["min_ms"]
    caps = ", ".join(f"`{k}={v}`" for k, v in meta["isa_caps"].items()) or "none"
    lines = ["# One-row matrix products of a SmolLM2-135M step, by kind", "",
             f"Machine: {meta['machine']} (torch's CPU capability {meta['cpu_capability']}; caps: {caps}); shared "
             f"(1-minute load average {load[0]:.1f} -> {load[1]:.1f} on {meta['cores']} cores); {args.threads} threads; "
             f"median of {args.rounds} rounds, the kinds taking turns. Command: `{meta['command']}`", "",
             "| product | ms a step (median) | relative to fp32 | fastest | relative | implementation |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        picked = "; ".join(sorted(set(impl.get(name, [])))) or "not oneDNN or MKL (ATen or fbgemm)"
        lines.append(f"| {name} | {r['ms']:.2f} | {r['ms'] / base:.2f} | {r['min_ms']:.2f} | {r['min_ms'] / best:.2f} "
                     f"| {picked} |")
    lines += ["", f"oneDNN's ISA: {', '.join(sorted(set(impl.get('oneDNN ISA', []))))}; MKL's code path: "
              f"{', '.join(sorted(set(impl.get('MKL code path', []))))}"]
    (args.out / "kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
