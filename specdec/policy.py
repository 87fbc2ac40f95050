"""How many drafts to verify: chosen each step from measured costs and estimated acceptance.

The model (Leviathan et al. 2023, with measured costs in place of a constant ratio). If the
drafts at positions 1..K are accepted with conditional probabilities a_1..a_K (a_i: accepted at
i given 1..i-1 were), one verification commits on average

    E(K) = 1 + sum_{i=1..K} prod_{j<=i} a_j        tokens (the target's own token included)

and costs ``T(K) = draft(K) + verify(K + pending)`` seconds. The policy picks the K that maximises
committed tokens per second, ``E(K) / T(K)``; K = 0 is plain decoding (E = 1, no drafting). A
batch shares one forward, whose cost follows its widest row, so the batch picks one width W and
row b verifies ``min(W, available_b)`` drafts.

Inputs, all measured while decoding:

* :class:`CostModel`: seconds of one target forward as a function of the tokens it feeds
  (width x batch) and of the tokens it attends to (its context), kept per (model, device, dtype,
  cache kind, fast output layer or not) for the process: a short calibration the first time
  (forwards of 1..64 tokens after contexts of 32 and 512 tokens, on throwaway caches), then
  corrected by every forward the loop runs: a load factor moves every width at once, a slower
  shape correction the widths near the one observed;
* the drafting cost per proposed token, measured per call from the generator's ``propose``;
  before the first measurement, the bytes of weights the attached assistants' steps read
  relative to the target's (``modelinfo.step_bytes``), times a one-token target forward
  (decoding is bound by reading weights), so a draft model too slow to pay at the prior
  acceptance is not even prefilled;
* :class:`AcceptanceTracker`: per source of drafts, row and position, decayed counts of accepted /
  offered drafts with a prior (the generator's ``acceptance_prior()``: 0.5 unless it knows better;
  one per source for a generator with several, see ``Proposal.sources``). Counts decay
  every step, also when a row does not draft, so a row that stopped drafting drifts back towards
  the prior and probes again later.

:func:`choose_width` is a pure function (tested with hypothesis): never above what rows can
offer, zero when no width pays, and never a wider block when acceptance falls.

Under sampling, decisions must not depend on timings: a seeded call must reproduce exactly, and
the random numbers the verifier draws depend on how many drafts each step verifies. There the
policy uses a fixed cost curve per device kind (``FIXED_SLOPE``) and a drafting cost equal to
the bytes of weights the attached assistants' steps read relative to the target's (decoding is
bound by reading weights), so its choices follow from the committed tokens alone.
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from .kv import CacheSettings, make_kv
from .modelinfo import cache_argument

#: token counts at which a forward's cost is tracked
COST_GRID = (1, 2, 4, 8, 16, 32, 64)
#: the counts timed by the first calibration (the others are interpolated until observed); the
#: small ones matter most: the first drafts' cost decides whether drafting pays at all
CALIBRATED = (1, 2, 3, 4, 8, 16, 64)
#: context lengths (tokens already cached) at which costs are tracked: a forward of several tokens
#: costs more over a long context (2-core CPU, SmolLM2-135M: 5 tokens cost 1.4x one token after 32
#: cached tokens, 2.0x after 700)
CONTEXT_GRID = (32, 512, 2048)
#: extra cost of each further token fed, in one-token forwards, by device kind: the fixed curve
#: used where decisions must not depend on timings (sampling, so that a seeded call reproduces).
#: Measured for SmolLM2-135M: 2-core CPU about 1 + k/8; H200, eager, 32 tokens 1.28x one token.
FIXED_SLOPE = {"cpu": 1 / 8, "cuda": 0.28 / 31}
#: how far one observed forward moves the cost model: the machine's load (one factor for the whole
#: curve, so a slower machine makes every width slower) and the curve's shape near that point
LOAD_RATE, SHAPE_RATE = 0.05, 0.05


def expected_tokens(accept: torch.Tensor) -> torch.Tensor:
    """accept [B, K] conditional acceptance per position -> [B, K+1]: E(k) for k = 0..K."""
    rows = [_expected(rates) for rates in accept.double().tolist()]
    return torch.tensor(rows, dtype=torch.float64).reshape(accept.shape[0], accept.shape[1] + 1)


def _expected(rates: list[float]) -> list[float]:
    """E(k) for k = 0..K of one row (plain floats: the loop asks every step, and B x K is small)."""
    out, reach = [1.0], 1.0
    for a in rates:
        reach *= a  # P(drafts 1..i all accepted)
        out.append(out[-1] + reach)
    return out


def choose_width(accept: torch.Tensor, available: torch.Tensor, step_seconds: torch.Tensor) -> int:
    """The number of drafts W that maximises the batch's committed tokens per second.

    accept [B, K] conditional acceptance per row and position; available [B] drafts each row can
    offer (at most K); step_seconds [K+1] the cost of a step that verifies w drafts (w = 0..K),
    drafting included. Row b verifies ``min(W, available[b])``. Ties go to the smaller W.
    """
    k = accept.shape[1]
    total = [0.0] * (k + 1)  # committed tokens of the batch for w = 0..K
    for rates, offer in zip(accept.double().tolist(), available.long().clamp(0, k).tolist()):
        expected = _expected(rates)
        for w in range(k + 1):
            total[w] += expected[min(w, offer)]
    widest = int(available.max()) if available.numel() else 0
    rate = [t / max(c, 1e-12) for t, c in zip(total, step_seconds.double().tolist())][: widest + 1]
    best = max(rate)
    return next(w for w, r in enumerate(rate) if r >= best * (1 - 1e-9))  # the smallest of the best


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

    _shared: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, CostModel]]" = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, seconds: list, rate: float = SHAPE_RATE, contexts: tuple[int, ...] = (0,)):
        table = torch.tensor(seconds, dtype=torch.float64)
        table = table[None, :] if table.dim() == 1 else table
        if table.shape != (len(contexts), len(COST_GRID)):
            raise ValueError(f"seconds must be [{len(contexts)}, {len(COST_GRID)}], got {list(table.shape)}")
        self.table: list[list[float]] = table.tolist()  # [C][G]
        self.grid = [float(x) for x in COST_GRID]
        self.contexts = [float(c) for c in contexts]
        self.load = 1.0  # the machine's load relative to the table
        self.rate = rate  # 0: a fixed model that observations do not move

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
    def for_model(cls, model, calibrate_with: torch.Tensor, cache: CacheSettings | None = None,
                  slots: int = 0) -> tuple["CostModel", float]:
        """The process-wide cost model of ``model`` on its device and dtype, with this cache kind
        (static or dynamic, compiled or not); calibrated on first use with the tokens
        ``calibrate_with [L]`` on a cache of at least ``slots`` slots (the call's: a static
        cache's length is part of a compiled graph). Returns (model, seconds spent calibrating now)."""
        cache = cache or CacheSettings()
        key = _cost_key(model, cache)
        with cls._lock:
            found = cls._shared.get(model, {}).get(key)
        if found is not None:
            return found, 0.0
        started = time.perf_counter()
        made = calibrate(model, calibrate_with, cache, slots)
        spent = time.perf_counter() - started
        with cls._lock:
            return cls._shared.setdefault(model, {}).setdefault(key, made), spent

    def predict(self, tokens: torch.Tensor | float, context: float = 0.0) -> torch.Tensor:
        """Seconds for forwards feeding ``tokens`` (any shape) after ``context`` cached tokens."""
        curve = self._curve(float(context))
        x = torch.as_tensor(tokens, dtype=torch.float64)
        out = []
        for t in x.reshape(-1).tolist():
            lo, hi, w = _bracket(self.grid, t)
            out.append(curve[lo] + (curve[hi] - curve[lo]) * w)  # linear past the last point too
        return torch.tensor(out, dtype=torch.float64).reshape(x.shape)

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
        with cls._lock:
            cls._shared.setdefault(model, {})[_cost_key(model, cache or CacheSettings())] = costs

    def observe(self, tokens: int, seconds: float, context: float = 0.0) -> None:
        """One forward that fed ``tokens`` after ``context`` cached tokens took ``seconds`` (counts
        past the grid are ignored)."""
        x = float(max(tokens, 1))
        if x > COST_GRID[-1] or self.rate == 0.0 or seconds <= 0.0:
            return
        predicted = float(self.predict(x, context))
        # one forward slowed by another process must not move the model far: the ratio is clipped to 1.5x
        ratio = min(max(seconds / predicted, 1 / 1.5), 1.5)
        self.load *= ratio ** LOAD_RATE
        c_lo, c_hi, c_w = _bracket(self.contexts, float(context))
        c_w = min(c_w, 1.0)
        g_lo, g_hi, g_w = _bracket(self.grid, x)
        for c, cw in ((c_lo, 1 - c_w), (c_hi, c_w)):
            for g, gw in ((g_lo, 1 - g_w), (g_hi, g_w)):
                if g > 0:  # one token is the anchor: the load alone moves it, the shape is relative to it
                    self.table[c][g] *= ratio ** (self.rate * cw * gw)


def _cost_key(model, cache: CacheSettings) -> tuple:
    param = next(model.parameters())
    return (str(param.device), str(param.dtype), *cache.key)


def calibrate(model, tokens: torch.Tensor, cache: CacheSettings | None = None, slots: int = 0,
              reps: int = 3) -> CostModel:
    """A :class:`CostModel` from timed forwards: the median of ``reps`` forwards at each
    ``CALIBRATED`` count after a cached context of 32 tokens and after one of 512 where the model's
    positions (and a static cache of ``slots`` slots) allow, the contexts taken in turn;
    interpolated in between, extrapolated to the longer ``CONTEXT_GRID`` contexts. Runs on
    throwaway caches of the call's kind (compiled forwards compile here if not warmed up); the
    user's model is only read. It calls
    ``model.forward`` itself, so forward hooks that watch decoding do not see these forwards
    (their time is reported apart, as ``AcceptanceStats.calibration_seconds``)."""
    cache = cache or CacheSettings()
    device = next(model.parameters()).device
    tokens = tokens.reshape(-1).to(device)
    if tokens.numel() == 0:
        tokens = torch.zeros(1, dtype=torch.long, device=device)
    room = int(getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 0) or CONTEXT_GRID[1] * 4
    if cache.static:
        room = min(room, slots)  # a static cache's length is part of its compiled graphs
    contexts = [c for c in CONTEXT_GRID[:2] if c == CONTEXT_GRID[0] or c + CALIBRATED[-1] + 1 <= room]
    cache_kwarg = cache_argument(model)
    kvs = [make_kv(model, 1, max(slots, length + CALIBRATED[-1] + 1), cache) for length in contexts]
    try:
        with torch.no_grad():
            prefixes = [tokens.repeat(n // tokens.numel() + 1)[:n] for n in contexts]
            curves = _time_widths(model, kvs, cache_kwarg, prefixes, reps)
    finally:
        for kv in kvs:
            kv.release()
    calibrated = [float(c) for c in CALIBRATED]
    rows = []  # [contexts][COST_GRID], interpolated between the calibrated counts
    for curve in curves:
        points = [_bracket(calibrated, float(x)) for x in COST_GRID]
        rows.append([curve[lo] + (curve[hi] - curve[lo]) * w for lo, hi, w in points])
    if len(contexts) == 1:
        return CostModel(rows[0])
    span = contexts[1] - contexts[0]
    growth = [max(b - a, 0.0) / span for a, b in zip(*rows)]  # seconds per further cached token
    table = [[a + g * (c - contexts[0]) for a, g in zip(rows[0], growth)] for c in CONTEXT_GRID]
    return CostModel(table, contexts=CONTEXT_GRID)

def _time_widths(model, kvs: list, cache_kwarg: str, contexts: list[torch.Tensor], reps: int) -> list[list[float]]:
    """Median seconds of a forward of each ``CALIBRATED`` count after each ``contexts[i] [L_i]``
    is cached in ``kvs[i]``: [contexts][CALIBRATED]. Every round times each count after each
    context in turn, so a change of the machine's load skews no count or context alone (timed
    context by context, a load change between them made the cost of a long context's forward
    come out 1.5x off, or no dearer than a short one's)."""

    def forward(kv, ids: torch.Tensor, first_slot: int) -> None:
        device = ids.device
        width = ids.shape[1]
        fed = kv.padded_width(width, first_slot == 0)
        ids = torch.cat([ids, ids.new_zeros(1, fed - width)], dim=1)
        kwargs = {"input_ids": ids, "position_ids": first_slot + torch.arange(fed, device=device)[None, :],
                  cache_kwarg: kv.cache, "use_cache": True, "logits_to_keep": 1 if first_slot == 0 else width}
        mask = lambda slots: (torch.arange(slots, device=device) < first_slot + width).long()[None, :]  # noqa: E731
        kv.forward(model, kwargs, first_slot=first_slot, width=width, first=first_slot == 0, mask=mask,
                   needs_mask=False, direct=True)

    for kv, context in zip(kvs, contexts):
        length = context.numel()
        forward(kv, context[None, :], 0)
        forward(kv, context[:1][None, :], length)  # warms up the step path
        kv.crop(length + 1, length)
    times = [{count: [] for count in CALIBRATED} for _ in contexts]
    for _ in range(reps):
        for count in CALIBRATED:
            for kv, context, timed in zip(kvs, contexts, times):
                length = context.numel()
                ids = context.repeat(count // length + 1)[:count][None, :]  # [1, count]
                synchronize(context.device)
                start = time.perf_counter()
                forward(kv, ids, length)
                synchronize(context.device)
                timed[count].append(time.perf_counter() - start)
                kv.crop(length + count, length)
    return [[sorted(t)[(reps - 1) // 2] for t in timed.values()] for timed in times]


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


#: acceptance at which a source of drafts is priced until one of its drafts has been verified (its
#: prior, if higher): a draft whose worth is unknown is tried once where it would pay if it agreed
#: with the target this often, and its record decides from then on
UNTRIED = 0.8


class AcceptanceTracker:
    """Per source of drafts, row and draft position, decayed counts of drafts offered and accepted
    (with a prior per source).

    A generator with several sources (prompt lookup, then a draft model where lookup finds
    nothing) names each row's source in ``Proposal.sources``; each source's acceptance is learnt
    apart, so a source that is seldom right shortens its own blocks, not the other's.
    A row that drafted from a source forgets that source at ``decay`` per step; otherwise it
    forgets slowly (``idle_decay``), so after a run of rejections its estimate climbs back to the
    prior over a few dozen steps and it probes again, rarely enough to cost little where drafting
    never pays.

    With ``untried`` (a run passes :data:`UNTRIED`), until a source's first drafts have been
    verified (in any row) it is priced at ``untried`` (or its prior if higher) at every position:
    the prior is what a source is worth on average, but a source that pays only on text it agrees
    with would never be tried at it, and one verified block settles the question.
    """

    def __init__(self, batch: int, positions: int, *, prior: float | tuple[float, ...] = 0.5,
                 prior_weight: float = 2.0, decay: float = 0.9, idle_decay: float = 0.97,
                 untried: float | None = None):
        self.priors = tuple(float(p) for p in (prior if isinstance(prior, (tuple, list)) else (prior,)))
        self.offered = torch.zeros(len(self.priors), batch, positions, dtype=torch.float64)  # [S, B, K]
        self.accepted = torch.zeros_like(self.offered)
        self.prior_weight, self.decay, self.idle_decay = prior_weight, decay, idle_decay
        # per source: the acceptance it is priced at before any of its drafts was verified (None: tried)
        self.untried: list[float | None] = [max(p, untried) if untried is not None else None for p in self.priors]

    def estimate(self, sources: torch.Tensor | None = None) -> torch.Tensor:
        """[B, K] conditional acceptance per position of row b's source ``sources[b]`` (default:
        source 0). Position 1's prior is the source's prior; position i's is the estimate at
        position i-1, so positions rarely reached borrow from the shallower ones (conditional
        acceptance seldom falls with depth: a copy that held for i-1 tokens tends to hold on)."""
        w = self.prior_weight
        batch = self.offered.shape[1]
        picks = [0] * batch if sources is None else sources.cpu().tolist()
        rows = []
        for b, s in enumerate(picks):  # plain floats: B x K is small
            if self.untried[s] is not None:
                rows.append([self.untried[s]] * self.offered.shape[2])
                continue
            rate, row = self.priors[s], []
            for a, o in zip(self.accepted[s, b].tolist(), self.offered[s, b].tolist()):
                rate = (a + rate * w) / (o + w)
                row.append(rate)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.float64).reshape(self.offered.shape[1:])

    def update(self, offered: torch.Tensor, accepted: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        """offered [B], accepted [B] drafts of this step, drafted by ``sources [B]`` (default:
        source 0); position i is tried if offered > i and every earlier draft was accepted."""
        positions = torch.arange(self.offered.shape[2])[None, None, :]  # [1, 1, K]
        offered, accepted = offered.cpu()[None, :, None], accepted.cpu()[None, :, None]  # [1, B, 1]
        picks = torch.zeros(offered.shape[1], dtype=torch.long) if sources is None else sources.cpu().long()
        mine = (torch.arange(len(self.priors))[:, None] == picks[None, :])[..., None]  # [S, B, 1]
        drafted = mine & (offered > 0)
        tried = drafted & (positions < offered) & (positions <= accepted)  # [S, B, K]
        hit = drafted & (positions < accepted)
        keep = torch.where(drafted, self.decay, self.idle_decay).double()  # [S, B, 1]
        self.offered.mul_(keep).add_(tried.double())
        self.accepted.mul_(keep).add_(hit.double())
        for s in drafted.flatten(1).any(1).nonzero().flatten().tolist():  # sources verified this step
            self.untried[s] = None

    def select_rows(self, rows: torch.Tensor) -> None:
        rows = rows.cpu()
        self.offered, self.accepted = self.offered[:, rows], self.accepted[:, rows]


class ConfidenceCalibration:
    """Per source of drafts, how a draft's acceptance varies with the drafter's own probability of
    it (``Proposal.confidence``): decayed counts of drafts reached and accepted in ``bins``
    equal-width bins of confidence, pooled over rows (it describes the drafter, not the row's
    text). :meth:`factor` is a bin's acceptance over the source's overall acceptance, each bin
    starting at the overall rate (factor 1): a drafter's confidence changes nothing until it has
    been seen to mean something. A copy of the target that is unsure of a token is the one that
    disagrees with it (2-core CPU, SmolLM2-135M and its w8a8 copy, teacher-forced over 471
    positions of six Spec-Bench prompts: agreement 1.00 where the copy gave its token 0.5 or more,
    0.85 below)."""

    def __init__(self, priors: tuple[float, ...], bins: int = 10, prior_weight: float = 4.0, decay: float = 0.99):
        self.priors = tuple(float(p) for p in priors)
        self.offered = [[0.0] * bins for _ in self.priors]  # [S][bins]
        self.accepted = [[0.0] * bins for _ in self.priors]
        self.bins, self.prior_weight, self.decay = bins, prior_weight, decay

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.bins), 0), self.bins - 1)

    def factor(self, confidence: float, source: int = 0) -> float:
        """A draft given ``confidence`` is accepted this many times as often as the source's drafts overall."""
        w = self.prior_weight
        overall = (sum(self.accepted[source]) + self.priors[source] * w) / (sum(self.offered[source]) + w)
        b = self._bin(confidence)
        return (self.accepted[source][b] + overall * w) / (self.offered[source][b] + w) / overall

    def update(self, confidence: torch.Tensor, offered: torch.Tensor, accepted: torch.Tensor,
               sources: torch.Tensor | None = None) -> None:
        """confidence [B, K] (NaN where a draft has none), offered [B], accepted [B] of one step:
        row b's draft i was reached (verified with every earlier one accepted) if i <= accepted[b]
        and i < offered[b]."""
        picks = [0] * confidence.shape[0] if sources is None else sources.cpu().tolist()
        for s in set(picks):
            self.offered[s] = [x * self.decay for x in self.offered[s]]
            self.accepted[s] = [x * self.decay for x in self.accepted[s]]
        for conf, off, acc, s in zip(confidence.cpu().tolist(), offered.cpu().tolist(), accepted.cpu().tolist(),
                                     picks):
            for i, c in enumerate(conf[: min(off, acc + 1)]):
                if c == c:  # not NaN
                    b = self._bin(c)
                    self.offered[s][b] += 1.0
                    self.accepted[s][b] += float(i < acc)


@dataclass
class DraftPolicy:
    """One call's draft-length policy: chooses the drafts to ask for and to verify each step."""

    costs: CostModel
    acceptance: AcceptanceTracker
    max_drafts: int
    #: propose time per proposed token: a prior until the first measurement, then a decayed mean
    draft_seconds_per_token: float = 0.0
    measured: bool = True  # False: fixed costs and a fixed drafting cost, decisions free of timings
    step_overhead: float = 0.0  # seconds of a step outside the target forward and drafting (decayed mean)
    drafting_measured: bool = False  # whether draft_seconds_per_token is a measurement yet
    #: acceptance given the drafter's own probability, for generators that give one
    calibration: ConfidenceCalibration | None = None

    def __post_init__(self):
        if self.calibration is None:
            self.calibration = ConfidenceCalibration(self.acceptance.priors)

    def budget(self, remaining: torch.Tensor, pending: int, context: int = 0, setup: float = 0.0) -> torch.Tensor:
        """Drafts to ask each row for before proposing (drafting cost included), priced with
        source 0's acceptance and drafting cost (a generator's main, costlier source: another
        source that drafts for free offers up to as many). remaining [B]; ``context``: the cache
        slots the verification attends to besides the tokens it feeds; ``setup``: seconds any
        drafting this step pays once (assistants that still have to prefill)."""
        return self._cap(remaining, pending, context, self.draft_seconds_per_token, setup=setup)

    def trim(self, offered: torch.Tensor, pending: int, context: int = 0,
             sources: torch.Tensor | None = None, confidence: torch.Tensor | None = None) -> torch.Tensor:
        """Drafts to verify once proposed (drafting is paid): offered [B] -> [B], each row valued
        with the acceptance of its source (``sources [B]``, default 0), and where the drafter gave
        its probability of a draft (``confidence [B, K]``), with the acceptance seen at that probability."""
        return self._cap(offered, pending, context, 0.0, sources, confidence=confidence)

    def keep_drafting(self, confidence: torch.Tensor, available: torch.Tensor, pending: int, context: int = 0) -> bool:
        """Whether drafting one more token still pays, with ``confidence [B, i]`` the drafter's
        probabilities of the i drafts made so far and ``available [B]`` the most drafts a row may
        offer: the step is planned again as :meth:`budget` plans it, valued with these drafts' own
        acceptance, and the best block is longer than i. (The drafts made stay in the step's cost:
        a block is worth extending if its tokens per second, over the whole step, grow, which is
        what keeps the long-run rate highest; leaving the paid drafts out would compare each
        further draft with a step made to look cheap, and end blocks of drafts that all pay.)"""
        made = confidence.shape[1]
        counts = available.cpu().clamp(0, self.max_drafts)
        seconds = self._step_seconds(counts.shape[0], pending, context, self.draft_seconds_per_token)
        return choose_width(self._estimate(None, confidence), counts, seconds) > made

    def _estimate(self, sources: torch.Tensor | None, confidence: torch.Tensor | None) -> torch.Tensor:
        """[B, K] conditional acceptance per position: the tracker's, scaled where a draft came with
        the drafter's probability by how acceptance at that probability compares with the source's
        overall (:meth:`ConfidenceCalibration.factor`)."""
        estimate = self.acceptance.estimate(sources)
        if confidence is None or confidence.numel() == 0:
            return estimate
        picks = [0] * estimate.shape[0] if sources is None else sources.cpu().tolist()
        width = min(confidence.shape[1], estimate.shape[1])
        for b, (row, s) in enumerate(zip(confidence[:, :width].cpu().tolist(), picks)):
            for i, c in enumerate(row):
                if c == c:  # not NaN
                    estimate[b, i] = min(float(estimate[b, i]) * self.calibration.factor(c, s), 1.0)
        return estimate

    def _cap(self, counts: torch.Tensor, pending: int, context: int, per_draft: float,
             sources: torch.Tensor | None = None, setup: float = 0.0,
             confidence: torch.Tensor | None = None) -> torch.Tensor:
        """counts [B] capped at the width that maximises committed tokens per second, where each
        draft costs ``per_draft`` seconds to make on top of verifying it, and drafting at all
        ``setup`` seconds."""
        available = counts.cpu().clamp(0, self.max_drafts)  # [B]
        seconds = self._step_seconds(available.shape[0], pending, context, per_draft, setup)
        width = choose_width(self._estimate(sources, confidence), available, seconds)
        return available.clamp(max=width).to(counts.device)

    def _step_seconds(self, batch: int, pending: int, context: int, per_draft: float,
                      setup: float = 0.0) -> torch.Tensor:
        """[max_drafts + 1] seconds of a step of ``batch`` rows that verifies w = 0.. drafts a row."""
        widths = torch.arange(self.max_drafts + 1, dtype=torch.float64)
        return (self.costs.predict((widths + pending) * batch, context) + per_draft * widths
                + setup * (widths > 0) + self.step_overhead)

    def rates(self, counts: torch.Tensor, pending: int, context: int, source: int = 0) -> torch.Tensor:
        """[B] committed tokens per second row b is expected to reach this step if it verifies the
        best number, up to ``counts[b]``, of drafts from ``source`` (zero drafts included: plain
        decoding). Source 0's drafts cost the measured drafting time; other sources' are free."""
        per_draft = self.draft_seconds_per_token if source == 0 else 0.0
        available = counts.cpu().clamp(0, self.max_drafts).tolist()
        seconds = self._step_seconds(len(available), pending, context, per_draft).tolist()
        estimate = self.acceptance.estimate(torch.full((len(available),), source, dtype=torch.long))
        out = []
        for accept, offer in zip(estimate.tolist(), available):
            expected = _expected(accept)
            out.append(max(expected[w] / max(seconds[w], 1e-12) for w in range(offer + 1)))
        return torch.tensor(out, dtype=torch.float64)

    def observe_overhead(self, seconds: float) -> None:
        """A step spent ``seconds`` outside the target forward and drafting (verification, commit,
        syncing, bookkeeping): a cost every step pays, whatever K, which favours longer blocks."""
        if self.measured:
            self.step_overhead = 0.8 * self.step_overhead + 0.2 * max(seconds, 0.0)

    def observe_drafting(self, seconds: float, proposed: int) -> None:
        """``propose`` took ``seconds`` for a block of ``proposed`` drafts (the widest row of
        source 0)."""
        if proposed > 0 and self.measured:
            per_token = seconds / proposed
            self.draft_seconds_per_token = (0.8 * self.draft_seconds_per_token + 0.2 * per_token
                                            if self.drafting_measured else per_token)
            self.drafting_measured = True
