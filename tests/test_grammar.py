"""Grammar-constrained decoding (specdec/grammar.py, docs/structured.md).

* **Greedy matrix.** A nested JSON schema (enums, arrays, a nested object), a regular expression
  and a small EBNF grammar x every built-in generator, one prompt and a left-padded batch: the
  output equals ``model.generate()`` with xgrammar's own ``transformers`` logits processor on the
  same compiled grammar, and every finished output is valid (JSON that validates against its
  schema; the grammar's matcher accepts the whole output).
* **Forced tokens.** The grammar's forced tokens are drafted (and accepted) with every generator,
  and alone they cut the target's forwards; a forced token that differs from a lookup's draft
  replaces it.
* **Rollback.** After a block of drafts the grammar's state, brought back to the committed
  tokens, is the state of never having drafted.
* **Sampling.** On a tiny 8-token Llama whose tokens are letters, a regular expression with a
  forced token: the joint distribution of three sampled tokens passes the chi-square test against
  the exact masked distribution (prompt lookup, a draft model, prompt lookup's trees).
* **Trees.** A tree with a wrong sibling under each grammar, greedy: ``generate()``'s output.
* **Doors and errors.** ``model.generate(custom_generate=...)`` with ``grammar=`` or with
  xgrammar's processor in ``logits_processor=``; the compiled grammar is cached per tokenizer and
  grammar; a missing tokenizer, an ambiguous string and a grammar that does not compile are
  refused with messages that say what to do.
"""

from __future__ import annotations

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar", reason='grammar tests need xgrammar: pip install "specdec[grammar]"')
jsonschema = pytest.importorskip("jsonschema")

import specdec  # noqa: E402
from specdec import SpecDecoder  # noqa: E402
from specdec.bench.grammar_check import check_output  # noqa: E402
from specdec.generators import CandidateGenerator, DraftingInfo, Proposal  # noqa: E402
from specdec.grammar import Grammar, GrammarConstraint, compile_grammar, only_token  # noqa: E402
from specdec.models import byte_tokenizer  # noqa: E402

from helpers import BlindAssistant, merged_tokenizer_world, perturbed_copy  # noqa: E402
from test_processors import DRAFT_MERGES, TARGET_MERGES, TEXTS  # noqa: E402
from test_sampling_lossless import PROMPT, TINY_VOCAB, assert_same_distribution, joint_counts, tiny_vocab_llama  # noqa: E402

NEW = 96
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "city": {"enum": ["Oslo", "Lima"]}},
                  "required": ["id", "city"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}
GRAMMARS = {
    "json_schema": Grammar.json_schema(SCHEMA),
    "regex": Grammar.regex(r"(the|a) (world|word)s? of [0-9]{1,3}( and [0-9]{1,3}){0,2}\."),
    "ebnf": Grammar.ebnf('root ::= "(" item (" " item){0,3} ")"\nitem ::= [a-z]{1,4} | "<" [0-9]{1,2} ">"'),
}
GENERATORS = ["none", "prompt_lookup", "draft_model", "self_draft", "self_draft_lookup", "cross_tokenizer"]


@pytest.fixture(scope="module")
def world():
    target, target_tok, _, decoders, prompts = merged_tokenizer_world(TARGET_MERGES, DRAFT_MERGES, TEXTS)
    eos = [target_tok.eos_token_id]
    compiled = {name: compile_grammar(g, target_tok, target.config.vocab_size, eos) for name, g in GRAMMARS.items()}
    references = {}

    def reference(grammar: str, shape: str) -> torch.Tensor:
        if (grammar, shape) not in references:
            ids, mask = prompts[shape]
            processor = xgr.contrib.hf.LogitsProcessor(compiled[grammar])
            references[grammar, shape] = target.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                                         do_sample=False, logits_processor=[processor])
        return references[grammar, shape]

    return target, target_tok, decoders, prompts, compiled, reference


def new_rows(sequences: torch.Tensor, width: int, tokenizer) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS (all of them when it has none)."""
    rows = []
    for row in sequences[:, width:].tolist():
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        rows.append(row[:end])
    return rows


def assert_valid(grammar: str, compiled, rows: list[list[int]], tokenizer) -> None:
    """Every row that ended is in the grammar (its matcher accepts it, EOS included); JSON rows
    parse and validate against the schema."""
    ended = [row for row in rows if row and row[-1] == tokenizer.eos_token_id]
    assert ended, "no row finished within the budget: the test checks nothing"
    for row in ended:
        matcher = xgr.GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in row) and matcher.is_terminated(), tokenizer.decode(row)
        if grammar == "json_schema":
            jsonschema.validate(json.loads(tokenizer.decode(row[:-1])), SCHEMA)


@pytest.mark.parametrize("shape", ["single", "batch"])
@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
def test_greedy_with_a_grammar_equals_generate_with_xgrammars_processor(world, grammar, generator, shape):
    target, tok, decoders, prompts, compiled, reference = world
    want = reference(grammar, shape)
    ids, mask = prompts[shape]
    out = decoders[generator].generate(ids, mask, max_new_tokens=NEW, grammar=GRAMMARS[grammar])
    assert torch.equal(out.sequences, want), (tok.batch_decode(out.sequences), tok.batch_decode(want))
    assert_valid(grammar, compiled[grammar], new_rows(out.sequences, ids.shape[1], tok), tok)
    if generator in ("none", "prompt_lookup"):  # drafters that do not see the grammar: it adds what it forces
        assert out.stats.grammar_drafts > 0 and out.stats.grammar_accepted > 0


class TreeOracle(CandidateGenerator):
    """From the known output ``ref`` (rows left-padded by ``pads``): the right token, under it a wrong
    sibling before the right second token, and the third under that: a tree in every step."""

    name = "grammar_tree_oracle"

    def __init__(self, ref: torch.Tensor, pads: list[int], vocab: int):
        self.ref, self.pads, self.vocab = ref, pads, vocab

    def drafting(self):
        return DraftingInfo(max_drafts=None)

    def propose(self, ctx, max_drafts):
        rows = []
        for b in range(ctx.batch_size):
            at = self.pads[b] + int(ctx.lengths[b])
            truth = self.ref[b, at: at + 3].tolist()
            if len(truth) < 3 or int(max_drafts[b]) < 4:
                rows.append([])
                continue
            rows.append([(truth[0], -1), ((truth[1] + 1) % self.vocab, 0), (truth[1], 0), (truth[2], 2)])
        return Proposal.from_tree(rows)


def test_token_trees_under_a_grammar_equal_generate_with_xgrammars_processor(world):
    """Trees verified under each grammar: every node masked along its own path (a wrong sibling the
    grammar forbids, or the target does not take), the output ``generate()``'s with xgrammar's
    processor, and the trees verified as trees."""
    target, tok, decoders, prompts, compiled, reference = world
    for grammar in sorted(GRAMMARS):
        for shape in ("single", "batch"):
            ids, mask = prompts[shape]
            want = reference(grammar, shape)
            pads = (mask == 0).sum(1).tolist()
            decoder = SpecDecoder(target, TreeOracle(want, pads, target.config.vocab_size), tokenizer=tok)
            out = decoder.generate(ids, mask, max_new_tokens=NEW, grammar=GRAMMARS[grammar])
            assert torch.equal(out.sequences, want), (grammar, shape)
            assert out.stats.tree_steps > 0 and "trees" not in out.stats.choices, (grammar, shape)
            assert out.stats.tree_depth > out.stats.tree_steps  # past the wrong sibling: deeper than one


def test_forced_tokens_alone_cut_the_targets_forwards(world):
    """No drafter: the JSON schema's forced punctuation and key names are verified in blocks."""
    target, tok, decoders, prompts, compiled, reference = world
    ids, mask = prompts["single"]
    out = decoders["none"].generate(ids, mask, max_new_tokens=NEW, grammar=GRAMMARS["json_schema"])
    new = len(new_rows(out.sequences, ids.shape[1], tok)[0])
    assert out.stats.grammar_accepted == out.stats.grammar_drafts  # a forced token is the only one allowed
    assert out.stats.committed_tokens == new and out.stats.steps < new * 0.7
    assert out.stats.steps + out.stats.grammar_accepted in (new, new + 1)  # + 1: the step that drafted EOS
    assert out.stats.grammar_share == out.stats.grammar_accepted / out.stats.committed_tokens > 0.3


def test_a_lookup_draft_the_grammar_forbids_is_cut_and_a_forced_token_replaces_a_wrong_one(world):
    target, tok, decoders, prompts, compiled, reference = world
    constraint = GrammarConstraint(compiled["json_schema"], prompt_width=0)
    opening = tok('{"name": "', add_special_tokens=False).input_ids
    drafts = torch.tensor([[opening[0], opening[1] + 1, 5, 6], [opening[0], 7, 7, 7], [9, 9, 9, 9]])
    rows, taken = constraint.extend(drafts, torch.tensor([4, 1, 4]), [[], [], []], [0, 1, 2], [40, 40, 2],
                                    [[True] * 4] * 3)
    assert rows[0][:len(opening)] == opening and taken[0] == 1  # the second draft differed from the forced token
    assert rows[1][:len(opening)] == opening and taken[1] == 1  # the forced tokens follow the generator's one
    assert rows[2] == opening[:2] and taken[2] == 0  # replaced at once, within the row's limit of 2
    free = GrammarConstraint(compiled["regex"], prompt_width=0)
    rows, taken = free.extend(torch.tensor([[ord("x"), 0]]), torch.tensor([2]), [[]], [0], [8], [[True, True]])
    assert rows == [[]] and taken == [0]  # "x" cannot start the regex: cut with what follows
    # drawn from a distribution: kept, the last draft, for the verifier to reject (cutting it is biased)
    rows, taken = free.extend(torch.tensor([[ord("x"), 0]]), torch.tensor([2]), [[]], [0], [8], [[False, False]])
    assert rows == [[ord("x")]] and taken == [1]


def test_a_forced_string_the_vocabulary_spells_several_ways_is_suggested(world):
    """After "x" the regex forces " the world." but no single token (" ", " t", " the" are all
    allowed): the walk proposes xgrammar's spelling of it, and the target verifies it."""
    target, tok, decoders, prompts, compiled, reference = world
    grammar = compile_grammar(Grammar.regex(r"x the world\."), tok, target.config.vocab_size, [tok.eos_token_id])
    constraint = GrammarConstraint(grammar, prompt_width=0)
    x = tok("x", add_special_tokens=False).input_ids
    rows, taken = constraint.extend(torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), [x], [0], [40], [[]])
    assert taken == [0] and rows[0][0] == tok.convert_tokens_to_ids("Ġthe")
    assert tok.decode(rows[0][:-1]) == " the world." and rows[0][-1] == tok.eos_token_id  # then EOS, forced


def test_a_rollback_after_a_rejected_block_leaves_the_state_of_never_drafting(world):
    target, tok, decoders, prompts, compiled, reference = world
    ids, _ = prompts["single"]
    text = reference("json_schema", "single")[0, ids.shape[1]:].tolist()
    used, fresh = (GrammarConstraint(compiled["json_schema"], prompt_width=0) for _ in range(2))
    vocab = used.vocab
    for cut in (3, 9, 17):
        committed = text[:cut]
        used.extend(torch.tensor([text[cut: cut + 6]]), torch.tensor([6]), [committed], [0], [40],  # a block drafted
                    [[True] * 6])
        wrong = [t for t in range(vocab) if allows_token(compiled["json_schema"], committed, t)][-1:]
        used.row(0).move(committed + wrong)  # a position after a draft the target rejected
        masks = []
        for constraint in (used, fresh):
            bitmask = xgr.allocate_token_bitmask(1, vocab)
            constraint.row(0).fill(committed, bitmask, 0)
            masks.append(bitmask)
        assert torch.equal(masks[0], masks[1]), cut
        assert used.row(0).matcher.is_completed() == fresh.row(0).matcher.is_completed()
        assert used.row(0).accepted == fresh.row(0).accepted == cut


def allows_token(compiled, prefix: list[int], token: int) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in prefix)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def test_only_token_reads_the_bitmask():
    words = torch.zeros(3, dtype=torch.int32)
    assert only_token(words, 96) is None
    words[2] = -(2 ** 31)  # bit 31 of word 2: token 95
    assert only_token(words, 96) == 95 and only_token(words, 90) is None
    words[0] = 1
    assert only_token(words, 96) is None
    assert only_token(torch.tensor([0, 0b1100], dtype=torch.int32), 64) is None


# -- sampling -------------------------------------------------------------------------------------------
N = 20_000
LETTERS = [chr(ord("a") + i) for i in range(TINY_VOCAB)]  # token i is the letter a + i
SAMPLING_REGEX = r"([abc]|dh|e[fg])+"  # after "d" the grammar forces "h"


def letters_grammar():
    info = xgr.TokenizerInfo(LETTERS, vocab_type=xgr.VocabType.RAW, vocab_size=TINY_VOCAB, stop_token_ids=[])
    return xgr.GrammarCompiler(info).compile_regex(SAMPLING_REGEX)


def exact_masked_joint(model, prompt: torch.Tensor, compiled) -> torch.Tensor:
    """[V, V, V] probability of the first three sampled tokens under the grammar's masks."""
    v = TINY_VOCAB
    joint = torch.zeros(v, v, v)
    with torch.no_grad():
        for tail in [()] + [(a,) for a in range(v)] + [(a, b) for a in range(v) for b in range(v)]:
            matcher = xgr.GrammarMatcher(compiled)
            if not all(matcher.accept_token(t) for t in tail):
                continue
            bitmask = xgr.allocate_token_bitmask(1, v)
            matcher.fill_next_token_bitmask(bitmask)
            logits = model(torch.cat([prompt, torch.tensor([tail], dtype=torch.long)], 1)).logits[:, -1].float()
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            p = torch.softmax(logits[0], -1)
            if len(tail) == 0:
                joint += p[:, None, None]
            elif len(tail) == 1:
                joint[tail[0]] *= p[:, None]
            else:
                joint[tail[0], tail[1]] *= p
    return joint


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model", "prompt_lookup_trees", "blind"])
def test_sampling_with_a_grammar_is_lossless(drafter):
    """``blind``: drafts drawn from a distribution that puts mass on tokens the grammar forbids;
    such a draft was cut, and its position sampled from the target's whole masked distribution
    instead of what the draft's distribution leaves of it (biased)."""
    target = tiny_vocab_llama(0)
    draft = perturbed_copy(target, 0.3, seed=1)
    compiled = letters_grammar()
    chosen = {"draft_model": draft, "prompt_lookup_trees": "prompt_lookup",
              "blind": BlindAssistant(draft)}.get(drafter, drafter)
    options = {"tree": True} if drafter == "prompt_lookup_trees" else {}
    # for trees, "1 2" was followed by 3 and by 6: the lookup proposes both continuations
    prompt = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 6, 4, 5, 1, 2]]) if options else PROMPT
    if drafter != "blind":  # an instance drafts as it was made
        options.update(num_tokens=3, schedule="fixed")
    decoder = SpecDecoder(target, chosen, **options)
    out = decoder.generate(prompt.repeat(N, 1), max_new_tokens=3, generator=torch.Generator().manual_seed(0),
                           do_sample=True, grammar=compiled)
    new = out.sequences[:, prompt.shape[1]:]
    assert new.shape == (N, 3)
    # a draft model drafts the forced tokens itself; a tree step takes no grammar drafts (its nodes are masked)
    assert out.stats.grammar_drafts > 0 or drafter in ("draft_model", "prompt_lookup_trees", "blind")
    assert 0 < out.stats.accepted_tokens < out.stats.drafted_tokens
    assert drafter != "prompt_lookup_trees" or out.stats.tree_steps > 0
    assert_same_distribution(joint_counts(new, TINY_VOCAB), exact_masked_joint(target, prompt, compiled))


# -- doors and errors -----------------------------------------------------------------------------------
def test_custom_generate_takes_a_grammar_or_xgrammars_processor(world):
    target, tok, decoders, prompts, compiled, reference = world
    ids, mask = prompts["batch"]
    want = reference("json_schema", "batch")
    got = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, target_tokenizer=tok,
                          custom_generate=specdec.generate, draft="prompt_lookup", grammar=SCHEMA)
    assert torch.equal(got, want)
    got = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                          custom_generate=specdec.generate, draft="prompt_lookup",
                          logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled["json_schema"])])
    assert torch.equal(got, want)


def test_the_compiled_grammar_is_cached_per_tokenizer_and_grammar(world):
    target, tok, decoders, prompts, compiled, reference = world
    again = compile_grammar(Grammar.json_schema(dict(SCHEMA)), tok, target.config.vocab_size, [tok.eos_token_id])
    assert again is compiled["json_schema"]
    other = byte_tokenizer(TARGET_MERGES)
    assert compile_grammar(SCHEMA, other, target.config.vocab_size, [tok.eos_token_id]) is not again


def test_the_compiled_grammars_kept_are_bounded(world, monkeypatch):
    """A service compiling a schema per request keeps at most MAX_COMPILED per tokenizer, the least
    recently used dropped (a grammar still in use stays)."""
    import specdec.grammar as grammar_module

    target, _, _, _, _, _ = world
    tok = byte_tokenizer()  # its own table entry
    monkeypatch.setattr(grammar_module, "MAX_COMPILED", 3)
    first = compile_grammar(Grammar.regex("a+"), tok, target.config.vocab_size, [tok.eos_token_id])
    for n in range(6):
        compile_grammar(Grammar.regex(f"b{{{n + 1}}}"), tok, target.config.vocab_size, [tok.eos_token_id])
        assert compile_grammar(Grammar.regex("a+"), tok, target.config.vocab_size, [tok.eos_token_id]) is first
    (_, kept), = grammar_module._COMPILED[tok].values()
    assert len(kept) == 3 and Grammar.regex("a+") in kept and Grammar.regex("b1") not in kept
    monkeypatch.setattr(grammar_module, "MAX_COMPILERS", 2)  # one compiler per set of stop ids: bounded too
    for stop in range(4):
        compile_grammar(Grammar.regex("a+"), tok, target.config.vocab_size, [stop])
    assert list(grammar_module._COMPILED[tok]) == [(target.config.vocab_size, (2,)), (target.config.vocab_size, (3,))]


def test_grammar_errors_say_what_to_do(world):
    target, tok, decoders, prompts, compiled, reference = world
    ids, mask = prompts["single"]
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        SpecDecoder(target).generate(ids, max_new_tokens=4, grammar=SCHEMA)
    with pytest.raises(TypeError, match="Grammar.regex"):
        decoders["none"].generate(ids, max_new_tokens=4, grammar="[a-z]+")
    with pytest.raises(ValueError, match="does not compile"):
        decoders["none"].generate(ids, max_new_tokens=4, grammar=Grammar.regex("(unclosed"))
    with pytest.raises(ValueError, match="one of"):
        Grammar.from_config({"regex": "a", "ebnf": "root ::= \"a\""})
    assert Grammar.from_config({"json_schema": SCHEMA}) == Grammar.json_schema(SCHEMA)


# -- the benchmark ----------------------------------------------------------------------------------------
def test_a_bench_run_with_per_question_grammars_and_a_batch(tmp_path):
    """Each question's own grammar (and the config's for the others) in a tiny run: every output
    identical to constrained transformers', valid, and the report's structured-output table."""
    import yaml

    from specdec.bench.config import load_config
    from specdec.bench.report import load_run
    from specdec.bench.runner import run_benchmark

    questions = [
        {"question_id": 501, "category": "rag", "turns": ["Context: Paris is in France. Where is Paris?"],
         "grammar": {"json_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]},
                                                                      "country": {"type": "string",
                                                                                  "pattern": "^[A-Za-z ]{1,8}$"}},
                                     "required": ["city", "country"]}}},
        {"question_id": 502, "category": "rag", "turns": ["Context: the sea is blue. What colour is the sea?"],
         "grammar": {"regex": "(blue|green|red)\\."}},
    ]
    dataset = tmp_path / "questions.jsonl"
    dataset.write_text("".join(json.dumps(q) + "\n" for q in questions))
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump({
        "target": "tiny-random:llama", "dataset": {"path": str(dataset), "subtasks": ["rag"]},
        "generation": {"max_new_tokens": 48}, "threads": 1, "warmup_new_tokens": 2, "batch_sizes": [1, 2],
        "methods": [{"name": "baseline", "generator": "baseline"}, {"name": "forced", "generator": "none"},
                    {"name": "pl", "generator": "prompt_lookup", "options": {"num_tokens": 3}}]}))
    run_benchmark(load_config(config), config_file=config, out_dir=tmp_path / "out", progress=False, log=lambda _: None)
    meta, rows = load_run(tmp_path / "out")
    singles = [r for r in rows if "batch_size" not in r]
    assert len(singles) == 6 and all(r["grammar"]["valid"] for r in singles)
    by = {(r["method"], r["question_id"]): r["output_ids"] for r in singles}
    assert all(by[m, q] == by["baseline", q] for m in ("forced", "pl") for q in (501, 502))
    batches = {r["method"]: r["output_ids"] for r in rows if r.get("batch_size") == 2}
    assert batches["forced"] == batches["pl"] == batches["baseline"]
    assert json.loads(next(r for r in singles if r["question_id"] == 501)["text"])["city"] in ("Paris", "Lyon")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Structured output" in report and "| `forced` | 2 of 2 |" in report


def test_json_strings_with_raw_control_characters_are_not_valid_json(world):
    """xgrammar's JSON strings with a maxLength admit raw control characters, which JSON itself
    forbids: the benchmark's check parses strictly, so such an output is counted invalid."""
    target, tok, decoders, prompts, compiled, reference = world
    schema = Grammar.json_schema({"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}},
                                  "required": ["s"]})
    grammar = compile_grammar(schema, tok, target.config.vocab_size, [tok.eos_token_id])
    ids = tok('{"s": "a\x07b"}', add_special_tokens=False).input_ids + [tok.eos_token_id]
    text = tok.decode(ids, skip_special_tokens=True)
    matcher = xgr.GrammarMatcher(grammar)
    assert "\x07" in text and all(matcher.accept_token(t) for t in ids)  # the grammar takes it
    assert check_output(grammar, schema, ids, text)["valid"] is False
    good = tok('{"s": "ab"}', add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert check_output(grammar, schema, good, tok.decode(good, skip_special_tokens=True))["valid"] is True


# -- a real model ------------------------------------------------------------------------------------------
@pytest.mark.real_model
def test_smollm2_answers_in_its_schema_exactly_and_validly(smollm2):
    """SmolLM2-135M-Instruct answers a Spec-Bench RAG question of the extraction set in a short
    schema: identical to transformers with xgrammar's processor, valid JSON of the schema."""
    from pathlib import Path

    from specdec.modelinfo import eos_token_ids
    from specdec.prompts import encode_chat

    model, tok = smollm2
    data = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "extraction.jsonl"
    question = json.loads(data.read_text().splitlines()[1])
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 60},
                                               "confidence": {"enum": ["high", "medium", "low"]}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    ids = encode_chat(tok, [{"role": "user", "content": question["turns"][0]}])
    grammar = Grammar.json_schema(schema)
    compiled = compile_grammar(grammar, tok, model.config.vocab_size, eos_token_ids(model))
    want = model.generate(ids, max_new_tokens=48, do_sample=False,
                          logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
    out = SpecDecoder(model, "prompt_lookup", tokenizer=tok).generate(ids, max_new_tokens=48, grammar=grammar)
    assert torch.equal(out.sequences, want)
    new = out.sequences[0, ids.shape[1]:].tolist()
    checked = check_output(compiled, grammar, new, tok.decode(new, skip_special_tokens=True))
    assert new[-1] in eos_token_ids(model) and checked["valid"] and checked["forced"] > 0
    assert out.stats.grammar_accepted > 0


def test_without_xgrammar_the_error_says_how_to_install_it(world, monkeypatch):
    import builtins

    target, tok, decoders, prompts, compiled, reference = world
    real_import = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar" or name.startswith("xgrammar."):
            raise ImportError("No module named 'xgrammar'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    ids, mask = prompts["single"]
    with pytest.raises(ImportError, match=r'pip install "specdec\[grammar\]"'):
        SpecDecoder(target, tokenizer=byte_tokenizer()).generate(ids, max_new_tokens=4, grammar=SCHEMA)


def test_the_grammar_masks_a_transposed_block_of_logits_as_a_contiguous_one(world):
    """A fast output layer returns its logits as a transposed view; xgrammar's mask writes through
    the scores' data, so the block it masks must be the processors' own contiguous copy."""
    from specdec.processors import BlockProcessors

    target, tok, _, prompts, compiled, _ = world
    ids, _ = prompts["single"]
    drafts = torch.tensor([tok.encode("the world")[:2]])  # in the grammar: a block of 3 positions
    processors = BlockProcessors([GrammarConstraint(compiled["regex"])], ids)
    lengths = torch.tensor([ids.shape[1]])
    pos = processors.positions(ids, lengths, lengths, torch.tensor([0]), drafts, torch.tensor([3]))
    scores = torch.randn(1, 3, target.config.vocab_size)
    transposed = scores.transpose(1, 2).contiguous().transpose(1, 2)  # the same numbers, V the outer stride
    assert not transposed.is_contiguous()
    want = processors.apply(scores, pos)
    assert bool(want.isneginf().any()) and not bool(want.isneginf().all(-1).any())  # each position allows some
    assert torch.equal(processors.apply(transposed, pos), want)
