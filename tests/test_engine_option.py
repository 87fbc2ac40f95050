"""``engine=`` on SpecDecoder, custom_generate and bench methods (docs/engines.md, "Choosing an engine").

"eager" runs the models' own forward and nothing else, for one decoder: no scripted stack, no
packed weights, no fast output layer, nothing decided, counted or packed for the model, while
another decoder of the same model on "auto" runs them as before. Every name keeps
``target.generate``'s greedy output; the choice is reported in ``stats.choices["engine"]``; an
unknown name is refused before any forward; a bench method's engine is part of its fingerprint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specdec
from specdec import SpecDecoder
from specdec.bench.config import ConfigError, load_config, parse_config
from specdec.bench.report import _cache_words
from specdec.bench.runner import config_hash, row_fingerprints
from specdec.engines.forwards import packed
from specdec.engines.forwards.direct import DirectForward
from specdec.engines.forwards.head import FastHead
from specdec.engines.forwards.packed import PackedLinears
from specdec.kv import CacheSettings
from specdec.model_plan import UNDECIDED, planned
from specdec.models import tiny_random
from specdec.policy.costs import CostModel
from specdec.prompts import left_pad

from helpers import TINY_COSTS, ForwardRecorder, pin_costs, repetitive_prompt, tiny_pair

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SHARE = ROOT / "benchmarks" / "configs" / "engine_share_smollm2.yaml"
NEW = 16


def pin_eager_costs(model):
    """:func:`helpers.pin_costs` for ``engine="eager"`` forwards too (their costs are kept apart)."""
    pin_costs(model)
    for implementation in ("dynamic", "static"):
        CostModel.pin(model, CostModel(list(TINY_COSTS)), CacheSettings.make(implementation, engine="eager"))
    return model


@pytest.fixture
def paths(monkeypatch):
    """What the CPU engine's forwards did, by path: DirectForward calls, packed-weight uses asked,
    fast-head calls, and every decision made (``decide``)."""
    seen = {"direct": 0, "packed": 0, "head": 0, "decide": 0}

    def spy(cls, name, key):
        original = getattr(cls, name)

        def counted(*args, **kwargs):
            seen[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, counted)

    spy(DirectForward, "__call__", "direct")
    spy(PackedLinears, "use", "packed")
    spy(FastHead, "__call__", "head")
    for cls in (DirectForward, FastHead):
        monkeypatch.setattr(cls, "_decide", classmethod(lambda c, m, _o=cls._decide: seen.__setitem__(
            "decide", seen["decide"] + 1) or _o.__func__(c, m)))
    return seen


@pytest.fixture
def llama():
    """A tiny Llama whose CPU forwards are all pinned on (forgotten afterwards)."""
    target = pin_eager_costs(tiny_random("llama", seed=5)[0])
    assert DirectForward.pin(target, True) is not None
    assert FastHead.pin(target, True) is not None
    PackedLinears.pin(target, True)
    yield target
    for cls in (DirectForward, FastHead, PackedLinears):
        cls.forget(target)


def padded_batch(tokenizer):
    rows = [repetitive_prompt(n, seed=n)[0] for n in (5, 19)]
    return left_pad(rows, tokenizer.pad_token_id)


@pytest.mark.parametrize("engine", ["eager", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gpt2", "phi3"])
def test_greedy_output_is_generates_on_every_engine(arch, engine):
    target, draft, tokenizer = tiny_pair(arch)
    pin_eager_costs(target)
    ids = repetitive_prompt(20, seed=1)
    padded, mask = padded_batch(tokenizer)
    want = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    want_batch = target.generate(padded, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    for drafter in (None, "prompt_lookup", draft):
        decoder = SpecDecoder(target, drafter, engine=engine)
        assert torch.equal(decoder.generate(ids, max_new_tokens=NEW).sequences, want), drafter
        out = decoder.generate(padded, mask, max_new_tokens=NEW)
        assert torch.equal(out.sequences, want_batch), drafter
        assert out.stats.choices["engine"].startswith("target: " + ("eager" if engine == "eager" else "cpu (auto)"))


@pytest.mark.parametrize("engine", ["eager", "auto", "cpu"])
def test_custom_generate_takes_the_engine_and_keeps_generates_output(engine):
    target, _, tokenizer = tiny_pair("llama", seed=2)
    pin_eager_costs(target)
    padded, mask = padded_batch(tokenizer)
    want = target.generate(padded, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    out = target.generate(padded, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                          custom_generate=specdec.generate, draft="prompt_lookup",
                          decoder_options={"engine": engine}, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert out.stats.choices["engine"].startswith("target: " + {"eager": "eager", "auto": "cpu (auto)",
                                                                "cpu": "cpu:"}[engine])


def test_eager_on_a_static_cache_keeps_generates_output(llama, paths):
    ids = repetitive_prompt(20, seed=8).repeat(2, 1)
    want = llama.generate(ids, max_new_tokens=NEW, do_sample=False)
    paths.update(direct=0, packed=0, head=0)
    out = SpecDecoder(llama, "prompt_lookup", engine="eager", cache_implementation="static").generate(
        ids, max_new_tokens=NEW)
    assert torch.equal(out.sequences, want)
    assert paths == {"direct": 0, "packed": 0, "head": 0, "decide": 0}


def test_eager_runs_none_of_the_cpu_forwards_while_auto_of_the_same_model_does(llama, paths):
    ids = repetitive_prompt(20, seed=3).repeat(2, 1)  # two rows: verifications feed 4+ rows, packed territory
    want = llama.generate(ids, max_new_tokens=24, do_sample=False)
    paths.update(direct=0, packed=0, head=0)
    eager = SpecDecoder(llama, "prompt_lookup", engine="eager")
    auto = SpecDecoder(llama, "prompt_lookup")
    out = eager.generate(ids, max_new_tokens=24)
    assert torch.equal(out.sequences, want)
    assert paths == {"direct": 0, "packed": 0, "head": 0, "decide": 0}
    assert out.stats.choices["engine"] == "target: eager: the model's own forward"
    assert "packed_weights" not in out.stats.choices
    out = auto.generate(ids, max_new_tokens=24)  # the same model, another decoder: its paths as pinned
    assert torch.equal(out.sequences, want)
    assert paths["direct"] > 0 and paths["head"] > 0 and paths["packed"] > 0
    assert out.stats.choices["engine"].startswith("target: cpu (auto): scripted Llama stack used; packed weights ")
    assert out.stats.choices["engine"].endswith("; fast output layer used")
    if packed.available():
        assert "packed weights used for forwards of" in out.stats.choices["engine"]
    paths.update(direct=0, packed=0, head=0)
    assert torch.equal(eager.generate(ids, max_new_tokens=24).sequences, want)  # and eager again after auto
    assert paths == {"direct": 0, "packed": 0, "head": 0, "decide": 0}


def test_eager_decides_counts_and_packs_nothing_for_the_model(paths):
    target, draft, _ = tiny_pair("llama", seed=4)
    pin_eager_costs(target)
    ids = repetitive_prompt(20, seed=4)
    try:
        for drafter in ("prompt_lookup", draft, "prompt_lookup"):  # three calls: auto would have packed by now
            SpecDecoder(target, drafter, engine="eager").generate(ids, max_new_tokens=NEW)
        assert paths["decide"] == 0
        for model in (target, draft):
            plan = planned(model)  # the costs pinned above made the target's
            assert plan is None or (plan.direct is UNDECIDED and plan.head is UNDECIDED)
            assert plan is None or plan.packed is None  # not even a call counted: auto's packing is its own
        out = SpecDecoder(target, draft).generate(ids, max_new_tokens=NEW)
        assert PackedLinears.of(target).calls == 1  # the first call auto counts is its own
        assert "assistant 0: cpu (auto)" in out.stats.choices["engine"]
    finally:
        for cls in (DirectForward, FastHead, PackedLinears):
            cls.forget(target)
            cls.forget(draft)


def test_the_engine_reaches_the_assistants():
    target, draft, _ = tiny_pair("llama", seed=6)
    pin_eager_costs(target)
    out = SpecDecoder(target, draft, engine="eager").generate(repetitive_prompt(20), max_new_tokens=NEW)
    assert out.stats.choices["engine"] == ("target: eager: the model's own forward | "
                                           "assistant 0: eager: the model's own forward")


@pytest.mark.parametrize("bad,error,words", [
    ("eagr", ValueError, "Did you mean 'eager'"),
    ("gpu", ValueError, "Known: auto, cpu, eager"),
    (None, TypeError, "engine must be a name"),
])
def test_an_unknown_engine_is_refused_before_any_forward(bad, error, words):
    target, _ = tiny_random("llama", seed=7)
    recorder = ForwardRecorder(target)
    try:
        with pytest.raises(error, match=words):
            SpecDecoder(target, "prompt_lookup", engine=bad)
        with pytest.raises(error, match=words):
            target.generate(repetitive_prompt(8), max_new_tokens=4, custom_generate=specdec.generate,
                            draft="prompt_lookup", decoder_options={"engine": bad})
        with pytest.raises(error, match=words):
            CacheSettings.make(engine=bad)
    finally:
        recorder.remove()
    assert recorder.calls == []


def test_the_cpu_engine_is_refused_for_a_model_elsewhere():
    target, _ = tiny_random("llama", seed=7)
    target.to("meta")
    with pytest.raises(ValueError, match="engine='cpu' runs models on a CPU; LlamaForCausalLM is on meta"):
        SpecDecoder(target, None, engine="cpu")


# -- bench methods ----------------------------------------------------------------------------------
def methods_config(**engine):
    return parse_config({"target": "tiny-random:llama", "methods": [
        {"name": "baseline", "generator": "baseline"},
        {"name": "loop", "generator": "none", **engine}]})


def test_the_engine_share_config_loads_with_each_methods_engine():
    config = load_config(ENGINE_SHARE)
    engines = {m.name: m.engine for m in config.methods}
    assert engines == {"baseline": "auto", "loop_eager": "eager", "loop_auto": "auto", "pl_eager": "eager",
                       "pl_auto": "auto"}
    assert {m.generator for m in config.methods} == {"baseline", "none", "prompt_lookup"}
    assert config.threads == 2 and config.generation.max_new_tokens == 128 and config.dataset.per_subtask == 2


def test_a_methods_engine_enters_its_fingerprint_and_auto_keeps_older_ones():
    plain, auto, eager, cpu = methods_config(), methods_config(engine="auto"), methods_config(engine="eager"), \
        methods_config(engine="cpu")
    prints = [row_fingerprints(c, []).methods["loop"] for c in (plain, auto, eager, cpu)]
    assert prints[0] == prints[1]  # auto is the default: results written before the field still resume
    assert len({prints[1], prints[2], prints[3]}) == 3
    assert config_hash(plain, []) == config_hash(auto, []) != config_hash(eager, [])
    assert row_fingerprints(eager, []).methods["baseline"] == row_fingerprints(plain, []).methods["baseline"]


@pytest.mark.parametrize("method,words", [
    ({"name": "loop", "generator": "none", "engine": "eagr"}, "Did you mean 'eager'"),
    ({"name": "b", "generator": "baseline", "engine": "eager"}, "engine: 'baseline' runs transformers' own generate"),
    ({"name": "pl", "generator": "prompt_lookup", "options": {"engine": "eager"}},
     "options.engine: 'engine' is a key of the method"),
])
def test_a_bad_engine_in_a_bench_method_is_refused_by_name(method, words):
    with pytest.raises(ConfigError, match=words):
        parse_config({"target": "tiny-random:llama",
                      "methods": [{"name": "baseline", "generator": "baseline"}, method]})


def test_the_report_names_a_methods_engine():
    assert _cache_words({"engine": "eager"}) == ", engine `eager`"
    assert _cache_words({"engine": "auto"}) == _cache_words({}) == ""


def test_the_command_line_takes_an_engine_and_prints_the_choice(capsys):
    from specdec import cli
    from specdec.engines import ENGINE_CHOICES

    assert list(cli.ENGINE_NAMES) == list(ENGINE_CHOICES)  # named there so that the parser imports no torch
    base = ["generate", "--target", "tiny-random:llama", "--max-new-tokens", "4", "--threads", "1", "--raw"]
    for engine, said in (("eager", "engine: target: eager: the model's own forward"), ("auto", "engine: target: cpu")):
        assert cli.main([*base, "--engine", engine, "abcabc"]) == 0
        assert said in capsys.readouterr().err, engine
    with pytest.raises(SystemExit):
        cli.main([*base, "--engine", "eagr", "abc"])
    assert "invalid choice: 'eagr'" in capsys.readouterr().err


def test_the_report_splits_a_speedup_into_the_engines_share_and_speculations():
    """With the loop drafting nothing on an engine, a method's speedup = that loop's x its own over it."""
    from specdec.bench.report import _engine_share_section
    from specdec.bench.summary import Summary

    def summary(method, generator, speedup, reference=False):
        return Summary(method, generator, "overall", 4, 100, 1.0, speedup, None, False, None, None, reference)

    meta = {"config": {"methods": [{"name": "base", "generator": "baseline"},
                                   {"name": "loop_eager", "generator": "none", "engine": "eager"},
                                   {"name": "loop_auto", "generator": "none"},
                                   {"name": "pl_eager", "generator": "prompt_lookup", "engine": "eager"},
                                   {"name": "pl_auto", "generator": "prompt_lookup"}]}}
    overall = [summary("base", "baseline", 1.0, reference=True), summary("loop_eager", "none", 1.0),
               summary("loop_auto", "none", 1.25), summary("pl_eager", "prompt_lookup", 1.6),
               summary("pl_auto", "prompt_lookup", 2.0)]
    text = "\n".join(_engine_share_section(meta, overall))
    assert "| `pl_auto` | `auto` | 2.00x | 1.25x (`loop_auto`) | 1.60x |" in text
    assert "| `pl_eager` | `eager` | 1.60x | 1.00x (`loop_eager`) | 1.60x |" in text
    assert "| `loop_auto` | `auto` | 1.25x | 1.25x (`loop_auto`) | n/a |" in text.replace("—", "n/a")
    assert _engine_share_section({"config": {"methods": meta["config"]["methods"][3:]}}, overall[3:]) == []
