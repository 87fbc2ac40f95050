"""The cost-aware draft-length policy: pure-function properties, the cost model, the tracker,
and its behaviour inside the loop (exactness unchanged; skipping when drafting cannot pay)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SpecDecoder
from specdec.generators import CandidateGenerator, DraftingInfo, Proposal, declared_drafting
from specdec.metrics import AcceptanceStats
from specdec.models import tiny_random
from specdec import policy as policy_module
from specdec.policy import (COST_GRID, CONTEXT_GRID, LOAD_RATE, AcceptanceTracker, ConfidenceCalibration, CostModel,
                            DraftPolicy, choose_width, expected_tokens)

from helpers import ForwardRecorder, repetitive_prompt

K = 8
probability = st.floats(0.0, 1.0, allow_nan=False)


@st.composite
def situations(draw):
    batch = draw(st.integers(1, 4))
    accept = torch.tensor(draw(st.lists(st.lists(probability, min_size=K, max_size=K), min_size=batch,
                                        max_size=batch)), dtype=torch.float64)
    available = torch.tensor(draw(st.lists(st.integers(0, K), min_size=batch, max_size=batch)))
    base = draw(st.floats(0.01, 1.0))
    slope = draw(st.floats(0.0, 0.5))
    draft = draw(st.floats(0.0, 0.5))
    widths = torch.arange(K + 1, dtype=torch.float64)
    seconds = base * (1 + slope * widths) + draft * widths  # increasing in the width
    return accept, available, seconds


def test_expected_tokens_follows_the_formula():
    accept = torch.tensor([[0.5, 0.5, 1.0]])
    assert expected_tokens(accept).tolist() == [[1.0, 1.5, 1.75, 2.0]]


@settings(max_examples=300, deadline=None)
@given(situations())
def test_choice_maximises_the_batch_rate_of_the_formula(case):
    """choose_width (plain Python numbers) picks the smallest width of best rate E / T, with E from
    expected_tokens and each row verifying min(W, what it offers)."""
    accept, available, seconds = case
    expected = expected_tokens(accept)  # [B, K+1]
    taken = torch.minimum(torch.arange(K + 1)[None, :], available[:, None])
    rate = expected.gather(1, taken).sum(0) / seconds
    rate = rate[: int(available.max()) + 1]
    width = choose_width(accept, available, seconds)
    assert float(rate[width]) >= float(rate.max()) * (1 - 1e-9)
    assert all(float(r) < float(rate.max()) * (1 - 1e-9) for r in rate[:width])


@settings(max_examples=300, deadline=None)
@given(situations())
def test_never_more_than_any_row_can_offer(case):
    accept, available, seconds = case
    width = choose_width(accept, available, seconds)
    assert 0 <= width <= int(available.max())


@settings(max_examples=300, deadline=None)
@given(situations(), st.floats(0.0, 1.0))
def test_lower_acceptance_never_chooses_more_drafts(case, factor):
    accept, available, seconds = case
    assert choose_width(accept * factor, available, seconds) <= choose_width(accept, available, seconds)


@settings(max_examples=200, deadline=None)
@given(situations())
def test_zero_when_drafting_cannot_pay(case):
    accept, available, seconds = case
    # a verification of w drafts commits at most w + 1 tokens: if it costs w + 1 steps or more, it never pays
    costly = seconds[0] * (torch.arange(K + 1, dtype=torch.float64) + 1) * 1.01
    assert choose_width(accept, available, costly) == 0
    assert choose_width(torch.zeros_like(accept), available, seconds) == 0  # nothing is ever accepted


def test_free_verification_of_certain_drafts_takes_them_all():
    accept = torch.ones(2, K, dtype=torch.float64)
    assert choose_width(accept, torch.tensor([3, 5]), torch.ones(K + 1)) == 5


def test_cost_model_interpolates_and_follows_observations():
    model = CostModel([1.0 + x / 8 for x in COST_GRID])
    assert float(model.predict(3)) == pytest.approx(1 + 3 / 8)
    model.observe(16, 100.0)  # one forward slowed by another process moves the model by at most 1.5x ** rates
    assert float(model.predict(16)) <= (1 + 16 / 8) * 1.5 ** (LOAD_RATE + model.rate) + 1e-9
    for _ in range(200):  # the machine became slower for wide forwards
        model.observe(16, 10.0)
    assert float(model.predict(16)) == pytest.approx(10.0, rel=0.05)
    assert float(model.predict(32)) >= float(model.predict(16))  # never cheaper to feed more
    fixed = CostModel.fixed("cpu")
    before = fixed.predict(8).item()
    fixed.observe(8, 100.0)
    assert fixed.predict(8).item() == before


def test_a_slower_machine_makes_every_width_slower():
    """Observations at one width (the common one-token step) scale the widths never observed too,
    so a loaded machine does not make a draft look free."""
    model = CostModel([1.0 + x / 8 for x in COST_GRID])
    for _ in range(100):
        model.observe(1, 2 * (1 + 1 / 8))  # every one-token forward now takes twice as long
    assert float(model.predict(1)) == pytest.approx(2 * (1 + 1 / 8), rel=0.05)
    assert float(model.predict(2)) > float(model.predict(1)) * 1.05  # a draft still costs something
    assert float(model.predict(8)) > 1.5 * (1 + 8 / 8)


def test_cost_model_by_context():
    short = [1.0 + x / 8 for x in COST_GRID]
    long = [1.0 + x / 2 for x in COST_GRID]  # wide forwards cost more over a long context
    model = CostModel([short, long], contexts=(0, 1000))
    assert float(model.predict(4, 0)) == pytest.approx(1.5)
    assert float(model.predict(4, 1000)) == pytest.approx(3.0)
    assert float(model.predict(4, 500)) == pytest.approx(2.25)
    assert float(model.predict(4, 5000)) == pytest.approx(3.0)  # constant past the ends
    for _ in range(300):
        model.observe(4, 4.0, context=1000)
    assert float(model.predict(4, 1000)) == pytest.approx(4.0, rel=0.05)
    with pytest.raises(ValueError, match="seconds must be"):
        CostModel([short], contexts=(0, 1000))


def test_calibration_stops_at_its_budget_after_one_round_and_says_so(capsys, monkeypatch):
    """A first call must not stall behind calibration on a busy machine: once the budget has passed,
    no further round starts, the rounds timed so far decide, and stderr says how many were kept."""
    from specdec.policy import costs

    monkeypatch.delenv("SPECDEC_QUIET", raising=False)
    target, _ = tiny_random("llama", seed=3)
    rounds = []
    real = costs._time_widths

    def spy(*args, **kwargs):
        seconds = real(*args, **kwargs)
        rounds.append(capsys.readouterr().err)
        return seconds

    monkeypatch.setattr(costs, "_time_widths", spy)
    model = costs.calibrate(target, torch.arange(5, 20), budget=0.0)
    assert "1 of 3 rounds kept" in rounds[-1] and bool((model.seconds > 0).all())
    costs.calibrate(target, torch.arange(5, 20))  # the default budget: every round on a tiny model
    assert "rounds kept" not in rounds[-1]


def test_calibration_keeps_each_widths_fastest_round():
    """Another process slowed the 16-token forward in two rounds of three: the median kept a slowed
    one, and the policy then priced that width (and the widths interpolated from it) far above its
    cost for the life of the process, avoiding exactly the width whose price it never saw again."""
    from specdec.policy import costs

    class SlowedKV:  # a cache backend whose forwards take a set time: 1 ms a token; two 16-token ones 20 ms
        sixteens, cache = 0, None

        def padded_width(self, width, first):
            return width

        def forward(self, model, kwargs, first_slot, width, **_):
            if width == 16:
                self.sixteens += 1
            time.sleep(0.02 if width == 16 and self.sixteens <= 2 else 1e-3 * width)

        def crop(self, *_):
            pass

    seconds = costs._time_widths(None, SlowedKV(), "past_key_values", torch.arange(8), 3, (1, 2, 4, 16), 60.0)
    assert seconds[3] < 0.019  # the unslowed round: about 16 ms


def test_calibration_times_a_short_context_and_longer_ones_learn_from_observed_forwards():
    """The first calibration times one short context only (no long prefill in a first call); a
    longer context's row, its one-token cost included, follows what forwards there take, while
    the calibrated row's one-token cost moves only with the machine's load."""
    target, _ = tiny_random("llama", seed=3)
    model = policy_module.calibrate(target, torch.arange(5, 20))
    assert model.contexts == [float(c) for c in CONTEXT_GRID]
    assert bool((model.seconds > 0).all()) and torch.equal(model.seconds[0], model.seconds[-1])
    assert model.anchored == {0}
    short, _ = tiny_random("llama", seed=3, max_position_embeddings=24)
    assert bool((policy_module.calibrate(short, torch.arange(5, 20)).seconds > 0).all())
    grown = CostModel([[1.0 + x / 8 for x in COST_GRID]] * len(CONTEXT_GRID), contexts=CONTEXT_GRID, anchored=(0,))
    for _ in range(400):  # one-token forwards after 2048 cached tokens take twice what the curve says
        grown.observe(1, 2 * (1 + 1 / 8), context=CONTEXT_GRID[-1])
        grown.observe(1, 1 + 1 / 8, context=CONTEXT_GRID[0])  # and after 32 what it says
    assert float(grown.predict(1, CONTEXT_GRID[-1])) == pytest.approx(2 * (1 + 1 / 8), rel=0.1)
    assert float(grown.predict(1, CONTEXT_GRID[0])) == pytest.approx(1 + 1 / 8, rel=0.1)


def test_acceptance_tracker_counts_positions_and_decays():
    tracker = AcceptanceTracker(2, 4, prior=0.5, prior_weight=1.0, decay=0.5, idle_decay=0.5)
    tracker.update(torch.tensor([3, 2]), torch.tensor([1, 2]))  # row 0: d1 kept, d2 rejected; row 1: both kept
    est = tracker.estimate()
    assert est[0, 0] > 0.5 and est[0, 1] < est[0, 0]
    assert est[0, 2] == est[0, 1]  # position 3, never reached, borrows from position 2
    assert est[1, 0] > 0.5 and est[1, 1] > 0.5
    for _ in range(30):  # no drafting: back to the prior, so the row probes again later
        tracker.update(torch.tensor([0, 0]), torch.tensor([0, 0]))
    assert torch.allclose(tracker.estimate(), torch.full((2, 4), 0.5, dtype=torch.float64), atol=1e-6)


def test_each_source_of_drafts_is_learnt_apart():
    tracker = AcceptanceTracker(2, 4, prior=(0.8, 0.4), prior_weight=1.0, decay=0.5, idle_decay=0.5)
    assert torch.equal(tracker.estimate(torch.tensor([1, 0]))[:, 0], torch.tensor([0.4, 0.8], dtype=torch.float64))
    for _ in range(10):  # row 0's source-1 drafts all rejected; row 1's source-0 drafts all accepted
        tracker.update(torch.tensor([3, 3]), torch.tensor([0, 3]), sources=torch.tensor([1, 0]))
    assert tracker.estimate(torch.tensor([1, 1]))[0, 0] < 0.15  # source 1 of row 0 learnt: never right
    assert tracker.estimate(torch.tensor([0, 0]))[0, 0] == pytest.approx(0.8, abs=0.01)  # its source 0: the prior
    assert tracker.estimate(torch.tensor([0, 0]))[1, 0] > 0.9
    assert tracker.estimate(torch.tensor([1, 1]))[1, 0] == pytest.approx(0.4, abs=0.01)
    tracker.select_rows(torch.tensor([1]))
    assert tracker.estimate().shape == (1, 4) and tracker.estimate()[0, 0] > 0.9


def test_an_untried_source_is_tried_once_at_the_optimistic_price_then_its_record_decides():
    """Costs of 1 + k/8 per forward and a draft token at half a step: at the prior of 0.5 no block
    pays, at 0.8 for the first draft one does. The untried source is asked for drafts; after one verified block its
    record decides: a rejected first draft stops drafting, accepted ones keep it going."""
    costs = CostModel([1 + x / 8 for x in COST_GRID], rate=0.0)
    remaining = torch.tensor([20])
    plain = DraftPolicy(costs, AcceptanceTracker(1, 8, prior=0.5), 8, 0.5)
    assert int(plain.budget(remaining, 1)) == 0  # without the rule the draft is never tried
    for accepted, drafts_after in ((0, False), (3, True)):
        tracker = AcceptanceTracker(1, 8, prior=(0.5, 0.9), untried=0.8)
        policy = DraftPolicy(costs, tracker, 8, 0.5)
        assert tracker.estimate(torch.tensor([1]))[0].tolist() == [0.9] + [0.5] * 7  # a prior above it stands, first
        first = int(policy.budget(remaining, 1))
        assert first > 0 and tracker.estimate()[0].tolist() == [0.8] + [0.5] * 7  # a short try
        tracker.update(torch.tensor([0]), torch.tensor([0]))  # a step without drafts tries nothing
        assert tracker.untried[0] == 0.8
        tracker.update(torch.tensor([first]), torch.tensor([min(accepted, first)]))
        assert tracker.untried == [None, 0.9]  # source 1 was not drafted from: still untried
        assert (int(policy.budget(remaining, 1)) > 0) == drafts_after, accepted


class OracleOrRandom(CandidateGenerator):
    """Source 0 proposes the target's own continuation (always accepted); with ``alternate``,
    every other step is source 1's random ids (never accepted). ``log`` (shared by sessions) gets
    (source, offered, rate of source 0, rate of source 1, drafts asked for) per step."""

    def __init__(self, reference: torch.Tensor, log: list, alternate: bool = True):
        self.reference, self.log, self.alternate = reference, log, alternate

    def drafting(self):
        return DraftingInfo(priors=(0.5, 0.5))

    def propose(self, ctx, max_drafts):
        self.rates = [ctx.draft_rate(max_drafts, source) for source in (0, 1)]  # what each source would pay
        self.source, n = len(self.log) % 2 if self.alternate else 0, int(max_drafts.max())
        self.cap = n
        start = int(ctx.lengths[0])
        right = self.reference[:, start: start + n]
        ids = right if self.source == 0 else torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(start))
        return Proposal(ids, torch.tensor([ids.shape[1]]).clamp(max=max_drafts), sources=torch.tensor([self.source]))

    def observe(self, ctx, feedback):
        self.log.append((self.source, int(feedback.offered[0]), *(float(r[0]) for r in self.rates), self.cap))


def run_oracle(new_tokens: int, alternate: bool) -> tuple[list, AcceptanceStats]:
    """Decode with :class:`OracleOrRandom` on a CPU-like cost curve; check the output is exact;
    return its log and stats."""
    target, _ = tiny_random("llama", seed=3)
    cpu_like(target)
    ids = repetitive_prompt(8)
    reference = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    log: list = []
    out = SpecDecoder(target, OracleOrRandom(reference, log, alternate)).generate(ids, max_new_tokens=new_tokens)
    assert torch.equal(out.sequences, reference)
    return log, out.stats


def test_the_policy_verifies_each_source_by_its_own_acceptance():
    log, _ = run_oracle(120, alternate=True)
    later = log[6:]
    right = sorted(k for source, k, *_ in later if source == 0)
    wrong = sorted(k for source, k, *_ in later if source == 1)
    assert right and wrong and right[len(right) // 2] >= 4, log  # the oracle's blocks stay long
    assert wrong[len(wrong) // 2] <= 1, log  # the random source's blocks shrink to one draft or none
    # what ctx.draft_rate tells a generator choosing between its sources: the oracle pays more
    # (wherever a row may draft at all: with no room left both rates are plain decoding's)
    assert all(oracle > random for _, _, oracle, random, cap in later if cap > 0), log


def test_a_free_generator_is_asked_for_all_and_verified_by_each_proposals_source():
    """Source 0 barely accepted, source 1 mostly: sized by source 0 before the proposal, nothing is
    asked for; a generator whose drafts are free (``DraftingInfo.free``) is asked for all a row may
    take, and admit() verifies a source-1 proposal's drafts and no source-0 proposal's."""
    costs = CostModel([1 + x / 8 for x in COST_GRID], rate=0.0)
    remaining = torch.tensor([6])

    def policy(free: bool) -> DraftPolicy:
        return DraftPolicy(costs, AcceptanceTracker(1, 8, prior=(0.02, 0.95)), 8, 0.0, measured=False, free=free)

    assert policy(False).plan(remaining, 1, 0, []).tolist() == [0]
    verified = []
    for source in (0, 1):
        free = policy(True)
        assert free.plan(remaining, 1, 0, []).tolist() == [6]
        verified += free.admit(torch.tensor([6]), torch.tensor([source]), None).tolist()
    assert verified[0] == 0 and verified[1] >= 3, verified


def test_draft_rate_is_none_without_the_policy_and_checks_its_source():
    target, _ = tiny_random("llama", seed=3)
    seen = []

    class Asks(CandidateGenerator):
        name = "asks"

        def __init__(self, own_lengths: bool, source: int = 0):
            self.own_lengths, self.source = own_lengths, source

        def drafting(self):
            return DraftingInfo(max_drafts=None if self.own_lengths else 4)  # None: its own lengths, no policy

        def propose(self, ctx, max_drafts):
            seen.append(ctx.draft_rate(max_drafts, self.source))
            paid.append(ctx.draft_rate(max_drafts, self.source, paid=True))
            return Proposal.empty(ctx.batch_size)

    paid = []
    SpecDecoder(target, Asks(True)).generate(repetitive_prompt(8), max_new_tokens=3)
    assert seen and all(rate is None for rate in seen + paid)
    seen.clear(), paid.clear()
    SpecDecoder(target, Asks(False)).generate(repetitive_prompt(8), max_new_tokens=3)
    assert seen and all(rate.shape == (1,) and float(rate[0]) > 0 for rate in seen)
    assert all(float(p[0]) >= float(r[0]) for p, r in zip(paid, seen))  # drafts already made cost nothing more
    with pytest.raises(ValueError, match="asks: draft_rate.source=1"):
        SpecDecoder(target, Asks(False, source=1)).generate(repetitive_prompt(8), max_new_tokens=3)


def test_a_proposals_sources_are_checked():
    target, _ = tiny_random("llama", seed=3)

    class BadSource(CandidateGenerator):
        name = "bad_source"

        def propose(self, ctx, max_drafts):
            return Proposal(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                            sources=torch.tensor([1]))  # one source only (the default priors)

    with pytest.raises(ValueError, match="bad_source.*Proposal.sources"):
        SpecDecoder(target, BadSource()).generate(repetitive_prompt(8), max_new_tokens=5)


class Random(CandidateGenerator):
    """Proposes random ids (never right on a random model): drafting cannot pay."""

    def propose(self, ctx, max_drafts):
        g = torch.Generator().manual_seed(int(ctx.lengths.sum()))
        return Proposal(torch.randint(0, 250, (ctx.batch_size, int(max_drafts.max())), generator=g), max_drafts)


def cpu_like(model) -> None:
    """Pin a 2-core-CPU-like cost curve (a k-token forward costs 1 + k/8 one-token forwards): a
    tiny model's measured curve is flat, where every draft is almost free to verify."""
    CostModel.pin(model, CostModel([0.05 * (1 + x / 8) for x in COST_GRID], rate=0.0))


def test_auto_stops_drafting_when_nothing_is_accepted_and_stays_exact():
    """Drafts that are never right end in plain steps and one-draft probes. On this cost curve a
    one-draft step costs 1/9 more than a plain one and the estimate hovers at that break-even, so
    the policy probes on about every other step (40-48 plain steps of 80 on this project's
    machines, as their own step overheads shift that break-even): the bounds leave room for that."""
    target, _ = tiny_random("llama", seed=3)
    cpu_like(target)
    ids = repetitive_prompt(8)
    out = SpecDecoder(target, Random()).generate(ids, max_new_tokens=80)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=80, do_sample=False))
    stats = out.stats
    blocks = stats.drafts_verified  # steps that verified 0, 1, 2, ... drafts
    assert sum(blocks[2:]) <= 1, blocks  # one untried block at most; afterwards single-draft probes
    assert stats.skipped_share >= 0.4, blocks  # no fewer plain steps than probes, give or take
    assert stats.drafted_tokens <= 0.6 * stats.steps, blocks  # well under one draft per step


def test_auto_drafts_long_blocks_where_drafts_are_right():
    log, stats = run_oracle(80, alternate=False)
    assert stats.acceptance_rate == 1.0
    assert max(step[1] for step in log) >= 8, log  # blocks of many drafts were verified


def test_a_draft_model_too_slow_to_pay_is_never_run():
    """Before drafting is timed, a draft token is priced at the draft's bytes relative to the
    target's one-token forward: a draft as large as the target cannot pay at the prior acceptance,
    so it is not even prefilled; a much smaller one drafts from the first step."""
    target, _ = tiny_random("llama", seed=3)
    cpu_like(target)
    ids = repetitive_prompt(8)
    reference = target.generate(ids, max_new_tokens=20, do_sample=False)
    heavy = copy.deepcopy(target)
    light, _ = tiny_random("llama", seed=4, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)
    for draft, runs in ((heavy, False), (light, True)):
        recorder = ForwardRecorder(draft)
        out = SpecDecoder(target, draft).generate(ids, max_new_tokens=20)
        assert torch.equal(out.sequences, reference)
        assert bool(recorder.calls) == runs and (out.stats.drafted_tokens > 0) == runs


def test_sampling_with_auto_is_reproducible_and_timing_free():
    target, _ = tiny_random("llama", seed=3)
    ids = repetitive_prompt(8)
    runs = [SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=40, do_sample=True,
                                                         generator=torch.Generator().manual_seed(11))
            for _ in range(2)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].stats.calibration_seconds == 0.0  # no timing entered the decisions


# -- the drafter's own probability ---------------------------------------------------------------
def test_confidence_changes_nothing_until_it_has_meant_something():
    calibration = ConfidenceCalibration((0.8, 0.5))
    assert calibration.factor(0.05) == pytest.approx(1.0) and calibration.factor(0.95, 1) == pytest.approx(1.0)
    # source 0: drafts given 0.9 or more are always accepted, drafts given under 0.3 never
    for _ in range(30):
        calibration.update(torch.tensor([[0.95, 0.2, 0.95], [0.97, float("nan"), 0.95]]),
                           offered=torch.tensor([3, 3]), accepted=torch.tensor([1, 3]))
    assert calibration.factor(0.2) < 0.3 < 1.0 < calibration.factor(0.95)
    assert calibration.factor(0.6) == pytest.approx(1.0)  # no draft seen there
    assert calibration.factor(0.2, 1) == pytest.approx(1.0)  # the other source is learnt apart
    # row 0's third draft was never reached (its second was rejected), row 1's NaN is no confidence
    assert sum(calibration.offered[0]) == pytest.approx(4 * sum(0.99 ** i for i in range(30)), rel=1e-6)


def confident_policy(drafts_seconds: float = 0.2) -> DraftPolicy:
    """One row, costs of 1 + k/8 per forward, a draft token at ``drafts_seconds``, acceptance 0.9,
    and a drafter whose drafts given under 0.3 have been rejected and over 0.9 accepted."""
    policy = DraftPolicy(CostModel([1 + x / 8 for x in COST_GRID], rate=0.0), AcceptanceTracker(1, 16, prior=0.9),
                         16, drafts_seconds)
    for _ in range(40):
        policy.calibration.update(torch.tensor([[0.95, 0.95, 0.1]]), torch.tensor([3]), torch.tensor([2]))
    return policy


def test_a_block_ends_at_a_draft_its_drafter_doubts():
    policy, available = confident_policy(), torch.tensor([16])
    sure = torch.full((1, 3), 0.97)
    assert policy.keep_drafting(sure, available, pending=1)
    assert not policy.keep_drafting(torch.tensor([[0.97, 0.97, 0.1]]), available, pending=1)
    # once drafted, the doubted draft is not verified; the sure ones before it are
    offered = policy.trim(torch.tensor([3]), 1, confidence=torch.tensor([[0.97, 0.97, 0.1]]))
    assert offered.tolist() == [2]
    assert policy.trim(torch.tensor([3]), 1, confidence=sure).tolist() == [3]
    # without confidences, the tracker's estimate decides, as before
    assert policy.trim(torch.tensor([3]), 1).tolist() == [3]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=15), st.integers(1, 16))
def test_never_drafts_past_what_a_row_may_offer(confidences, cap):
    policy = confident_policy(0.01)
    made = torch.tensor([confidences])
    if made.shape[1] >= cap:
        assert not policy.keep_drafting(made, torch.tensor([cap]), pending=1)


def test_a_drafters_confidence_is_checked():
    target, _ = tiny_random("llama", seed=3)

    class BadConfidence(CandidateGenerator):
        name = "bad_confidence"

        def propose(self, ctx, max_drafts):
            return Proposal(torch.zeros(1, 2, dtype=torch.long), torch.full((1,), 2), confidence=torch.ones(1, 1))

    with pytest.raises(ValueError, match="bad_confidence.*Proposal.confidence"):
        SpecDecoder(target, BadConfidence()).generate(repetitive_prompt(8), max_new_tokens=5)


def test_prompt_lookup_names_each_rows_match_length_and_agreement_as_its_source():
    """Two sources per n-gram length from max_ngram down to min_ngram, uncontested then contested,
    each with its own prior; a row's source is the length of the suffix it matched and whether
    that suffix's earlier occurrences disagree on the next token (the latest one's is proposed)."""
    from types import SimpleNamespace

    from candidate_generators.prompt_lookup import NGRAM_PRIOR, PromptLookupGenerator, lookup_match
    from candidate_generators.self_draft import SelfDraftGenerator

    gen = PromptLookupGenerator()  # n-grams 4..2
    assert gen.drafting().priors == (*NGRAM_PRIOR[4], *NGRAM_PRIOR[3], *NGRAM_PRIOR[2])
    assert all(sure > contested for sure, contested in NGRAM_PRIOR.values())
    assert PromptLookupGenerator(max_ngram=6, min_ngram=1).drafting().priors[:6] == NGRAM_PRIOR[4] * 3
    assert SelfDraftGenerator(lookup=True).drafting().priors == (0.85, *gen.drafting().priors)
    rows = [[1, 2, 3, 4, 9, 9, 1, 2, 3, 4],  # a 4-gram seen before: 9, 9, 1 follow it
            [5, 6, 7, 8, 0, 6, 7, 8],  # the 3-gram 6 7 8 (not 0 6 7 8): 0, 6, 7 follow it
            [5, 6, 7, 8, 0, 3, 7, 8],  # only 7 8
            [1, 2, 3, 4, 5, 6, 7, 8],  # nothing
            [7, 8, 1, 7, 8, 2, 7, 8]]  # 7 8 seen twice, followed by 1 and by 2: contested; 2, 7, 8 follow the latest
    tokens = torch.zeros(len(rows), 12, dtype=torch.long)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.tensor(row)
    ctx = SimpleNamespace(tokens=tokens, lengths=torch.tensor([len(r) for r in rows]), batch_size=len(rows),
                          token_lists=lambda: rows)
    gen.setup(ctx)
    proposal = gen.propose(ctx, torch.full((len(rows),), 3))
    assert proposal.sources.tolist() == [0, 2, 4, 0, 5]
    assert proposal.lengths.tolist() == [3, 3, 3, 0, 3]
    assert proposal.token_ids[0].tolist() == [9, 9, 1] and proposal.token_ids[1].tolist() == [0, 6, 7]
    assert proposal.token_ids[4].tolist() == [2, 7, 8]
    match = lookup_match(torch.tensor(rows[2]), 4, 2, 5)
    assert (match.n, match.contested, match.drafts.tolist()) == (2, False, [0, 3, 7, 8])
    match = lookup_match(torch.tensor(rows[4] + [1]), 4, 1, 5)  # 7 8 1 seen once: uncontested
    assert (match.n, match.contested, match.drafts.tolist()) == (3, False, [7, 8, 2, 7, 8])
    match = lookup_match(torch.tensor(rows[4]), 4, 2, 5)
    assert (match.n, match.contested, match.drafts.tolist()) == (2, True, [2, 7, 8])


def test_drafts_the_policy_declines_to_verify_count_as_skipped_drafting():
    """Drafts asked for (source 0 looks worth it) but from a source the policy has learnt to
    decline (one rejected block at a low prior) are not verified, and those steps count as
    skipped drafting, as steps where no drafts were asked for do."""
    target, _ = tiny_random("llama", seed=3)
    CostModel.pin(target, CostModel([0.05 * (1 + 0.7 * (x > 1) + x / 16) for x in COST_GRID], rate=0.0))

    class Declined(CandidateGenerator):
        name = "declined"

        def drafting(self):
            return DraftingInfo(priors=(0.9, 0.05))

        def propose(self, ctx, max_drafts):
            g = torch.Generator().manual_seed(int(ctx.lengths.sum()))
            ids = torch.randint(0, 250, (ctx.batch_size, int(max_drafts.max())), generator=g)
            return Proposal(ids, max_drafts.clone(), sources=torch.ones(ctx.batch_size, dtype=torch.long))

    ids = repetitive_prompt(8)
    out = SpecDecoder(target, Declined()).generate(ids, max_new_tokens=40)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=40, do_sample=False))
    stats = out.stats
    assert stats.drafts_verified[0] >= stats.steps - 2, stats.drafts_verified  # one block tried, then none
    assert stats.skipped_steps >= stats.steps - 3, (stats.skipped_steps, stats.steps)


# -- what a generator declares ---------------------------------------------------------------------
def test_a_generator_declares_its_drafting_in_one_piece_and_the_earlier_hooks_still_count():
    """``drafting()`` gives priors, the most drafts and stepwise at once; a plugin that still
    defines ``acceptance_prior``, ``draft_cap`` or ``drafts_stepwise`` gets them honoured with a
    DeprecationWarning, also below a built-in that defines ``drafting()``."""
    from candidate_generators.draft_model import DraftModelGenerator
    from candidate_generators.prompt_lookup import PromptLookupGenerator

    assert declared_drafting(Random(), "random") == DraftingInfo((0.5,), 16, False)
    assert declared_drafting(PromptLookupGenerator(schedule="fixed"), "pl").max_drafts is None
    assert DraftingInfo(0.7).priors == (0.7,)

    class Earlier(CandidateGenerator):
        drafts_stepwise = True

        def acceptance_prior(self):
            return (0.6, 0.3)

        def draft_cap(self):
            return 5

    class SureDraft(DraftModelGenerator):
        def acceptance_prior(self):
            return 0.95

    with pytest.warns(DeprecationWarning, match="acceptance_prior"):
        assert declared_drafting(Earlier(), "earlier") == DraftingInfo((0.6, 0.3), 5, True)
    target, _ = tiny_random("llama", seed=3)
    with pytest.warns(DeprecationWarning, match="acceptance_prior"):
        assert declared_drafting(SureDraft(target), "sure") == DraftingInfo((0.95,), 16, True)

    class Bad(CandidateGenerator):
        def drafting(self):
            return DraftingInfo(priors=(0.5, 1.0))

        def propose(self, ctx, max_drafts):
            return Proposal.empty(ctx.batch_size)

    with pytest.raises(ValueError, match="bad_prior: the acceptance priors"):
        declared_drafting(Bad(), "bad_prior")
    with pytest.raises(ValueError, match="max_drafts"):
        declared_drafting(type("Zero", (Bad,), {"drafting": lambda self: DraftingInfo(max_drafts=0)})(), "zero")


def test_source_0s_drafts_counted_as_made_cost_nothing_more():
    """``rates(..., paid=True)``: source 0's drafts priced as already made this step (a batch's
    draft model steps every row when any row drafts from it): the rate of a step whose drafting
    takes no time, above the one that pays for its drafts."""
    costs = CostModel([1 + x / 64 for x in COST_GRID], rate=0.0)
    policy = DraftPolicy(costs, AcceptanceTracker(1, 8, prior=0.9), 8, 0.3)
    counts = torch.tensor([6])
    paid, unpaid = float(policy.rates(counts, 1, 0, 0, paid=True)), float(policy.rates(counts, 1, 0, 0))
    assert policy.draft_seconds_per_token > 0 and paid > unpaid
    policy.draft_seconds_per_token = 0.0
    assert float(policy.rates(counts, 1, 0, 0)) == pytest.approx(paid)


def test_a_row_ahead_of_the_batch_is_worth_only_its_share_of_a_step():
    """With one row ahead of three, its drafts save only its part of later steps: a block that pays
    when every token counts alike does not pay; rows equally far from their end (and one row) are
    valued as before."""
    costs = CostModel([1 + x / 64 for x in COST_GRID], rate=0.0)  # a batch step feeding more tokens costs little more
    policy = DraftPolicy(costs, AcceptanceTracker(4, 8, prior=0.9), 8, 0.05)
    assert policy.row_values(torch.tensor([20, 20, 20, 20]), 1, 0) is None
    assert policy.row_values(torch.tensor([20]), 1, 0) is None
    value = policy.row_values(torch.tensor([20, 20, 14, 20]), 1, 0)
    share = (costs.predict(4).item() - costs.predict(3).item()) / costs.predict(4).item()
    assert value.tolist() == pytest.approx([1 / 3, 1 / 3, share, 1 / 3])
    only_ahead = torch.tensor([0, 0, 4, 0])  # the row ahead is the only one with drafts
    accept = policy.acceptance.estimate()
    seconds = policy._step_seconds(4, 1, 0, policy.draft_seconds_per_token)
    assert choose_width(accept, only_ahead, seconds) > 0  # every token alike: it pays
    assert choose_width(accept, only_ahead, seconds, value) == 0  # worth its share only: it does not
    everyone = torch.tensor([4, 4, 4, 4])
    assert choose_width(accept, everyone, seconds, value) > 0  # the last rows' drafts still pay


def test_what_a_step_that_verified_drafts_costs_besides_its_forward_is_learnt_apart():
    """Steps that verified drafts pay more outside the forward (rows realigned, assistants kept in
    step): learnt apart from plain steps, from the plain steps' figure on, so that a batch where
    that extra outweighs what the drafts save stays plain; plain steps do not move it."""
    costs = CostModel([0.05 * (1 + x / 16) for x in COST_GRID], rate=0.0)
    policy = DraftPolicy(costs, AcceptanceTracker(4, 8, prior=0.5), 8, 0.005)
    for _ in range(10):
        policy.observe_overhead(0.002)
    assert policy.draft_overhead is None and policy.step_overhead == pytest.approx(0.002, rel=0.2)
    before = policy._step_seconds(4, 1, 0, policy.draft_seconds_per_token)
    assert before[1] - before[0] == pytest.approx(costs.predict(8).item() - costs.predict(4).item() + 0.005)
    available = torch.tensor([8, 8, 8, 8])
    assert choose_width(policy.acceptance.estimate(), available, before) > 0
    policy.observe_overhead(0.08, drafts=True)
    assert policy.draft_overhead == pytest.approx(0.8 * policy.step_overhead + 0.2 * 0.08)
    for _ in range(20):
        policy.observe_overhead(0.08, drafts=True)
        policy.observe_overhead(0.002)
    after = policy._step_seconds(4, 1, 0, policy.draft_seconds_per_token)
    assert after[0] == pytest.approx(before[0], rel=0.01) and after[1] > before[1] + 0.07
    assert choose_width(policy.acceptance.estimate(), available, after) == 0
    for _ in range(120):  # steps that drafted nothing: it drifts back, and drafting is tried again
        policy.observe_idle()
    assert policy.draft_overhead < 0.08 * 0.1
    assert choose_width(policy.acceptance.estimate(), available, policy._step_seconds(4, 1, 0, 0.0)) > 0


def test_a_first_slow_draft_is_not_a_drafts_price_and_a_call_that_stopped_drafting_tries_again():
    """An assistant's first proposal in the process carries first-use work (allocations, a first
    run of its forward): it is not learnt from. A measured cost then replaces the prior, and where
    the call stops drafting it drifts back towards the prior, so one slow measurement cannot end
    drafting for the rest of the call."""
    costs = CostModel([0.04 * (1 + x / 8) for x in COST_GRID], rate=0.0)
    policy = DraftPolicy(costs, AcceptanceTracker(1, 8, prior=0.9), 8)
    policy.assistant, policy.first_use = torch.nn.Linear(2, 2), True
    policy.draft_prior = policy.draft_seconds_per_token = 0.01
    policy.observe_drafting(1.0, 1)  # the first proposal: 1 s for one draft, not a draft's cost
    assert policy.draft_seconds_per_token == 0.01 and not policy.drafting_measured
    policy.observe_drafting(0.5, 2)
    assert policy.draft_seconds_per_token == pytest.approx(0.25) and policy.drafting_measured
    assert policy_module.DraftingMemory.share(policy.assistant) == pytest.approx(0.25 / costs.predict(1).item())
    seconds = policy._step_seconds(1, 1, 0, policy.draft_seconds_per_token)
    assert choose_width(policy.acceptance.estimate(), torch.tensor([8]), seconds) == 0  # too dear to draft
    for _ in range(30):
        policy.observe_idle()  # steps that drafted nothing
    assert 0.01 < policy.draft_seconds_per_token < 0.5 * 0.25 + 0.01
    # and so does what the process remembers for the next call
    assert policy_module.DraftingMemory.share(policy.assistant) == pytest.approx(
        policy.draft_seconds_per_token / costs.predict(1).item())
    for _ in range(200):
        policy.observe_idle()
    seconds = policy._step_seconds(1, 1, 0, policy.draft_seconds_per_token)
    assert choose_width(policy.acceptance.estimate(), torch.tensor([8]), seconds) > 0  # worth a try again


def test_a_later_call_starts_from_the_drafting_cost_an_earlier_one_measured(monkeypatch):
    """The process remembers an assistant's measured drafting cost (as a share of a target step):
    the next call prices its drafts at it from the start and does not try the assistant in a short
    block as if its drafts were of unknown worth; output stays the target's."""
    target, _ = tiny_random("llama", seed=3)
    cpu_like(target)
    draft, _ = tiny_random("llama", seed=4, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)
    ids = repetitive_prompt(8)
    reference = target.generate(ids, max_new_tokens=20, do_sample=False)
    priced = []
    price = DraftPolicy.price

    def recording(self, *args, **kwargs):
        remembered = policy_module.DraftingMemory.share(draft)
        spent = price(self, *args, **kwargs)
        priced.append((self, remembered, self.draft_seconds_per_token, self.drafting_measured,
                       list(self.acceptance.untried)))
        return spent

    monkeypatch.setattr(DraftPolicy, "price", recording)
    decoder = SpecDecoder(target, draft)
    for _ in range(2):
        assert torch.equal(decoder.generate(ids, max_new_tokens=20).sequences, reference)
    (first, nothing, _, measured_before, untried_before), (second, share, starting, measured, untried) = priced
    assert first.assistant is draft and nothing is None and not measured_before and untried_before[0] is not None
    assert share is not None and share > 0  # the first call measured it
    one_token = CostModel.for_model(target, ids[0])[0].predict(1).item()  # the pinned curve
    assert measured and untried[0] is None and starting == pytest.approx(share * one_token)


def test_a_noisy_calibration_round_gives_no_forward_a_negative_cost():
    """One round can time 16 tokens below 8 (another process ran meanwhile): a wider forward is
    taken to cost at least what a narrower one measured, so extrapolating past the last width
    never gives a cost below zero."""
    from specdec.policy.costs import COST_GRID, CostModel

    model = CostModel.from_timings([1, 2, 4, 8, 16], [4e-4, 5e-4, 8e-4, 9e-4, 5e-4])
    costs = model.seconds[0]
    assert bool((costs > 0).all()) and all(b >= a for a, b in zip(costs.tolist(), costs[1:].tolist()))
    assert float(model.predict(max(COST_GRID))) >= 9e-4


@pytest.mark.parametrize("arch, key", [("gpt2", "n_positions"), ("opt", "max_position_embeddings")])
def test_calibration_fits_a_small_position_table(arch, key):
    """The first call times forwards of up to 16 tokens; on a model with fewer learned positions
    than that they indexed past the table (IndexError) where generate() decodes."""
    target, _ = tiny_random(arch, seed=1, **{key: 8})
    ids = torch.tensor([[11, 89, 175, 11, 89]])
    want = target.generate(ids, max_new_tokens=2, do_sample=False)
    assert torch.equal(SpecDecoder(target, "prompt_lookup").generate(ids, max_new_tokens=2).sequences, want)
