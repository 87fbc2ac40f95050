"""A draft model at lower precision (``weights=`` on ``draft_model`` and ``cross_tokenizer``).

The draft is copied (once per decoder) at the asked precision and steps compiled on a static
cache; greedy output stays the target's (``test_cross_tokenizer`` checks the cross-tokenizer case), the user's draft is never modified, and a bad option is
refused by name. Also: a proposal in which an assistant catches up on steps it sat out is not
taken as the cost of its drafts (the policy would otherwise price drafting far too high).
"""

from __future__ import annotations

import pytest
import torch

from candidate_generators.draft_model import DraftModelGenerator
from specdec.engines.forwards.int8 import Int8Linear
from specdec import SpecDecoder
from specdec.generators import Proposal
from specdec.models import tiny_random
from specdec.policy import COST_GRID, CostModel, DraftPolicy
from specdec.run import CATCH_UP

from helpers import FAST_COMPILE, assert_batch_is_exact, perturbed_copy, repetitive_prompt, weights_checksum


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(scope="module")
def pair():
    target = tiny_random("llama", seed=11)[0]
    return target, perturbed_copy(target, 0.05, seed=12)


@pytest.mark.parametrize("weights", ["bfloat16", "w8a8"])
def test_a_low_precision_draft_model_is_exact_and_leaves_the_draft_alone(pair, weights):
    target, draft = pair
    before = weights_checksum(draft)
    decoder = SpecDecoder(target, draft, weights=weights, compile_draft=FAST_COMPILE, schedule="fixed", num_tokens=4)
    ids = repetitive_prompt(10)
    out = decoder.generate(ids, max_new_tokens=40)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=40, do_sample=False))
    assert 0 < out.stats.accepted_tokens < out.stats.drafted_tokens  # it drafts, and is sometimes wrong
    assert_batch_is_exact(decoder, target)
    assert weights_checksum(draft) == before
    copies = decoder.candidate_generator._copies
    assert list(copies._made[draft]) == [weights]  # the calls built one copy, in the decoder's store
    copy_ = copies.get(draft, weights)
    assert copy_ is not draft
    if weights == "w8a8":
        assert any(isinstance(m, Int8Linear) for m in copy_.modules())
    else:
        assert next(copy_.parameters()).dtype == torch.bfloat16


def test_bad_precision_options_are_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="weights must be one of"):
        SpecDecoder(target, draft, weights="int3")
    with pytest.raises(TypeError, match="compile_draft"):
        SpecDecoder(target, draft, weights="w8a8", compile_draft="yes")


class LaggingDraft(DraftModelGenerator):
    """Drafts, then drafts nothing for ten steps (its assistant falls behind), then drafts again;
    records how far behind the assistant was before each proposal that drafts."""

    def __init__(self, draft, **kwargs):
        super().__init__(draft, **kwargs)
        self.steps, self.lags = 0, []

    def propose(self, ctx, max_drafts):
        self.steps += 1
        if 3 <= self.steps <= 12:
            return Proposal.empty(ctx.batch_size, max_drafts.device)
        self.lags.append(self.assistant._state.pending_width())
        return super().propose(ctx, max_drafts)

    def acceptance_prior(self) -> float:
        return 0.95  # drafting pays at first, whatever the random draft proposes


def test_catching_up_is_not_priced_as_drafting(monkeypatch):
    target = tiny_random("llama", seed=15, num_hidden_layers=4)[0]  # no end-of-sequence within 40 tokens
    draft = tiny_random("llama", seed=14, num_hidden_layers=1)[0]  # a third of the target's bytes a step
    CostModel.pin(target, CostModel([1.0] * len(COST_GRID), rate=0.0))  # a forward "costs" 1 s: drafting pays
    generator = LaggingDraft(draft, schedule="auto", num_tokens=3)
    observed = []
    original = DraftPolicy.observe_drafting

    def record(self, seconds, proposed):
        if proposed > 0:
            observed.append(generator_session[0].lags[-1])
        original(self, seconds, proposed)

    generator_session = []
    original_session = LaggingDraft.session

    def session(self):
        fresh = original_session(self)
        generator_session.append(fresh)
        return fresh

    monkeypatch.setattr(DraftPolicy, "observe_drafting", record)
    monkeypatch.setattr(LaggingDraft, "session", session)
    decoder = SpecDecoder(target, generator)
    ids = repetitive_prompt(10)
    out = decoder.generate(ids, max_new_tokens=40)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=40, do_sample=False))
    lags = generator_session[0].lags
    assert max(lags) > CATCH_UP  # the first proposal after the pause caught up on ten steps
    assert observed and all(lag <= CATCH_UP for lag in observed)


def test_greedy_drafts_are_the_argmax_with_its_softmax_probability(pair, monkeypatch):
    """Under greedy decoding each draft is the argmax of the assistant's logits and its confidence
    that token's softmax probability (computed without the softmax)."""
    from specdec.assistant import Assistant

    target, draft = pair
    seen, proposals = [], []
    next_logits, propose = Assistant.next_logits, DraftModelGenerator.propose

    def recording_logits(self):
        logits = next_logits(self)
        seen.append(logits.detach().clone())
        return logits

    def recording_propose(self, ctx, max_drafts):
        seen.clear()
        proposal = propose(self, ctx, max_drafts)
        proposals.append((proposal, list(seen)))
        return proposal

    monkeypatch.setattr(Assistant, "next_logits", recording_logits)
    monkeypatch.setattr(DraftModelGenerator, "propose", recording_propose)
    ids = repetitive_prompt(10)
    out = SpecDecoder(target, draft, schedule="fixed", num_tokens=3).generate(ids, max_new_tokens=12)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=12, do_sample=False))
    checked = 0
    for proposal, logits in proposals:
        for i, step in enumerate(logits[: proposal.token_ids.shape[1]]):
            probs = torch.softmax(step.float(), dim=-1)
            assert torch.equal(proposal.token_ids[:, i], step.argmax(dim=-1))
            assert torch.allclose(proposal.confidence[:, i], probs.gather(1, step.argmax(-1, keepdim=True))[:, 0])
            checked += 1
    assert checked >= 6
