"""``prompt_lookup``: copy what followed the latest earlier occurrence of the current suffix.

For each row, try n-grams from ``max_ngram`` down to ``min_ngram``: take the row's last n tokens,
find their most recent earlier occurrence in prompt + generated text, and propose the tokens that
followed it. No model runs; the drafts are point masses, which the verifier handles losslessly.

How long a suffix matched says how far a copy is likely to hold, so under the cost-aware policy
each n-gram length is a source of its own (``Proposal.sources``; source 0 the longest): the
policy learns each one's acceptance apart and verifies long blocks after long matches, short
ones or none after short matches. Greedy SmolLM2-135M-Instruct on the 70 turns of
``benchmarks/configs/spec_bench_smollm2.yaml``, the first draft after a match found by searching
n = 4..1 was accepted at 22% after a 1-token match, 50% after 2, 63% after 3, 85% after 4
(``NGRAM_PRIOR`` holds them rounded).
"""

from __future__ import annotations

import torch

from specdec.generators import CandidateGenerator, DecodeContext, DraftLengthSchedule, Feedback, Proposal
from specdec.registry import register_candidate_generator


#: the acceptance prior of a draft that follows a match of n tokens (the longest listed for longer
#: ones): what the first draft after such a match scored in the run quoted in the module docstring
NGRAM_PRIOR = {1: 0.25, 2: 0.5, 3: 0.65, 4: 0.8}


def lookup_match(sequence: torch.Tensor, max_ngram: int, min_ngram: int, count: int) -> tuple[int, torch.Tensor]:
    """sequence [L] -> (n, drafts): the length n of the longest suffix (``max_ngram`` down to
    ``min_ngram``) seen earlier, and up to ``count`` tokens that followed its latest earlier
    occurrence; (0, empty) when none is."""
    length = sequence.shape[0]
    for n in range(max_ngram, min_ngram - 1, -1):
        if length <= n:
            continue
        suffix = sequence[length - n:]
        windows = sequence[: length - 1].unfold(0, n, 1)  # [L-n, n]: windows with a next token
        hits = (windows == suffix).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return n, sequence[start: start + count]
    return 0, sequence[:0]


def lookup(sequence: torch.Tensor, max_ngram: int, min_ngram: int, count: int) -> torch.Tensor:
    """sequence [L] -> up to ``count`` tokens that followed the latest earlier match of its suffix."""
    return lookup_match(sequence, max_ngram, min_ngram, count)[1]


def ngram_prior(n: int) -> float:
    return NGRAM_PRIOR[min(n, max(NGRAM_PRIOR))]


def ngram_source(max_ngram: int, n: int) -> int:
    """The source of a match of n tokens when n-grams up to ``max_ngram`` are tried: 0 the longest
    (and rows without a match, n = 0)."""
    return max_ngram - n if n else 0


@register_candidate_generator("prompt_lookup")
class PromptLookupGenerator(CandidateGenerator):
    # Defaults chosen on SmolLM2-135M / 2 CPU cores with Spec-Bench prompts (docs/benchmarks.md,
    # docs/draft_length.md): matches of at least two tokens (after one, the first draft was right
    # 22% of the time, too seldom to pay for a wider forward there), and up to four, the longest
    # tried first: a four-token match is the surest source (85%), and replaying the policy on
    # recorded outputs (benchmarks/replay_policy.py) put n-grams 4..2 about 1% above 3..2.
    def __init__(self, *, num_tokens: int = 4, max_ngram: int = 4, min_ngram: int = 2,
                 schedule: str = "auto", max_tokens: int = 10):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.schedule = DraftLengthSchedule(num_tokens, schedule, max_tokens)

    def setup(self, ctx: DecodeContext) -> None:
        self.schedule.reset(ctx.batch_size)

    def acceptance_prior(self) -> tuple[float, ...]:
        """One source per match length, the longest first (``Proposal.sources`` = max_ngram - n)."""
        return tuple(ngram_prior(n) for n in range(self.max_ngram, self.min_ngram - 1, -1))

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        budget = torch.minimum(self.schedule.current, max_drafts.cpu()).tolist()
        tokens, lengths = ctx.tokens, ctx.lengths.tolist()
        found = [lookup_match(tokens[b, : lengths[b]], self.max_ngram, self.min_ngram, budget[b]) if budget[b] > 0
                 else (0, tokens.new_empty(0)) for b in range(len(lengths))]
        proposal = Proposal.from_rows([drafts for _, drafts in found], tokens.device)
        proposal.sources = torch.tensor([ngram_source(self.max_ngram, n) for n, _ in found], dtype=torch.long)
        return proposal

    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        self.schedule.update(feedback)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.schedule.select_rows(rows)
