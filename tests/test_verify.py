"""The verifier on its own: exact cases with hand-made scores, then hypothesis properties.

``greedy_verify`` and ``speculative_sample`` are pure functions of tensors, so every case here
builds ``target_logits``/``target_probs [B, K+1, V]``, ``draft_ids [B, K]``, ``draft_lengths [B]``
and (for sampling) ``draft_probs [B, K, V]`` by hand, and checks the verdict
(``accepted [B]``, ``next_token [B]``).

Properties (hypothesis, random shapes and scores):

* per row, the committed block is an accepted draft prefix plus exactly one target token;
* ``0 <= accepted[b] <= draft_lengths[b] <= K``;
* greedy verification equals a plain-Python walk along the target's argmax chain;
* rows are independent: verifying a batch equals verifying each row alone (greedy), and the
  per-row invariants of sampling hold whatever the other rows hold.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.verify import greedy_verify, speculative_sample

NEG = -1e9  # "impossible" logit in hand-made cases


def onehot_logits(ids: list[list[int]], vocab: int) -> torch.Tensor:
    """[B][K+1] argmax ids -> [B, K+1, V] logits whose argmax is exactly those ids."""
    ids_t = torch.tensor(ids)
    logits = torch.zeros(*ids_t.shape, vocab)
    logits.scatter_(2, ids_t[..., None], 5.0)
    return logits


# -- greedy: exact cases -------------------------------------------------------------------------
def test_greedy_all_accepted_gives_bonus_token():
    logits = onehot_logits([[3, 1, 4, 2]], vocab=5)  # argmax chain 3, 1, 4 then bonus 2
    verdict = greedy_verify(logits, torch.tensor([[3, 1, 4]]), torch.tensor([3]))
    assert verdict.accepted.tolist() == [3]
    assert verdict.next_token.tolist() == [2]


def test_greedy_first_mismatch_stops_and_target_token_follows():
    logits = onehot_logits([[3, 1, 4, 2], [0, 0, 0, 0], [1, 2, 3, 4]], vocab=5)
    drafts = torch.tensor([[3, 2, 4], [1, 0, 0], [1, 2, 0]])
    verdict = greedy_verify(logits, drafts, torch.tensor([3, 3, 3]))
    # row 0: d2=2 != 1, so d3 matching later does not count; row 1: first draft wrong
    assert verdict.accepted.tolist() == [1, 0, 2]
    assert verdict.next_token.tolist() == [1, 0, 3]


def test_greedy_respects_draft_lengths_and_padding():
    logits = onehot_logits([[3, 1, 4, 2], [3, 1, 4, 2], [3, 1, 4, 2]], vocab=5)
    drafts = torch.tensor([[3, 1, 4], [3, 1, 4], [3, 1, 4]])  # all three would match
    verdict = greedy_verify(logits, drafts, torch.tensor([2, 0, 1]))
    assert verdict.accepted.tolist() == [2, 0, 1]
    assert verdict.next_token.tolist() == [4, 3, 1]  # the target's token at the first unoffered slot


def test_greedy_with_no_drafts_at_all():
    logits = onehot_logits([[2], [4]], vocab=5)
    verdict = greedy_verify(logits, torch.zeros(2, 0, dtype=torch.long), torch.tensor([0, 0]))
    assert verdict.accepted.tolist() == [0, 0]
    assert verdict.next_token.tolist() == [2, 4]


# -- sampling: exact cases -----------------------------------------------------------------------
def test_sampling_accepts_with_certainty_where_target_covers_draft():
    """target_probs[d] >= draft_probs[d] > 0 means min(1, t/d) = 1: always accepted."""
    target = torch.tensor([[[0.6, 0.4, 0.0], [0.2, 0.8, 0.0], [0.0, 0.0, 1.0]]]).repeat(500, 1, 1)
    draft = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]]).repeat(500, 1, 1)
    drafts = torch.tensor([[0, 1]]).repeat(500, 1)
    verdict = speculative_sample(target, drafts, torch.full((500,), 2), draft, torch.Generator().manual_seed(0))
    assert verdict.accepted.tolist() == [2] * 500
    assert verdict.next_token.tolist() == [2] * 500  # the bonus comes from target_probs[:, 2]


def test_sampling_never_accepts_a_draft_the_target_excludes():
    target = torch.tensor([[[0.0, 0.7, 0.3], [1.0, 0.0, 0.0]]]).repeat(500, 1, 1)
    draft = torch.tensor([[[0.9, 0.1, 0.0]]]).repeat(500, 1, 1)
    verdict = speculative_sample(target, torch.zeros(500, 1, dtype=torch.long), torch.ones(500, dtype=torch.long),
                                 draft, torch.Generator().manual_seed(1))
    assert verdict.accepted.tolist() == [0] * 500
    # residual max(0, t - d) = [0, 0.6, 0.3] -> ids 1 and 2 in ratio 2:1
    counts = torch.bincount(verdict.next_token, minlength=3).tolist()
    assert counts[0] == 0 and 260 < counts[1] < 400 and 100 < counts[2] < 240


def test_sampling_rejection_resamples_from_the_residual_only():
    """t = [.5, .5, 0], d = [1, 0, 0], draft 0: accepted half the time; after a rejection the
    residual is [0, .5, 0], so the recovered token is always 1 (never the target's own 0)."""
    n = 4000
    target = torch.tensor([[[0.5, 0.5, 0.0], [0.1, 0.1, 0.8]]]).repeat(n, 1, 1)
    draft = torch.tensor([[[1.0, 0.0, 0.0]]]).repeat(n, 1, 1)
    verdict = speculative_sample(target, torch.zeros(n, 1, dtype=torch.long), torch.ones(n, dtype=torch.long),
                                 draft, torch.Generator().manual_seed(2))
    rejected = verdict.accepted == 0
    assert bool((verdict.next_token[rejected] == 1).all())
    assert abs(rejected.float().mean().item() - 0.5) < 0.04  # 0.04 is > 5 standard deviations
    # overall first token: 0 w.p. 0.5 (accepted), 1 w.p. 0.5 (recovered), as the target says


def test_sampling_one_hot_drafts_accept_with_target_probability():
    """No draft distribution (prompt lookup): accept with target_probs[d], else resample with d
    removed."""
    n = 4000
    target = torch.tensor([[[0.3, 0.5, 0.2], [0.0, 1.0, 0.0]]]).repeat(n, 1, 1)
    verdict = speculative_sample(target, torch.zeros(n, 1, dtype=torch.long), torch.ones(n, dtype=torch.long),
                                 None, torch.Generator().manual_seed(3))
    accepted = verdict.accepted == 1
    assert abs(accepted.float().mean().item() - 0.3) < 0.04
    assert bool((verdict.next_token[accepted] == 1).all())  # bonus from target_probs[:, 1]
    assert bool((verdict.next_token[~accepted] != 0).all())  # the rejected draft is never resampled


def test_sampling_draft_lengths_zero_samples_from_target():
    target = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])
    draft = torch.tensor([[[0.0, 0.0, 1.0]], [[0.0, 0.0, 1.0]]])
    verdict = speculative_sample(target, torch.tensor([[2], [2]]), torch.tensor([0, 1]), draft,
                                 torch.Generator().manual_seed(4))
    # row 0 offered nothing even though its padded draft would match: plain target sample
    assert verdict.accepted.tolist() == [0, 0]
    assert verdict.next_token.tolist() == [2, 1]


def test_sampling_same_seed_same_verdict_and_uses_the_given_generator():
    g = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(64, 4, 7, generator=g), -1)
    draft = torch.softmax(torch.randn(64, 3, 7, generator=g), -1)
    drafts = torch.multinomial(draft.view(-1, 7), 1, generator=g).view(64, 3)
    lengths = torch.randint(0, 4, (64,), generator=g)
    runs = []
    for global_seed in (11, 12):
        torch.manual_seed(global_seed)  # the global RNG must not matter
        v = speculative_sample(target, drafts, lengths, draft, torch.Generator().manual_seed(5))
        runs.append((v.accepted, v.next_token))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    other = speculative_sample(target, drafts, lengths, draft, torch.Generator().manual_seed(6))
    assert not (torch.equal(other.accepted, runs[0][0]) and torch.equal(other.next_token, runs[0][1]))


# -- hypothesis properties ---------------------------------------------------------------------
@st.composite
def greedy_cases(draw):
    """Random [B, K+1, V] logits and drafts that follow the argmax chain for a random stretch."""
    batch, k, vocab = draw(st.integers(1, 5)), draw(st.integers(0, 6)), draw(st.integers(2, 9))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(batch, k + 1, vocab, generator=g)  # continuous: no argmax ties
    chain = logits.argmax(-1)  # [B, K+1]
    follow = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=k, max_size=k),
                                        min_size=batch, max_size=batch)), dtype=torch.bool).view(batch, k)
    noise = torch.randint(0, vocab, (batch, k), generator=g)
    drafts = torch.where(follow, chain[:, :k], noise)
    lengths = torch.tensor(draw(st.lists(st.integers(0, k), min_size=batch, max_size=batch)))
    return logits, drafts, lengths


def argmax_walk(logits_row: torch.Tensor, drafts_row: torch.Tensor, length: int) -> tuple[int, int]:
    """Reference greedy verification of one row in plain Python: (accepted, next token)."""
    accepted = 0
    while accepted < length and int(drafts_row[accepted]) == int(logits_row[accepted].argmax()):
        accepted += 1
    return accepted, int(logits_row[accepted].argmax())


@settings(max_examples=200, deadline=None)
@given(greedy_cases())
def test_greedy_equals_the_argmax_chain_row_by_row(case):
    logits, drafts, lengths = case
    verdict = greedy_verify(logits, drafts, lengths)
    assert verdict.accepted.shape == lengths.shape and verdict.next_token.shape == lengths.shape
    for b in range(logits.shape[0]):
        acc, nxt = int(verdict.accepted[b]), int(verdict.next_token[b])
        assert 0 <= acc <= int(lengths[b]) <= drafts.shape[1]
        assert (acc, nxt) == argmax_walk(logits[b], drafts[b], int(lengths[b]))
        # committed block = accepted draft prefix + exactly one target token
        block = drafts[b, :acc].tolist() + [nxt]
        assert block == logits[b, : acc + 1].argmax(-1).tolist()
        # rows are independent: the row alone gives the same verdict
        alone = greedy_verify(logits[b: b + 1], drafts[b: b + 1], lengths[b: b + 1])
        assert (int(alone.accepted), int(alone.next_token)) == (acc, nxt)


@st.composite
def sampling_cases(draw):
    """Random target/draft distributions with zeros (as top-k/top-p make), drafts sampled from the
    draft distribution (or point masses), and a few rows whose draft equals the target."""
    batch, k, vocab = draw(st.integers(1, 6)), draw(st.integers(0, 5)), draw(st.integers(2, 8))
    one_hot = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def sparse_probs(*shape):  # [..., V], each row keeps at least one token
        logits = torch.randn(*shape, vocab, generator=g) * 2
        drop = torch.rand(*shape, vocab, generator=g) < 0.4
        drop[..., 0] &= ~drop.all(-1)  # never drop everything
        return torch.softmax(logits.masked_fill(drop, float("-inf")), -1)

    target = sparse_probs(batch, k + 1)  # [B, K+1, V]
    same = torch.tensor(draw(st.lists(st.booleans(), min_size=batch, max_size=batch)))  # [B]
    if one_hot:
        draft_probs = None
        drafts = torch.randint(0, vocab, (batch, k), generator=g)
        if k:  # rows where the target is itself a point mass on the draft: must be all accepted
            point = torch.nn.functional.one_hot(drafts, vocab).float()
            target[:, :k] = torch.where(same[:, None, None], point, target[:, :k])
    else:
        draft_probs = sparse_probs(batch, k)  # [B, K, V]
        draft_probs = torch.where(same[:, None, None], target[:, :k], draft_probs)
        drafts = (torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=g).view(batch, k)
                  if k else torch.zeros(batch, 0, dtype=torch.long))
    lengths = torch.tensor(draw(st.lists(st.integers(0, k), min_size=batch, max_size=batch)))
    seed = draw(st.integers(0, 2**31 - 1))
    return target, drafts, lengths, draft_probs, same, seed


@settings(max_examples=200, deadline=None)
@given(sampling_cases())
def test_sampling_verdicts_keep_their_invariants(case):
    target, drafts, lengths, draft_probs, same, seed = case
    verdict = speculative_sample(target, drafts, lengths, draft_probs, torch.Generator().manual_seed(seed))
    vocab = target.shape[-1]
    for b in range(target.shape[0]):
        acc, nxt = int(verdict.accepted[b]), int(verdict.next_token[b])
        assert 0 <= acc <= int(lengths[b]) <= drafts.shape[1]
        assert 0 <= nxt < vocab
        # every accepted draft is possible under the target
        for i in range(acc):
            assert float(target[b, i, drafts[b, i]]) > 0
        # the one extra token: bonus from the target, or recovered from the residual
        t_next = target[b, acc]
        assert float(t_next[nxt]) > 0
        if acc < int(lengths[b]):
            d_next = (draft_probs[b, acc] if draft_probs is not None
                      else torch.nn.functional.one_hot(drafts[b, acc], vocab).float())
            assert float(t_next[nxt]) > float(d_next[nxt])  # residual max(0, t - d) > 0 there
        if bool(same[b]):  # a draft distributed exactly as the target is never rejected
            assert acc == int(lengths[b])


@settings(max_examples=100, deadline=None)
@given(sampling_cases())
def test_sampling_is_reproducible_per_seed(case):
    target, drafts, lengths, draft_probs, _, seed = case
    a = speculative_sample(target, drafts, lengths, draft_probs, torch.Generator().manual_seed(seed))
    b = speculative_sample(target, drafts, lengths, draft_probs, torch.Generator().manual_seed(seed))
    assert torch.equal(a.accepted, b.accepted) and torch.equal(a.next_token, b.next_token)
