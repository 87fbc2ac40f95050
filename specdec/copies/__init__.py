"""Drafting with a copy of a model at lower precision (``weights=``), and which copy ``"auto"`` takes.

* ``drafts``: :class:`~.drafts.LowPrecisionDraft`, the option a generator mixes in to draft with
  a copy of its model, and :class:`~.drafts.Copies`, which builds each copy once per configured
  generator (the copies themselves are the engines' ``build_copy``, ``specdec.engines``);
* ``choose``: ``weights="auto"``, the copy measured best on this machine, with its timers
  (``choice_timing``), time budget and progress bar (``choice_budget``) and the file that keeps
  the choice (``choice_file``).

The package sits above the core's cache backends (it times decoding steps through them) and
reaches the engines through their root only. Nothing here chooses tokens: a copy only drafts.
"""

from __future__ import annotations

from .choice_budget import budget_seconds
from .drafts import Copies, LowPrecisionDraft

__all__ = ["Copies", "LowPrecisionDraft", "budget_seconds"]
