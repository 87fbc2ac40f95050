"""A target sharded by transformers' tensor and pipeline parallelism, decoded by ``torchrun --nproc-per-node 2``.

Tiny models are saved to a temporary folder; this file, run by ``torchrun`` (the ``__main__``
part below), loads the target with ``DistributedConfig(tp_size=2)`` or ``(pp_size=2)`` on two
CPU processes (gloo) and runs every case in one launch (pipeline parallelism first: the tensor
cases end by aborting the process groups), each rank writing what it saw to a JSON file per
kind; the tests compare that with single-process references computed here.

* greedy output equals the single-process ``model.generate()``: prompt lookup and a draft model
  (on one rank, and replicated), batch 1 and a left-padded batch, the static cache (tensor
  parallelism; refused with a clear error under pipeline parallelism), and
  ``model.generate(custom_generate=specdec.generate)`` on the sharded model;
* a grammar (a regular expression, xgrammar) on the sharded target equals the single-process
  ``model.generate()`` with xgrammar's processor, on a left-padded batch;
* every rank returns the same tokens, statistics (the decider's), a streamer is fed on one rank
  only, stop strings and a user stopping criterion that reads a rank-dependent "clock" cut every
  rank's output where the decider's cut it;
* seeded sampling gives the same tokens on every rank, and (20,000 rows of a tiny 8-token model,
  prompt lookup and a draft model) the joint distribution of three generated tokens passes the
  chi-square test against the target's exact distribution (tests/test_sampling_lossless.py);
* ranks stay in step whatever fails where (issue 47): a check that fails on one rank only (an id
  outside the vocabulary in one rank's prompt, through both entry points and ``prefill``), a
  logits processor raising on one rank (greedy, and the decider's under sampling), a streamer
  raising: every rank raises one clear error, and the next call pairs with the other rank's same
  call (a greedy call with ``repetition_penalty=5.0`` equals the single-process output); calls
  that differ between ranks (their logits processors, stopping criteria, generator seeds,
  prompts, generators' drafting) are refused on every rank with an error naming what differs, and a generator reused
  across sampled calls stays in step;
* a failure reaches every rank as one clear error, quickly: the decider's drafter failing (every
  rank raises, and the next call works: the process group survives), then a failure on the other
  rank inside the target's forward (both raise within seconds; the groups are aborted, and a
  later call raises a clear error on every rank instead of entering a collective).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

# one torchrun launch (about 20 s, two processes): balanced into the second process of a split session (tests/conftest.py)
pytestmark = pytest.mark.split_second

TIMEOUT = 300  # seconds a launch may take before the test fails (a hang fails, it does not block the suite)
ROWS = 20_000
PROMPT = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
PADDED = [[257, 257, 5, 9, 7, 8, 5, 9, 7, 8], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]  # 257: <pad>
TINY_PROMPT = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]]
NEW = 24
AGREE_NEW = 8  # new tokens of the agreement cases' calls (greedy: the first of the NEW-token references)
OUTSIDE = 10**6  # an id outside the tiny target's vocabulary
SAMPLING = {"pl": dict(temperature=0.8, top_k=6), "dm": dict(temperature=1.2, top_p=0.9)}
GRAMMAR_REGEX = r"[a-z]{2,5}( [a-z]{2,5}){1,6}\."  # a grammar= case: words, then a full stop


# -- the models, saved -----------------------------------------------------------------------------
def _save_models(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.tiny import tiny_random

    target, tokenizer = tiny_random("llama", num_hidden_layers=4)
    draft, _ = tiny_random("llama", seed=1, num_hidden_layers=1)
    target.save_pretrained(folder / "target"), tokenizer.save_pretrained(folder / "target")
    draft.save_pretrained(folder / "draft")
    tiny_random("mistral", num_hidden_layers=4, sliding_window=4)[0].save_pretrained(folder / "sliding")
    config = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        small = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            small.lm_head.weight.mul_(6.0)  # uneven distributions
            guess = LlamaForCausalLM(config).eval()
            guess.load_state_dict(small.state_dict())
            for p in guess.parameters():
                p.add_(torch.randn(p.shape) * 0.3 * p.std())
    for model, name in ((small, "small"), (guess, "small_draft")):
        model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
        model.generation_config.pad_token_id = 0
        model.save_pretrained(folder / name)


def _exact_joint(model, prompt: torch.Tensor, params) -> torch.Tensor:
    """[V, V, V] probability of the first three generated tokens of ``prompt [1, P]``."""
    v = model.config.vocab_size
    with torch.no_grad():
        p1 = params.probs(model(prompt).logits[0, -1])
        one = torch.cat([prompt.repeat(v, 1), torch.arange(v)[:, None]], 1)
        p2 = params.probs(model(one).logits[:, -1])
        pairs = torch.cartesian_prod(torch.arange(v), torch.arange(v))
        p3 = params.probs(model(torch.cat([prompt.repeat(v * v, 1), pairs], 1)).logits[:, -1]).view(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("distributed")
    _save_models(folder)
    return folder


@pytest.fixture(scope="module")
def references(saved) -> dict:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(saved / "target", dtype=torch.float32)
    out = {}
    for name, rows in (("one", PROMPT), ("padded", PADDED)):
        ids = torch.tensor(rows)
        mask = (ids != 257).long()
        new = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=257)
        out[name] = new[:, ids.shape[1]:].tolist()
    ids = torch.tensor(PROMPT)
    new = target.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=257,
                          repetition_penalty=5.0)
    out["penalized"] = new[:, ids.shape[1]:].tolist()
    sliding = AutoModelForCausalLM.from_pretrained(saved / "sliding", dtype=torch.float32)
    out["sliding"] = sliding.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None)[:, ids.shape[1]:].tolist()
    import xgrammar
    from transformers import AutoTokenizer

    from specdec.grammar import Grammar, compile_grammar

    ids = torch.tensor(PADDED)
    compiled = compile_grammar(Grammar.regex(GRAMMAR_REGEX), AutoTokenizer.from_pretrained(saved / "target"), target.config.vocab_size, [])
    new = target.generate(ids, attention_mask=(ids != 257).long(), max_new_tokens=NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=257,
                          logits_processor=[xgrammar.contrib.hf.LogitsProcessor(compiled)])
    out["grammar"] = new[:, ids.shape[1]:].tolist()
    return out


KINDS = ("pipeline", "tensor")  # in launch order


@pytest.fixture(scope="module")
def launched(saved, tmp_path_factory) -> dict[str, list[dict]]:
    """Run this file under torchrun (2 processes); each kind's two ranks' results."""
    out = tmp_path_factory.mktemp("launch_out")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, str(saved), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return {kind: [json.loads((out / f"{kind}_rank{r}.json").read_text()) for r in range(2)] for kind in KINDS}


@pytest.fixture(scope="module")
def tensor(launched) -> list[dict]:
    return launched["tensor"]


@pytest.fixture(scope="module")
def pipeline(launched) -> list[dict]:
    return launched["pipeline"]


# -- the tests -------------------------------------------------------------------------------------
GREEDY = {"pl_one": "one", "pl_padded": "padded", "dm_one": "one", "dm_padded": "padded",
          "dm_replicated": "padded", "pl_static": "padded", "custom_generate": "padded"}


@pytest.mark.parametrize("case", list(GREEDY))
def test_tensor_parallel_greedy_equals_single_process_generate(tensor, references, case):
    for rank in tensor:
        assert rank[case] == references[GREEDY[case]], f"rank {rank['rank']}"


PIPELINE = {"pl_one": "one", "pl_padded": "padded", "dm_padded": "padded", "pl_sliding": "sliding", "pl_warmed": "one"}


@pytest.mark.parametrize("case", list(PIPELINE))
def test_pipeline_parallel_greedy_equals_single_process_generate(pipeline, references, case):
    """``pl_sliding``: a sliding-window target, whose mask transformers sizes from cache layer 0,
    which the second stage does not hold (it raised); ``pl_warmed``: after ``warmup()``, which
    read the embeddings the second stage does not hold (it raised there alone, the first stage
    waiting in the pipeline's forward)."""
    for rank in pipeline:
        assert rank[case] == references[PIPELINE[case]], f"rank {rank['rank']}"


def test_self_draft_and_generators_reading_hidden_states_are_refused_on_a_sharded_target(pipeline):
    for rank in pipeline:
        assert "self_draft copies the target's weights, which are sharded across ranks" in rank["self_draft_refused"]
        assert "candidate generator 'eagle3' reads the target's hidden states" in rank["eagle3_refused"]


def test_pipeline_parallel_refuses_the_static_cache(pipeline):
    for rank in pipeline:
        assert "static" in rank["static_refused"] and "pipeline" in rank["static_refused"]


def test_every_rank_returns_the_deciders_statistics_and_one_streamer_is_fed(tensor):
    first, second = tensor
    assert first["stats"] == second["stats"]
    assert first["stats"]["committed_tokens"] == NEW
    coordination = first["stats"]["coordination"]
    # greedy prompt lookup: one message a step (the drafts), and one at the start
    assert coordination["messages"] == coordination["steps"] + 1
    assert 0 < coordination["bytes"] / coordination["messages"] < 200
    assert first["streamed"] == first["pl_one"][0] and second["streamed"] == []
    assert first["streamed_end"] == ["end"] and second["streamed_end"] == []  # the decider's alone, ended
    # through custom_generate, the other rank's streamer (given the prompt by generate()) is ended too,
    # so that a reader of it finishes (it waited for ever)
    prompt = PROMPT[0]
    assert second["door_streamed"] == [prompt, "end"]
    assert first["door_streamed"][0] == prompt and len(first["door_streamed"]) > 2 and first["door_streamed"][-1] == "end"


def test_stop_strings_and_user_criteria_cut_every_rank_where_the_decider_did(tensor, references):
    for rank in tensor:
        assert rank["stop_string"] == references["one"][0][: rank["stop_at"]]
        # the criterion stops at 5 new tokens on the decider and at 9 on the other rank: the decider's holds
        assert rank["clock"] == references["one"][0][:5]


def test_a_grammar_on_a_sharded_target_equals_single_process_generate_with_xgrammar(tensor, references):
    assert references["grammar"] != references["padded"]  # the grammar changed the output
    for rank in tensor:
        assert rank["grammar"] == references["grammar"]


def test_seeded_sampling_gives_every_rank_the_same_tokens(tensor, pipeline):
    for launch in (tensor, pipeline):
        assert launch[0]["sampled"] == launch[1]["sampled"]
        assert len(launch[0]["sampled"]) == 4 and launch[0]["sampled"][0] != launch[0]["sampled"][1]


@pytest.mark.parametrize("drafter", ["pl", "dm"])
def test_sampling_under_tensor_parallelism_is_lossless(tensor, saved, drafter):
    from transformers import AutoModelForCausalLM

    from helpers import chi_square_pooled
    from specdec.sampling import SamplingParams

    small = AutoModelForCausalLM.from_pretrained(saved / "small", dtype=torch.float32)
    expected = _exact_joint(small, torch.tensor(TINY_PROMPT), SamplingParams(True, **SAMPLING[drafter]))
    counts = torch.tensor(tensor[0][f"joint_{drafter}"], dtype=torch.float64)
    assert counts.sum() == ROWS and tensor[0][f"joint_{drafter}"] == tensor[1][f"joint_{drafter}"]
    assert 0 < tensor[0][f"accepted_{drafter}"] < tensor[0][f"drafted_{drafter}"]  # speculation happened
    p_value, tv = chi_square_pooled(counts, expected)
    assert p_value > 1e-3 and tv < 0.05, (p_value, tv)


def test_a_failing_decider_fails_every_rank_and_the_next_call_works(tensor, references):
    decider, other = tensor
    assert decider["decider_failure"] == "ValueError: boom at step 3"
    assert other["decider_failure"].startswith("RankFailedError: rank 0 failed during generate(): ValueError: boom")
    for rank in tensor:
        assert rank["decider_failure_seconds"] < 30
        assert rank["after_failure"] == references["one"]


def test_a_rank_failing_inside_the_forward_fails_every_rank_within_seconds(tensor):
    decider, other = tensor
    assert other["forward_failure"] == "RuntimeError: rank 1 broke in its forward"
    assert decider["forward_failure"].startswith("RankFailedError: rank 1 failed during generate(): RuntimeError")
    for rank in tensor:
        assert rank["forward_failure_seconds"] < 30


VOCAB_ERROR = "ValueError: input_ids hold ids outside the target's vocabulary"


@pytest.mark.parametrize("case", ["vocab_one_rank", "vocab_custom", "vocab_prefill"])
def test_a_check_failing_on_one_rank_fails_every_rank_with_its_error(tensor, case):
    """rank 1's prompt holds an id outside the vocabulary, rank 0's does not (SpecDecoder.generate
    under sampling, model.generate(custom_generate=...), prefill): both ranks raise, rank 0 naming
    rank 1's error, instead of rank 0's call returning while rank 1's raised."""
    decider, other = tensor
    assert other[case].startswith(VOCAB_ERROR), other[case]
    assert decider[case].startswith(f"RankFailedError: rank 1 failed during generate(): {VOCAB_ERROR}"), decider[case]


@pytest.mark.parametrize("case, reference", [("after_vocab", "penalized"), ("after_vocab_custom", "one"),
                                             ("after_vocab_prefill", "one"), ("after_failures", "one"),
                                             ("after_timeout", "one")])
def test_after_a_failure_each_call_pairs_with_the_other_ranks_same_call(tensor, references, case, reference):
    """The call after a one-rank failure (``after_vocab``: greedy with repetition_penalty=5.0, after a
    sampled call without it) gives the single-process output on both ranks: the ranks stayed in step."""
    assert references["penalized"] != references["one"]  # the penalty changes the output
    for rank in tensor:
        assert rank[case] == [references[reference][0][:AGREE_NEW]], f"rank {rank['rank']}: {rank[case]}"


@pytest.mark.parametrize("case, part", [("differ_penalty", "logits processors"),
                                        ("differ_processor", "logits processors"),
                                        ("differ_criteria", "stopping criteria"), ("differ_seed", "generator state"),
                                        ("differ_prompt", "prompt"),
                                        ("differ_drafting", "drafting declarations")])
def test_calls_that_differ_between_ranks_are_refused_naming_what_differs(tensor, case, part):
    for rank in tensor:
        assert rank[case].startswith("RanksDivergedError: the ranks were given different calls"), rank[case]
        assert f"their {part} differ" in rank[case], rank[case]


def test_decoders_given_another_timeout_on_each_rank_are_refused_on_every_rank(tensor):
    for rank in tensor:
        assert rank["differ_timeout"].startswith("RanksDivergedError: the ranks were given different "
                                                 "DistributedOptions.timeout ([60.0, 61.0], by rank)"), rank


def test_a_generator_reused_across_sampled_calls_stays_in_step(tensor):
    decider, other = tensor
    for case in ("same_generator_1", "same_generator_2"):
        assert isinstance(decider[case], list) and decider[case] == other[case], (decider[case], other[case])
    assert decider["same_generator_1"] != decider["same_generator_2"]  # the generator went on drawing
    assert decider["generator_state"] == other["generator_state"]


@pytest.mark.parametrize("case, failed, text", [
    ("processor_failure", 1, "RuntimeError: processor broke on rank 1"),
    ("decider_processor_failure", 0, "RuntimeError: processor broke on rank 0"),
    ("streamer_failure", 0, "RuntimeError: streamer broke")])
def test_user_code_failing_mid_call_on_one_rank_fails_every_rank_and_keeps_the_groups(tensor, case, failed, text):
    """A logits processor or the streamer raising between messages on one rank: that rank raises its
    error, the other names it, and the process groups stay usable (``after_failures`` decodes)."""
    for rank in tensor:
        named = f"RankFailedError: rank {failed} failed during generate(): {text}"
        assert rank[case] == (text if rank["rank"] == failed else named), rank[case]


def test_after_the_groups_were_aborted_a_call_raises_a_clear_error_on_every_rank(tensor):
    for rank in tensor:
        for case in ("after_abort", "after_abort_same"):
            assert rank[case].startswith("DistributedDecodeError: the process groups of this rank are unusable"), \
                rank[case]


# -- one process: what needs no launch -------------------------------------------------------------
def test_a_target_held_whole_needs_no_coordination_and_bad_options_are_refused():
    from specdec import SpecDecoder
    from specdec.distributed import DistributedOptions, Ranks, sharding
    from specdec.tiny import tiny_random

    target, _ = tiny_random("llama")
    assert sharding(target) == () and Ranks.of(target) is None
    assert SpecDecoder(target, "prompt_lookup", distributed={"draft_placement": "replicated"}).ranks is None
    with pytest.raises(ValueError, match="draft_placement must be one of"):
        SpecDecoder(target, "prompt_lookup", distributed={"draft_placement": "everywhere"})
    with pytest.raises(ValueError, match="timeout must be"):
        DistributedOptions(timeout=0)
    with pytest.raises(TypeError, match="distributed must be"):
        SpecDecoder(target, "prompt_lookup", distributed=2)


def test_an_offloaded_device_map_decodes_as_the_whole_model(saved, references, tmp_path):
    """A device_map that offloads layers (accelerate keeps them on the meta device between forwards
    and loads them for each): one process, nothing to coordinate, the same greedy output."""
    from transformers import AutoModelForCausalLM

    from specdec import SpecDecoder

    layout = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
              "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    target = AutoModelForCausalLM.from_pretrained(saved / "target", dtype=torch.float32, device_map=layout,
                                                  offload_folder=str(tmp_path))
    ids = torch.tensor(PADDED)
    output = SpecDecoder(target, "prompt_lookup").generate(ids, (ids != 257).long(), max_new_tokens=NEW,
                                                           eos_token_id=None)
    assert output.sequences[:, ids.shape[1]:].tolist() == references["padded"]
    with pytest.raises(ValueError, match="keeps some offloaded"):  # a copy of weights it does not hold raised deep inside
        SpecDecoder(target, "self_draft").generate(ids, (ids != 257).long(), max_new_tokens=4)


def test_the_bench_schema_takes_a_distributed_target(tmp_path):
    import yaml

    from specdec.bench.config import ConfigError, load_config

    root = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"
    for name in ("quick_tp.yaml", "gpu_tp_smollm2.yaml"):
        assert load_config(root / name).distributed.world_size == 2
    data = yaml.safe_load((root / "quick_tp.yaml").read_text())
    for distributed, problem in (({"tp_size": 1}, "at least 2"), ({"tp_size": 2, "pp": 2}, "pp")):
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({**data, "distributed": distributed}))
        with pytest.raises(ConfigError, match=problem):
            load_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**data, "target": "tiny-random:llama"}))
    with pytest.raises(ConfigError, match="packaged model or a local folder"):
        load_config(tmp_path / "c.yaml")

# -- the ranks' side (run by torchrun) -------------------------------------------------------------
def _worker(kind: str, folder: str, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.distributed import DistributedConfig

    from specdec import SpecDecoder

    torch.set_num_threads(1)
    sizes = {"tensor": dict(tp_size=2), "pipeline": dict(pp_size=2)}[kind]
    load = lambda name, **kw: AutoModelForCausalLM.from_pretrained(f"{folder}/{name}", dtype=torch.float32, **kw)  # noqa: E731
    target = load("target", distributed_config=DistributedConfig(**sizes))
    draft = load("draft")
    rank = dist.get_rank()
    result = {"rank": rank}
    one, padded = torch.tensor(PROMPT), torch.tensor(PADDED)
    run = lambda decoder, ids, **kw: decoder.generate(  # noqa: E731
        ids, (ids != 257).long(), max_new_tokens=NEW, eos_token_id=None, **kw)
    new = lambda output, ids: output.sequences[:, ids.shape[1]:].tolist()  # noqa: E731
    lookup, drafting = SpecDecoder(target, "prompt_lookup"), SpecDecoder(target, draft)
    result["pl_one"], result["pl_padded"] = new(run(lookup, one), one), new(run(lookup, padded), padded)
    result["dm_one"], result["dm_padded"] = new(run(drafting, one), one), new(run(drafting, padded), padded)
    result["sampled"] = new(run(drafting, padded.repeat(2, 1), do_sample=True, temperature=0.9,
                                generator=torch.Generator().manual_seed(0)), padded.repeat(2, 1))
    if kind == "tensor":
        replicated = SpecDecoder(target, draft, distributed={"draft_placement": "replicated"})
        result["dm_replicated"] = new(run(replicated, padded), padded)
        result["pl_static"] = new(run(SpecDecoder(target, "prompt_lookup", cache_implementation="static"), padded),
                                  padded)
        import specdec

        result["custom_generate"] = target.generate(  # model.generate(custom_generate=...) enters the same run
            padded, attention_mask=(padded != 257).long(), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
            pad_token_id=257, custom_generate=specdec.generate, draft="prompt_lookup")[:, padded.shape[1]:].tolist()
        _one_rank_things(target, folder, result)
        _lossless(load, result)
        _agreement(target, result)
        _failures(target, result)
    else:
        sliding = load("sliding", distributed_config=DistributedConfig(**sizes))
        result["pl_sliding"] = new(run(SpecDecoder(sliding, "prompt_lookup"), one), one)
        warmed = SpecDecoder(target, "prompt_lookup")
        warmed.warmup(max_length=64)
        result["pl_warmed"] = new(run(warmed, one), one)
        try:
            SpecDecoder(target, "prompt_lookup", cache_implementation="static")
        except ValueError as exc:
            result["static_refused"] = str(exc)
        try:  # a copy of this rank's shards (it failed inside the copy's making, naming nothing)
            SpecDecoder(target, "self_draft").generate(one, max_new_tokens=4)
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            result["self_draft_refused"] = f"{type(exc).__name__}: {exc}"
        from candidate_generators.eagle3 import Eagle3Head, HeadConfig

        head = Eagle3Head(HeadConfig.for_target(target.config, draft_vocab_size=target.config.vocab_size))
        head.set_vocab(torch.arange(target.config.vocab_size))
        try:  # the hidden states it reads never reached it: it drafted nothing, silently
            SpecDecoder(target, "eagle3", head=head).generate(one, max_new_tokens=4)
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            result["eagle3_refused"] = f"{type(exc).__name__}: {exc}"
    Path(out, f"{kind}_rank{rank}.json").write_text(json.dumps(result))


def _one_rank_things(target, folder: str, result: dict) -> None:
    """Statistics, the streamer, stop strings and a user criterion that reads a rank's own "clock"."""
    import torch.distributed as dist
    from transformers import AutoTokenizer, StoppingCriteria

    from specdec import SpecDecoder

    tokenizer = AutoTokenizer.from_pretrained(f"{folder}/target")
    decoder = SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer)
    ids = torch.tensor(PROMPT)

    class Recorder:
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.append(value.flatten().tolist())

        def end(self):
            self.tokens.append("end")

    streamer = Recorder()
    output = decoder.generate(ids, max_new_tokens=NEW, eos_token_id=None, streamer=streamer)
    result["streamed"] = [t for chunk in streamer.tokens[1:-1] for t in chunk]  # the prompt first, then new tokens
    result["streamed_end"] = streamer.tokens[-1:]
    import specdec

    door = Recorder()  # generate() gives the prompt to every rank's streamer, then specdec runs
    target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, eos_token_id=None,
                    pad_token_id=257, custom_generate=specdec.generate, draft="prompt_lookup", streamer=door)
    result["door_streamed"] = door.tokens
    result["stats"] = output.stats.as_dict() | {"total_seconds": 0, "draft_seconds": 0, "verify_seconds": 0}
    result["stats"]["coordination"] = {k: v for k, v in output.stats.coordination.items() if k != "seconds"}
    text = tokenizer.decode(output.sequences[0, ids.shape[1]:])
    stop = text[6:8]  # ends within the 7th or 8th new token
    stopped = decoder.generate(ids, max_new_tokens=NEW, eos_token_id=None, stop_strings=stop)
    result["stop_string"] = stopped.sequences[0, ids.shape[1]:].tolist()
    result["stop_at"] = len(result["stop_string"])
    rank = dist.get_rank()

    class RankClock(StoppingCriteria):  # a criterion whose answer differs between ranks, as a clock's would
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + (5 if rank == 0 else 9))

    clocked = decoder.generate(ids, max_new_tokens=NEW, eos_token_id=None, stopping_criteria=[RankClock()])
    result["clock"] = clocked.sequences[0, ids.shape[1]:].tolist()
    from specdec.grammar import Grammar

    padded = torch.tensor(PADDED)
    constrained = decoder.generate(padded, (padded != 257).long(), max_new_tokens=NEW, eos_token_id=None,
                                   grammar=Grammar.regex(GRAMMAR_REGEX))
    result["grammar"] = constrained.sequences[:, padded.shape[1]:].tolist()


def _lossless(load, result: dict) -> None:
    """20,000 sampled rows of three tokens from the tiny 8-token model, sharded: joint counts."""
    from transformers.distributed import DistributedConfig

    from specdec import SpecDecoder

    small = load("small", distributed_config=DistributedConfig(tp_size=2))
    for name, draft in (("pl", "prompt_lookup"), ("dm", load("small_draft"))):
        decoder = SpecDecoder(small, draft, num_tokens=3, schedule="fixed")
        output = decoder.generate(torch.tensor(TINY_PROMPT).repeat(ROWS, 1), max_new_tokens=3, do_sample=True,
                                  generator=torch.Generator().manual_seed(0), **SAMPLING[name])
        new = output.sequences[:, len(TINY_PROMPT[0]):]
        codes = new[:, 0] * 64 + new[:, 1] * 8 + new[:, 2]
        result[f"joint_{name}"] = torch.bincount(codes, minlength=512).view(8, 8, 8).tolist()
        result[f"drafted_{name}"], result[f"accepted_{name}"] = output.stats.drafted_tokens, output.stats.accepted_tokens


def _agreement(target, result: dict) -> None:
    """Calls whose arguments, or failures, differ between the ranks, one after another: each
    returns the same tokens on every rank or raises one clear error on every rank; the calls
    after them check that each rank's call still pairs with the other rank's same call."""
    import torch.distributed as dist
    from transformers import LogitsProcessor, StoppingCriteria

    import specdec
    from specdec import SpecDecoder

    rank = dist.get_rank()
    decoder = SpecDecoder(target, "prompt_lookup", distributed={"timeout": 60})
    one = torch.tensor(PROMPT)
    outside = torch.tensor([[*PROMPT[0][:-1], OUTSIDE]]) if rank == 1 else one  # rank 1's prompt alone is wrong

    def attempt(case, work):
        try:
            output = work()
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            result[case] = sequences[:, one.shape[1]:].tolist()
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            result[case] = f"{type(exc).__name__}: {exc}"

    def call(ids=one, **kw):
        return decoder.generate(ids, max_new_tokens=AGREE_NEW, eos_token_id=None, **kw)

    def custom(ids=one, **kw):
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=AGREE_NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=257, custom_generate=specdec.generate,
                               draft="prompt_lookup", decoder_options={"distributed": {"timeout": 60}}, **kw)

    class Ban(LogitsProcessor):  # a user processor with a setting
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores):
            return scores.index_fill(1, torch.tensor([self.token]), float("-inf"))

    class BreaksOn(LogitsProcessor):  # raises on one rank, at its n-th call (its settings agree: the rank is read)
        def __init__(self, on, n):
            self.on, self.n, self.calls = on, n, 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if dist.get_rank() == self.on and self.calls == self.n:
                raise RuntimeError(f"processor broke on rank {self.on}")
            return scores

    class StopAt(StoppingCriteria):
        def __init__(self, length):
            self.length = length

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length)

    class BreakingStreamer:  # fed on the decider only
        def __init__(self):
            self.puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:
                raise RuntimeError("streamer broke")

        def end(self):
            pass

    seeded = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731
    # a check only rank 1 fails (under sampling: the case), then a call that must pair rightly
    attempt("vocab_one_rank", lambda: call(outside, do_sample=True, generator=seeded(0)))
    attempt("after_vocab", lambda: call(repetition_penalty=5.0))
    attempt("vocab_custom", lambda: custom(outside))
    attempt("after_vocab_custom", lambda: custom())
    attempt("vocab_prefill", lambda: decoder.prefill(outside))
    attempt("after_vocab_prefill", lambda: call())
    # calls that differ between the ranks: refused on every rank, naming what differs
    attempt("differ_penalty", lambda: call(repetition_penalty=5.0 if rank else 1.5))
    attempt("differ_processor", lambda: call(logits_processor=[Ban(5 if rank else 7)]))
    attempt("differ_criteria", lambda: call(stopping_criteria=[StopAt(14 if rank else 16)]))
    attempt("differ_seed", lambda: call(do_sample=True, generator=seeded(rank)))
    attempt("differ_prompt", lambda: call(one + rank))
    # decoders whose generators declare other most drafts (each sized its messages by its own: gloo aborted)
    differing = SpecDecoder(target, "prompt_lookup", max_tokens=3 if rank else 10, distributed={"timeout": 60})
    attempt("differ_drafting", lambda: differing.generate(one, max_new_tokens=AGREE_NEW, eos_token_id=None))
    # another timeout on each rank (each made a control group the other did not: the next call hung)
    attempt("differ_timeout", lambda: SpecDecoder(target, "prompt_lookup", distributed={"timeout": 60 + rank}))
    attempt("after_timeout", lambda: SpecDecoder(target, "prompt_lookup", distributed={"timeout": 61}).generate(
        one, max_new_tokens=AGREE_NEW, eos_token_id=None))
    # one generator over two sampled calls: every rank's ends where the decider's does
    generator = seeded(3)
    attempt("same_generator_1", lambda: call(do_sample=True, generator=generator))
    attempt("same_generator_2", lambda: call(do_sample=True, generator=generator))
    result["generator_state"] = zlib.crc32(generator.get_state().numpy().tobytes())
    # failures mid-call, on one rank: every rank raises, the next call works
    attempt("processor_failure", lambda: call(logits_processor=[BreaksOn(1, 3)]))
    attempt("decider_processor_failure", lambda: call(logits_processor=[BreaksOn(0, 2)], do_sample=True,
                                                        generator=seeded(0)))
    attempt("streamer_failure", lambda: call(streamer=BreakingStreamer()))
    attempt("after_failures", lambda: call())


def _failures(target, result: dict) -> None:
    """The decider's drafter fails at its third step; then rank 1 fails inside a forward (last:
    that aborts the process groups); then a call by a new decoder and by the same one."""
    import torch.distributed as dist

    from specdec import SpecDecoder
    from specdec.generators import CandidateGenerator, DraftingInfo, Proposal

    class Boom(CandidateGenerator):
        def __init__(self):
            self.steps = 0

        def drafting(self):
            return DraftingInfo(max_drafts=None)

        def propose(self, ctx, max_drafts):
            self.steps += 1
            if self.steps == 3:
                raise ValueError("boom at step 3")
            return Proposal.empty(ctx.batch_size)

    ids = torch.tensor(PROMPT)
    for case, decoder, hook in (("decider_failure", SpecDecoder(target, Boom()), None),
                                ("forward_failure", SpecDecoder(target, "prompt_lookup"), _breaker(dist.get_rank()))):
        handle = target.register_forward_pre_hook(hook) if hook else None
        started = time.perf_counter()
        try:
            decoder.generate(ids, max_new_tokens=NEW, eos_token_id=None)
            result[case] = "no error"
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            result[case] = f"{type(exc).__name__}: {exc}"
        result[f"{case}_seconds"] = time.perf_counter() - started
        if handle is None:  # the process group survived: the next call decodes
            result["after_failure"] = SpecDecoder(target, "prompt_lookup").generate(
                ids, max_new_tokens=NEW, eos_token_id=None).sequences[:, ids.shape[1]:].tolist()
        else:
            handle.remove()
    later = {"after_abort": lambda: SpecDecoder(target, "prompt_lookup"), "after_abort_same": lambda: decoder}
    for case, make in later.items():
        try:  # the groups are aborted: a later call, by a new decoder or the same, says so; it enters no collective
            make().generate(ids, max_new_tokens=NEW, eos_token_id=None)
            result[case] = "no error"
        except Exception as exc:  # noqa: BLE001
            result[case] = f"{type(exc).__name__}: {exc}"


def _breaker(rank: int):
    calls = []

    def hook(module, args):
        calls.append(1)
        if rank == 1 and len(calls) == 3:
            raise RuntimeError("rank 1 broke in its forward")

    return hook


if __name__ == "__main__":
    for launched_kind in KINDS:
        _worker(launched_kind, *sys.argv[1:3])
