"""Cross-tokenizer drafting (``cross_tokenizer``): exact greedy output, lossless sampling, alignment.

Toy pairs use two byte-level BPE tokenizers from ``byte_tokenizer`` with different merges, so
the same text splits differently: whitespace runs, multi-byte characters (2-, 3- and 4-byte)
split differently or merged into one token, and merges that straddle the other tokenizer's
token boundaries.

Random tiny models spell random bytes, so they say little about alignment. The alignment tests
use *text oracles* instead: a forward hook makes a tiny model behave like a perfect language model
of one script (it reads the bytes its tokens spell so far and puts all its mass on the first
token of the canonical encoding of the rest, or on EOS once off-script or done). With a target
oracle and a draft oracle of the same script, every drafted text is right, so acceptance
measures only the alignment: dropped or shifted characters, a stale draft cache or a wrong
re-tokenization all show up as rejections.
"""

from __future__ import annotations

import copy

import pytest
import torch

from candidate_generators.cross_tokenizer import CrossTokenizerGenerator
from specdec.alignment import DRAFT_WINDOW, complete_text_after, continuation_ids, decode, encode, freeze_split
from specdec import SpecDecoder
from specdec.models import byte_tokenizer, tiny_random
from specdec.sampling import SamplingParams

from helpers import ForwardRecorder, chi_square_pooled, left_pad, perturbed_copy, weights_checksum

# same number of merges: both tokenizers then put <eos>/<pad> at the same ids (a perturbed copy of
# the target keeps the target's generation config and serves as a draft in the sampling test)
TARGET_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "Ġ"), ("Ã", "©"), ("l", "l"), ("e", "ll"),
                 ("H", "ell"), ("Hell", "o"), ("æ", "Ĺ"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("ð", "Ł")]
DRAFT_MERGES = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("Ġ", "Ċ"), ("Ċ", "ĉ"), ("H", "e"), ("l", "l"),
                ("ll", "o"), ("Ĺ", "¥"), ("æ", "Ĺ¥"), ("w", "o"), ("r", "l"), ("ĺ", "Ģ"), ("Ł", "ĺĢ")]
SCRIPT = ("Hello the  world, \n\tthe café 日本語 😀 then   Hello théâtre\n\n"
          "the wor ld of Hellos: 😀😀 日本 the end")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on the shared 2-core machine two spinning threads made tiny models
    ~25x slower (measured), and the real pair no faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizers():
    return byte_tokenizer(TARGET_MERGES), byte_tokenizer(DRAFT_MERGES)


# -- text oracles -----------------------------------------------------------------------------
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE tokens are spelt in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


BYTE_CHARS = _byte_chars()
CHAR_BYTES = {c: b for b, c in BYTE_CHARS.items()}


class TextOracle:
    """Forward hook: ``model`` becomes a perfect greedy model of ``script`` in ``tokenizer``'s tokens.

    One script per batch row; it remembers each row's tokens by position (the cache's content)."""

    def __init__(self, model, tokenizer, scripts: list[str]):
        self.tokenizer, self.scripts = tokenizer, [s.encode() for s in scripts]
        self.eos, self.pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        special = set(tokenizer.all_special_ids)
        self.pieces = {i: (b"" if i in special else bytes(CHAR_BYTES[c] for c in t))
                       for i, t in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))}
        self.rows: dict[int, dict[int, int]] = {}
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def next_token(self, b: int, history: bytes) -> int:
        script = self.scripts[b]
        if not script.startswith(history) or len(history) == len(script):
            return self.eos
        rest = "".join(BYTE_CHARS[x] for x in script[len(history):])
        return self.tokenizer.backend_tokenizer.model.tokenize(rest)[0].id

    def _hook(self, module, args, kwargs, output):
        ids, positions = kwargs["input_ids"], kwargs["position_ids"]
        logits = output.logits  # [B, keep, V]
        keep = logits.shape[1]
        forced = torch.full_like(logits, -30.0)
        for b in range(ids.shape[0]):
            row = self.rows.setdefault(b, {})
            for token, pos in zip(ids[b].tolist(), positions[b].tolist()):
                if token != self.pad:  # padding (left of a short row, or filler) says nothing
                    row[pos] = token
            for j, pos in enumerate(positions[b, ids.shape[1] - keep:].tolist()):
                history = b"".join(self.pieces.get(row.get(i, self.pad), b"") for i in range(pos + 1))
                forced[b, j, self.next_token(b, history)] = 30.0
        output.logits = forced
        return output

    def select_rows(self, keep: torch.Tensor) -> None:
        self.scripts = [self.scripts[i] for i in keep.tolist()]
        self.rows = {new: self.rows.get(old, {}) for new, old in enumerate(keep.tolist())}

    def remove(self):
        self.handle.remove()


def oracle_pair(tokenizers, scripts: list[str]):
    target_tok, draft_tok = tokenizers
    target, _ = tiny_random("llama", seed=3, tokenizer=target_tok)
    draft, _ = tiny_random("qwen2", seed=4, tokenizer=draft_tok)
    return target, draft, TextOracle(target, target_tok, scripts), TextOracle(draft, draft_tok, scripts)


# -- pure functions: each boundary case ---------------------------------------------------------
def test_the_toy_tokenizers_split_the_script_differently(tokenizers):
    target_tok, draft_tok = tokenizers
    t_ids, d_ids = encode(target_tok, SCRIPT), encode(draft_tok, SCRIPT)
    assert decode(target_tok, t_ids) == SCRIPT == decode(draft_tok, d_ids)
    assert t_ids != d_ids and len(target_tok) == len(draft_tok)
    t_pieces, d_pieces = target_tok.convert_ids_to_tokens(t_ids), draft_tok.convert_ids_to_tokens(d_ids)
    assert "Hello" in t_pieces and "He" in d_pieces and "llo" in d_pieces  # a merge straddles the draft's split
    assert "æĹ" in t_pieces and "¥" in t_pieces  # target: 日 ends inside a token
    assert "æĹ¥" in d_pieces  # draft: 日 is one token
    assert "ĠĠ" in t_pieces and "ĠĊ" in d_pieces  # whitespace runs split differently


def test_unfinished_characters_wait(tokenizers):
    target_tok, _ = tokenizers
    ids = encode(target_tok, "the 日本")  # ... 'æĹ' '¥' 'æ' 'ľ' '¬'
    assert target_tok.convert_ids_to_tokens(ids)[-5:] == ["æĹ", "¥", "æ", "ľ", "¬"]
    for cut, expected in ((len(ids), "the 日本"), (len(ids) - 1, "the 日"), (len(ids) - 2, "the 日"),
                          (len(ids) - 3, "the 日"), (len(ids) - 4, "the "), (len(ids) - 5, "the ")):
        text, n = complete_text_after(target_tok, ids[:cut], 0)
        assert text == expected and decode(target_tok, ids[:n]) == expected, cut
    # with decode context in front, only the new characters come back
    text, n = complete_text_after(target_tok, ids[:-1], 2)
    assert text == decode(target_tok, ids[:-3])[len(decode(target_tok, ids[:2])):] and n == len(ids) - 3 - 2


def test_continuation_completes_a_pending_character(tokenizers):
    target_tok, _ = tokenizers
    committed = encode(target_tok, "the 日")[:-1]  # ends with 'æĹ': the first two bytes of 日
    pending = committed[-1:]
    ids = continuation_ids(target_tok, pending, "", "日本 the")
    assert ids is not None and decode(target_tok, committed + ids) == "the 日本 the"
    assert continuation_ids(target_tok, pending, "", "本") is None  # text that does not complete it


def test_continuation_after_a_merge_that_straddles_the_boundary(tokenizers):
    target_tok, _ = tokenizers
    committed = encode(target_tok, "the Hell")  # the target would have merged 'Hell' + 'o'
    anchor = committed[-2:]
    anchor_text = decode(target_tok, anchor)
    assert continuation_ids(target_tok, anchor, anchor_text, "o world") is None  # re-tokenized: 'Hello'
    ids = continuation_ids(target_tok, [], "", "o world")  # a shorter anchor: the text alone
    assert decode(target_tok, committed + ids) == "the Hello world"
    # whitespace: the anchor's trailing space joins the draft's leading one
    committed = encode(target_tok, "a ")
    assert continuation_ids(target_tok, committed, "a ", " b") is None
    assert decode(target_tok, committed + continuation_ids(target_tok, [], "", " b")) == "a  b"


def test_freeze_split_never_changes_the_tokens(tokenizers):
    _, draft_tok = tokenizers
    enc = draft_tok(SCRIPT, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    splits = 0
    for keep in range(1, len(ids) - 1):
        tokens, chars = freeze_split(draft_tok, SCRIPT, ids, offsets, keep, tries=1)
        if tokens:
            splits += 1
            assert encode(draft_tok, SCRIPT[:chars]) + encode(draft_tok, SCRIPT[chars:]) == ids
            assert tokens == len(ids) - keep
    assert splits > len(ids) // 2  # most token boundaries are usable
    # a split inside a character is refused: '日' is 'æĹ¥' in the draft but 2 tokens in a byte tokenizer
    bytes_only = byte_tokenizer()
    enc = bytes_only("日", add_special_tokens=False, return_offsets_mapping=True)
    assert freeze_split(bytes_only, "日", enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]], 1) == (0, 0)


# -- alignment, end to end, with text oracles --------------------------------------------------
def record_sessions(decoder, prepare=lambda gen: None) -> list:
    """The per-call sessions the decoder's generator makes (``prepare`` runs on each, before setup)."""
    sessions, make = [], decoder.candidate_generator.session

    def session():
        sessions.append(make())
        prepare(sessions[-1])
        return sessions[-1]

    decoder.candidate_generator.session = session
    return sessions


@pytest.mark.parametrize("num_tokens,schedule", [(3, "fixed"), (6, "fixed"), (4, "adaptive")])
def test_perfect_drafts_are_accepted_across_every_boundary(tokenizers, num_tokens, schedule):
    target_tok, draft_tok = tokenizers
    target, draft, t_oracle, d_oracle = oracle_pair(tokenizers, [SCRIPT])
    prompt = target_tok("Hello the", return_tensors="pt").input_ids
    steps = len(encode(target_tok, SCRIPT)) - prompt.shape[1] + 1
    reference = target.generate(prompt, max_new_tokens=steps + 5, do_sample=False)
    assert target_tok.decode(reference[0], skip_special_tokens=True) == SCRIPT  # the oracle works

    decoder = SpecDecoder(target, draft, tokenizer=target_tok, draft_tokenizer=draft_tok,
                          num_tokens=num_tokens, schedule=schedule)
    assert isinstance(decoder.candidate_generator, CrossTokenizerGenerator)
    recorder = ForwardRecorder(draft)
    sessions = record_sessions(decoder)
    out = decoder.generate(prompt, max_new_tokens=steps + 5)
    recorder.remove()
    assert torch.equal(out.sequences, reference)

    gen = sessions[-1]
    # the draft's sequence spells the committed text (its last synced state)
    assert decode(draft_tok, gen.draft_sequence(0)) == SCRIPT
    # every drafted text was right, so only a token cut at a draft's end may be rejected
    assert out.stats.acceptance_rate > 0.75, (out.stats.acceptance_rate, out.stats.generator)
    assert out.stats.mean_accepted_length > 2.0
    assert out.stats.generator["unaligned"] == 0
    # the draft keeps its cache: after the prefill no forward re-encodes the text
    fed = [c["tokens"] for c in recorder.calls]
    draft_prompt = len(encode(draft_tok, "Hello the"))
    assert fed[0] == draft_prompt
    assert max(fed[1:]) <= DRAFT_WINDOW + 2 * num_tokens
    final = len(gen.draft_sequence(0))
    assert sum(fed) <= final + len(fed)  # each draft token fed about once, plus one draft per forward at most
    t_oracle.remove()
    d_oracle.remove()


def test_batched_rows_with_oracles_each_match_their_own_generate(tokenizers):
    target_tok, draft_tok = tokenizers
    scripts = [SCRIPT, "日本語 the  Hello 😀 world " * 2, "  the\n\tcafé, théâtre Hello the world"]
    prompts = [s[: n] for s, n in zip(scripts, (9, 2, 5))]
    target, draft, t_oracle, d_oracle = oracle_pair(tokenizers, scripts)
    rows = [target_tok(p, return_tensors="pt").input_ids[0] for p in prompts]
    ids, mask = left_pad(rows, target_tok.pad_token_id)
    new = 30
    decoder = SpecDecoder(target, draft, tokenizer=target_tok, draft_tokenizer=draft_tok, num_tokens=4,
                         schedule="fixed")  # oracles as large as the target: auto would not draft
    alive = list(range(len(rows)))

    def follow_rows(gen):
        own_select = gen.select_rows

        def select_rows(keep):  # finished rows leave: the oracles' per-row memories follow
            own_select(keep)
            alive[:] = [alive[i] for i in keep.tolist()]
            for oracle in (t_oracle, d_oracle):
                oracle.select_rows(keep)

        gen.select_rows = select_rows

    sessions = record_sessions(decoder, follow_rows)
    out = decoder.generate(ids, mask, max_new_tokens=new)
    gen = sessions[-1]
    assert out.stats.acceptance_rate > 0.6, out.stats.acceptance_rate
    texts = []
    for b, row in enumerate(rows):
        t_oracle.scripts, t_oracle.rows = [scripts[b].encode()], {}
        ref = target.generate(row[None], max_new_tokens=new, do_sample=False)[0, row.numel():]
        got = out.sequences[b, ids.shape[1]:]
        assert torch.equal(got[: ref.numel()], ref), b
        assert bool((got[ref.numel():] == target_tok.pad_token_id).all())
        texts.append(target_tok.decode(torch.cat([row, ref]), skip_special_tokens=True))
    assert alive  # the rows that finished last: their draft sequences spell their committed text
    for i, b in enumerate(alive):
        assert decode(draft_tok, gen.draft_sequence(i)) == texts[b]
    t_oracle.remove()
    d_oracle.remove()


# -- greedy equivalence on random tiny pairs ----------------------------------------------------
@pytest.mark.parametrize("target_arch,draft_arch", [("llama", "qwen2"), ("gemma3_text", "llama"), ("gpt2", "mistral")])
def test_greedy_matches_target_generate(tokenizers, target_arch, draft_arch):
    target_tok, draft_tok = tokenizers
    target, _ = tiny_random(target_arch, seed=5, tokenizer=target_tok)
    draft, _ = tiny_random(draft_arch, seed=6, tokenizer=draft_tok)
    decoder = SpecDecoder(target, draft, tokenizer=target_tok, draft_tokenizer=draft_tok, num_tokens=3)
    for text in ("Hello the world", " 日本語  é\n\t", "😀"):
        prompt = target_tok(text, return_tensors="pt").input_ids
        ref = target.generate(prompt, max_new_tokens=32, do_sample=False)
        assert torch.equal(decoder.generate(prompt, max_new_tokens=32).sequences, ref), text


def test_greedy_with_a_correlated_draft_and_left_padded_batch(tokenizers):
    """A perturbed copy of the target (the byte ids mean the same in both tokenizers) drafts well
    enough that blocks are accepted; rows of different lengths each equal their own generate."""
    target_tok, draft_tok = tokenizers
    target, _ = tiny_random("llama", seed=7, tokenizer=target_tok)
    draft = perturbed_copy(target, 0.1, seed=8)
    texts = ["the", "Hello the world, the end of the", " é", "日本語 😀 the"]
    rows = [target_tok(t, return_tensors="pt").input_ids[0] for t in texts]
    ids, mask = left_pad(rows, target_tok.pad_token_id)
    # a tiny draft costs as much as the tiny target: the cost-aware default rightly declines to
    # draft, so a fixed K makes this test exercise drafting
    out = SpecDecoder(target, draft, tokenizer=target_tok, draft_tokenizer=draft_tok,
                      num_tokens=4, schedule="fixed").generate(ids, mask, max_new_tokens=40)
    for b, row in enumerate(rows):
        ref = target.generate(row[None], max_new_tokens=40, do_sample=False)[0, row.numel():]
        got = out.sequences[b, ids.shape[1]:]
        assert torch.equal(got[: ref.numel()], ref), b
        assert bool((got[ref.numel():] == target_tok.pad_token_id).all())
    assert out.stats.accepted_tokens > 0


def test_a_low_precision_draft_is_exact_and_leaves_the_draft_alone(tokenizers):
    """``weights="w8a8"``: a compiled int8 copy of the draft drafts; the draft itself is only read."""
    target_tok, draft_tok = tokenizers
    target, _ = tiny_random("llama", seed=7, tokenizer=target_tok)
    draft = perturbed_copy(target, 0.05, seed=8)  # the byte ids mean the same in both tokenizers
    before = _fingerprint(draft)
    decoder = SpecDecoder(target, draft, tokenizer=target_tok, draft_tokenizer=draft_tok, weights="w8a8",
                          compile_draft={"backend": "aot_eager"}, num_tokens=4, schedule="fixed", min_confidence=0.0)
    accepted = 0
    for text in ("the theme of the", "Hello the world"):
        prompt = target_tok(text, return_tensors="pt").input_ids
        out = decoder.generate(prompt, max_new_tokens=30)
        assert torch.equal(out.sequences, target.generate(prompt, max_new_tokens=30, do_sample=False)), text
        accepted += out.stats.accepted_tokens
    assert accepted > 0
    assert _fingerprint(draft) == before


# -- sampling is lossless ------------------------------------------------------------------------
N_SAMPLES = 20_000
ALPHA = 1e-3


def whole_characters_only(model, tokenizer, sharpen: float = 2.0):
    """Forward hook: ``model`` never emits a token that is not whole UTF-8 characters (or EOS),
    and its logits are scaled by ``sharpen``.

    Random byte-level models otherwise spell invalid UTF-8, which no text-level method can draft,
    and spread their mass so thinly that hardly any draft is accepted."""
    special = set(tokenizer.all_special_ids)
    bias = torch.full((model.get_output_embeddings().weight.shape[0],), -50.0)
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in special:
            continue
        try:
            bytes(CHAR_BYTES[c] for c in piece).decode("utf-8")
            bias[i] = 0.0
        except UnicodeDecodeError:
            pass
    bias[tokenizer.eos_token_id] = 0.0

    def hook(module, args, kwargs, output):
        output.logits = output.logits * sharpen + bias
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("temperature,top_k,top_p,min_confidence", [(1.0, None, None, 0.0), (0.8, 12, 0.95, 0.2)])
def test_sampling_matches_the_target_distribution(tokenizers, temperature, top_k, top_p, min_confidence):
    """The joint law of the first two generated tokens, from 20,000 rows in one ``generate`` call.

    Three tokens are generated with three drafts per step, so the first two positions see every
    path: draft accepted then accepted or rejected, rejected and resampled, bonus tokens. Exact
    law: p(a) p(b | a) from the target's own (warped) distributions, one forward per first token.

    Threshold: chi-square p >= ALPHA = 1e-3, cells with expected count < 5 pooled (the usual
    validity condition of the approximation). Under a lossless sampler the p-value is uniform, so
    a fixed seed fails with probability 1e-3. The check's power is shown on the same counts:
    against the law at a 10% different temperature (a far smaller bias than a wrong acceptance
    rule, e.g. accepting the drafts outright, makes) it gives p < 1e-6.
    """
    target_tok, draft_tok = tokenizers
    target, _ = tiny_random("llama", seed=9, tokenizer=target_tok)
    draft = perturbed_copy(target, 0.2, seed=10)  # byte ids mean the same in both: a draft that often agrees
    hooks = [whole_characters_only(target, target_tok), whole_characters_only(draft, draft_tok)]
    prompt = target_tok("a", return_tensors="pt").input_ids  # the same byte id in both vocabularies
    eos, pad = target_tok.eos_token_id, target_tok.pad_token_id
    decoder = SpecDecoder(target, draft, tokenizer=target_tok, draft_tokenizer=draft_tok, num_tokens=3, schedule="fixed",
                          min_confidence=min_confidence)
    out = decoder.generate(prompt.expand(N_SAMPLES, -1), max_new_tokens=3, do_sample=True, temperature=temperature,
                           top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(11))
    stats = out.stats
    assert stats.drafted_tokens > N_SAMPLES and 0.05 < stats.acceptance_rate < 0.95, stats
    assert len(stats.accepted_at_position) >= 2 and stats.accepted_at_position[1] > 200, stats
    new = out.sequences[:, prompt.shape[1]: prompt.shape[1] + 2]  # [N, 2]

    vocab = target.get_output_embeddings().weight.shape[0]

    def law(t: float) -> torch.Tensor:  # [V, V + 1]: column V = "stopped after an EOS"
        params = SamplingParams(True, t, top_k, top_p)
        with torch.no_grad():
            first = params.probs(target(prompt).logits[0, -1])  # [V]
            seqs = torch.cat([prompt.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
            second = params.probs(target(seqs).logits[:, -1])  # [V, V]
        joint = torch.cat([first[:, None] * second, torch.zeros(vocab, 1)], dim=1)
        joint[eos] = 0
        joint[eos, vocab] = first[eos]
        return joint

    seconds = torch.where(new[:, 0] == eos, torch.full_like(new[:, 1], vocab), new[:, 1])
    assert bool((new[new[:, 0] == eos, 1] == pad).all())
    counts = torch.zeros(vocab, vocab + 1)
    counts.index_put_((new[:, 0], seconds), torch.ones(N_SAMPLES), accumulate=True)
    assert chi_square_pooled(counts, law(temperature))[0] >= ALPHA
    assert chi_square_pooled(counts, law(temperature * 1.1))[0] < 1e-6
    for hook in hooks:
        hook.remove()


# -- the user's objects, errors -------------------------------------------------------------------
def test_user_models_tokenizers_and_configs_are_unchanged(tokenizers):
    target_tok, draft_tok = tokenizers
    target, _ = tiny_random("llama", seed=12, tokenizer=target_tok)
    draft = perturbed_copy(target, 0.2, seed=13)
    snapshot = lambda m: ({k: v.clone() for k, v in m.state_dict().items()}, m.config.to_dict(),  # noqa: E731
                          m.generation_config.to_dict(), m.get_output_embeddings(), m.training)
    before = [snapshot(m) for m in (target, draft)]
    vocabs = [(t.get_vocab(), len(t), t.eos_token_id, t.pad_token_id, t.padding_side) for t in tokenizers]
    decoder = SpecDecoder(target, draft, tokenizer=target_tok, draft_tokenizer=draft_tok)
    prompt = target_tok("Hello the world", return_tensors="pt").input_ids
    decoder.generate(prompt, max_new_tokens=20)
    decoder.generate(prompt.expand(3, -1), max_new_tokens=20, do_sample=True, top_p=0.9,
                     generator=torch.Generator().manual_seed(0))
    for model, (state, config, gen_config, head, training) in zip((target, draft), before):
        now = model.state_dict()
        assert state.keys() == now.keys() and all(torch.equal(state[k], now[k]) for k in state)
        assert model.config.to_dict() == config and model.generation_config.to_dict() == gen_config
        assert model.get_output_embeddings() is head and model.training == training
    assert vocabs == [(t.get_vocab(), len(t), t.eos_token_id, t.pad_token_id, t.padding_side) for t in tokenizers]


def test_selection_and_errors(tokenizers):
    target_tok, draft_tok = tokenizers
    target, _ = tiny_random("llama", seed=14, tokenizer=target_tok)
    draft = perturbed_copy(target, 0.2, seed=15)
    prompt = target_tok("the", return_tensors="pt").input_ids
    same = SpecDecoder(target, draft, tokenizer=target_tok, draft_tokenizer=copy.deepcopy(target_tok))
    assert not isinstance(same.candidate_generator, CrossTokenizerGenerator)  # same vocabulary: draft_model
    by_name = SpecDecoder(target, "cross_tokenizer", tokenizer=target_tok, draft_tokenizer=draft_tok, draft_model=draft)
    assert isinstance(by_name.candidate_generator, CrossTokenizerGenerator)
    assert torch.equal(by_name.generate(prompt, max_new_tokens=8).sequences,
                       target.generate(prompt, max_new_tokens=8, do_sample=False))
    with pytest.raises(ValueError, match="needs both tokenizers"):
        SpecDecoder(target, CrossTokenizerGenerator(draft), tokenizer=target_tok).generate(prompt, max_new_tokens=4)
    with pytest.raises(TypeError, match="needs a draft model"):
        CrossTokenizerGenerator("not a model")


# -- the real pair: Gemma-3-270M target, SmolLM2-135M draft ---------------------------------------
REAL_PROMPTS = ["The capital of France is", "Question: Why is the sky blue?\nAnswer:",
                "Le café de la gare, à côté du théâtre, est"]  # plain text: Gemma-3-270M is a base model
REAL_NEW_TOKENS = 16


def _fingerprint(model) -> tuple:
    """Cheap exact fingerprint of a model's weights, configs and head (no 1 GB copy)."""
    head = model.get_output_embeddings()
    return (weights_checksum(model), model.config.to_dict(), model.generation_config.to_dict(), id(head), head.weight.shape)


@pytest.mark.real_model
def test_gemma3_target_with_smollm2_draft_is_exact(gemma3, smollm2):
    """Greedy output identical to Gemma's own ``generate`` on three plain-text prompts (one with
    accents, which the two tokenizers split differently), with drafts actually accepted, and
    both models, tokenizers and configs unchanged afterwards."""
    target, target_tok = gemma3
    draft, draft_tok = smollm2
    assert target_tok.get_vocab() != draft_tok.get_vocab()
    before = (_fingerprint(target), _fingerprint(draft), len(target_tok), len(draft_tok))
    # on this CPU a SmolLM2 draft token costs about half a Gemma step, so the cost-aware default
    # rightly drafts almost nothing; the adaptive schedule makes the alignment do real work. The
    # eager engine: choosing a faster one times Gemma's 262k-row output layer for seconds, and the
    # engines are tested on their own (test_engines.py, test_real_smollm2.py)
    decoder = SpecDecoder(target, draft, tokenizer=target_tok, draft_tokenizer=draft_tok, schedule="adaptive",
                          engine="eager")
    assert isinstance(decoder.candidate_generator, CrossTokenizerGenerator)
    sessions = record_sessions(decoder)
    accepted = drafted = 0
    for text in REAL_PROMPTS:
        prompt = target_tok(text, return_tensors="pt").input_ids
        ref = target.generate(prompt, max_new_tokens=REAL_NEW_TOKENS, do_sample=False)
        out = decoder.generate(prompt, max_new_tokens=REAL_NEW_TOKENS)
        assert torch.equal(out.sequences, ref), (text, target_tok.decode(ref[0]), target_tok.decode(out.sequences[0]))
        gen = sessions[-1]
        assert out.stats.generator["unaligned"] == 0
        assert decode(draft_tok, gen.draft_sequence(0)) == target_tok.decode(ref[0], skip_special_tokens=True)
        accepted, drafted = accepted + out.stats.accepted_tokens, drafted + out.stats.drafted_tokens
    assert accepted > 0.2 * drafted, (accepted, drafted)  # the text alignment works on real tokenizers
    assert (_fingerprint(target), _fingerprint(draft), len(target_tok), len(draft_tok)) == before
