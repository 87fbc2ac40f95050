"""Waiting for a device: the one thing a timer needs before it reads the clock.

Work on a CUDA device runs asynchronously, so a forward's time is only known once the device
has finished it; elsewhere (a CPU) the call returns when the work is done and this is a no-op.
Used by the run (the target's verification forward) and by the cost model's calibration.
"""

from __future__ import annotations

import torch


def device_type(device) -> str:
    """``device``'s type ("cpu", "cuda", ...), with no ``torch.device`` built for one that is already."""
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def synchronize(device) -> None:
    """Block until ``device`` has finished the work queued on it (CUDA only)."""
    if device_type(device) == "cuda":
        torch.cuda.synchronize(device)
