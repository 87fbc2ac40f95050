"""``prompt_lookup``: copy what followed the latest earlier occurrence of the current suffix.

For each row, try n-grams from ``max_ngram`` down to ``min_ngram``: take the row's last n tokens,
find their most recent earlier occurrence in prompt + generated text, and propose the tokens that
followed it. No model runs; the drafts are point masses, which the verifier handles losslessly.
"""

from __future__ import annotations

import torch

from specdec.generators import CandidateGenerator, DecodeContext, DraftLengthSchedule, Feedback, Proposal
from specdec.registry import register_candidate_generator


def lookup(sequence: torch.Tensor, max_ngram: int, min_ngram: int, count: int) -> torch.Tensor:
    """sequence [L] -> up to ``count`` tokens that followed the latest earlier match of its suffix."""
    length = sequence.shape[0]
    for n in range(max_ngram, min_ngram - 1, -1):
        if length <= n:
            continue
        suffix = sequence[length - n:]
        windows = sequence[: length - 1].unfold(0, n, 1)  # [L-n, n]: windows with a next token
        hits = (windows == suffix).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return sequence[start: start + count]
    return sequence[:0]


@register_candidate_generator("prompt_lookup")
class PromptLookupGenerator(CandidateGenerator):
    # Defaults chosen on SmolLM2-135M / 2 CPU cores, 16 Spec-Bench prompts (docs/benchmarks.md):
    # verifying k drafts costs about 1 + k/8 plain steps there, so short adaptive blocks and
    # matches of at least two tokens beat a fixed K=10 with unigram matches.
    def __init__(self, *, num_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 2,
                 schedule: str = "auto", max_tokens: int = 10):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.schedule = DraftLengthSchedule(num_tokens, schedule, max_tokens)

    def setup(self, ctx: DecodeContext) -> None:
        self.schedule.reset(ctx.batch_size)

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        budget = torch.minimum(self.schedule.current, max_drafts.cpu()).tolist()
        tokens, lengths = ctx.tokens, ctx.lengths.tolist()
        found = [lookup(tokens[b, : lengths[b]], self.max_ngram, self.min_ngram, budget[b]) if budget[b] > 0
                 else tokens.new_empty(0) for b in range(len(lengths))]
        return Proposal.from_rows(found, tokens.device)

    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        self.schedule.update(feedback)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.schedule.select_rows(rows)
