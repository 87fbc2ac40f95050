"""Structured output: a grammar's constraint at every verified position, its own tokens as drafts.

``generate(..., grammar=...)`` takes a JSON schema (a dict, or a pydantic model class), a
:class:`Grammar` (``Grammar.json_schema``, ``Grammar.regex``, ``Grammar.ebnf``) or an
``xgrammar.CompiledGrammar``. The grammar is compiled by xgrammar (``pip install
"specdec[grammar]"``) for the target's tokenizer, once per tokenizer and grammar, with the call's
end-of-sequence ids as the grammar's stop tokens, so a finished grammar ends the row.

The constraint is a logits processor, :class:`GrammarConstraint`, placed where ``generate()``
places a user's processors (after the generation config's, before the sampling warpers). Its
mask at a position is the grammar's state after that row's generated tokens *and the drafts
before the position*, as ``model.generate(logits_processor=[xgrammar.contrib.hf.LogitsProcessor(g)])``
computes it one token at a time. One matcher per row is moved to each position it is asked about
by rolling back to the longest prefix it shares with the position's tokens and accepting the
rest, so rejected drafts leave exactly the state of never having been drafted. An
``xgrammar.contrib.hf.LogitsProcessor`` a user passes in ``logits_processor=`` is applied the same
way (``specdec/processors.py``).

**The grammar's own drafts** (:meth:`GrammarConstraint.extend`). Before verification each row's
drafts walk through its grammar: a draft the grammar forbids is cut with everything after it (the
target could not accept it); where the mask allows exactly one token, that token is the draft (a
generator's draft that differs is replaced, and its later drafts dropped); after the generator's
drafts, forced tokens keep being appended while each next token is forced. Where the grammar
forces a *string* but not a token (a key name the vocabulary can spell several ways), xgrammar's
own tokenization of that string (``find_jump_forward_tokens``) is proposed too: never committed
unverified, since the model may spell it another way, but a guess the target checks like any
other draft. All drafts stay proposals, verified like any other, so the output is the target's
whatever they are; a grammar's draft has probability 1 under the drafter (a point mass).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor

#: the grammar's own drafts a row may take per step beyond its generator's
GRAMMAR_LIMIT = 32


#: xgrammar without its GPU-kernel dependency, as the README's install and .ci/run give it (tests/test_docs.py)
CPU_INSTALL = "pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2"


def xgrammar():
    """The xgrammar module, or an ImportError saying how to install it."""
    try:
        import xgrammar as xgr
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"grammar-constrained decoding needs xgrammar: on a CPU machine {CPU_INSTALL} (as the "
                          "README does; xgrammar's own dependencies pull triton, GPU kernels); with a GPU, "
                          'pip install "specdec[grammar]"') from e
    return xgr


@dataclass(frozen=True)
class Grammar:
    """A grammar to constrain the output to: ``kind`` is ``"json_schema"`` (``source`` the schema
    as JSON text), ``"regex"`` or ``"ebnf"`` (GBNF, root rule ``root``). ``any_whitespace``
    (JSON only): whether whitespace between JSON tokens is free; the default, False, asks for
    one fixed compact layout, whose punctuation the grammar then forces."""

    kind: str
    source: str
    any_whitespace: bool = False

    KINDS = ("json_schema", "regex", "ebnf")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"grammar kind {self.kind!r}: expected one of {', '.join(self.KINDS)}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"a {self.kind} grammar needs a non-empty string, got {self.source!r}")

    @classmethod
    def json_schema(cls, schema, any_whitespace: bool = False) -> "Grammar":
        """A JSON schema: a dict, a JSON string, or a pydantic model class."""
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, dict):
            raise TypeError(f"a JSON schema is a dict, a JSON string or a pydantic model class, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema), any_whitespace)

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, text: str) -> "Grammar":
        return cls("ebnf", text)

    @classmethod
    def from_config(cls, value: dict) -> "Grammar":
        """``{"json_schema": {...}}``, ``{"regex": "..."}`` or ``{"ebnf": "..."}`` (a bench config's
        form), with ``any_whitespace`` beside a JSON schema."""
        kinds = [k for k in cls.KINDS if k in value]
        unknown = set(value) - {*cls.KINDS, "any_whitespace"}
        if len(kinds) != 1 or unknown:
            raise ValueError(f"a grammar is one of {{json_schema: ..., regex: ..., ebnf: ...}}, got keys {sorted(value)}")
        kind = kinds[0]
        if kind == "json_schema":
            return cls.json_schema(value[kind], bool(value.get("any_whitespace", False)))
        return cls(kind, value[kind])


def as_grammar(value) -> Grammar:
    """What ``grammar=`` accepts -> a :class:`Grammar` (a compiled grammar is returned as it is)."""
    if isinstance(value, Grammar) or type(value).__name__ == "CompiledGrammar":
        return value
    if isinstance(value, dict) or (isinstance(value, type) and hasattr(value, "model_json_schema")):
        return Grammar.json_schema(value)
    if isinstance(value, str):
        raise TypeError("grammar= got a plain string, which could be a regex or a grammar: pass "
                        "Grammar.regex(...), Grammar.ebnf(...) or a JSON schema (a dict)")
    raise TypeError(f"grammar= takes a JSON schema (dict or pydantic model class), a specdec.Grammar or an "
                    f"xgrammar.CompiledGrammar, got {type(value).__name__}")


# -- compiling, cached per tokenizer and grammar --------------------------------------------------
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(vocab, stops): (compiler, LRU)}
_LOCK = threading.Lock()
#: compiled grammars kept per tokenizer and stop tokens, least recently used dropped past it: a
#: service that compiles a schema per request must not grow without bound
MAX_COMPILED = 64
#: grammar compilers kept per tokenizer (one per vocabulary size and set of stop ids), least recently used dropped
MAX_COMPILERS = 8


def compile_grammar(grammar, tokenizer, vocab_size: int, stop_token_ids) -> object:
    """``grammar`` (anything :func:`as_grammar` takes) compiled for ``tokenizer`` with a mask of
    ``vocab_size`` tokens (the model's) and ``stop_token_ids`` as the tokens that end it."""
    grammar = as_grammar(grammar)
    if type(grammar).__name__ == "CompiledGrammar":
        return grammar
    if tokenizer is None:
        raise ValueError("grammar= needs the target's tokenizer: SpecDecoder(target, draft, tokenizer=...), or "
                         "model.generate(..., custom_generate=specdec.generate, target_tokenizer=...)")
    xgr = xgrammar()
    stops = tuple(sorted(int(t) for t in stop_token_ids))
    with _LOCK:
        per_tokenizer = _COMPILED.setdefault(tokenizer, OrderedDict())
        if (vocab_size, stops) not in per_tokenizer:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stops) or None)
            per_tokenizer[vocab_size, stops] = (xgr.GrammarCompiler(info, cache_enabled=False), OrderedDict())  # ours is bounded
            while len(per_tokenizer) > MAX_COMPILERS:  # a service passing its own EOS ids per request
                per_tokenizer.popitem(last=False)
        per_tokenizer.move_to_end((vocab_size, stops))
        compiler, compiled = per_tokenizer[vocab_size, stops]
        if grammar not in compiled:
            compiled[grammar] = _compile(compiler, grammar)
            while len(compiled) > MAX_COMPILED:
                compiled.popitem(last=False)
        compiled.move_to_end(grammar)
        return compiled[grammar]


def _compile(compiler, grammar: Grammar):
    try:
        if grammar.kind == "json_schema":
            return compiler.compile_json_schema(grammar.source, any_whitespace=grammar.any_whitespace)
        if grammar.kind == "regex":
            return compiler.compile_regex(grammar.source)
        return compiler.compile_grammar(grammar.source)
    except RuntimeError as e:
        raise ValueError(f"the {grammar.kind} grammar does not compile: {e}") from e


# -- the constraint ------------------------------------------------------------------------------
class GrammarConstraint(LogitsProcessor):
    """The grammar's mask at any position, for every row of a call (one compiled grammar for all
    rows, or one per row of the prompt as given).

    As a plain logits processor (``generate()`` calling it once per step) it masks each row's
    next token; specdec applies it over whole blocks (:meth:`block`) and proposes its own
    tokens (:meth:`extend`)."""

    def __init__(self, compiled, prompt_width: int | None = None):
        xgr = xgrammar()
        self.compiled = list(compiled) if isinstance(compiled, (list, tuple)) else [compiled]
        if not self.compiled:
            raise ValueError("grammar= got an empty list: pass one grammar for every row, or a list of one per "
                             "row of the batch")
        self.vocab = self.compiled[0].tokenizer_info.vocab_size
        self.width = prompt_width  # the prompt's columns as given (set at the first call when None)
        self.rows: dict[int, _RowState] = {}
        self.scratch = xgr.allocate_token_bitmask(1, self.vocab)

    @classmethod
    def from_hf(cls, processor, prompt_width: int | None = None) -> "GrammarConstraint":
        """The same constraint as an ``xgrammar.contrib.hf.LogitsProcessor``, for a fresh call."""
        return cls(processor.compiled_grammars, prompt_width)

    def check_batch(self, batch: int) -> None:
        """Before any forward: one grammar for every row, or exactly one per row of a ``batch``-row
        prompt (xgrammar's processor takes the same)."""
        if len(self.compiled) > 1 and len(self.compiled) != batch:
            raise ValueError(f"{len(self.compiled)} grammars for a batch of {batch} rows: pass one grammar for every "
                             f"row, or a list of exactly one per row")

    def row(self, index: int) -> "_RowState":
        if index not in self.rows:
            if len(self.compiled) > 1 and index >= len(self.compiled):
                raise ValueError(f"{len(self.compiled)} compiled grammars for a batch with row {index}")
            grammar = self.compiled[0] if len(self.compiled) == 1 else self.compiled[index]
            self.rows[index] = _RowState(xgrammar().GrammarMatcher(grammar))
        return self.rows[index]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.width is None:
            self.width = input_ids.shape[1]
        bitmask = xgrammar().allocate_token_bitmask(input_ids.shape[0], self.vocab)
        for b in range(input_ids.shape[0]):
            self.row(b).fill(input_ids[b, self.width:].tolist(), bitmask, b)
        return self._apply(scores.clone(), bitmask)

    def block(self, scores: torch.Tensor, pos) -> torch.Tensor:
        """scores [B, J, V] at the valid positions of ``pos`` (specdec.processors.Positions) ->
        masked in place; invalid positions are left as they are."""
        batch, j, vocab = scores.shape
        bitmask = xgrammar().allocate_token_bitmask(batch * j, self.vocab)
        valid = pos.valid.cpu()
        lengths = pos.lengths.cpu()
        for b in range(batch):
            wanted = valid[b].nonzero().flatten().tolist()
            if not wanted:
                continue
            ids = pos.ids[b, pos.width: int(lengths[b, wanted[-1]])].tolist()
            state = self.row(int(pos.rows[b]))
            for p in wanted:
                state.fill(ids[: int(lengths[b, p]) - pos.width], bitmask, b * j + p)
        self._apply(scores.view(batch * j, vocab), bitmask)
        return scores

    def _apply(self, flat: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Mask ``flat [N, V]`` (float, any device) in place with ``bitmask [N, W]``."""
        xgr = xgrammar()
        if flat.device.type == "cpu" or flat.device.type == "cuda":
            xgr.apply_token_bitmask_inplace(flat, bitmask.to(flat.device))
            return flat
        cpu = flat.cpu()
        xgr.apply_token_bitmask_inplace(cpu, bitmask)
        flat.copy_(cpu)
        return flat

    def extend(self, drafts: torch.Tensor, offered: torch.Tensor, committed: list[list[int]], rows: list[int],
               limit: list[int], point: list[list[bool]]) -> tuple[list[list[int]], list[int]]:
        """Walk each row's drafts ``drafts [B, K]`` (``offered [B]`` of them; ``point [B][K]``:
        which are point masses) through its grammar after its ``committed`` generated tokens ->
        (each row's drafts: the generator's up to the first the grammar forbids or replaces, then
        the grammar's own after them (forced tokens, suggested spellings of a forced string), at
        most ``limit[b]`` in all; how many of those came from the generator)."""
        out, kept = [], []
        offered_list, draft_rows = offered.tolist(), drafts.tolist()
        for b, row in enumerate(rows):
            mine, taken = self.row(row).walk(committed[b], draft_rows[b][: offered_list[b]], limit[b], self.scratch,
                                             self.vocab, point[b])
            out.append(mine)
            kept.append(taken)
        return out, kept


class _RowState:
    """One row's matcher and the tokens it has been moved through (``history``; the first
    ``accepted`` of them accepted: after the grammar ended, or a token it refused, the rest are
    ignored, as ``generate()``'s xgrammar processor ignores tokens after the end)."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.history: list[int] = []
        self.accepted = 0

    def move(self, tokens: list[int]) -> None:
        """Bring the matcher to the state after ``tokens`` (generated tokens, then drafts)."""
        history, n = self.history, min(len(self.history), len(tokens))
        common = n if history[:n] == tokens[:n] else next(i for i in range(n) if history[i] != tokens[i])
        if common < self.accepted:
            self.matcher.rollback(self.accepted - common)
            self.accepted = common
        del history[common:]
        for token in tokens[common:]:
            if self.accepted == len(history) and not self.matcher.is_terminated() \
                    and self.matcher.accept_token(int(token)):
                self.accepted += 1
            history.append(int(token))

    def fill(self, tokens: list[int], bitmask: torch.Tensor, index: int) -> None:
        """Row ``index`` of ``bitmask`` <- the mask after ``tokens``: the grammar's; after the grammar
        ended, the mask the end was chosen under (xgrammar's processor keeps it); after a token
        the grammar refused, everything allowed (such a draft is cut before it is verified)."""
        self.move(tokens)
        matcher = self.matcher
        if matcher.is_terminated():
            last = self.history[self.accepted - 1]
            matcher.rollback(1)
            matcher.fill_next_token_bitmask(bitmask, index)
            matcher.accept_token(last)
        elif self.accepted < len(self.history):
            bitmask[index] = -1
        else:
            matcher.fill_next_token_bitmask(bitmask, index)

    def walk(self, committed: list[int], drafts: list[int], limit: int, scratch: torch.Tensor,
             vocab: int, point: list[bool]) -> tuple[list[int], int]:
        """-> (the drafts to verify after ``committed``, how many of them are the generator's). A
        forbidden draft is replaced by the grammar's suggestion where it is a point mass
        (``point``); one drawn from a distribution ends the walk, kept for the verifier to reject
        (its position then samples from what the draft's distribution leaves of the target's:
        replacing it would sample from the whole whenever the draw was forbidden, biased)."""
        self.move(committed)
        if self.accepted < len(self.history):  # a committed token the grammar refused: nothing to walk from
            return [], 0
        matcher, out, taken, following, suggested = self.matcher, [], 0, True, []
        while len(out) < limit and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(scratch, 0)
            forced = only_token(scratch[0], vocab)
            mine = drafts[taken] if following and taken < len(drafts) else None
            if forced is not None:
                if mine == forced:
                    taken += 1
                else:
                    following = False
                token = forced
                suggested = suggested[1:] if suggested[:1] == [forced] else []
            elif mine is not None and allows(scratch[0], mine):
                token, taken = mine, taken + 1
            elif mine is not None and not point[taken]:  # drawn, and forbidden: the verifier rejects it
                out.append(mine)
                self.history.append(mine)
                return out, taken + 1
            else:  # the generator has no draft here (or a point mass the grammar forbids): its suggestion
                following = False
                suggested = suggested or matcher.find_jump_forward_tokens()
                if not suggested or not allows(scratch[0], suggested[0]):
                    break
                token, suggested = suggested[0], suggested[1:]
            if not matcher.accept_token(token):
                break
            out.append(token)
            self.history.append(token)
            self.accepted += 1
        return out, taken


def no_allowed_token(row: int, new_token: int) -> ValueError:
    """The error of a position where the grammar and the other logits processors together allow
    no token (``generate()`` would take token 0 there and go on outside the grammar)."""
    return ValueError(f"no token is allowed at new token {new_token} of row {row}: the grammar allows none there, "
                      f"or only tokens that the other logits processors forbid (suppress_tokens, bad_words_ids, a min "
                      f"length that forbids the end of sequence, ...), so no output can follow the grammar. An EOS id "
                      f"the grammar needs as text does this too (it only ends the output); relax them or the grammar")


def only_token(words: torch.Tensor, vocab: int) -> int | None:
    """The one token a bitmask row ``words [W]`` (int32, bit i of word w: token 32w + i) allows, or None."""
    nonzero = words.nonzero()
    if nonzero.numel() != 1:
        return None
    w = int(nonzero)
    bits = int(words[w]) & 0xFFFFFFFF
    if bits & (bits - 1):
        return None
    token = 32 * w + bits.bit_length() - 1
    return token if token < vocab else None


def allows(words: torch.Tensor, token: int) -> bool:
    return 0 <= token < 32 * words.shape[0] and bool((int(words[token // 32]) >> (token % 32)) & 1)


def with_grammar_drafts(proposal, rows: list[list[int]], taken: list[int]):
    """The proposal to verify: row b's drafts ``rows[b]``, of which the first ``taken[b]`` are the
    generator's (its probabilities kept) and the rest the grammar's (point masses); ``grammar_drafts`` [B] set."""
    from .generators import Proposal

    device = proposal.token_ids.device
    made = Proposal.from_rows(rows, device)
    lengths = made.lengths
    taken_t = torch.tensor(taken, dtype=torch.long, device=device)
    probs = proposal.probs
    if probs is not None:
        batch, k = made.token_ids.shape
        out = probs.new_zeros(batch, k, probs.shape[-1])
        cols = torch.arange(k, device=device)[None, :]
        mine = cols < taken_t[:, None]  # [B, k]
        width = min(k, probs.shape[1])
        out[:, :width][mine[:, :width]] = probs[:, :width][mine[:, :width]]
        point = (~mine) & (cols < lengths[:, None])
        out[point] = torch.nn.functional.one_hot(made.token_ids[point], probs.shape[-1]).to(out.dtype)
        probs = out
    return dataclasses.replace(proposal, token_ids=made.token_ids, lengths=lengths, probs=probs,
                               grammar_drafts=lengths - taken_t)
