"""Issue 47, state on disk: nothing read back from disk changes an output silently, and one-time
work is bounded.

* the weight cache (``specdec.weight_cache``): a cached file changed after it was written (flipped
  bytes in the weights, an edited config or generation config, a damaged tokenizer, a file added),
  or a folder without its marker, is said, naming the file, and rebuilt from the GGUF file once;
  a folder's tokenizer that does not load is said, not taken for a checkpoint without one;
* the ``auto`` weights choice file (``specdec.copies.choose``): one that parses but has another
  shape, or other contents than were written, is said, naming it, measured again and replaced;
* measuring the choice stops at a time budget with the best copy so far, said; it shows progress
  where asked; and its key is the model's and the machine's only, so that ``specdec generate``
  and the API share one choice.

A packaged model here is a tiny random one: its "GGUF file" is a placeholder and its
de-quantization (``from_pretrained(..., gguf_file=...)``) is replaced by the tiny model itself,
so the cache's own code runs as on a real model, in a temporary ``SPECDEC_CACHE``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import warnings

import pytest
import torch

from specdec import SpecDecoder, models
from specdec.copies import choose
from specdec.engines.forwards.lowbit import build_copy
from specdec.models import PackagedModel, load_model, tiny_random

from helpers import repetitive_prompt

NAME = "tiny-packaged"


# -- the weight cache ------------------------------------------------------------------------------
@pytest.fixture
def packaged(tmp_path, monkeypatch):
    """A packaged model ``NAME`` in a fresh cache; returns (the model its GGUF file de-quantizes to,
    its tokenizer, a list with one entry per de-quantization)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_NO_WEIGHT_CACHE", raising=False)
    source = tmp_path / "package"
    source.mkdir()
    (source / "tiny.gguf").write_bytes(b"GGUF placeholder")
    entry = PackagedModel(NAME, "a tiny random llama", "nothing", lambda: (str(source), "tiny.gguf"))
    monkeypatch.setattr(models, "PACKAGED_MODELS", {**models.PACKAGED_MODELS, NAME: entry})
    models.packaged_location.cache_clear()
    model, tokenizer = tiny_random("llama", seed=11)
    dequantized = []
    real_model, real_tokenizer = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def fake_model(path, *args, gguf_file=None, **kwargs):
        if gguf_file is None:
            return real_model(path, *args, **kwargs)
        dequantized.append(gguf_file)
        return copy.deepcopy(model)

    def fake_tokenizer(path, *args, gguf_file=None, **kwargs):
        return real_tokenizer(path, *args, **kwargs) if gguf_file is None else copy.deepcopy(tokenizer)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fake_tokenizer)
    yield model, tokenizer, dequantized
    models.packaged_location.cache_clear()


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def load_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say about a cache as written
        return load_model(NAME)


def flip_bytes(path, count: int = 64):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


TAMPERING = {
    "model.safetensors": flip_bytes,
    "config.json": lambda path: edit_json(path, rms_norm_eps=0.5),
    "generation_config.json": lambda path: edit_json(path, repetition_penalty=3.0),
    "tokenizer.json": lambda path: path.write_text(path.read_text()[:-200]),  # cut short: not JSON
}


@pytest.mark.parametrize("file", list(TAMPERING))
def test_a_cached_file_changed_after_writing_is_said_and_rebuilt(packaged, file):
    model, tokenizer, dequantized = packaged
    first, _ = load_model(NAME)  # de-quantized and cached
    cache = models.weight_cache_path(NAME)
    assert dequantized == ["tiny.gguf"] and cache.is_dir() and same_weights(first, model)
    TAMPERING[file](cache / file)
    with pytest.warns(UserWarning, match=f"cached weights of {NAME} cannot be used: .*{file}"):
        again, again_tok = load_model(NAME)
    assert len(dequantized) == 2  # rebuilt from the GGUF file, as written the first time
    assert same_weights(again, model) and again_tok is not None
    assert again.config.rms_norm_eps == model.config.rms_norm_eps
    assert again.generation_config.to_dict() == model.generation_config.to_dict()
    ids = repetitive_prompt(8)
    assert torch.equal(again.generate(ids, max_new_tokens=6, do_sample=False),
                       model.generate(ids, max_new_tokens=6, do_sample=False))
    later, later_tok = load_quietly()  # the rewritten cache verifies, and nothing is de-quantized
    assert len(dequantized) == 2 and same_weights(later, model) and later_tok.get_vocab() == tokenizer.get_vocab()


def test_a_sharded_load_reads_only_a_verified_cache(packaged):
    """torchrun's loader reads the cache folder itself (transformers' from_pretrained with its
    parallel plan): it too rebuilds a damaged folder before any rank reads it, and a packaged
    model's tokenizer there must load."""
    from specdec.distributed.load import checkpoint_folder
    from specdec.models import load_tokenizer

    _, _, dequantized = packaged
    load_model(NAME)
    cache = models.weight_cache_path(NAME)
    flip_bytes(cache / "model.safetensors")
    with pytest.warns(UserWarning, match="model.safetensors"):
        assert checkpoint_folder(NAME) == cache
    assert len(dequantized) == 2
    (cache / "tokenizer.json").write_text("{")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(cache, strict=True)


def test_a_folder_verified_once_is_hashed_again_only_when_a_file_changes(packaged, monkeypatch):
    from specdec import weight_cache

    load_model(NAME)
    cache = models.weight_cache_path(NAME)
    hashed = []
    real = weight_cache._digest
    monkeypatch.setattr(weight_cache, "_digest", lambda path: hashed.append(path.name) or real(path))
    assert weight_cache.folder_problem(cache) is None and hashed
    hashed.clear()
    assert weight_cache.folder_problem(cache) is None and hashed == []  # verified by this process, unchanged since
    edit_json(cache / "generation_config.json", repetition_penalty=3.0)
    assert "generation_config.json" in weight_cache.folder_problem(cache) and hashed


def test_a_file_added_to_a_cache_folder_is_said_and_rebuilt(packaged):
    _, _, dequantized = packaged
    load_model(NAME)
    cache = models.weight_cache_path(NAME)
    (cache / "model.safetensors.index.json").write_text("{}")
    with pytest.warns(UserWarning, match="model.safetensors.index.json"):
        load_model(NAME)
    assert len(dequantized) == 2 and not (cache / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("marker", ["missing", "from before the digests"])
def test_a_cache_folder_without_a_valid_marker_is_rebuilt_once(packaged, marker):
    """Issue 47 item 10: a folder without its marker was de-quantized again on every load and never
    rewritten (the rename into place failed beside it)."""
    from specdec.weight_cache import CACHE_MARKER

    model, _, dequantized = packaged
    load_model(NAME)
    cache = models.weight_cache_path(NAME)
    if marker == "missing":
        (cache / CACHE_MARKER).unlink()
    else:
        (cache / CACHE_MARKER).write_text(json.dumps({"model": NAME, "dtype": "torch.float32"}))
    with pytest.warns(UserWarning, match=CACHE_MARKER):
        load_model(NAME)
    assert len(dequantized) == 2 and (cache / CACHE_MARKER).is_file()
    later, _ = load_quietly()
    assert len(dequantized) == 2 and same_weights(later, model)  # rebuilt once, read from the cache since


def test_a_folders_tokenizer_that_does_not_load_is_said(tmp_path):
    """A local checkpoint whose tokenizer files are damaged is not a checkpoint without a tokenizer:
    the load says so, naming the folder and the files (one saved without any stays silent)."""
    model, tokenizer = tiny_random("llama", seed=12)
    bare, damaged = tmp_path / "bare", tmp_path / "damaged"
    model.save_pretrained(bare)
    model.save_pretrained(damaged)
    tokenizer.save_pretrained(damaged)
    (damaged / "tokenizer.json").write_text((damaged / "tokenizer.json").read_text()[:-100])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_model(str(bare))[1] is None
    with pytest.warns(UserWarning, match=f"tokenizer in {damaged} .*tokenizer.json.* did not load"):
        loaded, loaded_tok = load_model(str(damaged))
    assert loaded_tok is None and same_weights(loaded, model)


# -- the auto-weights choice file -----------------------------------------------------------------
@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDEC_NO_WEIGHT_CACHE", raising=False)
    monkeypatch.setattr(choose, "_MEMO", {})
    return tmp_path


@pytest.fixture(scope="module")
def target():
    return tiny_random("llama", seed=13)[0]


SAMPLE = torch.arange(5, 40)[None, :]


def counting_build(built: list):
    def build(model, weights):
        built.append(weights)
        return build_copy(model, "bfloat16")
    return build


def resign(data):
    """The file's digest made to match its edited contents (where the file has one), so that its
    shape is what is checked."""
    if isinstance(data, dict) and importlib.util.find_spec("specdec.copies.choice_file") is not None:
        from specdec.copies.choice_file import _contents_digest

        data["digest"] = _contents_digest(data)
    return data


def _wrong(change):
    def edit(data):
        change(data)
        return resign(data)
    return edit


WRONG_SHAPES = {
    "a list": lambda data: [data],
    "candidates an object": _wrong(lambda d: d.update(candidates={"w8a8": 1})),
    "no weights": _wrong(lambda d: d.pop("weights")),
    "a candidate with another field": _wrong(lambda d: d["candidates"][0].update(speed=2)),
    "a measured candidate without figures": _wrong(lambda d: d["candidates"][0].update(expected_speedup=None)),
    "weights not measured": _wrong(lambda d: d.update(weights="float64")),
    "edited, not re-signed": lambda data: {**data, "target_seconds": (data["target_seconds"] or 1) * 9},
    "not JSON": lambda data: "{not json",
}


@pytest.mark.parametrize("shape", list(WRONG_SHAPES))
def test_a_choice_file_of_another_shape_is_said_measured_again_and_replaced(target, own_cache, shape, monkeypatch):
    monkeypatch.setattr(choose, "candidates", lambda model: ("bfloat16",))
    key = choose.cache_key(target)
    choose.choose(target, SAMPLE, counting_build([]))
    path = choose.cache_file(key)
    changed = WRONG_SHAPES[shape](json.loads(path.read_text()))
    path.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    monkeypatch.setattr(choose, "_MEMO", {})  # a later process
    built = []
    with pytest.warns(UserWarning, match=f"choice file {path}"):
        choice, _ = choose.choose(target, SAMPLE, counting_build(built))
    assert built == ["bfloat16"] and choice.weights == "bfloat16" and not choice.cached  # measured again
    monkeypatch.setattr(choose, "_MEMO", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, fresh = choose.choose(target, SAMPLE, counting_build(built))  # the file was replaced
    assert again.cached and fresh == {} and built == ["bfloat16"] and again.weights == "bfloat16"
    assert "read from the cache" in again.reason


def test_a_self_draft_call_survives_a_damaged_choice_file(own_cache, monkeypatch):
    """Issue 47 item 7: every later self_draft call crashed (KeyError) on such a file."""
    fresh = tiny_random("llama", seed=14)[0]
    path = choose.cache_file(choose.cache_key(fresh))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": choose._FORMAT, "candidates": []}))
    ids = repetitive_prompt(10)
    with pytest.warns(UserWarning, match=f"choice file {path}"):
        out = SpecDecoder(fresh, "self_draft", compile_draft=False).generate(ids, max_new_tokens=8)
    assert torch.equal(out.sequences, fresh.generate(ids, max_new_tokens=8, do_sample=False))
    assert choose.load(choose.cache_key(fresh)).weights == out.stats.choices["weights"]


# -- one-time work: bounded, shown, shared -----------------------------------------------------------
class FakeClock:
    """Seconds that pass only when read: ``step`` each read."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_the_time_budget_stops_measuring_and_says_so(target, own_cache, monkeypatch):
    """Issue 47 item 12: choosing took 349 s on a busy machine. Past the budget the copy being timed
    stops after MIN_ROUNDS rounds, no later copy is built, and the choice says so."""
    # no copy is ever good enough to end the search: the budget alone stops it, whatever this
    # machine's timing of the bfloat16 copy (a fast one made the later copies "not needed")
    monkeypatch.setattr(choose, "ENOUGH", float("inf"))
    built = []
    choice, kept = choose.measure(target, SAMPLE, lambda m, w: built.append(w) or build_copy(m, w),
                                  weights=("bfloat16", "w8a8", "dynamic_int8"), budget=5.0,
                                  clock=FakeClock(10.0))  # spent at the first look after MIN_ROUNDS rounds
    by_name = {c.weights: c for c in choice.candidates}
    assert built == ["bfloat16"] and choice.weights == "bfloat16" and set(kept) == {"bfloat16"}
    assert choice.cut_short and choice.budget == 5.0
    assert by_name["bfloat16"].steps == choose.MIN_ROUNDS and by_name["bfloat16"].cut
    assert all("time budget ran out" in by_name[w].problem for w in ("w8a8", "dynamic_int8"))
    assert "stopped by its 5 s time budget" in choice.reason and "timed 2 steps: the time budget ran out" in choice.reason
    # a generous budget on the same clock is not cut short
    choice, _ = choose.measure(target, SAMPLE, build_copy, weights=("bfloat16",), budget=1e6, clock=FakeClock(1.0))
    assert not choice.cut_short and "budget" not in choice.reason


def test_a_spent_budget_is_said_on_stderr_and_in_stats_and_kept_for_the_process_only(own_cache, monkeypatch,
                                                                                    capsys):
    """A choice cut short by the budget is one busy moment's: the process keeps it, no file does."""
    fresh = tiny_random("llama", seed=15)[0]
    monkeypatch.delenv("SPECDEC_QUIET", raising=False)
    ids = repetitive_prompt(10)
    out = SpecDecoder(fresh, "self_draft", compile_draft=False, choice_budget=0).generate(ids, max_new_tokens=8)
    assert torch.equal(out.sequences, fresh.generate(ids, max_new_tokens=8, do_sample=False))
    assert "stopped by its 0 s time budget" in out.stats.choices["weights_choice"]
    err = capsys.readouterr().err
    assert "for at most some 0 s" in err and "the 0 s time budget ran out: the best copy measured by then" in err
    assert "kept for this process only" in err
    assert choose._MEMO[choose.cache_key(fresh)].cut_short  # this process keeps it
    assert choose.load(choose.cache_key(fresh)) is None  # a later process measures again
    monkeypatch.setenv(choose.BUDGET_ENV, "soon")
    with pytest.raises(ValueError, match="SPECDEC_CHOICE_BUDGET must be a number of seconds"):
        choose.budget_seconds()
    with pytest.raises(ValueError, match="choice_budget must be a number of seconds >= 0"):
        SpecDecoder(fresh, "self_draft", choice_budget=-1)


def test_interleaved_stops_at_the_budget_after_min_rounds():
    from test_auto_weights import FixedTimer

    timers = {"target": FixedTimer(0.010), "fast": FixedTimer(0.004)}
    ticks = []
    choose.interleaved(timers, 16, prune_after=choose.PRUNE_AFTER, out_of_time=lambda: True, tick=ticks.append)
    assert timers["fast"].steps == choose.MIN_ROUNDS == timers["target"].steps and ticks == [0, 1]


def test_measuring_shows_progress_only_where_asked(target, own_cache, capsys, monkeypatch):
    choose.measure(target, SAMPLE, build_copy, weights=("bfloat16",), progress=True)
    err = capsys.readouterr().err
    assert "choosing the draft copy" in err and "bfloat16: timing" in err and "of the budget left" in err
    choose.measure(target, SAMPLE, build_copy, weights=("bfloat16",), progress=False)
    assert capsys.readouterr().err == ""
    assert not choose.progress_shown(None)  # stderr is not a terminal here
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    monkeypatch.setenv("SPECDEC_QUIET", "1")
    assert not choose.progress_shown(None)


def test_the_key_is_the_models_and_the_machines_not_the_calls(monkeypatch):
    """Issue 47 item 12: ``specdec generate`` measured again under another key: the key counted the
    threads (the CLI sets them from the cores idle at the moment) and the folder the model was read
    from (a GGUF package's on the first load, the weight cache's after)."""
    model = tiny_random("llama", seed=16)[0]
    key = choose.cache_key(model)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert choose.cache_key(model) == key
    finally:
        torch.set_num_threads(threads)
    moved = copy.deepcopy(model)
    moved.config._name_or_path = "/somewhere/else"
    moved.name_or_path = "/somewhere/else"
    assert choose.cache_key(moved) == key
    other = copy.deepcopy(model)
    other.config.rms_norm_eps = 0.25  # another config
    assert choose.cache_key(other) != key
    with torch.no_grad():
        moved.model.layers[-1].mlp.down_proj.weight[-1, -1] += 1.0  # another weight, near the end
    assert choose.cache_key(moved) != key


def test_the_command_line_reads_the_choice_the_api_made(own_cache, monkeypatch, capsys):
    from specdec.cli import main

    monkeypatch.delenv("SPECDEC_QUIET", raising=False)
    model, tokenizer = load_model("tiny-random:llama")  # what `--target tiny-random:llama` loads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the API's process: other threads than the command line's
        choose.choose(model, SAMPLE, build_copy)
    finally:
        torch.set_num_threads(threads)
    assert "choosing the draft copy" in capsys.readouterr().err
    monkeypatch.setattr(choose, "_MEMO", {})
    try:
        code = main(["generate", "--target", "tiny-random:llama", "--draft", "self_draft", "--max-new-tokens", "4",
                     "--threads", "1", "--raw", "hello"])
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert code == 0 and "choosing the draft copy" not in err, err


def test_the_choice_files_candidate_check_covers_every_field_of_a_candidate():
    import dataclasses

    from specdec.copies.choice_file import _CANDIDATE_FIELDS

    assert set(_CANDIDATE_FIELDS) == {f.name for f in dataclasses.fields(choose.Candidate)}
