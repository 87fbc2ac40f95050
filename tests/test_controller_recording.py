"""The controller, proven by recording every forward of the target and the assistant.

Models here are a tiny Llama subclass whose ``forward`` declares one extra explicit input,
``marker`` (a stand-in for a prefill-only input such as ``pixel_values``). A forward pre-hook
records, for every forward, the token ids fed, their position ids and the keyword names.
With the per-step verdicts (offered / accepted drafts, heard through the generator's
``observe``) the whole schedule of forwards is predictable, and the test checks it exactly:

* the target runs once per step (forwards == ``stats.steps``): its first forward is the whole
  prompt plus the first drafts, each later one the pending last token plus the new drafts;
* the assistant is prefilled exactly once (its first forward is the whole prompt); after that
  each forward feeds one token: the pending committed token, or two (the last draft and the
  bonus) right after a fully accepted block, then one per draft it proposes. Every position is
  fed once per distinct token, so it is never fed a token it already holds;
* the assistant drafts exactly the tokens the target then verifies;
* only the first forward of each model receives ``marker``; neither model's ``generate()`` runs.

Then ``AcceptanceStats`` (item 10): every field present and consistent with the verdicts; and the
one :class:`~specdec.generators.StepRecord` a step builds, which the generator hears as its feedback.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from candidate_generators.draft_model import DraftModelGenerator
from specdec import AcceptanceStats, SpecDecoder
from specdec.generators import StepRecord
from specdec.multimodal import declared_inputs
from specdec.models import tiny_random

from helpers import ForwardRecorder, left_pad, perturbed_copy, repetitive_prompt




class MarkedLlama(LlamaForCausalLM):
    """A Llama whose forward declares ``marker``, an input that must reach the first forward only."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, marker=None, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                               logits_to_keep=logits_to_keep, **kwargs)


def marked(model) -> MarkedLlama:
    copy_ = MarkedLlama(model.config)
    copy_.load_state_dict(model.state_dict())
    copy_.generation_config = copy.deepcopy(model.generation_config)
    return copy_.eval()


class Recorder(ForwardRecorder):
    """ForwardRecorder that also keeps the position ids of every forward."""

    def _hook(self, module, args, kwargs):
        super()._hook(module, args, kwargs)
        positions = kwargs.get("position_ids")
        self.calls[-1]["positions"] = positions.clone() if positions is not None else None


@pytest.fixture(scope="module")
def pair():
    base, tokenizer = tiny_random("llama", seed=4)
    target = marked(base)
    draft = marked(perturbed_copy(base, 0.15, seed=9))
    assert "marker" in declared_inputs(target)
    return target, draft, tokenizer


def forbid_generate(monkeypatch, *models):
    for model in models:
        monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("generate() must never run"))


def run_recorded(target, draft, ids, monkeypatch, *, max_new_tokens=40, num_tokens=4, **kwargs):
    """Decode with draft_model, recording both models' forwards and every step's verdict."""
    generator = DraftModelGenerator(draft, num_tokens=num_tokens, schedule="fixed")
    verdicts: list[tuple[list[int], list[int]]] = []
    observe = DraftModelGenerator.observe  # each call works on its own session: record on the class

    def recording_observe(self, ctx, feedback):
        verdicts.append((feedback.offered.tolist(), feedback.accepted.tolist()))
        observe(self, ctx, feedback)

    monkeypatch.setattr(DraftModelGenerator, "observe", recording_observe)
    recorders = Recorder(target), Recorder(draft)
    try:
        with monkeypatch.context() as patch:
            forbid_generate(patch, target, draft)
            out = SpecDecoder(target, generator).generate(ids, max_new_tokens=max_new_tokens, **kwargs)
    finally:
        for r in recorders:
            r.remove()
    return out, recorders[0].calls, recorders[1].calls, verdicts


def test_every_forward_of_target_and_assistant_is_accounted_for(pair, monkeypatch):
    target, draft, _ = pair
    ids = repetitive_prompt(14, seed=3)  # [1, P]
    prompt_len = ids.shape[1]
    marker = torch.ones(1)
    out, t_calls, d_calls, verdicts = run_recorded(target, draft, ids, monkeypatch, marker=marker)
    final = out.sequences[0].tolist()
    assert out.sequences.tolist() == target.generate(ids, max_new_tokens=40, do_sample=False).tolist()

    offered = [o[0] for o, _ in verdicts]
    accepted = [a[0] for _, a in verdicts]
    assert 0 < sum(accepted) < sum(offered)  # some blocks accepted, some rejected
    assert any(a == o > 0 for o, a in zip(offered, accepted))  # at least one fully accepted block
    assert len(t_calls) == out.stats.steps == len(verdicts)

    # committed length before each step
    lengths = [prompt_len]
    for a in accepted:
        lengths.append(lengths[-1] + a + 1)

    d_iter = iter(d_calls)
    for s, (o, a) in enumerate(zip(offered, accepted)):
        call = t_calls[s]
        start = 0 if s == 0 else lengths[s] - 1
        end = lengths[s] + o  # committed tokens + o drafts
        assert call["tokens"] == end - start, f"target step {s}"
        assert call["positions"][0].tolist() == list(range(start, end))
        assert call["input_ids"][0, : lengths[s] - start].tolist() == final[start: lengths[s]]
        assert ("marker" in call["kwargs"]) == (s == 0), f"target step {s}"
        drafts = call["input_ids"][0, lengths[s] - start:].tolist()  # what the target verified

        # the assistant's forwards of this step: o of them, one per draft it proposes
        for i in range(o):
            d = next(d_iter)
            if i == 0:
                if s == 0:
                    fed_from = 0  # the one prefill: the whole prompt
                else:
                    fed_from = lengths[s] - (2 if accepted[s - 1] == offered[s - 1] else 1)
                fed = list(range(fed_from, lengths[s]))
                assert d["input_ids"][0].tolist() == final[fed_from: lengths[s]], f"draft step {s}"
            else:
                fed = [lengths[s] - 1 + i]
                assert d["input_ids"][0].tolist() == [drafts[i - 1]], f"draft step {s} draft {i}"
            assert d["positions"][0].tolist() == fed, f"draft step {s} forward {i}"
            assert ("marker" in d["kwargs"]) == (s == 0 and i == 0)
    assert next(d_iter, None) is None  # no other assistant forward
    assert d_calls[0]["tokens"] == prompt_len and all(c["tokens"] <= 2 for c in d_calls[1:])


def test_a_batch_prefills_each_model_once(pair, monkeypatch):
    target, draft, tokenizer = pair
    rows = [repetitive_prompt(n, seed=n)[0] for n in (5, 17, 9)]
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    out, t_calls, d_calls, verdicts = run_recorded(target, draft, ids, monkeypatch, max_new_tokens=20,
                                                   attention_mask=mask, marker=torch.ones(3))
    for calls in (t_calls, d_calls):
        assert [("marker" in c["kwargs"]) for c in calls] == [True] + [False] * (len(calls) - 1)
        assert calls[0]["tokens"] >= ids.shape[1] and all(c["tokens"] <= 18 for c in calls[1:])
    assert sum(c["batch"] for c in t_calls) == out.stats.steps  # a step is one row verified once
    assert len(t_calls) == len(verdicts)
    for i, row in enumerate(rows):
        ref = target.generate(row[None], max_new_tokens=20, do_sample=False)[0, row.numel():]
        assert out.sequences[i, ids.shape[1]: ids.shape[1] + ref.numel()].tolist() == ref.tolist()


def test_prompt_lookup_target_forwards_equal_steps(pair, monkeypatch):
    target, _, _ = pair
    recorder = Recorder(target)
    ids = repetitive_prompt(14, seed=5)
    with monkeypatch.context() as patch:
        forbid_generate(patch, target)
        out = SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=30, marker=torch.ones(1))
    recorder.remove()
    assert len(recorder.calls) == out.stats.steps
    assert [("marker" in c["kwargs"]) for c in recorder.calls] == [True] + [False] * (len(recorder.calls) - 1)
    assert recorder.calls[0]["positions"][0, 0] == 0 and recorder.calls[0]["tokens"] >= ids.shape[1]


# -- AcceptanceStats -------------------------------------------------------------------------------
def test_acceptance_stats_are_complete_and_consistent(pair, monkeypatch):
    target, draft, _ = pair
    ids = repetitive_prompt(14, seed=3)
    out, _, _, verdicts = run_recorded(target, draft, ids, monkeypatch, max_new_tokens=40, num_tokens=5)
    stats = out.stats
    offered = [o[0] for o, _ in verdicts]
    accepted = [a[0] for _, a in verdicts]
    new_tokens = out.sequences.shape[1] - ids.shape[1]

    assert stats.steps == len(verdicts)
    assert stats.drafted_tokens == sum(offered) and stats.accepted_tokens == sum(accepted)
    assert stats.committed_tokens == new_tokens <= stats.accepted_tokens + stats.steps
    assert stats.mean_accepted_length == pytest.approx(stats.committed_tokens / stats.steps)
    assert 1.0 < stats.mean_accepted_length <= 6.0
    assert stats.acceptance_rate == pytest.approx(sum(accepted) / sum(offered))
    per_position = stats.per_position_acceptance
    assert len(per_position) <= 5 and sum(stats.accepted_at_position) == stats.accepted_tokens
    for i, rate in enumerate(per_position):
        assert rate == pytest.approx(sum(a > i for a in accepted) / stats.steps)
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))  # non-increasing
    assert stats.draft_seconds > 0 and stats.verify_seconds > 0
    assert stats.total_seconds >= stats.draft_seconds + stats.verify_seconds
    assert stats.tokens_per_second > 0
    d = stats.as_dict()
    for key in ("steps", "drafted_tokens", "accepted_tokens", "committed_tokens", "mean_accepted_length",
                "acceptance_rate", "per_position_acceptance", "draft_seconds", "verify_seconds"):
        assert key in d
    assert AcceptanceStats.from_dict(d).as_dict() == d

    merged = stats + stats
    assert merged.steps == 2 * stats.steps and merged.committed_tokens == 2 * stats.committed_tokens
    assert merged.mean_accepted_length == pytest.approx(stats.mean_accepted_length)
    assert merged.per_position_acceptance == pytest.approx(per_position)


def test_plain_decoding_scores_mean_accepted_length_one(pair):
    target, _, _ = pair
    ids = repetitive_prompt(10, seed=2)
    out = SpecDecoder(target).generate(ids, max_new_tokens=12)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=12, do_sample=False))
    stats = out.stats
    assert stats.mean_accepted_length == 1.0 and stats.steps == stats.committed_tokens == 12
    assert stats.drafted_tokens == stats.accepted_tokens == 0 and stats.acceptance_rate == 0.0
    assert stats.per_position_acceptance == []


def test_the_target_drafting_for_itself_accepts_everything(pair):
    target, _, _ = pair
    ids = repetitive_prompt(10, seed=2)
    out = SpecDecoder(target, target, num_tokens=3, schedule="fixed").generate(ids, max_new_tokens=16)
    stats = out.stats
    assert stats.acceptance_rate == 1.0 and stats.steps == 4  # 4 blocks of 3 drafts + 1 bonus
    assert stats.mean_accepted_length == 4.0 and stats.per_position_acceptance == [1.0, 1.0, 1.0]


def test_each_step_builds_one_record_that_the_generator_hears(pair, monkeypatch):
    """The generator's ``observe`` gets the step's :class:`StepRecord`: its counts nest (verified
    <= worth verifying <= made <= asked), a row keeps at most its accepted drafts and the target's
    token, only the first step is the prefill, and the records add up to the output and stats."""
    target, draft, tokenizer = pair
    records: list[StepRecord] = []
    observe = DraftModelGenerator.observe

    def recording_observe(self, ctx, feedback):
        records.append(feedback)
        observe(self, ctx, feedback)

    monkeypatch.setattr(DraftModelGenerator, "observe", recording_observe)
    rows = [repetitive_prompt(n, seed=n)[0] for n in (6, 12)]
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    out = SpecDecoder(target, DraftModelGenerator(draft, num_tokens=3, schedule="fixed")).generate(
        ids, mask, max_new_tokens=24)
    assert sum(r.offered.shape[0] for r in records) == out.stats.steps  # row-steps
    for i, r in enumerate(records):
        assert isinstance(r, StepRecord) and r.first == (i == 0) and not r.waiting
        assert bool((r.offered <= r.candidates).all() and (r.candidates <= r.made).all() and (r.made <= r.asked).all())
        assert bool((r.accepted <= r.offered).all() and (r.kept <= r.accepted + 1).all() and (r.kept >= 0).all())
        assert r.drafting >= 0 and r.forward > 0 and r.verifying >= r.forward
        if not r.first:  # each row fed its pending tokens (at least the newest) and the widest block of drafts
            assert r.fed % len(r.offered) == 0 and r.fed >= (1 + int(r.offered.max())) * len(r.offered)
    assert sum(int(r.kept.sum()) for r in records) == out.stats.committed_tokens
    assert sum(int(r.offered.sum()) for r in records) == out.stats.drafted_tokens > 0
