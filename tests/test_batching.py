"""Batches: per-row acceptance, finished rows leave the batch, memory stays bounded."""

import torch

from specdec import SpecDecoder
from specdec.state import ModelState

from helpers import ForwardRecorder, left_pad, repetitive_prompt, tiny_pair


def _rows(lengths, seed=0):
    return [repetitive_prompt(n, seed=seed + n)[0] for n in lengths]


def test_rows_stop_at_their_own_eos_and_leave_the_batch():
    target, draft, tokenizer = tiny_pair("llama")
    rows = _rows((4, 30, 9, 17, 22))
    # an EOS id that plain decoding of the first row emits early: rows then finish at different steps
    alone0 = target.generate(rows[0][None], max_new_tokens=40, do_sample=False)[0, rows[0].numel():]
    eos = int(alone0[5])
    refs = [target.generate(r[None], max_new_tokens=40, do_sample=False, eos_token_id=eos)[0, r.numel():] for r in rows]
    assert len({r.numel() for r in refs}) > 1, "rows should finish at different lengths"
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    recorder = ForwardRecorder(target)
    try:
        out = SpecDecoder(target, draft, num_tokens=3).generate(ids, mask, max_new_tokens=40, eos_token_id=eos)
    finally:
        recorder.remove()
    for i, ref in enumerate(refs):
        got = out.sequences[i, ids.shape[1]:]
        assert torch.equal(got[: ref.numel()], ref)
        assert bool((got[ref.numel():] == tokenizer.pad_token_id).all())
    batch_sizes = [c["batch"] for c in recorder.calls]
    assert batch_sizes[0] == len(rows)
    assert batch_sizes == sorted(batch_sizes, reverse=True) and batch_sizes[-1] < len(rows)


def test_cache_memory_is_bounded_by_the_longest_row(monkeypatch):
    """Over a long batched generation the cache never holds more slots than the longest row
    (plus the block being verified), whether rows re-feed or shift."""
    for refeed_limit in (16, 0):
        monkeypatch.setattr(ModelState, "REFEED_LIMIT", refeed_limit)
        target, draft, tokenizer = tiny_pair("mistral")
        rows = _rows((5, 33, 12))
        ids, mask = left_pad(rows, tokenizer.pad_token_id)
        seen = []
        original = ModelState.forward

        def spy(self, start):
            logits = original(self, start)
            seen.append((self.cache.get_seq_length(), self.cached_slots, int((self.offsets + self.lengths).max()),
                         int(self.lengths.max()), int(self.offsets.min())))
            return logits

        monkeypatch.setattr(ModelState, "forward", spy)
        out = SpecDecoder(target, draft, num_tokens=4).generate(ids, mask, max_new_tokens=160, eos_token_id=[])
        monkeypatch.setattr(ModelState, "forward", original)
        assert out.sequences.shape[1] == ids.shape[1] + 160
        assert len(seen) > 40
        for cache_len, cached_slots, max_end, max_len, min_offset in seen:
            assert cache_len == cached_slots <= max_end
            assert min_offset == 0  # common left padding is trimmed
            assert max_end <= max_len + ids.shape[1] + refeed_limit + 1


def test_batched_sampling_is_reproducible():
    target, draft, tokenizer = tiny_pair("gemma3_text")
    ids, mask = left_pad(_rows((6, 20, 13)), tokenizer.pad_token_id)
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(1234)
        runs.append(SpecDecoder(target, draft, num_tokens=3).generate(ids, mask, max_new_tokens=25, do_sample=True,
                                                                       temperature=0.8, top_k=50, generator=g).sequences)
    assert torch.equal(runs[0], runs[1])


def test_select_rows_after_a_full_rollback():
    """A state rolled back to 0 cached slots can still drop rows and run (regression)."""
    target, _, _ = tiny_pair("llama")
    state = ModelState(target, torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 2]), capacity=8)
    state.forward(start=torch.tensor([1, 1]))
    state.sync(torch.tensor([[5, 6], [7, 8]]), torch.tensor([2, 2]), since=torch.tensor([0, 0]))
    assert state.cached_slots == 0
    state.select_rows(torch.tensor([1]))
    logits = state.forward(start=torch.tensor([1]))
    alone = target(input_ids=torch.tensor([[7, 8]])).logits[:, -1]
    assert torch.allclose(logits[:, 0], alone, atol=1e-5)


def test_append_writes_each_rows_own_count():
    """append(ids, counts) puts row b's first counts[b] ids after its own length and advances it by
    counts[b] (what lies past a row's length is never read); without counts, every id; the rows
    grow where the capacity is short."""
    target, _, _ = tiny_pair("llama")
    state = ModelState(target, torch.tensor([[1, 2, 0], [3, 4, 5]]), torch.tensor([2, 3]), capacity=4, pad_token_id=0)
    state.append(torch.tensor([[7, 8, 9], [10, 11, 12]]), torch.tensor([3, 1]))
    assert state.lengths.tolist() == [5, 4]
    assert state.tokens[0, :5].tolist() == [1, 2, 7, 8, 9] and state.tokens[1, :4].tolist() == [3, 4, 5, 10]
    assert state.tokens.shape[1] >= 6  # grown: row 0's block ends at column 5
    state.append(torch.tensor([[20], [21]]))
    assert state.lengths.tolist() == [6, 5]
    assert state.tokens[0, 5] == 20 and state.tokens[1, 4] == 21
    state.append(torch.zeros(2, 0, dtype=torch.long), torch.tensor([0, 0]))  # nothing to write
    assert state.lengths.tolist() == [6, 5]


def test_commit_of_drafts_in_place_writes_what_a_whole_block_writes():
    """commit(placed=accepted) after the forward's append (a chain step) leaves the tokens, lengths
    and cache a whole-block commit leaves, down to a row that accepts every draft at the capacity's
    edge and a row whose block a stop cuts short."""
    target, _, _ = tiny_pair("llama")
    prompt, lengths = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([3, 2])
    drafts, accepted = torch.tensor([[7, 8, 9], [10, 11, 12]]), torch.tensor([3, 1])
    block = torch.cat([drafts, torch.zeros(2, 1, dtype=torch.long)], dim=1)
    block.scatter_(1, accepted[:, None], torch.tensor([[13], [14]]))  # the target's token after the accepted
    keep = torch.tensor([4, 1])  # row 1 stops at its first token
    states = []
    for placed in (None, accepted):
        state = ModelState(target, prompt, lengths, capacity=3, pad_token_id=0)
        committed = state.lengths
        state.append(drafts, torch.tensor([3, 3]))
        state.forward(start=committed - 1)
        state.commit(committed, block, keep, cached=committed + accepted, placed=placed)
        states.append(state)
    whole, in_place = states
    assert whole.lengths.tolist() == in_place.lengths.tolist() == [7, 3]
    for b, n in enumerate(whole.lengths.tolist()):
        assert whole.tokens[b, :n].tolist() == in_place.tokens[b, :n].tolist()
    assert in_place.tokens[0, :7].tolist() == [1, 2, 3, 7, 8, 9, 13]
    assert whole.cached_slots == in_place.cached_slots and torch.equal(whole.offsets, in_place.offsets)
