"""Regression tests for issue 47's stopping and grammar defects (items 2, 3, 4, 9 and 10's first).

2. A left-padded batch whose criteria hold no ``eos_token_id`` (``eos_token_id=None``): a row that a
   ``StoppingCriteria`` or a stop string ended goes on generating, unpadded, until every row has
   stopped, as ``generate()`` does; with an EOS criterion it is padded.
3. A user's ``StoppingCriteria`` gets what ``generate()`` passes: the left-padded batch ``[B, P + t]``
   and ``scores`` (None, or the tuple of every step's processed scores when the call returns them);
   a criterion on the width or on column 0 stops the rows ``generate()`` stops.
4. A grammar whose only allowed tokens another processor forbids stops the call with a clear error
   where a row would take such a position, never where only a rejected draft led.
9. What ``generate()`` accepts works alike: a criterion returning a Python bool, an int tensor or a
   0-d tensor; a logits processor returning float16, bfloat16 or float64 scores.
10. ``grammar=[]`` and a per-row list whose length is not the batch's are ValueErrors before any forward.

Each case runs through both call sites (``SpecDecoder.generate`` and ``model.generate(custom_generate=
specdec.generate, ...)``) and compares with ``target.generate`` on a tiny random Llama whose byte-level
tokenizer has a few merges (the cross-tokenizer draft has others).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, StoppingCriteria, StoppingCriteriaList, StopStringCriteria

import specdec
from specdec.generators import CandidateGenerator, DraftingInfo, Proposal

from helpers import ForwardRecorder, merged_tokenizer_world
from test_processors import DRAFT_MERGES, TARGET_MERGES, TEXTS

# many short cases (about 20 s in all): balanced into the second process of a split session (tests/conftest.py)
pytestmark = pytest.mark.split_second

NEW = 16
GENERATORS = ["none", "prompt_lookup", "draft_model", "self_draft", "self_draft_lookup", "cross_tokenizer"]
SITES = ["decoder", "custom_generate"]


@pytest.fixture(scope="module")
def world():
    """The target, its tokenizers, one decoder per generator, a single prompt and a left-padded
    batch of three (two rows padded), and ``reference(shape, **settings)``: ``target.generate``'s
    greedy sequences for the same settings."""
    target, target_tok, draft_tok, decoders, prompts = merged_tokenizer_world(TARGET_MERGES, DRAFT_MERGES, TEXTS)

    def reference(shape: str, **settings):
        ids, mask = prompts[shape]
        if "stopping_criteria" in settings:
            settings["stopping_criteria"] = StoppingCriteriaList(settings["stopping_criteria"])
        if "stop_strings" in settings:
            settings["tokenizer"] = target_tok
        return target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **settings)

    return target, target_tok, draft_tok, decoders, prompts, reference


def call(world, site: str, drafter: str, shape: str, **settings):
    """One call (greedy unless it says so) of generator ``drafter`` through ``site``; returns what it
    returns (a ``SpecOutput`` through the decoder; through ``custom_generate``, sequences or a dict
    as ``generate()``)."""
    target, tok, draft_tok, decoders, prompts, _ = world
    ids, mask = prompts[shape]
    if site == "decoder":
        settings.setdefault("do_sample", False)
        return decoders[drafter].generate(ids, mask, max_new_tokens=NEW, **settings)
    criteria = list(settings.pop("stopping_criteria", []))
    if "stop_strings" in settings:  # generate() keeps its tokenizer from a custom_generate: the criterion it builds
        criteria.append(StopStringCriteria(tok, settings.pop("stop_strings")))
    if criteria:
        settings["stopping_criteria"] = StoppingCriteriaList(criteria)
    both = {"draft_tokenizer": draft_tok} if drafter == "cross_tokenizer" else {}
    settings.setdefault("do_sample", False)
    return target.generate(ids, attention_mask=mask, max_new_tokens=NEW, custom_generate=specdec.generate,
                           draft=decoders[drafter].candidate_generator, target_tokenizer=tok, **both, **settings)


def sequences(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.sequences


class StopOnToken(StoppingCriteria):
    """Stops a row whose last token is ``token`` (per row: other rows go on)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def row_stopper(world) -> tuple[StopOnToken, list[str]]:
    """A criterion and a stop string that each end one row of the batch early (the others later
    or never), read from the batch's greedy continuation without EOS."""
    target, tok, _, _, prompts, reference = world
    width = prompts["batch"][0].shape[1]
    rows = reference("batch", eos_token_id=None)[:, width:].tolist()
    token = next(t for t in rows[2][:6] if t not in rows[1])  # row 2 stops early, row 1 never
    text = [tok.decode([t]) for t in rows[1][:6]]  # a printable character only row 1 makes
    string = next(s for s in text if len(s) == 1 and s.isprintable() and s.strip()
                  and not any(s in tok.decode(r) for r in (rows[0], rows[2])))
    return StopOnToken(token), [string]


# -- 2. a row stopped without an EOS criterion goes on ------------------------------------------------------
@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize("stop", ["criterion", "stop_string"])
def test_a_row_stopped_without_an_eos_criterion_goes_on_as_in_generate(world, stop, generator, site):
    criterion, strings = row_stopper(world)
    settings = {"stopping_criteria": [criterion]} if stop == "criterion" else {"stop_strings": strings}
    width = world[4]["batch"][0].shape[1]
    for eos in (None, "config"):  # no EOS criterion: nothing padded; the config's EOS: the stopped row padded
        given = {"eos_token_id": None} if eos is None else {}
        want = world[5]("batch", **given, **dict(settings))
        out = sequences(call(world, site, generator, "batch", **given, **dict(settings)))
        assert torch.equal(out, want), (eos, out[:, width:].tolist(), want[:, width:].tolist())
        padded = bool((want[:, width:] == world[1].pad_token_id).any())
        assert padded == (eos is not None)  # the stop really happened, and generate() padded only with an EOS


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("generator", GENERATORS)
def test_one_row_stopped_without_an_eos_criterion_ends_the_call(world, generator, site):
    """Batch 1: the criterion's stop ends the call where generate() ends it, EOS or not."""
    target, tok, _, _, prompts, reference = world
    width = prompts["single"][0].shape[1]
    token = reference("single", eos_token_id=None)[0, width + 5].item()
    for given in ({"eos_token_id": None}, {}):
        want = reference("single", stopping_criteria=[StopOnToken(token)], **given)
        out = sequences(call(world, site, generator, "single", stopping_criteria=[StopOnToken(token)], **given))
        assert torch.equal(out, want) and out.shape[1] < width + NEW


@pytest.mark.parametrize("site", SITES)
def test_an_empty_eos_list_is_an_eos_criterion_as_in_generate(world, site):
    """``eos_token_id=[]``: generate() still builds an EosTokenCriteria (of no ids), so it pads the
    row a criterion ended, unlike ``eos_token_id=None``."""
    criterion = row_stopper(world)[0]
    want = world[5]("batch", eos_token_id=[], stopping_criteria=[criterion])
    assert bool((want[:, world[4]["batch"][0].shape[1]:] == world[1].pad_token_id).any())
    out = sequences(call(world, site, "prompt_lookup", "batch", eos_token_id=[], stopping_criteria=[criterion]))
    assert torch.equal(out, want)


# -- 3. what a criterion sees ---------------------------------------------------------------------------------
class Width(StoppingCriteria):
    """Stops every row once the batch is ``width`` columns wide (generate(): all at one step)."""

    def __init__(self, width: int):
        self.width = width

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.width, dtype=torch.bool)


class ColumnZero(StoppingCriteria):
    """Stops the rows whose column 0 is padding: the left-padded rows, at their first new token."""

    def __init__(self, pad: int):
        self.pad = pad

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, 0] == self.pad


class PythonBool(StoppingCriteria):
    """A plain Python bool, which generate() takes (``is_done | True``)."""

    def __init__(self, width: int):
        self.width = width

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] >= self.width


class IntTensor(StopOnToken):
    """One int64 value per row (generate(): ``unfinished & ~is_done``)."""

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -1] == self.token).long()


class ZeroDim(PythonBool):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.tensor(input_ids.shape[1] >= self.width)


def criteria(world) -> dict:
    tok, prompts = world[1], world[4]
    width = prompts["batch"][0].shape[1]
    token = row_stopper(world)[0].token
    return {"width": Width(width + 5), "column_zero": ColumnZero(tok.pad_token_id),
            "python_bool": PythonBool(width + 7), "int_tensor": IntTensor(token), "zero_dim": ZeroDim(width + 4)}


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("generator", ["prompt_lookup", "draft_model", "cross_tokenizer"])
@pytest.mark.parametrize("kind", ["width", "column_zero", "python_bool", "int_tensor", "zero_dim"])
def test_a_criterion_on_the_padded_batch_stops_the_rows_generate_stops(world, kind, generator, site):
    """Width and column 0 of the left-padded batch, and the return types generate() takes (item 9)."""
    criterion = criteria(world)[kind]
    for shape in ("batch", "single"):
        for given in ({"eos_token_id": None}, {}):
            want = world[5](shape, stopping_criteria=[criterion], **given)
            out = sequences(call(world, site, generator, shape, stopping_criteria=[criterion], **given))
            assert torch.equal(out, want), (shape, given)


class Layout(StoppingCriteria):
    """Never stops; keeps every call's input ids and the shapes of its scores."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, list | None]] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append((input_ids.clone(), None if scores is None else [tuple(s.shape) for s in scores]))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("returned", [False, True])
def test_criteria_get_the_left_padded_batch_and_generates_scores(world, returned, site):
    """Every call: the whole batch [3, P + t], the prompt as given then each row's new tokens
    (those of a row that has not reached t yet are padding), and scores as generate() passes them."""
    target, tok, _, _, prompts, reference = world
    ids = prompts["batch"][0]
    width, vocab = ids.shape[1], target.config.vocab_size
    extra = {"output_scores": True, "return_dict_in_generate": True} if returned else {}
    want = reference("batch", eos_token_id=None)
    seen = Layout()
    call(world, site, "prompt_lookup", "batch", stopping_criteria=[seen], eos_token_id=None, **extra)
    assert {int(c[0].shape[1]) for c in seen.calls} == set(range(width + 1, width + NEW + 1))
    for batch, shapes in seen.calls:
        t = batch.shape[1] - width
        assert batch.shape[0] == 3 and torch.equal(batch[:, :width], ids)
        for row, expected in zip(batch[:, width:], want[:, width: width + t]):
            known = int((row == expected).long().cumprod(0).sum())
            assert bool((row[known:] == tok.pad_token_id).all()), (t, row, expected)
        assert shapes == ([(3, vocab)] * t if returned else None)


# -- 9. what a logits processor may return -----------------------------------------------------------------
class Cast(LogitsProcessor):
    """A user's processor that returns the scores in another dtype (and penalizes one token)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, 97] -= 1.0
        return scores.to(self.dtype)


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("generator", GENERATORS)
def test_a_processor_returning_float16_works_as_in_generate(world, generator, site):
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        settings = {"logits_processor": [Cast(dtype)], "output_scores": True, "return_dict_in_generate": True,
                    "repetition_penalty": 1.3}  # a processor after it gets its dtype
        want = world[5]("batch", **settings)
        out = call(world, site, generator, "batch", **settings)
        assert torch.equal(out.sequences, want.sequences), dtype
        assert out.scores[0].dtype == want.scores[0].dtype == dtype
        assert torch.allclose(out.scores[0].double(), want.scores[0].double(), atol=1e-2)  # the same scores
    sampled = call(world, site, generator, "batch", logits_processor=[Cast(torch.float16)], do_sample=True,
                   top_k=20, generator=torch.Generator().manual_seed(0))  # samples from float16 scores
    assert sequences(sampled).shape[0] == 3


# -- 4. a grammar with no allowed token --------------------------------------------------------------------
@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("generator", GENERATORS)
def test_a_grammar_whose_tokens_are_all_forbidden_stops_with_a_clear_error(world, generator, site):
    pytest.importorskip("xgrammar")
    from specdec.grammar import Grammar

    for pattern, where in (("q", 1), ("ab", 2)):
        forbidden = [ord(pattern[-1])]  # its last character: the new tokens before it are allowed, then none
        for sample in (False, True):
            settings = {"grammar": Grammar.regex(pattern), "suppress_tokens": forbidden, "do_sample": sample}
            if sample:
                settings["generator"] = torch.Generator().manual_seed(0)
            with pytest.raises(ValueError, match=f"no token is allowed at new token {where} of row 0"):
                call(world, site, generator, "single", **settings)


class Drafts(CandidateGenerator):
    """Proposes the same point-mass drafts every step."""

    def __init__(self, drafts):
        self.drafts = drafts

    def drafting(self):
        return DraftingInfo(max_drafts=None)

    def propose(self, ctx, max_drafts):
        return Proposal.from_rows([self.drafts[: int(m)] for m in max_drafts.tolist()], ctx.tokens.device)


def test_a_dead_end_only_a_rejected_draft_reaches_is_no_error(world):
    """The grammar "xc|yd" with the follower of the letter the target does not choose forbidden:
    a draft down that path is rejected before its dead end, and the output is generate()'s."""
    xgr = pytest.importorskip("xgrammar")
    from specdec.grammar import Grammar, compile_grammar

    target, tok, _, _, prompts, _ = world
    ids, mask = prompts["single"]
    grammar = Grammar.regex("xc|yd")
    compiled = compile_grammar(grammar, tok, target.config.vocab_size, [tok.eos_token_id])
    free = target.generate(ids, max_new_tokens=3, do_sample=False,
                           logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
    chosen = chr(int(free[0, ids.shape[1]]))
    other, dead = ("y", "d") if chosen == "x" else ("x", "c")
    want = target.generate(ids, max_new_tokens=4, do_sample=False, suppress_tokens=[ord(dead)],
                           logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
    decoder = specdec.SpecDecoder(target, Drafts([ord(other), ord(dead)]), tokenizer=tok)
    out = decoder.generate(ids, max_new_tokens=4, grammar=grammar, suppress_tokens=[ord(dead)])
    assert torch.equal(out.sequences, want)
    assert out.stats.drafted_tokens >= 1  # the draft down the dead path was verified


class TreeDrafts(Drafts):
    """Proposes the same point-mass tree every step: ``drafts`` as (token, parent) pairs."""

    def propose(self, ctx, max_drafts):
        return Proposal.from_tree([self.drafts[: int(m)] for m in max_drafts.tolist()])


def test_a_tree_under_a_grammar_stops_at_a_dead_end_on_its_path_and_not_off_it(world):
    """Trees: a column that allows no token stops the call with the chain's error where the accepted
    path reaches it (after "a" under "ab" with "b" forbidden); one only a rejected sibling leads to
    (under "xc|yd", the sibling the target does not choose, then its forbidden follower) is no
    error, and the output is generate()'s."""
    xgr = pytest.importorskip("xgrammar")
    from specdec.grammar import Grammar, compile_grammar

    target, tok, _, _, prompts, _ = world
    ids, mask = prompts["single"]
    decoder = specdec.SpecDecoder(target, TreeDrafts([(ord("a"), -1), (ord("z"), -1), (ord("b"), 0)]), tokenizer=tok)
    with pytest.raises(ValueError, match="no token is allowed at new token 2 of row 0"):
        decoder.generate(ids, max_new_tokens=4, grammar=Grammar.regex("ab"), suppress_tokens=[ord("b")])
    grammar = Grammar.regex("xc|yd")
    compiled = compile_grammar(grammar, tok, target.config.vocab_size, [tok.eos_token_id])
    free = target.generate(ids, max_new_tokens=3, do_sample=False,
                           logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
    chosen = chr(int(free[0, ids.shape[1]]))
    other, dead = ("y", "d") if chosen == "x" else ("x", "c")
    want = target.generate(ids, max_new_tokens=4, do_sample=False, suppress_tokens=[ord(dead)],
                           logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
    tree = TreeDrafts([(ord(other), -1), (ord(dead), 0), (ord(chosen), -1)])
    out = specdec.SpecDecoder(target, tree, tokenizer=tok).generate(ids, max_new_tokens=4, grammar=grammar,
                                                                     suppress_tokens=[ord(dead)])
    assert torch.equal(out.sequences, want)
    assert out.stats.tree_steps >= 1  # the tree, the dead path in it, was verified as a tree


# -- 10. a list of grammars that does not fit the batch ------------------------------------------------------
@pytest.mark.parametrize("site", SITES)
def test_a_list_of_grammars_must_fit_the_batch_before_any_forward(world, site):
    pytest.importorskip("xgrammar")
    from specdec.grammar import Grammar

    one = Grammar.regex("[a-z]+")
    recorder = ForwardRecorder(world[0])
    try:
        for grammar, message in (([], "empty list"), ([one] * 4, "4 grammars for a batch of 3"),
                                 ([one] * 2, "2 grammars for a batch of 3")):
            with pytest.raises(ValueError, match=message):
                call(world, site, "prompt_lookup", "batch", grammar=grammar)
        assert recorder.calls == []
        out = call(world, site, "prompt_lookup", "batch", grammar=[one] * 3)  # one per row, or one for all
        assert sequences(out).shape[0] == 3 and recorder.calls
    finally:
        recorder.remove()
