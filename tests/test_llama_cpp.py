"""The llama_cpp engine: specdec's output equals llama.cpp's own plain decoding of the same file.

The reference is what a user of llama-cpp-python runs: ``Llama.generate`` at temperature 0, one
token per forward. The tiny models are written to GGUF by ``export_gguf``; the real SmolLM2 file is
its packaged GGUF re-written as F32 by llama.cpp's quantizer (``real_model``)."""

from __future__ import annotations

import builtins

import pytest
import torch

from specdec import SpecDecoder, load_model
from specdec.bench import ConfigError
from specdec.bench.config import BenchConfig
from specdec.engines import LLAMA_CPP_INSTALL, attach_gguf, export_gguf
from specdec.engines import llama_cpp_library as library

REPEAT = b"the cat sat on the mat. the cat sat on the mat. the dog sat on the "


def peer(path: str, ids: list[int], new_tokens: int, eos: int | None) -> list[int]:
    """llama-cpp-python's plain greedy decoding of ``ids`` (F32 keys and values, as the engine keeps them)."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=len(ids) + new_tokens + 64, n_threads=1, type_k=0, type_v=0, verbose=False)
    out = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if token == eos or len(out) >= new_tokens:
            break
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(tiny llama with its exported GGUF attached, tokenizer, the file's path)."""
    model, tokenizer = load_model("tiny-random:llama")
    path = export_gguf(model, str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"))
    return attach_gguf(model, path), tokenizer, path


def _ids(text: bytes) -> torch.Tensor:
    return torch.tensor([list(text)])


def test_an_exported_file_decodes_as_the_model_does(tiny):
    model, tokenizer, path = tiny
    ids = _ids(REPEAT)
    want = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert peer(path, ids[0].tolist(), 24, tokenizer.eos_token_id) == want[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("draft", ["prompt_lookup", "suffix"])
def test_speculation_on_llama_cpp_equals_its_plain_decoding(tiny, draft):
    model, tokenizer, path = tiny
    decoder = SpecDecoder(model, draft, tokenizer=tokenizer, engine="llama_cpp")
    accepted = 0
    for text in (REPEAT, b"abcabcabcabcab", b"one two one two one two one"):
        ids = _ids(text)
        out = decoder.generate(ids, max_new_tokens=32, do_sample=False)
        assert out.sequences[0, ids.shape[1]:].tolist() == peer(path, ids[0].tolist(), 32, tokenizer.eos_token_id)
        accepted += out.stats.accepted_tokens
    assert accepted > 0  # drafts were verified several at a time, not only one token per forward
    assert out.stats.choices["engine"].startswith("target: llama_cpp: tiny-llama.gguf")


def test_left_padded_batches_equal_each_row_alone(tiny):
    model, tokenizer, path = tiny
    texts = [REPEAT, b"abcabcabcabc", b"xyz xyz xyz xyz xyz"]
    batch = tokenizer([t.decode() for t in texts], return_tensors="pt", padding=True, padding_side="left")
    out = SpecDecoder(model, "prompt_lookup", tokenizer=tokenizer, engine="llama_cpp").generate(
        batch["input_ids"], batch["attention_mask"], max_new_tokens=20, do_sample=False)
    width = batch["input_ids"].shape[1]
    for row, text in enumerate(texts):
        want = peer(path, list(text), 20, tokenizer.eos_token_id)
        got = out.sequences[row, width:width + len(want)].tolist()
        assert got == want, row


def test_a_context_is_reused_by_the_next_call(tiny):
    model, tokenizer, path = tiny
    decoder = SpecDecoder(model, "prompt_lookup", tokenizer=tokenizer, engine="llama_cpp")
    ids = _ids(REPEAT)
    first = decoder.generate(ids, max_new_tokens=16, do_sample=False).sequences
    made = []
    original = library.Context.__init__

    def counting(self, *args, **kwargs):
        made.append(args)
        original(self, *args, **kwargs)

    library.Context.__init__ = counting
    try:
        second = decoder.generate(ids, max_new_tokens=16, do_sample=False).sequences
    finally:
        library.Context.__init__ = original
    assert torch.equal(first, second)
    assert made == []  # an idle context, cleared, served the second call


def test_trees_are_verified_as_chains(tiny):
    model, tokenizer, path = tiny
    ids = _ids(REPEAT)
    out = SpecDecoder(model, "prompt_lookup", tokenizer=tokenizer, engine="llama_cpp", tree=True).generate(
        ids, max_new_tokens=24, do_sample=False)
    assert out.sequences[0, ids.shape[1]:].tolist() == peer(path, ids[0].tolist(), 24, tokenizer.eos_token_id)
    assert "llama_cpp" in str(out.stats.choices.get("trees", ""))


def test_a_build_that_is_not_batch_invariant_is_refused(tiny, monkeypatch):
    model, tokenizer, path = tiny
    original = library.Context.decode

    def perturbed(self, tokens, *args, **kwargs):  # what llamafile's kernels do: wide forwards sum differently
        out = original(self, tokens, *args, **kwargs)
        return out + 1e-6 if len(tokens) > 1 else out

    monkeypatch.setattr(library.Context, "decode", perturbed)
    monkeypatch.setattr(library, "_invariant", {})
    with pytest.raises(RuntimeError, match="not batch-invariant.*GGML_LLAMAFILE=OFF"):
        SpecDecoder(model, "prompt_lookup", tokenizer=tokenizer, engine="llama_cpp").generate(
            _ids(REPEAT), max_new_tokens=4, do_sample=False)


def test_what_the_engine_refuses_is_said_before_any_forward(tiny):
    model, tokenizer, path = tiny
    bare, _ = load_model("tiny-random:llama")
    with pytest.raises(ValueError, match="attach_gguf"):
        SpecDecoder(bare, "prompt_lookup", engine="llama_cpp")
    with pytest.raises(ValueError, match="neither cache_implementation='static' nor compile"):
        SpecDecoder(model, "prompt_lookup", engine="llama_cpp", cache_implementation="static")
    from specdec.generators import DraftingInfo, NoDraft

    class ReadsHidden(NoDraft):  # what eagle3 and mtp declare
        name = "reads_hidden"

        def drafting(self):
            return DraftingInfo(max_drafts=None, hidden_layers=(1,))

    with pytest.raises(ValueError, match="reads the target's hidden states, which engine='llama_cpp' does not return"):
        SpecDecoder(model, ReadsHidden(), engine="llama_cpp").generate(_ids(REPEAT), max_new_tokens=2)
    with pytest.raises(ValueError, match="prefill.. keeps a transformers cache, which engine='llama_cpp' cannot"):
        SpecDecoder(model, "prompt_lookup", engine="llama_cpp").prefill(_ids(REPEAT))
    with pytest.raises(ValueError, match="export_gguf writes plain Llama-architecture models"):
        export_gguf(load_model("tiny-random:gpt2")[0], "/nonexistent/never-written.gguf")
    with pytest.raises(ValueError, match="sliding_window=8"):  # a window the file could not hold was dropped
        export_gguf(load_model("tiny-random:mistral")[0], "/nonexistent/never-written.gguf")


def test_without_llama_cpp_python_the_error_says_how_to_install_it(tiny, monkeypatch):
    real_import = builtins.__import__

    def no_llama_cpp(name, *args, **kwargs):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama_cpp)
    with pytest.raises(ImportError) as caught:
        library.bindings()
    assert "GGML_LLAMAFILE=OFF" in str(caught.value) and LLAMA_CPP_INSTALL in str(caught.value)


def test_self_draft_drafts_with_its_torch_copy_for_a_llama_cpp_target(tiny):
    """The copy is the target's weights rounded, run by torch; it keeps its own cache (llama.cpp
    holds the target's keys and values, so there is nothing to mirror) and never inherits the
    target's GGUF file (it would then draft with the target's own F32 weights)."""
    model, tokenizer, path = tiny
    decoder = SpecDecoder(model, "self_draft", tokenizer=tokenizer, engine="llama_cpp", weights="bfloat16",
                          lookup=False, schedule="fixed", num_tokens=3, compile_draft=False)
    accepted = 0
    for text in (REPEAT, b"one two one two one two one"):
        ids = _ids(text)
        out = decoder.generate(ids, max_new_tokens=24, do_sample=False)
        assert out.sequences[0, ids.shape[1]:].tolist() == peer(path, ids[0].tolist(), 24, tokenizer.eos_token_id)
        accepted += out.stats.accepted_tokens
    assert accepted > 0
    assert "| assistant 0: cpu" in out.stats.choices["engine"]


@pytest.mark.parametrize("weights", ["Q8_0", "Q4_1"])
def test_quantized_files_decode_in_the_engine_and_the_peer(tiny, weights):
    """Where llama.cpp's build and the CPU have AMX (a Xeon since Sapphire Rapids), quantized weights
    loaded with its defaults go to AMX buffers, and the first decode from them crashed the process.
    The engine (a quantized twin drafting) and the bench's peer load them without those buffers."""
    from specdec.bench.config import LlamaCppOptions
    from specdec.bench.peer import llama_cpp_runner
    from specdec.engines import gguf_twin

    model, tokenizer, path = tiny
    assert library.model_params().use_extra_bufts == (not library.has_amx())
    ids = _ids(REPEAT)
    out = SpecDecoder(model, gguf_twin(model, weights), tokenizer=tokenizer, engine="llama_cpp").generate(
        ids, max_new_tokens=16, do_sample=False)
    assert out.sequences[0, ids.shape[1]:].tolist() == peer(path, ids[0].tolist(), 16, tokenizer.eos_token_id)
    run = llama_cpp_runner(LlamaCppOptions(weights=weights), model, model.generation_config)
    new, _ = run(ids, seed=0, max_new_tokens=16)
    assert len(new) == 16 and all(0 <= t < model.config.vocab_size for t in new)


def test_the_bench_method_is_greedy_only():
    base = {"target": "tiny-random:llama", "methods": [{"generator": "baseline"},
                                                      {"name": "peer", "generator": "llama_cpp",
                                                       "options": {"weights": "Q4_1", "lookup": 10}}]}
    config = BenchConfig.model_validate(base)
    assert config.methods[1].kind.reference and not config.methods[1].kind.batched
    with pytest.raises(ValueError, match="decodes greedily"):
        BenchConfig.model_validate({**base, "generation": {"do_sample": True}})
    with pytest.raises(ValueError, match="weights"):
        BenchConfig.model_validate({**base, "methods": [{"generator": "baseline"},
                                                        {"generator": "llama_cpp", "options": {"weights": "Q5"}}]})
    assert issubclass(ConfigError, ValueError)


def test_sampling_on_llama_cpp_is_the_target_distribution(tmp_path):
    """2,000 rows of 2 new tokens over an 8-token vocabulary, the second drafted by prompt lookup and
    accepted or resampled against llama.cpp's logits: distributed as the target's."""
    from helpers import chi_square_pooled
    from test_sampling_lossless import ALPHA, PROMPT, TINY_VOCAB, exact_three_token_joint, joint_counts, tiny_vocab_llama

    from specdec.sampling import SamplingParams

    target = tiny_vocab_llama(0)
    attach_gguf(target, export_gguf(target, str(tmp_path / "vocab8.gguf")))
    params = SamplingParams(True, 0.8, top_k=6)
    decoder = SpecDecoder(target, "prompt_lookup", engine="llama_cpp")
    pairs, accepted, drafted = [], 0, 0
    for i in range(8):  # 250 rows a call: llama.cpp holds at most 256 sequences
        out = decoder.generate(PROMPT.repeat(250, 1), max_new_tokens=2, do_sample=True, temperature=0.8, top_k=6,
                               generator=torch.Generator().manual_seed(i))
        pairs.append(out.sequences[:, PROMPT.shape[1]:PROMPT.shape[1] + 2])
        accepted, drafted = accepted + out.stats.accepted_tokens, drafted + out.stats.drafted_tokens
    assert 0 < accepted < drafted  # drafts were both accepted and rejected
    expected = exact_three_token_joint(target, PROMPT, params).sum(-1)  # [V, V] the first two tokens
    p_value, _ = chi_square_pooled(joint_counts(torch.cat(pairs), TINY_VOCAB), expected)
    assert p_value > ALPHA, f"chi-square p = {p_value:.2e}"
    with pytest.raises(ValueError, match="at most 256 rows"):
        decoder.generate(PROMPT.repeat(257, 1), max_new_tokens=2, do_sample=False)


@pytest.mark.real_model
def test_smollm2_on_llama_cpp_equals_llama_cpp_plain(smollm2, smollm2_prompts):
    from specdec.engines import gguf_for

    model, tokenizer = smollm2
    ids = smollm2_prompts[0]
    out = SpecDecoder(model, "prompt_lookup", tokenizer=tokenizer, engine="llama_cpp").generate(
        ids, max_new_tokens=32, do_sample=False)
    assert out.sequences[0, ids.shape[1]:].tolist() == peer(gguf_for(model), ids[0].tolist(), 32,
                                                           model.generation_config.eos_token_id)
