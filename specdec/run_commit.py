"""CommitSteps: a step's end: the verdict committed, then heard by everyone who learns from it.

A mixin of :class:`~specdec.run.DecodeRun`: its methods read the run's states, stopper, session
and policy. It builds the committed block, cuts it where rows stop and commits it to the
target's cache; the step's record then goes to the statistics, the streamer, the followers, the
generator and the policy.
"""

from __future__ import annotations

import time

import torch

from .generators import StepRecord
from .host import host_ints, host_long, hosted, read_rows
from .verify import Verdict


class CommitSteps:
    def _commit(self, scores: torch.Tensor, draft_ids: torch.Tensor, verdict: Verdict, committed: torch.Tensor,
                chain: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict]:
        """-> (block [B, k+1]: the accepted drafts, then the target's token; kept [B]: how much of
        it each row keeps (cut where it stops; a stopped row that ``generate()`` would not pad
        goes on); finished [B] bool: the rows that leave the batch, None where no row can stop
        in this block; held: each synced follower's :meth:`ModelState.held` values, read with the
        verdict). The target's cache then holds the committed prefix. ``scores`` [B, k+1,
        V]: what the stopping criteria may see; ``chain``: the drafts were fed as a chain, so the
        target's tokens already hold them in place (a tree's accepted path is gathered into place)."""
        target = self.target
        block = torch.cat([draft_ids, verdict.next_token[:, None]], dim=1)  # [B, k+1]
        if draft_ids.shape[1]:  # the target's token after the accepted drafts
            block.scatter_(1, verdict.accepted[:, None], verdict.next_token[:, None])
        synced = [state for state in self.followers if state not in self.borrowers]
        held = [state.held(committed, block) for state in synced]  # read with the verdict: _observe's syncs
        rows, accepted, *held = read_rows(block, verdict.accepted, *held)  # the step's one read of the device
        done = [n - p for n, p in zip(host_ints(committed), host_ints(self.prompt_lengths))]  # new tokens before
        counts = host_long([a + 1 for a in accepted], block.device)
        if self.stopper.quiet(done, rows):  # most steps: every row keeps its block
            kept, finished = counts, None
        else:
            generated = host_long(done, block.device)
            keep, stopped = self.stopper.cut(target.tokens, committed, block, counts, self.prompt_lengths, scores)
            kept, finished = self.stopper.settle(generated, counts, keep, stopped)
        cached = hosted(committed + verdict.accepted, [n + a for n, a in zip(host_ints(committed), accepted)])
        target.commit(committed, block, kept, cached=cached, placed=verdict.accepted if chain and draft_ids.shape[1] else None)
        return block, kept, finished, dict(zip(synced, held))

    def _observe(self, record: StepRecord, block: torch.Tensor, committed: torch.Tensor, held: dict) -> None:
        """Everyone who learns from the step hears it: statistics, streamer, followers, generator, policy."""
        self._count(record)
        self.feed.tokens(block, record.kept)
        for state in self.followers:
            if state in self.borrowers:
                if not state.is_first_iteration:  # the first copy waits for drafts (_draft)
                    state.mirror(self.target)
            else:
                state.sync(self.target.tokens, self.target.lengths, since=committed, held=held.get(state))
        drafter = record.drafter_view()  # the generator's drafts only
        self.session.observe(self.ctx, drafter)
        if self.policy is not None:
            self.policy.observe(drafter)
        # keeping drafts in step is drafting work
        self.stats.draft_seconds += time.perf_counter() - record.started - record.drafting - record.verifying

    def _count(self, record: StepRecord) -> None:
        stats = self.stats
        offered, accepted = host_ints(record.offered), host_ints(record.accepted)
        stats.record_step(offered, accepted, host_ints(record.kept))
        if record.tree:
            stats.record_tree(offered, accepted)
        if record.grammar_drafts is not None:
            stats.record_grammar(record.grammar_drafts.tolist(), offered, accepted)
        record = record.drafter_view()
        stats.draft_seconds += record.drafting
        stats.verify_seconds += record.verifying
        stats.compile_seconds += record.compiling
        if not record.first and not record.compiling:  # the prefill's cost (or a compile's) is not a verification's
            stats.record_forward(record.fed, record.forward)
        if self.policy is not None and not record.waiting:  # no drafts asked for, or none of those offered verified
            stats.skipped_steps += sum(room > 0 and (asked == 0 or (candidates > 0 and offered == 0))
                                       for asked, candidates, offered, room in
                                       zip(*(host_ints(t) for t in (record.asked, record.candidates, record.offered,
                                                                    record.room))))
