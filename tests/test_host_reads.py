"""A step reads the device once: its bookkeeping runs on host values (specdec/host.py).

On a GPU every ``int()``, ``bool()`` or ``tolist()`` of a tensor waits for the device, so a step
reads back only its verdict (the accepted counts and the committed block) and computes each row's
length, room, drafts offered and stop checks from values it already holds. These tests count the
reads a step makes (``torch.overrides.TorchFunctionMode`` sees each one) and check that the
values a step carries always equal the tensors they describe.
"""

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

import specdec.host as host
from specdec import SpecDecoder
from specdec.host import host_ints, host_long, hosted, read_rows
from specdec.run import DecodeRun
from specdec.stopping import Stopper

from helpers import left_pad, repetitive_prompt, tiny_pair

READS = {"__int__", "__bool__", "__float__", "__index__", "item", "tolist"}


class CountReads(TorchFunctionMode):
    """Counts reads of tensors into Python values; with ``own=True`` only specdec's own of what a
    device would hold: not those the model's forward makes inside ``transformers``, nor those of
    float64 tensors (the draft-length policy's arithmetic, made on the CPU whatever the device)."""

    def __init__(self, own: bool = False):
        super().__init__()
        self.count, self.own, self.where = 0, own, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            stack = traceback.extract_stack()[:-1]
            host_side = args[0].dtype == torch.float64 or any("/transformers/" in frame.filename for frame in stack)
            if not (self.own and host_side):
                self.count += 1
                self.where.append(next((f"{f.filename.split('/')[-1]}:{f.lineno}" for f in reversed(stack)
                                        if ("specdec" in f.filename or "candidate_generators" in f.filename)
                                        and not f.filename.endswith("host.py")), "?"))
        return func(*args, **(kwargs or {}))


def test_values_are_read_once_attached_and_carried(monkeypatch):
    monkeypatch.setattr(host, "CHECK", False)
    t = torch.tensor([3, 1, 2])
    with CountReads() as reads:
        assert host_ints(t) == [3, 1, 2]
        assert host_ints(t) == [3, 1, 2]
    assert reads.count == 1
    made = host_long([4, 5])
    with CountReads() as reads:
        assert host_ints(made) == [4, 5]
    assert reads.count == 0 and made.dtype == torch.long and made.tolist() == [4, 5]
    block, accepted = torch.tensor([[7, 8, 9], [4, 5, 6]]), torch.tensor([2, 0])
    with CountReads() as reads:
        rows, counts = read_rows(block, accepted)
        assert host_ints(block) == rows and host_ints(accepted) == counts
    assert reads.count == 1 and rows == [[7, 8, 9], [4, 5, 6]] and counts == [2, 0]


def test_a_value_that_no_longer_describes_its_tensor_is_caught(monkeypatch):
    monkeypatch.setattr(host, "CHECK", True)  # as the test suite runs
    t = hosted(torch.tensor([1, 2]), [1, 2])
    assert host_ints(t) == [1, 2]
    t.add_(1)  # written in place: what no carrier of host values may be
    with pytest.raises(AssertionError, match="host values"):
        host_ints(t)


def _reads_per_step(decoder, monkeypatch, *args, **kwargs) -> tuple:
    """Generate -> (output, per step: (reads, where each was made, whether no row could stop in
    its block)), the comparisons of host values switched off."""
    monkeypatch.setattr(host, "CHECK", False)
    counts, step, quiet, quiets = [], DecodeRun.step, Stopper.quiet, []

    def counted(run):
        quiets.clear()
        with CountReads(own=True) as reads:
            going = step(run)
        counts.append((reads.count, reads.where, quiets[0]))
        return going

    def heard(stopper, generated, block):
        quiets.append(quiet(stopper, generated, block))
        return quiets[-1]

    monkeypatch.setattr(DecodeRun, "step", counted)
    monkeypatch.setattr(Stopper, "quiet", heard)
    out = decoder.generate(*args, **kwargs)
    return out, counts


FIXED = ("prompt_lookup", {"schedule": "fixed", "num_tokens": 4})
POLICY = ("prompt_lookup", {})
DRAFT = ("draft_model", {"schedule": "fixed", "num_tokens": 3})  # the pair's draft, kept in step by the controller


def _drafted(decoder, monkeypatch, ids, mask, new: int) -> set[int]:
    """The ids ``decoder`` drafts (and offers) for this prompt."""
    drafted, forward = set(), DecodeRun._forward

    def spy(run, draft_ids, offered, *args):
        drafted.update(t for row, n in zip(draft_ids.tolist(), offered.tolist()) for t in row[:n])
        return forward(run, draft_ids, offered, *args)

    with monkeypatch.context() as patched:
        patched.setattr(DecodeRun, "_forward", spy)
        decoder.generate(ids, mask, max_new_tokens=new)
    return drafted


@pytest.mark.parametrize("generator, rows, cache, eos", [
    ((None, {}), 1, {"engine": "eager"}, None),
    ((None, {}), 3, {"cache_implementation": "static"}, "late"),
    (FIXED, 1, {"engine": "eager"}, None),
    (FIXED, 3, {"engine": "eager"}, "drafted"),
    (FIXED, 1, {"cache_implementation": "static"}, "drafted"),
    (POLICY, 1, {"engine": "eager"}, "late"),
    (POLICY, 3, {"engine": "eager"}, "drafted"),
    (POLICY, 3, {"cache_implementation": "static"}, "drafted"),
    (DRAFT, 1, {"engine": "eager"}, None),
    (DRAFT, 3, {"cache_implementation": "static"}, None),
])
def test_a_step_reads_the_device_once(monkeypatch, generator, rows, cache, eos):
    """Every step after the prefill that no row can stop in reads the device exactly once: batch
    1 and a left-padded batch, a dynamic and a static cache, no drafts, a fixed schedule and the
    draft-length policy; no end of sequence, one that ends the first row late, and one that the
    drafts hold but the target never writes (each such draft is cut from the host values); a
    draft model, whose sync with the committed tokens is read with the verdict (its drafts are
    read once more, by the proposal's check). Output stays generate()'s."""
    target, draft, tokenizer = tiny_pair("llama")
    target.generation_config.eos_token_id = None  # None: rows run to their budget
    prompts = [repetitive_prompt(24 + 7 * b, seed=b)[0] for b in range(rows)]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    new = 40
    decoder = SpecDecoder(target, draft if generator[0] == "draft_model" else generator[0], **cache, **generator[1])
    if eos is not None:
        plain = target.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        if eos == "late":
            target.generation_config.eos_token_id = int(plain[0, -3])
        else:
            never = _drafted(decoder, monkeypatch, ids, mask, new) - set(plain[:, ids.shape[1]:].flatten().tolist())
            assert never, "the prompt should make the generator draft some id the output never holds"
            target.generation_config.eos_token_id = min(never)
    out, counts = _reads_per_step(decoder, monkeypatch, ids, mask, max_new_tokens=new)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert torch.equal(out.sequences, expected)
    steady = [(n, where) for n, where, quiet in counts[1:] if quiet]  # the prefill reads the prompt; stops read more
    # a model's drafts carry no host values: the proposal's check reads them once (their ids must lie
    # in the vocabulary before the forward), the step's verdict once (the follower's sync with it)
    reads = 2 if generator is DRAFT else 1
    assert len(steady) >= 5 and {n for n, _ in steady} == {reads}, [c for c in steady if c[0] != reads]
