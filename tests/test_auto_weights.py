"""``weights="auto"``: the copy's precision chosen by measurement (``specdec/copies/choose.py``).

The choice follows the policy's model (the expected rate from each candidate's measured step
and agreement: the first candidate expected to reach ``ENOUGH``, else the best), a candidate
that fails to build is left out with its reason, the choice is kept on disk per machine and
model and read back by a later process (no measuring then), and a call says what was chosen and
why (``stats.choices``), with the seconds spent apart from
decoding (``stats.summary()``). Output stays the target's whatever the choice.
"""

from __future__ import annotations

import pytest
import torch

from specdec import SpecDecoder
from specdec.copies import choose
from specdec.copies import Copies
from specdec.engines.forwards.lowbit import build_copy
from specdec.metrics import AcceptanceStats
from specdec.policy.costs import COST_GRID, CostModel
from specdec.models import tiny_random

from helpers import DRAFTING_PAYS, pin_costs, repetitive_prompt


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A fresh weight cache root and an empty process memo: every choice is measured anew."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(choose, "_MEMO", {})
    return tmp_path


@pytest.fixture(scope="module")
def target():
    return pin_costs(tiny_random("llama", seed=3)[0], DRAFTING_PAYS, rate=0.0)


def fake_timings(monkeypatch, steps: dict, agreements: dict, target_seconds: float = 0.010):
    """Measurements as given: {weights: step seconds}, {weights: agreement}; the target's step
    ``target_seconds``, its wider forwards dearer by half of that every 7 tokens. Returns a builder
    that fails for weights without a step (a candidate this machine cannot build)."""
    def interleaved(timers, count, prune_after=None, out_of_time=None, tick=None):
        reference = list(range(100))  # the target's greedy tokens
        tops = {"target": reference}
        for name in timers:
            if name in agreements:
                same = round(agreements[name] * 100)
                tops[name] = reference[:same] + [-1] * (100 - same)
        seconds = {"target": target_seconds, **{name: steps[name] for name in timers if name in steps}}
        wide = {width: [target_seconds * (1 + 0.5 * (width - 1) / 7)] for width in choose.WIDTHS}
        return seconds, tops, wide

    def build(model, weights):
        if weights not in steps:
            raise ImportError(f"no kernel for {weights} here")
        return build_copy(model, "bfloat16")

    monkeypatch.setattr(choose, "interleaved", interleaved)
    return build


@pytest.mark.parametrize("flags, caps, first, last", [
    (["avx2", "avx512f", "avx512_vnni", "amx_int8"], {}, "w8a8", "dynamic_int8"),  # an AMX Xeon
    (["avx2"], {}, "int4", "w8a8"),  # an AVX2-only EPYC
    (["avx2", "avx512f", "avx512_vnni", "amx_int8"], {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "int4", "w8a8"),  # capped
    # AVX-512 without VNNI: oneDNN's level below its int8 dot products (it was taken for one with them)
    (["avx2", "avx512f", "avx512_vnni", "amx_int8"], {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, "int4", "w8a8"),
    (["avx2", "avx512f", "avx512_vnni", "amx_int8"], {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, "w8a8",
     "dynamic_int8"),
])
def test_the_order_of_candidates_follows_the_cpus_int8_instructions(monkeypatch, flags, caps, first, last):
    """Where int8 products have no dot-product instructions (VNNI, AMX) the w8a8 copy is tried
    last: the first copy expected to pay ends the search, so the order is what a first call pays."""
    from specdec import machine

    monkeypatch.setattr(machine, "cpu_flags", lambda names=(): [f for f in flags if f in names])
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in caps.items():
        monkeypatch.setenv(name, value)
    order = choose.candidates(torch.nn.Linear(2, 2))  # a float32 model (dynamic_int8 needs one)
    assert (order[0], order[-1]) == (first, last)
    assert sorted(order) == sorted(("w8a8", "int4", "bfloat16", "dynamic_int8"))


def test_expected_speedup_follows_the_policys_model():
    flat = lambda width: 1.0  # noqa: E731  a verification costs one plain step whatever its width
    assert choose.expected_speedup(0.0, 0.1, flat) == (1.0, 0)  # never accepted: plain decoding
    speedup, drafts = choose.expected_speedup(1.0, 0.0, flat)
    assert drafts == choose.MAX_DRAFTS and speedup == pytest.approx(choose.MAX_DRAFTS + 1)
    # a dearer step pays less, and a step as dear as the target's never pays
    assert choose.expected_speedup(0.9, 0.1, flat)[0] > choose.expected_speedup(0.9, 0.3, flat)[0] > 1.0
    assert choose.expected_speedup(0.9, 1.0, flat) == (1.0, 0)


def test_auto_picks_the_best_expected_rate_not_the_fastest_step(target, own_cache, monkeypatch):
    # w8a8 steps fastest but agrees poorly; bfloat16 agrees best; dynamic_int8 cannot be built here
    build = fake_timings(monkeypatch, {"w8a8": 0.002, "bfloat16": 0.004}, {"w8a8": 0.3, "bfloat16": 0.95})
    sample = torch.arange(5, 40)[None, :]
    choice, built = choose.measure(target, sample, build, weights=("w8a8", "bfloat16", "dynamic_int8"))
    assert choice.weights == "bfloat16" and set(built) == {"bfloat16"}  # only the winner is kept
    by_name = {c.weights: c for c in choice.candidates}
    assert by_name["bfloat16"].expected_speedup > by_name["w8a8"].expected_speedup > 1.0
    assert by_name["w8a8"].expected_speedup < choose.ENOUGH  # so the next one is tried
    assert by_name["bfloat16"].expected_speedup >= choose.ENOUGH  # and the last one is not built
    assert by_name["dynamic_int8"].problem.startswith("not needed")
    assert "bfloat16" in choice.reason and "dynamic_int8: not built (not needed" in choice.reason


def test_every_candidate_is_tried_where_none_is_enough(target, own_cache, monkeypatch):
    build = fake_timings(monkeypatch, {"w8a8": 0.009, "bfloat16": 0.0095}, {"w8a8": 0.9, "bfloat16": 0.95})
    built_names = []
    sample = torch.arange(5, 40)[None, :]
    choice, _ = choose.measure(target, sample, lambda m, w: built_names.append(w) or build(m, w),
                               weights=("w8a8", "bfloat16", "dynamic_int8"))
    assert max(c.expected_speedup or 0 for c in choice.candidates) < choose.ENOUGH
    assert built_names == ["w8a8", "bfloat16", "dynamic_int8"]  # tried: it cannot be built here
    by_name = {c.weights: c for c in choice.candidates}
    assert by_name["dynamic_int8"].problem.startswith("ImportError: no kernel")
    assert choice.reason.startswith(f"{choice.weights}: the best expected rate")


def test_candidates_after_one_expected_to_be_enough_are_not_built(target, own_cache, monkeypatch):
    build = fake_timings(monkeypatch, {"w8a8": 0.002, "bfloat16": 0.004}, {"w8a8": 0.95, "bfloat16": 0.95})
    built_names, target_timers = [], []
    real_timer = choose.StepTimer
    monkeypatch.setattr(choose, "StepTimer", lambda model, *a: target_timers.append(model) or real_timer(model, *a))
    sample = torch.arange(5, 40)[None, :]
    choice, built = choose.measure(target, sample, lambda m, w: built_names.append(w) or build(m, w),
                                   weights=("w8a8", "bfloat16", "dynamic_int8"))
    assert built_names == ["w8a8"] and choice.weights == "w8a8" and set(built) == {"w8a8"}
    by_name = {c.weights: c for c in choice.candidates}
    assert by_name["w8a8"].expected_speedup >= choose.ENOUGH
    assert by_name["bfloat16"].problem.startswith("not needed") and by_name["dynamic_int8"].problem.startswith("not needed")
    assert choice.reason.startswith(f"w8a8: the first copy expected to reach {choose.ENOUGH}x")
    # a second copy measured (the first not enough) reuses the target's timer, prefilled once
    target_timers.clear()
    build = fake_timings(monkeypatch, {"w8a8": 0.009, "bfloat16": 0.002}, {"w8a8": 0.5, "bfloat16": 0.95})
    choice, _ = choose.measure(target, sample, build, weights=("w8a8", "bfloat16"))
    assert choice.weights == "bfloat16" and sum(model is target for model in target_timers) == 1


def test_the_targets_timings_become_its_forward_cost_model(own_cache, monkeypatch):
    """A call after ``auto`` measured times no target forward of its own: the policy starts from
    the forwards timed while choosing (a model that already had a cost model keeps it)."""
    fresh = tiny_random("llama", seed=5)[0]
    build = fake_timings(monkeypatch, {"w8a8": 0.002}, {"w8a8": 0.95}, target_seconds=0.010)
    choose.measure(fresh, torch.arange(5, 40)[None, :], build, weights=("w8a8",))
    costs, spent = CostModel.for_model(fresh, torch.arange(5, 40))
    assert spent == 0.0
    assert float(costs.predict(1)) == pytest.approx(0.010) and float(costs.predict(8)) == pytest.approx(0.015)
    kept = CostModel([1.0] * len(COST_GRID))
    assert not CostModel.offer(fresh, kept) and CostModel.for_model(fresh, torch.arange(5, 40))[0] is costs


def test_a_first_call_calibrates_nothing_after_choosing(own_cache):
    fresh = tiny_random("llama", seed=6)[0]
    out = SpecDecoder(fresh, "self_draft", compile_draft=False).generate(repetitive_prompt(10), max_new_tokens=8)
    assert out.stats.calibration_seconds == 0.0 and out.stats.generator["setup_seconds"] > 0
    assert torch.equal(out.sequences, fresh.generate(repetitive_prompt(10), max_new_tokens=8, do_sample=False))


def test_the_targets_timer_rewinds_to_the_same_tokens(target):
    sample = torch.arange(5, 40)[None, :]
    timer = choose.StepTimer(target, sample, 6)
    try:
        first = [timer.step()[1] for _ in range(6)]
        timer.rewind()
        assert [timer.step()[1] for _ in range(6)] == first
    finally:
        timer.release()


class FixedTimer:
    """A StepTimer stand-in whose steps take ``seconds`` and predict token 7."""

    prefilled: list = []

    def __init__(self, seconds: float):
        self.seconds, self.steps = seconds, 0

    def time(self, width: int) -> float:
        return self.seconds * width

    def step(self):
        self.steps += 1
        return self.seconds, 7


def test_a_copy_no_faster_than_the_target_is_timed_no_further():
    timers = {"target": FixedTimer(0.010), "fast": FixedTimer(0.004), "faster": FixedTimer(0.003),
              "slow": FixedTimer(0.012)}
    seconds, tops, _ = choose.interleaved(timers, 16, prune_after=choose.PRUNE_AFTER)
    assert timers["slow"].steps == choose.PRUNE_AFTER
    assert timers["fast"].steps == timers["faster"].steps == 16 == timers["target"].steps  # two copies left: compared
    assert seconds["slow"] == 0.012 and len(tops["slow"]) == choose.PRUNE_AFTER
    assert choose.agreement(tops["target"], tops["slow"]) == 1.0  # over the steps both were timed at


def test_a_lone_copy_left_is_timed_only_lone_steps():
    timers = {"target": FixedTimer(0.010), "fast": FixedTimer(0.004), "slow": FixedTimer(0.012)}
    seconds, tops, _ = choose.interleaved(timers, 16, prune_after=choose.PRUNE_AFTER)
    assert timers["slow"].steps == choose.PRUNE_AFTER < choose.LONE_STEPS < 16
    assert timers["fast"].steps == choose.LONE_STEPS == timers["target"].steps
    assert seconds["fast"] == 0.004 and len(tops["fast"]) == choose.LONE_STEPS
    # a copy pruned alone: the target steps no further either
    timers = {"target": FixedTimer(0.010), "slow": FixedTimer(0.012)}
    choose.interleaved(timers, 16, prune_after=choose.PRUNE_AFTER)
    assert timers["slow"].steps == choose.PRUNE_AFTER == timers["target"].steps
    # without pruning (a caller timing everything) every model steps through every token
    timers = {"target": FixedTimer(0.010), "fast": FixedTimer(0.004)}
    choose.interleaved(timers, 16)
    assert timers["fast"].steps == 16 == timers["target"].steps


def test_the_choice_is_kept_on_disk_and_read_back_without_measuring(target, own_cache, monkeypatch, capsys):
    build = fake_timings(monkeypatch, {"w8a8": 0.002, "bfloat16": 0.004}, {"w8a8": 0.9, "bfloat16": 0.95})
    monkeypatch.setattr(choose, "candidates", lambda model: ("w8a8", "bfloat16"))
    monkeypatch.delenv("SPECDEC_QUIET", raising=False)
    sample = torch.arange(5, 40)[None, :]
    first, built = choose.choose(target, sample, build)
    assert first.weights == "w8a8" and not first.cached and built
    said = capsys.readouterr().err.splitlines()  # measuring is one-time work: said, not silent
    assert said[0].startswith("specdec: choosing the draft copy") and "w8a8, bfloat16" in said[0]
    assert said[1].startswith("specdec: ... chose w8a8 in ")
    files = list((own_cache / "weights" / "auto-weights").glob("*.json"))
    assert len(files) == 1
    monkeypatch.setattr(choose, "_MEMO", {})  # a later process: only the disk knows

    def no_build(model, weights):
        raise AssertionError("a remembered choice measures nothing")

    again, built = choose.choose(target, sample, no_build)
    assert again.cached and again.weights == "w8a8" and built == {}
    assert capsys.readouterr().err == ""  # read back: nothing to say
    assert [c.weights for c in again.candidates] == [c.weights for c in first.candidates]
    assert "read from the cache" in again.reason


def test_the_key_names_the_machine_and_the_model(target, monkeypatch):
    key = choose.cache_key(target)
    assert choose.cache_key(target) == key
    other = tiny_random("llama", seed=4)[0]
    assert choose.cache_key(other) != key  # other weights
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert choose.cache_key(target) != key  # an instruction-set cap is another machine


def test_copies_build_the_chosen_copy_once_whichever_name_asks(target, own_cache, monkeypatch):
    build = fake_timings(monkeypatch, {"bfloat16": 0.004}, {"bfloat16": 0.95})
    monkeypatch.setattr(choose, "candidates", lambda model: ("bfloat16",))
    monkeypatch.setattr("specdec.copies.drafts.build_copy", build)
    copies = Copies()
    made = copies.get(target, "auto", torch.arange(5, 40)[None, :])
    assert copies.get(target, "bfloat16") is made and copies.choice(target).weights == "bfloat16"


def test_a_call_says_what_was_chosen_and_times_it_apart(target, own_cache):
    decoder = SpecDecoder(target, "self_draft", compile_draft=False)
    ids = repetitive_prompt(10)
    out = decoder.generate(ids, max_new_tokens=12)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=12, do_sample=False))
    stats = out.stats
    assert stats.choices["weights"] in choose.candidates(target)
    assert stats.choices["weights_choice"].startswith(
        (stats.choices["weights"] + ": the best expected rate", stats.choices["weights"] + ": the first copy expected"))
    assert stats.generator["setup_seconds"] > 0 and "setup" in stats.summary()
    assert stats.one_time_seconds >= stats.generator["setup_seconds"]
    assert stats.decoding_tokens_per_second >= stats.tokens_per_second
    later = decoder.generate(ids, max_new_tokens=12).stats  # the copy is built: nothing one-time is left
    assert later.generator["setup_seconds"] < stats.generator["setup_seconds"]
    assert later.choices["weights"] == stats.choices["weights"]


def test_stats_keep_choices_and_compile_time_through_merge_and_dict():
    a = AcceptanceStats(total_seconds=2.0, committed_tokens=10, compile_seconds=1.0, choices={"weights": "w8a8"})
    b = AcceptanceStats(total_seconds=1.0, committed_tokens=10, calibration_seconds=0.5)
    merged = a + b
    assert merged.compile_seconds == 1.0 and merged.choices == {"weights": "w8a8"}
    assert merged.decoding_tokens_per_second == pytest.approx(20 / 1.5)
    back = AcceptanceStats.from_dict(merged.as_dict())
    assert back.compile_seconds == 1.0 and back.choices == {"weights": "w8a8"}
    assert "one-time 1.5 s (calibration 0.5 s, compiling/packing 1.0 s)" in merged.summary()


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_by_default_a_call_compiles_nothing_and_a_warm_up_compiles_the_copy(target, own_cache):
    """``compile_draft="auto"``: the copy drafts eagerly in a call (no silent compile), and compiles
    inside ``SpecDecoder.warmup`` (``warming``) or once a graph of it was compiled in the process."""
    from specdec.compiled import compiles_now, warming

    decoder = SpecDecoder(target, "self_draft", weights="bfloat16")
    graphs = compiled_graphs()
    decoder.generate(repetitive_prompt(10), max_new_tokens=8)
    assert compiled_graphs() == graphs
    session = decoder.candidate_generator.session()
    session.drafting_model(target)
    assert session.precision_attach_options()["compile"] is False
    with warming():
        assert compiles_now(session._model) and session.precision_attach_options()["compile"] is True
    assert not compiles_now(session._model)


def test_torchs_dynamic_int8_copy_drafts_eagerly_and_exactly(target):
    decoder = SpecDecoder(target, "self_draft", weights="dynamic_int8", compile_draft=True)
    ids = repetitive_prompt(10)
    graphs = compiled_graphs()
    out = decoder.generate(ids, max_new_tokens=16)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=16, do_sample=False))
    assert out.stats.accepted_tokens > 0 and compiled_graphs() == graphs  # its packed layers never compile
    assert out.stats.choices["weights"] == "dynamic_int8"


def test_the_bench_report_says_what_each_method_chose(tmp_path):
    from specdec.bench.report import write_report
    from test_bench import _synthetic_run

    chose = AcceptanceStats(steps=2, committed_tokens=4, total_seconds=0.5,
                            choices={"weights": "w8a8", "weights_choice": "w8a8: the best expected rate on a CPU"})
    out = _synthetic_run(tmp_path, [chose.as_dict(), AcceptanceStats(steps=2, committed_tokens=4).as_dict(),
                                    AcceptanceStats(steps=2, committed_tokens=4).as_dict()])
    write_report(out, log=None)
    section = (out / "report.md").read_text().split("## Choices made on this machine", 1)[1].split("\n## ", 1)[0]
    assert "| `auto` | `weights` | w8a8 |" in section
    assert "| `auto` | `weights_choice` | w8a8: the best expected rate on a CPU |" in section


def test_steps_are_timed_and_compared_one_token_at_a_time(target):
    """Every model steps through the same tokens; a copy identical to the target agrees everywhere."""
    ids = torch.arange(5, 25)[None, :]
    timers = {"target": choose.StepTimer(target, ids, 6), "same": choose.StepTimer(target, ids, 6)}
    seconds, tops, wide = choose.interleaved(timers, 6)
    assert len(tops["target"]) == ids.shape[1] and tops["same"] == tops["target"]  # the prefilled 14, then 6 steps
    assert sorted(wide) == sorted(choose.WIDTHS) and all(len(t) == 2 and min(t) > 0 for t in wide.values())
    assert choose.agreement(tops["target"], tops["same"]) == 1.0 and seconds["same"] > 0
    assert timers["target"].position == ids.shape[1]  # each step fed the next token and kept it


def test_agreement_is_measured_over_the_prefilled_text_too(target):
    """A handful of steps cannot tell a 93% copy from an 88% one: the greedy tokens of the prefill
    (teacher-forced, one forward each) are compared as well, except for a copy quantizing a forward's
    activations per tensor, whose many-token forward is not how it drafts."""
    ids = torch.arange(5, 45)[None, :]
    start = ids.shape[1] - 6
    copy = build_copy(target, "bfloat16")
    reference = choose.StepTimer(target, ids, 6)
    timers = {"target": reference, "bfloat16": choose.StepTimer(copy, ids, 6)}
    _, tops, _ = choose.interleaved(timers, 6)
    with torch.no_grad():  # the same positions, teacher-forced by the models' own forwards
        ours = target(ids[:, :start]).logits[0].argmax(-1).tolist()
        theirs = copy(ids[:, :start]).logits[0].argmax(-1).tolist()
    assert tops["target"][:start] == ours and tops["bfloat16"][:start] == theirs
    made = choose._candidate("bfloat16", 0.001, tops, choose.target_costs(0.01, {}), start)
    assert (made.positions, made.steps) == (ids.shape[1], 6)
    assert made.agreement == choose.agreement(tops["target"], tops["bfloat16"])
    assert made.agreement == sum(a == b for a, b in zip(tops["target"], tops["bfloat16"])) / ids.shape[1]
    per_tensor = choose.StepTimer(build_copy(target, "dynamic_int8"), ids, 6)
    assert per_tensor.prefilled == [None] * start
    reference.rewind()
    _, tops, _ = choose.interleaved({"target": reference, "dynamic_int8": per_tensor}, 6)
    made = choose._candidate("dynamic_int8", 0.001, tops, choose.target_costs(0.01, {}), start)
    assert (made.positions, made.steps) == (6, 6)  # its steps alone
    for timer in (reference, timers["bfloat16"], per_tensor):
        timer.release()


def test_without_a_tokenizer_the_calibration_text_is_encoded_by_the_models_stored_one(tmp_path):
    """A call that passes no tokenizer still measures on the calibration text where the model's
    tokenizer is saved beside its weights (read from disk, nothing downloaded), not on a prompt of a
    few tokens; a model with none stored falls back to the prompt."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny_random("llama", seed=7)
    prompt = torch.arange(5, 11)
    assert choose.stored_tokenizer(model) is None
    assert torch.equal(choose.calibration_ids(None, prompt, "cpu", model=model), prompt[None, :])
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path)
    text = torch.tensor(tokenizer(choose.CALIBRATION_TEXT)["input_ids"][:128])[None, :]
    assert text.shape[1] > 100
    assert torch.equal(choose.calibration_ids(None, prompt, "cpu", model=saved), text)


@pytest.mark.parametrize("later, chosen", [(1.05, "w8a8"), (1.15, "int4")])
def test_a_later_copy_replaces_an_earlier_one_only_when_clearly_better(target, own_cache, monkeypatch, later, chosen):
    """Measurements of the same copy vary by some 5% between runs: a later candidate whose expected
    speedup is within ``BETTER_BY`` of an earlier one's does not replace it, one clearly better does."""
    build = fake_timings(monkeypatch, {"w8a8": 0.005, "int4": 0.005}, {"w8a8": 0.5, "int4": 0.5})
    real = choose._candidate

    def scaled(name, *args):
        made = real(name, *args)
        if name == "int4":
            made.expected_speedup *= later
        return made

    monkeypatch.setattr(choose, "_candidate", scaled)
    choice, built = choose.measure(target, torch.arange(5, 40)[None, :], build, weights=("w8a8", "int4"))
    by_name = {c.weights: c for c in choice.candidates}
    assert by_name["w8a8"].expected_speedup < choose.ENOUGH  # so int4 is measured
    assert by_name["int4"].expected_speedup == pytest.approx(by_name["w8a8"].expected_speedup * later)
    assert choice.weights == chosen and set(built) == {chosen} and choice.reason.startswith(f"{chosen}: ")


def test_the_reason_gives_each_copys_step_against_the_target_timed_beside_it():
    """Each copy's expected speedup reads the target's step from the rounds timed beside it, its
    reported step read the first copy's: on a busy machine "2.93x (step 1.50 of the target's)"."""
    first = choose.Candidate("w8a8", step_seconds=0.012, agreement=0.5, expected_speedup=1.05, positions=8,
                             target_step_seconds=0.020)
    second = choose.Candidate("bfloat16", step_seconds=0.015, agreement=1.0, expected_speedup=2.93, positions=8,
                              target_step_seconds=0.050)
    reason = choose.Choice("bfloat16", [first, second], target_seconds=0.010).reason
    assert "bfloat16 2.93x (step 0.30 of the target's" in reason and "w8a8 1.05x (step 0.60 of" in reason
