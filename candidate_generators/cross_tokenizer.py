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
no step of the text alignment below can change the output distribution: a misalignment only
costs acceptance.

State kept per row, between steps (:class:`RowText`):

* ``text``: the committed text, whole characters only, and ``read``: how many committed target
  tokens it covers. Target tokens past ``read`` end inside a multi-byte character (byte-fallback
  or byte-level pieces) and wait until the character completes.
* ``marks``: recent (target index, character offset) pairs where the committed target tokens end
  on a character boundary. A proposal re-tokenizes ``anchor text + draft text`` from such a mark,
  so merges that straddle the boundary and pending partial characters come out right; the
  result is used only if its head reproduces the committed target tokens exactly, otherwise a
  shorter anchor (finally none) is tried.
* ``frozen``/``frozen_chars``: the draft's token sequence is ``frozen tokens + encode(text[frozen_chars:])``.
  Only the tail (about ``DRAFT_WINDOW`` tokens plus the new text) is re-tokenized after a step,
  so a merge that straddles the old end is redone; tokens move into the frozen part only at a
  split that re-encodes to the very same tokens on both sides. ``Assistant.rewrite`` then keeps the
  longest common prefix cached: accepted drafts that re-tokenize to themselves are never fed
  again, and nothing is re-encoded from the start of the text.

The user's models, tokenizers and configs are only read: nothing is pruned, re-indexed or set.
Batches of any size work: every row has its own text, marks and draft sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from specdec.generators import (CandidateGenerator, DecodeContext, DraftLengthSchedule, Feedback, Proposal,
                                token_id_list, vocab_size)
from specdec.modelinfo import eos_token_ids, pad_token_id
from specdec.multimodal import declared_inputs
from specdec.registry import register_candidate_generator
from specdec.sampling import sample

from .lowbit import LowPrecisionDraft

#: what a decoder writes for bytes that are not (yet) a whole UTF-8 character
REPLACEMENT = "\ufffd"
#: a UTF-8 character has at most 4 bytes, so at most 3 trailing tokens can hold an unfinished one
UTF8_MAX_BYTES = 4
#: draft tokens left re-tokenizable behind the committed end; merges that straddle it fit in here
DRAFT_WINDOW = 8
#: draft tokens of context when decoding drafted tokens (decoders that strip a leading space)
DECODE_CONTEXT = 4
#: clean target boundaries remembered per row (anchors and decode context)
MARKS_KEPT = 4
#: longest anchor, in target tokens, re-tokenized in front of the draft text
MAX_ANCHOR = 16


# -- text <-> tokens: small pure functions --------------------------------------------------------
def fast(tokenizer):
    """The Rust tokenizer behind a fast ``transformers`` tokenizer, else the tokenizer itself.

    Same ids, text and offsets as the ``transformers`` wrapper with a fraction of its per-call
    overhead, which matters at a few calls per row per step. The functions below take either."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else tokenizer


def _backend(tokenizer) -> Tokenizer | None:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def decode(tokenizer, ids: list[int]) -> str:
    """Plain text of ``ids``: special tokens dropped, no clean-up of spaces (that would change text)."""
    backend = _backend(tokenizer)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=True)
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def encode(tokenizer, text: str) -> list[int]:
    backend = _backend(tokenizer)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """ids and character offsets (None for tokenizers that cannot give offsets)."""
    backend = _backend(tokenizer)
    if backend is not None:
        enc = backend.encode(text, add_special_tokens=False)
        return enc.ids, list(enc.offsets)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError):
        return encode(tokenizer, text), None


def text_after(tokenizer, ids: list[int], context: int) -> str:
    """The text ``ids[context:]`` add after ``ids[:context]``.

    Decoding with a little context in front keeps what decoders do to a leading token (strip a
    space, join a character split across tokens) identical for both decodes; falls back to
    decoding ``ids[context:]`` alone if the decoder is not prefix-stable here."""
    head, full = decode(tokenizer, ids[:context]), decode(tokenizer, ids)
    return full[len(head):] if full.startswith(head) else decode(tokenizer, ids[context:])


def complete_text_after(tokenizer, ids: list[int], context: int) -> tuple[str, int]:
    """``(text, n)``: the text that ``ids[context:context + n]`` add, for the largest n whose text
    ends on a whole character. ``ids[:context]`` must end on a whole character.

    A decoded text ending in U+FFFD may be an unfinished character: up to 3 trailing tokens are
    held back. If more than that would be held back the bytes are invalid rather than unfinished,
    and are taken as they decode."""
    for end in range(len(ids), max(context, len(ids) - UTF8_MAX_BYTES + 1) - 1, -1):
        if end == context:
            break
        text = text_after(tokenizer, ids[:end], context)
        if not text.endswith(REPLACEMENT):
            return text, end - context
    if len(ids) - context >= 2 * UTF8_MAX_BYTES:
        return text_after(tokenizer, ids, context), len(ids) - context
    return "", 0


def continuation_ids(tokenizer, anchor_ids: list[int], anchor_text: str, text: str) -> list[int] | None:
    """Target ids that follow ``anchor_ids`` and spell ``text``, or None.

    ``anchor_ids`` are committed target tokens starting on a character boundary; ``anchor_text``
    is the whole-character text of their head (a trailing unfinished character is not in it, its
    bytes are completed by ``text``). Re-tokenizing ``anchor_text + text`` lets the tokenizer see
    the context; the result is usable only if it reproduces ``anchor_ids`` as its head."""
    ids = encode(tokenizer, anchor_text + text)
    n = len(anchor_ids)
    return ids[n:] if ids[:n] == anchor_ids else None


def freeze_split(tokenizer, text: str, ids: list[int], offsets: list[tuple[int, int]] | None,
                 keep: int, tries: int = 4) -> tuple[int, int]:
    """``(tokens, chars)``: a split of ``ids = encode(text)`` leaving about ``keep`` tokens after it
    such that ``encode(text[:chars]) == ids[:tokens]`` and ``encode(text[chars:]) == ids[tokens:]``,
    or ``(0, 0)``. Freezing at such a split never changes the token sequence."""
    if offsets is None:
        return 0, 0
    for j in range(len(ids) - keep, max(0, len(ids) - keep - tries), -1):
        if j <= 0:
            break
        chars = offsets[j - 1][1]
        if offsets[j][0] != chars or not 0 < chars < len(text):
            continue  # the token boundary falls inside a character (or offsets were trimmed)
        if encode(tokenizer, text[:chars]) == ids[:j] and encode(tokenizer, text[chars:]) == ids[j:]:
            return j, chars
    return 0, 0


def leading_special_ids(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text by default (a BOS token, or nothing)."""
    plain = encode(tokenizer, "a")
    full = tokenizer("a")["input_ids"]
    if len(full) > len(plain) and full[len(full) - len(plain):] == plain:
        return full[: len(full) - len(plain)]
    return []



@dataclass
class RowText:
    """One row's committed text and its draft-token bookkeeping (see the module docstring)."""

    text: str  # committed text, whole characters
    read: int  # committed target tokens covered by `text`
    marks: list[tuple[int, int]] = field(default_factory=list)  # (target index, char offset), last = (read, len(text))
    frozen: int = 0  # draft tokens that never change again
    frozen_chars: int = 0  # characters of `text` they spell

    @classmethod
    def start(cls, target_tokenizer, ids: list[int]) -> "RowText":
        """The row for committed target tokens ``ids`` (a prompt)."""
        text, read = complete_text_after(target_tokenizer, ids, 0)
        marks = []
        for back in range(1, UTF8_MAX_BYTES + 1):  # one more clean boundary, a few tokens back
            end = read - back
            if end <= 0:
                break
            head = decode(target_tokenizer, ids[:end])
            if not head.endswith(REPLACEMENT) and text.startswith(head):
                marks.append((end, len(head)))
                break
        marks.append((read, len(text)))
        return cls(text, read, marks)

    def retokenize(self, draft_tokenizer) -> tuple[list[int], int]:
        """Draft ids for ``text[frozen_chars:]`` (they follow the frozen tokens); moves the frozen
        split forward where that changes nothing. Returns the ids and the old frozen count."""
        tail = self.text[self.frozen_chars:]
        ids, offsets = encode_with_offsets(draft_tokenizer, tail)
        before = self.frozen
        if len(ids) > DRAFT_WINDOW:
            tokens, chars = freeze_split(draft_tokenizer, tail, ids, offsets, DRAFT_WINDOW)
            self.frozen += tokens
            self.frozen_chars += chars
        return ids, before

    def advance(self, target_tokenizer, committed: list[int]) -> None:
        """Append the whole characters of newly committed target tokens (``committed``: the row's
        committed tokens) to ``text``."""
        start = self.marks[-2][0] if len(self.marks) > 1 else self.read  # a little decode context
        text, n = complete_text_after(target_tokenizer, committed[start:], self.read - start)
        if n:
            self.text += text
            self.read += n
            self.marks = (self.marks + [(self.read, len(self.text))])[-MARKS_KEPT:]

    def continuation(self, target_tokenizer, committed: list[int], text: str) -> tuple[list[int] | None, str]:
        """Target ids that spell ``text`` after the committed tokens, and how they were found
        (``anchored``, ``unanchored``, or ``unaligned`` with None)."""
        count = len(committed)
        candidates = [m for m in self.marks[:-1] if count - m[0] <= MAX_ANCHOR][-1:] + [self.marks[-1]]
        for index, chars in candidates:
            anchor_ids = committed[index:]
            ids = continuation_ids(target_tokenizer, anchor_ids, self.text[chars:], text)
            if ids is not None:
                return ids, "anchored" if anchor_ids else "unanchored"
        return None, "unaligned"


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
    for ``draft_model`` (``lowbit.py``).
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
