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
accepted nodes' entries moved into chain order (``ModelState.keep_path``), and from there the
step is a chain's (commit, stopping, streamer, followers). A tree the step cannot verify (a
grammar, a distributed call, a model the engine refuses) is verified as its leading chain.

The record of a step is built once and read by everyone who learns from the step; the policy is
met only through ``plan``, ``admit`` and ``observe`` (and, from the generator, through the
context it was built with: ``ctx.draft_rate`` and ``ctx.keep_drafting``).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .assistant import Assistant
from .compiled import compile_seconds
from .forwards.packed import PackedLinears
from .device import synchronize
from .distributed import Solo
from .engines import Layout, LayoutNotSupported, engine_report, make_engine
from .generators import CandidateGenerator, DecodeContext, Proposal, StepRecord, TargetHidden, declared_drafting
from .grammar import no_allowed_token, with_grammar_drafts
from .kv import CacheSettings, static_problem
from .metrics import AcceptanceStats
from .modelinfo import kv_layout, vocab_size
from .multimodal import check_assistant
from .outputs import ScoreRecorder, SpecOutput
from .policy import DraftPolicy
from .request import CallSettings, Prompt
from .state import ModelState, cache_problem
from .stopping import StreamFeed
from .validation import check_hidden_layers, check_proposal
from .verify import (TreeVerdict, Verdict, greedy_verify, leaf_chains, speculative_sample, tree_greedy_verify,
                     tree_point_mass_sample)

#: tokens an assistant may have pending before a proposal (the target's newest, the last draft, a
#: re-tokenized tail) for the proposal's time to count as drafting cost: more is catching up
CATCH_UP = 4


class DecodeRun:
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
            PackedLinears.calling(target)  # a model called again gets its weights packed (forwards/packed.py)
        if prompt.prefix is not None:
            self.target.continue_from(prompt.prefix)
        self.followers: list[ModelState] = []  # assistants in the target's token space
        self.own: list[ModelState] = []  # assistants in their own token space
        self.borrowers: list[ModelState] = []  # followers whose cache mirrors the target's
        self.ranks = settings.ranks  # specdec/distributed/: the decisions ranks share
        self.session = self.ranks.session(generator)
        self.plugin = generator.name or type(generator).__name__
        self.drafting = declared_drafting(self.session, self.plugin)  # priors, max drafts, stepwise
        self.policy = DraftPolicy.for_call(self.drafting, prompt.rows.shape[0], settings.sampling.do_sample,
                                           target.device.type, self.plugin)  # None: the generator's own lengths
        self.processors = settings.processors or None  # an empty list processes nothing
        self.ctx = DecodeContext(target, tokenizer, draft_tokenizer, settings.sampling, settings.generator,
                                 prompt.spec.user_inputs, self.target, self._attach, self.policy, self.stopper.ended,
                                 self._draft_scores if self.processors is not None else None)
        # validates and attaches assistants: still before any forward (every rank agrees it went well)
        self.ranks.together(lambda: self.session.setup(self.ctx))
        self.target.hidden_layers = self._hidden_layers(target)
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
        self.recorder = ScoreRecorder(prompt.rows.shape[0], settings.output_scores, settings.output_logits)
        self._tree_engine = None  # the eager engine that runs tree forwards, made at the first tree
        self._tree_refusal: str | None = None  # why this call verifies trees as chains (None: it does not)

    def _price(self, prompt: Prompt, cache: CacheSettings) -> None:
        """The policy prices drafting with the assistants attached, calibrating on the call's cache
        where it can; the graphs that calibration compiled count as compiling, not timing."""
        compiled_before = compile_seconds()
        self.stats.calibration_seconds += self.policy.price(
            self.target.model, [s.model for s in self.assistants], prompt.rows, prompt.lengths, cache,
            self.target.kv.slots, kv=self.target.kv)
        compiled = compile_seconds() - compiled_before
        self.stats.calibration_seconds -= compiled
        self.stats.compile_seconds += compiled

    def _hidden_layers(self, target) -> tuple[int, ...]:
        """The target's hidden states the generator reads, checked, read after its ``setup`` (a
        generator may learn them there, from the head it loads): every target forward returns them
        (specdec.forwards on a CPU, a tree's engine)."""
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

    def _attach(self, model, tokens=None, lengths=None, pad_token_id=None, cache_implementation=None,
                compile=None, compile_widths=None, prefill_from_target=False, owned=False) -> Assistant:
        problem = cache_problem(model, self.target.batch_size)
        if problem:
            raise ValueError(f"assistant: {problem}")
        if prefill_from_target:
            if self.target.kv.cache is None:
                raise ValueError(f"{self.plugin} mirrors the target's transformers cache into its draft model's; "
                                 f"engine={self._engine!r} keeps the target's keys and values itself (use engine='auto')")
            if tokens is not None:
                raise ValueError("prefill_from_target needs an assistant that shares the target's tokens (no tokens=)")
            if kv_layout(model) != kv_layout(self.ctx.target) or self.spec.user_inputs:
                raise ValueError(f"prefill_from_target needs the target's cache layout (layers, key/value heads, "
                                 f"head size) and a text-only prompt: {type(model).__name__} has "
                                 f"{kv_layout(model)}, the target {kv_layout(self.ctx.target)}")
        check_assistant(self.ctx.target, model)
        self.ranks.check_assistant(model, prefill_from_target)
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
            cache = dataclasses.replace(cache, lengths=base.lengths, owned=bool(owned), fast_head=base.fast_head,
                                        engine=base.engine)
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
        k = int(offered.max())
        draft_ids = proposal.token_ids[:, :k].to(target.device)  # [B, k]
        parents = proposal.parents[:, :k].to(target.device) if proposal.is_tree else None  # [B, k]
        committed = target.lengths  # [B] (a state's lengths are replaced, never written in place)
        logits = self._forward(draft_ids, offered, committed, parents)  # [B, k+1, V]
        forwarded = time.perf_counter()
        dead = None
        if parents is None:
            scores = self._scores(logits, draft_ids, offered, committed)  # [B, k+1, V] as generate() processes them
            verifiable, dead = self._dead_ends(scores, offered)  # a grammar's position where nothing is allowed
            verdict = self.ranks.verdict(lambda: self._verify(scores, draft_ids, verifiable, proposal, dead),
                                         self.settings.sampling.do_sample, draft_ids)
        else:  # a tree: verified from the root, then the chain it accepted (columns and cache entries)
            scores = self._tree_scores(logits, draft_ids, parents, offered, committed)  # [B, k+1, V]
            verdict = self._verify_tree(scores, draft_ids, parents, offered)
            columns = torch.cat([torch.zeros_like(verdict.path[:, :1]), verdict.path + 1], dim=1)  # [B, k+1]
            draft_ids = draft_ids.gather(1, verdict.path)  # [B, k]: the accepted path's tokens first
            scores, logits = (_columns(x, columns) for x in (scores, logits))
            target.keep_path(committed, verdict.path, verdict.accepted)
        block, kept, finished = self._commit(scores, draft_ids, verdict, committed)  # [B, k+1], [B], [B]
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
            forward=forwarded - drafted, verifying=time.perf_counter() - drafted,
            grammar_drafts=proposal.grammar_drafts, tree=parents is not None,
            hidden=TargetHidden(*target.committed_hidden(committed + verdict.accepted)) if target.hidden_layers else None)
        self._observe(record, block, committed)
        if bool(finished.any()):
            self._retire(finished)
        return bool(self.row_ids.numel())

    def _room(self) -> torch.Tensor:
        """[B] the drafts each row may take: none past its budget (or past the stop of the last row
        to stop, when every row has stopped and some go on unpadded: specdec/stopping.py), none past
        the model's learned positions."""
        target = self.target
        room = self.stopper.end() - (target.lengths - self.prompt_lengths) - 1
        positions = target.position_room()  # [B] or None
        return room if positions is None else torch.minimum(room, positions.clamp_min(0))

    def _plan(self, room: torch.Tensor, pending: int, context: int) -> torch.Tensor:
        """[B] the drafts to ask each row for: the policy's plan, or all a row may take without one;
        none while assistants that borrow the target's prefill wait for it."""
        if self.policy is None:
            asked = room
        else:
            prefills = [int(s.lengths.max()) * s.batch_size if s.is_first_iteration and s not in self.borrowers
                        else 0 for s in self.assistants]  # tokens each assistant has yet to prefill
            asked = self.policy.plan(room, pending, context, prefills)
        if self.target.is_first_iteration and self.borrowers:  # they draft once they hold the target's prefill
            return torch.zeros_like(room)
        return asked

    def _catching_up(self, asked: torch.Tensor) -> bool:
        """Whether an assistant prefills (it has not yet run), catches up on steps it sat out, or
        takes the target's cache for the first time (drafts ``asked`` [B] of it) in this proposal:
        either way the proposal's time says nothing of a draft's cost."""
        return any((s.is_first_iteration and bool((asked > 0).any())) if s in self.borrowers
                   else s.is_first_iteration or s.pending_width() > CATCH_UP for s in self.assistants)

    def _draft(self, asked: torch.Tensor, room: torch.Tensor) -> tuple[Proposal, float, tuple[torch.Tensor, ...]]:
        """Propose and admit -> (proposal, when propose returned, (made, candidates, offered) [B] each);
        under a grammar, the drafts it forbids cut and the tokens it forces added. An assistant
        that borrows the target's cache takes it the first time drafts are asked for (a call
        that never drafts never copies it)."""
        waiting = [state for state in self.borrowers if state.is_first_iteration]
        if waiting and bool((asked > 0).any()):
            for state in waiting:
                state.mirror(self.target)
        proposal = self.session.propose(self.ctx, asked)
        drafted = time.perf_counter()
        made, candidates, offered = self._admit(proposal, asked)
        if proposal.is_tree:
            proposal, offered = self._tree_or_chain(proposal, offered)
        if self.processors is not None and self.processors.grammar is not None:
            proposal, offered = self._constrain(proposal, offered, room)
        return proposal, drafted, (made, candidates, offered)

    def _admit(self, proposal: Proposal, asked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A checked proposal -> (made, candidates, offered) [B] each: the drafts within ``asked``
        that the target can take, those worth verifying, those the policy verifies."""
        target = self.target
        check_proposal(proposal, self.plugin, target.batch_size, self.vocab, self.settings.sampling.do_sample,
                       len(self.drafting.priors))
        tree = proposal.is_tree
        if tree:
            self._check_tree(proposal)
        ids = proposal.token_ids.to(target.device)  # [B, K]
        # a tree's first nodes are a tree too (parents come first): a tree is cut like a chain
        made = target.admissible_drafts(ids, torch.minimum(proposal.lengths.to(target.device), asked).clamp_min(0))
        if self.processors is not None and self.processors.hard and not tree:
            made = self._allowed(ids, made, proposal.confidence)
        # a tree's node after an end of sequence in node order may be its sibling: nothing cut
        candidates = made if tree else self.stopper.worth_verifying(ids, made)
        if self.policy is None:
            return made, candidates, candidates
        sources = proposal.sources.cpu() if proposal.sources is not None else None  # [B] or None: source 0
        return made, candidates, self.policy.admit(candidates, sources, proposal.confidence)

    def _constrain(self, proposal: Proposal, offered: torch.Tensor, room: torch.Tensor) -> tuple[Proposal, torch.Tensor]:
        """The grammar's walk over the offered drafts (specdec/grammar.py) -> the proposal to verify
        (``grammar_drafts`` [B]: the trailing drafts it proposed), its drafts per row [B]."""
        target = self.target
        committed = [target.tokens[b, p:n].tolist() for b, (p, n) in
                     enumerate(zip(self.prompt_lengths.tolist(), target.lengths.tolist()))]
        room = room.clamp_min(0)
        if self.drafting.max_drafts is not None:  # the most a sharded target's ranks exchange
            room = room.clamp_max(self.drafting.max_drafts)
        rows, taken = self.processors.extend(proposal.token_ids, offered, committed, self.row_ids.tolist(),
                                             room.tolist())
        proposal = with_grammar_drafts(proposal, rows, taken)
        return proposal, proposal.lengths.to(offered.device)

    def _forward(self, draft_ids: torch.Tensor, offered: torch.Tensor, committed: torch.Tensor,
                 parents: torch.Tensor | None = None) -> torch.Tensor:
        """Feed the pending tokens and row b's first ``offered[b]`` drafts -> logits [B, k+1, V] from
        each row's last committed token on; waits for the device, so the forward can be timed.
        With ``parents [B, k]`` the drafts are a tree's nodes, fed with its layout through the eager
        engine: column i+1 is then the logits after node i's own chain."""
        self.target.append(draft_ids, offered)
        if parents is None:
            logits = self.target.forward(start=committed - 1)
        else:
            logits = self.target.forward_tree(committed - 1, (parents, offered, self._tree_engine))
        synchronize(self.target.device)
        return logits

    # -- token trees (docs/trees.md) ----------------------------------------------------------------
    def _check_tree(self, proposal: Proposal) -> None:
        """A proposal's ``parents`` must be a well-formed tree over its drafts; name the plugin if not."""
        where = f"candidate generator {self.plugin!r}"
        parents = proposal.parents
        if not isinstance(parents, torch.Tensor) or tuple(parents.shape) != tuple(proposal.token_ids.shape):
            raise ValueError(f"{where}: Proposal.parents must be None or a long tensor shaped like token_ids "
                             f"{tuple(proposal.token_ids.shape)}, got "
                             f"{tuple(parents.shape) if isinstance(parents, torch.Tensor) else type(parents).__name__}")
        try:
            Layout.tree(parents, lengths=proposal.lengths.to(parents.device))
        except ValueError as error:
            raise ValueError(f"{where}: Proposal.parents: {error}") from None

    def _tree_or_chain(self, proposal: Proposal, offered: torch.Tensor) -> tuple[Proposal, torch.Tensor]:
        """A checked tree proposal and the nodes admitted per row [B] -> the proposal this step
        verifies: the tree itself, or its leading chain where the step cannot verify a tree (or the
        nodes admitted form a chain in every row, which the chain's faster path verifies)."""
        if self.settings.sampling.do_sample and proposal.probs is not None:
            raise NotImplementedError(
                f"candidate generator {self.plugin!r} proposed a token tree with draft probabilities: sampling "
                "verifies point-mass trees only for now (recursive rejection over stochastic siblings is not "
                "built); propose probs=None, a chain, or decode greedily")
        # a first forward's prefill-only inputs (images) pass with the first step: trees after it
        passing = self.target.is_first_iteration and bool(self.target.prefill_inputs)
        reason = self._tree_refusal or (None if passing else self._tree_problem())
        if reason is not None and self._tree_refusal is None:
            self._tree_refusal = reason  # for the rest of the call
            self.stats.choices["trees"] = f"verified as chains: {reason}"
        if reason is None and not passing and not proposal.is_chain(offered):
            return proposal, offered
        cut = dataclasses.replace(proposal, lengths=torch.minimum(proposal.lengths, offered.to(proposal.lengths.device)))
        chain = cut.leading_chain()
        return chain, torch.minimum(offered, chain.lengths.to(offered.device))

    def _tree_problem(self) -> str | None:
        """Why this call cannot verify trees (None: it can): a grammar (its matchers follow one
        chain), a distributed call, or a model the eager engine cannot run a tree layout on."""
        if self.processors is not None and self.processors.grammar is not None:
            return "a grammar constrains the call"
        if not isinstance(self.ranks, Solo):
            return "a distributed call"
        if not self.target.kv.trees:
            return f"engine={self._engine!r} verifies chains"
        if self._tree_engine is None:
            self._tree_engine = make_engine("eager", self.target.model)
        try:
            self._tree_engine.check_tree_support(self.target.kv.cache)
        except LayoutNotSupported as error:
            return str(error)
        return None

    def _tree_scores(self, logits: torch.Tensor, node_ids: torch.Tensor, parents: torch.Tensor,
                     offered: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
        """A tree's logits [B, k+1, V] (column i+1: after node i) -> the scores ``generate()`` would
        compute at each column given that node's own path: the processors are applied once per
        leaf rank, over the chains from the root to each row's l-th leaf (a chain block as
        :meth:`_scores` processes one), and each column takes its scores from a chain through it."""
        if self.processors is None:
            return logits.float()
        target = self.target
        chains, depths = leaf_chains(parents, offered)  # [L, B, k] node indices, [L, B]
        out = logits.float().clone()
        rows = torch.arange(out.shape[0], device=out.device)[:, None]
        for path, depth in zip(chains, depths):
            width = int(depth.max())
            path = path[:, :width]  # [B, d]
            columns = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1)  # [B, d+1]
            pos = self.processors.positions(target.tokens, committed, self.prompt_lengths, self.row_ids,
                                            node_ids.gather(1, path), depth + 1)
            processed = self.processors.apply(_columns(logits.float(), columns), pos)  # [B, d+1, V]
            if processed.dtype != out.dtype:
                out = out.to(processed.dtype)
            valid = torch.arange(width + 1, device=out.device)[None, :] <= depth[:, None]  # [B, d+1]
            out[rows.expand_as(columns)[valid], columns[valid]] = processed[valid]
        return out

    def _verify_tree(self, scores: torch.Tensor, node_ids: torch.Tensor, parents: torch.Tensor,
                     offered: torch.Tensor) -> TreeVerdict:
        """A tree's scores [B, k+1, V] -> its verdict: greedy, or the target sampled from the root
        down where a point-mass child holds the sampled token (specdec/verify.py)."""
        sampling = self.settings.sampling
        if not sampling.do_sample:
            return tree_greedy_verify(scores, node_ids, parents, offered)
        target_probs = torch.softmax(scores, dim=-1) if self.processors is not None else sampling.probs(scores)
        return tree_point_mass_sample(target_probs.float(), node_ids, parents, offered, self.settings.generator)

    def _allowed(self, ids: torch.Tensor, made: torch.Tensor, confidence: torch.Tensor | None) -> torch.Tensor:
        """made [B] cut before the first draft a processor forbids whatever the logits (a bad word,
        a repeated n-gram), in rows whose drafts have no probability of their own (a lookup's): a
        drafter that drafts from the processed scores never proposes one. Dropping drafts keeps
        the output as it is (a proposal may depend on anything but the verifier's randomness)."""
        target = self.target
        lookup = (torch.ones_like(made, dtype=torch.bool) if confidence is None
                  else torch.isnan(confidence[:, 0]).to(made.device) if confidence.shape[1] else None)
        if lookup is None or not bool((lookup & (made > 0)).any()):
            return made
        k = int(made.max())
        pos = self.processors.positions(target.tokens, target.lengths, self.prompt_lengths, self.row_ids,
                                        ids[:, :k], made)
        return torch.where(lookup, self.processors.allowed_drafts(ids[:, :k], made, pos, self.vocab), made)

    def _scores(self, logits: torch.Tensor, draft_ids: torch.Tensor, offered: torch.Tensor,
                committed: torch.Tensor) -> torch.Tensor:
        """logits [B, k+1, V] -> the scores ``generate()`` would sample or take the argmax of at each
        position (the processors given the committed tokens and the drafts before it); the logits
        themselves when the call has no processors."""
        if self.processors is None:
            # generate()'s scores are the float32 logits; only what records or shows them needs the copy
            # (a bfloat16 target's argmax is the same, and sampling upcasts for itself)
            keep = self.recorder or self.stopper.history is not None
            return logits.float() if keep else logits
        target = self.target
        pos = self.processors.positions(target.tokens, committed, self.prompt_lengths, self.row_ids, draft_ids,
                                        offered + 1)
        return self.processors.apply(logits.float(), pos)

    def _draft_scores(self, logits: torch.Tensor, drafts: torch.Tensor | None) -> torch.Tensor:
        """A drafter's logits [B, V'] at the position after the committed tokens and ``drafts [B, i]``
        -> the target's processors applied there ([B, V']; ``DecodeContext.scores``)."""
        target, width = self.target, logits.shape[-1]
        drafts = drafts if drafts is not None else target.tokens.new_zeros(target.batch_size, 0)
        full = torch.nn.functional.pad(logits.float(), (0, self.vocab - width), value=-float("inf")) \
            if width < self.vocab else logits[:, : self.vocab].float()  # [B, V]: the processors' width
        i = drafts.shape[1]
        pos = self.processors.positions(target.tokens, target.lengths, self.prompt_lengths, self.row_ids,
                                        drafts.to(target.device), torch.full_like(target.lengths, i + 1), first=i)
        scores = self.processors.apply(full[:, None], pos)[:, 0, :width].float()
        # a position where the processors allow nothing (a grammar's dead end, found when verified):
        # any finite scores do for a proposal, none of whose drafts can then be kept
        return scores.masked_fill(scores.amax(dim=-1, keepdim=True).isneginf(), 0.0)

    def _dead_ends(self, scores: torch.Tensor, offered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Under a grammar, the positions of a block where the processed scores [B, k+1, V] allow
        no token at all -> (the drafts to verify [B]: none at or after a row's first such
        position, which is then the furthest a verdict can reach; that first position [B], k+1
        where none), or (offered, None) when there is none. ``generate()`` would take token 0
        there and go on unconstrained; the run stops instead if a row commits that position."""
        if self.processors is None or self.processors.grammar is None:
            return offered, None
        cols = torch.arange(scores.shape[1], device=scores.device)[None, :]
        dead = scores.amax(dim=-1).isneginf() & (cols <= offered[:, None])  # [B, k+1]
        if not bool(dead.any()):
            return offered, None
        first = torch.where(dead.any(1), dead.float().argmax(1), scores.shape[1])  # [B]
        return torch.minimum(offered, first.to(offered.dtype)), first

    def _refuse_dead_end(self, dead: torch.Tensor, kept: torch.Tensor, committed: torch.Tensor) -> None:
        """Raise where a row committed a token chosen at a position its grammar and processors
        left without any allowed token (``dead`` [B], from :meth:`_dead_ends`)."""
        reached = (kept > dead).nonzero().flatten().tolist()
        if reached:
            b = reached[0]
            # through the ranks: on a sharded target every rank raises it at the next message, the groups kept
            self.ranks.fail(no_allowed_token(int(self.row_ids[b]), int(committed[b] - self.prompt_lengths[b] + dead[b]) + 1))

    def _verify(self, scores: torch.Tensor, draft_ids: torch.Tensor, offered: torch.Tensor, proposal,
                dead: torch.Tensor | None = None) -> Verdict:
        """scores [B, k+1, V] (processed, or the raw logits without processors) -> the verdict;
        ``dead`` [B] a position that allows no token (:meth:`_dead_ends`) scored as any other
        (uniform), since a verdict that reaches it ends the run."""
        sampling = self.settings.sampling
        if dead is not None:
            cols = torch.arange(scores.shape[1], device=scores.device)[None, :, None]
            scores = scores.masked_fill(cols == dead[:, None, None], 0.0)
        if not sampling.do_sample:
            return greedy_verify(scores, draft_ids, offered)
        k = draft_ids.shape[1]
        draft_probs = proposal.probs[:, :k].to(scores.device) if proposal.probs is not None else None
        # with processors the warpers are among them, as in generate() (which samples from the softmax
        # of whatever dtype they return, float16 included: held in float32 here, the same numbers)
        target_probs = torch.softmax(scores, dim=-1) if self.processors is not None else sampling.probs(scores)
        if target_probs.dtype in (torch.float16, torch.bfloat16):
            target_probs = target_probs.float()
        return speculative_sample(target_probs, draft_ids, offered, draft_probs, self.settings.generator)

    def _commit(self, scores: torch.Tensor, draft_ids: torch.Tensor, verdict: Verdict,
                committed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (block [B, k+1]: the accepted drafts, then the target's token; kept [B]: how much of
        it each row keeps (cut where it stops; a stopped row that ``generate()`` would not pad
        goes on); finished [B] bool: the rows that leave the batch). The target's cache then
        holds the committed prefix. ``scores`` [B, k+1, V]: what the stopping criteria may see."""
        target = self.target
        block = torch.cat([draft_ids, verdict.next_token[:, None]], dim=1)  # [B, k+1]
        if draft_ids.shape[1]:  # the target's token after the accepted drafts
            block.scatter_(1, verdict.accepted[:, None], verdict.next_token[:, None])
        counts = verdict.accepted + 1
        keep, stopped = self.stopper.cut(target.tokens, committed, block, counts, self.prompt_lengths, scores)
        kept, finished = self.stopper.settle(committed - self.prompt_lengths, counts, keep, stopped)
        target.commit(committed, block, kept, cached=committed + verdict.accepted)
        return block, kept, finished

    def _observe(self, record: StepRecord, block: torch.Tensor, committed: torch.Tensor) -> None:
        """Everyone who learns from the step hears it: statistics, streamer, followers, generator, policy."""
        self._count(record)
        self.feed.tokens(block, record.kept)
        for state in self.followers:
            if state in self.borrowers:
                if not state.is_first_iteration:  # the first copy waits for drafts (_draft)
                    state.mirror(self.target)
            else:
                state.sync(self.target.tokens, self.target.lengths, since=committed)
        drafter = record.drafter_view()  # the generator's drafts only
        self.session.observe(self.ctx, drafter)
        if self.policy is not None:
            self.policy.observe(drafter)
        # keeping drafts in step is drafting work
        self.stats.draft_seconds += time.perf_counter() - record.started - record.drafting - record.verifying

    def _count(self, record: StepRecord) -> None:
        stats = self.stats
        stats.record_step(record.offered.tolist(), record.accepted.tolist(), record.kept.tolist())
        if record.tree:
            stats.record_tree(record.offered.tolist(), record.accepted.tolist())
        if record.grammar_drafts is not None:
            stats.record_grammar(record.grammar_drafts.tolist(), record.offered.tolist(), record.accepted.tolist())
        record = record.drafter_view()
        stats.draft_seconds += record.drafting
        stats.verify_seconds += record.verifying
        stats.compile_seconds += record.compiling
        if not record.first and not record.compiling:  # the prefill's cost (or a compile's) is not a verification's
            stats.record_forward(record.fed, record.forward)
        if self.policy is not None and not record.waiting:  # no drafts asked for, or none of those offered verified
            declined = (record.asked == 0) | ((record.candidates > 0) & (record.offered == 0))
            stats.skipped_steps += int((declined & (record.room > 0)).sum())

    def _retire(self, finished: torch.Tensor) -> None:
        """Finished rows [B] bool leave the batch; their new tokens become output."""
        target = self.target
        for b in finished.nonzero().flatten().tolist():
            row = int(self.row_ids[b])
            self.outputs[row] = target.tokens[b, int(self.prompt_lengths[b]): int(target.lengths[b])].clone()
        rest = (~finished).nonzero().flatten()
        self.row_ids, self.prompt_lengths = self.row_ids[rest], self.prompt_lengths[rest]
        self.stopper.select_rows(rest)
        if rest.numel():
            for state in self.states():
                state.select_rows(rest)
            self.session.select_rows(rest)
            if self.policy is not None:
                self.policy.select_rows(rest)

    def _engine_report(self) -> str:
        """What ran each model's forwards (``stats.choices["engine"]``): "target: ...", then each
        assistant's (a copy or a draft model) as "assistant i: ...", joined by " | "."""
        def said(state: ModelState) -> str:
            return engine_report(state.model, state.kv.settings.engine, state.kv.settings.fast_head)

        parts = [f"target: {said(self.target)}"]
        parts += [f"assistant {i}: {said(state)}" for i, state in enumerate(self.assistants)]
        return " | ".join(parts)

    def states(self) -> list[ModelState]:
        """The target's state and every assistant's."""
        return [self.target, *self.followers, *self.own]

    def release(self) -> None:
        """Hand static caches back for reuse (also when a call ends early with an exception)."""
        for state in self.states():
            state.release()

    def finish(self, input_ids: torch.Tensor, started: float) -> SpecOutput:
        """-> sequences [B, P + new] (the prompt as given, then each row's new tokens right-padded),
        the scores and logits asked for, and the statistics."""
        self.feed.end()
        report = self.session.report()  # counters; words (a choice and its reason) go to stats.choices
        self.stats.generator = {k: v for k, v in report.items() if not isinstance(v, str)}
        self.stats.choices.update({k: v for k, v in report.items() if isinstance(v, str)})
        packed = None if self.settings.cache.own_forward else PackedLinears.decision(self.target.model)
        if packed is not None:
            self.stats.choices["packed_weights"] = packed
        self.stats.choices["engine"] = self._engine_report()
        self.stats.total_seconds = time.perf_counter() - started
        if self.processors is not None:
            self.stats.processor_seconds = self.processors.seconds
        # generate()'s steps: a row that went on past its stop (unpadded) may hold more
        longest = self.stopper.length() or max(o.numel() for o in self.outputs)
        new = input_ids.new_full((input_ids.shape[0], longest), self.settings.pad)
        for b, o in enumerate(self.outputs):
            new[b, : min(o.numel(), longest)] = o[:longest]
        scores, logits = self.recorder.tuples(longest)
        return SpecOutput(sequences=torch.cat([input_ids, new], dim=1), scores=scores, logits=logits, stats=self.stats)


# -- token trees: pure helpers ----------------------------------------------------------------------
def _columns(x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """x [B, T, V], columns [B, C] -> x[b, columns[b, c]]: [B, C, V]."""
    return x.gather(1, columns[..., None].expand(-1, -1, x.shape[-1]))
