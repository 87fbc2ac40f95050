"""Logits processors at every verified position, as ``model.generate()`` would apply them.

``generate()`` calls its ``LogitsProcessorList`` once per step on ``input_ids`` (the prompt as
given, left padding included, then every generated token) and the step's float32 logits. A
speculative step scores K+1 positions at once, so the target's distribution at block position j
is its processed logits given the committed tokens *and the drafts before j*: row b's input ids
there are ``prompt_b + generated_b + drafts_b[:j]``, of length ``P + g_b + j``. This module
applies the very processors ``generate()`` builds (``GenerationMixin._get_logits_processor``: the
config's processors, the user's ``logits_processor=``, and under sampling the warpers) to every
position of a block, and to a drafter's logits at the position it drafts for.

The contract for a processor is ``generate()``'s own: a function of ``(input_ids, scores)``
whose row i of the output depends on row i of its inputs and on nothing it remembers from an
earlier call; row i of a batch is the prompt's row i (the state some processors keep per row,
like the repetition penalty's left padding, is indexed by it). Then each way of applying one
below gives exactly the scores ``generate()`` computes:

* **scores only** (temperature, top-k, top-p, min-p, typical, epsilon, eta, top-h, suppress
  tokens, inf/nan removal, log-softmax): one call over the ``[B*(K+1), V]`` block;
* **vectorized here** (repetition penalty, no-repeat n-grams, the encoder repetition penalty,
  ``prefix_allowed_tokens_fn``): ``transformers``' float operations over the whole block at once,
  each checked against the processor position by position (tests/test_processors.py);
* **the last few tokens** (sequence bias, bad words): one call on each position's last-W-token window;
* **by length** (min length, min new tokens, begin-suppress, forced BOS/EOS, exponential decay,
  watermarking): one call per distinct input length in the block, on the positions of that length;
* **any other** (the user's own): one call per distinct input length, on a batch laid out as the
  prompt's (each row at its own index; rows without a position of that length hold a copy);
* **a grammar** (``grammar=``, or xgrammar's own processor in ``logits_processor=``): a
  :class:`~specdec.grammar.GrammarConstraint`, whose matchers follow each position's ids
  (specdec/grammar.py).

A processor may return its scores in another dtype (float16, bfloat16, float64), as ``generate()``
allows: the later processors, the verification and the returned scores then take that dtype.

Two processors remember earlier calls and cannot be replayed at a speculative position:
classifier-free guidance (``guidance_scale``) and SynthID watermarking; they are refused by name.
What the processing costs per step: docs/generation.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.generation import logits_process as lp

from .grammar import GRAMMAR_LIMIT, GrammarConstraint

#: processors whose output row depends on that row's scores only (never on input_ids)
SCORES_ONLY = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper,
               lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper, lp.EtaLogitsWarper, lp.TopHLogitsWarper,
               lp.InfNanRemoveLogitsProcessor, lp.LogitNormalization, lp.SuppressTokensLogitsProcessor)
#: stateless, row by row, reading the input length (the watermark: its last tokens) and their own fields
BY_LENGTH = (lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor, lp.SuppressTokensAtBeginLogitsProcessor,
             lp.ForcedBOSTokenLogitsProcessor, lp.ForcedEOSTokenLogitsProcessor, lp.ExponentialDecayLengthPenalty,
             lp.WatermarkLogitsProcessor)
#: processors that forbid tokens outright (-inf whatever the logits): a lookup's draft they forbid is dropped
HARD = (lp.NoBadWordsLogitsProcessor, lp.NoRepeatNGramLogitsProcessor, lp.SuppressTokensLogitsProcessor,
        lp.SuppressTokensAtBeginLogitsProcessor, lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor,
        lp.ForcedBOSTokenLogitsProcessor, lp.ForcedEOSTokenLogitsProcessor, lp.PrefixConstrainedLogitsProcessor)
#: processors that remember earlier calls, and the generation setting that builds each
REFUSED = {lp.UnbatchedClassifierFreeGuidanceLogitsProcessor: "guidance_scale",
           lp.SynthIDTextWatermarkLogitsProcessor: "watermarking_config (SynthID)"}


@dataclass
class Positions:
    """The input ids ``generate()`` would pass at each position of a block, for every row:
    row b's at position j are ``ids[b, :lengths[b, j]]``. Only ``valid`` positions are used
    (rows offer different numbers of drafts); the others may hold anything finite."""

    ids: torch.Tensor  # [B, M] the prompt as given, the generated tokens, then the block's drafts
    lengths: torch.Tensor  # [B, J] input length at each position
    valid: torch.Tensor  # [B, J] bool
    rows: torch.Tensor  # [B] each row's index in the prompt as given
    batch: int  # rows of the prompt as given
    width: int = 0  # columns of the prompt as given: generated tokens start there


def positions(prompt_ids: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor,
              rows: torch.Tensor, block: torch.Tensor, counts: torch.Tensor, first: int = 0) -> Positions:
    """The positions ``first..K`` after row b's committed tokens and ``block [B, K]`` (position j
    after the first j drafts).

    prompt_ids [B0, P] as given; tokens [B, L] holding row b's committed tokens in
    ``[:lengths[b]]``, its unpadded prompt (``prompt_lengths[b]`` tokens) first; rows [B] each
    row's index in ``prompt_ids``; counts [B] positions scored per row, from position 0."""
    device = tokens.device
    width, k = prompt_ids.shape[1], block.shape[1]
    base = width + lengths - prompt_lengths  # [B] input length at position 0
    m = int(base.max()) + k
    cols = torch.arange(m, device=device)[None, :]  # [1, M]
    prompt = torch.nn.functional.pad(prompt_ids.to(device)[rows], (0, m - width))  # [B, M]
    generated = tokens.gather(1, (cols - width + prompt_lengths[:, None]).clamp(0, tokens.shape[1] - 1))  # [B, M]
    ids = torch.where(cols < width, prompt, generated)
    if k:
        ids = ids.scatter(1, base[:, None] + torch.arange(k, device=device)[None, :], block.to(device))
    j = torch.arange(first, k + 1, device=device)[None, :]  # [1, J]
    return Positions(ids, base[:, None] + j, j < counts[:, None], rows, prompt_ids.shape[0], width)


# -- one processor over a block: scores [B, J, V] -> [B, J, V] ---------------------------------------
# The scores an applier gets are the block's own copy (BlockProcessors.apply made it): the ones
# vectorized here change the few entries they touch in place, instead of copying the block again.
def _scores_only(processor, scores: torch.Tensor, pos: Positions) -> torch.Tensor:
    batch, j, vocab = scores.shape
    flat = scores.reshape(batch * j, vocab)
    return processor(pos.ids[:, :1].repeat_interleave(j, dim=0), flat).reshape(batch, j, vocab)


def _repetition(processor: lp.RepetitionPenaltyLogitsProcessor, scores: torch.Tensor, pos: Positions) -> torch.Tensor:
    """Every token in a position's ids (past the ignored prompt columns) is penalized there: the
    penalty's float operations on those entries only, as ``transformers``' gather and scatter."""
    batch, j, vocab = scores.shape
    ids, width = pos.ids, pos.ids.shape[1]
    cols = torch.arange(width, device=ids.device)  # [M]
    skip = processor.prompt_ignore_length
    if skip is None:
        skip = torch.zeros(batch, dtype=torch.long, device=ids.device)
    elif isinstance(skip, int):
        skip = torch.full((batch,), skip, dtype=torch.long, device=ids.device)
    else:  # one per row of the prompt as given
        skip = skip.to(ids.device)[pos.rows]
    seen = (cols >= skip[:, None, None]) & (cols < pos.lengths[..., None]) & (ids < vocab)[:, None, :]  # [B, J, M]
    b, p, m = seen.nonzero(as_tuple=True)
    tokens = ids[b, m]
    score = scores[b, p, tokens]
    scores[b, p, tokens] = torch.where(score < 0, score * processor.penalty, score / processor.penalty)
    return scores


def _no_repeat(processor: lp.NoRepeatNGramLogitsProcessor, scores: torch.Tensor, pos: Positions) -> torch.Tensor:
    """Position j bans the last token of every n-gram in ``ids[:c]`` (c = its length) whose first
    n-1 tokens equal the last n-1 tokens there."""
    n, (batch, j, vocab) = processor.ngram_size, scores.shape
    ids, lengths = pos.ids, pos.lengths  # [B, M], [B, J]
    if ids.shape[1] < n:
        return scores
    windows = ids.unfold(1, n, 1)  # [B, W, n]
    starts = torch.arange(windows.shape[1], device=ids.device)  # [W]
    match = (starts[None, None, :] <= (lengths - n)[..., None]) & (lengths >= n)[..., None]  # [B, J, W]
    if n > 1:
        at = (lengths[..., None] - (n - 1) + torch.arange(n - 1, device=ids.device)).clamp(0, ids.shape[1] - 1)
        prefix = ids.gather(1, at.reshape(batch, -1)).reshape(batch, j, n - 1)  # [B, J, n-1]
        match &= (windows[:, None, :, :-1] == prefix[:, :, None, :]).all(-1)
    match &= (windows[:, None, :, -1] < vocab)  # ids past the scores' width ban nothing
    b, p, w = match.nonzero(as_tuple=True)
    scores[b, p, windows[b, w, -1]] = -float("inf")
    return scores


def _encoder_repetition(processor: lp.EncoderRepetitionPenaltyLogitsProcessor, scores: torch.Tensor,
                        pos: Positions) -> torch.Tensor:
    batch, j, vocab = scores.shape
    encoder = processor.encoder_input_ids.to(scores.device)
    if pos.batch > encoder.shape[0]:  # generate() built it before repeating each prompt's rows (num_return_sequences)
        encoder = encoder.repeat_interleave(pos.batch // encoder.shape[0], dim=0)
    encoder = encoder[pos.rows].repeat_interleave(j, dim=0)  # [B*J, P]
    flat = scores.reshape(batch * j, vocab)
    score = torch.gather(flat, 1, encoder)
    score = torch.where(score < 0, score * processor.penalty, score / processor.penalty)
    return flat.scatter_(1, encoder, score).reshape(batch, j, vocab)


def _prefix_constrained(processor: lp.PrefixConstrainedLogitsProcessor, scores: torch.Tensor,
                        pos: Positions) -> torch.Tensor:
    """The user's function once per scored position, with the row's prompt index as batch id."""
    if processor._num_beams != 1:
        return _aligned(processor, scores, pos)
    mask = torch.zeros_like(scores)
    for b, j in pos.valid.nonzero().tolist():
        allowed = processor._prefix_allowed_tokens_fn(int(pos.rows[b]), pos.ids[b, : int(pos.lengths[b, j])])
        if len(allowed) == 0:
            raise ValueError(f"`prefix_allowed_tokens_fn` returned an empty list for batch ID {int(pos.rows[b])}. "
                             "This means that the constraint is unsatisfiable.")
        mask[b, j].fill_(-float("inf"))
        mask[b, j, allowed] = 0
    processed = scores + mask
    unsatisfiable = processed.amax(dim=-1).isneginf()[..., None]  # [B, J, 1]
    return torch.where(unsatisfiable, mask, processed)


def _last_tokens(processor: lp.SequenceBiasLogitsProcessor, scores: torch.Tensor, pos: Positions) -> torch.Tensor:
    """Sequence biases read at most the last (longest sequence - 1) ids: one call on those windows,
    when every position has that many (else by length). None at all (bad words that were only EOS
    ids, which ``transformers`` drops; or only an empty one) read no ids."""
    width = max((len(seq) for seq in processor.sequence_bias), default=1) - 1
    if width <= 0:  # -1: only an empty sequence (bad_words_ids=[[]]), which biases nothing
        return _scores_only(processor, scores, pos)
    if int(pos.lengths.min()) < width:
        return _by_length(processor, scores, pos)
    batch, j, vocab = scores.shape
    at = pos.lengths[..., None] - width + torch.arange(width, device=pos.ids.device)  # [B, J, W]
    windows = pos.ids.gather(1, at.reshape(batch, -1)).reshape(batch * j, width)
    return processor(windows, scores.reshape(batch * j, vocab)).reshape(batch, j, vocab)


def _by_length(processor, scores: torch.Tensor, pos: Positions, aligned: bool = False) -> torch.Tensor:
    """One call per distinct input length over the valid positions of that length; ``aligned``
    lays each call out as the prompt's batch (row i at index i), for processors that keep state
    per row."""
    out = scores.clone()
    lengths = pos.lengths.masked_fill(~pos.valid, -1)  # [B, J]
    for n in lengths[lengths >= 0].unique().tolist():
        b, j = (lengths == n).nonzero(as_tuple=True)
        ids, rows_scores = pos.ids[b, :n], scores[b, j]  # [r, n], [r, V]
        if aligned:  # a position of this length is at most one per row
            index = pos.rows[b]
            full_ids = ids[:1].expand(pos.batch, n).clone()
            full_ids[index] = ids
            full_scores = rows_scores[:1].expand(pos.batch, -1).clone()
            full_scores[index] = rows_scores
            processed = processor(full_ids, full_scores)[index]
        else:
            processed = processor(ids, rows_scores)
        if processed.dtype != out.dtype:  # generate() goes on in the dtype a processor returns (float16, ...)
            out = out.to(processed.dtype)
        out[b, j] = processed
    return out


def _aligned(processor, scores: torch.Tensor, pos: Positions) -> torch.Tensor:
    return _by_length(processor, scores, pos, aligned=True)


def _grammar(processor: GrammarConstraint, scores: torch.Tensor, pos: Positions) -> torch.Tensor:
    return processor.block(scores, pos)


def applier(processor) -> Callable[[object, torch.Tensor, Positions], torch.Tensor]:
    """How to apply ``processor`` over a block (by exact class: a subclass may change anything)."""
    kind = type(processor)
    if kind is GrammarConstraint:
        return _grammar
    if kind in REFUSED:
        raise ValueError(f"{REFUSED[kind]}: {kind.__name__} keeps state from one generate() step to the next, "
                         "so it cannot score speculative positions; unset it to decode speculatively")
    special = {lp.RepetitionPenaltyLogitsProcessor: _repetition, lp.NoRepeatNGramLogitsProcessor: _no_repeat,
               lp.EncoderRepetitionPenaltyLogitsProcessor: _encoder_repetition,
               lp.PrefixConstrainedLogitsProcessor: _prefix_constrained,
               lp.SequenceBiasLogitsProcessor: _last_tokens, lp.NoBadWordsLogitsProcessor: _last_tokens}
    if kind in special:
        return special[kind]
    if kind in SCORES_ONLY:
        return _scores_only
    if kind in BY_LENGTH:
        return _by_length
    return _aligned


class BlockProcessors:
    """A call's ``LogitsProcessorList`` (as ``generate()`` built it) applied over blocks.

    ``seconds`` adds up the time spent processing, for the statistics."""

    def __init__(self, processors, prompt_ids: torch.Tensor):
        width = prompt_ids.shape[1]
        processors = [_position_aware(p, width) for p in processors if not inert(p, width)]
        self.steps = [(p, applier(p)) for p in processors]
        self.hard = [(p, a) for p, a in self.steps if type(p) in HARD]
        grammars = [p for p in processors if type(p) is GrammarConstraint]
        if len(grammars) > 1:
            raise ValueError("one grammar per call: the logits processors hold "
                             f"{len(grammars)} grammar constraints")
        self.grammar: GrammarConstraint | None = grammars[0] if grammars else None
        if self.grammar is not None:
            self.grammar.check_batch(prompt_ids.shape[0])
        self.prompt_ids = prompt_ids  # [B0, P] as given
        self.seconds = 0.0

    def __bool__(self) -> bool:
        return bool(self.steps)

    def positions(self, tokens, lengths, prompt_lengths, rows, block, counts, first: int = 0) -> Positions:
        return positions(self.prompt_ids, tokens, lengths, prompt_lengths, rows, block, counts, first)

    def apply(self, scores: torch.Tensor, pos: Positions) -> torch.Tensor:
        """scores [B, J, V] float32 at ``pos`` -> the processed scores, as ``generate()`` computes them."""
        started = time.perf_counter()
        # the block's own, contiguous: appliers may write in place, some through the data itself
        # (xgrammar's bitmask), which a transposed view (a fast output layer's logits) would defeat
        scores = scores.clone(memory_format=torch.contiguous_format)
        for processor, apply in self.steps:
            scores = apply(processor, scores, pos)
        self.seconds += time.perf_counter() - started
        return scores

    def allowed_drafts(self, drafts: torch.Tensor, counts: torch.Tensor, pos: Positions, vocab: int) -> torch.Tensor:
        """drafts [B, K] at ``pos`` (its first K positions: before each draft), counts [B] ->
        [B] each row's drafts up to the first that a processor forbids whatever the logits."""
        if not self.hard or drafts.shape[1] == 0:
            return counts
        started = time.perf_counter()
        scores = torch.zeros(*pos.lengths.shape, vocab, device=drafts.device)  # [B, J, V]
        for processor, apply in self.hard:
            scores = apply(processor, scores, pos)
        k = drafts.shape[1]
        banned = scores[:, :k].gather(2, drafts[..., None].to(scores.device)).squeeze(-1).isneginf()  # [B, K]
        first = torch.where(banned.any(1), banned.float().argmax(1), k).to(counts.device)
        self.seconds += time.perf_counter() - started
        return torch.minimum(counts, first)

    def extend(self, drafts: torch.Tensor, offered: torch.Tensor, committed: list[list[int]], rows: list[int],
               room: list[int], point: list[list[bool]]) -> tuple[list[list[int]], list[int]]:
        """The grammar's walk over each row's drafts (:meth:`GrammarConstraint.extend`): at most
        ``GRAMMAR_LIMIT`` of the grammar's own drafts past a row's offered drafts, and never past its ``room``."""
        started = time.perf_counter()
        limit = [min(r, o + GRAMMAR_LIMIT) for r, o in zip(room, offered.tolist())]
        out = self.grammar.extend(drafts, offered, committed, rows, limit, point)
        self.seconds += time.perf_counter() - started
        return out


#: what ``generate()`` appends after a user's processors: the warpers (when sampling), watermarking, normalization
AFTER_USERS = (lp.TemperatureLogitsWarper, lp.TopHLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper,
               lp.MinPLogitsWarper, lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper, lp.EtaLogitsWarper,
               lp.WatermarkLogitsProcessor, lp.SynthIDTextWatermarkLogitsProcessor, lp.LogitNormalization)


def with_user_processor(processors, extra) -> list:
    """``generate()``'s built list with ``extra`` where ``generate()`` puts a user's processor:
    before the warpers, watermarking and normalization it appends after them."""
    processors = list(processors or [])
    at = len(processors)
    while at and type(processors[at - 1]) in AFTER_USERS:
        at -= 1
    return [*processors[:at], extra, *processors[at:]]


def inert(processor, width: int) -> bool:
    """Whether ``processor`` changes no score of a call whose prompt is ``width`` columns wide: a
    minimum length already reached at the first new token (``generate()`` builds one for
    ``min_new_tokens=0``, and for a ``min_length`` the prompt already has), which ``generate()``
    applies as the identity at every step. Such a processor is left out of the call."""
    if type(processor) is lp.MinLengthLogitsProcessor:
        return processor.min_length <= width
    if type(processor) is lp.MinNewTokensLengthLogitsProcessor:
        return processor.prompt_length_to_skip + processor.min_new_tokens <= width
    return False


def _position_aware(processor, width: int):
    """``generate()``'s xgrammar processor (it counts its calls to know which token is new) as a
    :class:`GrammarConstraint` that reads every position from its input ids; a fresh copy of a
    GrammarConstraint given as a processor (it keeps the matchers of the call)."""
    kind = type(processor)
    if kind.__module__ == "xgrammar.contrib.hf" and kind.__name__ == "LogitsProcessor":
        return GrammarConstraint.from_hf(processor, width)
    if kind is GrammarConstraint:
        return GrammarConstraint(processor.compiled, width)
    return processor
