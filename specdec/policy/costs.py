"""What a target forward costs: a table of measured seconds by tokens fed and context.

:class:`CostModel` gives the seconds of one forward of a model as a function of the tokens it
feeds (width x batch) and of the tokens it attends to (its context). One is kept per (model,
device, dtype, cache kind, fast output layer or not) for the process: :func:`calibrate` times a
short series of forwards after a short context the first time (on throwaway caches: the user's
model is only read), then every forward the loop runs corrects it, by a load factor that moves
every width at once (a busier machine makes a draft no cheaper) and, more slowly, by a shape
correction of the widths and contexts near the one observed; the longer contexts' rows learn
from it how the cost grows with the context, their one-token cost included.

Invariants: a wider forward is never predicted cheaper than a narrower one at the same context;
one observation moves the table by at most a clipped factor, so a forward slowed by another
process does little harm; a model with ``rate=0`` (the fixed curve used under sampling) never
moves. Why each piece is there, and how the numbers look on one machine: docs/draft_length.md.
"""

from __future__ import annotations

import bisect
import itertools
import time

import torch

from ..compiled import say
from ..device import synchronize
from ..distributed import sharding
from ..engines import measuring
from ..kv import CacheSettings, make_kv
from ..model_plan import plan_of
from ..modelinfo import cache_argument

#: token counts at which a forward's cost is tracked
COST_GRID = (1, 2, 4, 8, 16, 32, 64)
#: the counts timed by the first calibration after a short context (the others are interpolated,
#: and past the last extrapolated, until observed); the small ones matter most: the first drafts'
#: cost decides whether drafting pays at all, and one token to two is the dearest step of the curve
CALIBRATED = (1, 2, 4, 16)
#: context lengths (tokens already cached) at which costs are tracked: on a CPU a forward of
#: several tokens costs more over a long context (docs/draft_length.md, "Its inputs")
CONTEXT_GRID = (32, 512, 2048)
#: seconds after which calibrating stops at the end of a round and keeps the rounds timed so far (at
#: least one): on a quiet 2-core CPU all three rounds take under a second; on a busy machine, or
#: where the first forwards compile, a round can take minutes, and a first call must not stall
#: for them (what it spends is reported as ``AcceptanceStats.calibration_seconds``)
CALIBRATION_BUDGET = 10.0
#: extra cost of each further token fed, in one-token forwards, by device kind: the fixed curve
#: used where decisions must not depend on timings (sampling, so that a seeded call reproduces);
#: chosen from the curves measured on each kind (docs/draft_length.md, "Sampling")
FIXED_SLOPE = {"cpu": 1 / 8, "cuda": 0.28 / 31}
#: how far one observed forward moves the cost model: the machine's load (one factor for the whole
#: curve, so a slower machine makes every width slower) and the curve's shape near that point
LOAD_RATE, SHAPE_RATE = 0.05, 0.05


def _bracket(grid: list[float], x: float) -> tuple[int, int, float]:
    """(lo, hi, weight of hi) of ``x`` in the ascending ``grid``: clamped below its first point,
    the last segment past its last point (weight above 1)."""
    if len(grid) == 1:
        return 0, 0, 0.0
    x = max(x, grid[0])
    hi = min(max(bisect.bisect_left(grid, x), 1), len(grid) - 1)
    return hi - 1, hi, (x - grid[hi - 1]) / (grid[hi] - grid[hi - 1])


class CostModel:
    """Seconds of one forward of a model as a function of the tokens it feeds (width x batch) and
    of its context (tokens already cached).

    ``seconds [C, G]``: one curve per ``contexts`` point (one row: the same at every context),
    piecewise linear through ``COST_GRID`` (linear past its last point), linear between contexts
    (constant past the ends). Each observed forward moves the whole model by a load factor and the
    points around it (one token excepted) by a shape correction: the model follows the machine's
    load at every width, also widths the loop seldom runs, and learns its shape relative to the
    one-token step over time. Plain Python numbers inside: the loop asks it twice per step.
    """

    def __init__(self, seconds: list, rate: float = SHAPE_RATE, contexts: tuple[int, ...] = (0,),
                 anchored: tuple[int, ...] | None = None):
        table = torch.tensor(seconds, dtype=torch.float64)
        table = table[None, :] if table.dim() == 1 else table
        if table.shape != (len(contexts), len(COST_GRID)):
            raise ValueError(f"seconds must be [{len(contexts)}, {len(COST_GRID)}], got {list(table.shape)}")
        self.table: list[list[float]] = table.tolist()  # [C][G]
        self.grid = [float(x) for x in COST_GRID]
        self.contexts = [float(c) for c in contexts]
        self.load = 1.0  # the machine's load relative to the table
        self.rate = rate  # 0: a fixed model that observations do not move
        # rows (by index) whose one-token cost was measured: the load alone moves it there; the
        # other rows learn theirs from what they observe (how the cost grows with the context)
        self.anchored = set(range(len(contexts)) if anchored is None else anchored)

    @property
    def seconds(self) -> torch.Tensor:
        """[C, G] the table (without the load factor)."""
        return torch.tensor(self.table, dtype=torch.float64)

    @classmethod
    def fixed(cls, device_type: str) -> "CostModel":
        """The timing-free curve of ``FIXED_SLOPE`` (unit: one one-token forward)."""
        slope = FIXED_SLOPE.get(device_type, FIXED_SLOPE["cpu"])
        return cls([1.0 + (x - 1) * slope for x in COST_GRID], rate=0.0)

    @classmethod
    def from_timings(cls, counts: list[int], seconds: list[float]) -> "CostModel":
        """A model from forwards timed after a short context: ``seconds[i]`` for ``counts[i]``
        tokens (ascending, 1 first); the grid's other counts interpolated, and past the last
        extrapolated, until observed. Every ``CONTEXT_GRID`` row starts as that curve; how the
        cost grows with the context is learnt from the call's own forwards (:meth:`observe`).
        A wider forward is taken to cost at least what a narrower one measured (a noisy round can
        time 16 tokens below 8, and a line through them would give wider forwards negative costs)."""
        short = _on_grid(tuple(counts), list(itertools.accumulate(seconds, max)))
        return cls([short] * len(CONTEXT_GRID), contexts=CONTEXT_GRID, anchored=(0,))

    @classmethod
    def for_model(cls, model, calibrate_with: torch.Tensor, cache: CacheSettings | None = None,
                  slots: int = 0, kv=None) -> tuple["CostModel", float]:
        """The process-wide cost model of ``model`` on its device and dtype, with this cache kind
        (static or dynamic, compiled or not); calibrated on first use with the tokens
        ``calibrate_with [L]`` on a cache of ``slots`` slots (the call's: a static cache's length
        is part of a compiled graph), ``kv`` itself where it serves (the call's cache backend,
        before its first forward). Returns (model, seconds spent calibrating now)."""
        cache = cache or CacheSettings()
        key = _cost_key(model, cache)
        plan = plan_of(model)
        with plan.lock:
            found = plan.costs.get(key)
        if found is not None:
            return found, 0.0
        started = time.perf_counter()
        made = calibrate(model, calibrate_with, cache, slots, kv=kv)
        spent = time.perf_counter() - started
        with plan.lock:
            return plan.costs.setdefault(key, made), spent

    def predict(self, tokens: torch.Tensor | float, context: float = 0.0) -> torch.Tensor:
        """Seconds for forwards feeding ``tokens`` (any shape) after ``context`` cached tokens."""
        x = torch.as_tensor(tokens, dtype=torch.float64)
        return torch.tensor(self.seconds_for(x.reshape(-1).tolist(), context), dtype=torch.float64).reshape(x.shape)

    def seconds_for(self, tokens: list[float], context: float = 0.0) -> list[float]:
        """:meth:`predict` in plain numbers (what the loop prices every step with)."""
        curve = self._curve(float(context))
        out = []
        for t in tokens:
            lo, hi, w = _bracket(self.grid, float(t))
            out.append(curve[lo] + (curve[hi] - curve[lo]) * w)  # linear past the last point too
        return out

    def _curve(self, context: float) -> list[float]:
        """Seconds at each ``COST_GRID`` count after ``context`` cached tokens, never cheaper for more."""
        lo, hi, w = _bracket(self.contexts, context)
        w = min(w, 1.0)  # constant past the last context
        curve, top = [], 0.0
        for a, b in zip(self.table[lo], self.table[hi]):
            top = max(top, (a * (1 - w) + b * w) * self.load)
            curve.append(top)
        return curve

    @classmethod
    def pin(cls, model, costs: "CostModel", cache: CacheSettings | None = None) -> None:
        """Use ``costs`` for ``model`` (on its device and dtype, with this cache kind) from now on,
        e.g. a curve measured offline, or a known one in a test."""
        plan = plan_of(model)
        with plan.lock:
            plan.costs[_cost_key(model, cache or CacheSettings())] = costs

    @classmethod
    def offer(cls, model, costs: "CostModel", cache: CacheSettings | None = None) -> bool:
        """Use ``costs`` for ``model`` with this cache kind where the process has no model for it
        yet (forwards timed elsewhere, e.g. while ``weights="auto"`` chose a copy: the call then
        times none of its own). Returns whether it was taken."""
        plan = plan_of(model)
        with plan.lock:
            return plan.costs.setdefault(_cost_key(model, cache or CacheSettings()), costs) is costs

    def observe(self, tokens: int, seconds: float, context: float = 0.0) -> None:
        """One forward that fed ``tokens`` after ``context`` cached tokens took ``seconds`` (counts
        past the grid are ignored)."""
        x = float(max(tokens, 1))
        if x > COST_GRID[-1] or self.rate == 0.0 or seconds <= 0.0:
            return
        predicted = self.seconds_for([x], context)[0]
        # one forward slowed by another process must not move the model far: the ratio is clipped to 1.5x
        ratio = min(max(seconds / predicted, 1 / 1.5), 1.5)
        self.load *= ratio ** LOAD_RATE
        c_lo, c_hi, c_w = _bracket(self.contexts, float(context))
        c_w = min(c_w, 1.0)
        g_lo, g_hi, g_w = _bracket(self.grid, x)
        for c, cw in ((c_lo, 1 - c_w), (c_hi, c_w)):
            for g, gw in ((g_lo, 1 - g_w), (g_hi, g_w)):
                if g > 0 or c not in self.anchored:  # a measured one-token cost is the anchor: the load alone moves it
                    self.table[c][g] *= ratio ** (self.rate * cw * gw)


def _cost_key(model, cache: CacheSettings) -> tuple:
    param = next(model.parameters())
    return (str(param.device), str(param.dtype), *cache.key)


def calibrate(model, tokens: torch.Tensor, cache: CacheSettings | None = None, slots: int = 0,
              reps: int = 3, kv=None, budget: float | None = None) -> CostModel:
    """A :class:`CostModel` from timed forwards: the median of ``reps`` forwards at each
    ``CALIBRATED`` count the model's positions allow after a cached context of 32 tokens (fewer where they,
    or a static cache of ``slots`` slots, do not allow 32), the counts taken in turn within a
    round, made into a model by :meth:`CostModel.from_timings` (no longer context is timed, so
    that a first call spends no second on a context it may never reach: docs/draft_length.md,
    "Its inputs"). Runs on a cache of
    the call's kind (compiled forwards compile here if not warmed up): on the static cache the
    call's own ``kv`` (before its first forward) where it has one row, else one of its length
    from the pool, so calibrating allocates nothing sized by ``max_new_tokens``; on the dynamic
    cache a throwaway one. The user's model is only read. It calls ``model.forward`` itself, so
    forward hooks that watch decoding do not see these forwards (their time is reported apart,
    as ``AcceptanceStats.calibration_seconds``). Rounds stop once ``budget`` seconds
    (``CALIBRATION_BUDGET``; none on a sharded target, whose ranks must run the same forwards) have
    passed, with a line on stderr; the first round always completes."""
    cache = cache or CacheSettings()
    device = next(model.parameters()).device
    tokens = tokens.reshape(-1).to(device)
    if tokens.numel() == 0:
        tokens = torch.zeros(1, dtype=torch.long, device=device)
    room = int(getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 0) or CONTEXT_GRID[1] * 4
    if cache.static and slots:
        room = min(room, slots)  # a static cache's length is part of its compiled graphs
    context = max(1, min(CONTEXT_GRID[0], room - CALIBRATED[-1] - 1))
    counts = tuple(c for c in CALIBRATED if context + c <= room) or CALIBRATED[:1]  # a small position table
    cache_kwarg = cache_argument(model)
    if cache.static:
        own = kv if kv is not None and getattr(kv, "batch", None) == 1 else None
        made = own or make_kv(model, 1, max(slots, context + counts[-1] + 1), cache)
    else:
        own, made = None, make_kv(model, 1, context + counts[-1] + 1, cache)
    try:
        with torch.no_grad(), measuring():  # timing forwards: no sign of use, they get no weights packed
            prefix = tokens.repeat(context // tokens.numel() + 1)[:context]
            if budget is None:
                # a sharded target's calibration forwards are collectives: every rank must run the same
                # rounds, which a clock of each rank's own cannot promise (docs/distributed.md)
                budget = float("inf") if sharding(model) else CALIBRATION_BUDGET
            curve = _time_widths(model, made, cache_kwarg, prefix, reps, counts, budget)
    finally:
        if made is not own:
            made.release()
    return CostModel.from_timings(list(counts), curve)


def _on_grid(counts: tuple[int, ...], values: list[float]) -> list[float]:
    """``values`` at ``counts`` -> [COST_GRID] values, linear in between and past the last count."""
    known = [float(c) for c in counts]
    out = []
    for x in COST_GRID:
        lo, hi, w = _bracket(known, float(x))
        out.append(values[lo] + (values[hi] - values[lo]) * w)
    return out


def _time_widths(model, kv, cache_kwarg: str, context: torch.Tensor, reps: int, counts: tuple[int, ...],
                 budget: float) -> list[float]:
    """The fastest seconds of a forward of each of ``counts`` tokens after ``context [L]`` is cached
    in ``kv``. Every round times each count in turn, so a change of the machine's load skews no count
    alone; the fastest round of each count drops the rounds another process slowed (a width priced
    too high is one the policy avoids, so no later forward would correct it). No round starts once
    ``budget`` seconds have passed since the first forward: the rounds timed so far decide."""

    def forward(ids: torch.Tensor, first_slot: int) -> None:
        device = ids.device
        width = ids.shape[1]
        fed = kv.padded_width(width, first_slot == 0)
        ids = torch.cat([ids, ids.new_zeros(1, fed - width)], dim=1)
        kwargs = {"input_ids": ids, "position_ids": first_slot + torch.arange(fed, device=device)[None, :],
                  cache_kwarg: kv.cache, "use_cache": True, "logits_to_keep": 1 if first_slot == 0 else width}
        mask = lambda slots: (torch.arange(slots, device=device) < first_slot + width).long()[None, :]  # noqa: E731
        kv.forward(model, kwargs, first_slot=first_slot, width=width, first=first_slot == 0, mask=mask,
                   needs_mask=False, direct=True)

    length = context.numel()
    began = time.perf_counter()
    forward(context[None, :], 0)
    forward(context[:1][None, :], length)  # warms up the step path
    kv.crop(length + 1, length)
    timed: dict[int, list[float]] = {count: [] for count in counts}
    for done in range(reps):
        if done and time.perf_counter() - began > budget:
            say(f"specdec: timing forwards for the draft-length policy took {time.perf_counter() - began:.0f} s "
                f"(over its {budget:.0f} s budget): {done} of {reps} rounds kept")
            break
        for count in counts:
            ids = context.repeat(count // length + 1)[:count][None, :]  # [1, count]
            synchronize(context.device)
            start = time.perf_counter()
            forward(ids, length)
            synchronize(context.device)
            timed[count].append(time.perf_counter() - start)
            kv.crop(length + count, length)
    return [min(t) for t in timed.values()]
