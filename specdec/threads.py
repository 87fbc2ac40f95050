"""The number of intra-op threads for the command line and the benchmarks.

On a machine whose cores are shared, a torch thread whose core is busy with another process
stalls every operation of the others (they wait for it at each barrier; measured in
docs/performance.md, "Threads on a shared machine").
``auto`` therefore counts the cores that are idle right now (from ``/proc/stat`` over a short
window) and uses that many threads, at least one; elsewhere it uses torch's own default.
"""

from __future__ import annotations

import os
import time

import torch

#: how long ``idle_cores`` watches the processor counters
SAMPLE_SECONDS = 0.2
#: a core counts as idle when at least this share of the window was idle
IDLE_SHARE = 0.6


def _cpu_times() -> dict[str, tuple[int, int]]:
    """Per core: (idle jiffies, total jiffies) from /proc/stat."""
    times = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                values = [int(v) for v in fields]
                times[name] = (values[3] + (values[4] if len(values) > 4 else 0), sum(values))
    return times


def idle_cores(window: float = SAMPLE_SECONDS) -> int | None:
    """Cores of this process's affinity set that were mostly idle over ``window`` seconds, or
    None where that cannot be read (no /proc/stat)."""
    try:
        before = _cpu_times()
        time.sleep(window)
        after = _cpu_times()
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    except OSError:
        return None
    idle = 0
    for name, (idle_after, total_after) in after.items():
        if allowed is not None and int(name[3:]) not in allowed:
            continue
        idle_before, total_before = before.get(name, (idle_after, total_after))
        elapsed = total_after - total_before
        if elapsed > 0 and (idle_after - idle_before) / elapsed >= IDLE_SHARE:
            idle += 1
    return idle


def configure_threads(setting: str | int | None = "auto") -> int:
    """Set torch's intra-op threads: an int (or its string), or ``auto`` (the idle cores, at least
    one; torch's default where idleness cannot be read). Returns the number set."""
    if setting in (None, "auto"):
        free = idle_cores()
        threads = torch.get_num_threads() if free is None else max(1, free)
    else:
        threads = int(setting)
        if threads < 1:
            raise ValueError(f"threads must be >= 1 or 'auto', got {setting!r}")
    torch.set_num_threads(threads)
    return threads
