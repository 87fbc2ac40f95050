"""DecodeRun: everything one ``generate()`` call owns, and one step of its loop.

A run is made after validation and before any forward. It owns the target's
:class:`~specdec.state.ModelState`, the assistants' states (plugins hold only
:class:`~specdec.assistant.Assistant` handles), the generator's session, the draft-length
policy, the stopper, the streamer feed, the statistics and the finished rows. Nothing in it is
shared with another call, so one :class:`~specdec.decoder.SpecDecoder` serves concurrent calls.

One :meth:`DecodeRun.step`, the algorithm::

    plan      policy.plan(remaining [B], pending, context)   -> asked [B]  (all a row may take without a policy)
    propose   session.propose(ctx, asked)                    -> Proposal: token_ids [B, K], lengths [B], probs
    admit     check_proposal; made [B] = min(lengths, asked), admissible, cut before a lookup's draft a
              processor forbids; candidates [B] = cut after a drafted end of sequence;
              offered [B] = policy.admit(candidates)
    forward   target.append(drafts [B, k]); target.forward() -> logits [B, k+1, V]  (first step: prefill too)
    verify    processors.apply -> scores [B, k+1, V] (generate()'s at each position, specdec/processors.py);
              greedy_verify | speculative_sample             -> accepted [B], next_token [B]
    commit    block [B, k+1] = accepted drafts + next token;  stopper.cut -> keep [B], stopped [B];
              stopper.settle -> kept [B], finished [B] (generate()'s padding rule, specdec/stopping.py);
              target.commit: one realign of the target's cache
    observe   StepRecord -> statistics, streamer, followers.sync, session.observe, policy.observe;
              finished rows leave every state, the session and the policy

A proposal with ``parents`` (a token tree, docs/trees.md) is admitted by its node count, fed in
the same one forward with the tree layout through the eager engine (``specdec.engines``), its
scores processed along each node's own path, verified from the root (``tree_greedy_verify``,
``tree_point_mass_sample``) and turned into the chain it accepted: the target's cache keeps the
accepted nodes' entries moved into chain order (``specdec.accepted.keep_path``), and from there the
step is a chain's (commit, stopping, streamer, followers). A tree the step cannot verify (a
grammar, a distributed call, a model the engine refuses) is verified as its leading chain.

The record of a step is built once and read by everyone who learns from the step; the policy is
met only through ``plan``, ``admit`` and ``observe`` (and, from the generator, through the
context it was built with: ``ctx.draft_rate`` and ``ctx.keep_drafting``).

:class:`DecodeRun` holds what the call owns, the assistants' attachment, the step itself and its
forward; the step's parts are mixins of their own: plan, propose and admit
(:mod:`specdec.run_drafts`), token trees (:mod:`specdec.run_trees`), scores and a chain's verdict
(:mod:`specdec.run_scores`), commit and observe (:mod:`specdec.run_commit`), finished rows and the
output (:mod:`specdec.run_output`).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .accepted import committed_hidden
from .assistant import Assistant
from .compiled import compile_seconds
from .device import DeviceTimer
from .engines import call_begins
from .generators import CandidateGenerator, DecodeContext, StepRecord, TargetHidden, declared_drafting, plugin_name
from .host import host_ints, host_long
from .kv import CacheSettings, static_problem
from .metrics import AcceptanceStats
from .modelinfo import kv_layout, vocab_size
from .multimodal import check_assistant
from .outputs import ScoreRecorder
from .policy import DraftPolicy
from .probes import both_ways_problem, slot_problem
from .request import CallSettings, Prompt
from .run_commit import CommitSteps
from .run_drafts import CATCH_UP, DraftSteps
from .run_output import OutputSteps
from .run_scores import ScoreSteps
from .run_trees import TreeSteps
from .shared_prefill import shared_prefix
from .state import ModelState, cache_problem
from .stopping import StreamFeed
from .validation import check_hidden_layers

__all__ = ["CATCH_UP", "DecodeRun"]


class DecodeRun(DraftSteps, TreeSteps, ScoreSteps, CommitSteps, OutputSteps):
    def __init__(self, target, generator: CandidateGenerator, prompt: Prompt, settings: CallSettings, *,
                 tokenizer=None, draft_tokenizer=None):
        self.settings, self.stopper = settings, settings.stopper
        self.spec, self.width = prompt.spec, prompt.rows.shape[1]
        prefill, positions = prompt.spec.for_model(target) if prompt.prefix is None else (None, None)
        self.target = ModelState(target, prompt.rows, prompt.lengths, pad_token_id=settings.pad,
                                 prefill_inputs=prefill, positions=positions, **self._cache_args(target))
        # a re-fed token widens every row's next forward: a plain step of a batch would then cost
        # several, so the target's rows that end apart are shifted into line instead (a copy of the
        # lagging rows' cache; docs/performance.md, "Batches")
        self.target.refeed_limit = 0
        if not settings.cache.own_forward:  # engine="eager" is no sign of use: another decoder's packing is its own
            call_begins(target)  # a model called again gets its weights packed (the CPU engine)
        if prompt.prefix is not None:
            self.target.continue_from(prompt.prefix)
        self.followers: list[ModelState] = []  # assistants in the target's token space
        self.own: list[ModelState] = []  # assistants in their own token space
        self.borrowers: list[ModelState] = []  # followers whose cache mirrors the target's
        self.ranks = settings.ranks  # specdec/distributed/: the decisions ranks share
        self.session = self.ranks.session(generator)
        self.plugin = plugin_name(generator)
        self.drafting = declared_drafting(self.session, self.plugin)  # priors, max drafts, stepwise
        self.policy = DraftPolicy.for_call(self.drafting, prompt.rows.shape[0], settings.sampling.do_sample,
                                           target.device.type, self.plugin)  # None: the generator's own lengths
        self.processors = settings.processors or None  # an empty list processes nothing
        self.ctx = DecodeContext(target, tokenizer, draft_tokenizer, settings.sampling, settings.generator,
                                 prompt.spec.user_inputs, self.target, self._attach, self.policy,
                                 self.stopper.ended if self.stopper.eos_ids else None,  # None: no draft can end a row
                                 self._draft_scores if self.processors is not None else None,
                                 can_mirror=self.target.kv.cache is not None)
        # validates and attaches assistants: still before any forward (every rank agrees it went well)
        self.ranks.together(lambda: self.session.setup(self.ctx))
        self.target.hidden_layers = self._hidden_layers(target)
        self._share_prefill(target, prompt)
        self.vocab = vocab_size(target)
        self.stats = AcceptanceStats()
        if self.policy is not None:  # drafting is priced by the assistants just attached
            self._price(prompt, settings.cache)
        self.feed = StreamFeed(settings.streamer)
        if settings.stream_prompt:
            self.feed.prompt(prompt.input_ids)
        self.prompt_lengths = prompt.lengths.clone()
        self.row_ids = torch.arange(prompt.rows.shape[0], device=prompt.rows.device)  # original row of each row
        self.outputs: list[torch.Tensor | None] = [None] * prompt.rows.shape[0]
        self.stopper.begin(prompt.input_ids, settings.pad, self.outputs, settings.output_scores)
        self.timer = DeviceTimer(self.target.device)  # the target's forward, each step
        self.recorder = ScoreRecorder(prompt.rows.shape[0], settings.output_scores, settings.output_logits)
        self._tree_engine = None  # the engine that runs tree forwards (CPU or eager), made at the first tree
        self._tree_refusal: str | None = None  # why this call verifies trees as chains (None: it does not)

    def _share_prefill(self, target, prompt: Prompt) -> None:
        """Rows that repeat a prompt continue from one prefill of it (``specdec/shared_prefill.py``):
        once the generator is set up and every check has passed, before the first forward."""
        shared = shared_prefix(target, prompt, self.settings, self.target.hidden_layers)
        if shared is not None:
            self.target.continue_from(shared, owned=True)  # made for this call: its cache is not copied

    def _hidden_layers(self, target) -> tuple[int, ...]:
        """The target's hidden states the generator reads, checked, read after its ``setup`` (a
        generator may learn them there, from the head it loads): every target forward returns them
        (specdec.engines.forwards on a CPU, a tree's engine)."""
        layers = self.session.drafting().hidden_layers
        if layers and not self.target.kv.returns_hidden:
            raise ValueError(f"{self.plugin} reads the target's hidden states, which engine={self._engine!r} does not "
                             "return (use engine='auto')")
        return check_hidden_layers(layers, target, self.plugin) if layers else ()

    @property
    def _engine(self) -> str:
        """The engine the target's forwards run on (its cache backend's settings)."""
        return self.target.kv.settings.engine

    @property
    def assistants(self) -> list[ModelState]:
        """Every assistant's state, followers first (the order the policy prices them in)."""
        return [*self.followers, *self.own]

    def _cache_args(self, model, cache: CacheSettings | None = None) -> dict:
        """How ``model`` keeps its cache this call: as the call says, unless ``cache`` overrides."""
        cache = cache or self.settings.cache
        if cache.static:
            problem = static_problem(model, prefill_inputs=bool(self.spec.user_inputs))
            if problem:
                raise ValueError(problem)
        return {"kv": cache, "max_new_tokens": self.settings.max_new_tokens}

    def _check_assistant(self, model, tokens, prefill_from_target: bool) -> None:
        """Refuse an assistant this run cannot keep in step (ValueError); the checks that may run
        forwards last."""
        problem = cache_problem(model, self.target.batch_size)
        if problem:
            raise ValueError(f"assistant: {problem}")
        if prefill_from_target:
            if self.target.kv.cache is None:
                raise ValueError(f"{self.plugin} mirrors the target's transformers cache into its draft model's; "
                                 f"engine={self._engine!r} keeps the target's keys and values itself (use engine='auto')")
            if tokens is not None:
                raise ValueError("prefill_from_target needs an assistant that shares the target's tokens (no tokens=)")
            if kv_layout(model) != kv_layout(self.ctx.target):
                raise ValueError(f"prefill_from_target needs the target's cache layout (layers, key/value heads, "
                                 f"head size): {type(model).__name__} has {kv_layout(model)}, the target "
                                 f"{kv_layout(self.ctx.target)}")
            if self.spec.user_inputs:
                raise ValueError(f"prefill_from_target needs a prompt of token ids alone; this call also passes "
                                 f"{sorted(self.spec.user_inputs)} (the target's prefill-only inputs)")
        check_assistant(self.ctx.target, model)
        self.ranks.check_assistant(model, prefill_from_target)
        device = next(model.parameters()).device
        if device != self.target.device:
            raise ValueError(f"the assistant is on {device} and the target on {self.target.device}; "
                             "put both on one device")
        # the last checks: they may run forwards
        problem = both_ways_problem(model) or slot_problem(model, self.target.batch_size)
        if problem:
            raise ValueError(f"assistant: {problem}")

    def _attach(self, model, tokens=None, lengths=None, pad_token_id=None, cache_implementation=None,
                compile=None, compile_widths=None, prefill_from_target=False, owned=False) -> Assistant:
        self._check_assistant(model, tokens, prefill_from_target)
        cache = None
        if cache_implementation is not None or compile is not None or compile_widths is not None or owned:
            base = self.settings.cache
            cache = CacheSettings.make(cache_implementation or base.implementation,
                                       (base.options or base.compile) if compile is None else compile,
                                       compile_widths or base.widths)
            # keeps the warmed-up lengths and the call's choice of head
            cache = dataclasses.replace(cache, lengths=base.lengths, owned=bool(owned), fast_head=base.fast_head,
                                        engine=base.engine)
        if tokens is None:  # follows the target's tokens: the run keeps it in step
            prefill, positions = self.spec.for_model(model)  # the inputs its forward declares; its own positions
            state = ModelState(model, self.target.tokens[:, : self.width], self.target.lengths,
                               pad_token_id=self.settings.pad, prefill_inputs=prefill, positions=positions,
                               strict_positions=False, **self._cache_args(model, cache))
            self.followers.append(state)
            if prefill_from_target:
                self.borrowers.append(state)
        else:  # its own token space (another tokenizer): the generator keeps it in step
            pad = self.settings.pad if pad_token_id is None else pad_token_id
            state = ModelState(model, tokens, lengths, pad_token_id=pad, prefill_inputs=self.spec.plain_inputs(model),
                               strict_positions=False, **self._cache_args(model, cache))
            self.own.append(state)
        return Assistant(state, follows_target=tokens is None)

    # -- the loop ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Plan, propose, admit, forward, verify, commit, observe; return whether any row is still decoding."""
        started, target, compiled_before = time.perf_counter(), self.target, compile_seconds()
        room = self._room()  # [B]
        pending, context = target.pending_width(), target.cached_slots  # context: slots attended besides those fed
        first = target.is_first_iteration
        asked = self._plan(room, pending, context)  # [B]
        catching_up = self._catching_up(asked)
        proposal, drafted, (made, candidates, offered) = self.ranks.drafts(  # the decider's, on every rank
            lambda: self._draft(asked, room), room, self.drafting.max_drafts, target)  # [B] each
        k = max(host_ints(offered), default=0)
        draft_ids = proposal.token_ids[:, :k].to(target.device)  # [B, k]
        parents = proposal.parents[:, :k].to(target.device) if proposal.is_tree else None  # [B, k]
        committed = target.lengths  # [B] (a state's lengths are replaced, never written in place)
        self.timer.begin(drafted)
        logits = self._forward(draft_ids, offered, committed, parents)  # [B, k+1, V]
        self.timer.end()
        depth = None  # [B] a tree's depth
        if parents is None:
            scores = self._scores(logits, draft_ids, offered, committed)  # [B, k+1, V] as generate() processes them
            verifiable, dead = self._dead_ends(scores, offered)  # a grammar's position where nothing is allowed
            verdict = self.ranks.verdict(lambda: self._verify(scores, draft_ids, verifiable, proposal, dead),
                                         self.settings.sampling.do_sample, draft_ids)
        else:  # a tree: verified from the root, then the chain it accepted (columns and cache entries)
            scores, logits, draft_ids, verdict, dead, depth = self._tree_step(logits, draft_ids, parents, offered,
                                                                              committed, proposal.probs)
        block, kept, finished, held = self._commit(scores, draft_ids, verdict, committed, chain=parents is None)
        if dead is not None:
            self._refuse_dead_end(dead, kept, committed)
        if self.recorder:
            self.recorder.record(self.row_ids, kept, scores, logits)
        record = StepRecord(
            offered, verdict.accepted, asked=asked, made=made, candidates=candidates, kept=kept, room=room,
            sources=proposal.sources.cpu() if proposal.sources is not None else None,
            confidence=proposal.confidence, fed=(pending + k) * target.batch_size, context=context,
            first=first, catching_up=catching_up, waiting=first and bool(self.borrowers),
            compiling=compile_seconds() - compiled_before, started=started, drafting=drafted - started,
            forward=self.timer.seconds(), verifying=time.perf_counter() - drafted,
            grammar_drafts=proposal.grammar_drafts, tree=parents is not None, depth=depth,
            hidden=TargetHidden(*committed_hidden(target, committed + verdict.accepted)) if target.hidden_layers else None)
        self._observe(record, block, committed, held)
        if finished is not None and any(host_ints(finished)):
            self._retire(finished)
        return bool(self.row_ids.numel())

    def _forward(self, draft_ids: torch.Tensor, offered: torch.Tensor, committed: torch.Tensor,
                 parents: torch.Tensor | None = None) -> torch.Tensor:
        """Feed the pending tokens and row b's first ``offered[b]`` drafts -> logits [B, k+1, V] from
        each row's last committed token on (queued on a GPU: the step's read of its verdict waits).
        With ``parents [B, k]`` the drafts are a tree's nodes, fed with its layout through the eager
        engine: column i+1 is then the logits after node i's own chain."""
        self.target.append(draft_ids, offered)
        start = host_long([n - 1 for n in host_ints(committed)], committed.device)  # [B] each row's last committed token
        if parents is None:
            return self.target.forward(start=start)
        return self.target.forward_tree(start, (parents, offered, self._tree_engine))

    def states(self) -> list[ModelState]:
        """The target's state and every assistant's."""
        return [self.target, *self.followers, *self.own]

    def release(self) -> None:
        """Hand static caches back for reuse (also when a call ends early with an exception)."""
        for state in self.states():
            state.release()
