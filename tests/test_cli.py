"""The command line (``specdec.cli.main``, run in-process) and ``load_model``'s checks and cache.

* every bad argument (generator or model name, ``--option`` key or value, number, data set) is
  refused in well under a second, before any model loads, with a message that says what is
  wrong and, for names, what was probably meant;
* ``generate`` and ``demo`` run end to end on tiny random models; ``demo`` reports its progress
  on stderr per prompt and per method;
* ``load_model`` silences ``transformers``' progress bars without changing the caller's settings,
  and caches a de-quantized packaged model to a checkpoint that loads back identical.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

import specdec.models as models
import specdec.weight_cache as weight_cache
from specdec.cli import main
from specdec.generators import CandidateGenerator
from specdec.models import ModelNotAvailableError, load_model
from specdec.registry import register_candidate_generator, unregister_candidate_generator


def run_cli(argv: list[str], capsys) -> tuple[int, str, str, float]:
    """(exit status, stdout, stderr, seconds) of ``specdec ARGV`` run in this process."""
    start = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    return code, out, err, seconds


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the arguments must be refused first."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"load_model{args} was called before the arguments were checked")

    monkeypatch.setattr(models, "load_model", refuse)


REFUSED = [
    (["generate", "--draft", "prompt_lookpu", "hi"], ["'prompt_lookpu'", "Did you mean 'prompt_lookup'?"]),
    (["generate", "--max-new-tokens", "0", "hi"], ["--max-new-tokens", "must be >= 1"]),
    (["generate", "--max-new-tokens", "many", "hi"], ["--max-new-tokens", "whole number"]),
    (["generate", "--threads", "0", "hi"], ["--threads", "must be >= 1"]),
    (["generate", "--option", "num_token=6", "hi"],
     ["no option 'num_token'", "Did you mean 'num_tokens'?", "num_tokens=4", "max_ngram=4", "schedule='auto'"]),
    (["generate", "--option", "schedule=adaptve", "hi"], ["prompt_lookup", "schedule must be one of"]),
    (["generate", "--option", "min_ngram=3", "--option", "max_ngram=2", "hi"], ["min_ngram <= max_ngram"]),
    (["generate", "--option", "num_tokens", "hi"], ["KEY=VALUE", "'num_tokens'"]),
    (["generate", "--option", "num_tokens=3", "--option", "num_tokens=4", "hi"], ["num_tokens given twice"]),
    (["generate", "--target", "smollm-135m", "hi"], ["--target", "'smollm-135m'", "Did you mean 'smollm2-135m'?"]),
    (["generate", "--target", "tiny-random:lama", "hi"], ["'lama'", "Did you mean 'llama'?"]),
    (["generate", "--target", "./no/such/folder", "hi"], ["no model folder", "./no/such/folder"]),
    (["generate", "--draft", "smollm-135m", "hi"], ["neither a candidate generator nor a model",
                                                    "Did you mean 'smollm2-135m'?"]),
    (["generate", "--draft", "draft_model", "hi"], ["'draft_model' drafts with a model", "--draft smollm2-135m"]),
    (["generate", "--draft", "tiny-random:llama", "--option", "num_tokns=3", "hi"],
     ["no option 'num_tokns'", "Did you mean 'num_tokens'?", "max_tokens=16"]),
    (["generate", "--draft", "tiny-random:llama", "--option", "schedule=sometimes", "hi"], ["schedule must be one of"]),
    (["generate", "--draft", "none", "--option", "num_tokens=3", "hi"], ["takes no options"]),
    (["generate", "--temperature", "0.5", "hi"], ["only with --sample"]),
    (["generate", "--sample", "--temperature", "0", "hi"], ["--temperature", "> 0"]),
    (["generate", "--sample", "--top-p", "1.5", "hi"], ["--top-p", "(0, 1]"]),
    (["generate", "--sample", "--top-k", "0", "hi"], ["--top-k", ">= 1"]),
    (["generate", "--num-return-sequences", "2", "hi"], ["only with --sample"]),
    (["generate", "--sample", "--num-return-sequences", "0", "hi"], ["--num-return-sequences"]),
    (["demo", "--dataset", "/no/such/question.jsonl"], ["/no/such/question.jsonl", "SPECDEC_SPEC_BENCH"]),
    (["demo", "--per-category", "0"], ["--per-category", ">= 1"]),
    (["demo", "--draft", "none"], ["--draft other than 'none'"]),
    (["demo", "--draft", "prompt_lookpu"], ["Did you mean 'prompt_lookup'?"]),
    (["generate", "--device", "gpu", "hi"], ["--device", "expected one of cpu, cuda, cuda:N, auto, got 'gpu'"]),
    (["generate", "--device", "cuda:one", "hi"], ["--device", "got 'cuda:one'"]),
    (["generate", "--dtype", "fp16", "hi"], ["--dtype", "invalid choice: 'fp16'", "'bfloat16'"]),
    (["generate", "--cache-implementation", "paged", "hi"], ["--cache-implementation", "invalid choice: 'paged'"]),
    (["generate", "--compile", "hi"], ["--compile needs --cache-implementation static"]),
    (["demo", "--compile"], ["--compile needs --cache-implementation static"]),
]


@pytest.mark.parametrize("argv,phrases", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_bad_arguments_are_refused_before_any_model_loads(argv, phrases, capsys, no_model_loads):
    code, out, err, seconds = run_cli(argv, capsys)
    assert code == 2, (code, out, err)
    for phrase in phrases:
        assert phrase in err, (phrase, err)
    assert "Traceback" not in err and seconds < 5, seconds


def test_a_plugin_generator_s_options_come_from_its_signature(capsys, no_model_loads):
    @register_candidate_generator("test_cli_options")
    class WithOptions(CandidateGenerator):
        def __init__(self, *, width: int = 3, patience: float = 0.5, mode: str = "a"):
            if mode not in ("a", "b"):
                raise ValueError(f"mode must be 'a' or 'b', got {mode!r}")

    @register_candidate_generator("test_cli_required")
    class Required(CandidateGenerator):
        def __init__(self, *, table):
            self.table = table

    try:
        code, _, err, _ = run_cli(["generate", "--draft", "test_cli_options", "--option", "widht=2", "x"], capsys)
        assert code == 2 and "no option 'widht'" in err and "Did you mean 'width'?" in err
        assert "width=3, patience=0.5, mode='a'" in err
        code, _, err, _ = run_cli(["generate", "--draft", "test_cli_options", "--option", "mode=c", "x"], capsys)
        assert code == 2 and "mode must be 'a' or 'b'" in err
        code, _, err, _ = run_cli(["generate", "--draft", "test_cli_required", "x"], capsys)
        assert code == 2 and "needs the option(s) table" in err
    finally:
        unregister_candidate_generator("test_cli_options")
        unregister_candidate_generator("test_cli_required")


@pytest.mark.parametrize("command", [["generate", "hi"], ["demo"]])
def test_a_missing_cuda_device_is_refused_before_any_model_loads(command, capsys, no_model_loads, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err, _ = run_cli([command[0], "--device", "cuda", *command[1:]], capsys)
    assert code == 2 and "--device: 'cuda' needs a CUDA GPU, but torch.cuda.is_available() is False" in err


def test_load_model_suggests_the_closest_name():
    start = time.perf_counter()
    with pytest.raises(ModelNotAvailableError) as info:
        load_model("smollm-135m")
    assert "Did you mean 'smollm2-135m'?" in str(info.value) and "tiny-random:<arch>" in str(info.value)
    with pytest.raises(ModelNotAvailableError, match="Did you mean 'gemma2'"):
        load_model("tiny-random:gemma")
    with pytest.raises(ModelNotAvailableError) as info:
        load_model("zzzz-qqqq")
    assert "did you mean" not in str(info.value).lower()
    assert time.perf_counter() - start < 5


# -- commands that run ---------------------------------------------------------------------------------
def test_generate_runs_with_a_generator_and_with_a_draft_model(capsys):
    base = ["generate", "--target", "tiny-random:llama", "--max-new-tokens", "8", "--threads", "1", "--raw"]
    code, out, err, _ = run_cli([*base, "--option", "num_tokens=3", "abcabcabc"], capsys)
    assert code == 0 and out.strip() and "tokens/s" in err
    code, out, err, _ = run_cli([*base, "--draft", "tiny-random:llama", "--option", "schedule=fixed", "abcabc"], capsys)
    assert code == 0 and "mean accepted length" in err
    code, out, err, _ = run_cli([*base, "--draft", "none", "--sample", "--temperature", "0.7", "--top-k", "5",
                                 "abc"], capsys)
    assert code == 0, err
    code, out, err, _ = run_cli([*base, "--sample", "--num-return-sequences", "3", "abcabc"], capsys)
    numbers = ["-- 1", "-- 2", "-- 3"]
    assert code == 0 and [line for line in out.splitlines() if line in numbers] == numbers, err


def write_questions(folder) -> str:
    questions = folder / "question.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"{c} {c} {c} again {c}"]}
            for i, c in enumerate(["extraction", "rag", "summarization", "translation", "writing"])]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(questions)


def test_demo_reports_progress_per_prompt_and_method(tmp_path, capsys, monkeypatch):
    import tempfile

    questions = write_questions(tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the demo's temporary results go
    code, out, err, _ = run_cli(["demo", "--target", "tiny-random:llama", "--dataset", str(questions),
                                 "--max-new-tokens", "6", "--threads", "1"], capsys)
    assert code == 0, err
    assert "loading tiny-random:llama" in err
    for i, category in enumerate(["extraction", "rag", "summarization", "translation"], 1):
        assert f"[{i}/4] {category} (question {i - 1}): plain decoding" in err
        assert f"[{i}/4] {category} (question {i - 1}): speculative decoding took" in err
    assert "writing" not in out and "speedup" in out and "outputs identical: True" in out
    assert not list(scratch.iterdir())  # its temporary results directory is removed at the end


# -- progress bars -------------------------------------------------------------------------------------
@pytest.mark.parametrize("enabled", [True, False])
def test_loading_silences_progress_bars_and_restores_the_callers_setting(enabled):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    before = (hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity(), gguf_utils.tqdm)
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        with models._quiet_transformers():
            assert not hf_logging.is_progress_bar_enabled()
            assert hf_logging.get_verbosity() == hf_logging.ERROR
            assert gguf_utils.tqdm(range(3)).disable  # the GGUF de-quantizer's own tqdm
        assert hf_logging.is_progress_bar_enabled() is enabled
        assert (hf_logging.get_verbosity(), gguf_utils.tqdm) == before[1:]
    finally:
        (hf_logging.enable_progress_bar if before[0] else hf_logging.disable_progress_bar)()


# -- the weight cache ----------------------------------------------------------------------------------
def test_weight_cache_location_and_opt_out(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_NO_WEIGHT_CACHE", raising=False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert weight_cache.weight_cache_root() == tmp_path / "weights"
    monkeypatch.delenv("SPECDEC_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert weight_cache.weight_cache_root() == tmp_path / "home" / ".cache" / "specdec" / "weights"
    for value in ("1", "yes", "true"):
        monkeypatch.setenv("SPECDEC_NO_WEIGHT_CACHE", value)
        assert weight_cache.weight_cache_root() is None
    monkeypatch.setenv("SPECDEC_NO_WEIGHT_CACHE", "0")
    assert weight_cache.weight_cache_root() is not None


def test_weight_cache_round_trip_is_checked_and_written_atomically(tmp_path, capsys, monkeypatch):
    """On a tiny model (the mechanics; the real GGUF model is the real_model test below)."""
    model, tokenizer = load_model("tiny-random:llama")
    cache = tmp_path / "weights" / "tiny-abc"
    weight_cache.write_weight_cache("tiny", model, tokenizer, cache, torch.float32, load=models._load_folder)
    assert (cache / weight_cache.CACHE_MARKER).is_file() and "cached the de-quantized tiny" in capsys.readouterr().err
    assert sorted(p.name for p in cache.parent.iterdir()) == ["tiny-abc"]  # no temporary folder left
    loaded, loaded_tok = models._load_folder(cache, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert loaded_tok.get_vocab() == tokenizer.get_vocab()

    other = tmp_path / "weights" / "tiny-def"
    monkeypatch.setattr(weight_cache, "_round_trip_problem", lambda *a: "parameter lm_head.weight")
    with pytest.warns(UserWarning, match="not caching tiny's weights.*lm_head"):
        weight_cache.write_weight_cache("tiny", model, tokenizer, other, torch.float32, load=models._load_folder)
    assert sorted(p.name for p in other.parent.iterdir()) == ["tiny-abc"]  # nothing half-written

    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.warns(UserWarning, match="could not cache"):
        weight_cache.write_weight_cache("tiny", model, tokenizer, blocked / "weights" / "x", torch.float32,
                                        load=models._load_folder)


@pytest.mark.real_model
def test_cached_smollm2_loads_identical_to_the_gguf(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDEC_NO_WEIGHT_CACHE", raising=False)
    cache = models.weight_cache_path("smollm2-135m")
    assert cache.parent == tmp_path / "weights" and not cache.exists()
    import gguf

    from specdec.gguf_read import FastReader

    parsed, reader, build = [], gguf.GGUFReader, FastReader.__init__
    monkeypatch.setattr(FastReader, "__init__", lambda self, path, *a: parsed.append(path) or build(self, path, *a))
    fresh, fresh_tok = load_model("smollm2-135m")  # from the GGUF file, writing the cache
    assert len(parsed) == 1 and gguf.GGUFReader is reader  # parsed once (not once per part), then restored
    err = capfd.readouterr().err
    assert f"cached the de-quantized smollm2-135m weights in {cache}" in err and "SPECDEC_NO_WEIGHT_CACHE" in err
    assert "Converting" not in err and "Loading weights" not in err  # no progress bars
    assert (cache / weight_cache.CACHE_MARKER).is_file()

    start = time.perf_counter()
    cached, cached_tok = load_model("smollm2-135m")
    seconds = time.perf_counter() - start
    assert cached.name_or_path == str(cache) and capfd.readouterr().err == ""
    print(f"\nsmollm2-135m from the weight cache: {seconds:.1f}s")

    fresh_sd, cached_sd = fresh.state_dict(), cached.state_dict()
    assert list(fresh_sd) == list(cached_sd)
    for key in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                "model.layers.29.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"):
        assert cached_sd[key].dtype == torch.float32 and torch.equal(fresh_sd[key], cached_sd[key]), key
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()  # still tied
    ignore = {"_name_or_path", "quantization_config"}
    assert ({k: v for k, v in fresh.config.to_dict().items() if k not in ignore}
            == {k: v for k, v in cached.config.to_dict().items() if k not in ignore})
    assert fresh.generation_config.to_dict() == cached.generation_config.to_dict()

    assert type(fresh_tok) is type(cached_tok) and fresh_tok.get_vocab() == cached_tok.get_vocab()
    assert fresh_tok.chat_template == cached_tok.chat_template
    assert (fresh_tok.eos_token_id, fresh_tok.pad_token_id, fresh_tok.bos_token_id) == \
        (cached_tok.eos_token_id, cached_tok.pad_token_id, cached_tok.bos_token_id)
    messages = [{"role": "user", "content": "Summarize: the quick brown fox jumps over the lazy dog. 日本語 🤖"}]
    ids = fresh_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids2 = cached_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert torch.equal(ids["input_ids"], ids2["input_ids"])
    with torch.no_grad():
        assert torch.equal(fresh(ids["input_ids"]).logits, cached(ids2["input_ids"]).logits)

    monkeypatch.setenv("SPECDEC_NO_WEIGHT_CACHE", "1")  # opted out: the GGUF again, nothing written
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "unused"))
    assert models.weight_cache_path("smollm2-135m") is None


# -- devices, dtypes, static caches, compilation ------------------------------------------------------------
@pytest.fixture
def quick_compile(monkeypatch):
    """``--compile`` compiles with aot_eager (seconds) instead of inductor (minutes on a CPU); the
    SpecDecoder warm-ups are recorded as (batch size, max length)."""
    import specdec.bench.methods as bench_methods
    import specdec.kv as kv
    from specdec.decoder import SpecDecoder

    real_forward, real_kwargs, real_warmup = kv.compiled_forward, bench_methods.hf_cache_kwargs, SpecDecoder.warmup
    calls = []
    monkeypatch.setattr(kv, "compiled_forward", lambda model, options, owned=False: real_forward(
        model, {"backend": "aot_eager", **options}, owned))
    monkeypatch.setattr(bench_methods, "hf_cache_kwargs", lambda implementation="dynamic", compile=False: real_kwargs(
        implementation, {"backend": "aot_eager"} if compile is True else compile))

    def watched(self, batch_size=1, max_length=1024):
        calls.append((batch_size, max_length))
        return real_warmup(self, batch_size, max_length)

    monkeypatch.setattr(SpecDecoder, "warmup", watched)
    return calls


def test_generate_with_a_static_cache_in_bfloat16(capsys):
    code, out, err, _ = run_cli(["generate", "--target", "tiny-random:llama", "--max-new-tokens", "8", "--threads", "1",
                                 "--raw", "--dtype", "bfloat16", "--cache-implementation", "static", "abcabcabc"], capsys)
    assert code == 0 and out.strip() and "tokens/s" in err and "compiled" not in err


def test_generate_compiles_before_timing(capsys, quick_compile):
    code, out, err, _ = run_cli(["generate", "--target", "tiny-random:llama", "--max-new-tokens", "8", "--threads", "1",
                                 "--raw", "--cache-implementation", "static", "--compile", "--option", "num_tokens=3",
                                 "abcabcabc"], capsys)
    assert code == 0, err
    assert quick_compile == [(1, 9 + 8)]  # the byte-level prompt's 9 tokens + 8 new ones
    lines = err.splitlines()
    compiled = next(i for i, line in enumerate(lines) if line.startswith("compiled in ") and "not counted" in line)
    assert compiled < next(i for i, line in enumerate(lines) if "tokens/s" in line)


def test_demo_with_a_compiled_static_cache_stays_identical(tmp_path, capsys, quick_compile):
    code, out, err, _ = run_cli(["demo", "--target", "tiny-random:llama", "--dataset", write_questions(tmp_path),
                                 "--categories", "extraction,rag", "--max-new-tokens", "6", "--threads", "1",
                                 "--cache-implementation", "static", "--compile", "--out", str(tmp_path / "out")],
                                capsys)
    assert code == 0, err
    longest = max(len(f"{c} {c} {c} again {c}") for c in ("extraction", "rag"))  # byte tokens, before the template
    assert len(quick_compile) == 1 and quick_compile[0][0] == 1 and quick_compile[0][1] >= longest + 6
    assert "compiled in " in err and err.index("compiled in ") < err.index("[1/2] extraction")
    assert "outputs identical: True" in out
    kept = tmp_path / "out"  # --out keeps the results, the config the flags made and the full report
    assert (kept / "report.md").is_file() and (kept / "demo.yaml").is_file()
    assert len((kept / "results.jsonl").read_text().splitlines()) == 2 * 2  # 2 prompts x (plain, speculative)


def test_generate_is_greedy_without_sample_whatever_the_models_config_says(tmp_path, capsys):
    """A model whose generation_config samples: without --sample the command sampled anyway, unseeded
    (three runs, three texts), where --help says --sample chooses sampling."""
    from specdec import load_model

    model, tokenizer = load_model("tiny-random:llama")
    model.generation_config.do_sample, model.generation_config.temperature = True, 1.5
    model.save_pretrained(tmp_path), tokenizer.save_pretrained(tmp_path)
    ids = tokenizer("hello hello hello", return_tensors="pt").input_ids
    want = tokenizer.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:],
                            skip_special_tokens=True)
    for _ in range(2):
        code, out, err, _ = run_cli(["generate", "--target", str(tmp_path), "--max-new-tokens", "12", "--threads", "1",
                                     "--raw", "hello hello hello"], capsys)
        assert code == 0, err
        assert out == want + "\n"


def test_option_values_are_read_as_numbers_booleans_or_text():
    """true/false were kept as text, which every boolean option (tree, lookup) refuses."""
    from specdec.cli_args import parse_options

    assert parse_options(["tree=true", "lookup=False", "num_tokens=4", "min_prob=0.5", "weights=int4"]) == \
        {"tree": True, "lookup": False, "num_tokens": 4, "min_prob": 0.5, "weights": "int4"}
