"""DraftSteps: a step's drafting, from the policy's plan to the drafts the target verifies.

A mixin of :class:`~specdec.run.DecodeRun`: its methods read the run's states, settings, policy,
session and processors. It prices drafting once the assistants are attached, gives each row its
room and the drafts to ask for, has the generator propose, and admits the proposal: checked, cut
to what the target can take and the processors allow, to what is worth verifying and to what
the policy verifies, then extended by the tokens a grammar forces.
"""

from __future__ import annotations

import time

import torch

from .compiled import compile_seconds
from .generators import Proposal
from .grammar import with_grammar_drafts
from .host import host_ints, host_long
from .kv import CacheSettings
from .request import Prompt
from .validation import check_proposal

#: tokens an assistant may have pending before a proposal (the target's newest, the last draft, a
#: re-tokenized tail) for the proposal's time to count as drafting cost: more is catching up
CATCH_UP = 4


class DraftSteps:
    def _price(self, prompt: Prompt, cache: CacheSettings) -> None:
        """The policy prices drafting with the assistants attached, calibrating on the call's cache
        where it can; the graphs that calibration compiled count as compiling, not timing."""
        compiled_before = compile_seconds()
        self.stats.calibration_seconds += self.policy.price(
            self.target.model, [s.model for s in self.assistants], prompt.rows, prompt.lengths, cache,
            self.target.kv.slots, kv=self.target.kv)
        compiled = compile_seconds() - compiled_before
        self.stats.calibration_seconds -= compiled
        self.stats.compile_seconds += compiled

    def _room(self) -> torch.Tensor:
        """[B] the drafts each row may take: none past its budget (or past the stop of the last row
        to stop, when every row has stopped and some go on unpadded: specdec/stopping.py), none past
        the model's learned positions."""
        target, end, limit = self.target, self.stopper.end(), self.target.position_limit
        room = [end - (n - p) - 1 for n, p in zip(host_ints(target.lengths), host_ints(self.prompt_lengths))]
        if limit is not None:  # learned positions: none fed past them
            room = [min(r, max(limit - n, 0)) for r, n in zip(room, host_ints(target.lengths))]
        return host_long(room, target.device)

    def _plan(self, room: torch.Tensor, pending: int, context: int) -> torch.Tensor:
        """[B] the drafts to ask each row for: the policy's plan, or all a row may take without one;
        none while assistants that borrow the target's prefill wait for it."""
        if self.policy is None:
            asked = room
        else:
            prefills = [max(host_ints(s.lengths)) * s.batch_size if s.is_first_iteration and s not in self.borrowers
                        else 0 for s in self.assistants]  # tokens each assistant has yet to prefill
            asked = self.policy.plan(room, pending, context, prefills)
        if self.target.is_first_iteration and self.borrowers:  # they draft once they hold the target's prefill
            return host_long([0] * room.shape[0], room.device)
        return asked

    def _catching_up(self, asked: torch.Tensor) -> bool:
        """Whether an assistant prefills (it has not yet run), catches up on steps it sat out, or
        takes the target's cache for the first time (drafts ``asked`` [B] of it) in this proposal:
        either way the proposal's time says nothing of a draft's cost."""
        return any((s.is_first_iteration and max(host_ints(asked)) > 0) if s in self.borrowers
                   else s.is_first_iteration or s.pending_width() > CATCH_UP for s in self.assistants)

    def _draft(self, asked: torch.Tensor, room: torch.Tensor) -> tuple[Proposal, float, tuple[torch.Tensor, ...]]:
        """Propose and admit -> (proposal, when propose returned, (made, candidates, offered) [B] each);
        under a grammar, the drafts it forbids cut and the tokens it forces added. An assistant
        that borrows the target's cache takes it the first time drafts are asked for (a call
        that never drafts never copies it)."""
        waiting = [state for state in self.borrowers if state.is_first_iteration]
        if waiting and max(host_ints(asked)) > 0:
            for state in waiting:
                state.mirror(self.target)
        proposal = self.session.propose(self.ctx, asked)
        drafted = time.perf_counter()
        made, candidates, offered = self._admit(proposal, asked)
        if proposal.is_tree:
            proposal, offered = self._tree_or_chain(proposal, offered)
        if self.processors is not None and self.processors.grammar is not None and not proposal.is_tree:
            proposal, offered = self._constrain(proposal, offered, room)  # a tree's nodes are masked where verified
        return proposal, drafted, (made, candidates, offered)

    def _admit(self, proposal: Proposal, asked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A checked proposal -> (made, candidates, offered) [B] each: the drafts within ``asked``
        that the target can take, those worth verifying, those the policy verifies."""
        target = self.target
        check_proposal(proposal, self.plugin, target.batch_size, self.vocab, self.settings.sampling.do_sample,
                       len(self.drafting.priors))
        tree = proposal.is_tree
        if tree:
            self._check_tree(proposal)
        ids = proposal.token_ids.to(target.device)  # [B, K]
        # a tree's first nodes are a tree too (parents come first): a tree is cut like a chain
        made = host_long([max(min(n, a), 0) for n, a in zip(host_ints(proposal.lengths), host_ints(asked))],
                         target.device)
        made = target.admissible_drafts(ids, made)
        point = None  # [B, K]: which drafts are point masses, where asked
        if self.processors is not None and self.processors.hard and not tree:
            point = point_masses(proposal, ids)
            made = self._allowed(ids, made, point)
        # a tree's node after an end of sequence in node order may be its sibling: nothing cut
        candidates = made if tree else self.stopper.worth_verifying(ids, made)
        if self.policy is None:
            return made, candidates, candidates
        sources = proposal.sources.cpu() if proposal.sources is not None else None  # [B] or None: source 0
        return made, candidates, self.policy.admit(candidates, sources, self._pricing_confidence(proposal, ids, point))

    def _pricing_confidence(self, proposal: Proposal, ids: torch.Tensor,
                            point: torch.Tensor | None) -> torch.Tensor | None:
        """The confidences the policy may size the verified block by: under sampling, none of a draft
        drawn from a distribution (NaN), since whether a drawn draft is verified must not depend on
        what was drawn (its own probability, or a later draft's): speculative sampling is exact only
        so. Point masses (a lookup's) keep theirs, as every draft does under greedy decoding."""
        confidence = proposal.confidence
        if confidence is None or proposal.probs is None or not self.settings.sampling.do_sample:
            return confidence  # no confidence, no draws (point masses), or greedy decoding
        point = point_masses(proposal, ids) if point is None else point
        drawn = torch.zeros(confidence.shape, dtype=torch.bool, device=confidence.device)  # [B, K'] (K' >= K)
        drawn[:, : point.shape[1]] = ~point.to(confidence.device)
        return confidence.masked_fill(drawn, float("nan"))

    def _constrain(self, proposal: Proposal, offered: torch.Tensor,
                   room: torch.Tensor) -> tuple[Proposal, torch.Tensor]:
        """The grammar's walk over the offered drafts (specdec/grammar.py) -> the proposal to verify
        (``grammar_drafts`` [B]: the trailing drafts it proposed), its drafts per row [B]."""
        target = self.target
        committed = [target.tokens[b, p:n].tolist() for b, (p, n) in
                     enumerate(zip(self.prompt_lengths.tolist(), target.lengths.tolist()))]
        room = room.clamp_min(0)
        if self.drafting.max_drafts is not None:  # the most a sharded target's ranks exchange
            room = room.clamp_max(self.drafting.max_drafts)
        rows, taken = self.processors.extend(proposal.token_ids, offered, committed, self.row_ids.tolist(),
                                             room.tolist(), point_masses(proposal, proposal.token_ids).tolist())
        proposal = with_grammar_drafts(proposal, rows, taken)
        return proposal, proposal.lengths.to(offered.device)

    def _allowed(self, ids: torch.Tensor, made: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
        """made [B] cut at the first draft a processor forbids whatever the logits (a bad word, a
        repeated n-gram): before it where it is a point mass (``point [B, K]``: a lookup's), after
        it where the drafter drew it from a distribution, which the verifier then rejects,
        sampling from what that distribution leaves of the target's. Cutting such a draft would
        sample its position from the target's whole distribution whenever the draw was forbidden:
        biased. Dropping point masses keeps the output as it is."""
        target, k = self.target, int(made.max())
        if k == 0 or not bool(point[:, :k].any()):
            return made  # nothing to drop: a forbidden draw's rejection is left to the verifier
        pos = self.processors.positions(target.tokens, target.lengths, self.prompt_lengths, self.row_ids,
                                        ids[:, :k], made)
        cut = self.processors.allowed_drafts(ids[:, :k], made, pos, self.vocab)  # [B]
        drawn = ~point[:, :k].gather(1, cut.clamp(max=k - 1)[:, None].to(point.device))[:, 0].to(made.device)
        return torch.where((cut < made) & drawn, cut + 1, cut)


def point_masses(proposal: Proposal, ids: torch.Tensor) -> torch.Tensor:
    """[B, K] bool: whether each draft of ``ids [B, K]`` is a point mass (drafted with no
    distribution of its own, or with all of its draft probability on it)."""
    if proposal.probs is None:
        return torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    k = min(ids.shape[1], proposal.probs.shape[1])
    at = proposal.probs[:, :k].gather(2, ids[:, :k, None].to(proposal.probs.device))[..., 0] >= 1.0
    return torch.nn.functional.pad(at.to(ids.device), (0, ids.shape[1] - k), value=True)
