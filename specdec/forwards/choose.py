"""``weights="auto"``: the copy's precision chosen by measurement on the machine it runs on.

Which copy drafts fastest depends on the CPU more than on the model: int8 x uint8 products
(``w8a8``) are cheap on a CPU with VNNI/AMX int8 instructions and dearer than the fp32 target's
own on one with AVX2 only, where a bfloat16 copy or torch's fbgemm layers (``dynamic_int8``) win
(docs/self_draft.md, "Which copy, on which CPU"). So on a CPU ``auto`` measures, once per machine
and model:

1. the candidate copies (:func:`candidates`) are tried one at a time, in order; each is built
   only where none tried before it is expected to reach :data:`ENOUGH` (step 4), so a machine
   where the first one serves well builds and times no other (the choice is paid for by a
   user's first call);
2. the target and the copy step through the last :data:`STEPS` tokens of a short calibration
   text one token at a time, eagerly, on caches of the kinds they run on (a draft's step, and a
   plain decoding step): each model once a round, the order alternating from round to round
   (the machine may be shared), medians; the target's forward of each of :data:`WIDTHS` tokens
   is timed too, one a round in turn (the cost of verifying); a copy whose median step after
   :data:`PRUNE_AFTER` rounds is no shorter than the target's is timed no further (it cannot
   pay), and one that is, :data:`LONE_STEPS` steps; the target's cache is rolled back to the
   text's first timed token for the next copy (its prefill is done once);
3. each copy's agreement with the target: the share of the calibration positions where both
   models' greedy next token is the same (teacher-forced), over the prefilled text (one forward
   each, which the timing needs anyway) and the steps timed: a handful of steps alone is too few
   to tell a 93% copy from an 88% one. A copy that quantizes a forward's activations per tensor
   (torch's dynamic int8) is compared at its one-token steps only: a many-token forward is not
   how it drafts;
4. each copy's expected rate by the draft-length policy's own model: the best K of
   ``E(K) / (K d + T(K + 1))``, E from the agreement (:func:`specdec.policy.plan.expected_tokens`),
   d the copy's step, T the target's forward (the draft-length policy's forward-cost model,
   ``specdec.policy.costs``, made from the widths timed, which a call's policy then starts from
   instead of timing the target again); the first copy expected to reach :data:`ENOUGH` wins,
   else the first whose rate no later one beats by :data:`BETTER_BY` (the policy still decides
   each step whether drafting pays).

Measuring is bounded by a time budget (:data:`BUDGET_SECONDS`, ``SPECDEC_CHOICE_BUDGET``, or the
generator's ``choice_budget``): once it is spent no further candidate is built and the copy being
timed stops after :data:`MIN_ROUNDS` rounds, the best copy measured so far is taken, and the
choice says so (its ``reason``, the line on stderr, ``out.stats.choices``). A busy machine once
spent 349 s here where 7 s is usual. While measuring, a progress bar runs on stderr where it is a
terminal (not under ``SPECDEC_QUIET``, nor where the caller passes ``progress=False``).

The choice, with the table it was made from, is kept in a JSON file under the weight cache root
(``choice_file.py``: one per machine and model, keyed by nothing of how the model was called, so
the command line and the API share it; verified when read, and one that does not read back as
written is said, naming it, measured again and replaced), so later processes build only the
chosen copy; deleting the file measures again.
Off the CPU ``auto`` is ``bfloat16`` without measuring (no int8 candidate there needs no extra
package).

Invariants: the target is only read; nothing measured changes any token of the output (a copy
only drafts); a candidate that fails to build is left out with the reason recorded.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import choice_file
from .choice_file import _FORMAT, cache_file, cache_key, save  # noqa: F401  (re-exported)

#: the widths of the target's forwards timed besides its one-token steps: the cost of verifying
#: drafts, and the draft-length policy's calibration (``specdec.policy.costs.CALIBRATED``)
WIDTHS = (2, 4, 16)
#: calibration tokens each model steps through one at a time, timed and compared: a draft steps one
#: token at a time, and a copy whose activations are quantized per tensor (torch's dynamic int8)
#: agrees with the target far less over a many-token forward than in one-token steps
STEPS = 16
#: the most drafts a step may verify when pricing a copy (the policy's default cap)
MAX_DRAFTS = 16
#: after this many rounds a copy whose median step is no faster than the target's is no longer
#: timed: it cannot pay at any agreement
PRUNE_AFTER = 4
#: once a stage has a single copy left (the others dropped as no faster than the target), it is
#: timed this many steps and no more: its figures are compared with nothing, they only price it
LONE_STEPS = 8
#: the expected speedup at which a measured copy makes the candidates after it not worth building
#: (each one more costs a first call some 2-3 s): a copy that clearly pays. The model's figures run
#: well below what decoding reaches (docs/self_draft.md: the w8a8 copy that gives 1.65-1.78x end
#: to end on the Intel Xeon there is expected at 1.11-1.33x)
ENOUGH = 1.1
#: how much higher a later candidate's expected speedup must be to replace an earlier one: the same
#: copy's expected speedup varies by about 5% either way between fresh choices on a shared machine,
#: 10% at the extremes (w8a8 1.11-1.33x on the Intel Xeon of docs/self_draft.md), and the order of
#: :func:`candidates` is itself a measured preference (where both draft faster than the target, the
#: earlier won end to end)
BETTER_BY = 1.10
#: seconds measuring may take (building and timing candidates) before the best copy so far is taken:
#: some four times what a choice takes on an idle machine (3-8 s, docs/self_draft.md), and a bound
#: on a busy one (349 s seen); ``SPECDEC_CHOICE_BUDGET`` or ``self_draft``'s ``choice_budget`` sets it
BUDGET_SECONDS = 30.0
BUDGET_ENV = "SPECDEC_CHOICE_BUDGET"
#: the rounds a copy is timed even past the budget: one median needs some, and a choice needs a copy
MIN_ROUNDS = 2
#: a text to measure agreement on, when a tokenizer can encode it (else the call's prompt)
CALIBRATION_TEXT = (
    "The city council met on Tuesday to discuss the new budget. After a long debate, the members agreed "
    "to spend more on public transport and less on road repairs. Here is a short summary of the plan:\n"
    "1. Buses will run every ten minutes during rush hour.\n2. Two new bike lanes will open next spring.\n"
    "3. The price of a monthly pass will stay the same.\nIn Python, the function below returns the sum of "
    "a list of numbers:\n\ndef total(numbers):\n    result = 0\n    for n in numbers:\n        result += n\n"
    "    return result\n")


@dataclass
class Candidate:
    """One copy as measured: its step (s), its agreement with the target, the speedup over plain
    decoding the policy's model expects of it (and at how many drafts), or why it was left out."""

    weights: str
    step_seconds: float | None = None
    agreement: float | None = None
    expected_speedup: float | None = None
    drafts: int = 0
    problem: str | None = None
    steps: int = 0  # one-token steps timed (fewer where it was dropped early)
    positions: int = 0  # calibration positions its agreement was measured at
    cut: bool = False  # its timing was stopped by the time budget


@dataclass
class Choice:
    """The copy ``auto`` chose, and why."""

    weights: str
    candidates: list[Candidate] = field(default_factory=list)
    target_seconds: float | None = None  # the target's one-token forward
    machine: str = ""
    seconds: float = 0.0  # spent measuring (0 when read from the cache)
    cached: bool = False  # read from the disk cache
    budget: float | None = None  # the time budget (s) measuring ran under
    cut_short: bool = False  # the budget ran out: the best copy measured by then

    @property
    def reason(self) -> str:
        """One line: the winner, and every candidate's expected speedup, step and agreement."""
        parts = []
        for c in sorted(self.candidates, key=lambda c: -(c.expected_speedup or 0.0)):
            if c.problem:
                parts.append(f"{c.weights}: not built ({c.problem})")
            else:
                relative = c.step_seconds / self.target_seconds if self.target_seconds else float("nan")
                early = f", timed {c.steps} steps: the time budget ran out" if c.cut else (
                    f", timed {c.steps} steps: slower than the target" if 0 < c.steps < max(
                        (d.steps for d in self.candidates), default=0) else "")
                parts.append(f"{c.weights} {c.expected_speedup:.2f}x (step {relative:.2f} of the target's, "
                             f"agreement {c.agreement:.0%} of {c.positions} tokens{early})")
        how = "measured earlier, read from the cache" if self.cached else f"measured in {self.seconds:.1f} s"
        if self.cut_short:
            how += f"; stopped by its {self.budget:g} s time budget: the best copy measured by then"
        chosen = next((c for c in self.candidates if c.weights == self.weights), None)
        enough = chosen is not None and (chosen.expected_speedup or 0.0) >= ENOUGH
        why = (f"the first copy expected to reach {ENOUGH}x" if enough else
               f"the best expected rate (a later copy replaces an earlier one {BETTER_BY - 1:.0%} faster)")
        return f"{self.weights}: {why} on {self.machine} ({how}): " + "; ".join(parts)


def load(key: str) -> Choice | None:
    """The choice kept on disk for ``key`` (``choice_file.read``), or None."""
    data = choice_file.read(key)
    if data is None:
        return None
    return Choice(data["weights"], [Candidate(**c) for c in data["candidates"]], data["target_seconds"],
                  data["machine"], 0.0, cached=True, budget=data["budget"], cut_short=data["cut_short"])


def candidates(model) -> tuple[str, ...]:
    """The copies worth measuring for ``model`` on a CPU, in the order they are tried (the first
    expected to reach :data:`ENOUGH` ends the search, so the order is what a first call pays for).
    Where the CPU has int8 dot-product instructions (:func:`specdec.machine.fast_int8_products`:
    VNNI or AMX): w8a8 (the fastest draft there), int4 (half w8a8's bytes, bfloat16 activations,
    torch's own int4 kernel, its output layer in bfloat16), bfloat16 (quick to build), torch's
    dynamic int8 (the slowest to build: 1.5 s for SmolLM2-135M, most of it ``quantize_dynamic``
    packing weights). Without them int4 comes first and w8a8 last: there an int8 x uint8 product
    costs more than the fp32 one it replaces (w8a8's step 1.4 of the target's on the AMD EPYC of
    docs/self_draft.md, int4's 0.27-0.41), and timing it first cost a first call seconds for nothing.
    torchao's weight-only int8 is not among them: its eager step costs more than the fp32 target's
    on every CPU measured (benchmarks/results/forward_cost_isa/README.md), and a call drafts eagerly
    unless warmed up; name it (``weights="int8"``) to draft with it compiled."""
    from ..machine import fast_int8_products

    if fast_int8_products():
        return ("w8a8", "int4", "bfloat16", "dynamic_int8")
    return ("int4", "bfloat16", "dynamic_int8", "w8a8")


# -- timing -------------------------------------------------------------------------------------
class StepTimer:
    """A model stepping through the calibration tokens ``ids [1, L]`` one at a time, as a draft
    does, through the cache backends decoding uses (``specdec.kv``): prefilled with all but the
    last ``steps`` tokens, then :meth:`step` feeds the next one (timed, its greedy next token
    kept); :meth:`time` times a wider forward and rolls it back."""

    def __init__(self, model, ids: torch.Tensor, steps: int, cache=None):
        from ..kv import make_kv
        from ..modelinfo import cache_argument

        self.model = model
        self.start = self.position = ids.shape[1] - steps
        room = max(WIDTHS)  # the widest timed forward goes past the text's end: its first tokens again
        self.ids = torch.cat([ids, ids.repeat(1, room // ids.shape[1] + 1)[:, :room]], dim=1)
        self.kv = make_kv(model, 1, self.ids.shape[1] + 1, cache)
        self.cache_kwarg = cache_argument(model)
        with torch.no_grad():
            logits = self._forward(0, self.position, True, keep=0)  # [1, start, V]
        # the greedy next token at each prefilled position, compared for agreement too, except for a
        # model quantizing a forward's activations per tensor: its many-token forward is not a draft's
        per_tensor = any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in model.modules())
        self.prefilled = [None] * self.start if per_tensor else logits[0].argmax(-1).tolist()

    def _forward(self, start: int, width: int, first: bool = False, keep: int | None = None) -> torch.Tensor:
        from .packed import measuring

        with measuring():  # no sign of use: these forwards do not get the target's weights packed
            return self._fed(start, width, first, width if keep is None else keep)

    def _fed(self, start: int, width: int, first: bool, keep: int) -> torch.Tensor:
        fed = self.kv.padded_width(width, first)
        kwargs = {"input_ids": self.ids[:, start: start + fed], "position_ids": torch.arange(start, start + fed)[None, :],
                  self.cache_kwarg: self.kv.cache, "use_cache": True, "logits_to_keep": keep}
        mask = lambda slots: (torch.arange(slots) < start + width).long()[None, :]  # noqa: E731
        return self.kv.forward(self.model, kwargs, first_slot=start, width=width, first=first, mask=mask,
                               needs_mask=False, direct=True)

    def step(self) -> tuple[float, int]:
        """Feed the next calibration token: (seconds, the greedy next token after it)."""
        started = time.perf_counter()
        with torch.no_grad():
            logits = self._forward(self.position, 1)  # [1, 1, V]
        seconds = time.perf_counter() - started
        self.position += 1
        return seconds, int(logits[0, -1].argmax())

    def time(self, width: int) -> float:
        """Seconds of one forward of ``width`` tokens at the current position (then rolled back)."""
        started = time.perf_counter()
        with torch.no_grad():
            self._forward(self.position, width)
        seconds = time.perf_counter() - started
        self.kv.crop(self.position + width, self.position)
        return seconds

    def rewind(self) -> "StepTimer":
        """Back to the first timed token (the cache keeps the prefill); -> this timer."""
        self.kv.crop(self.position, self.start)
        self.position = self.start
        return self

    def release(self) -> None:
        self.kv.release()


def interleaved(timers: dict[str, StepTimer], steps: int, prune_after: int | None = None,
                out_of_time: Callable[[], bool] | None = None, tick: Callable[[int], None] | None = None,
                ) -> tuple[dict[str, float], dict[str, list[int]], dict[int, list[float]]]:
    """Every model of ``timers`` (the target's named ``"target"``) steps through ``steps`` tokens,
    one step each a round, the order rotating from round to round; the target's forward of one of
    :data:`WIDTHS` tokens is timed each round, the widths in turn. After ``prune_after`` rounds a
    model whose median step is no shorter than the target's steps no more (its figures are those
    of the rounds it ran), and where one copy is left, measuring ends after :data:`LONE_STEPS`
    rounds (the choice among them cannot change); after :data:`MIN_ROUNDS` it ends as soon as
    ``out_of_time()`` says so (the time budget). ``tick(r)`` after each round r (progress).
    -> ({name: median step seconds}, {name: greedy tokens}, {width: the target's seconds at that
    width, each time})."""
    names = list(timers)
    for timer in timers.values():
        timer.time(1)  # first-use work (kernel selection, allocation) is not a step's cost
    timers["target"].time(max(WIDTHS))
    times: dict[str, list[float]] = {name: [] for name in names}
    tops: dict[str, list[int | None]] = {name: list(timers[name].prefilled) for name in names}
    wide: dict[int, list[float]] = {width: [] for width in WIDTHS}
    for r in range(steps):
        if r == prune_after:
            target = statistics.median(times["target"])
            names = [n for n in names if n == "target" or statistics.median(times[n]) < target]
        if len(names) == 1 or (prune_after is not None and r >= max(prune_after, LONE_STEPS) and len(names) <= 2):
            break  # no copy left to time, or one whose figures are compared with no other's
        if out_of_time is not None and r >= MIN_ROUNDS and out_of_time():
            break  # the budget is spent: these rounds are what the choice is made from
        for name in names[r % len(names):] + names[: r % len(names)]:
            seconds, top = timers[name].step()
            times[name].append(seconds)
            tops[name].append(top)
        width = WIDTHS[r % len(WIDTHS)]
        wide[width].append(timers["target"].time(width))
        if tick is not None:
            tick(r)
    return {name: statistics.median(t) for name, t in times.items()}, tops, wide


# -- the choice ---------------------------------------------------------------------------------
def compared(reference: list[int | None], tops: list[int | None]) -> list[tuple[int, int]]:
    """The (target's, copy's) greedy next tokens at the positions both have one (None: not compared there)."""
    return [(a, b) for a, b in zip(reference, tops) if a is not None and b is not None]


def agreement(reference: list[int | None], tops: list[int | None]) -> float:
    """Share of the :func:`compared` positions where a copy's greedy next token is the target's."""
    pairs = compared(reference, tops)
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def expected_speedup(accept: float, step: float, target_seconds: Callable[[int], float]) -> tuple[float, int]:
    """(speedup over plain decoding, drafts) of the best block length K for a copy whose drafts are
    accepted with conditional probability ``accept`` and cost ``step`` seconds each, verified by a
    target forward of K + 1 tokens costing ``target_seconds(K + 1)`` (the policy's model)."""
    from ..policy.plan import expected_tokens

    expected = expected_tokens(torch.full((1, MAX_DRAFTS), accept, dtype=torch.float64))[0].tolist()  # [K+1]
    rates = [expected[k] / (k * step + target_seconds(k + 1)) for k in range(MAX_DRAFTS + 1)]
    best = max(range(len(rates)), key=rates.__getitem__)
    return rates[best] * target_seconds(1), best


class Budget:
    """The time measuring may take: ``budget()`` says whether it is spent (remembering that it
    was: :attr:`spent`). ``clock`` is the time in seconds (a test passes its own)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter):
        self.seconds, self.clock, self.started, self.spent = seconds, clock, clock(), False

    def elapsed(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        return max(0.0, self.seconds - self.elapsed())

    def __call__(self) -> bool:
        if self.elapsed() >= self.seconds:
            self.spent = True
        return self.spent


def budget_seconds(budget: float | None = None) -> float:
    """The time budget measuring runs under: ``budget`` where given, else ``SPECDEC_CHOICE_BUDGET``,
    else :data:`BUDGET_SECONDS`. Raises ValueError, naming it, for one that is not a number >= 0."""
    where = "choice_budget"
    if budget is None:
        text = os.environ.get(BUDGET_ENV, "").strip()
        if not text:
            return BUDGET_SECONDS
        where = BUDGET_ENV
        try:
            budget = float(text)
        except ValueError:
            raise ValueError(f"{BUDGET_ENV} must be a number of seconds, got {text!r}") from None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
        raise ValueError(f"{where} must be a number of seconds >= 0, got {budget!r}")
    return float(budget)


def progress_shown(progress: bool | None) -> bool:
    """Whether measuring shows a progress bar: ``progress`` where the caller says, else where stderr
    is a terminal and ``SPECDEC_QUIET`` is not set."""
    if progress is not None:
        return bool(progress)
    quiet = os.environ.get("SPECDEC_QUIET", "").strip().lower() not in ("", "0", "false", "no")
    return not quiet and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


class Progress:
    """A ``tqdm`` bar on stderr over the candidates' timing rounds (``steps`` each), saying which
    copy is being built or timed and the budget left; does nothing where not ``shown``."""

    def __init__(self, names, steps: int, budget: Budget, shown: bool):
        self.steps, self.budget, self.index, self.bar, self.what = steps, budget, 0, None, ""
        if shown:
            from tqdm import tqdm

            self.bar = tqdm(total=len(names) * steps, desc="specdec: choosing the draft copy", unit="round",
                            file=sys.stderr, leave=False, dynamic_ncols=True)

    def stage(self, index: int, name: str, what: str) -> None:
        self.index = index
        self._show(index * self.steps, f"{name}: {what}")

    def tick(self, r: int) -> None:
        self._show(self.index * self.steps + r + 1, None)

    def _show(self, done: int, what: str | None) -> None:
        if self.bar is None:
            return
        self.bar.n = done
        if what is not None:
            self.what = what
        self.bar.set_postfix_str(f"{self.what}, {self.budget.left():.0f} s of the budget left", refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def measure(target, sample: torch.Tensor, build: Callable, draft_cache=None,
            weights: tuple[str, ...] | None = None, steps: int = STEPS, budget: float | None = None,
            progress: bool | None = False, clock: Callable[[], float] = time.perf_counter) -> tuple[Choice, dict]:
    """Try the candidate copies of ``target`` in order (see the module doc) on the calibration
    tokens ``sample [1, L]``, until one is expected to reach :data:`ENOUGH` or the time budget
    (``budget`` seconds, :func:`budget_seconds`, by ``clock``) is spent: then the best copy so far
    (at least one is timed, :data:`MIN_ROUNDS` rounds or more), the choice marked ``cut_short``.
    The target's forward-cost model is made from its forwards timed here, where the process has
    none yet (``CostModel.offer``: a call's policy then times no forward of its own). ``progress``:
    a bar on stderr (:func:`progress_shown`). Returns the choice and the copy chosen ({weights: copy})."""
    from .. import machine
    from ..kv import CacheSettings
    from ..policy.costs import CostModel

    budget_s = budget_seconds(budget)
    spent = Budget(budget_s, clock)
    steps = max(1, min(steps, sample.shape[1] - 1))
    names = tuple(weights or candidates(target))
    bar = Progress(names, steps, spent, progress_shown(progress))
    found, built, reference = [], {}, None
    ones, wide = [], {width: [] for width in WIDTHS}  # the target's timings, over every copy's rounds
    try:
        for index, name in enumerate(names):
            problem = _skipped(found, spent, budget_s)
            if problem is None:
                bar.stage(index, name, "building")
                copy, problem = _built(build, target, name)
            if problem is not None:
                found.append(Candidate(name, problem=problem))
                continue
            built[name] = copy
            bar.stage(index, name, "timing")
            reference = StepTimer(target, sample, steps, CacheSettings()) if reference is None else reference.rewind()
            seconds, tops, timed = _time_against(reference, built[name], name, sample, steps, draft_cache,
                                                 out_of_time=spent, tick=bar.tick)
            ones.append(seconds["target"])
            for width, times in timed.items():
                wide[width] += times
            found.append(_candidate(name, seconds[name], tops, target_costs(seconds["target"], timed), reference.start))
            found[-1].cut = spent.spent  # (once spent, no later copy is timed)
    finally:
        bar.close()
        if reference is not None:
            reference.release()
    best = _best(found)
    CostModel.offer(target, target_costs(statistics.median(ones), wide), CacheSettings())
    choice = Choice(best.weights, found, ones[0], f"{machine.describe()}, {torch.get_num_threads()} threads",
                    spent.elapsed(), budget=budget_s, cut_short=spent.spent)
    return choice, {best.weights: built[best.weights]}


def _built(build: Callable, target, name: str):
    """-> (``build(target, name)``, None), or (None, why this machine could not build that copy: a
    missing kernel or package)."""
    try:
        return build(target, name), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def _skipped(found: list, spent, budget_s: float) -> str | None:
    """Why the next candidate is not built, after the ones ``found`` so far: one is expected to reach
    :data:`ENOUGH`, or one was timed and the budget is ``spent``; None: build it."""
    best = max((c.expected_speedup for c in found if c.problem is None), default=0.0)
    if best >= ENOUGH:
        return f"not needed: another copy is expected to give {best:.2f}x"
    if any(c.problem is None for c in found) and spent():
        return f"the {budget_s:g} s time budget ran out before it"
    return None


def _best(found: list):
    """The candidate to choose: the first timed, replaced by a later one only :data:`BETTER_BY` better."""
    usable = [c for c in found if c.problem is None]
    if not usable:
        raise RuntimeError("weights='auto': no candidate copy could be built here: "
                           + "; ".join(f"{c.weights}: {c.problem}" for c in found))
    best = usable[0]
    for candidate in usable[1:]:
        if candidate.expected_speedup > best.expected_speedup * BETTER_BY:  # (none after one reaching ENOUGH is built)
            best = candidate
    return best


def _time_against(reference: StepTimer, copy, name: str, sample: torch.Tensor, steps: int, draft_cache,
                  out_of_time=None, tick=None):
    """:func:`interleaved` of ``copy`` (named ``name``) and the target's ``reference`` timer."""
    timer = StepTimer(copy, sample, steps, draft_cache)
    try:
        return interleaved({"target": reference, name: timer}, steps, prune_after=PRUNE_AFTER,
                           out_of_time=out_of_time, tick=tick)
    finally:
        timer.release()


def target_costs(one: float, wide: dict[int, list[float]]):
    """The target's :class:`~specdec.policy.costs.CostModel` from its one-token step (s) and the
    times of its wider forwards ({width: [seconds]}, medians taken; widths never timed left out)."""
    from ..policy.costs import CostModel

    widths = [width for width in sorted(wide) if wide[width]]
    return CostModel.from_timings([1, *widths], [one, *(statistics.median(wide[w]) for w in widths)])


def _candidate(name: str, step: float, tops: dict[str, list[int | None]], costs, prefilled: int) -> Candidate:
    """A copy's record from its median ``step``, both models' greedy tokens (``prefilled`` from the
    prefill, then one a step), and the target's forward-cost model ``costs``."""
    made = Candidate(name, step_seconds=step, steps=len(tops[name]) - prefilled,
                     positions=len(compared(tops["target"], tops[name])), agreement=agreement(tops["target"], tops[name]))
    made.expected_speedup, made.drafts = expected_speedup(made.agreement, step, lambda width: float(costs.predict(width)))
    return made


def calibration_ids(tokenizer, fallback: torch.Tensor | None, device, longest: int = 128, model=None) -> torch.Tensor:
    """[1, L] the calibration tokens: :data:`CALIBRATION_TEXT` encoded by ``tokenizer``, or by
    ``model``'s own tokenizer where one is stored beside its weights (:func:`stored_tokenizer`),
    else ``fallback`` (the call's first prompt row, often too short to tell copies apart), at most
    ``longest`` tokens."""
    ids = None
    if tokenizer is None and model is not None:
        tokenizer = stored_tokenizer(model)
    if tokenizer is not None:
        try:
            ids = torch.as_tensor(tokenizer(CALIBRATION_TEXT)["input_ids"], dtype=torch.long)
        except Exception:  # a tokenizer that cannot encode plain text: use the prompt
            ids = None
    if ids is None or ids.numel() < 8:
        ids = fallback.reshape(-1) if fallback is not None and fallback.numel() >= 2 else torch.arange(2, 34)
    return ids[:longest].reshape(1, -1).to(device)


def stored_tokenizer(model):
    """The tokenizer saved with ``model``'s weights (its ``name_or_path``, read from disk only:
    nothing is downloaded), or None."""
    path = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # no tokenizer stored there (or none this transformers can read)
        return None


# -- the cache ----------------------------------------------------------------------------------
_MEMO: dict[str, Choice] = {}
_LOCK = threading.Lock()


def choose(target, sample: torch.Tensor | Callable[[], torch.Tensor], build: Callable,
           draft_cache=None, budget: float | None = None, progress: bool | None = None) -> tuple[Choice, dict]:
    """The copy ``auto`` means for ``target`` here: remembered for the process, read from the
    disk cache, or measured (:func:`measure` on the calibration tokens ``sample`` [1, L], or what
    it returns when it is a function: made only when measuring; within ``budget`` seconds,
    :func:`budget_seconds`; a progress bar as ``progress`` says, :func:`progress_shown`) and saved,
    said on stderr. Returns (choice, copies built now)."""
    from ..compiled import say

    key = cache_key(target)
    with _LOCK:
        found = _MEMO.get(key) or load(key)
        if found is not None:
            _MEMO[key] = found
            return found, {}
        path = cache_file(key)
        seconds = budget_seconds(budget)
        say(f"choosing the draft copy for this machine and model: timing {', '.join(candidates(target))} as needed, "
            f"for at most some {seconds:g} s" + (f" (once; kept in {path}) ..." if path is not None else " ..."))
        choice, built = measure(target, sample() if callable(sample) else sample, build, draft_cache,
                                budget=seconds, progress=progress)
        cut = (" (the {:g} s time budget ran out: the best copy measured by then, kept for this process "
               "only; a later process measures again)".format(seconds)) if choice.cut_short else ""
        say(f"... chose {choice.weights} in {choice.seconds:.1f} s{cut}")
        if not choice.cut_short:  # one busy moment must not fix the copy for this machine for good
            save(key, choice)
        _MEMO[key] = choice
        return choice, built
