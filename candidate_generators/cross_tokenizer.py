"""``cross_tokenizer``: a draft model with its own tokenizer drafts text; the target verifies its own tokens.

Method: string-level exact match (SLEM; Timor et al., "Accelerating LLM Inference with Lossless
Speculative Decoding Algorithms for Heterogeneous Vocabularies", ICML 2025). Each step the draft
decodes K tokens in its own vocabulary on its own cache; their text is re-tokenized with the
target's tokenizer into target ids, which go to the verifier as point masses
(``Proposal.probs = None``). The target's logits alone decide what is committed.

Guarantee. Greedy: the verifier commits the target's argmax at every position, so the output is
token for token ``target.generate(do_sample=False)`` whatever was proposed. Sampling: for a
point-mass draft d the verifier accepts with probability target_probs[d] and otherwise samples
from target_probs with d removed and renormalised, so the committed token has probability
target_probs[d] * [x = d] + (1 - target_probs[d]) * target_probs[x] [x != d] / (1 - target_probs[d])
= target_probs[x] for every x. This holds for any proposal that is a function of the committed
history and of randomness the verifier does not use, which is what the draft's samples are. So
no step of the text alignment can change the output distribution: a misalignment only costs
acceptance. How committed text and draft tokens are kept aligned per row: ``specdec/alignment.py``.

The user's models, tokenizers and configs are only read: nothing is pruned, re-indexed or set.
Batches of any size work: every row has its own text, marks and draft sequence.
"""

from __future__ import annotations

import torch

from specdec.alignment import REPLACEMENT, RowText, fast, leading_special_ids, text_after
from specdec.copies import LowPrecisionDraft
from specdec.generators import (CandidateGenerator, DecodeContext, DraftLengthSchedule, Feedback, Proposal,
                                token_id_list, vocab_size)
from specdec.modelinfo import eos_token_ids, pad_token_id
from specdec.multimodal import declared_inputs
from specdec.registry import register_candidate_generator
from specdec.sampling import sample

#: draft tokens of context when decoding drafted tokens (decoders that strip a leading space)
DECODE_CONTEXT = 4


@register_candidate_generator("cross_tokenizer")
class CrossTokenizerGenerator(LowPrecisionDraft, CandidateGenerator):
    """Drafts with a model whose tokenizer differs from the target's (string-level exact match).

    ``num_tokens`` is the number of draft-model tokens per step (the target tokens they spell may
    be fewer or more); ``schedule`` ``fixed`` or ``adaptive`` as for ``draft_model``. A row stops
    drafting early at a special token, and where the draft's probability of its own token falls
    below ``min_confidence`` (0 = never): a proposal may depend on anything but the target's
    randomness, so this is as lossless as the rest. The defaults (6, adaptive, 0.5) were the best
    of five settings tried on Gemma-3-270M + SmolLM2-135M, where every draft token and every
    verified position is expensive (docs/cross_tokenizer.md). ``report()`` counts steps, proposed
    target tokens and how each proposal was aligned (``anchored``, ``unanchored``, ``unaligned``).
    ``weights=`` drafts with a copy of the draft model at lower precision, ``compile_draft`` as
    for ``draft_model`` (``specdec/engines/forwards/lowbit.py``).
    """

    def __init__(self, draft_model, *, num_tokens: int = 6, schedule: str = "auto", max_tokens: int = 16,
                 min_confidence: float = 0.5, weights: str | None = None, compile_draft: bool | dict | None = None):
        if not isinstance(draft_model, torch.nn.Module):
            raise TypeError("cross_tokenizer needs a draft model: SpecDecoder(target, draft_model, "
                            "tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer)")
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.draft = draft_model
        self.min_confidence = float(min_confidence)
        self.schedule = DraftLengthSchedule(num_tokens, schedule, max_tokens)
        self.assistant = None
        self.rows: list[RowText] = []
        self.counts = {"steps": 0, "proposed": 0, "anchored": 0, "unanchored": 0, "unaligned": 0}
        self._init_precision(weights, compile_draft)

    # -- setup ---------------------------------------------------------------------------------
    def setup(self, ctx: DecodeContext) -> None:
        self._check(ctx)
        self.draft = self.drafting_model(self.draft)
        self.target_fast, self.draft_fast = fast(ctx.tokenizer), fast(ctx.draft_tokenizer)
        self.draft_vocab = min(len(ctx.draft_tokenizer), vocab_size(self.draft))  # ids past the tokenizer spell nothing
        self.target_vocab = ctx.target_vocab_size
        self.draft_stops = set(ctx.draft_tokenizer.all_special_ids)  # drafting text ends at any of these
        self.draft_eos = set(token_id_list(ctx.draft_tokenizer.eos_token_id)) | set(eos_token_ids(self.draft))
        target_eos = eos_token_ids(ctx.target) or token_id_list(ctx.tokenizer.eos_token_id)
        self.target_eos = target_eos[0] if target_eos else None
        lead = leading_special_ids(ctx.draft_tokenizer)
        pad = pad_token_id(self.draft)
        bos_or_eos = token_id_list(ctx.draft_tokenizer.bos_token_id) or token_id_list(ctx.draft_tokenizer.eos_token_id)

        self.rows, sequences = [], []
        for b in range(ctx.batch_size):
            row = RowText.start(self.target_fast, ctx.tokens[b, : int(ctx.lengths[b])].tolist())
            row_lead = lead or ((bos_or_eos or [pad])[:1] if not row.text else [])  # an empty text needs one token
            row.frozen = len(row_lead)
            tail, _ = row.retokenize(self.draft_fast)
            sequences.append(row_lead + tail)
            self.rows.append(row)
        width = max(len(s) for s in sequences)
        tokens = torch.full((ctx.batch_size, width), pad, dtype=torch.long, device=ctx.tokens.device)
        for b, s in enumerate(sequences):
            tokens[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long, device=ctx.tokens.device)
        self.assistant = ctx.attach(self.draft, tokens, lengths, pad_token_id=pad,
                                    **self.precision_attach_options())
        self.schedule.reset(ctx.batch_size)

    def _check(self, ctx: DecodeContext) -> None:
        if ctx.tokenizer is None or ctx.draft_tokenizer is None:
            raise ValueError("cross_tokenizer needs both tokenizers: SpecDecoder(target, draft_model, "
                             "tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer)")
        clash = sorted(set(ctx.model_inputs) & declared_inputs(self.draft))
        if clash:
            raise ValueError(f"model inputs {clash} are laid out in the target's tokens and cannot be routed to a "
                             "draft with another tokenizer; cross_tokenizer drafts from text only")

    # -- drafting ------------------------------------------------------------------------------
    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        device = max_drafts.device
        counts = torch.minimum(self.schedule.current.to(device), max_drafts).clamp_min(0)  # [B] draft tokens
        k = int(counts.max()) if counts.numel() else 0
        if k == 0:
            return Proposal.empty(ctx.batch_size, device)
        base = self.assistant.lengths  # [B] draft tokens before this step's drafts
        drafted, taken = self._draft(ctx, counts)
        proposals = []
        for b, row in enumerate(self.rows):
            ids = self._target_drafts(ctx, b, row, drafted[b][: int(taken[b])], int(base[b]))
            proposals.append(ids[: max(int(max_drafts[b]), 0)])
        proposal = Proposal.from_rows(proposals, device)
        self.counts["steps"] += 1
        self.counts["proposed"] += int(proposal.lengths.sum())
        return proposal

    def _draft(self, ctx: DecodeContext, counts: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
        """Run the draft until every row has ``counts[b]`` tokens or stopped early; -> (per-row
        draft-token ids, taken [B])."""
        taken = torch.zeros_like(counts)  # [B] drafts each row keeps
        active = counts > 0  # [B] rows still drafting
        stops = torch.tensor(sorted(self.draft_stops), dtype=torch.long, device=counts.device)
        drafted = []
        while bool(active.any()):
            logits = self.assistant.next_logits()[:, : self.draft_vocab]  # [B, Vd]
            if ctx.sampling.do_sample:
                probs = ctx.sampling.probs(logits)  # [B, Vd]
                token = sample(probs, ctx.generator)
            else:
                probs, token = None, logits.argmax(-1)
            drafted.append(token)
            self.assistant.feed(token)
            taken += active.long()
            # a row stops at its count, at a special token, or (optionally) where the draft is unsure
            active &= (taken < counts) & ~torch.isin(token, stops)
            if self.min_confidence > 0:
                probs = probs if probs is not None else torch.softmax(logits.float(), dim=-1)
                active &= probs.gather(1, token[:, None]).squeeze(1) >= self.min_confidence
        return torch.stack(drafted, dim=1).tolist(), taken

    def _target_drafts(self, ctx: DecodeContext, b: int, row: RowText, drafted: list[int], base: int) -> list[int]:
        """Row b's drafted draft-token ids -> target ids spelling the same text after the committed tokens."""
        ends = False
        for i, t in enumerate(drafted):
            if t in self.draft_stops:
                ends = t in self.draft_eos
                drafted = drafted[:i]
                break
        context = self.assistant.row(b, max(0, base - DECODE_CONTEXT), base)
        text = text_after(self.draft_fast, context + drafted, len(context)).rstrip(REPLACEMENT) if drafted else ""
        if not text:
            ids = []
        else:
            ids, how = row.continuation(self.target_fast, ctx.tokens[b, : int(ctx.lengths[b])].tolist(), text)
            self.counts[how] += 1
            if ids is None:
                return []
        if ends and self.target_eos is not None:
            ids = ids + [self.target_eos]
        for i, t in enumerate(ids):  # a tokenizer may know ids the target's head does not have
            if t >= self.target_vocab:
                return ids[:i]
        return ids

    # -- after verification --------------------------------------------------------------------
    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        self.schedule.update(feedback)
        tails, since = [], []
        for b, row in enumerate(self.rows):
            row.advance(self.target_fast, ctx.tokens[b, : int(ctx.lengths[b])].tolist())
            ids, before = row.retokenize(self.draft_fast)
            tails.append(ids)
            since.append(before)
        self.assistant.rewrite(since, tails)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]
        self.schedule.select_rows(rows)

    def report(self) -> dict[str, int]:
        return dict(self.counts)

    # -- introspection (tests, debugging) -------------------------------------------------------
    def draft_sequence(self, b: int) -> list[int]:
        """Row b's current draft-token sequence (after a step: the committed text, re-tokenized)."""
        return self.assistant.row(b)
