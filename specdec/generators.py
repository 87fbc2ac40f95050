"""The candidate-generator protocol: what a plugin implements and what it is given.

A generator instance is the *configuration* the user built (``SpecDecoder(target, "name",
**options)``). Each ``generate()`` call works on its own *session*: ``generator.session()``,
by default a fresh instance built with the same constructor arguments, so per-call state never
leaks between calls and one decoder serves several calls at once (from different threads).
A generator holding something built once and shared (a quantized model copy) overrides
``session()``. On the session, in order:

1. ``drafting() -> DraftingInfo`` once: what the core's draft-length policy should know of its
   drafts (priors per source, the most drafts a step, whether it drafts one token at a time);
2. ``setup(ctx)`` once, before any forward, with a :class:`DecodeContext`: the target, the
   tokenizers, the sampling parameters, the committed tokens, and ``ctx.attach(model)``, which
   hands an assistant model to the controller and returns an
   :class:`~specdec.assistant.Assistant` handle (the controller owns its cache);
3. ``propose(ctx, max_drafts) -> Proposal`` before every target forward. ``max_drafts [B]`` is the
   most each row may offer (so output never runs past ``max_new_tokens``); a proposal with
   ``parents`` is a token tree of that many nodes (docs/trees.md), verified in one forward;
4. ``observe(ctx, feedback)`` after every verification, with the step's :class:`StepRecord`
   (a :class:`Feedback`: per-row offered/accepted counts, and the rest of what the step saw);
5. ``select_rows(rows)`` when finished rows leave the batch (per-row state must follow);
6. ``report() -> dict`` at the end: counters the generator wants in ``stats.generator``.

A generator may take options per call: the keyword arguments of ``generate()`` it names in
``call_options`` reach ``for_call(**options)``, which returns the configuration that call's
session is made from (``suffix``'s ``memory_scope``).

Only ``propose`` is required. ``acceptance_prior()``, ``draft_cap()`` and the class flag
``drafts_stepwise`` are the earlier form of ``drafting()``: still honoured (with a
``DeprecationWarning``) where a plugin defines them. Built-in generators live in
``candidate_generators/`` and use the public core only.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from .context import AssistantHandle, CommittedRows, DecodeContext, DraftAdvice
from .feedback import Feedback, StepRecord, TargetHidden
from .host import host_ints, host_long, hosted
from .modelinfo import token_id_list, vocab_size
from .sampling import SamplingParams
from .tries import continuation_trie

#: drafts per step the cost-aware policy may ask a generator without a schedule for
DEFAULT_MAX_DRAFTS = 16

#: the plugin API (the context's types and the helpers plugins use are re-exported from their modules)
__all__ = ["DEFAULT_MAX_DRAFTS", "AssistantHandle", "CandidateGenerator", "CommittedRows", "DecodeContext",
           "DraftAdvice", "DraftLengthSchedule", "DraftingInfo", "Feedback", "NoDraft", "Proposal", "SamplingParams",
           "StepRecord", "TargetHidden", "continuation_trie", "declared_drafting", "host_ints", "token_id_list", "vocab_size"]

@dataclass
class Proposal:
    token_ids: torch.Tensor  # [B, K] long, padded past each row's length
    lengths: torch.Tensor  # [B] long, valid drafts per row (0 allowed)
    probs: torch.Tensor | None = None  # [B, K, target_vocab] draft distribution, None = point masses
    #: [B, K] long: a token tree (docs/trees.md): ``parents[b, i]`` is draft i's parent index in row b
    #: (-1: a child of the pending token), parents before children, ``lengths[b]`` nodes; None = a chain
    parents: torch.Tensor | None = None
    #: [B] long: which of the generator's sources drafted each row (an index into
    #: ``DraftingInfo.priors``), for a generator with several; None = source 0
    sources: torch.Tensor | None = None
    #: [B, K] float: the drafter's own probability of each draft (NaN where it has none), for the
    #: policy to weigh each draft by; None = none
    confidence: torch.Tensor | None = None
    #: [B] long: set by the run, not a generator: the trailing drafts that are a grammar's own (specdec/grammar.py)
    grammar_drafts: torch.Tensor | None = None

    @classmethod
    def empty(cls, batch: int, device: torch.device | str = "cpu") -> "Proposal":
        return cls(hosted(torch.zeros(batch, 0, dtype=torch.long, device=device), [[] for _ in range(batch)]),
                   host_long([0] * batch, device))

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def leading_chain(self) -> "Proposal":
        """A tree proposal's leading chain as a chain proposal: node 0, its first child, that one's
        first child, ... (a trie built one continuation after another leads with the first); the
        proposal itself when it is a chain. What a step verifies where a tree cannot be."""
        if self.parents is None:
            return self
        ids = self.token_ids
        parents, lengths = self.parents.to(ids.device).long(), self.lengths.to(ids.device).long()
        batch, k = ids.shape
        real = torch.arange(k, device=ids.device)[None, :] < lengths[:, None]  # [B, K]
        order = torch.zeros(batch, k, dtype=torch.long, device=ids.device)  # [B, K] node at each chain index
        count = torch.zeros(batch, dtype=torch.long, device=ids.device)
        node = torch.where(lengths > 0, 0, -1)  # [B] the chain's next node (-1: it ended)
        for j in range(k):
            live = node >= 0
            if not bool(live.any()):
                break
            order[:, j] = node.clamp(min=0)
            count += live.long()
            child = (parents == node[:, None]) & real & live[:, None]  # [B, K]
            node = torch.where(child.any(dim=1), child.float().argmax(dim=1), -1)
        probs = self.probs
        if probs is not None:
            probs = probs.gather(1, order.to(probs.device)[..., None].expand(-1, -1, probs.shape[-1]))
        confidence = self.confidence
        if confidence is not None:
            confidence = confidence[:, :k].gather(1, order.to(confidence.device))
        return replace(self, token_ids=ids.gather(1, order), lengths=count.to(self.lengths.device), probs=probs,
                       confidence=confidence, parents=None)

    def is_chain(self, counts: torch.Tensor | None = None) -> bool:
        """Whether every row's first ``counts[b]`` (default ``lengths[b]``) nodes form a chain, each
        the child of the one before (always, for a proposal without ``parents``)."""
        if self.parents is None:
            return True
        counts = (self.lengths if counts is None else counts).to(self.parents.device)
        index = torch.arange(self.parents.shape[1], device=self.parents.device)[None, :]
        return bool(((self.parents == index - 1) | (index >= counts[:, None])).all())

    @classmethod
    def from_tree(cls, rows: list[list[tuple[int, int]]], device: torch.device | str = "cpu") -> "Proposal":
        """Point-mass tree drafts from per-row lists of ``(token, parent)`` nodes (parent -1: a
        child of the pending token; parents before children), padded with token 0 and parent -1."""
        counts = [len(r) for r in rows]
        width = max(counts, default=0)
        token_ids = torch.zeros(len(rows), width, dtype=torch.long)
        parents = torch.full((len(rows), width), -1, dtype=torch.long)
        for b, r in enumerate(rows):
            for i, (token, parent) in enumerate(r):
                token_ids[b, i], parents[b, i] = token, parent
        return cls(token_ids.to(device), torch.tensor(counts, dtype=torch.long, device=device),
                   parents=parents.to(device))

    @classmethod
    def from_rows(cls, rows: list[list[int]] | list[torch.Tensor], device: torch.device | str = "cpu") -> "Proposal":
        """Point-mass drafts from per-row lists (or 1-D tensors) of ids, padded with 0."""
        counts = [len(r) for r in rows]
        width = max(counts, default=0)
        padded = [(r.tolist() if isinstance(r, torch.Tensor) else list(r)) + [0] * (width - n) for r, n in zip(rows, counts)]
        flat = [token for row in padded for token in row]
        return cls(hosted(long_tensor(flat, device).reshape(len(rows), width), padded), long_tensor(counts, device))


#: a 1-D int64 tensor of a step's small host list (drafts, counts, sources), carrying its values
#: (specdec.host: reading them back costs no device read)
long_tensor = host_long


@dataclass(frozen=True)
class DraftingInfo:
    """What a generator declares to the core's draft-length policy, once per call (its
    ``drafting()``), in one piece as vLLM's proposers get one metadata object.

    * ``priors``: per source of drafts, the acceptance the policy assumes until it has measured
      some (each in (0, 1); a float means one source). A generator with several sources names
      each row's in ``Proposal.sources``; source 0 should be the one whose drafts cost time.
    * ``max_drafts``: the most drafts the policy may ask for a step, or None when the generator
      sets its own draft lengths (a ``fixed`` or ``adaptive`` schedule): no policy runs then, and
      the core verifies whatever it offers.
    * ``stepwise``: ``propose`` drafts one token at a time, asks ``ctx.keep_drafting`` after each
      and returns each draft's probability in ``Proposal.confidence``: wherever drafting pays it
      is asked for all a row may take, and its own probabilities end each block.
    * ``free``: making drafts costs nothing worth pricing (a lookup's reads): the policy asks each
      row for all it may take, and verifies what each row's own source and drafts' confidence
      (``Proposal.sources``, ``Proposal.confidence``) say pays, instead of sizing the ask by source
      0 before the proposal.
    * ``hidden_layers``: the target's hidden states the generator reads (``output_hidden_states``
      indices: 0 the embeddings, i the output of layer i): every target forward returns them
      (on its fast path where it has one), and each step's record carries those of the tokens it
      committed (:class:`TargetHidden`, ``feedback.hidden``). Empty: none (the default). Read
      after ``setup``, so a generator may learn them there (from the head it loads).
    """

    priors: tuple[float, ...] | float = (0.5,)
    max_drafts: int | None = DEFAULT_MAX_DRAFTS
    stepwise: bool = False
    free: bool = False
    hidden_layers: tuple[int, ...] = ()

    def __post_init__(self):
        priors = self.priors
        object.__setattr__(self, "priors", tuple(priors) if isinstance(priors, (tuple, list)) else (priors,))


class CandidateGenerator:
    """Base class of every candidate generator (built-in or third-party). Only ``propose`` is
    required; every other method has a default that does nothing or declares the defaults."""

    name: ClassVar[str] = ""
    #: keyword arguments of ``SpecDecoder.generate()`` that are this generator's, per call: taken out of
    #: the call's arguments (before generation settings and model inputs) and given to :meth:`for_call`
    call_options: ClassVar[tuple[str, ...]] = ()
    #: deprecated: ``DraftingInfo.stepwise`` (read where a plugin still sets it)
    drafts_stepwise: ClassVar[bool] = False

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        self._init_args = (args, kwargs)  # what session() rebuilds each call from
        return self

    def session(self) -> "CandidateGenerator":
        """A generator for one ``generate()`` call: by default a fresh instance built with this
        one's constructor arguments (models among them are shared, not copied)."""
        args, kwargs = getattr(self, "_init_args", ((), {}))
        return type(self)(*args, **kwargs)

    def for_call(self, **options) -> "CandidateGenerator":
        """The configuration one call decodes with, given the :attr:`call_options` the call passed
        (only those it passed); its :meth:`session` is the call's generator. Default: this one.
        Override to return a copy that carries them (a shallow copy shares what the decoder holds)."""
        return self

    def drafting(self) -> DraftingInfo:
        """What the core's draft-length policy should know of this generator's drafts. Default:
        one source at prior 0.5; up to ``DEFAULT_MAX_DRAFTS`` drafts a step, or for a generator
        with a ``schedule`` (:class:`DraftLengthSchedule`) its ``policy_drafts``; not stepwise
        (read from the deprecated hooks below, which a plugin may still override)."""
        cap = self.draft_cap()
        return DraftingInfo(self.acceptance_prior(), cap if cap > 0 else None, bool(self.drafts_stepwise))

    def setup(self, ctx: DecodeContext) -> None:
        """Called once per session, before any forward: validate here, attach assistants."""

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        raise NotImplementedError

    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        """Called after every verification with the step's :class:`StepRecord`."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of any per-row state."""

    def report(self) -> dict[str, Any]:
        """Counters for ``stats.generator`` at the end of the call (none by default)."""
        return {}

    # -- deprecated: the earlier form of drafting() -----------------------------------------------
    def draft_cap(self) -> int:
        """Deprecated: ``DraftingInfo.max_drafts`` (0 here meaning None)."""
        schedule = getattr(self, "schedule", None)
        if isinstance(schedule, DraftLengthSchedule):
            return schedule.policy_drafts or 0
        return DEFAULT_MAX_DRAFTS

    def acceptance_prior(self) -> float | tuple[float, ...]:
        """Deprecated: ``DraftingInfo.priors``."""
        return 0.5


#: the hooks ``drafting()`` replaces, and the ``DraftingInfo`` field each one fills
_DEPRECATED_HOOKS = {"acceptance_prior": "priors", "draft_cap": "max_drafts", "drafts_stepwise": "stepwise"}


def declared_drafting(generator: CandidateGenerator, plugin: str) -> DraftingInfo:
    """``generator.drafting()``, checked. A deprecated hook that a plugin overrides still counts
    (with a ``DeprecationWarning``), also below a class that defines ``drafting()`` (a subclass of
    a built-in that overrides ``acceptance_prior``, say), so plugins written for the earlier
    surface keep working."""
    info = generator.drafting()
    mro = type(generator).__mro__
    depth = lambda name: next(i for i, k in enumerate(mro) if name in vars(k))  # noqa: E731
    for hook, name in _DEPRECATED_HOOKS.items():
        if depth(hook) < mro.index(CandidateGenerator):
            warnings.warn(f"candidate generator {plugin!r}: {hook} is deprecated; return "
                          f"DraftingInfo({name}=...) from drafting()", DeprecationWarning, stacklevel=3)
            if depth(hook) < depth("drafting"):
                info = replace(info, **{name: _deprecated_value(generator, hook)})
    if not info.priors or not all(isinstance(p, (int, float)) and 0.0 < p < 1.0 for p in info.priors):
        raise ValueError(f"{plugin}: the acceptance priors (DraftingInfo.priors, formerly acceptance_prior()) "
                         f"must be in (0, 1) (a float, or one per source), got {info.priors!r}")
    if info.max_drafts is not None and (not isinstance(info.max_drafts, int) or info.max_drafts < 1):
        raise ValueError(f"{plugin}: DraftingInfo.max_drafts must be a positive int or None, got {info.max_drafts!r}")
    return info


def _deprecated_value(generator: CandidateGenerator, hook: str):
    if hook == "acceptance_prior":
        return DraftingInfo(generator.acceptance_prior()).priors
    if hook == "draft_cap":
        cap = generator.draft_cap()
        return cap if cap > 0 else None
    return bool(generator.drafts_stepwise)


def plugin_name(generator: CandidateGenerator) -> str:
    """How errors and reports name ``generator``: its registered ``name``, else its class's."""
    return generator.name or type(generator).__name__


def most_drafts(generator: CandidateGenerator, info: DraftingInfo) -> int | None:
    """The most drafts (tree nodes) ``generator``, which declared ``info``, proposes a step, None if
    unbounded: ``info.max_drafts`` under the policy, else 0 for :class:`NoDraft`, a fixed schedule's
    ``num_tokens``, an adaptive one's ``max_tokens`` (the widths ``SpecDecoder.warmup`` compiles)."""
    if info.max_drafts is not None:
        return info.max_drafts
    if isinstance(generator, NoDraft):
        return 0
    schedule = getattr(generator, "schedule", None)
    if isinstance(schedule, DraftLengthSchedule):
        return schedule.initial if schedule.kind == "fixed" else schedule.max_tokens
    return None


class NoDraft(CandidateGenerator):
    """Proposes nothing: the loop degenerates to plain decoding (mean accepted length 1.0)."""

    name = "none"

    def drafting(self) -> DraftingInfo:
        return DraftingInfo(max_drafts=None)

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        return Proposal.empty(ctx.batch_size, ctx.tokens.device)


class DraftLengthSchedule:
    """Per-row number of drafts K, capped at ``max_tokens``:

    * ``auto`` (the default of every built-in): the core's cost-aware policy (``specdec.policy``)
      chooses K each step from measured forward costs and estimated acceptance; the generator
      offers up to the ``max_drafts`` it is given;
    * ``fixed``: always ``num_tokens``;
    * ``adaptive``: +2 after a fully accepted block, -1 otherwise, never below 1 (the heuristic
      ``transformers`` uses), starting at ``num_tokens``.
    """

    KINDS = ("auto", "fixed", "adaptive")

    def __init__(self, num_tokens: int, kind: str = "auto", max_tokens: int = 32):
        if kind not in self.KINDS:
            raise ValueError(f"schedule must be one of {self.KINDS}, got {kind!r}")
        if not isinstance(num_tokens, numbers.Integral) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        self.kind, self.max_tokens = kind, max(int(max_tokens), int(num_tokens))
        self.initial = self.max_tokens if kind == "auto" else int(num_tokens)
        self.current = torch.empty(0, dtype=torch.long)

    @property
    def policy_drafts(self) -> int | None:
        """``DraftingInfo.max_drafts`` of a generator on this schedule: ``max_tokens`` under
        ``auto``, None (the generator sets its own lengths) otherwise."""
        return self.max_tokens if self.kind == "auto" else None

    def reset(self, batch: int) -> None:
        self.current = host_long([self.initial] * batch)  # [B] on the CPU, carrying its values

    def update(self, feedback: Feedback) -> None:
        if self.kind != "adaptive":
            return
        lengths = list(host_ints(self.current))
        for b, (offered, accepted) in enumerate(zip(host_ints(feedback.offered), host_ints(feedback.accepted))):
            if offered > 0:  # a row that verified drafts: grown after a fully accepted block, else shrunk
                lengths[b] = min(max(lengths[b] + 2 if accepted == offered else lengths[b] - 1, 1), self.max_tokens)
        self.current = host_long(lengths)

    def select_rows(self, rows: torch.Tensor) -> None:
        lengths = host_ints(self.current)
        self.current = host_long([lengths[r] for r in host_ints(rows)])
