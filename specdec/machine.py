"""The CPU a figure was measured on: its model name and the instruction-set level torch's kernels use.

Decoding speed on a CPU depends on both (an int8 product that is cheap with AMX can cost more than
the fp32 one on a CPU with AVX2 only), so every benchmark result records them beside its figures.
"""

from __future__ import annotations

import os
import platform

import torch


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_capability() -> str:
    """torch's CPU kernel level (``torch.backends.cpu.get_cpu_capability()``: e.g. AVX2, AVX512,
    or AMX-capable ones), which ``ATEN_CPU_CAPABILITY`` can lower."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_flags(names: tuple[str, ...] = ("avx2", "avx512f", "avx512_vnni", "amx_int8", "amx_bf16")) -> list[str]:
    """Which of ``names`` the CPU reports (``/proc/cpuinfo`` flags on Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [n for n in names if n in have]
    except OSError:
        pass
    return []


#: environment variables that cap the instruction set a CPU kernel library uses: ATen's own kernels
#: and inductor's generated code, oneDNN (``torch._int_mm``, bfloat16 products), MKL (float32
#: products), fbgemm (``quantize_dynamic``'s layers). Set, they make a CPU run code meant for a
#: lesser one (docs/performance.md, "Emulating another CPU").
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
           "FBGEMM_ENABLE_INSTRUCTIONS")


def isa_caps() -> dict[str, str]:
    """The :data:`ISA_ENV` variables that are set, with their values."""
    return {name: os.environ[name] for name in ISA_ENV if os.environ.get(name)}


def fast_int8_products() -> bool:
    """Whether the CPU has int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX) that oneDNN's
    int8 products may use: without them (an AVX2-only CPU, or oneDNN capped below them by
    ``ONEDNN_MAX_CPU_ISA``) an int8 x uint8 product costs more than the fp32 one it replaces (and
    saturates its 16-bit pair sums)."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if cap in ("SSE41", "AVX", "AVX2", "AVX512_CORE"):  # oneDNN's levels below int8 dot products
        return False
    return bool(cpu_flags(("avx512_vnni", "avx_vnni", "amx_int8")))


def describe() -> str:
    """One line naming the CPU, e.g. ``Intel(R) Xeon(R) Processor (AVX512; amx_int8)``, and any
    instruction-set caps set in the environment (``...; ONEDNN_MAX_CPU_ISA=AVX2``)."""
    flags = [f for f in cpu_flags() if f.startswith("amx")]
    caps = [f"{k}={v}" for k, v in isa_caps().items()]
    extra = "".join(f"; {', '.join(part)}" for part in (flags, caps) if part)
    return f"{cpu_model()} ({cpu_capability()}{extra})"
