"""One call's decisions, shared: the run meets its coordinator at a few points of a step.

:data:`SOLO` takes every decision in place (a target held whole by this process). A
:class:`RankCall` makes the decider's decisions every rank's: the call agreed and the generator's
setup with it (:meth:`~RankCall.together`), the drafts each forward verifies
(:meth:`~RankCall.drafts`), the verdict (:meth:`~RankCall.verdict`: the decider's under sampling;
with logits processors, agreed), a user criterion's cut (:class:`SharedStopper`), the output and
statistics at the end (:meth:`~RankCall.finish`). Each message is one all-reduce of an int32
vector: ``world`` slots (each rank's digest, or -1: failed), then the decider's payload (sent by
its :class:`~specdec.distributed.messages.Messenger`; see the package docstring). What the run
holds in place of the user's generator, streamer, processors and stopper: ``stand_ins.py``.

Ranks stay in step from one call to the next: every rank's call sends the same messages, in the
same order, whatever fails where.

* :func:`coordinated` opens the call before its arguments are checked, so a check that fails on
  one rank only (an id outside the vocabulary in one rank's prompt) is that rank's slot in the
  call's first message (:meth:`~RankCall.guard`), not a call the other ranks wait in; the first
  message also compares the calls' fingerprints (``fingerprint.py``) and names what differs.
* User code that runs on one rank, or on every rank between messages (logits processors, the
  streamer, the generator's ``observe`` / ``select_rows`` / ``report``), runs :class:`Deferred`:
  its error is held (:meth:`~RankCall.hold`) and that rank sends -1 at the next message, whose
  shape does not depend on what failed; the rank skips its decisions until then.
* Only an error where no message comes next in step (inside the target's forward, whose
  collectives the other ranks wait in) aborts the process groups; a later call then raises
  :func:`~specdec.distributed.ranks.check_usable`'s error.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from ..generators import CandidateGenerator, Proposal, plugin_name
from ..verify import Verdict
from .fingerprint import Fingerprint, digest
from .messages import Messenger, agreed, error_text
from .ranks import (DECIDER, INLINE_DRAFTS, DistributedDecodeError, RankFailedError, Ranks, RanksDivergedError,
                    abort_process_groups, broken, sharding)
from .stand_ins import Deferred, DeferringSession, Relay, SharedStopper


# -- one process: every decision in place ----------------------------------------------------------
class Solo:
    """The coordinator of a call that is not distributed: every decision is taken here."""

    decides = True

    def session(self, generator: CandidateGenerator) -> CandidateGenerator:
        return generator.session()

    def together(self, work: Callable[[], None]) -> None:
        work()

    def drafts(self, draft: Callable, room: torch.Tensor, max_drafts: int | None, state):
        return draft()

    def verdict(self, verify: Callable[[], Verdict], sampled: bool, device) -> Verdict:
        return verify()

    def stopper(self, stopper):
        return stopper

    def streamer(self, streamer, prompt_streamed: bool = False):
        return streamer

    def processors(self, processors):
        return processors

    def fail(self, error: BaseException) -> None:
        """This process failed where the run can still go on to its next decision point: raise now."""
        raise error

    def check_assistant(self, model, mirrors: bool) -> None:
        pass

    def finish(self, sequences: torch.Tensor, stats):
        return sequences, stats


SOLO = Solo()


@contextlib.contextmanager
def coordinated(ranks: Ranks | None):
    """The coordinator of one call, around all of it, its argument checks first: :data:`SOLO`
    for a target held whole (``ranks`` None), else a :class:`RankCall` whose guard turns a
    failure on any rank, anywhere inside, into one error on every rank."""
    if ranks is None:
        yield SOLO
        return
    call = RankCall(ranks)
    with call.guard():
        yield call


def _attempt(work: Callable):
    """(work(), None), or (None, the exception it raised)."""
    try:
        return work(), None
    except Exception as exc:  # noqa: BLE001 - handed to every rank by the next message
        return None, exc


def _nothing(*args, **kwargs) -> None:
    return None


class _EndOnly:
    """A streamer's stand-in that ends it and puts nothing (a non-deciding rank's)."""

    def __init__(self, streamer):
        self.streamer = streamer

    def put(self, value) -> None:
        pass

    def end(self) -> None:
        self.streamer.end()


def _unprocessed(scores: torch.Tensor, pos) -> torch.Tensor:
    return scores


def _pack(offered: torch.Tensor, token_ids: torch.Tensor, inline: int, limit: int) -> torch.Tensor:
    """offered [B], token_ids [B, K] -> int32 [B + B * inline]: the counts, then each row's first
    ``inline`` ids (zero-padded)."""
    batch = offered.shape[0]
    if batch and int(offered.max()) > limit:
        raise RuntimeError(f"drafts offered ({offered.tolist()}) exceed what the rows may take ({limit})")
    ids = torch.zeros(batch, inline, dtype=torch.int32)
    width = min(inline, token_ids.shape[1])
    ids[:, :width] = token_ids[:, :width].cpu()
    return torch.cat([offered.cpu().to(torch.int32), ids.flatten()])


class RankCall(Messenger):
    """One distributed ``generate()`` call: the decisions its ranks share, what its messages cost,
    and its failures (see the package docstring)."""

    def __init__(self, ranks: Ranks):
        """The coordinator of one call, made before its arguments are checked (:func:`coordinated`);
        :meth:`given` tells it the call's fingerprint before its first message."""
        super().__init__(ranks)
        self.replicated = ranks.options.draft_placement == "replicated"
        self.fingerprint: Fingerprint | None = None
        self.generator: torch.Generator | None = None  # under sampling: every rank's ends as the decider's
        self.processed = False  # the call has logits processors: its greedy verdicts are agreed too
        self.steps = 0

    def given(self, fingerprint: Fingerprint, generator: torch.Generator | None = None) -> None:
        """The call's arguments (compared at the first message) and, under sampling, its generator."""
        self.fingerprint, self.generator = fingerprint, generator

    # -- errors held until the next message -----------------------------------------------------------
    @property
    def failed(self) -> bool:
        """Whether this rank holds an error for the next message (it skips its decisions until then)."""
        return self.pending is not None

    def hold(self, error: BaseException) -> None:
        """Keep this rank's first error for the next message."""
        if self.pending is None:
            self.pending = error

    def fail(self, error: BaseException) -> None:
        """This rank failed where the run can still go on to its next message (an error every rank
        raises alike, after the verdict, say): held, and raised there on every rank. The run goes
        on until then, its decisions skipped (:attr:`failed`)."""
        self.hold(error)

    def defer(self, work: Callable):
        """work(), or None with its error held (nothing runs once the rank has failed)."""
        if self.failed:
            return None
        result, error = _attempt(work)
        if error is not None:
            self.hold(error)
        return result

    # -- the run's decision points ------------------------------------------------------------------
    def session(self, generator: CandidateGenerator) -> CandidateGenerator:
        """The generator's session on this rank: a :class:`Relay` where it does not draft, else the
        session with its hooks between messages deferred."""
        session = generator.session()
        plugin = plugin_name(generator)
        if self.decides or self.replicated:
            return DeferringSession(session, plugin, self)
        return Relay(session, plugin)

    def together(self, work: Callable[[], None]) -> None:
        """Run ``work`` (the generator's setup) here, then agree that it went well on every rank
        and that every rank was given the same call (naming what differs where it was not)."""
        _, error = _attempt(work) if not self.failed else (None, None)
        value = self.fingerprint.value if self.fingerprint is not None else 0
        try:
            self._exchange(None, 0, error, value, what="the call's arguments")
        except RanksDivergedError:
            raise self._differing() from None

    def drafts(self, draft: Callable, room: torch.Tensor, max_drafts: int | None, state):
        """The decider's ``draft()`` (the run's propose and admit: (proposal, time drafted, (made,
        candidates, offered))) on every rank: one message of the counts and ids of the drafts the
        next forward verifies (a second one for blocks past :data:`INLINE_DRAFTS`)."""
        batch = room.shape[0]
        limit = int(room.clamp_min(0).max()) if batch else 0
        limit = limit if max_drafts is None else min(limit, max_drafts)
        inline = min(limit, INLINE_DRAFTS)

        def decide():
            made = draft()
            proposal, _, (_, _, offered) = made
            return made, _pack(offered, proposal.token_ids, inline, limit) if self.decides else None

        mine = payload = error = None
        if (self.decides or self.replicated) and not self.failed:
            result, error = _attempt(decide)
            mine, payload = result if result is not None else (None, None)
        got = self._exchange(payload, batch * (1 + inline), error, self._state_digest(state))
        offered = got[:batch].long()  # [B]
        k = int(offered.max()) if batch else 0
        ids = got[batch:].view(batch, inline)[:, :k]  # [B, k]
        if k > inline:  # a long block: its ids in a second message
            extra = mine[0].token_ids[:, :k].cpu().to(torch.int32).flatten() if self.decides else None
            ids = self._exchange(extra, batch * k, None, 0).view(batch, k)
        self.steps += 1
        if self.decides:
            return mine
        offered, ids = offered.to(state.device), ids.long().to(state.device)
        return Proposal(ids, offered), time.perf_counter(), (offered, offered, offered)

    def verdict(self, verify: Callable[[], Verdict], sampled: bool, like: torch.Tensor) -> Verdict:
        """The verdict on every rank. Greedy verification runs on every rank (they hold the same
        logits: the next message compares the tokens they commit); with logits processors (user
        code, run on every rank) one message then agrees it went well everywhere. Under sampling
        one message carries the decider's accepted counts and target tokens. ``like``: the drafts [B, k]."""
        if not sampled and not self.processed:
            return verify()
        batch = like.shape[0]
        runs = (self.decides or not sampled) and not self.failed
        mine, error = _attempt(verify) if runs else (None, None)
        if not sampled:
            self._exchange(None, 0, error, 0)
            return mine
        payload = None if mine is None else torch.cat([mine.accepted, mine.next_token]).cpu().to(torch.int32)
        got = self._exchange(payload, 2 * batch, error, 0).long().to(like.device)
        return mine if self.decides else Verdict(got[:batch], got[batch:])

    def cut(self, cut: Callable, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The decider's stopping decision (keep [B], finished [B]) on every rank: user stopping
        criteria may read a clock."""
        mine, error = _attempt(cut) if self.decides and not self.failed else (None, None)
        payload = None if mine is None else torch.cat([mine[0], mine[1].long()]).cpu().to(torch.int32)
        got = self._exchange(payload, 2 * batch, error, 0).long().to(device)
        return mine if self.decides else (got[:batch], got[batch:].bool())

    def stopper(self, stopper):
        """``stopper``, or where it holds user criteria, one that shares the decider's cuts."""
        users = [c for c in stopper.criteria if type(c).__name__ != "StopStringCriteria"]
        return SharedStopper(stopper, self) if users else stopper

    def streamer(self, streamer, prompt_streamed: bool = False):
        """The streamer fed on this rank: the decider's only, its errors held for the next message.
        Another rank's gets only its end, where ``generate()`` already gave it the prompt
        (``prompt_streamed``: the custom_generate door), so that a reader of it finishes."""
        if streamer is None:
            return None
        if not self.decides:
            return _EndOnly(streamer) if prompt_streamed else None
        return Deferred(streamer, self, {"put": _nothing, "end": _nothing})

    def processors(self, processors):
        """The call's processors (a BlockProcessors, or None), their errors held for the next message."""
        self.processed = processors is not None
        return None if processors is None else Deferred(processors, self, {"apply": _unprocessed})

    def check_assistant(self, model, mirrors: bool) -> None:
        if sharding(model):
            raise ValueError(f"the assistant {type(model).__name__} is sharded across ranks ({', '.join(sharding(model))} "
                             "parallel); load it whole on every rank: specdec runs drafters on one rank "
                             "(docs/distributed.md)")
        if mirrors:
            raise ValueError("prefill_from_target copies the target's cache, which is sharded across ranks here; "
                             "use a drafter that prefills itself (docs/distributed.md)")

    # -- the end of the call ------------------------------------------------------------------------
    def finish(self, sequences: torch.Tensor, stats):
        """Every rank returns its sequences (checked equal) and the decider's statistics, with what
        this rank's messages cost in ``stats.coordination``; under sampling every rank's generator
        ends in the decider's state (as if it had drawn the call's numbers itself)."""
        import torch.distributed as dist

        stats.coordination = {"messages": self.messages, "bytes": self.bytes, "seconds": self.seconds,
                              "steps": self.steps}
        error, self.pending = self.pending, None
        state = self.generator.get_state() if self.decides and self.generator is not None else None
        mine = (digest(sequences), stats if self.decides else None, state, error_text(error) if error else None)
        gathered: list = [None] * self.ranks.world
        try:
            dist.all_gather_object(gathered, mine, group=self.ranks.group)
        except Exception as exc:  # noqa: BLE001
            raise (error if error is not None else self._lost(exc)) from exc
        if error is not None:
            raise agreed(error)
        failed = [(r, g[3]) for r, g in enumerate(gathered) if g[3] is not None]
        if failed:
            lines = [f"rank {r} failed during generate(): {text}" for r, text in failed]
            raise agreed(RankFailedError("\n".join(lines)))
        digests = [g[0] for g in gathered]
        if len(set(digests)) > 1:
            raise agreed(RanksDivergedError(f"the ranks' outputs differ (digests {digests})"))
        if self.generator is not None and not self.decides:
            self.generator.set_state(gathered[DECIDER][2])
        return sequences, gathered[DECIDER][1]

    @contextlib.contextmanager
    def guard(self):
        """Around a call, its argument checks included: an error raised on this rank outside a
        message reaches every rank."""
        try:
            yield
        except BaseException as exc:
            if getattr(exc, "__specdec_agreed__", False):
                raise
            if self.messages == 0 and not broken():  # before the first message: every rank meets at together()'s
                try:
                    self._exchange(None, 0, exc, 0)
                except BaseException as settled:
                    if getattr(settled, "__specdec_agreed__", False):
                        raise  # every rank knows (this error, or another rank's)
            # no message comes next in step (a forward's collective failed or was left): the groups go
            others = self._peer_errors(wait=2.0 if _is_communication_error(exc) else 0.0)
            if not others:
                self._publish(exc)
            abort_process_groups(f"call {self.id} failed on rank {self.ranks.rank}: {error_text(exc)[:300]}")
            if others:
                raise RankFailedError(others) from exc
            raise

    # -- messages (each one: Messenger._exchange) ---------------------------------------------------
    def _differing(self) -> DistributedDecodeError:
        """The first message's digests differ: every rank sends its fingerprint's parts, and
        raises one error naming those that differ."""
        import torch.distributed as dist

        gathered: list = [None] * self.ranks.world
        try:
            dist.all_gather_object(gathered, self.fingerprint, group=self.ranks.group)
        except Exception as lost:  # noqa: BLE001
            return self._lost(lost)
        parts = self.fingerprint.differing([g for g in gathered if g is not None]) if self.fingerprint else []
        return agreed(RanksDivergedError(
            f"the ranks were given different calls: their {', '.join(parts) or 'arguments'} differ. Every rank "
            "must make the same calls with the same arguments, in the same order (a seeded generator under "
            "sampling: the same seed on every rank)"))

    def _state_digest(self, state) -> int:
        """A digest of the committed tokens of ``state`` (a ModelState)."""
        return digest(state.lengths, state.tokens[:, : int(state.lengths.max()) if state.lengths.numel() else 0])


def _is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a failed collective (a peer that left), not this rank's own error."""
    text = f"{type(exc).__name__} {exc}"
    return any(word in text for word in ("DistBackendError", "gloo", "NCCL", "Connection", "Timed out"))
