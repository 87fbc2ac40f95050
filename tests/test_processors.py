"""Logits processors at every verified position (docs/generation.md).

* **Over a block.** Every processor class ``generate()`` builds (and a user's own), applied by
  ``specdec.processors`` over a block of positions with rows of different lengths, left padding
  and a row that already left the batch, equals the processor called position by position on the
  input ids ``generate()`` would pass there: exactly, bit for bit.
* **Greedy matrix.** Each setting alone and a realistic mix (repetition penalty + no-repeat
  n-grams + min_new_tokens + bad words) x every built-in generator, for one prompt and a
  left-padded batch: the output equals ``model.generate()``'s with the same settings. The
  references are computed once per module; settings that name tokens take them from the plain
  greedy output, so that each one changes what is generated.
* **Sampling.** Repetition penalty + top-p + min-p with prompt lookup and with a draft model on a
  tiny 8-token Llama: the joint distribution of three sampled tokens passes the chi-square test
  of tests/test_sampling_lossless.py against the exact processed distribution.
* **Outputs.** ``output_scores`` / ``output_logits`` as ``generate()`` returns them; the streamer
  gets exactly the committed tokens.
* **Drafts see the processors.** A lookup's draft a processor forbids is dropped before
  verification; a draft model drafts from the processed scores (drafting for itself it then
  agrees every time).
* **Settings from the generation config**, explicit arguments over them; what cannot be
  reproduced is refused by name before any forward.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, WatermarkingConfig
from transformers.generation import logits_process as lp

from specdec import SpecDecoder
from specdec.generators import CandidateGenerator, DraftingInfo, Proposal
from specdec.models import byte_tokenizer, tiny_random
from specdec.processors import BlockProcessors

from helpers import ForwardRecorder, RecordingStreamer, every_generator, left_pad, perturbed_copy, pin_costs
from test_sampling_lossless import PROMPT, TINY_VOCAB, assert_same_distribution, joint_counts, tiny_vocab_llama

NEW = 16  # new tokens per greedy run
TARGET_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or")]
DRAFT_MERGES = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("w", "o"), ("r", "l"), ("H", "e")]
TEXTS = ["the world of the word, the world of the", "or the", "the worth of a world"]


# -- over a block: each processor class against itself, position by position --------------------------
class ThreeBackPenalty(LogitsProcessor):
    """A user's processor, a function of (input_ids, scores): the token three back is penalized."""

    def __call__(self, input_ids, scores):
        return scores.scatter_add(1, input_ids[:, -3:-2], torch.full_like(scores[:, :1], -30.0))


def block_case():
    """A prompt batch of 4 (two rows left-padded with id 49), row 2 retired; 3 rows at different
    generated lengths, 5 drafts each, 6, 3 and 1 positions scored."""
    g = torch.Generator().manual_seed(0)
    vocab, width = 50, 6
    prompt = torch.randint(0, 10, (4, width), generator=g)
    prompt[1, :2], prompt[3, :3] = 49, 49
    unpadded = [6, 4, 6, 3]
    rows = torch.tensor([0, 1, 3])
    generated = [torch.randint(0, 10, (n,), generator=g) for n in (5, 2, 7)]
    tokens = torch.zeros(3, 40, dtype=torch.long)
    lengths, prompt_lengths = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    for b, r in enumerate(rows.tolist()):
        row = torch.cat([prompt[r, width - unpadded[r]:], generated[b]])
        tokens[b, : row.numel()], lengths[b], prompt_lengths[b] = row, row.numel(), unpadded[r]
    block = torch.randint(0, 10, (3, 5), generator=g)
    counts = torch.tensor([6, 3, 1])
    scores = torch.randn(3, 6, vocab, generator=g) * 3
    return prompt, rows, generated, tokens, lengths, prompt_lengths, block, counts, scores


BLOCK_PROCESSORS = {
    "repetition_penalty_per_row": lambda p: lp.RepetitionPenaltyLogitsProcessor(1.3, torch.tensor([0, 2, 0, 3])),
    "repetition_reward": lambda p: lp.RepetitionPenaltyLogitsProcessor(0.7),
    "repetition_penalty_int": lambda p: lp.RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=4),
    "no_repeat_1": lambda p: lp.NoRepeatNGramLogitsProcessor(1),
    "no_repeat_2": lambda p: lp.NoRepeatNGramLogitsProcessor(2),
    "no_repeat_3": lambda p: lp.NoRepeatNGramLogitsProcessor(3),
    "no_repeat_longer_than_any_row": lambda p: lp.NoRepeatNGramLogitsProcessor(40),
    "bad_words": lambda p: lp.NoBadWordsLogitsProcessor([[3], [4, 5], [1, 2, 3]], eos_token_id=7),
    # bad words that are only EOS ids: transformers drops them all, and the processor changes nothing
    "bad_words_only_eos": lambda p: lp.NoBadWordsLogitsProcessor([[7], [8]], eos_token_id=[7, 8]),
    # an empty banned sequence, which generate() takes: the block applier read windows of -1 ids
    "bad_words_empty": lambda p: lp.NoBadWordsLogitsProcessor([[]], eos_token_id=7),
    "sequence_bias": lambda p: lp.SequenceBiasLogitsProcessor([[[3], 1.5], [[4, 5], -2.0]]),
    "min_length": lambda p: lp.MinLengthLogitsProcessor(15, 7),
    "min_new_tokens": lambda p: lp.MinNewTokensLengthLogitsProcessor(6, 5, [7, 8]),
    "suppress": lambda p: lp.SuppressTokensLogitsProcessor([1, 2]),
    "begin_suppress": lambda p: lp.SuppressTokensAtBeginLogitsProcessor([1, 2], 9),
    "forced_bos": lambda p: lp.ForcedBOSTokenLogitsProcessor(3),
    "forced_eos": lambda p: lp.ForcedEOSTokenLogitsProcessor(13, 7),
    "exponential_decay": lambda p: lp.ExponentialDecayLengthPenalty((2, 1.5), 7, 6),
    "encoder_repetition": lambda p: lp.EncoderRepetitionPenaltyLogitsProcessor(1.4, p),
    "encoder_no_repeat": lambda p: lp.EncoderNoRepeatNGramLogitsProcessor(2, p),
    "prefix_allowed": lambda p: lp.PrefixConstrainedLogitsProcessor(lambda b, s: [int(s[-1]) % 7, b + 10, 20], 1),
    "inf_nan": lambda p: lp.InfNanRemoveLogitsProcessor(),
    "renormalize": lambda p: lp.LogitNormalization(),
    "temperature": lambda p: lp.TemperatureLogitsWarper(0.7),
    "top_k": lambda p: lp.TopKLogitsWarper(5),
    "top_p": lambda p: lp.TopPLogitsWarper(0.8),
    "min_p": lambda p: lp.MinPLogitsWarper(0.1),
    "typical": lambda p: lp.TypicalLogitsWarper(0.9),
    "epsilon": lambda p: lp.EpsilonLogitsWarper(0.01),
    "eta": lambda p: lp.EtaLogitsWarper(0.01),
    "top_h": lambda p: lp.TopHLogitsWarper(0.5),
    "watermark": lambda p: lp.WatermarkLogitsProcessor(50, "cpu"),
    "user": lambda p: ThreeBackPenalty(),
}


@pytest.mark.parametrize("name", sorted(BLOCK_PROCESSORS))
def test_a_block_is_processed_as_generate_processes_each_position(name):
    prompt, rows, generated, tokens, lengths, prompt_lengths, block, counts, scores = block_case()
    processor = BLOCK_PROCESSORS[name](prompt)
    processors = BlockProcessors([processor], prompt)
    pos = processors.positions(tokens, lengths, prompt_lengths, rows, block, counts)
    got = processors.apply(scores.clone(), pos)
    for b, row in enumerate(rows.tolist()):
        sequence = torch.cat([prompt[row], generated[b], block[b]])
        for j in range(int(counts[b])):
            # generate()'s batch at that step: row ``row`` is this one (the others hold a copy)
            ids = sequence[: prompt.shape[1] + generated[b].numel() + j][None].repeat(prompt.shape[0], 1)
            want = processor(ids, scores[b, j][None].repeat(prompt.shape[0], 1))[row]
            assert torch.equal(got[b, j], want), (b, j)


def test_processors_that_remember_earlier_steps_are_refused():
    config = GenerationConfig(guidance_scale=1.5)
    model, _ = tiny_random("llama", seed=1)
    processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=4,
                                             encoder_input_ids=torch.zeros(1, 4, dtype=torch.long), device="cpu")
    with pytest.raises(ValueError, match="guidance_scale"):
        BlockProcessors(processors, torch.zeros(1, 4, dtype=torch.long))


# -- greedy: every setting x every generator, one prompt and a left-padded batch ------------------------
SETTINGS = {
    # name: (settings from the plain output's tokens t, whether they change the output)
    "repetition_penalty": lambda t: {"repetition_penalty": 1.5},
    "encoder_repetition_penalty": lambda t: {"encoder_repetition_penalty": 2.0},
    "no_repeat_ngram_size": lambda t: {"no_repeat_ngram_size": 2},
    "bad_words_ids": lambda t: {"bad_words_ids": [[t[1]], [t[3], t[4]]]},
    "bad_words_ids_only_eos": lambda t: {"eos_token_id": t[2], "bad_words_ids": [[t[2]]]},
    "suppress_tokens": lambda t: {"suppress_tokens": [t[0], t[2]]},
    "begin_suppress_tokens": lambda t: {"begin_suppress_tokens": [t[0]]},
    "min_length": lambda t: {"eos_token_id": t[2], "min_length": 24},
    "min_new_tokens": lambda t: {"eos_token_id": t[2], "min_new_tokens": 6},
    "sequence_bias": lambda t: {"sequence_bias": [[[t[1]], -20.0], [[t[2], t[3]], -20.0]]},
    "prefix_allowed_tokens_fn": lambda t: {"prefix_allowed_tokens_fn": lambda b, ids: [
        v for v in range(256) if (v + int(ids[-1])) % 3]},
    "exponential_decay_length_penalty": lambda t: {"eos_token_id": t[6], "exponential_decay_length_penalty": (1, 4.0)},
    "forced_eos_token_id": lambda t: {"forced_eos_token_id": t[0]},
    "renormalize_logits": lambda t: {"renormalize_logits": True, "remove_invalid_values": True},
    "watermarking_config": lambda t: {"watermarking_config": WatermarkingConfig(bias=6.0)},
    "logits_processor": lambda t: {"logits_processor": [ThreeBackPenalty()]},
    "mix": lambda t: {"repetition_penalty": 1.2, "no_repeat_ngram_size": 3, "eos_token_id": t[2],
                      "min_new_tokens": 6, "bad_words_ids": [[t[1]], [t[3], t[4]]]},
}
UNCHANGED = {"renormalize_logits", "bad_words_ids_only_eos"}  # log-softmax keeps the argmax; EOS is never a bad word
GENERATORS = ["none", "prompt_lookup", "draft_model", "self_draft", "cross_tokenizer"]  # every built-in


@pytest.fixture(scope="module")
def world():
    """The target (a tiny Llama, a byte-level tokenizer with merges), one decoder per generator (each
    drafting a fixed 4 tokens, so that drafting happens), the prompts, and the references of each
    setting, computed once on first use."""
    target_tok, draft_tok = byte_tokenizer(TARGET_MERGES), byte_tokenizer(DRAFT_MERGES)
    target, _ = tiny_random("llama", seed=7, tokenizer=target_tok)
    pin_costs(target)
    draft = perturbed_copy(target, 0.1, seed=8)
    decoders = every_generator(target, draft, target_tok, draft_tok)
    single = target_tok(TEXTS[0], return_tensors="pt").input_ids
    batch = left_pad([target_tok(t, return_tensors="pt").input_ids[0] for t in TEXTS], target_tok.pad_token_id)
    prompts = {"single": (single, torch.ones_like(single)), "batch": batch}
    plain = target.generate(single, max_new_tokens=NEW, do_sample=False)[0, single.shape[1]:].tolist()
    references = {}

    def reference(setting: str, shape: str) -> tuple[dict, torch.Tensor]:
        if (setting, shape) not in references:
            kwargs = SETTINGS[setting](plain)
            ids, mask = prompts[shape]
            references[setting, shape] = kwargs, target.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                                                 do_sample=False, **kwargs)
        return references[setting, shape]

    return target, decoders, prompts, plain, reference


@pytest.mark.parametrize("shape", ["single", "batch"])
@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_with_processors_equals_generate(world, setting, generator, shape):
    target, decoders, prompts, plain, reference = world
    kwargs, want = reference(setting, shape)
    ids, mask = prompts[shape]
    if shape == "single" and setting not in UNCHANGED:  # the setting matters here
        assert want[0, ids.shape[1]:].tolist() != plain[: want.shape[1] - ids.shape[1]], setting
    out = decoders[generator].generate(ids, mask, max_new_tokens=NEW, **kwargs)
    assert torch.equal(out.sequences, want)


@pytest.mark.parametrize("shape", ["single", "batch"])
def test_greedy_with_processors_equals_generate_with_the_hybrid_self_draft(world, shape):
    """self_draft with lookup: lookup's drafts (checked against the processors) and the copy's."""
    target, decoders, prompts, plain, reference = world
    kwargs, want = reference("mix", shape)
    out = decoders["self_draft_lookup"].generate(*prompts[shape], max_new_tokens=NEW, **kwargs)
    assert torch.equal(out.sequences, want)


# -- sampling: the chi-square test of tests/test_sampling_lossless.py with processors --------------------
N = 20_000
SAMPLING = {"do_sample": True, "repetition_penalty": 1.3, "top_p": 0.85, "min_p": 0.1}


def exact_processed_joint(model, prompt: torch.Tensor, settings: dict) -> torch.Tensor:
    """[V, V, V] probability of the first three sampled tokens under ``settings``: the processors
    generate() builds, applied to every 0-, 1- and 2-token continuation of ``prompt [1, P]``."""
    config, _ = model._prepare_generation_config(None, **settings)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device="cpu")
    processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=prompt.shape[1],
                                             encoder_input_ids=prompt, device="cpu")
    v = TINY_VOCAB
    probs = []
    with torch.no_grad():
        for tails in (torch.zeros(1, 0, dtype=torch.long), torch.arange(v)[:, None],
                      torch.cartesian_prod(torch.arange(v), torch.arange(v))):
            ids = torch.cat([prompt.repeat(tails.shape[0], 1), tails], 1)
            probs.append(torch.softmax(processors(ids, model(ids).logits[:, -1].float()), -1))
    return probs[0][0][:, None, None] * probs[1][:, :, None] * probs[2].view(v, v, v)


@pytest.fixture(scope="module")
def vocab8():
    target = tiny_vocab_llama(0)
    return target, perturbed_copy(target, 0.3, seed=1)


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
def test_sampling_with_processors_is_lossless(vocab8, drafter):
    target, draft = vocab8
    decoder = SpecDecoder(target, draft if drafter == "draft_model" else drafter, num_tokens=3, schedule="fixed")
    out = decoder.generate(PROMPT.repeat(N, 1), max_new_tokens=3, generator=torch.Generator().manual_seed(0),
                           **SAMPLING)
    new = out.sequences[:, PROMPT.shape[1]:]
    assert new.shape == (N, 3)
    assert out.stats.drafted_tokens >= N and 0 < out.stats.accepted_tokens < out.stats.drafted_tokens
    assert_same_distribution(joint_counts(new, TINY_VOCAB), exact_processed_joint(target, PROMPT, SAMPLING))


# -- outputs ------------------------------------------------------------------------------------------------
def test_scores_and_logits_are_generates(world):
    target, decoders, prompts, plain, reference = world
    kwargs, want = reference("mix", "batch")
    ids, mask = prompts["batch"]
    got = decoders["draft_model"].generate(ids, mask, max_new_tokens=NEW, output_scores=True, output_logits=True,
                                           return_dict_in_generate=True, **kwargs)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_scores=True,
                          output_logits=True, return_dict_in_generate=True, **kwargs)
    assert torch.equal(got.sequences, ref.sequences) and got.stats.steps > 0
    assert len(got.scores) == len(ref.scores) and len(got.logits) == len(ref.logits)
    generated = (got.sequences[:, ids.shape[1]:] != target.generation_config.pad_token_id).sum(1)  # [B] before padding
    for step, (ours, theirs) in enumerate(zip(got.scores, ref.scores)):
        rows = generated > step  # generate() keeps scoring the rows that ended; a speculative run does not
        assert torch.equal(ours[rows].isinf(), theirs[rows].isinf())
        assert torch.allclose(ours[rows].nan_to_num(0, 0, 0), theirs[rows].nan_to_num(0, 0, 0), atol=1e-4)
        assert torch.allclose(got.logits[step][rows], ref.logits[step][rows], atol=1e-4)


def test_the_streamer_gets_exactly_the_committed_tokens(world):
    target, decoders, prompts, plain, reference = world
    kwargs, want = reference("mix", "single")
    streamer = RecordingStreamer()
    out = decoders["prompt_lookup"].generate(*prompts["single"], max_new_tokens=NEW, streamer=streamer, **kwargs)
    assert streamer.ended and torch.equal(torch.cat(streamer.puts), out.sequences[0])


# -- drafts see the processors ------------------------------------------------------------------------------
class FixedDrafts(CandidateGenerator):
    """Proposes the same point-mass drafts every step, on no schedule of the policy's."""

    def __init__(self, drafts):
        self.drafts, self.offered = drafts, []

    def drafting(self):
        return DraftingInfo(max_drafts=None)

    def propose(self, ctx, max_drafts):
        return Proposal.from_rows([self.drafts[: int(m)] for m in max_drafts.tolist()], ctx.tokens.device)

    def observe(self, ctx, feedback):
        self.offered.append(int(feedback.offered.max()))


def test_a_lookup_draft_a_processor_forbids_is_dropped_before_verification(world):
    target, decoders, prompts, plain, reference = world
    kwargs, want = reference("bad_words_ids", "single")
    generator = FixedDrafts([plain[0], plain[1], plain[0]])  # plain[1] is a bad word: drafts stop before it
    session = SpecDecoder(target, generator)
    out = session.generate(*prompts["single"], max_new_tokens=NEW, **kwargs)
    assert torch.equal(out.sequences, want)
    assert out.stats.drafted_tokens == out.stats.steps - 1  # the last step has no room for a draft


def test_prompt_lookup_under_no_repeat_ngrams_verifies_no_draft(world):
    """Every lookup draft repeats the bigram it was copied from: none reaches the target."""
    target, decoders, prompts, plain, reference = world
    kwargs, want = reference("no_repeat_ngram_size", "single")
    out = decoders["prompt_lookup"].generate(*prompts["single"], max_new_tokens=NEW, **kwargs)
    assert torch.equal(out.sequences, want) and out.stats.drafted_tokens == 0


def test_a_draft_model_drafts_from_the_processed_scores(world):
    """The target drafting for itself proposes the processed argmax: every draft is accepted."""
    target, decoders, prompts, plain, reference = world
    kwargs, want = reference("mix", "single")
    out = SpecDecoder(target, target, num_tokens=4, schedule="fixed").generate(*prompts["single"], max_new_tokens=NEW,
                                                                              **kwargs)
    assert torch.equal(out.sequences, want)
    assert out.stats.drafted_tokens > 0 and out.stats.acceptance_rate == 1.0


# -- settings from the generation config ---------------------------------------------------------------------
def test_defaults_come_from_the_generation_config_and_arguments_override_them():
    target = pin_costs(tiny_random("llama", seed=3)[0])
    ids = torch.tensor([[5, 6, 7, 8, 5, 6]])
    decoder = SpecDecoder(target, "prompt_lookup", num_tokens=3, schedule="fixed")  # no timing in the decisions
    greedy = decoder.generate(ids, max_new_tokens=12).sequences
    target.generation_config.update(do_sample=True, temperature=1.5, max_new_tokens=12)
    def seeded(**kw):
        return decoder.generate(ids, generator=torch.Generator().manual_seed(3), **kw).sequences
    sampled = seeded()
    assert sampled.shape == greedy.shape and not torch.equal(sampled, greedy)  # samples, 12 new tokens
    # top_k=50: generate()'s default, which a config's None leaves in place
    assert torch.equal(sampled, seeded(do_sample=True, temperature=1.5, top_k=50, max_new_tokens=12))
    assert torch.equal(seeded(do_sample=False), greedy)
    target.generation_config.update(do_sample=False, max_new_tokens=None)
    assert decoder.generate(ids).sequences.shape[1] == ids.shape[1] + 20  # generate()'s default max_length


@pytest.mark.parametrize("settings,name", [
    ({"num_beams": 2}, "num_beams"),
    ({"token_healing": True}, "token_healing"), ({"guidance_scale": 1.5}, "guidance_scale"),
    ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
    ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha"),
])
def test_what_cannot_be_reproduced_is_refused_by_name_before_any_forward(settings, name):
    target = tiny_random("llama", seed=3)[0]
    recorder = ForwardRecorder(target)
    try:
        with pytest.raises(ValueError, match=name):
            SpecDecoder(target, "prompt_lookup").generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, **settings)
    finally:
        recorder.remove()
    assert recorder.calls == []


# -- benchmarks take the settings -------------------------------------------------------------------------
def test_a_benchmark_applies_the_settings_to_every_method_and_reports_them(tmp_path):
    from specdec.bench.report import load_run
    from specdec.bench.summary import summaries
    from test_bench import TWO_METHODS, run, tiny_config

    settings = {"max_new_tokens": 10, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2}
    config = tiny_config(tmp_path, methods=TWO_METHODS + [{"name": "hf_pl3", "generator": "hf_prompt_lookup",
                                                            "options": {"num_tokens": 3}}], generation=settings)
    out = run(config, tmp_path / "out")
    meta, rows = load_run(out.out_dir)
    assert all(s.exact_match == 1.0 for s in summaries(meta, rows) if s.exact_match is not None)
    report = (out.out_dir / "report.md").read_text()
    assert "`repetition_penalty=1.3`, `no_repeat_ngram_size=2`" in report and "Logits processors" in report
    ours = [r for r in rows if r["method"] == "pl3"]
    assert ours and all(r["stats"]["processor_seconds"] > 0 for r in ours)


def test_a_minimum_length_already_reached_is_left_out():
    """``min_new_tokens=0`` (as the bench spells the neutral setting) makes ``generate()`` build a
    MinLengthLogitsProcessor that never changes a score: the call leaves it out, and its output is
    generate()'s; a minimum still ahead is kept and honoured."""
    from specdec.processors import inert

    assert inert(lp.MinLengthLogitsProcessor(5, [7]), 5) and not inert(lp.MinLengthLogitsProcessor(6, [7]), 5)
    assert inert(lp.MinNewTokensLengthLogitsProcessor(5, 0, [7]), 5)
    assert not inert(lp.MinNewTokensLengthLogitsProcessor(5, 1, [7]), 5)
    assert not BlockProcessors([lp.MinLengthLogitsProcessor(3, [7])], torch.zeros(1, 4, dtype=torch.long))
    target, tokenizer = tiny_random("llama")
    ids = tokenizer("the cat sat on the mat", return_tensors="pt").input_ids
    eos = tokenizer.eos_token_id
    for minimum in (0, 12):
        settings = {"max_new_tokens": 16, "do_sample": False, "min_new_tokens": minimum, "eos_token_id": eos}
        want = target.generate(ids, pad_token_id=tokenizer.pad_token_id, **settings)
        got = SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer).generate(ids, **settings).sequences
        assert torch.equal(got, want), minimum
