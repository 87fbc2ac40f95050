"""How often drafts are accepted: learnt per source of drafts, row and position while decoding.

:class:`AcceptanceTracker` keeps, per source of drafts (a generator may name several: prompt
lookup, then a draft model where lookup finds nothing), row and draft position, decayed counts
of drafts offered and accepted, pulled towards the source's prior; its estimate is the
conditional acceptance a_i of the policy's model (docs/draft_length.md). A source none of whose
drafts has been verified yet is priced at :data:`UNTRIED` (or its prior if higher), so that a
draft which pays only where it agrees is tried once and then judged on its record.
:class:`ConfidenceCalibration` learns how acceptance varies with the drafter's own probability
of a draft, pooled over rows.

Invariants: estimates lie in [0, 1]; counts decay every step, also for a row that did not draft
(more slowly), so a row that stopped drafting drifts back to the prior and probes again; a
drafter's confidence changes nothing until it has been seen to mean something.
"""

from __future__ import annotations

import torch

from ..host import host_ints

#: acceptance at which a source of drafts is priced until one of its drafts has been verified (its
#: prior, if higher): a draft whose worth is unknown is tried once where it would pay if it agreed
#: with the target this often, and its record decides from then on
UNTRIED = 0.8
#: the most a draft past the first of an untried source is priced at (its prior, if lower): a try
#: is a short block, since where the source does not agree every draft of it is lost
UNTRIED_DEEP = 0.5


class AcceptanceTracker:
    """Per source of drafts, row and draft position, decayed counts of drafts offered and accepted
    (with a prior per source).

    A generator with several sources (prompt lookup, then a draft model where lookup finds
    nothing) names each row's source in ``Proposal.sources``; each source's acceptance is learnt
    apart, so a source that is seldom right shortens its own blocks, not the other's.
    A row that drafted from a source forgets that source at ``decay`` per step; otherwise it
    forgets slowly (``idle_decay``), so after a run of rejections its estimate climbs back to the
    prior over a few dozen steps and it probes again, rarely enough to cost little where drafting
    never pays.

    With ``untried`` (a run passes :data:`UNTRIED`), until a source's first drafts have been
    verified (in any row) its first position is priced at ``untried`` (or its prior if higher),
    deeper ones at its prior, at most :data:`UNTRIED_DEEP`: the prior is what a source is worth on
    average, but a source that pays only on text it agrees with would never be tried at it, and
    one verified block settles the question. Deeper positions stay low so that the try is a short
    block: where the source does not agree, a long one cost a whole step or more
    (docs/draft_length.md).
    """

    def __init__(self, batch: int, positions: int, *, prior: float | tuple[float, ...] = 0.5,
                 prior_weight: float = 2.0, decay: float = 0.9, idle_decay: float = 0.97,
                 untried: float | None = None):
        self.priors = tuple(float(p) for p in (prior if isinstance(prior, (tuple, list)) else (prior,)))
        # [S][B][K] plain numbers: the loop updates and reads them every step, a few hundred at most
        self.offered = [[[0.0] * positions for _ in range(batch)] for _ in self.priors]
        self.accepted = [[[0.0] * positions for _ in range(batch)] for _ in self.priors]
        self.positions = positions
        self.prior_weight, self.decay, self.idle_decay = prior_weight, decay, idle_decay
        # per source: the acceptance it is priced at before any of its drafts was verified (None: tried)
        self.untried: list[float | None] = [max(p, untried) if untried is not None else None for p in self.priors]

    def estimate(self, sources: torch.Tensor | None = None) -> torch.Tensor:
        """[B, K] conditional acceptance per position of row b's source ``sources[b]`` (default:
        source 0). Position 1's prior is the source's prior; position i's is the estimate at
        position i-1, so positions rarely reached borrow from the shallower ones (conditional
        acceptance seldom falls with depth: a copy that held for i-1 tokens tends to hold on)."""
        return torch.tensor(self.estimate_rows(sources), dtype=torch.float64).reshape(self.batch, self.positions)

    @property
    def batch(self) -> int:
        return len(self.offered[0])

    def estimate_rows(self, sources: torch.Tensor | list[int] | None = None) -> list[list[float]]:
        """:meth:`estimate` as lists of plain numbers [B][K] (what the policy computes with)."""
        w = self.prior_weight
        batch = self.batch
        if sources is None:
            picks = [0] * batch
        else:
            picks = host_ints(sources) if isinstance(sources, torch.Tensor) else list(sources)
        rows = []
        for b, s in enumerate(picks):  # plain floats: B x K is small
            if self.untried[s] is not None:  # the first draft at the optimistic price, deeper ones below it
                rows.append([self.untried[s]] + [min(self.priors[s], UNTRIED_DEEP)] * (self.positions - 1))
                continue
            rate, row = self.priors[s], []
            for a, o in zip(self.accepted[s][b], self.offered[s][b]):
                rate = (a + rate * w) / (o + w)
                row.append(rate)
            rows.append(row)
        return rows

    def update(self, offered: torch.Tensor, accepted: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        """offered [B], accepted [B] drafts of this step, drafted by ``sources [B]`` (default:
        source 0); position i is tried if offered > i and every earlier draft was accepted."""
        offers, accepts = host_ints(offered), host_ints(accepted)
        picks = [0] * len(offers) if sources is None else host_ints(sources)
        for s, (offered_s, accepted_s) in enumerate(zip(self.offered, self.accepted)):
            for b, (offer, accept, pick) in enumerate(zip(offers, accepts, picks)):
                drafted = pick == s and offer > 0
                keep = self.decay if drafted else self.idle_decay
                row_offered, row_accepted = offered_s[b], accepted_s[b]
                for i in range(self.positions):
                    tried = drafted and i < offer and i <= accept
                    row_offered[i] = row_offered[i] * keep + (1.0 if tried else 0.0)
                    row_accepted[i] = row_accepted[i] * keep + (1.0 if drafted and i < accept else 0.0)
                if drafted:  # a source verified this step
                    self.untried[s] = None

    def select_rows(self, rows: torch.Tensor) -> None:
        rows = rows.tolist()
        self.offered = [[source[r] for r in rows] for source in self.offered]
        self.accepted = [[source[r] for r in rows] for source in self.accepted]


class ConfidenceCalibration:
    """Per source of drafts, how a draft's acceptance varies with the drafter's own probability of
    it (``Proposal.confidence``): decayed counts of drafts reached and accepted in ``bins``
    equal-width bins of confidence, pooled over rows (it describes the drafter, not the row's
    text). :meth:`factor` is a bin's acceptance over the source's overall acceptance, each bin
    starting at the overall rate (factor 1): a drafter's confidence changes nothing until it has
    been seen to mean something. Why: a drafter that is unsure of a token is the one likely to
    disagree with the target (docs/draft_length.md, "The drafter's own probability")."""

    def __init__(self, priors: tuple[float, ...], bins: int = 10, prior_weight: float = 4.0, decay: float = 0.99):
        self.priors = tuple(float(p) for p in priors)
        self.offered = [[0.0] * bins for _ in self.priors]  # [S][bins]
        self.accepted = [[0.0] * bins for _ in self.priors]
        self.bins, self.prior_weight, self.decay = bins, prior_weight, decay

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.bins), 0), self.bins - 1)

    def factor(self, confidence: float, source: int = 0) -> float:
        """A draft given ``confidence`` is accepted this many times as often as the source's drafts overall."""
        w = self.prior_weight
        overall = (sum(self.accepted[source]) + self.priors[source] * w) / (sum(self.offered[source]) + w)
        b = self._bin(confidence)
        return (self.accepted[source][b] + overall * w) / (self.offered[source][b] + w) / overall

    def update(self, confidence: torch.Tensor, offered: torch.Tensor, accepted: torch.Tensor,
               sources: torch.Tensor | None = None) -> None:
        """confidence [B, K] (NaN where a draft has none), offered [B], accepted [B] of one step:
        row b's draft i was reached (verified with every earlier one accepted) if i <= accepted[b]
        and i < offered[b]."""
        picks = [0] * confidence.shape[0] if sources is None else host_ints(sources)
        for s in set(picks):
            self.offered[s] = [x * self.decay for x in self.offered[s]]
            self.accepted[s] = [x * self.decay for x in self.accepted[s]]
        for conf, off, acc, s in zip(confidence.cpu().tolist(), host_ints(offered), host_ints(accepted), picks):
            for i, c in enumerate(conf[: min(off, acc + 1)]):
                if c == c:  # not NaN
                    b = self._bin(c)
                    self.offered[s][b] += 1.0
                    self.accepted[s][b] += float(i < acc)
