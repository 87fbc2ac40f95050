"""How many drafts to verify: each step's plan, from measured costs and learnt acceptance.

The model (Leviathan et al. 2023, with measured costs in place of a constant ratio). A
verification of K drafts commits E(K) tokens on average (:mod:`.expected`: from a_i, the
probability that draft i is accepted given 1..i-1 were) and costs
``T(K) = draft(K) + verify(K + pending)`` seconds. The policy picks the K that maximises
committed tokens per second, ``E(K) / T(K)``; K = 0 is plain decoding (E = 1, no drafting). A
batch shares one forward, whose cost follows its widest row, so the batch picks one width W and
row b verifies ``min(W, available_b)`` drafts; its rows' tokens are weighted by what they save of
the call's time (:meth:`DraftPolicy.row_values`: a row ahead of the others only leaves sooner).

Its inputs: ``verify`` from the target's :class:`~.costs.CostModel`; ``draft`` per proposed
token, measured from the generator's ``propose`` (before the first measurement, the bytes the
attached assistants' steps read relative to the target's, times a one-token target forward:
decoding is bound by reading weights, so a draft model too slow to pay is not even
prefilled); a_i from the :class:`~.acceptance.AcceptanceTracker` of the row's source, scaled by
the :class:`~.acceptance.ConfidenceCalibration` where the drafter gave its probability.

One call's :class:`DraftPolicy` meets the run at three points of a step:

1. :meth:`DraftPolicy.plan` before the proposal: the drafts to ask each row for, drafting's cost
   included. While the generator proposes it may ask :meth:`~DraftPolicy.step_rate` and
   :meth:`~DraftPolicy.step_keep` about that step (``ctx.draft_rate``, ``ctx.keep_drafting``);
2. :meth:`DraftPolicy.admit` once the drafts are made: how many to verify (drafting is paid);
3. :meth:`DraftPolicy.observe` after the commit, with the step's
   :class:`~specdec.generators.StepRecord`: what each forward and proposal cost, what was
   accepted.

Nothing outside this package reads or writes the policy's members.

The batch's width is :func:`~.expected.choose_width`'s; the process remembers each assistant's
measured drafting cost across calls (:class:`~.memory.DraftingMemory`).

Under sampling, decisions must not depend on timings: a seeded call must reproduce exactly, and
the random numbers the verifier draws depend on how many drafts each step verifies. There the
policy uses a fixed cost curve per device kind (``FIXED_SLOPE``) and a drafting cost equal to
the bytes of weights the attached assistants' steps read relative to the target's, so its
choices follow from the committed tokens alone. See docs/draft_length.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..host import host_ints, host_long
from ..kv import CacheSettings
from ..modelinfo import step_bytes
from .acceptance import UNTRIED, AcceptanceTracker, ConfidenceCalibration
from .costs import CostModel
from .expected import choose_width, expected_row, expected_tokens
from .memory import DraftingMemory

if TYPE_CHECKING:  # pragma: no cover
    from ..generators import DraftingInfo, StepRecord

__all__ = ["IDLE_DRIFT", "DraftPolicy", "DraftingMemory", "choose_width", "expected_tokens"]

#: per step that drafts nothing, the share of the way a measured drafting cost moves back to its
#: prior (about 30 such steps halve the gap)
IDLE_DRIFT = 0.025


@dataclass
class DraftPolicy:
    """One call's draft-length policy: chooses the drafts to ask for and to verify each step."""

    costs: CostModel
    acceptance: AcceptanceTracker
    max_drafts: int
    #: propose time per proposed token: a prior until the first measurement, then a decayed mean
    draft_seconds_per_token: float = 0.0
    measured: bool = True  # False: fixed costs and a fixed drafting cost, decisions free of timings
    step_overhead: float = 0.0  # seconds of a plain step outside the target forward (decayed mean)
    #: the same for a step that verified drafts (realigning rows that accepted apart, keeping the
    #: assistants in step); None until one is seen: the plain step's
    draft_overhead: float | None = None
    drafting_measured: bool = False  # whether draft_seconds_per_token is a measurement yet
    #: acceptance given the drafter's own probability, for generators that give one
    calibration: ConfidenceCalibration | None = None
    #: the generator drafts one token at a time and its own probabilities end each block
    stepwise: bool = False
    #: drafts cost nothing to make: every row is asked for all it may take, admit() decides
    free: bool = False
    #: per attached assistant (in the run's order): the bytes its step reads relative to the target's
    weights: tuple[float, ...] = ()
    #: (pending, context) of the step planned last: what admit, step_rate and step_keep price
    shape: tuple[int, int] = (0, 0)
    plugin: str = ""  # the generator's name, for errors
    priced: bool = True  # False until price() (during the generator's setup): step_rate answers None
    #: [B] what a token committed in each row is worth to the call this step (:meth:`row_values`)
    value: torch.Tensor | None = None
    #: the one assistant whose drafting cost the policy measures (:class:`DraftingMemory`), or None
    assistant: torch.nn.Module | None = None
    #: the drafting cost's prior (seconds per token, from the bytes the assistants read): where the
    #: call stops drafting, its measured cost drifts back towards it, so drafting is tried again
    draft_prior: float = 0.0
    #: the assistant drafts for the first time in this process: its first proposal's time (first-use
    #: work: allocations, a first run of its forward) is not a draft's cost
    first_use: bool = False

    def __post_init__(self):
        if self.calibration is None:
            self.calibration = ConfidenceCalibration(self.acceptance.priors)

    # -- one call's policy: built before the generator's setup, priced after it -----------------
    @classmethod
    def for_call(cls, info: "DraftingInfo", batch: int, do_sample: bool, device_type: str,
                 plugin: str = "") -> "DraftPolicy | None":
        """The policy of one call for a generator that declares ``info``, or None when it sets its
        own draft lengths (``info.max_drafts`` None). Timing-free under sampling. Drafting is
        priced by :meth:`price` once the generator's setup has attached its assistants."""
        if info.max_drafts is None:
            return None
        acceptance = AcceptanceTracker(batch, info.max_drafts, prior=info.priors, untried=UNTRIED)
        return cls(CostModel.fixed(device_type), acceptance, info.max_drafts, measured=not do_sample,
                   stepwise=info.stepwise, free=info.free, plugin=plugin, priced=False)

    def price(self, target, assistants: list, rows: torch.Tensor, lengths: torch.Tensor,
              cache: CacheSettings, slots: int, kv=None) -> float:
        """Price the call's forwards and drafts, the ``assistants`` (models, in the run's order)
        attached: each assistant's step at the bytes it reads relative to the target's (no
        assistant, e.g. prompt lookup: about nothing), or for an assistant an earlier call
        measured, at what it measured (:class:`DraftingMemory`). Under greedy decoding the target's
        process-wide measured :class:`CostModel` (calibrated on the first prompt row ``rows[0,
        :lengths[0]]`` on first use, on a cache of ``slots`` slots: the call's ``kv`` where it
        serves); under sampling the fixed curve. Returns the seconds spent calibrating now."""
        self.weights = tuple(step_bytes(model) / step_bytes(target) for model in assistants)
        ratio, self.priced = sum(self.weights), True
        if not self.measured:
            self.draft_seconds_per_token = ratio  # in one-token forwards of the fixed curve
            return 0.0
        self.costs, spent = CostModel.for_model(target, rows[0, : int(lengths[0])], cache, slots=slots, kv=kv)
        one = float(self.costs.predict(rows.shape[0], float(lengths.max())))
        self.assistant = assistants[0] if len(assistants) == 1 else None
        learnt = DraftingMemory.share(self.assistant)
        self.draft_prior = ratio * one
        self.first_use = self.assistant is not None and learnt is None
        if learnt is None:  # the drafting cost's prior until propose() is first timed (the first proposal also prefills)
            self.draft_seconds_per_token = self.draft_prior
        else:  # what earlier calls measured, which this call's measurements then correct
            self.draft_seconds_per_token, self.drafting_measured = learnt * one, True
            self.acceptance.untried[0] = None  # the assistant's drafts were verified before: no short try
        return spent

    # -- the run's three calls a step -------------------------------------------------------------
    def plan(self, remaining: torch.Tensor, pending: int, context: int, prefills: list[int]) -> torch.Tensor:
        """[B] drafts to ask each row for before proposing. ``remaining [B]``: drafts each row may
        still take; ``pending``: tokens the target feeds besides the drafts; ``context``: cache
        slots the verification attends to besides its own tokens; ``prefills``: per assistant (in
        :meth:`price`'s order) the tokens it has yet to prefill (0: none owed)."""
        self.shape = (pending, context)
        self.value = self.row_values(remaining, pending, context)
        if self.free:  # what each row offers is priced by its own source and confidence (admit)
            return host_long(self._offers(remaining), remaining.device)
        # an assistant's prefill still to come is paid once, so it is spread over the steps left;
        # and drafting starts only where a later step (one token pending) would draft too
        setup = self._setup_seconds(prefills) / max(max(host_ints(remaining)), 1)
        ask = self.budget(remaining, pending, context, setup)
        if setup > 0:
            steady = self.budget(remaining, 1, context + pending, setup)
            ask = host_long([a if s > 0 else 0 for a, s in zip(host_ints(ask), host_ints(steady))], ask.device)
        if self.stepwise:  # where drafting pays, the drafter's own probabilities end the block
            ask = host_long([r if a > 0 else a for a, r in zip(host_ints(ask), self._offers(remaining))], ask.device)
        return ask

    def row_values(self, remaining: torch.Tensor, pending: int, context: int) -> torch.Tensor | None:
        """[B] what one more token committed in each row this step saves of the call's time, in
        batch steps; None for one row (or rows all equally far from their end: every row alike).
        A call ends when its last row does, so the rows furthest from their end (the largest
        ``remaining``) share one step per token they all advance (1/c each, c of them); a row
        ahead of them only leaves the batch sooner, saving one row's part of each later step
        (the step's cost less the cost of a step of one row fewer). Batches whose rows stop at
        their own ends of sequence are valued alike."""
        rows = host_ints(remaining)
        batch = len(rows)
        if batch <= 1:
            return None
        last = [r == max(rows) for r in rows]
        count = sum(last)
        if count == batch:
            return None
        whole = float(self.costs.predict(pending * batch, context))
        fewer = float(self.costs.predict(pending * (batch - 1), context))
        share = min(max((whole - fewer) / max(whole, 1e-12), 0.0), 1.0)
        return torch.where(torch.tensor(last), 1.0 / count, share).double()

    def admit(self, offered: torch.Tensor, sources: torch.Tensor | None,
              confidence: torch.Tensor | None) -> torch.Tensor:
        """[B] drafts to verify of the ``offered [B]`` ones, for the step planned last (:meth:`trim`)."""
        return self.trim(offered, *self.shape, sources, confidence)

    def observe(self, record: "StepRecord") -> None:
        """Learn from one step: the drafting cost (unless an assistant prefilled or caught up in
        the proposal: a cost of resuming, not of a draft), the forward's cost (not the prefill's),
        each source's acceptance, what the drafter's confidence meant, the step's other costs."""
        sources = record.sources
        if not record.first and not record.compiling:  # a step that compiled a graph says nothing of its costs
            picks = [0] * record.made.shape[0] if sources is None else host_ints(sources)
            if not record.catching_up:  # the most drafts a row made from source 0 (the ones that cost time)
                drafted = max((m for m, s in zip(host_ints(record.made), picks) if s == 0), default=0)
                if drafted:
                    self.observe_drafting(record.drafting, drafted)
                else:
                    self.observe_idle()
            self.costs.observe(record.fed, record.forward, record.context)
        self.acceptance.update(record.offered, record.accepted, sources)
        if record.confidence is not None:
            self.calibration.update(record.confidence, record.offered, record.accepted, sources)
        if not record.first and not record.compiling:
            self.observe_overhead(record.overhead(), drafts=max(host_ints(record.offered), default=0) > 0)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (finished rows left the batch)."""
        self.acceptance.select_rows(rows)
        self.value = None  # the next plan values the rows left

    # -- what a generator may ask while it proposes (DecodeContext.draft_rate / keep_drafting) ---
    def step_rate(self, counts: torch.Tensor, source: int, paid: bool = False) -> torch.Tensor | None:
        """:meth:`rates` for the step planned last; None before :meth:`price`."""
        if not self.priced:
            return None
        if not 0 <= int(source) < len(self.acceptance.priors):
            raise ValueError(f"{self.plugin}: draft_rate(source={source}) needs a source in "
                             f"[0, {len(self.acceptance.priors)}) (one per DraftingInfo.priors)")
        return self.rates(counts, *self.shape, int(source), paid).to(counts.device)

    def step_keep(self, confidence: torch.Tensor, max_drafts: torch.Tensor) -> bool:
        """:meth:`keep_drafting` for the step planned last; True before :meth:`price`."""
        return True if not self.priced else self.keep_drafting(confidence, max_drafts, *self.shape)

    def _setup_seconds(self, prefills: list[int]) -> float:
        """Seconds the assistants that have not yet run would spend prefilling before their first
        draft (a cost drafting pays once), each priced like a target forward over as many tokens,
        scaled by its weight."""
        return sum((w * float(self.costs.predict(t)) for w, t in zip(self.weights, prefills) if t), 0.0)

    # -- the plan's pieces -----------------------------------------------------------------------

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
        counts = self._offers(available)
        seconds = self._step_seconds(len(counts), pending, context, self.draft_seconds_per_token)
        return choose_width(self._estimate(None, confidence), counts, seconds, self._value(len(counts))) > made

    def step_node_prices(self, confidence: torch.Tensor) -> torch.Tensor | None:
        """:meth:`node_prices` for the step planned last; None before :meth:`price`."""
        return None if not self.priced else self.node_prices(confidence, *self.shape)

    def node_prices(self, confidence: torch.Tensor, pending: int, context: int = 0) -> torch.Tensor:
        """``[m]`` tokens the k-th node verified beside a chain of ``confidence [B, i]`` drafts (a
        tree's alternative, which costs no drafting) must add to a row for the step to commit
        tokens at least as fast as with the chain alone: the forward's extra seconds for one more
        token a row, times the chain's expected tokens a row per second of the step. ``m``: up to
        ``max_drafts`` nodes a row in all."""
        batch, width = confidence.shape[0], min(confidence.shape[1], self.max_drafts)
        seconds = self._step_seconds(batch, pending, context, self.draft_seconds_per_token)
        forwards = self.costs.seconds_for([(w + pending) * batch for w in range(self.max_drafts + 1)], context)
        rows = self._estimate(None, confidence)
        rate = sum(expected_row(r)[width] for r in rows) / batch / max(seconds[width], 1e-12)
        return torch.tensor([rate * (forwards[w + 1] - forwards[w]) for w in range(width, self.max_drafts)],
                            dtype=torch.float64)

    def _offers(self, counts: torch.Tensor) -> list[int]:
        """counts [B] as plain numbers within 0..max_drafts."""
        return [min(max(c, 0), self.max_drafts) for c in host_ints(counts)]

    def _estimate(self, sources: torch.Tensor | None, confidence: torch.Tensor | None) -> list[list[float]]:
        """[B][K] conditional acceptance per position: the tracker's, scaled where a draft came with
        the drafter's probability by how acceptance at that probability compares with the source's
        overall (:meth:`ConfidenceCalibration.factor`)."""
        estimate = self.acceptance.estimate_rows(sources)
        if confidence is None or confidence.numel() == 0:
            return estimate
        picks = [0] * len(estimate) if sources is None else host_ints(sources)
        width = min(confidence.shape[1], self.acceptance.positions)
        for b, (row, s) in enumerate(zip(confidence[:, :width].cpu().tolist(), picks)):
            for i, c in enumerate(row):
                if c == c:  # not NaN
                    estimate[b][i] = min(estimate[b][i] * self.calibration.factor(c, s), 1.0)
        return estimate

    def _cap(self, counts: torch.Tensor, pending: int, context: int, per_draft: float,
             sources: torch.Tensor | None = None, setup: float = 0.0,
             confidence: torch.Tensor | None = None) -> torch.Tensor:
        """counts [B] capped at the width that maximises committed tokens per second, where each
        draft costs ``per_draft`` seconds to make on top of verifying it, and drafting at all
        ``setup`` seconds."""
        available = self._offers(counts)  # [B]
        seconds = self._step_seconds(len(available), pending, context, per_draft, setup)
        width = choose_width(self._estimate(sources, confidence), available, seconds, self._value(len(available)))
        return host_long([min(a, width) for a in available], counts.device)

    def _value(self, rows: int) -> torch.Tensor | None:
        """This step's :meth:`row_values` where they describe ``rows`` rows."""
        value = self.value
        return value if value is not None and value.shape[0] == rows else None

    def _step_seconds(self, batch: int, pending: int, context: int, per_draft: float,
                      setup: float = 0.0) -> list[float]:
        """[max_drafts + 1] seconds of a step of ``batch`` rows that verifies w = 0.. drafts a row."""
        forwards = self.costs.seconds_for([(w + pending) * batch for w in range(self.max_drafts + 1)], context)
        plain = self.step_overhead
        drafting = plain if self.draft_overhead is None else self.draft_overhead
        return [f + (per_draft * w + setup + drafting if w else plain) for w, f in enumerate(forwards)]

    def rates(self, counts: torch.Tensor, pending: int, context: int, source: int = 0,
              paid: bool = False) -> torch.Tensor:
        """[B] committed tokens per second row b is expected to reach this step if it verifies the
        best number, up to ``counts[b]``, of drafts from ``source`` (zero drafts included: plain
        decoding). Source 0's drafts cost the measured drafting time unless ``paid`` (made this
        step anyway); other sources' are free."""
        per_draft = self.draft_seconds_per_token if source == 0 and not paid else 0.0
        available = self._offers(counts)
        seconds = self._step_seconds(len(available), pending, context, per_draft)
        out = []
        for accept, offer in zip(self.acceptance.estimate_rows([source] * len(available)), available):
            expected = expected_row(accept)
            out.append(max(expected[w] / max(seconds[w], 1e-12) for w in range(offer + 1)))
        return torch.tensor(out, dtype=torch.float64)

    def observe_overhead(self, seconds: float, drafts: bool = False) -> None:
        """A step spent ``seconds`` outside the target forward and drafting (verification, commit,
        syncing, bookkeeping): a cost every step pays, whatever K, which favours longer blocks. A
        step that verified ``drafts`` pays more (rows that accepted apart realign, assistants catch
        up on the block): learnt apart, so that a batch where that costs more than the drafts save
        stays plain."""
        if not self.measured:
            return
        seconds = max(seconds, 0.0)
        if not drafts:
            self.step_overhead = 0.8 * self.step_overhead + 0.2 * seconds
        else:  # from the plain steps' until one is seen: one slow step moves it a fifth of the way
            known = self.step_overhead if self.draft_overhead is None else self.draft_overhead
            self.draft_overhead = 0.8 * known + 0.2 * seconds

    def observe_idle(self) -> None:
        """A step drafted nothing: a measured drafting cost drifts towards its prior by
        :data:`IDLE_DRIFT` (and so does what the process remembers of it), and a drafting step's
        overhead towards a plain step's, so that one slow measurement cannot stop drafting for
        good, in this call or a later one (it is measured again once drafting looks worth a try)."""
        if not self.measured:
            return
        if self.draft_overhead is not None:
            self.draft_overhead += IDLE_DRIFT * (self.step_overhead - self.draft_overhead)
        if self.drafting_measured and self.draft_prior > 0:
            self.draft_seconds_per_token += IDLE_DRIFT * (self.draft_prior - self.draft_seconds_per_token)
            self._remember()

    def observe_drafting(self, seconds: float, proposed: int) -> None:
        """``propose`` took ``seconds`` for a block of ``proposed`` drafts (the widest row of
        source 0); an assistant's first proposal in the process is not learnt from (``first_use``)."""
        if self.first_use:
            self.first_use = False
            return
        if proposed > 0 and self.measured:
            per_token = seconds / proposed
            self.draft_seconds_per_token = (0.8 * self.draft_seconds_per_token + 0.2 * per_token
                                            if self.drafting_measured else per_token)
            self.drafting_measured = True
            self._remember()

    def _remember(self) -> None:
        """Tell :class:`DraftingMemory` the drafting cost as it stands, as a share of a one-token
        forward of this batch and context."""
        if self.assistant is not None:
            one = self.costs.seconds_for([self.acceptance.batch], float(self.shape[1]))[0]
            DraftingMemory.learn(self.assistant, self.draft_seconds_per_token / max(one, 1e-12))
