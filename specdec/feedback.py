"""What a step tells those who learn from it: the generator's ``observe`` (a :class:`Feedback`),
the draft-length policy and the statistics (the whole :class:`StepRecord`), and a generator that
declared hidden layers (:class:`TargetHidden`). Re-exported by ``specdec.generators``."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch


@dataclass
class TargetHidden:
    """The target's hidden states of the tokens one step committed that its forward fed (the
    step's pending tokens, all of the prompt at the prefill, and the accepted drafts; not the
    target's own new token, which no forward has fed yet): ``states[layer] [B, M, H]``, column
    j of row b holding token ``start[b] + j``, valid for ``j < count[b]``. A token fed again (a
    row re-feeding after its batch's cache was realigned) is reported again: index by position."""

    states: dict[int, torch.Tensor]
    start: torch.Tensor  # [B] long
    count: torch.Tensor  # [B] long


@dataclass
class Feedback:
    offered: torch.Tensor  # [B] drafts each row offered after clamping (the ones verified)
    accepted: torch.Tensor  # [B] drafts each row had accepted


@dataclass
class StepRecord(Feedback):
    """One step as the run saw it, built once after the commit: the generator's ``observe`` gets
    it (as its :class:`Feedback`), the draft-length policy learns from it, the statistics count
    it. Counts are [B] long tensors on the target's device."""

    asked: torch.Tensor  # [B] the max_drafts propose() was given
    made: torch.Tensor  # [B] drafts proposed within the ask that the target can take (drafting is priced on these)
    candidates: torch.Tensor  # [B] of those, the ones worth verifying (none after a drafted end of sequence)
    kept: torch.Tensor  # [B] tokens committed: accepted drafts and the target's own, cut where a row stopped
    room: torch.Tensor  # [B] drafts each row could still take before this step (its last token excluded)
    sources: torch.Tensor | None = None  # [B] long, on the CPU: each row's source of drafts (None: source 0)
    confidence: torch.Tensor | None = None  # [B, K] the drafter's probability of each draft (NaN: none)
    fed: int = 0  # tokens the target's forward fed, all rows together
    context: int = 0  # cache slots that forward attended to besides the tokens it fed
    first: bool = False  # the target's first forward (its prefill): its cost says nothing of a verification's
    catching_up: bool = False  # an assistant prefilled, or caught up on skipped steps, within this proposal
    waiting: bool = False  # no drafts asked for: assistants that borrow the target's prefill waited for it
    compiling: float = 0.0  # seconds of this step spent compiling graphs (first use): its times say nothing of a step's
    started: float = 0.0  # time.perf_counter() when the step began
    drafting: float = 0.0  # seconds of propose()
    forward: float = 0.0  # seconds of the target's forward
    verifying: float = 0.0  # seconds from the proposal to the commit (forward, verification, commit)
    grammar_drafts: torch.Tensor | None = None  # [B] of the offered drafts, the trailing ones a grammar proposed
    #: whether the step verified a token tree: ``offered`` then counts its nodes, ``accepted`` the
    #: depth of the accepted path (docs/trees.md), ``depth`` [B] the depth of its deepest node
    tree: bool = False
    depth: torch.Tensor | None = None
    #: the hidden states a generator declared (``DraftingInfo.hidden_layers``) of the tokens this
    #: step committed; None when it declared none
    hidden: TargetHidden | None = None

    def drafter_view(self) -> "StepRecord":
        """The step as the generator's drafts saw it: the grammar's drafts after them left out (free,
        nearly certain, they say nothing of the drafter or of the draft length); a tree as the chain
        of its depth (nodes beside a path are no deep positions that failed: docs/trees.md)."""
        if self.tree and self.depth is not None:
            depth = self.depth.to(self.offered.device)
            return replace(self, offered=depth, accepted=torch.minimum(self.accepted, depth),
                           made=torch.minimum(self.made, depth.to(self.made.device)), depth=None, tree=False)
        if self.grammar_drafts is None:
            return self
        offered = self.offered - self.grammar_drafts.to(self.offered.device)
        return replace(self, offered=offered, accepted=torch.minimum(self.accepted, offered), grammar_drafts=None)

    def overhead(self) -> float:
        """Seconds of this step so far outside drafting and the target's forward (verification,
        commit, keeping assistants in step, bookkeeping): a cost every step pays, whatever K."""
        return time.perf_counter() - self.started - self.forward - self.drafting
