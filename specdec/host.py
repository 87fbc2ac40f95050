"""Host values of a step's small integer tensors: read from the device at most once, or never.

A step's bookkeeping (each row's length, its room, the drafts offered and accepted, the stop
checks, the statistics) is made of small integer tensors the loop also needs as Python numbers.
On a GPU every such read (``int()``, ``bool()``, ``tolist()``) waits for the device, so a step
reads the device once, after verification (the accepted counts and the committed block,
:func:`read_rows`), and computes every other number from values it already holds:

* :func:`host_ints` gives a tensor's values as Python ints: the ones attached to it when it was
  made from host values, else one read, attached for the next reader;
* :func:`hosted` attaches values computed on the host to the tensor they describe, and
  :func:`host_long` makes a tensor from host values with them attached.

Only tensors that are never written in place may carry values (a state's ``lengths`` and
``offsets`` are replaced, never edited; so are a step's counts). With :data:`CHECK` set (the test
suite sets it) every attached value is compared with the tensor when read.
"""

from __future__ import annotations

import os
from array import array

import torch

from .device import device_type

__all__ = ["CHECK", "host_ints", "host_long", "hosted", "read_rows"]

#: compare attached values with the tensor whenever they are read (a read each time: for tests)
CHECK = os.environ.get("SPECDEC_CHECK_HOST", "") not in ("", "0")

_ATTR = "_specdec_host"


def host_ints(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``, read from the device only if no values were attached (then attached)."""
    values = getattr(tensor, _ATTR, None)
    if values is None:
        values = tensor.tolist()
        setattr(tensor, _ATTR, values)
    elif CHECK and values != tensor.tolist():
        raise AssertionError(f"host values {values} attached to a tensor that holds {tensor.tolist()}")
    return values


def hosted(tensor: torch.Tensor, values: list) -> torch.Tensor:
    """``tensor`` with ``values`` (what its ``tolist()`` gives) attached; the caller keeps ``values`` as they are."""
    setattr(tensor, _ATTR, values)
    return tensor


def host_long(values: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """A 1-D int64 tensor of ``values`` on ``device``, carrying them (:func:`host_ints` reads
    nothing): made through a buffer the tensor keeps alive, a third of ``torch.tensor``'s cost."""
    out = torch.frombuffer(array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)
    kind = device_type(device)
    if kind == "cuda":  # queued behind the device's work from pinned memory, as a plain copy would wait for it
        out = out.pin_memory().to(device, non_blocking=True)
    elif kind != "cpu":
        out = out.to(device)
    return hosted(out, values)


def read_rows(*tensors: torch.Tensor) -> list[list[int]]:
    """Each of ``tensors`` ([B] or [B, n] integer, on one device) as host values, in one read of
    the device; each then carries its values."""
    columns = [t[:, None] if t.dim() == 1 else t for t in tensors]
    rows = (columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)).tolist()  # [B][sum n]
    out, at = [], 0
    for tensor, part in zip(tensors, columns):
        width = part.shape[1]
        values = [row[at] for row in rows] if tensor.dim() == 1 else [row[at: at + width] for row in rows]
        out.append(values)
        hosted(tensor, values)
        at += width
    return out
