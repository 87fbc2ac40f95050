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

The calibration tokens and the timers are ``choice_timing.py``'s, the time budget and the progress
bar ``choice_budget.py``'s; this module rates the copies and chooses.

Invariants: the target is only read; nothing measured changes any token of the output (a copy
only drafts); a candidate that fails to build is left out with the reason recorded.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import choice_file
from .choice_budget import BUDGET_ENV, BUDGET_SECONDS, Budget, Progress, budget_seconds, progress_shown
from .choice_file import _FORMAT, cache_file, cache_key, save
from .choice_timing import (CALIBRATION_TEXT, LONE_STEPS, MIN_ROUNDS, PRUNE_AFTER, STEPS, WIDTHS, StepTimer,
                            calibration_ids, interleaved, stored_tokenizer)

#: the names callers read here (``lowbit.py``, ``self_draft``), some defined in choice_timing.py and choice_budget.py
__all__ = ["_FORMAT", "BETTER_BY", "BUDGET_ENV", "BUDGET_SECONDS", "CALIBRATION_TEXT", "ENOUGH", "LONE_STEPS", "MAX_DRAFTS",
           "MIN_ROUNDS", "PRUNE_AFTER", "STEPS", "WIDTHS", "Budget", "Candidate", "Choice", "Progress", "StepTimer",
           "agreement", "budget_seconds", "cache_file", "cache_key", "calibration_ids", "candidates", "choose",
           "compared", "expected_speedup", "interleaved", "load", "measure", "progress_shown", "save",
           "stored_tokenizer", "target_costs"]

#: the most drafts a step may verify when pricing a copy (the policy's default cap)
MAX_DRAFTS = 16
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
    target_step_seconds: float | None = None  # the target's step in the rounds timed beside it


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
                beside = c.target_step_seconds or self.target_seconds
                relative = c.step_seconds / beside if beside else float("nan")
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
    unless warmed up; name it (``weights="int8"``) to draft with it compiled. dynamic_int8 only for a
    float32 target (torch's dynamically quantized layers take float32 activations)."""
    from ..machine import fast_int8_products

    order = ("w8a8", "int4", "bfloat16", "dynamic_int8") if fast_int8_products() else (
        "int4", "bfloat16", "dynamic_int8", "w8a8")
    return tuple(w for w in order if w != "dynamic_int8" or next(model.parameters()).dtype == torch.float32)


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
            found[-1].target_step_seconds = seconds["target"]
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
