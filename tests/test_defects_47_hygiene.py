"""Issue 47, items 8, 13 and 14: what a process keeps, what a command imports, what specdec warns.

* **Bounded per-model tables** (item 8). ``custom_generate`` calls keep drafters per target
  (``specdec.integration.Drafters``): a draft model passed once is freed after its call, the
  drafters kept for one target stay at ``MAX_DRAFTERS`` however many options and tokenizers the
  calls bring, and a target that goes away takes everything specdec's weak tables keep for it
  and its draft (fast head, direct forward, cost curves, low-precision copies) with it.
* **Light commands** (item 13). ``import specdec.cli`` and building the ``specdec`` and
  ``specdec bench`` parsers import neither torch nor transformers; ``--help`` exits 0 from the
  installed command, and ``specdec list`` lists what the registry has without importing the
  generators.
* **No deprecated arguments** (item 14). Every forward specdec runs takes its cache by the name
  the model's forward declares (``cache`` in transformers 5.25, where ``past_key_values`` warns),
  whatever name its caller used; and the test session's warning filters (pyproject.toml) turn a
  deprecation warning raised from specdec's own modules into a failure.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import warnings
import weakref

import pytest
import torch
from transformers import DynamicCache

import specdec
from specdec import SpecDecoder
from specdec.engines.forwards.head import FastHead, model_logits
from specdec.integration import DRAFTERS, MAX_DRAFTERS
from specdec.models import byte_tokenizer, tiny_random
from specdec.tiny import TINY_ARCHS

from helpers import perturbed_copy, pin_costs, reference, repetitive_prompt

FIXED = {"num_tokens": 3, "schedule": "fixed"}


# -- item 8: per-model tables are bounded ---------------------------------------------------------------
def test_a_draft_model_passed_once_is_freed_after_its_call():
    """Twelve calls with a fresh draft model once kept all twelve alive (+229 MiB on SmolLM2)."""
    target = pin_costs(tiny_random("llama", seed=1)[0])
    ids = repetitive_prompt(6)
    want = reference(target, ids, 8)
    drafts = []
    for seed in range(3):
        draft = perturbed_copy(target, 0.3, seed=seed)
        out = target.generate(ids, max_new_tokens=8, custom_generate=specdec.generate, draft=draft,
                              draft_options=FIXED)
        assert torch.equal(out, want)
        drafts.append(weakref.ref(draft))
        del draft, out
    gc.collect()
    assert [ref() is None for ref in drafts] == [True] * 3
    assert DRAFTERS.count(target) == 0


def test_the_drafters_kept_for_a_target_are_bounded_and_reused():
    """Each new tokenizer or option set builds a drafter; past ``MAX_DRAFTERS`` the least recently
    used goes, with the tokenizer it kept; a repeated call reuses its drafter."""
    target = pin_costs(tiny_random("llama", seed=2)[0])
    ids = repetitive_prompt(6, seed=1)
    want = reference(target, ids, 6)
    tokenizers = []
    for n in range(MAX_DRAFTERS + 3):
        tokenizer = byte_tokenizer()
        out = target.generate(ids, max_new_tokens=6, custom_generate=specdec.generate, draft="prompt_lookup",
                              draft_options={"num_tokens": 1 + n % 3, "schedule": "fixed"}, target_tokenizer=tokenizer)
        assert torch.equal(out, want)
        tokenizers.append(weakref.ref(tokenizer))
        del tokenizer
    gc.collect()
    assert DRAFTERS.count(target) == MAX_DRAFTERS
    assert [ref() is not None for ref in tokenizers] == [False] * 3 + [True] * MAX_DRAFTERS
    last = DRAFTERS.generators(target)[-1]
    target.generate(ids, max_new_tokens=6, custom_generate=specdec.generate, draft="prompt_lookup",
                    draft_options={"num_tokens": 1 + (MAX_DRAFTERS + 2) % 3, "schedule": "fixed"},
                    target_tokenizer=tokenizers[-1]())
    assert DRAFTERS.count(target) == MAX_DRAFTERS and DRAFTERS.generators(target)[-1] is last
    specdec.integration.release(target)


@pytest.mark.parametrize("draft", ["self_draft", "model"])
def test_a_target_and_its_draft_leave_nothing_behind(draft):
    """Every weak per-model table (drafters, fast head, direct forward, cost curves, copies) lets
    the models go once the caller drops them: no table's value holds its key."""
    target = tiny_random("llama", seed=3)[0]
    FastHead.pin(target, True)
    model = perturbed_copy(target, 0.3, seed=4)
    chosen, options = (model, FIXED) if draft == "model" else ("self_draft", {"weights": "bfloat16",
                                                                            "compile_draft": False})
    ids = repetitive_prompt(6, seed=2)
    target.generate(ids, max_new_tokens=6, custom_generate=specdec.generate, draft=chosen, draft_options=options)
    SpecDecoder(target, chosen, **options).generate(ids, max_new_tokens=6)
    refs = [weakref.ref(target), weakref.ref(model)]
    del target, model, chosen
    gc.collect()
    assert [ref() is None for ref in refs] == [True, True]


# -- item 13: light commands ------------------------------------------------------------------------------
HEAVY = ("torch", "transformers")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_command_line_and_its_parsers_import_neither_torch_nor_transformers():
    code = (
        "import json, sys\n"
        f"heavy = {HEAVY!r}\n"
        "say = lambda step: print(json.dumps([step, [m for m in heavy if m in sys.modules]]), flush=True)\n"
        "import specdec.cli\n"
        "say('import specdec.cli')\n"
        "from specdec.bench import cli as bench\n"
        "say('import specdec.bench.cli')\n"
        "specdec.cli.build_parser(); bench.run_parser(); bench.report_parser()\n"
        "say('the parsers')\n"
        "for argv in (['--help'], ['generate', '--help'], ['demo', '--help'], ['bench', '--help'],\n"
        "             ['bench', 'report', '--help']):\n"
        "    try:\n"
        "        specdec.cli.main(argv)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, (argv, exc.code)\n"
        "    say(' '.join(argv))\n")
    done = _python(code)
    seen = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    assert seen == {step: [] for step in seen}, seen
    assert done.returncode == 0 and len(seen) == 8, done.stderr


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["bench", "report", "--help"]])
def test_help_exits_0(argv):
    done = subprocess.run([sys.executable, "-m", "specdec", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "usage: specdec" in done.stdout


def test_list_names_the_registrys_generators_without_importing_them():
    code = ("import sys\n"
            "from specdec.cli import main\n"
            "main(['list'])\n"
            "print('IMPORTED', [m for m in ('transformers', 'candidate_generators.prompt_lookup') "
            "if m in sys.modules])\n")
    done = _python(code)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "IMPORTED []"
    listed = [line.split()[0] for line in lines[1:lines.index("packaged models:")]]
    assert listed == specdec.available_generators()
    described = dict(line.split(None, 1) for line in lines[1:lines.index("packaged models:")])
    for name in listed:
        module = sys.modules[specdec.get_candidate_generator(name).__module__]
        assert described[name] == module.__doc__.strip().splitlines()[0]


def test_list_names_a_plugin_that_does_not_load_instead_of_failing(monkeypatch):
    import importlib.metadata

    from specdec import cli

    broken = importlib.metadata.EntryPoint("broken_plugin", "no_such_module_for_specdec_tests:Nothing",
                                           cli.ENTRY_POINT_GROUP)
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None, **kw: [*real(group=group), broken] if group == cli.ENTRY_POINT_GROUP
                        else real(group=group, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the registry's own word on skipping it, where it looks again
        summaries = cli.generator_summaries()
    assert summaries["broken_plugin"].startswith("(does not load: ")
    assert summaries["prompt_lookup"]


def test_the_command_lines_own_copies_of_torch_side_names_agree():
    from specdec import cli, registry
    from specdec.models import DTYPES

    assert list(cli.DTYPE_NAMES) == list(DTYPES)
    assert cli.ENTRY_POINT_GROUP == registry.ENTRY_POINT_GROUP


# -- item 14: no deprecated arguments, and the session fails on a deprecation from specdec ------------------
def _deprecations(record) -> list[str]:
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in record
            if issubclass(w.category, (DeprecationWarning, FutureWarning))
            and ("past_key_values" in str(w.message) or "/specdec/" in w.filename
                 or "/candidate_generators/" in w.filename)]


def test_a_cache_given_as_past_key_values_reaches_the_forward_as_cache():
    """transformers 5.25 warns ``past_key_values is deprecated ... Use cache instead`` from
    specdec/engines/forwards/head.py when a caller names the cache the old way: specdec renames it."""
    model = tiny_random("llama", seed=5)[0]
    ids = repetitive_prompt(5, seed=3)
    with torch.no_grad():
        own_cache, cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
        own = model.forward(input_ids=ids, cache=own_cache, use_cache=True).logits
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for direct in (True, False):
                cache = DynamicCache(config=model.config)
                mine = model_logits(model, {"input_ids": ids, "past_key_values": cache, "use_cache": True},
                                    direct=direct, fast_head=False)
                assert torch.equal(mine, own) and cache.get_seq_length() == ids.shape[1]
    assert _deprecations(record) == []


def test_a_forward_that_declares_only_past_key_values_gets_it():
    """The fallback is read from the forward's signature, not from the model's class name."""
    from specdec.engines.forwards.head import with_current_cache_keyword

    model = tiny_random("llama", seed=5)[0]

    class Older(type(model)):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return super().forward(input_ids=input_ids, cache=past_key_values, use_cache=use_cache, **kwargs)

    older = Older(model.config).eval()
    kwargs = {"input_ids": torch.ones(1, 2, dtype=torch.long), "past_key_values": DynamicCache(config=model.config)}
    assert with_current_cache_keyword(older, kwargs) is kwargs
    renamed = with_current_cache_keyword(model, kwargs)
    assert set(renamed) == {"input_ids", "cache"} and renamed["cache"] is kwargs["past_key_values"]
    both = {**kwargs, "cache": None}
    assert with_current_cache_keyword(model, both) is both  # both given: the forward decides, as transformers does


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_decoding_runs_no_forward_by_a_deprecated_name(arch):
    """Every tested architecture, dynamic and static caches, timed calibration (direct forwards)
    and the fast head: no deprecation warning from specdec's code or about the cache's name, and
    the output is generate()'s."""
    target = tiny_random(arch, seed=6)[0]
    FastHead.pin(target, True)
    ids = repetitive_prompt(6, seed=4)
    want = reference(target, ids, 6)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for cache in ("dynamic", "static"):
            out = SpecDecoder(target, "prompt_lookup", cache_implementation=cache).generate(ids, max_new_tokens=6)
            assert torch.equal(out.sequences, want), cache
        out = target.generate(ids, max_new_tokens=6, custom_generate=specdec.generate, draft="prompt_lookup")
        assert torch.equal(out, want)
    assert _deprecations(record) == []


@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning])
@pytest.mark.parametrize("module", ["specdec.engines.forwards.head", "specdec", "candidate_generators.draft_model"])
def test_a_deprecation_warning_from_specdecs_code_fails_the_test(category, module):
    with pytest.raises(category, match="from specdec's code"):
        warnings.warn_explicit("a deprecated argument, from specdec's code", category, f"{module}.py", 1,
                               module=module)


def test_a_deprecation_from_elsewhere_or_specdecs_own_plugin_notice_is_only_shown():
    with warnings.catch_warnings(record=True) as record:
        warnings.warn_explicit("someone else's deprecation", FutureWarning, "x.py", 1, module="specdec_lookalike")
        warnings.warn_explicit("candidate generator 'mine': acceptance_prior is deprecated; return "
                               "DraftingInfo(priors=...) from drafting()", DeprecationWarning, "run.py", 1,
                               module="specdec.run")
    assert len(record) == 2

