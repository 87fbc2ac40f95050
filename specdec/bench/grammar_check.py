"""A finished structured output checked against its grammar (the bench's *Structured output* table)."""

from __future__ import annotations

import json

from ..grammar import Grammar, only_token, xgrammar


def check_output(compiled, grammar: Grammar | None, ids: list[int], text: str) -> dict:
    """A finished output ``ids`` (its text ``text``, special tokens left out) against its grammar ->
    ``{"forced": tokens at positions where the grammar allowed exactly one, "valid": whether the
    grammar accepts the whole output (and, for a JSON schema, the text parses and validates, where
    jsonschema is installed)}``."""
    xgr = xgrammar()
    matcher = xgr.GrammarMatcher(compiled)
    vocab = compiled.tokenizer_info.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    forced, valid = 0, True
    for token in ids:
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask)
        forced += only_token(bitmask[0], vocab) is not None
        if not matcher.accept_token(int(token)):
            valid = False
            break
    valid = valid and (matcher.is_terminated() or matcher.is_completed())
    if valid and grammar is not None and grammar.kind == "json_schema":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return {"forced": forced, "valid": False}
        try:
            import jsonschema
        except ImportError:  # pragma: no cover - the grammar's acceptance stands alone
            return {"forced": forced, "valid": True}
        valid = jsonschema.Draft202012Validator(json.loads(grammar.source)).is_valid(value)
    return {"forced": forced, "valid": valid}
