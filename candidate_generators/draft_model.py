"""``draft_model``: a smaller causal LM with the target's tokenizer drafts K tokens.

The assistant is attached to the controller, which owns its cache; the generator holds only an
:class:`~specdec.assistant.Assistant` handle. The assistant is prefilled once, on the first call
to ``propose``, then drafts one token per forward on its own cache. After every verification the
controller brings it to the committed prefix, so it is never fed a token it already holds (only
the target's new token, and the last draft when all were accepted).

Each step it drafts one token at a time and asks ``ctx.keep_drafting`` after each, with its own
probabilities of the drafts so far: the core's policy ends the block where another draft no longer
pays, and at once after a drafted end of sequence. It drafts from its logits after the call's
logits processors (``ctx.scores``: a repetition penalty, banned n-grams, the sampling warpers, as
the target's scores get them), so its drafts agree with the target's processed choice.

Vocabularies may be padded to different sizes; drafts are restricted to the ids both models
have. A draft with a different tokenizer is refused (that needs a cross-tokenizer generator).

``weights=`` (``"w8a8"``, ``"bfloat16"``, ... see ``specdec/engines/forwards/lowbit.py``) drafts with a copy of the draft at
that precision instead, built once per decoder (the draft model is only read) and stepped
compiled on a static cache (``compile_draft``): on a CPU a w8a8 copy of a small draft steps
several times faster than the draft itself.
"""

from __future__ import annotations

import torch

from specdec.copies import LowPrecisionDraft
from specdec.generators import (CandidateGenerator, DecodeContext, DraftingInfo, DraftLengthSchedule, Feedback,
                                Proposal, token_id_list, vocab_size)
from specdec.registry import register_candidate_generator
from specdec.sampling import sample

#: vocabularies whose sizes differ by more than this are not "the same tokenizer, padded"
MAX_VOCAB_PADDING = 1024


def tokenizer_mismatch(target, draft, tokenizer, draft_tokenizer) -> str | None:
    """Why ``draft`` cannot draft for ``target`` token for token, or None."""
    if tokenizer is not None and draft_tokenizer is not None and tokenizer is not draft_tokenizer:
        if tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            return "the target and draft tokenizers have different vocabularies"
    vt, vd = vocab_size(target), vocab_size(draft)
    if abs(vt - vd) > MAX_VOCAB_PADDING:
        return f"vocabulary sizes differ beyond padding ({vt} vs {vd})"
    eos_t = token_id_list(target.generation_config.eos_token_id)
    eos_d = token_id_list(draft.generation_config.eos_token_id)
    if eos_t and eos_d and not set(eos_t) & set(eos_d):
        return f"end-of-sequence ids differ ({eos_t} vs {eos_d})"
    return None


@register_candidate_generator("draft_model")
class DraftModelGenerator(LowPrecisionDraft, CandidateGenerator):
    def __init__(self, draft, *, num_tokens: int = 5, schedule: str = "auto", max_tokens: int = 16,
                 weights: str | None = None, compile_draft: bool | dict | None = None):
        if not isinstance(draft, torch.nn.Module):
            raise TypeError("draft_model needs a draft model: SpecDecoder(target, draft_model)")
        self.draft = draft
        self.schedule = DraftLengthSchedule(num_tokens, schedule, max_tokens)
        self.assistant = None
        self._init_precision(weights, compile_draft)

    def drafting(self) -> DraftingInfo:
        # stepwise: its own probability of each draft ends the block (ctx.keep_drafting)
        return DraftingInfo(max_drafts=self.schedule.policy_drafts, stepwise=True)

    def source_model(self, ctx: DecodeContext):
        """The model whose weights draft (at ``weights`` precision, if set)."""
        return self.draft

    def setup(self, ctx: DecodeContext) -> None:
        source = self.source_model(ctx)
        problem = tokenizer_mismatch(ctx.target, source, ctx.tokenizer, ctx.draft_tokenizer)
        if problem:
            raise ValueError(f"draft_model needs the target's tokenizer: {problem}. A draft with another "
                             "tokenizer needs the cross-tokenizer generator (pass tokenizer= and draft_tokenizer=).")
        self.draft = self.drafting_model(source, ctx)
        self.shared_vocab = min(vocab_size(ctx.target), vocab_size(self.draft))
        self.target_vocab = ctx.target_vocab_size
        self.assistant = ctx.attach(self.draft, **self.attach_options())
        self.schedule.reset(ctx.batch_size)

    def attach_options(self) -> dict:
        """How the draft keeps its cache (see ``DecodeContext.attach``): the call's own, unless
        it drafts compiled (``compile_draft``; a low-precision copy by default)."""
        return self.precision_attach_options()

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        lengths = torch.minimum(self.schedule.current.to(max_drafts.device), max_drafts).clamp_min(0)
        k = int(lengths.max())
        if k == 0:
            return Proposal.empty(ctx.batch_size, max_drafts.device)
        ids, probs, confidence = [], [], []
        for i in range(k):
            logits = self.assistant.next_logits()[:, : self.shared_vocab].float()  # [B, V]
            logits = ctx.scores(logits, torch.stack(ids, dim=1) if ids else None)  # the target's processors
            if ctx.sampling.do_sample:
                p = ctx.probs(logits)
                token = sample(p, ctx.generator)
                probs.append(torch.nn.functional.pad(p, (0, self.target_vocab - self.shared_vocab)))
                confidence.append(p.gather(1, token[:, None]))  # [B, 1]: the draft's own probability of it
            else:  # the argmax (the first of equal maxima) and its softmax probability, without the softmax
                top, token = logits.max(dim=-1)
                confidence.append(torch.exp(logits - top[:, None]).sum(dim=-1, keepdim=True).reciprocal())
            ids.append(token)
            if i + 1 < k and not ctx.keep_drafting(torch.stack(ids, dim=1), torch.cat(confidence, dim=1), lengths):
                break
            if i + 1 < k:  # the last draft is fed next step, and only if the target accepts it
                self.assistant.feed(token)
        token_ids = torch.stack(ids, dim=1)  # [B, k']
        return Proposal(token_ids, lengths.clamp(max=len(ids)), torch.stack(probs, dim=1) if probs else None,
                        confidence=torch.cat(confidence, dim=1))

    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        self.schedule.update(feedback)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.schedule.select_rows(rows)
