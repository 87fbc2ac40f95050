"""The candidate-generator protocol: what a plugin implements and what it is given.

A generator instance is the *configuration* the user built (``SpecDecoder(target, "name",
**options)``). Each ``generate()`` call works on its own *session*: ``generator.session()``,
by default a fresh instance built with the same constructor arguments, so per-call state never
leaks between calls and one decoder serves several calls at once (from different threads).
A generator holding something built once and shared (a quantized model copy) overrides
``session()``. On the session, in order:

1. ``setup(ctx)`` once, before any forward, with a :class:`DecodeContext`: the target, the
   tokenizers, the sampling parameters, the committed tokens, and ``ctx.attach(model)``, which
   hands an assistant model to the controller and returns an
   :class:`~specdec.assistant.Assistant` handle (the controller owns its cache).
2. ``propose(ctx, max_drafts) -> Proposal`` before every target forward. ``max_drafts [B]`` is the
   most each row may offer (so output never runs past ``max_new_tokens``).
3. ``observe(ctx, feedback)`` after every verification, with per-row offered/accepted counts.
4. ``select_rows(rows)`` when finished rows leave the batch (per-row state must follow).
5. ``report() -> dict`` at the end: counters the generator wants in ``stats.generator``.

Built-in generators live in ``candidate_generators/`` and use nothing beyond the public core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from .modelinfo import token_id_list, vocab_size  # noqa: F401  (re-exported for plugins)
from .sampling import SamplingParams

#: drafts per step the cost-aware policy may ask a generator without a schedule for
DEFAULT_MAX_DRAFTS = 16

if TYPE_CHECKING:  # pragma: no cover
    from .assistant import Assistant
    from .state import ModelState


@dataclass
class Proposal:
    token_ids: torch.Tensor  # [B, K] long, padded past each row's length
    lengths: torch.Tensor  # [B] long, valid drafts per row (0 allowed)
    probs: torch.Tensor | None = None  # [B, K, target_vocab] draft distribution, None = point masses
    #: [B] long: which of the generator's sources drafted each row (an index into its
    #: ``acceptance_prior()``), for a generator with several; None = source 0
    sources: torch.Tensor | None = None
    #: [B, K] float: the drafter's own probability of each draft (NaN where it has none), for the
    #: policy to weigh each draft by; None = none
    confidence: torch.Tensor | None = None

    @classmethod
    def empty(cls, batch: int, device: torch.device | str = "cpu") -> "Proposal":
        return cls(torch.zeros(batch, 0, dtype=torch.long, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device))

    @classmethod
    def from_rows(cls, rows: list[list[int]] | list[torch.Tensor], device: torch.device | str = "cpu") -> "Proposal":
        """Point-mass drafts from per-row lists (or 1-D tensors) of ids, padded with 0."""
        counts = [len(r) for r in rows]
        token_ids = torch.zeros(len(rows), max(counts, default=0), dtype=torch.long, device=device)
        for b, r in enumerate(rows):
            if counts[b]:
                token_ids[b, : counts[b]] = torch.as_tensor(r, dtype=torch.long, device=device)
        return cls(token_ids, torch.tensor(counts, dtype=torch.long, device=device))


@dataclass
class Feedback:
    offered: torch.Tensor  # [B] drafts each row offered after clamping
    accepted: torch.Tensor  # [B] drafts each row had accepted


@dataclass
class DecodeContext:
    """What a generator may read and use during one ``generate()`` call."""

    target: Any
    tokenizer: Any
    draft_tokenizer: Any
    sampling: SamplingParams
    generator: torch.Generator | None
    model_inputs: dict[str, Any]
    _target_state: "ModelState" = field(repr=False)
    _attach: Callable[..., "Assistant"] = field(repr=False)
    _rate: Callable[[torch.Tensor, int], "torch.Tensor | None"] | None = field(default=None, repr=False)
    _keep: Callable[[torch.Tensor, torch.Tensor], bool] | None = field(default=None, repr=False)
    _ended: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)

    @property
    def tokens(self) -> torch.Tensor:
        """[B, L] committed tokens (read only), row b valid in ``[:lengths[b]]`` (prompt included)."""
        return self._target_state.tokens

    @property
    def lengths(self) -> torch.Tensor:
        """[B] committed length per row. During ``propose`` the target holds no drafts yet."""
        return self._target_state.lengths

    @property
    def batch_size(self) -> int:
        return self._target_state.batch_size

    @property
    def target_vocab_size(self) -> int:
        return vocab_size(self.target)

    def draft_rate(self, counts: torch.Tensor, source: int = 0) -> torch.Tensor | None:
        """[B] committed tokens per second the core's draft-length policy expects for row b this
        step if it verifies the best number, up to ``counts[b]``, of drafts from ``source`` (an
        index into ``acceptance_prior()``; source 0's measured drafting cost included, other
        sources' drafts taken as free). A generator with several sources asks it during
        ``propose`` to draft each row from the source that pays most. None when the generator
        sets its own draft lengths (a ``fixed`` or ``adaptive`` schedule: no policy runs)."""
        return None if self._rate is None else self._rate(counts, source)

    def keep_drafting(self, drafts: torch.Tensor, confidence: torch.Tensor | None, max_drafts: torch.Tensor) -> bool:
        """Whether to draft one more token this step, asked by a generator that drafts one token at
        a time (``CandidateGenerator.drafts_stepwise``) after each: ``drafts [B, i]`` the drafts so
        far, ``confidence [B, i]`` its own probabilities of them (None if it has none),
        ``max_drafts [B]`` what ``propose`` was given. False once every row has drafted an end of
        sequence (nothing after it can be kept) or as many as it may; otherwise, under the core's
        policy, while it expects a longer block to pay, valued with these drafts' own acceptance;
        True when the generator sets its own draft lengths."""
        made = drafts.shape[1]
        open_rows = made < max_drafts.to(drafts.device)
        if self._ended is not None and made:
            open_rows &= ~self._ended(drafts)[:, -1]
        if not bool(open_rows.any()):
            return False
        if self._keep is None or confidence is None:
            return True
        return self._keep(confidence, max_drafts)

    def attach(self, model, tokens: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
               pad_token_id: int | None = None, *, cache_implementation: str | None = None,
               compile: bool | dict | None = None, compile_widths: tuple[int, ...] | None = None,
               prefill_from_target: bool = False, owned: bool = False) -> "Assistant":
        """Hand an assistant model to the controller; get an :class:`~specdec.assistant.Assistant`.

        Without ``tokens`` the assistant shares the target's token ids and the controller keeps it
        at the committed prefix after every verification. With ``tokens [B, L]`` and ``lengths
        [B]`` (another tokenizer's ids) the generator keeps it in step with ``rewrite``. Either way
        the controller builds its cache, routes prefill-only inputs to its first forward, and drops
        finished rows. ``cache_implementation`` / ``compile`` (as in ``SpecDecoder``) choose how
        this assistant keeps its cache, whatever the call uses (default: as the call);
        ``compile_widths``: the forward widths to compile (e.g. ``(1, 2)`` for a draft that feeds
        one token per step; wider forwards then run eagerly).

        ``prefill_from_target``: the assistant's cache mirrors the target's: it starts from a copy
        of the keys and values the target's prefill computed and takes those of each verified
        block, so it is fed neither the prompt nor committed tokens, only its drafts and the
        target's newest token. Needs an assistant that shares the target's tokens and its cache
        layout (layers, key/value heads, head size): a copy of the target at lower precision, say.
        The first step then verifies no drafts (the target's prefill has to come first).

        ``owned``: the generator built ``model`` and nothing changes it (its modules, their
        attributes, its parameters' shapes) while it is attached: its compiled forwards then run
        a compiled function of its own that skips dynamo's guards on its modules (a copy of a
        135M model steps 1.4 ms faster of 12 ms on a 2-core CPU). Never for the user's models.
        """
        return self._attach(model, tokens, lengths, pad_token_id, cache_implementation, compile, compile_widths,
                            prefill_from_target, owned)


class CandidateGenerator:
    """Base class of every candidate generator (built-in or third-party)."""

    name: ClassVar[str] = ""
    #: True: ``propose`` drafts one token at a time, asks ``ctx.keep_drafting`` after each and
    #: returns each draft's probability in ``Proposal.confidence``. The core's policy then asks it
    #: for as many drafts as a row may take wherever drafting pays at all, and the drafter's own
    #: probabilities decide where each block ends.
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

    def setup(self, ctx: DecodeContext) -> None:
        """Called once per session, before any forward: validate here, attach assistants."""

    def propose(self, ctx: DecodeContext, max_drafts: torch.Tensor) -> Proposal:
        raise NotImplementedError

    def observe(self, ctx: DecodeContext, feedback: Feedback) -> None:
        """Called after every verification."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of any per-row state."""

    def report(self) -> dict[str, Any]:
        """Counters for ``stats.generator`` at the end of the call (none by default)."""
        return {}

    def draft_cap(self) -> int:
        """The most drafts the core's cost-aware policy may ask this generator for per step, or 0
        when the generator sets its own number (a ``fixed`` or ``adaptive`` schedule): the core
        then verifies whatever it offers. Generators without a ``schedule`` get the policy."""
        schedule = getattr(self, "schedule", None)
        if isinstance(schedule, DraftLengthSchedule):
            return schedule.max_tokens if schedule.kind == "auto" else 0
        return DEFAULT_MAX_DRAFTS

    def acceptance_prior(self) -> float | tuple[float, ...]:
        """The policy's estimate that a draft is accepted where it has measured few this call (in
        (0, 1)); measurements take over within a few steps. (Until a first block of a source's
        drafts is verified, the policy prices them at ``policy.UNTRIED`` = 0.8, or at this prior
        if higher, so that a draft which pays only where it agrees is tried.) A generator that
        knows its drafts agree with the target more often (a copy of the target, say) says so,
        and the policy keeps drafting through its first rejections instead of learning it.

        A generator with several sources of drafts (prompt lookup where it finds a match, a draft
        model elsewhere) returns one prior per source and names each row's source in
        ``Proposal.sources``: the policy then learns each source's acceptance apart. The
        ``max_drafts`` that ``propose`` gets are priced for source 0, which should be the source
        whose drafts cost time to make."""
        return 0.5


class NoDraft(CandidateGenerator):
    """Proposes nothing: the loop degenerates to plain decoding (mean accepted length 1.0)."""

    name = "none"

    def draft_cap(self) -> int:
        return 0

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
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.kind, self.max_tokens = kind, max(int(max_tokens), int(num_tokens))
        self.initial = self.max_tokens if kind == "auto" else int(num_tokens)
        self.current = torch.empty(0, dtype=torch.long)

    def reset(self, batch: int) -> None:
        self.current = torch.full((batch,), self.initial, dtype=torch.long)

    def update(self, feedback: Feedback) -> None:
        if self.kind != "adaptive":
            return
        offered, accepted = feedback.offered.cpu(), feedback.accepted.cpu()
        full = (accepted == offered) & (offered > 0)
        tried = offered > 0
        grown = torch.where(full, self.current + 2, self.current - 1).clamp(1, self.max_tokens)
        self.current = torch.where(tried, grown, self.current)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.current = self.current[rows.cpu()]
