"""Stopping inside accepted blocks, and streaming.

A verification commits a whole block (accepted drafts + one target token) at once; plain
generation would have checked its stopping rules after every token. The drafts here are the
target itself (every draft accepted, blocks of K+1) or prompt lookup (irregular blocks), so
stops fall at every offset inside blocks. Each case compares with ``target.generate`` given
the same ``eos_token_id`` / ``stop_strings`` / ``stopping_criteria`` and checks the output
length against the position computed from the greedy continuation, so a stop that fired too
late (end of block) or too early would fail.

Streamers (``put``/``end``): the prompt first, then exactly the committed tokens in order,
nothing past a stop, ``end`` once; transformers' ``TextStreamer`` prints what it prints for
``target.generate``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

from specdec import SpecDecoder
from specdec.models import tiny_random

from helpers import left_pad, reference

PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. The quick brown"
HORIZON = 40




@pytest.fixture(scope="module")
def setup():
    """A tiny Llama whose vocabulary is exactly the byte tokenizer's (258 ids) and its greedy
    continuation of the prompt (seed 0 continues with many distinct tokens)."""
    model, tok = tiny_random("llama", seed=0, vocab_size=258)
    ids = tok(PROMPT_TEXT, return_tensors="pt").input_ids  # [1, P]
    ref = model.generate(ids, max_new_tokens=HORIZON, do_sample=False)
    new = ref[0, ids.shape[1]:].tolist()
    assert len(new) == HORIZON  # no EOS within the horizon
    firsts = [j for j, t in enumerate(new) if t not in new[:j]]  # positions of first occurrences
    assert len(firsts) >= 20  # the stops below land at many different offsets
    return model, tok, ids, new, firsts


DECODERS = {
    "self_k3": lambda m, tok: SpecDecoder(m, m, tokenizer=tok, num_tokens=3, schedule="fixed"),
    "self_k8": lambda m, tok: SpecDecoder(m, m, tokenizer=tok, num_tokens=8, schedule="fixed"),
    "prompt_lookup": lambda m, tok: SpecDecoder(m, "prompt_lookup", tokenizer=tok, num_tokens=8),
}


def test_the_target_as_its_own_draft_accepts_whole_blocks(setup):
    model, tok, ids, new, _ = setup
    out = DECODERS["self_k8"](model, tok).generate(ids, max_new_tokens=HORIZON)
    assert out.sequences[0, ids.shape[1]:].tolist() == new
    assert out.stats.mean_accepted_length > 4  # stops below really fall inside long blocks


@pytest.mark.parametrize("kind", list(DECODERS))
def test_max_new_tokens_at_every_offset(setup, kind):
    model, tok, ids, new, _ = setup
    decoder = DECODERS[kind](model, tok)
    for n in range(1, 21):
        out = decoder.generate(ids, max_new_tokens=n)
        assert out.sequences.shape[1] == ids.shape[1] + n
        assert out.sequences[0, ids.shape[1]:].tolist() == new[:n]
        assert out.stats.committed_tokens == n


@pytest.mark.parametrize("kind", list(DECODERS))
def test_one_eos_id_inside_blocks(setup, kind):
    model, tok, ids, new, firsts = setup
    decoder = DECODERS[kind](model, tok)
    for j in firsts[:24]:
        eos = new[j]
        out = decoder.generate(ids, max_new_tokens=HORIZON, eos_token_id=eos)
        ref = reference(model, ids, HORIZON, eos_token_id=eos)
        assert torch.equal(out.sequences, ref), f"eos at new position {j}"
        assert out.sequences.shape[1] == ids.shape[1] + j + 1 and int(out.sequences[0, -1]) == eos


def test_several_eos_ids_stop_at_the_first(setup):
    model, tok, ids, new, firsts = setup
    decoder = DECODERS["self_k8"](model, tok)
    for a, b in [(firsts[3], firsts[12]), (firsts[15], firsts[5]), (firsts[7], firsts[8])]:
        eos = [new[b], new[a], new[b]]  # order and duplicates do not matter
        out = decoder.generate(ids, max_new_tokens=HORIZON, eos_token_id=eos)
        ref = model.generate(ids, max_new_tokens=HORIZON, do_sample=False, eos_token_id=eos)
        assert torch.equal(out.sequences, ref)
        assert out.sequences.shape[1] == ids.shape[1] + min(a, b) + 1


def test_eos_from_the_generation_config(setup, monkeypatch):
    model, tok, ids, new, firsts = setup
    j = firsts[10]
    monkeypatch.setattr(model.generation_config, "eos_token_id", new[j])
    out = DECODERS["self_k8"](model, tok).generate(ids, max_new_tokens=HORIZON)
    ref = model.generate(ids, max_new_tokens=HORIZON, do_sample=False)
    assert torch.equal(out.sequences, ref) and out.sequences.shape[1] == ids.shape[1] + j + 1


def test_eos_in_a_batch_stops_each_row_where_it_would_alone(setup):
    model, tok, _, _, _ = setup
    rows = [tok(t, return_tensors="pt").input_ids[0] for t in (PROMPT_TEXT, "abcabcabc", "Hello, hello, hello")]
    conts = [model.generate(r[None], max_new_tokens=HORIZON, do_sample=False)[0, r.numel():].tolist() for r in rows]
    eos = [conts[0][9], conts[1][2], conts[2][17]]  # a token from each row's continuation
    ids, mask = left_pad(rows, tok.pad_token_id)
    out = SpecDecoder(model, "prompt_lookup", num_tokens=6).generate(ids, mask, max_new_tokens=HORIZON,
                                                                     eos_token_id=eos)
    for i, row in enumerate(rows):
        ref = model.generate(row[None], max_new_tokens=HORIZON, do_sample=False, eos_token_id=eos)[0, row.numel():]
        got = out.sequences[i, ids.shape[1]:]
        assert ref.numel() < HORIZON  # every row stops on an EOS
        assert got[: ref.numel()].tolist() == ref.tolist()
        assert bool((got[ref.numel():] == tok.pad_token_id).all())


# -- stop strings --------------------------------------------------------------------------------
def stop_string_cases(ids: torch.Tensor, new: list[int]) -> list[tuple[list[str], int]]:
    """Stop strings taken from the continuation (printable ASCII bytes), with the new-token
    position where plain generation stops: the first token at which the text ends with one."""
    text = bytes(ids[0].tolist()) + bytes(t for t in new if t < 256)
    assert all(t < 256 for t in new)
    prompt_len = ids.shape[1]
    printable = [j for j, t in enumerate(new) if 33 <= t <= 126]
    singles = [chr(new[j]) for j in printable]
    pairs = [chr(new[j - 1]) + chr(new[j]) for j in printable if j and 33 <= new[j - 1] <= 126]
    cases = [[s] for s in singles[:6]] + [[p] for p in pairs[:3]] + [singles[2:5][::-1]]
    out = []
    for strings in cases:
        stop = next(j for j in range(len(new))
                    if any(text[: prompt_len + j + 1].endswith(s.encode()) for s in strings))
        out.append((strings, stop))
    return out


@pytest.mark.parametrize("kind", ["self_k8", "prompt_lookup"])
def test_stop_strings_inside_blocks(setup, kind):
    model, tok, ids, new, _ = setup
    decoder = DECODERS[kind](model, tok)
    cases = stop_string_cases(ids, new)
    assert len({stop for _, stop in cases}) >= 4
    for strings, stop in cases:
        out = decoder.generate(ids, max_new_tokens=HORIZON, stop_strings=strings)
        ref = reference(model, ids, HORIZON, stop_strings=strings, tokenizer=tok)
        assert torch.equal(out.sequences, ref), strings
        assert out.sequences.shape[1] == ids.shape[1] + stop + 1, strings


# -- user StoppingCriteria -----------------------------------------------------------------------
class StopOnToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __repr__(self) -> str:  # what helpers.reference keys its memo on
        return f"StopOnToken({self.token})"

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token  # [B]


class Recorder(StoppingCriteria):
    """Never stops; records (length, argmax of the last step's scores, last token) of each row at
    each call, and how many steps of scores it got (generate() passes None, or, when the call
    returns its scores, the tuple of every step's [B, V] scores so far)."""

    def __init__(self):
        self.seen: list[tuple[int, int | None, int]] = []
        self.steps: list[int | None] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.steps.append(len(scores) if scores is not None else None)
        for b in range(input_ids.shape[0]):
            argmax = int(scores[-1][b].argmax()) if scores is not None else None
            self.seen.append((int(input_ids.shape[1]), argmax, int(input_ids[b, -1])))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("kind", list(DECODERS))
def test_user_stopping_criteria_inside_blocks(setup, kind):
    model, tok, ids, new, firsts = setup
    decoder = DECODERS[kind](model, tok)
    for j in firsts[1:20:2]:
        criteria = StoppingCriteriaList([StopOnToken(new[j])])
        out = decoder.generate(ids, max_new_tokens=HORIZON, stopping_criteria=criteria)
        ref = reference(model, ids, HORIZON, stopping_criteria=criteria)
        assert torch.equal(out.sequences, ref)
        assert out.sequences.shape[1] == ids.shape[1] + j + 1


@pytest.mark.parametrize("returned", [False, True])
def test_user_criteria_see_every_position_with_generates_scores(setup, returned):
    """Each committed token is shown to the criteria once, in order, with the scores generate()
    passes them: None, or when the call returns its scores the tuple of every step's processed
    scores so far (the last one's argmax is the greedy token just committed)."""
    model, tok, ids, new, firsts = setup
    j = firsts[13]
    extra = {"output_scores": True, "return_dict_in_generate": True} if returned else {}
    ours, theirs = Recorder(), Recorder()
    decoder = DECODERS["self_k8"](model, tok)
    out = decoder.generate(ids, max_new_tokens=HORIZON, stopping_criteria=[ours, StopOnToken(new[j])], **extra)
    model.generate(ids, max_new_tokens=HORIZON, do_sample=False,
                   stopping_criteria=StoppingCriteriaList([theirs, StopOnToken(new[j])]), **extra)
    prompt_len = ids.shape[1]
    assert out.sequences.shape[1] == prompt_len + j + 1
    assert [length for length, _, _ in ours.seen] == list(range(prompt_len + 1, prompt_len + j + 2))
    assert all((argmax == last) if returned else argmax is None for _, argmax, last in ours.seen)
    assert ours.seen == theirs.seen and ours.steps == theirs.steps
    assert ours.steps == (list(range(1, j + 2)) if returned else [None] * (j + 1))


@pytest.mark.parametrize("stop", ["max_new_tokens", "eos"])
def test_user_criteria_also_see_the_last_token(setup, stop):
    """When max_new_tokens or an EOS ends generation, generate() still shows that last token to
    the user's criteria (they may count or log); so do we."""
    model, tok, ids, new, firsts = setup
    eos = new[firsts[11]] if stop == "eos" else None
    ours, theirs = Recorder(), Recorder()
    DECODERS["self_k8"](model, tok).generate(ids, max_new_tokens=17, eos_token_id=eos, stopping_criteria=[ours])
    model.generate(ids, max_new_tokens=17, do_sample=False, eos_token_id=eos,
                   stopping_criteria=StoppingCriteriaList([theirs]))
    assert [(n, last) for n, _, last in ours.seen] == [(n, last) for n, _, last in theirs.seen]
    assert ours.seen[-1][0] == ids.shape[1] + (firsts[11] + 1 if stop == "eos" else 17)


def test_every_criterion_sees_the_token_another_one_stops_on(setup):
    """generate() evaluates every criterion at every token; a recorder listed after the
    criterion that stops still sees the stopping token."""
    model, tok, ids, new, firsts = setup
    j = firsts[6]
    ours, theirs = Recorder(), Recorder()
    DECODERS["self_k8"](model, tok).generate(ids, max_new_tokens=HORIZON,
                                             stopping_criteria=[StopOnToken(new[j]), ours])
    model.generate(ids, max_new_tokens=HORIZON, do_sample=False,
                   stopping_criteria=StoppingCriteriaList([StopOnToken(new[j]), theirs]))
    assert [(n, last) for n, _, last in ours.seen] == [(n, last) for n, _, last in theirs.seen]
    assert ours.seen[-1][0] == ids.shape[1] + j + 1


# -- streamers -----------------------------------------------------------------------------------
class RecordingStreamer:
    def __init__(self):
        self.events: list = []

    def put(self, value):
        self.events.append(("put", value.clone()))

    def end(self):
        self.events.append(("end", None))

    def prompt_and_tokens(self) -> tuple[torch.Tensor, list[int], int]:
        assert self.events[-1] == ("end", None) and [e for e, _ in self.events].count("end") == 1
        puts = [v for e, v in self.events if e == "put"]
        return puts[0], [t for v in puts[1:] for t in v.flatten().tolist()], len(puts) - 1


@pytest.mark.parametrize("kind", ["self_k3", "prompt_lookup"])
def test_streamer_gets_the_prompt_then_exactly_the_committed_tokens(setup, kind):
    model, tok, ids, new, firsts = setup
    for eos in (None, new[firsts[9]]):  # ends on max_new_tokens, or on an EOS inside a block
        streamer = RecordingStreamer()
        out = DECODERS[kind](model, tok).generate(ids, max_new_tokens=30, eos_token_id=eos, streamer=streamer)
        prompt, tokens, chunks = streamer.prompt_and_tokens()
        assert torch.equal(prompt.reshape(ids.shape), ids)
        assert tokens == out.sequences[0, ids.shape[1]:].tolist()
        assert chunks == out.stats.steps  # one chunk per verification, in order
        theirs = RecordingStreamer()
        model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, streamer=theirs)
        assert theirs.prompt_and_tokens()[1] == tokens


def test_transformers_text_streamer_prints_the_same_text(setup, capsys):
    model, tok, _, _, _ = setup
    ids = tok("abc abc abc abc abc", return_tensors="pt").input_ids
    model.generate(ids, max_new_tokens=25, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True))
    theirs = capsys.readouterr().out
    out = SpecDecoder(model, "prompt_lookup", tokenizer=tok, num_tokens=5).generate(
        ids, max_new_tokens=25, streamer=TextStreamer(tok, skip_prompt=True))
    ours = capsys.readouterr().out
    assert ours == theirs
    assert ours.rstrip("\n") == tok.decode(out.sequences[0, ids.shape[1]:])


def test_drafts_after_an_end_of_sequence_are_neither_drafted_nor_verified(setup):
    """The target as its own draft (every draft right) with an EOS id that the greedy continuation
    reaches inside a block: the draft stops there, the verification takes nothing after it, and
    the output is the one ``generate`` gives."""
    from specdec.stopping import Stopper

    model, tok, ids, new, firsts = setup
    eos = new[firsts[5]]
    stopper = Stopper(max_new_tokens=50, eos_token_ids=[eos])
    drafts = torch.tensor([[1, eos, 2, 3], [1, 2, 3, 4], [eos, eos, 5, 6]])
    assert stopper.ended(drafts).tolist() == [[False, True, True, True], [False] * 4, [True] * 4]
    assert stopper.worth_verifying(drafts, torch.tensor([4, 4, 1])).tolist() == [2, 4, 1]
    ref = model.generate(ids, max_new_tokens=HORIZON, do_sample=False, eos_token_id=eos)
    out = SpecDecoder(model, model, tokenizer=tok, num_tokens=16, schedule="fixed").generate(
        ids, max_new_tokens=HORIZON, eos_token_id=eos)
    assert torch.equal(out.sequences, ref) and out.sequences.shape[1] == ids.shape[1] + firsts[5] + 1
    # every draft was right, so no step drafted past the end: the drafts are exactly the tokens kept
    # but the last step's own (the target's token after its last draft, or the EOS it produced)
    assert out.stats.accepted_tokens == out.stats.drafted_tokens
    assert out.stats.drafted_tokens <= firsts[5] + 1
