"""The candidate-generator protocol: what a plugin implements and what it is given.

A generator is created once per ``SpecDecoder`` and used for every ``generate()`` call:

1. ``setup(ctx)`` at the start of each call, with a :class:`DecodeContext`: the target, the
   tokenizers, the sampling parameters, the committed tokens, and ``ctx.attach(model)`` which
   hands an assistant model to the controller (the controller then owns its cache, prefill-only
   inputs and roll-back, exactly as for the target).
2. ``propose(ctx, max_drafts) -> Proposal`` before every target forward. ``max_drafts [B]`` is the
   most each row may offer (so output never runs past ``max_new_tokens``).
3. ``observe(ctx, feedback)`` after every verification, with per-row offered/accepted counts.
4. ``select_rows(rows)`` when finished rows leave the batch (per-row state must follow).

Built-in generators live in ``candidate_generators/`` and use nothing beyond this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .sampling import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from .state import ModelState


def token_id_list(ids) -> list[int]:
    """An id setting as found in configs and tokenizers (None, an int, a list or a tensor) -> list."""
    if ids is None:
        return []
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


@dataclass
class Proposal:
    token_ids: torch.Tensor  # [B, K] long, padded past each row's length
    lengths: torch.Tensor  # [B] long, valid drafts per row (0 allowed)
    probs: torch.Tensor | None = None  # [B, K, target_vocab] draft distribution, None = point masses

    @classmethod
    def empty(cls, batch: int, device: torch.device | str = "cpu") -> "Proposal":
        return cls(torch.zeros(batch, 0, dtype=torch.long, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device))


@dataclass
class Feedback:
    offered: torch.Tensor  # [B] drafts each row offered after clamping
    accepted: torch.Tensor  # [B] drafts each row had accepted


@dataclass
class DecodeContext:
    """What a generator may read and use during one ``generate()`` call."""

    target: Any
    tokenizer: Any
    draft_tokenizer: Any
    sampling: SamplingParams
    generator: torch.Generator | None
    target_state: "ModelState"
    model_inputs: dict[str, Any]
    _attach: Any = None

    @property
    def tokens(self) -> torch.Tensor:
        """[B, capacity] committed tokens, row b valid in ``[:lengths[b]]`` (prompt included)."""
        return self.target_state.tokens

    @property
    def lengths(self) -> torch.Tensor:
        """[B] committed length per row. During ``propose`` the target holds no drafts yet."""
        return self.target_state.lengths

    @property
    def batch_size(self) -> int:
        return self.target_state.batch_size

    @property
    def target_vocab_size(self) -> int:
        return int(self.target.get_output_embeddings().weight.shape[0])

    def attach(self, model, tokens: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
               pad_token_id: int | None = None) -> "ModelState":
        """Hand an assistant model to the controller and get its :class:`ModelState`.

        Without ``tokens`` the assistant shares the target's token ids: the controller rolls it
        back to the committed prefix after every verification. With ``tokens [B, L]`` and
        ``lengths [B]`` (another tokenizer's ids) the generator keeps it in sync itself, with
        ``state.sync`` / ``state.rollback`` / ``state.append``. Either way the controller builds
        its cache, routes prefill-only inputs to its first forward, and drops finished rows.
        """
        return self._attach(model, tokens, lengths, pad_token_id)


class CandidateGenerator:
    """Base class of every candidate generator (built-in or third-party)."""

    name: ClassVar[str] = ""

    def setup(self, ctx: DecodeContext) -> None:
        """Called at the start of every ``generate()``; validate here, before any forward."""

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        raise NotImplementedError

    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        """Called after every verification."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of any per-row state."""


class NoDraft(CandidateGenerator):
    """Proposes nothing: the loop degenerates to plain decoding (mean accepted length 1.0)."""

    name = "none"

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        return Proposal.empty(ctx.batch_size, ctx.tokens.device)


class DraftLengthSchedule:
    """Per-row number of drafts K: ``fixed``, or ``adaptive`` (+2 after a fully accepted block,
    -1 otherwise, never below 1; the heuristic ``transformers`` uses), capped at ``max_tokens``."""

    KINDS = ("fixed", "adaptive")

    def __init__(self, num_tokens: int, kind: str = "fixed", max_tokens: int = 32):
        if kind not in self.KINDS:
            raise ValueError(f"schedule must be one of {self.KINDS}, got {kind!r}")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.initial, self.kind, self.max_tokens = int(num_tokens), kind, max(int(max_tokens), int(num_tokens))
        self.current = torch.empty(0, dtype=torch.long)

    def reset(self, batch: int) -> None:
        self.current = torch.full((batch,), self.initial, dtype=torch.long)

    def update(self, feedback: Feedback) -> None:
        if self.kind == "fixed":
            return
        offered, accepted = feedback.offered.cpu(), feedback.accepted.cpu()
        full = (accepted == offered) & (offered > 0)
        tried = offered > 0
        grown = torch.where(full, self.current + 2, self.current - 1).clamp(1, self.max_tokens)
        self.current = torch.where(tried, grown, self.current)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.current = self.current[rows.cpu()]
