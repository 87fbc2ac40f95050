"""Aligning the token sequences of two tokenizers through their text.

A model with one tokenizer proposes text; another model, with another tokenizer, must see the
same text as its own tokens. Everything here goes through text: decode one side, re-encode on the
other, and keep just enough per-row state that each step re-tokenizes a short tail, never the
whole text. Used by the ``cross_tokenizer`` plugin (string-level exact match).

Invariant: these functions only decide which target tokens are *proposed*. The target's verifier
decides what is committed, so a misalignment here can cost acceptance but never change the output
(the argument is in ``candidate_generators/cross_tokenizer.py``'s docstring).

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
  split that re-encodes to the very same tokens on both sides. The caller's ``Assistant.rewrite``
  then keeps the longest common prefix cached: accepted drafts that re-tokenize to themselves
  are never fed again, and nothing is re-encoded from the start of the text.

Tokenizers are only read. The functions take a ``transformers`` tokenizer or the Rust
``tokenizers.Tokenizer`` behind it (see :func:`fast`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

#: what a decoder writes for bytes that are not (yet) a whole UTF-8 character
REPLACEMENT = "\ufffd"
#: a UTF-8 character has at most 4 bytes, so at most 3 trailing tokens can hold an unfinished one
UTF8_MAX_BYTES = 4
#: draft tokens left re-tokenizable behind the committed end; merges that straddle it fit in here
DRAFT_WINDOW = 8
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
