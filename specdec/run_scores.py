"""ScoreSteps: a verified block's scores, as ``generate()`` computes them, and a chain's verdict.

A mixin of :class:`~specdec.run.DecodeRun`: its methods read the run's target, settings and
processors. It turns the target's logits into the processed scores at each position (and a
drafter's logits into the target's processed scores, ``DecodeContext.scores``), finds the
positions a grammar leaves without any allowed token, and verifies a chain: greedily or by
speculative sampling.
"""

from __future__ import annotations

import torch

from .grammar import no_allowed_token
from .verify import Verdict, greedy_verify, speculative_sample


class ScoreSteps:
    def _scores(self, logits: torch.Tensor, draft_ids: torch.Tensor, offered: torch.Tensor,
                committed: torch.Tensor) -> torch.Tensor:
        """logits [B, k+1, V] -> the scores ``generate()`` would sample or take the argmax of at each
        position (the processors given the committed tokens and the drafts before it); the logits
        themselves when the call has no processors."""
        if self.processors is None:
            # generate()'s scores are the float32 logits; only what records or shows them needs the copy
            # (a bfloat16 target's argmax is the same, and sampling upcasts for itself)
            keep = self.recorder or self.stopper.history is not None
            return logits.float() if keep else logits
        target = self.target
        pos = self.processors.positions(target.tokens, committed, self.prompt_lengths, self.row_ids, draft_ids,
                                        offered + 1)
        return self.processors.apply(logits.float(), pos)

    def _draft_scores(self, logits: torch.Tensor, drafts: torch.Tensor | None) -> torch.Tensor:
        """A drafter's logits [B, V'] at the position after the committed tokens and ``drafts [B, i]``
        -> the target's processors applied there ([B, V']; ``DecodeContext.scores``)."""
        target, width = self.target, logits.shape[-1]
        drafts = drafts if drafts is not None else target.tokens.new_zeros(target.batch_size, 0)
        full = torch.nn.functional.pad(logits.float(), (0, self.vocab - width), value=-float("inf")) \
            if width < self.vocab else logits[:, : self.vocab].float()  # [B, V]: the processors' width
        i = drafts.shape[1]
        pos = self.processors.positions(target.tokens, target.lengths, self.prompt_lengths, self.row_ids,
                                        drafts.to(target.device), torch.full_like(target.lengths, i + 1), first=i)
        scores = self.processors.apply(full[:, None], pos)[:, 0, :width].float()
        # a position where the processors allow nothing (a grammar's dead end, found when verified):
        # any finite scores do for a proposal, none of whose drafts can then be kept
        return scores.masked_fill(scores.amax(dim=-1, keepdim=True).isneginf(), 0.0)

    def _dead_ends(self, scores: torch.Tensor, offered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Under a grammar, the positions of a block where the processed scores [B, k+1, V] allow
        no token at all -> (the drafts to verify [B]: none at or after a row's first such
        position, which is then the furthest a verdict can reach; that first position [B], k+1
        where none), or (offered, None) when there is none. ``generate()`` would take token 0
        there and go on unconstrained; the run stops instead if a row commits that position."""
        if self.processors is None or self.processors.grammar is None:
            return offered, None
        cols = torch.arange(scores.shape[1], device=scores.device)[None, :]
        dead = scores.amax(dim=-1).isneginf() & (cols <= offered[:, None])  # [B, k+1]
        if not bool(dead.any()):
            return offered, None
        first = torch.where(dead.any(1), dead.float().argmax(1), scores.shape[1])  # [B]
        return torch.minimum(offered, first.to(offered.dtype)), first

    def _refuse_dead_end(self, dead: torch.Tensor, kept: torch.Tensor, committed: torch.Tensor) -> None:
        """Raise where a row committed a token chosen at a position its grammar and processors
        left without any allowed token (``dead`` [B], from :meth:`_dead_ends`)."""
        reached = (kept > dead).nonzero().flatten().tolist()
        if reached:
            b = reached[0]
            # through the ranks: on a sharded target every rank raises it at the next message, the groups kept
            self.ranks.fail(no_allowed_token(int(self.row_ids[b]),
                                             int(committed[b] - self.prompt_lengths[b] + dead[b]) + 1))

    def _verify(self, scores: torch.Tensor, draft_ids: torch.Tensor, offered: torch.Tensor, proposal,
                dead: torch.Tensor | None = None) -> Verdict:
        """scores [B, k+1, V] (processed, or the raw logits without processors) -> the verdict;
        ``dead`` [B] a position that allows no token (:meth:`_dead_ends`) scored as any other
        (uniform), since a verdict that reaches it ends the run."""
        sampling = self.settings.sampling
        if dead is not None:
            cols = torch.arange(scores.shape[1], device=scores.device)[None, :, None]
            scores = scores.masked_fill(cols == dead[:, None, None], 0.0)
        if not sampling.do_sample:
            return greedy_verify(scores, draft_ids, offered)
        k = draft_ids.shape[1]
        draft_probs = proposal.probs[:, :k].to(scores.device) if proposal.probs is not None else None
        # with processors the warpers are among them, as in generate() (which samples from the softmax
        # of whatever dtype they return, float16 included: held in float32 here, the same numbers)
        target_probs = torch.softmax(scores, dim=-1) if self.processors is not None else sampling.probs(scores)
        if target_probs.dtype in (torch.float16, torch.bfloat16):
            target_probs = target_probs.float()
        return speculative_sample(target_probs, draft_ids, offered, draft_probs, self.settings.generator)
