"""Several sampled sequences per prompt (``num_return_sequences``), through both doors.

* With ``top_k=1`` sampling is deterministic (each step's only token is the argmax), so
  ``generate(do_sample=True, top_k=1, num_return_sequences=n)`` gives exact references: specdec's
  rows equal them row for row, which checks their order (each prompt's ``n`` rows together) and
  every repeated input, a vision-language target's encoded images included (custom_generate).
* With a full distribution, a chi-square test over two prompts at once: each prompt's rows are
  distributed as the target's own samples (same method and thresholds as
  tests/test_sampling_lossless.py).
* The target prefills each prompt once (all its tokens but the last), and the rows continue from
  copies of that cache (specdec/shared_prefill.py, also for rows a caller repeated); where that
  cannot be done (a static cache, one-token rows) every row is prefilled, as in ``generate()``.
* What cannot be repeated is refused before any forward: image inputs through
  ``SpecDecoder.generate``, a prefix without a row for every returned sequence; greedy search with
  ``n > 1`` is refused, as ``generate()`` refuses it.
"""

from __future__ import annotations

import time

import pytest
import torch

import specdec
from specdec import SpecDecoder
from specdec.return_sequences import grammars_per_row
from specdec.sampling import SamplingParams

from helpers import ForwardRecorder, RecordingStreamer, left_pad, repetitive_prompt, tiny_pair
from test_multimodal import image_prompt, tiny_vlm
from test_sampling_lossless import (PROMPT, TINY_VOCAB, assert_same_distribution, exact_three_token_joint,
                                    joint_counts, tiny_vocab_llama)

NEW = 16
ARGMAX = dict(do_sample=True, top_k=1)  # sampling that draws the argmax: deterministic references


@pytest.fixture(scope="module")
def llama():
    target, draft, _ = tiny_pair("llama")
    rows = [repetitive_prompt(6, seed=1)[0], torch.randint(0, 250, (9,), generator=torch.Generator().manual_seed(2))]
    ids, mask = left_pad(rows, pad_id=257)
    return target, draft, ids, mask


@pytest.mark.parametrize("door", ["SpecDecoder", "custom_generate"])
@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model", "suffix"])
def test_each_prompts_sequences_equal_generates_in_its_order(llama, door, drafter):
    target, draft, ids, mask = llama
    draft = draft if drafter == "draft_model" else drafter
    options = {"num_tokens": 4, "schedule": "fixed"}  # drafts whatever the policy would price them at
    want = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, num_return_sequences=3, **ARGMAX)
    assert want.shape[0] == 6
    if door == "SpecDecoder":
        out = SpecDecoder(target, draft, **options).generate(ids, mask, max_new_tokens=NEW, num_return_sequences=3,
                                                             **ARGMAX)
    else:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, num_return_sequences=3, **ARGMAX,
                              custom_generate=specdec.generate, draft=draft, draft_options=options,
                              return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert out.stats.drafted_tokens > 0


def test_several_sequences_of_two_prompts_are_distributed_as_the_targets_samples():
    """4,000 rows of each of two prompts in one call with a draft model: each prompt's first three
    tokens against its exact law (a mix-up of rows between prompts, or rows that share draws,
    fails)."""
    target = tiny_vocab_llama(0)
    draft = tiny_vocab_llama(5)
    other = PROMPT.flip(1)
    params = SamplingParams(True, 0.9, top_k=3)  # 27 cells: 4,000 rows each keep the total variation small
    n = 4_000
    out = SpecDecoder(target, draft, num_tokens=3, schedule="fixed").generate(
        torch.cat([PROMPT, other]), max_new_tokens=3, num_return_sequences=n, do_sample=True,
        temperature=params.temperature, top_k=params.top_k, generator=torch.Generator().manual_seed(0))
    width = PROMPT.shape[1]
    assert out.sequences.shape == (2 * n, width + 3)
    assert 0 < out.stats.accepted_tokens < out.stats.drafted_tokens
    for b, prompt in enumerate((PROMPT, other)):
        rows = out.sequences[b * n: (b + 1) * n]
        assert torch.equal(rows[:, :width], prompt.expand(n, -1))
        assert_same_distribution(joint_counts(rows[:, width:], TINY_VOCAB),
                                 exact_three_token_joint(target, prompt, params))


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_image_prompts_through_custom_generate_repeat_their_images_as_generate_does(family):
    target = tiny_vlm(family)
    prompts = [image_prompt(family, seed) for seed in (0, 1)]
    ids = torch.cat([p[0] for p in prompts])
    inputs = {k: torch.cat([p[1][k] for p in prompts]) for k in prompts[0][1]}
    call = lambda **more: target.generate(ids, **inputs, max_new_tokens=NEW, num_return_sequences=2,  # noqa: E731
                                          **ARGMAX, **more)
    want = call()
    assert torch.equal(call(custom_generate=specdec.generate, draft="prompt_lookup"), want)
    assert not torch.equal(want[0], want[2])  # the two prompts' rows differ: the order is checked


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_a_text_prompt_to_a_vision_language_target_shares_its_prefill_too(family):
    """A text prompt to a vision-language target (mRoPE for Qwen2-VL) takes the shared prefill."""
    target = tiny_vlm(family)
    ids = torch.tensor([[5, 17, 99, 5, 17, 99, 5, 17], [3, 4, 5, 6, 7, 8, 9, 10]])
    want = target.generate(ids, max_new_tokens=NEW, num_return_sequences=3, **ARGMAX)
    out = SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=NEW, num_return_sequences=3, **ARGMAX)
    assert torch.equal(out.sequences, want)


def test_what_cannot_be_repeated_is_refused_before_any_forward(llama):
    target, _, ids, mask = llama
    decoder = SpecDecoder(target, "prompt_lookup")
    prefix = decoder.prefill(ids[:, :8], mask[:, :8])
    vlm = tiny_vlm("llava")
    image_ids, image_inputs = image_prompt("llava", 0)
    recorders = [ForwardRecorder(target), ForwardRecorder(vlm)]
    try:
        with pytest.raises(ValueError, match=r"prefill every returned row .*repeat_interleave\(3"):
            decoder.generate(ids, mask, prefix=prefix, max_new_tokens=4, num_return_sequences=3, do_sample=True)
        with pytest.raises(ValueError, match="pixel_values.*custom_generate"):
            SpecDecoder(vlm, "prompt_lookup").generate(image_ids, **image_inputs, max_new_tokens=4,
                                                       num_return_sequences=2, do_sample=True)
        qwen_ids, qwen_inputs = image_prompt("qwen2_vl", 0)
        with pytest.raises(ValueError, match=r"the processor on n copies, and num_return_sequences=1\)$"):
            # custom_generate refuses an mRoPE target's images: the message does not send the user there
            SpecDecoder(tiny_vlm("qwen2_vl"), "prompt_lookup").generate(qwen_ids, **qwen_inputs, max_new_tokens=4,
                                                                        num_return_sequences=2, do_sample=True)
        with pytest.raises(ValueError, match="num_return_sequences"):  # greedy: generate() refuses it too
            decoder.generate(ids, mask, max_new_tokens=4, num_return_sequences=2, do_sample=False)
    finally:
        for recorder in recorders:
            recorder.remove()
    assert all(recorder.calls == [] for recorder in recorders)


@pytest.mark.parametrize("door", ["SpecDecoder", "custom_generate"])
def test_the_target_prefills_each_prompt_once_not_once_per_sequence(llama, door):
    """generate() prefills all n * B rows; specdec prefills each prompt's tokens but its last
    once (B rows) and repeats that cache: the rows then start from the same keys and values."""
    target, _, ids, mask = llama
    recorder = ForwardRecorder(target)
    try:
        if door == "SpecDecoder":
            SpecDecoder(target, "prompt_lookup").generate(ids, mask, max_new_tokens=4, num_return_sequences=3,
                                                          do_sample=True)
        else:
            target.generate(ids, attention_mask=mask, max_new_tokens=4, num_return_sequences=3, do_sample=True,
                            custom_generate=specdec.generate, draft="prompt_lookup")
    finally:
        recorder.remove()
    shapes = [(call["batch"], call["tokens"]) for call in recorder.calls]
    assert shapes[0] == (2, ids.shape[1] - 1)
    assert all(batch == 6 and tokens < 8 for batch, tokens in shapes[1:]), shapes


@pytest.mark.parametrize("door", ["SpecDecoder", "custom_generate"])
def test_the_calls_time_includes_the_shared_prefill(llama, door, monkeypatch):
    """stats.total_seconds (and tokens/s) count the shared prefill, and through custom_generate
    the call's argument checks before the run, as SpecDecoder.generate's do."""
    import specdec.shared_prefill

    target, _, ids, mask = llama
    real = specdec.shared_prefill.prefilled

    def slow(*args):
        time.sleep(0.3)
        return real(*args)

    monkeypatch.setattr(specdec.shared_prefill, "prefilled", slow)
    settings = dict(max_new_tokens=2, num_return_sequences=2, do_sample=True)
    if door == "SpecDecoder":
        stats = SpecDecoder(target, "prompt_lookup").generate(ids, mask, **settings).stats
    else:
        stats = target.generate(ids, attention_mask=mask, **settings, custom_generate=specdec.generate,
                                draft="prompt_lookup", return_dict_in_generate=True).stats
    assert stats.total_seconds >= 0.3


def test_rows_a_caller_repeated_are_prefilled_once_and_equal_generate(llama):
    """A greedy batch holding prompt A three times and B once, in any order: two rows prefilled;
    a batch of distinct rows is prefilled whole, as before."""
    target, _, ids, mask = llama
    index = torch.tensor([0, 1, 0, 0])
    decoder = SpecDecoder(target, "prompt_lookup")
    # (batch, tokens) of the first forward: the shared prefill; a whole prompt with drafts riding along
    for batch, prefill in (((ids[index], mask[index]), lambda b, t: (b, t) == (2, ids.shape[1] - 1)),
                           ((ids, mask), lambda b, t: b == 2 and t >= ids.shape[1])):
        recorder = ForwardRecorder(target)
        try:
            out = decoder.generate(*batch, max_new_tokens=NEW)
        finally:
            recorder.remove()
        assert torch.equal(out.sequences, target.generate(batch[0], attention_mask=batch[1], max_new_tokens=NEW,
                                                          do_sample=False))
        assert prefill(recorder.calls[0]["batch"], recorder.calls[0]["tokens"])


def test_a_generator_reading_the_targets_hidden_states_gets_every_rows_prefill(llama):
    """A head (eagle3, mtp) drafts from the hidden states of the prompt's prefill, and learns which
    it reads in its setup (from the head it loads): rows that repeat a prompt are all prefilled
    for it, and it hears every prompt position."""
    from specdec.generators import CandidateGenerator, DraftingInfo, Proposal

    heard = []

    class LearnsStates(CandidateGenerator):
        name = "learns_states"

        def __init__(self):
            self.layers = ()

        def setup(self, ctx):
            self.layers = (1,)

        def drafting(self):
            return DraftingInfo(max_drafts=None, hidden_layers=self.layers)

        def propose(self, ctx, max_drafts):
            return Proposal.empty(ctx.batch_size)

        def observe(self, ctx, feedback):
            heard.append(feedback.hidden)

    target, _, ids, mask = llama
    recorder = ForwardRecorder(target)
    try:
        out = SpecDecoder(target, LearnsStates()).generate(ids, mask, max_new_tokens=4, num_return_sequences=2,
                                                           do_sample=True)
    finally:
        recorder.remove()
    assert out.sequences.shape[0] == 4 and recorder.calls[0]["batch"] == 4
    assert heard and heard[0] is not None


def test_a_refused_call_with_repeated_rows_runs_no_forward(llama):
    """The shared prefill runs once every check has passed, just before the run's first forward."""
    target, _, ids, mask = llama
    index = torch.tensor([0, 1, 0])
    decoder = SpecDecoder(target, "prompt_lookup")
    recorder = ForwardRecorder(target)
    try:
        for settings, problem in ((dict(num_beams=2), "num_beams"), (dict(stop_strings=["x"]), "tokenizer"),
                                  (dict(max_length=3), "no new token"), (dict(grammar={"type": "string"}), "tokenizer"),
                                  (dict(streamer=RecordingStreamer()), "batch size 1")):
            with pytest.raises(ValueError, match=problem):
                decoder.generate(ids[index], mask[index], **({} if "max_length" in settings else {"max_new_tokens": 4}),
                                 **settings)
    finally:
        recorder.remove()
    assert recorder.calls == []


def test_a_static_cache_and_one_token_prompts_prefill_every_row(llama):
    """Where the cache cannot be shared (a static cache) or there is nothing before the last token,
    every row is prefilled, as generate() does; the output is the same either way."""
    target, _, ids, mask = llama
    for decoder, prompt, prompt_mask in ((SpecDecoder(target, "prompt_lookup", cache_implementation="static"),
                                          ids, mask),
                                         (SpecDecoder(target, "prompt_lookup"), ids[:, -1:], mask[:, -1:])):
        want = target.generate(prompt, attention_mask=prompt_mask, max_new_tokens=NEW, num_return_sequences=2,
                               **ARGMAX)
        recorder = ForwardRecorder(target)
        try:
            out = decoder.generate(prompt, prompt_mask, max_new_tokens=NEW, num_return_sequences=2, **ARGMAX)
        finally:
            recorder.remove()
        assert torch.equal(out.sequences, want)
        assert recorder.calls[0]["batch"] == 4


def test_a_prefix_holding_every_returned_row_continues_as_generate(llama):
    target, _, ids, mask = llama
    decoder = SpecDecoder(target, "prompt_lookup")
    prefix = decoder.prefill(ids[:, :9].repeat_interleave(2, 0), mask[:, :9].repeat_interleave(2, 0))
    out = decoder.generate(ids, mask, prefix=prefix, max_new_tokens=NEW, num_return_sequences=2, **ARGMAX)
    want = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, num_return_sequences=2, **ARGMAX)
    assert torch.equal(out.sequences, want)


def test_a_list_of_grammars_gives_each_prompts_rows_its_grammar():
    assert grammars_per_row(["a", "b"], 3, 6) == ["a", "a", "a", "b", "b", "b"]  # one per prompt
    assert grammars_per_row(list("abcdef"), 3, 6) == list("abcdef")  # one per returned row
    assert grammars_per_row(["a"], 3, 6) == ["a"] and grammars_per_row("a", 3, 6) == "a"
    assert grammars_per_row(["a", "b"], 1, 2) == ["a", "b"]
    with pytest.raises(ValueError, match=r"3 grammars for 2 prompts of 3 sequences each: .* one per prompt \(2\) "
                                         r"or one per returned row \(6\)"):
        grammars_per_row(["a", "b", "c"], 3, 6)


@pytest.mark.parametrize("door", ["SpecDecoder", "custom_generate"])
def test_encoder_repetition_penalty_reads_each_rows_own_prompt(llama, door):
    """generate() builds this processor from the prompt before repeating its rows: through
    custom_generate it holds B rows for the run's B * n (an IndexError before)."""
    target, _, ids, mask = llama
    settings = dict(max_new_tokens=NEW, num_return_sequences=2, encoder_repetition_penalty=1.5, **ARGMAX)
    want = target.generate(ids, attention_mask=mask, **settings)
    if door == "SpecDecoder":
        got = SpecDecoder(target, "prompt_lookup").generate(ids, mask, **settings).sequences
    else:
        got = target.generate(ids, attention_mask=mask, **settings, custom_generate=specdec.generate,
                              draft="prompt_lookup")
    assert torch.equal(got, want)
