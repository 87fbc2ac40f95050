"""The ``suffix`` generator (candidate_generators/suffix/): exact across calls, its memory shared by
one decoder's calls only, scoped per call, thread-safe, saved and loaded, within its byte bound."""

from __future__ import annotations

import threading
import tracemalloc

import pytest
import torch

from specdec import SpecDecoder
from specdec.generators import CandidateGenerator, Proposal
from specdec.models import tiny_random
from specdec.sampling import SamplingParams

from candidate_generators.suffix import SuffixGenerator, SuffixMemory, SuffixTrie
from helpers import assert_batch_is_exact, pin_costs, reference, repetitive_prompt
from test_sampling_lossless import (N, PROMPT, TINY_VOCAB, assert_same_distribution, exact_three_token_joint,
                                    joint_counts, tiny_vocab_llama)

# balanced into the second process of a split session (tests/conftest.py)
pytestmark = pytest.mark.split_second

NEW = 32


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_random("llama")
    return pin_costs(model)


def prompts(count: int, length: int = 12) -> list[torch.Tensor]:
    """[1, L] prompts, some with repeats, some random."""
    g = torch.Generator().manual_seed(7)
    return [repetitive_prompt(length, seed=s) if s % 2 else torch.randint(0, 250, (1, length), generator=g)
            for s in range(count)]


def memory_stats(out) -> dict:
    return out.stats.generator


# -- exactness ------------------------------------------------------------------------------------
def test_greedy_is_target_generate_across_calls(target):
    decoder = SpecDecoder(target, "suffix")
    for ids in [*prompts(4), *prompts(4)]:  # the second round drafts from the first's memory
        out = decoder.generate(ids, max_new_tokens=NEW)
        assert torch.equal(out.sequences, reference(target, ids, NEW))
    assert memory_stats(out)["drafted_memory"] > 0  # the memory really drafted


def test_a_left_padded_batch_is_exact_across_calls(target):
    decoder = SpecDecoder(target, "suffix")
    for _ in range(3):  # the later batches draft from the earlier ones' rows
        assert_batch_is_exact(decoder, target)
    assert decoder.candidate_generator.memory.stats()["memory_calls"] == 3


def test_a_wrong_memory_costs_speed_never_output(target):
    """Memory of other text with the same openings: drafts from it are wrong, the output is not."""
    decoder = SpecDecoder(target, "suffix")
    ids = prompts(1, length=16)[0]
    fake = ids[0].tolist() + torch.randint(0, 250, (NEW,), generator=torch.Generator().manual_seed(3)).tolist()
    for _ in range(3):
        decoder.candidate_generator.memory.add(None, [fake])
    out = decoder.generate(ids, max_new_tokens=NEW)
    assert torch.equal(out.sequences, reference(target, ids, NEW))
    assert memory_stats(out)["drafted_memory"] > 0


# -- the memory -----------------------------------------------------------------------------------
def test_trees_of_both_structures_are_exact_and_verified_as_trees(target):
    """``tree=True``: a prompt that repeats itself (the call's own trie drafts what followed) and a
    memory of the same prompt followed by other text: the two chains differ, the row proposes both
    as a tree, and the output is ``generate``'s, for one row, across calls and for a left-padded batch."""
    decoder = SpecDecoder(target, "suffix", tree=True, schedule="fixed", num_tokens=6)  # room for a second branch
    base = torch.randint(3, 250, (8,), generator=torch.Generator().manual_seed(5))
    ids = torch.cat([base, base[:5]])[None]  # its last five tokens occurred before, followed by base[5:]
    fake = ids[0].tolist() + torch.randint(0, 250, (NEW,), generator=torch.Generator().manual_seed(3)).tolist()
    for _ in range(3):
        decoder.candidate_generator.memory.add(None, [fake])
    trees = 0
    for call in [ids, *prompts(3), ids]:
        out = decoder.generate(call, max_new_tokens=NEW)
        assert torch.equal(out.sequences, reference(target, call, NEW))
        trees += out.stats.tree_steps
        assert memory_stats(out)["trees"] >= (out.stats.tree_steps > 0)
    assert trees > 0
    assert_batch_is_exact(decoder, target)


def test_a_second_identical_call_drafts_from_memory(target):
    ids = prompts(1, length=16)[0]  # random: the call alone finds little to copy
    decoder = SpecDecoder(target, "suffix")
    first, second = (decoder.generate(ids, max_new_tokens=NEW) for _ in range(2))
    assert torch.equal(first.sequences, second.sequences)
    assert second.stats.accepted_tokens >= first.stats.accepted_tokens + NEW // 2
    assert second.stats.steps <= first.stats.steps // 3
    alone = SpecDecoder(target, "suffix", memory_bytes=0)  # no memory: the second call is like the first
    again = [alone.generate(ids, max_new_tokens=NEW) for _ in range(2)][1]
    assert again.stats.generator["drafted_memory"] == 0 and again.stats.generator["memory_calls"] == 0
    assert again.stats.accepted_tokens <= second.stats.accepted_tokens - NEW // 2


def test_scopes_are_kept_apart(target):
    ids = prompts(1, length=16)[0]
    decoder = SpecDecoder(target, "suffix")
    decoder.generate(ids, max_new_tokens=NEW, memory_scope="alice")
    other = decoder.generate(ids, max_new_tokens=NEW, memory_scope="bob")
    unscoped = decoder.generate(ids, max_new_tokens=NEW)
    same = decoder.generate(ids, max_new_tokens=NEW, memory_scope="alice")
    assert memory_stats(other)["drafted_memory"] == 0 and memory_stats(unscoped)["drafted_memory"] == 0
    assert memory_stats(same)["drafted_memory"] >= NEW // 2
    assert torch.equal(other.sequences, same.sequences)
    assert memory_stats(same)["memory_scopes"] == 3
    with pytest.raises(TypeError, match="memory_scope"):
        decoder.generate(ids, max_new_tokens=4, memory_scope=3)


def test_custom_generate_keeps_a_drafters_memory_and_its_scopes_apart(target):
    """model.generate(custom_generate=...): the kept drafter remembers across calls; per-call options
    go in ``draft_call_options`` (generate() refuses keywords no model input takes)."""
    import specdec
    from specdec.integration import release

    ids = prompts(1, length=16)[0]
    want = reference(target, ids, NEW)

    def call(**options):
        out = target.generate(ids, max_new_tokens=NEW, custom_generate=specdec.generate, draft="suffix",
                              return_dict_in_generate=True, draft_call_options=options)
        assert torch.equal(out.sequences, want)
        return memory_stats(out)

    try:
        call(memory_scope="alice")
        assert call(memory_scope="bob")["drafted_memory"] == 0
        assert call(memory_scope="alice")["drafted_memory"] >= NEW // 2
        with pytest.raises(TypeError, match=r"draft_call_options \['memory_scop'\]"):
            call(memory_scop="alice")
    finally:
        release(target)


def test_two_decoders_never_share(target):
    ids = prompts(1, length=16)[0]
    one, two = SpecDecoder(target, "suffix"), SpecDecoder(target, "suffix")
    one.generate(ids, max_new_tokens=NEW)
    out = two.generate(ids, max_new_tokens=NEW)
    assert memory_stats(out)["drafted_memory"] == 0 and memory_stats(out)["memory_calls"] == 1
    assert one.candidate_generator.memory is not two.candidate_generator.memory


def test_concurrent_calls_from_threads_are_exact(target):
    decoder = SpecDecoder(target, "suffix")
    work = prompts(6)
    want = [reference(target, ids, NEW) for ids in work]
    errors, outs = [], {}

    def worker(t: int):
        try:
            for round_ in range(2):
                for i in range(t, len(work), 3):
                    outs[(round_, i)] = decoder.generate(work[i], max_new_tokens=NEW,
                                                         memory_scope=None if i % 2 else "even").sequences
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(torch.equal(outs[(r, i)], want[i]) for r in range(2) for i in range(len(work)))
    assert decoder.candidate_generator.memory.stats()["memory_calls"] == 2 * len(work)


def test_save_and_load_round_trip(target, tmp_path):
    ids = prompts(1, length=16)[0]
    decoder = SpecDecoder(target, "suffix")
    decoder.generate(ids, max_new_tokens=NEW, memory_scope="s")
    path = tmp_path / "memory.suffix"
    decoder.candidate_generator.save(path)
    restarted = SpecDecoder(target, "suffix")
    restarted.candidate_generator.load(path)
    assert restarted.candidate_generator.memory.stats() == decoder.candidate_generator.memory.stats()
    out = restarted.generate(ids, max_new_tokens=NEW, memory_scope="s")
    assert memory_stats(out)["drafted_memory"] >= NEW // 2
    assert torch.equal(out.sequences, reference(target, ids, NEW))
    restarted.candidate_generator.clear()
    assert restarted.candidate_generator.memory.stats()["memory_calls"] == 0


def test_a_damaged_file_is_refused_naming_it(target, tmp_path):
    decoder = SpecDecoder(target, "suffix")
    decoder.generate(prompts(1)[0], max_new_tokens=8)
    path = tmp_path / "memory.suffix"
    decoder.candidate_generator.save(path)
    data = path.read_bytes()
    kept = decoder.candidate_generator.memory.stats()
    cases = {"flipped": data[:-5] + bytes([data[-5] ^ 1]) + data[-4:], "cut": data[: len(data) // 2],
             "other": b'{"format": "something else"}\n', "version": data.replace(b'"version": 1', b'"version": 9'),
             "empty": b""}
    for name, damaged in cases.items():
        bad = tmp_path / f"{name}.suffix"
        bad.write_bytes(damaged)
        with pytest.raises(ValueError, match=f"{name}.suffix"):
            decoder.candidate_generator.load(bad)
    assert decoder.candidate_generator.memory.stats() == kept  # a refused file changes nothing


def test_a_one_token_match_drafts_by_default_and_not_under_min_match_2():
    """The last token seen once before, followed by 9 then 7: a match of one token drafts up to
    match_factor (2) drafts, from the call's own trie; ``min_match=2`` drafts nothing there."""
    row = [5, 9, 7, 3, 5]
    for generator, drafts in ((SuffixGenerator(), [9, 7]), (SuffixGenerator(min_match=2), [])):
        trie = SuffixTrie(generator.max_depth)
        trie.extend(trie.start(), row)
        branch, where, _ = generator.branch(row, trie, limit=8)
        assert branch.tokens == drafts and (where == "drafted_call" or not drafts)
        assert branch.match == (1 if drafts else 0)


def test_the_byte_bound_holds_after_1000_calls():
    """1,000 calls of 100 tokens (half of each from a shared template, half new) into a 1 MiB store."""
    bound = 1 << 20
    memory = SuffixMemory(bound, max_depth=24)
    g = torch.Generator().manual_seed(0)
    template = torch.randint(0, 5000, (50,), generator=g).tolist()
    highest = 0
    for _ in range(1000):
        memory.add(None, [template + torch.randint(0, 5000, (50,), generator=g).tolist()])
        highest = max(highest, memory.stats()["memory_bytes"])
    stats = memory.stats()
    assert highest <= bound and 0 < stats["memory_calls"] < 1000 and stats["memory_evicted"] == 1000 - stats["memory_calls"]
    newest = memory.calls[-1].rows[0].tolist()
    assert memory.draft(None, newest[:60], limit=8, longest=23, min_match=2, min_prob=0.1, factor=2.0).tokens == \
        newest[60:68]  # the newest call is held


def test_the_measured_bytes_cover_what_python_allocated():
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    trie = SuffixTrie(24)
    trie.extend(trie.start(), torch.randint(0, 5000, (2000,), generator=torch.Generator().manual_seed(1)).tolist())
    allocated = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert 0.8 * allocated <= trie.nbytes() <= 1.5 * allocated


# -- the per-call option ---------------------------------------------------------------------------
class Scoped(CandidateGenerator):
    call_options = ("flavour",)
    seen: list = []

    def for_call(self, flavour=None):
        Scoped.seen.append(flavour)
        return self

    def propose(self, ctx, max_drafts):
        return Proposal.empty(ctx.batch_size, ctx.tokens.device)


def test_a_generators_call_options_reach_for_call_and_nothing_else(target):
    ids = prompts(1)[0]
    SpecDecoder(target, Scoped()).generate(ids, max_new_tokens=2, flavour="x")
    SpecDecoder(target, Scoped()).generate(ids, max_new_tokens=2)  # not passed: for_call is not asked
    assert Scoped.seen == ["x"]
    with pytest.raises(ValueError, match="memory_scope"):  # a generator that does not take it: a model input
        SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=2, memory_scope="a")


# -- sampling ---------------------------------------------------------------------------------------
def test_sampling_from_memory_keeps_the_target_distribution():
    """Chi-square of the first three tokens, as tests/test_sampling_lossless.py checks the others, on
    a call that drafts from the memory of an earlier sampled call."""
    target = tiny_vocab_llama(0)
    params = SamplingParams(True, 0.8, top_k=6)
    decoder = SpecDecoder(target, "suffix", num_tokens=3, schedule="fixed")

    def sample(rows: int, seed: int):
        return decoder.generate(PROMPT.repeat(rows, 1), max_new_tokens=3, do_sample=True, temperature=0.8, top_k=6,
                                generator=torch.Generator().manual_seed(seed))

    sample(200, 1)  # fills the memory
    out = sample(N, 0)
    assert out.stats.generator["drafted_memory"] > 0 and 0 < out.stats.accepted_tokens < out.stats.drafted_tokens
    assert_same_distribution(joint_counts(out.sequences[:, PROMPT.shape[1]:], TINY_VOCAB),
                             exact_three_token_joint(target, PROMPT, params))
