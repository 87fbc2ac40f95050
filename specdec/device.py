"""Timing device work: waiting for a device, and timing a stretch of its work without waiting.

Work on a CUDA device runs asynchronously, so a forward's time is only known once the device
has finished it; elsewhere (a CPU) the call returns when the work is done. The cost model's
calibration waits (:func:`synchronize`); a decoding step does not: :class:`DeviceTimer` records
CUDA events around the target's forward and reads them after the step's one read of the device,
which has waited for the forward anyway.
"""

from __future__ import annotations

import time

import torch


def device_type(device) -> str:
    """``device``'s type ("cpu", "cuda", ...), with no ``torch.device`` built for one that is already."""
    return device.type if isinstance(device, torch.device) else torch.device(device).type


def synchronize(device) -> None:
    """Block until ``device`` has finished the work queued on it (CUDA only)."""
    if device_type(device) == "cuda":
        torch.cuda.synchronize(device)


class DeviceTimer:
    """The seconds of one stretch of work on ``device``, timed without waiting for it: on CUDA
    between two events recorded on its stream, elsewhere by the host's clock (the work is done
    when the calls return)."""

    def __init__(self, device):
        self.device, self.cuda = device, device_type(device) == "cuda"
        self._marks: list = [0.0, 0.0]

    def begin(self, now: float) -> None:
        """The stretch begins (``now``: the host's ``time.perf_counter()`` there, read by the caller)."""
        self._marks[0] = self._event() if self.cuda else now

    def end(self) -> None:
        self._marks[1] = self._event() if self.cuda else time.perf_counter()

    def seconds(self) -> float:
        """The stretch's seconds; on CUDA waits for its end (already reached once its results were read)."""
        first, last = self._marks
        if self.cuda:
            last.synchronize()
            return first.elapsed_time(last) / 1e3
        return last - first

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the stream the forward runs on, whichever GPU is current
        return event
