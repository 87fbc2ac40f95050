"""The target's linear layers with their weights packed once for MKL, in multi-token forwards.

A verification forward feeds a few tokens a row (a batch: a few rows more). On a CPU, torch runs
a float32 ``nn.Linear`` of 4-20 rows as MKL's ``sgemm``, which repacks the whole weight matrix on
every call before multiplying; for one row it runs a matrix-vector product, which does not. So a
several-token forward costs far more than a one-token step, much of it in that repacking. MKL can
pack a matrix once and multiply by it many times (``cblas_sgemm_pack`` / ``cblas_sgemm_compute``,
which torch exposes as ``torch.ops.mkl._mkl_reorder_linear_weight`` and
``torch.ops.mkl._mkl_linear``, the ops its own inductor uses for frozen float32 linear layers)
(the measurements: docs/performance.md, "Packed weights in verification forwards").

:class:`PackedLinears` keeps a packed copy of each float32 ``nn.Linear`` weight of one model on a
CPU, and :func:`packed_linears` routes the layers' calls to it inside specdec's own forwards that
feed :data:`MIN_ROWS` to :data:`MAX_ROWS` rows (tokens x batch rows); a one-token step runs as the
model's own (so plain steps give ``generate``'s numbers bit for bit), and so does a prefill. The
packed copies cost memory (about one to two times the layers' weights), so a model gets them:

* only in a model's second call (a process that calls a model again is expected to keep calling
  it), or once it has run :data:`PACK_AFTER` such forwards, not counting those that time the model
  (:func:`measuring`): a first call pays nothing for packing unless it is long enough to earn it
  back (deciding and packing cost about five such forwards);
* only where they fit: the extra bytes at most :data:`MEMORY_SHARE` of the memory available;
* only where packed products timed faster than the layers' own on this machine (one decoder
  layer's linear layers and the output layer at :data:`TIMED_ROWS` rows, medians, interleaved),
  decided once per model for the process (:meth:`PackedLinears.of`), with the range of rows they
  serve.

The logits differ from the unpacked forward's only in rounding (the same products, summed in
another order), as those of a multi-token verification already differ from one-token steps'.
A layer whose weight is changed in place, or replaced, is packed again before its next use; one
changed through ``.data`` (which torch does not track) before the next call's, where about 64 of
its values, spread over it, differ from those packed.
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import contextmanager

import torch

from ...compiled import flagged, one_time
from ...model_plan import plan_of, planned

#: fewest rows (tokens x batch rows) a forward may feed for the packed products: fewer run as a
#: matrix-vector product or close to one, which packing does not speed up (2-3 rows: slower here)
MIN_ROWS = 4
#: most rows: from about 24 rows on, torch's own product cost what the packed one does here
MAX_ROWS = 20
#: the row counts timed when deciding: the range used starts at the first of the lower two that
#: gains, and ends at MAX_ROWS where the last gains too, else at MIDDLE_ROWS
TIMED_ROWS = (4, 8, 16)
MIDDLE_ROWS = 12
#: eligible forwards after which a model's weights are packed within its first call (deciding and
#: packing cost about five)
PACK_AFTER = 20
#: the packed copies' bytes may take at most this share of the memory available when packing
MEMORY_SHARE = 0.5
#: packed products are used only where they take at most this share of the layers' own time
MIN_GAIN = 0.9
#: the pack's row hint (MKL's packing layout for small row counts; any row count may use it)
HINT_ROWS = 16


_MEASURING = threading.local()  # .on: this thread times forwards (they are no sign of use)


def measuring():
    """A context manager: inside it, this thread's forwards time a model (choosing a copy,
    calibrating the policy's costs), and do not count towards :data:`PACK_AFTER`, so that a first
    call's measuring does not get its model packed within that call."""
    return flagged(_MEASURING, "on")


def available() -> bool:
    """Whether this torch has MKL's packed products (a CPU build with MKL and oneDNN)."""
    return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_linear")


def _eligible(layer: torch.nn.Module) -> bool:
    weight = getattr(layer, "weight", None)
    return (type(layer) is torch.nn.Linear and type(weight) is torch.nn.Parameter and type(weight.data) is torch.Tensor
            and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and (layer.bias is None or layer.bias.dtype == torch.float32))


def memory_available() -> int | None:
    """Bytes of memory available now (Linux ``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _sample(weight: torch.Tensor) -> torch.Tensor:
    """About 64 of ``weight``'s values, spread over it."""
    flat = weight.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // 64)].clone()


class _Packed:
    """One layer's packed weight, with what it was packed from (to notice a changed weight)."""

    __slots__ = ("packed", "source", "version", "sample")

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, HINT_ROWS)
        self.source, self.version, self.sample = weight.data_ptr(), weight._version, _sample(weight)

    def current(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is the one packed (the same storage, changed by no tracked operation)."""
        return self.source == weight.data_ptr() and self.version == weight._version

    def same_values(self, weight: torch.Tensor) -> bool:
        """Whether the sampled values are still the packed ones (a write through ``.data`` bumps no version)."""
        return self.current(weight) and torch.equal(self.sample, _sample(weight))


class PackedLinears:
    """A model's float32 linear layers with packed weights (see the module doc)."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [m for m in model.modules() if _eligible(m)]
        self.forwards = 0  # eligible forwards seen
        self.calls = 0  # decoding calls of the model (SpecDecoder.generate) begun
        self.decided: bool | None = None  # None: not yet; then whether packed products are used
        self.rows = (MIN_ROWS, MAX_ROWS)  # the row counts they serve (measured when deciding)
        self.reason = ""
        self._packed: dict[int, _Packed] = {}

    @classmethod
    def of(cls, model: torch.nn.Module) -> "PackedLinears":
        plan = plan_of(model)
        with plan.lock:
            if plan.packed is None:
                plan.packed = cls(model)
            return plan.packed

    @classmethod
    def pin(cls, model: torch.nn.Module, use: bool) -> "PackedLinears":
        """Decide for ``model`` without waiting or timing (tests, and machines measured offline)."""
        state = cls.of(model)
        state.forwards = PACK_AFTER
        state.decided = bool(use and available() and state.layers)
        state.reason = "pinned"
        return state

    @classmethod
    def calling(cls, model: torch.nn.Module) -> None:
        """A decoding call of ``model`` begins (counted on a CPU only: elsewhere nothing is packed)."""
        weight = next(model.parameters(), None)
        if weight is not None and weight.device.type == "cpu":
            state = cls.of(model)
            state.calls += 1
            state.drop_changed()

    def drop_changed(self) -> None:
        """Forget the packed copies of weights whose values changed untracked since they were packed."""
        for layer in self.layers:
            packed = self._packed.get(id(layer))
            if packed is not None and not packed.same_values(layer.weight):
                del self._packed[id(layer)]

    @classmethod
    def decision(cls, model: torch.nn.Module) -> str | None:
        """What was decided for ``model`` and why, or None before deciding (or with no state)."""
        plan = planned(model)
        state = None if plan is None else plan.packed
        return None if state is None else state.report()

    @classmethod
    def forget(cls, model: torch.nn.Module) -> None:
        plan_of(model).set("packed", None)

    def extra_bytes(self) -> int:
        """What the packed copies are expected to take: twice the weights (MKL pads small ones)."""
        return 2 * sum(layer.weight.numel() * 4 for layer in self.layers)

    def use(self, rows: int) -> bool:
        """Whether a forward feeding ``rows`` rows runs the packed products (counting it, and
        deciding once enough have run)."""
        if not (self.rows[0] <= rows <= self.rows[1]) or not self.layers:
            return False
        if self.decided is None:
            if getattr(_MEASURING, "on", False):
                return False
            self.forwards += 1
            if self.forwards < PACK_AFTER and self.calls < 2:
                return False
            with one_time():  # the step is reported apart, and prices nothing
                self.decided, self.reason = self._decide()
                if self.decided:
                    for layer in self.layers:
                        self.packed_weight(layer)
        return self.decided

    def report(self) -> str | None:
        """What was decided and why (``out.stats.choices["packed_weights"]``), or None before deciding."""
        if self.decided is None:
            return None
        return f"{'used for forwards of %d-%d rows' % self.rows if self.decided else 'not used'}: {self.reason}"

    def _decide(self) -> tuple[bool, str]:
        if not available():
            return False, "this torch has no MKL packed products"
        free = memory_available()
        if free is not None and self.extra_bytes() > MEMORY_SHARE * free:
            return False, f"{self.extra_bytes() / 2**20:.0f} MB of packed weights would not fit ({free / 2**20:.0f} MB available)"
        times = {rows: self._time(rows) for rows in TIMED_ROWS}  # {rows: (packed, own)}
        gains = [rows for rows, (packed, own) in times.items() if packed <= MIN_GAIN * own]
        said = "; ".join(f"{rows} rows {packed * 1e3:.2f} against {own * 1e3:.2f} ms" for rows, (packed, own) in times.items())
        if TIMED_ROWS[1] not in gains:
            return False, f"packed products no faster here ({said})"
        self.rows = (MIN_ROWS if TIMED_ROWS[0] in gains else TIMED_ROWS[1],
                     MAX_ROWS if TIMED_ROWS[2] in gains else MIDDLE_ROWS)
        return True, f"packed products timed faster here ({said})"

    def _time(self, rows: int, reps: int = 3) -> tuple[float, float]:
        """(packed, own) median seconds of one decoder layer's linear layers and the largest one
        on ``rows`` rows."""
        middle = len(self.layers) // 2  # a decoder layer's linear layers come one after another
        probe = self.layers[middle: middle + 8] + [max(self.layers, key=lambda layer: layer.weight.numel())]
        noise = torch.Generator().manual_seed(0)  # never the global generator a user's seeded sampling reads
        inputs = [torch.randn(rows, layer.in_features, generator=noise) for layer in probe]
        timings: dict[str, list[float]] = {"packed": [], "own": []}
        with torch.no_grad():
            for r in range(reps + 1):
                for name in ("packed", "own") if r % 2 else ("own", "packed"):
                    started = time.perf_counter()
                    for layer, x in zip(probe, inputs):
                        self.product(layer, x) if name == "packed" else torch.nn.functional.linear(x, layer.weight,
                                                                                                   layer.bias)
                    if r:  # the first round packs the probe's layers and warms up
                        timings[name].append(time.perf_counter() - started)
        return statistics.median(timings["packed"]), statistics.median(timings["own"])

    def packed_weight(self, layer: torch.nn.Linear) -> torch.Tensor:
        """``layer``'s packed weight (packed now where it is not, or is stale)."""
        weight = layer.weight
        packed = self._packed.get(id(layer))
        if packed is None or not packed.current(weight):
            packed = self._packed[id(layer)] = _Packed(weight.detach())
        return packed.packed

    def product(self, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)`` through its packed weight."""
        packed = self.packed_weight(layer)
        rows = x.numel() // x.shape[-1]
        return torch.ops.mkl._mkl_linear(x if x.is_contiguous() else x.contiguous(), packed, layer.weight, layer.bias,
                                         rows)


@contextmanager
def packed_linears(model: torch.nn.Module, rows: int, device: torch.device):
    """Inside the block, ``model``'s float32 linear layers multiply through their packed weights,
    where a forward feeding ``rows`` rows on ``device`` should (:meth:`PackedLinears.use`); as the
    model's own afterwards. Yields whether they do."""
    if device.type != "cpu" or not (MIN_ROWS <= rows <= MAX_ROWS) or torch.compiler.is_compiling():
        yield False
        return
    state = PackedLinears.of(model)
    if not state.use(rows):
        yield False
        return
    for layer in state.layers:
        object.__setattr__(layer, "forward", _PackedForward(state, layer))
    try:
        yield True
    finally:
        for layer in state.layers:
            layer.__dict__.pop("forward", None)


class _PackedForward:
    """A layer's forward through :meth:`PackedLinears.product` (rows outside the range: its own)."""

    __slots__ = ("state", "layer")

    def __init__(self, state: PackedLinears, layer: torch.nn.Linear):
        self.state, self.layer = state, layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        low, high = self.state.rows
        if x.dtype != torch.float32 or x.device.type != "cpu" or not (low <= x.numel() // max(x.shape[-1], 1) <= high):
            return torch.nn.functional.linear(x, layer.weight, layer.bias)
        return self.state.product(layer, x)
