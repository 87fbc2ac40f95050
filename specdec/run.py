"""DecodeRun: everything one ``generate()`` call owns, and one step of its loop.

A run is made after validation and before any forward. It owns the target's
:class:`~specdec.state.ModelState`, the assistants' states (plugins hold only
:class:`~specdec.assistant.Assistant` handles), the generator's session, the stopper, the
streamer feed, the statistics and the finished rows. Nothing in it is shared with another call,
so one :class:`~specdec.decoder.SpecDecoder` serves concurrent calls.

Data path of one :meth:`DecodeRun.step`::

    session.propose(ctx, max_drafts [B])          -> Proposal: token_ids [B, K], lengths [B], probs
    check_proposal (names the plugin)             ;  offered [B] = min(lengths, max_drafts, admissible),
                                                     cut after an end-of-sequence draft, trimmed by the policy
    target.append(drafts); target.forward()       -> logits [B, k+1, V]   (first step: prefill too)
    greedy_verify | speculative_sample            -> accepted [B], next_token [B]
    block [B, k+1] = accepted drafts + next token ;  stopper.cut -> keep [B], finished [B]
    target.commit(committed, block, keep, cached) :  one realign of the target's cache
    stats, streamer                               ;  followers.sync(target tokens); session.observe
    finished rows leave every state and the session
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from .assistant import Assistant
from .generators import CandidateGenerator, DecodeContext, Feedback
from .kv import CacheSettings, static_problem
from .metrics import AcceptanceStats
from .modelinfo import kv_layout, step_bytes, vocab_size
from .multimodal import PrefillSpec, Prefix, check_assistant
from .policy import UNTRIED, AcceptanceTracker, CostModel, DraftPolicy, synchronize
from .sampling import SamplingParams
from .state import ModelState, cache_problem
from .stopping import Stopper, StreamFeed
from .validation import check_proposal
from .verify import Verdict, greedy_verify, speculative_sample

#: tokens an assistant may have pending before a proposal (the target's newest, the last draft, a
#: re-tokenized tail) for the proposal's time to count as drafting cost: more is catching up
CATCH_UP = 4


@dataclass
class Prompt:
    """A validated prompt on the target's device."""

    input_ids: torch.Tensor  # [B, P] as given (left padding included)
    rows: torch.Tensor  # [B, P] row b's tokens from column 0
    lengths: torch.Tensor  # [B] tokens per row
    spec: PrefillSpec  # the rows the prefill-only inputs describe (this prompt's, or the prefix's)
    prefix: Prefix | None = None


@dataclass
class CallSettings:
    max_new_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None
    pad: int
    stopper: Stopper
    streamer: Any = None
    cache: CacheSettings = CacheSettings()


class DecodeRun:
    def __init__(self, target, generator: CandidateGenerator, prompt: Prompt, settings: CallSettings, *,
                 tokenizer=None, draft_tokenizer=None):
        self.settings, self.stopper = settings, settings.stopper
        self.spec, self.width = prompt.spec, prompt.rows.shape[1]
        prefill, positions = prompt.spec.for_model(target) if prompt.prefix is None else (None, None)
        self.target = ModelState(target, prompt.rows, prompt.lengths, pad_token_id=settings.pad,
                                 prefill_inputs=prefill, positions=positions, **self._cache_args(target))
        if prompt.prefix is not None:
            self.target.continue_from(prompt.prefix)
        self.followers: list[ModelState] = []  # assistants in the target's token space
        self.own: list[ModelState] = []  # assistants in their own token space
        self.borrowers: list[ModelState] = []  # followers whose cache mirrors the target's
        self.session = generator.session()
        self.plugin = generator.name or type(generator).__name__
        self.sources = 1  # sources of drafts the generator names: one per acceptance_prior() (see _policy)
        self.ctx = DecodeContext(target, tokenizer, draft_tokenizer, settings.sampling, settings.generator,
                                 prompt.spec.user_inputs, self.target, self._attach)
        self.session.setup(self.ctx)  # validates and attaches assistants: still before any forward
        self.vocab = vocab_size(target)
        self.stats = AcceptanceStats()
        self.policy = self._policy(target, prompt)
        self.step_shape = (0, 0)  # (pending, context) of the step being proposed: what draft_rate prices
        if self.policy is not None:
            self.ctx._rate = self._draft_rate
            self.ctx._keep = self._keep_drafting
        self.ctx._ended = self.stopper.ended
        self.feed = StreamFeed(settings.streamer)
        self.feed.prompt(prompt.input_ids)
        self.prompt_lengths = prompt.lengths.clone()
        self.row_ids = torch.arange(prompt.rows.shape[0], device=prompt.rows.device)  # original row of each row
        self.outputs: list[torch.Tensor | None] = [None] * prompt.rows.shape[0]

    def _cache_args(self, model, cache: CacheSettings | None = None) -> dict:
        """How ``model`` keeps its cache this call: as the call says, unless ``cache`` overrides."""
        cache = cache or self.settings.cache
        if cache.static:
            problem = static_problem(model, prefill_inputs=bool(self.spec.user_inputs))
            if problem:
                raise ValueError(problem)
        return {"kv": cache, "max_new_tokens": self.settings.max_new_tokens}

    def _attach(self, model, tokens=None, lengths=None, pad_token_id=None, cache_implementation=None,
                compile=None, compile_widths=None, prefill_from_target=False, owned=False) -> Assistant:
        problem = cache_problem(model, self.target.batch_size)
        if problem:
            raise ValueError(f"assistant: {problem}")
        if prefill_from_target:
            if tokens is not None:
                raise ValueError("prefill_from_target needs an assistant that shares the target's tokens (no tokens=)")
            if kv_layout(model) != kv_layout(self.ctx.target) or self.spec.user_inputs:
                raise ValueError(f"prefill_from_target needs the target's cache layout (layers, key/value heads, "
                                 f"head size) and a text-only prompt: {type(model).__name__} has "
                                 f"{kv_layout(model)}, the target {kv_layout(self.ctx.target)}")
        check_assistant(self.ctx.target, model)
        device = next(model.parameters()).device
        if device != self.target.device:
            raise ValueError(f"the assistant is on {device} and the target on {self.target.device}; "
                             "put both on one device")
        cache = None
        if cache_implementation is not None or compile is not None or compile_widths is not None or owned:
            base = self.settings.cache
            cache = CacheSettings.make(cache_implementation or base.implementation,
                                       (base.options or base.compile) if compile is None else compile,
                                       compile_widths or base.widths)
            # keeps the warmed-up lengths and the call's choice of head
            cache = dataclasses.replace(cache, lengths=base.lengths, owned=bool(owned), fast_head=base.fast_head)
        if tokens is None:  # follows the target's tokens: the run keeps it in step
            prefill, positions = self.spec.for_model(model)  # the inputs its forward declares; its own positions
            state = ModelState(model, self.target.tokens[:, : self.width], self.target.lengths,
                               pad_token_id=self.settings.pad, prefill_inputs=prefill, positions=positions,
                               **self._cache_args(model, cache))
            self.followers.append(state)
            if prefill_from_target:
                self.borrowers.append(state)
        else:  # its own token space (another tokenizer): the generator keeps it in step
            pad = self.settings.pad if pad_token_id is None else pad_token_id
            state = ModelState(model, tokens, lengths, pad_token_id=pad, prefill_inputs=self.spec.plain_inputs(model),
                               **self._cache_args(model, cache))
            self.own.append(state)
        return Assistant(state, follows_target=tokens is None)

    def _policy(self, target, prompt: Prompt) -> DraftPolicy | None:
        """The cost-aware draft-length policy, unless the generator sets its own draft lengths.
        Measured costs under greedy decoding; timing-free ones under sampling (see policy.py)."""
        prior = self.session.acceptance_prior()
        priors = tuple(prior) if isinstance(prior, (tuple, list)) else (prior,)
        if not priors or not all(isinstance(p, (int, float)) and 0.0 < p < 1.0 for p in priors):
            raise ValueError(f"{self.plugin}.acceptance_prior() must be in (0, 1) (a float, or one per source), "
                             f"got {prior!r}")
        self.sources = len(priors)
        cap = self.session.draft_cap()
        if cap <= 0:
            return None
        acceptance = AcceptanceTracker(prompt.rows.shape[0], cap, prior=priors, untried=UNTRIED)
        # decoding is bound by reading weights: an assistant's draft token costs about the bytes its
        # step reads relative to the target's one-token step (no assistant, e.g. prompt lookup: about nothing)
        self.weight = {id(s): step_bytes(s.model) / step_bytes(target) for s in (*self.followers, *self.own)}
        ratio = sum(self.weight.values())
        if self.settings.sampling.do_sample:
            return DraftPolicy(CostModel.fixed(target.device.type), acceptance, cap, ratio, measured=False)
        costs, spent = CostModel.for_model(target, prompt.rows[0, : int(prompt.lengths[0])], self.settings.cache,
                                           slots=self.target.kv.slots)
        self.stats.calibration_seconds += spent
        # the drafting cost's prior until propose() is first timed (the first proposal also prefills)
        per_token = ratio * float(costs.predict(prompt.rows.shape[0], float(prompt.lengths.max())))
        return DraftPolicy(costs, acceptance, cap, per_token)

    # -- the loop ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Propose, verify, commit, stop, sync; return whether any row is still decoding."""
        tick = time.perf_counter()
        target, policy = self.target, self.policy
        remaining = self.settings.max_new_tokens - (target.lengths - self.prompt_lengths) - 1  # [B]
        pending = target.pending_width()
        context = target.cached_slots  # cache slots the verification attends to besides its own tokens
        ask = self._ask(remaining, pending, context)  # [B]
        self.step_shape = (pending, context)
        first = target.is_first_iteration
        # an assistant that has not yet run prefills in this proposal, one that sat out steps first
        # catches up on their tokens: either way the proposal's time says nothing of a draft's cost
        catching_up = policy is not None and any(s.is_first_iteration or s.pending_width() > CATCH_UP
                                                 for s in (*self.followers, *self.own) if s not in self.borrowers)
        proposal = self.session.propose(self.ctx, ask)
        drafted = time.perf_counter()
        check_proposal(proposal, self.plugin, target.batch_size, self.vocab, self.settings.sampling.do_sample,
                       self.sources)
        offered = torch.minimum(proposal.lengths.to(target.device), ask).clamp_min(0)  # [B]
        offered = target.admissible_drafts(proposal.token_ids.to(target.device), offered)
        sources = proposal.sources.cpu() if proposal.sources is not None else None  # [B] or None: source 0
        if policy is not None:
            main = offered.cpu() if sources is None else offered.cpu()[sources == 0]  # drafts that cost time to make
            if not first and not catching_up and main.numel():
                policy.observe_drafting(drafted - tick, int(main.max()))
        offered = self.stopper.worth_verifying(proposal.token_ids.to(target.device), offered)
        if policy is not None:
            found = offered
            offered = policy.trim(offered, pending, context, sources, proposal.confidence)
            if not (first and self.borrowers):  # no drafts asked for, or none of those offered verified
                declined = (ask == 0) | ((found > 0) & (offered == 0))
                self.stats.skipped_steps += int((declined & (remaining > 0)).sum())
        k = int(offered.max())
        draft_ids = proposal.token_ids[:, :k].to(target.device)  # [B, k]
        committed = target.lengths.clone()  # [B]
        target.append(draft_ids, offered)
        logits = target.forward(start=committed - 1)  # [B, k+1, V]
        synchronize(target.device)
        forward_seconds = time.perf_counter() - drafted
        if not first:  # the prefill's cost says nothing about a verification's
            tokens = (pending + k) * target.batch_size
            self.stats.record_forward(tokens, forward_seconds)
            if policy is not None:
                policy.costs.observe(tokens, forward_seconds, context)
        verdict = self._verify(logits, draft_ids, offered, proposal)
        block = torch.cat([draft_ids, verdict.next_token[:, None]], dim=1)  # [B, k+1]
        block.scatter_(1, verdict.accepted[:, None], verdict.next_token[:, None])  # the target's token after the accepted
        keep, finished = self.stopper.cut(target.tokens, committed, block, verdict.accepted + 1,
                                          self.prompt_lengths, logits)
        target.commit(committed, block, keep, cached=committed + verdict.accepted)
        verified = time.perf_counter()

        self.stats.record_step(offered.tolist(), verdict.accepted.tolist(), keep.tolist())
        self.stats.draft_seconds += drafted - tick
        self.stats.verify_seconds += verified - drafted
        self.feed.tokens(block[0, : int(keep[0])])
        for state in self.followers:
            if state in self.borrowers:
                state.mirror(target)
            else:
                state.sync(target.tokens, target.lengths, since=committed)
        self.session.observe(self.ctx, Feedback(offered, verdict.accepted))
        if policy is not None:
            policy.acceptance.update(offered, verdict.accepted, sources)
            if proposal.confidence is not None:
                policy.calibration.update(proposal.confidence, offered, verdict.accepted, sources)
            if not first:
                policy.observe_overhead(time.perf_counter() - tick - forward_seconds - (drafted - tick))
        self.stats.draft_seconds += time.perf_counter() - verified  # keeping drafts in step is drafting work
        if bool(finished.any()):
            self._retire(finished)
        return bool(self.row_ids.numel())

    def _ask(self, remaining: torch.Tensor, pending: int, context: int) -> torch.Tensor:
        """[B] the drafts to ask each row for this step: none while assistants that borrow the
        target's prefill wait for it, all a row may take without a policy, else the policy's budget."""
        policy = self.policy
        if self.target.is_first_iteration and self.borrowers:  # they draft once they hold the target's prefill
            return torch.zeros_like(remaining)
        if policy is None:
            return remaining
        # an assistant's prefill still to come is paid once, so it is spread over the steps left;
        # and drafting starts only where a later step (one token pending) would draft too
        setup = self._setup() / max(int(remaining.max()), 1)
        ask = policy.budget(remaining, pending, context, setup)
        if setup > 0:
            steady = policy.budget(remaining, 1, context + pending, setup)
            ask = torch.where(steady > 0, ask, torch.zeros_like(ask))
        if self.session.drafts_stepwise:  # where drafting pays, its own probabilities end the block
            ask = torch.where(ask > 0, remaining.clamp(0, policy.max_drafts), ask)
        return ask

    def _draft_rate(self, counts: torch.Tensor, source: int) -> torch.Tensor:
        """``DecodeContext.draft_rate``: the policy's expected rate for this step's shape."""
        if not 0 <= int(source) < self.sources:
            raise ValueError(f"{self.plugin}: draft_rate(source={source}) needs a source in [0, {self.sources}) "
                             "(one per acceptance_prior())")
        return self.policy.rates(counts, *self.step_shape, int(source)).to(counts.device)

    def _keep_drafting(self, confidence: torch.Tensor, max_drafts: torch.Tensor) -> bool:
        """``DecodeContext.keep_drafting``: the policy's answer for this step's shape."""
        return self.policy.keep_drafting(confidence, max_drafts, *self.step_shape)

    def _setup(self) -> float:
        """Seconds the assistants that have not yet run would spend prefilling before their first
        draft (a cost drafting pays once), priced like a target forward over as many tokens,
        scaled by the assistant's bytes relative to the target's."""
        policy, seconds = self.policy, 0.0
        for state in (*self.followers, *self.own):
            if state.is_first_iteration and state not in self.borrowers:
                tokens = int(state.lengths.max()) * state.batch_size
                seconds += self.weight[id(state)] * float(policy.costs.predict(tokens))
        return seconds

    def _verify(self, logits: torch.Tensor, draft_ids: torch.Tensor, offered: torch.Tensor, proposal) -> Verdict:
        sampling = self.settings.sampling
        if not sampling.do_sample:
            return greedy_verify(logits, draft_ids, offered)
        k = draft_ids.shape[1]
        draft_probs = proposal.probs[:, :k].to(logits.device) if proposal.probs is not None else None
        return speculative_sample(sampling.probs(logits), draft_ids, offered, draft_probs, self.settings.generator)

    def _retire(self, finished: torch.Tensor) -> None:
        """Finished rows [B] bool leave the batch; their new tokens become output."""
        target = self.target
        for b in finished.nonzero().flatten().tolist():
            row = int(self.row_ids[b])
            self.outputs[row] = target.tokens[b, int(self.prompt_lengths[b]): int(target.lengths[b])].clone()
        rest = (~finished).nonzero().flatten()
        self.row_ids, self.prompt_lengths = self.row_ids[rest], self.prompt_lengths[rest]
        if rest.numel():
            for state in self.states():
                state.select_rows(rest)
            self.session.select_rows(rest)
            if self.policy is not None:
                self.policy.acceptance.select_rows(rest)

    def states(self) -> list[ModelState]:
        """The target's state and every assistant's."""
        return [self.target, *self.followers, *self.own]

    def release(self) -> None:
        """Hand static caches back for reuse (also when a call ends early with an exception)."""
        for state in self.states():
            state.release()

    def finish(self, input_ids: torch.Tensor, started: float) -> tuple[torch.Tensor, AcceptanceStats]:
        """-> (sequences [B, P + new]: the prompt as given, then each row's new tokens right-padded; stats)."""
        self.feed.end()
        self.stats.generator = self.session.report()
        self.stats.total_seconds = time.perf_counter() - started
        longest = max(o.numel() for o in self.outputs)
        new = input_ids.new_full((input_ids.shape[0], longest), self.settings.pad)
        for b, o in enumerate(self.outputs):
            new[b, : o.numel()] = o
        return torch.cat([input_ids, new], dim=1), self.stats
