"""The time budget ``weights="auto"`` measures within, and the progress bar shown while it measures.

The budget is :data:`BUDGET_SECONDS` unless ``SPECDEC_CHOICE_BUDGET`` or the generator's
``choice_budget`` says otherwise (:func:`budget_seconds`); the bar runs on stderr where it is a
terminal and ``SPECDEC_QUIET`` is not set (:func:`progress_shown`). What a spent budget stops is
``choose.py``'s.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

#: seconds measuring may take (building and timing candidates) before the best copy so far is taken:
#: some four times what a choice takes on an idle machine (3-8 s, docs/self_draft.md), and a bound
#: on a busy one (349 s seen); ``SPECDEC_CHOICE_BUDGET`` or ``self_draft``'s ``choice_budget`` sets it
BUDGET_SECONDS = 30.0
BUDGET_ENV = "SPECDEC_CHOICE_BUDGET"


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

