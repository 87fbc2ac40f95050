"""How many drafts to verify each step: the cost-aware draft-length policy, one job a module.

* :mod:`.costs`: what a target forward costs (:class:`CostModel`, :func:`calibrate`);
* :mod:`.acceptance`: how often drafts are accepted (:class:`AcceptanceTracker`,
  :class:`ConfidenceCalibration`);
* :mod:`.expected`: the decision's arithmetic (:func:`expected_tokens`, :func:`choose_width`);
* :mod:`.memory`: the process's :class:`DraftingMemory` of each assistant's measured drafting cost;
* :mod:`.plan`: one call's :class:`DraftPolicy`, which the run meets through ``plan``, ``admit``
  and ``observe``.

The arrows point one way: plan uses the others, which know nothing of each other or of the run. See docs/draft_length.md.
"""

from .acceptance import UNTRIED, AcceptanceTracker, ConfidenceCalibration
from .costs import (CALIBRATED, CONTEXT_GRID, COST_GRID, FIXED_SLOPE, LOAD_RATE, SHAPE_RATE,
                    CostModel, calibrate)
from .plan import IDLE_DRIFT, DraftingMemory, DraftPolicy, choose_width, expected_tokens

__all__ = ["CALIBRATED", "CONTEXT_GRID", "COST_GRID", "FIXED_SLOPE", "LOAD_RATE", "SHAPE_RATE",
           "IDLE_DRIFT", "UNTRIED", "AcceptanceTracker", "ConfidenceCalibration", "CostModel", "DraftingMemory",
           "DraftPolicy", "calibrate",
           "choose_width", "expected_tokens"]
