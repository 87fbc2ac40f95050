"""The candidate-generator registry and third-party plugins.

* ``@register_candidate_generator`` registers a class under a name (and sets ``cls.name``);
* the built-ins are found through the ``specdec.candidate_generators`` entry-point group, as a
  third-party package's would be, and the core never imports them;
* unknown names list the known ones with a "did you mean"; duplicate names are refused; listing
  them prints nothing;
* a generator written at run time, and the two complete examples of docs/plugins.md (run
  exactly as the page prints them), decode with output identical to ``target.generate``.

Every registration made here is removed again (``unregister_candidate_generator``).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest
import torch

import specdec.registry as registry
from specdec import SpecDecoder
from specdec.generators import CandidateGenerator, DraftingInfo, Proposal
from specdec.models import tiny_random
from specdec.registry import (ENTRY_POINT_GROUP, UnknownGeneratorError, available_generators,
                              get_candidate_generator, register_candidate_generator,
                              unregister_candidate_generator)

from helpers import ForwardRecorder, left_pad, perturbed_copy, repetitive_prompt

ROOT = Path(__file__).resolve().parents[1]
BUILT_INS = {"draft_model": "candidate_generators.draft_model", "prompt_lookup": "candidate_generators.prompt_lookup",
             "suffix": "candidate_generators.suffix"}




@pytest.fixture
def cleanup():
    """Collects generator names and module names to remove after the test."""
    names, modules = [], []
    yield names, modules
    for name in names:
        unregister_candidate_generator(name)
    for module in modules:
        sys.modules.pop(module, None)


@pytest.fixture(scope="module")
def llama():
    return tiny_random("llama", seed=3)


def drafting_pays_llama():
    """The ``llama`` fixture's model, a fresh object whose forwards are priced so that drafting
    always pays (tests that assert drafts were accepted must not depend on the machine's load)."""
    from helpers import DRAFTING_PAYS, pin_costs

    target, tokenizer = tiny_random("llama", seed=3)
    return pin_costs(target, DRAFTING_PAYS, rate=0.0), tokenizer


@pytest.fixture
def fresh_registry(monkeypatch):
    """An empty registry whose entry points have not been loaded yet (restored afterwards)."""
    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.setattr(registry, "_entry_point_index", None)
    return registry


# -- decorator, entry points ---------------------------------------------------------------------
def test_decorator_registers_under_the_name(cleanup):
    names, _ = cleanup

    @register_candidate_generator("test_reg_decorated")
    class Decorated(CandidateGenerator):
        pass

    names.append("test_reg_decorated")
    assert get_candidate_generator("test_reg_decorated") is Decorated
    assert Decorated.name == "test_reg_decorated"
    assert "test_reg_decorated" in available_generators()
    unregister_candidate_generator("test_reg_decorated")
    with pytest.raises(UnknownGeneratorError):
        get_candidate_generator("test_reg_decorated")


def test_built_ins_are_declared_and_discovered_through_entry_points(fresh_registry):
    declared = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    for name, module in BUILT_INS.items():
        assert declared[name].module == module
    assert fresh_registry._REGISTRY == {}
    found = available_generators()  # loads the entry points into the empty registry
    for name, module in BUILT_INS.items():
        assert name in found
        cls = get_candidate_generator(name)
        assert cls is declared[name].load() and cls.__module__ == module and cls.name == name


def test_core_never_imports_the_plugins():
    """specdec/ must not import candidate_generators/ (the arrows point one way)."""
    offenders = []
    for path in sorted((ROOT / "specdec").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "candidate_generators"]
    assert not offenders, offenders


THIRD_PARTY_MODULE = '''
import torch
from specdec.generators import CandidateGenerator, Proposal

class LastTokenRepeater(CandidateGenerator):  # no decorator: registered by its entry point
    def propose(self, ctx, max_drafts):
        last = ctx.tokens[torch.arange(ctx.batch_size), ctx.lengths - 1]  # [B]
        k = int(max_drafts.clamp(0, 3).max())
        return Proposal(last[:, None].repeat(1, k), max_drafts.clamp(0, 3))
'''


def test_a_third_party_entry_point_is_discovered_and_a_broken_one_is_skipped(
        fresh_registry, monkeypatch, tmp_path, cleanup, llama):
    _, modules = cleanup
    (tmp_path / "thirdparty_repeater.py").write_text(THIRD_PARTY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    modules.append("thirdparty_repeater")
    real = entry_points(group=ENTRY_POINT_GROUP)
    fake = [*real,
            EntryPoint("repeater", "thirdparty_repeater:LastTokenRepeater", ENTRY_POINT_GROUP),
            EntryPoint("broken", "no_such_module_for_specdec_tests:Nothing", ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep for ep in fake if ep.group == group])
    with pytest.warns(UserWarning, match="broken"):
        known = available_generators()
    assert "repeater" in known and "broken" not in known and set(BUILT_INS) <= set(known)
    cls = get_candidate_generator("repeater")
    assert cls.__name__ == "LastTokenRepeater" and cls.name == "repeater"

    target, _ = llama
    ids = repetitive_prompt(10, seed=1)
    out = SpecDecoder(target, "repeater").generate(ids, max_new_tokens=20)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=20, do_sample=False))
    assert out.stats.drafted_tokens > 0


# -- errors ----------------------------------------------------------------------------------------
def test_unknown_name_lists_known_names_and_suggests_the_closest(llama):
    with pytest.raises(UnknownGeneratorError) as info:
        get_candidate_generator("prompt_lookpu")
    message = str(info.value)
    assert "prompt_lookpu" in message and "Did you mean 'prompt_lookup'?" in message
    assert all(name in message for name in BUILT_INS)
    assert isinstance(info.value, KeyError)

    with pytest.raises(UnknownGeneratorError) as info:
        get_candidate_generator("zzzzzz")
    assert "did you mean" not in str(info.value).lower() and "draft_model" in str(info.value)

    target, _ = llama
    with pytest.raises(UnknownGeneratorError, match="Did you mean 'draft_model'"):
        SpecDecoder(target, "draft_modle")


def test_duplicate_names_are_refused(cleanup):
    names, _ = cleanup

    @register_candidate_generator("test_reg_dup")
    class First(CandidateGenerator):
        pass

    names.append("test_reg_dup")

    class Second(CandidateGenerator):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_candidate_generator("test_reg_dup")(Second)
    assert get_candidate_generator("test_reg_dup") is First
    builtin = get_candidate_generator("prompt_lookup")
    with pytest.raises(ValueError, match="prompt_lookup"):
        register_candidate_generator("prompt_lookup")(Second)
    assert get_candidate_generator("prompt_lookup") is builtin
    register_candidate_generator("test_reg_dup")(First)  # the same class again is harmless
    with pytest.raises(ValueError):
        register_candidate_generator("")


def test_an_entry_point_name_is_refused_before_the_first_lookup_too(fresh_registry, monkeypatch):
    """Registering a built-in's name before anything looked a generator up used to replace the
    built-in silently (entry points load lazily and skipped names already taken)."""

    class Impostor(CandidateGenerator):
        pass

    assert not fresh_registry._entry_points_loaded
    with pytest.raises(ValueError) as before:
        register_candidate_generator("prompt_lookup")(Impostor)
    message = str(before.value)
    assert "candidate_generators.prompt_lookup:PromptLookupGenerator" in message  # the entry point's target
    assert f"{__name__}.{Impostor.__qualname__}" in message  # and the user's class
    cls = get_candidate_generator("prompt_lookup")
    assert cls.__module__ == "candidate_generators.prompt_lookup" and cls.name == "prompt_lookup"
    with pytest.raises(ValueError) as after:  # once the entry points are loaded: the same error
        register_candidate_generator("prompt_lookup")(Impostor)
    assert str(after.value) == message
    assert get_candidate_generator("prompt_lookup") is cls and "name" not in Impostor.__dict__


def test_the_clash_check_reads_entry_point_names_without_importing_them(fresh_registry, monkeypatch):
    lazy = EntryPoint("test_reg_lazy", "no_such_module_for_specdec_tests.sub:Lazy", ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [lazy] if group == ENTRY_POINT_GROUP else [])

    class Mine(CandidateGenerator):
        pass

    with pytest.raises(ValueError, match=r"test_reg_lazy = no_such_module_for_specdec_tests\.sub:Lazy"):
        register_candidate_generator("test_reg_lazy")(Mine)  # an import would have failed differently
    assert "no_such_module_for_specdec_tests" not in sys.modules
    register_candidate_generator("test_reg_not_declared")(Mine)  # other names are free
    assert fresh_registry._REGISTRY == {"test_reg_not_declared": Mine}

    # the entry point's own module registering its class under its name is of course allowed
    Lazy = type("Lazy", (CandidateGenerator,), {"__module__": "no_such_module_for_specdec_tests.sub"})
    register_candidate_generator("test_reg_lazy")(Lazy)
    assert fresh_registry._REGISTRY["test_reg_lazy"] is Lazy


def test_one_class_under_two_names_keeps_each_name(llama, cleanup):
    names, _ = cleanup

    @register_candidate_generator("test_reg_name_one")
    @register_candidate_generator("test_reg_name_two")
    class Repeater(CandidateGenerator):
        def __init__(self, *, num_tokens: int = 2):
            self.num_tokens = num_tokens

        def propose(self, ctx, max_drafts):
            last = ctx.tokens[torch.arange(ctx.batch_size), ctx.lengths - 1]
            k = self.num_tokens
            return Proposal(last[:, None].repeat(1, k), max_drafts.clamp(0, k))

    names.extend(["test_reg_name_one", "test_reg_name_two", "test_reg_name_three"])
    register_candidate_generator("test_reg_name_three")(Repeater)
    target, _ = llama
    ids = repetitive_prompt(8, seed=7)
    reference = target.generate(ids, max_new_tokens=12, do_sample=False)
    for name in ("test_reg_name_one", "test_reg_name_two", "test_reg_name_three"):
        cls = get_candidate_generator(name)
        assert cls.name == name and issubclass(cls, Repeater)
        decoder = SpecDecoder(target, name, num_tokens=3)
        gen = decoder.candidate_generator
        assert gen.name == name and isinstance(gen, Repeater) and gen.num_tokens == 3
        assert torch.equal(decoder.generate(ids, max_new_tokens=12).sequences, reference)
    assert Repeater.name == "test_reg_name_two"  # the first registration names the class itself
    register_candidate_generator("test_reg_name_one")(Repeater)  # again: harmless, nothing changes
    assert get_candidate_generator("test_reg_name_one").name == "test_reg_name_one"

    class Other(CandidateGenerator):
        pass

    with pytest.raises(ValueError, match=r"test_reg_name_one.*Repeater.*Other"):
        register_candidate_generator("test_reg_name_one")(Other)


# -- a generator written at run time ---------------------------------------------------------------
def test_a_generator_defined_at_run_time_decodes_exactly(llama, cleanup):
    names, _ = cleanup

    @register_candidate_generator("test_reg_echo")
    class EchoPrompt(CandidateGenerator):
        """Proposes the prompt's tokens that followed the last committed token's first
        occurrence in it (a crude lookup): a real third-party generator, only worse."""

        def __init__(self, *, num_tokens: int = 4):
            self.num_tokens = num_tokens
            self.calls = {"setup": 0, "propose": 0, "observe": 0}

        def setup(self, ctx):
            self.calls["setup"] += 1
            self.prompt_lengths = ctx.lengths.clone()

        def propose(self, ctx, max_drafts):
            self.calls["propose"] += 1
            rows = []
            for b in range(ctx.batch_size):
                prompt = ctx.tokens[b, : int(self.prompt_lengths[b])]
                last = ctx.tokens[b, int(ctx.lengths[b]) - 1]
                hits = (prompt[:-1] == last).nonzero().flatten()
                budget = min(self.num_tokens, int(max_drafts[b]))
                rows.append(prompt[int(hits[0]) + 1: int(hits[0]) + 1 + budget] if hits.numel() and budget > 0
                            else prompt[:0])
            k = max(r.numel() for r in rows)
            token_ids = torch.zeros(len(rows), k, dtype=torch.long)
            for b, r in enumerate(rows):
                token_ids[b, : r.numel()] = r
            return Proposal(token_ids, torch.tensor([r.numel() for r in rows]))

        def observe(self, ctx, feedback):
            self.calls["observe"] += 1

        def select_rows(self, rows):
            self.prompt_lengths = self.prompt_lengths[rows]

        def report(self):
            return dict(self.calls)

    names.append("test_reg_echo")
    target, tokenizer = llama
    decoder = SpecDecoder(target, "test_reg_echo", num_tokens=5)
    assert isinstance(decoder.candidate_generator, EchoPrompt) and decoder.candidate_generator.num_tokens == 5
    ids = repetitive_prompt(12, seed=4)
    out = decoder.generate(ids, max_new_tokens=24)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=24, do_sample=False))
    calls = out.stats.generator  # each call works on a fresh session, which reports its own counts
    assert calls["setup"] == 1 and calls["propose"] == calls["observe"] == out.stats.steps
    assert decoder.candidate_generator.calls["setup"] == 0  # the user's instance is only the configuration
    assert out.stats.drafted_tokens > 0

    rows = [repetitive_prompt(n, seed=n)[0] for n in (4, 15, 9)]
    batch, mask = left_pad(rows, tokenizer.pad_token_id)
    out = decoder.generate(batch, mask, max_new_tokens=16)
    for i, row in enumerate(rows):
        ref = target.generate(row[None], max_new_tokens=16, do_sample=False)[0, row.numel():]
        assert out.sequences[i, batch.shape[1]: batch.shape[1] + ref.numel()].tolist() == ref.tolist()

    with pytest.raises(TypeError, match="test_reg_echo"):
        SpecDecoder(target, "test_reg_echo", no_such_option=1)


# -- the examples of docs/plugins.md ---------------------------------------------------------------
def doc_blocks() -> dict[str, str]:
    """The ```python blocks of docs/plugins.md: complete files (first line ``# name.py``) by
    module name, and the usage block under the key ``usage``."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    blocks = {}
    for body in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        first = body.splitlines()[0]
        match = re.fullmatch(r"# (\w+)\.py", first)
        if match:
            blocks[match.group(1)] = body
        elif "import bigram_drafter" in body:
            blocks["usage"] = body
    return blocks


def import_doc_module(name: str, tmp_path: Path, monkeypatch, cleanup):
    names, modules = cleanup
    (tmp_path / f"{name}.py").write_text(doc_blocks()[name])
    monkeypatch.syspath_prepend(str(tmp_path))
    modules.append(name)
    module = __import__(name)
    names.extend(n for n in available_generators() if get_candidate_generator(n).__module__ == name)
    return module


def test_docs_bigram_example_runs_as_printed(tmp_path, monkeypatch, cleanup, capsys):
    blocks = doc_blocks()
    assert {"bigram_drafter", "greedy_assistant", "usage"} <= set(blocks)
    module = import_doc_module("bigram_drafter", tmp_path, monkeypatch, cleanup)
    assert get_candidate_generator("bigram") is module.BigramGenerator
    exec(compile(blocks["usage"], "docs/plugins.md (usage)", "exec"), {"__name__": "docs_usage"})
    assert "acceptance rate" in capsys.readouterr().out


def test_docs_bigram_generator_is_exact_and_really_drafts(tmp_path, monkeypatch, cleanup, llama):
    import_doc_module("bigram_drafter", tmp_path, monkeypatch, cleanup)
    target, tokenizer = drafting_pays_llama()  # drafts whatever the machine's load
    decoder = SpecDecoder(target, "bigram", num_tokens=6)
    ids = repetitive_prompt(16, seed=2)
    out = decoder.generate(ids, max_new_tokens=30)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=30, do_sample=False))
    assert out.stats.accepted_tokens > 0
    rows = [repetitive_prompt(n, seed=n)[0] for n in (5, 20, 11)]
    batch, mask = left_pad(rows, tokenizer.pad_token_id)
    out = decoder.generate(batch, mask, max_new_tokens=20)
    for i, row in enumerate(rows):
        ref = target.generate(row[None], max_new_tokens=20, do_sample=False)[0, row.numel():]
        assert out.sequences[i, batch.shape[1]: batch.shape[1] + ref.numel()].tolist() == ref.tolist()
    # sampling with a point-mass generator runs and is seeded
    runs = [decoder.generate(ids, max_new_tokens=20, do_sample=True, temperature=0.8,
                             generator=torch.Generator().manual_seed(3)).sequences for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_docs_assistant_example_is_exact_and_owned_by_the_controller(tmp_path, monkeypatch, cleanup, llama):
    import_doc_module("greedy_assistant", tmp_path, monkeypatch, cleanup)
    target, tokenizer = drafting_pays_llama()  # drafts whatever the machine's load
    # the cost-aware policy runs a draft only where it can pay: half the target's bytes, and agreeing often
    assistant = perturbed_copy(target, 0.2, seed=5).to(torch.bfloat16)
    monkeypatch.setattr(sys.modules["greedy_assistant"].SmallAssistantGenerator, "drafting",
                        lambda self: DraftingInfo(priors=0.9))
    recorder = ForwardRecorder(assistant)
    monkeypatch.setattr(assistant, "generate", lambda *a, **k: pytest.fail("the assistant ran generate()"))
    ids = repetitive_prompt(12, seed=6)
    out = SpecDecoder(target, "small_assistant", assistant=assistant).generate(ids, max_new_tokens=24)
    recorder.remove()
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=24, do_sample=False))
    assert out.stats.accepted_tokens > 0
    assert recorder.calls[0]["tokens"] == ids.shape[1]  # one prefill of the whole prompt
    assert all(call["tokens"] <= 2 for call in recorder.calls[1:])  # then incremental
    other_vocab, _ = tiny_random("llama", seed=3, vocab_size=400)
    with pytest.raises(ValueError, match="vocabulary"):
        SpecDecoder(target, "small_assistant", assistant=other_vocab).generate(ids, max_new_tokens=4)


def test_docs_hook_examples_run_as_printed_and_stay_exact(llama):
    """Every ``# hook:`` block of docs/plugins.md runs as printed, in the page's order; each
    generator it defines decodes exactly (one prompt and a left-padded batch), and what the
    examples claim holds (report reaches stats.generator, setup refuses, session shares)."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"```python\n(# hook: .*?)```", text, flags=re.S)
    namespace: dict = {"__name__": "docs_hooks"}
    for block in blocks:
        exec(compile(block, "docs/plugins.md (hooks)", "exec"), namespace)
    hooks = {block.splitlines()[0].removeprefix("# hook: ") for block in blocks}
    assert hooks == {"propose", "drafting", "setup", "observe, report", "select_rows", "session", "ctx.draft_rate",
                     "ctx.keep_drafting"}
    generators = [v for v in namespace.values() if isinstance(v, type) and issubclass(v, CandidateGenerator)
                  and v is not CandidateGenerator]
    assert len(generators) == len(blocks)
    target, tokenizer = llama
    ids = repetitive_prompt(10, seed=3)
    reference = target.generate(ids, max_new_tokens=16, do_sample=False)
    rows = [repetitive_prompt(n, seed=n)[0] for n in (4, 11)]
    batch, mask = left_pad(rows, tokenizer.pad_token_id)
    for cls in generators:
        decoder = SpecDecoder(target, cls(), tokenizer=tokenizer)
        assert torch.equal(decoder.generate(ids, max_new_tokens=16).sequences, reference), cls.__name__
        out = decoder.generate(batch, mask, max_new_tokens=12)
        for i, row in enumerate(rows):
            ref = target.generate(row[None], max_new_tokens=12, do_sample=False)[0, row.numel():]
            assert out.sequences[i, batch.shape[1]: batch.shape[1] + ref.numel()].tolist() == ref.tolist(), cls
    counted = SpecDecoder(target, namespace["Counting"]()).generate(ids, max_new_tokens=16)
    assert counted.stats.generator == {"steps": counted.stats.steps, "accepted": counted.stats.accepted_tokens}
    with pytest.raises(ValueError, match="needs_tokenizer"):
        SpecDecoder(target, namespace["NeedsTokenizer"]()).generate(ids, max_new_tokens=4)
    shared = namespace["SharedTable"]()
    assert shared.session().table is shared.table


def test_listing_the_generators_prints_nothing():
    """Loading the plugins imports transformers' modeling layers (``mtp``), and with them torchao,
    whose import logs messages about GPU kernels on a CPU build: specdec imports it quietly first."""
    done = subprocess.run([sys.executable, "-c", "import specdec; print(specdec.available_generators())"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "mtp" in done.stdout and done.stderr == "", done.stderr
