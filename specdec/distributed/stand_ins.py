"""What a rank's run holds in place of the user's objects during a distributed call.

Each routes one kind of user object through the call's :class:`~specdec.distributed.call.RankCall`
(``call``), so that every rank sends the same messages whatever that code does:

* :class:`Relay`: the generator on a rank that does not draft (one-rank drafting): it declares the
  generator's drafting and never proposes; the decider's drafts arrive in a message instead.
* :class:`DeferringSession`: the generator's session on a rank that drafts: its hooks between
  messages (``observe``, ``select_rows``, ``report``) have their errors held (``call.defer``).
* :class:`Deferred`: a streamer or the call's processors, whose errors are held (``call.hold``) for
  the next message, with a fallback result in their place.
* :class:`SharedStopper`: a stopper with user criteria, whose cuts are the decider's (``call.cut``).
"""

from __future__ import annotations

from typing import Callable

from ..generators import CandidateGenerator, DraftingInfo, declared_drafting


class Relay(CandidateGenerator):
    """A rank's stand-in for the generator under one-rank drafting: it declares the generator's
    drafting (so that every rank builds the same policy, and calibrates alike) and never proposes:
    the coordinator hands the decider's drafts to the run instead."""

    name = "relay"

    def __init__(self, session: CandidateGenerator, plugin: str):
        self.info = declared_drafting(session, plugin)

    def session(self) -> "Relay":
        return self

    def drafting(self) -> DraftingInfo:
        return self.info

    def propose(self, ctx, max_drafts):  # pragma: no cover - never called: see RankCall.drafts
        raise RuntimeError("a relay proposes nothing: the decider's drafts are received instead")


class Deferred:
    """``target`` (a streamer, the call's processors) whose methods in ``fallbacks`` never raise
    here: the first error one raises is held by ``call`` (a RankCall) for its next message; then,
    and once the rank has failed, they return ``fallbacks[name](*args)`` instead (processors: the
    scores unprocessed; a streamer: nothing)."""

    def __init__(self, target, call, fallbacks: dict[str, Callable]):
        self._target, self._call, self._fallbacks = target, call, fallbacks

    def __bool__(self) -> bool:
        return bool(self._target)

    def __getattr__(self, name):
        if name in ("_target", "_call", "_fallbacks"):  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        value = getattr(self._target, name)
        if name not in self._fallbacks:
            return value
        fallback = self._fallbacks[name]

        def deferred(*args, **kwargs):
            if self._call.failed:
                return fallback(*args, **kwargs)
            try:
                return value(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - every rank raises it at the next message
                self._call.hold(exc)
                return fallback(*args, **kwargs)

        return deferred


class DeferringSession(CandidateGenerator):
    """The generator's session on a rank that runs it: ``setup`` and ``propose`` run inside the
    call's messages (``call.together``, ``call.drafts``: see
    :class:`~specdec.distributed.call.RankCall`); the hooks between messages (``observe``,
    ``select_rows``, ``report``) run :class:`Deferred`-like."""

    name = "deferring"

    def __init__(self, session: CandidateGenerator, plugin: str, call):
        self.inner, self.call, self.plugin = session, call, plugin
        self.info = declared_drafting(session, plugin)

    def __getattr__(self, name):
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def session(self) -> "DeferringSession":
        return self

    def drafting(self) -> DraftingInfo:
        return self.info

    def setup(self, ctx) -> None:
        self.inner.setup(ctx)
        layers = self.inner.drafting().hidden_layers
        if layers:  # a rank holds its shard's states, and the decider reads none of the verifying forward
            raise ValueError(f"candidate generator {self.plugin!r} reads the target's hidden states "
                             f"(layers {list(layers)}), which specdec does not hand a drafter from a sharded target; "
                             "use prompt_lookup, suffix or a draft model (docs/distributed.md)")

    def propose(self, ctx, max_drafts):
        return self.inner.propose(ctx, max_drafts)

    def observe(self, ctx, feedback) -> None:
        self.call.defer(lambda: self.inner.observe(ctx, feedback))

    def select_rows(self, rows) -> None:
        self.call.defer(lambda: self.inner.select_rows(rows))

    def report(self) -> dict:
        report = self.call.defer(self.inner.report)
        return {} if report is None else report


class SharedStopper:
    """A :class:`~specdec.stopping.Stopper` whose cuts are the decider's (see
    :meth:`~specdec.distributed.call.RankCall.cut`)."""

    def __init__(self, stopper, call):
        self.base, self.call = stopper, call

    def __getattr__(self, name):
        return getattr(self.base, name)

    def cut(self, tokens, committed, block, counts, prompt_lengths, scores=None):
        return self.call.cut(lambda: self.base.cut(tokens, committed, block, counts, prompt_lengths, scores),
                             block.shape[0], block.device)
