"""One call's decisions, shared: the run meets its coordinator at a few points of a step.

:data:`SOLO` takes every decision in place (a target held whole by this process). A
:class:`RankCall` makes the decider's decisions every rank's: the generator's setup agreed
(:meth:`~RankCall.together`), the drafts each forward verifies (:meth:`~RankCall.drafts`), the
sampled verdict (:meth:`~RankCall.verdict`), a user criterion's cut (:class:`SharedStopper`), the
output and statistics at the end (:meth:`~RankCall.finish`); :meth:`~RankCall.guard` turns a
failure on one rank into one error on every rank. Each message is one all-reduce of an int32
vector: ``world`` slots (each rank's digest, or -1: failed), then the decider's payload (see the
package docstring).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Callable

import torch

from ..generators import CandidateGenerator, DraftingInfo, Proposal, declared_drafting
from ..verify import Verdict
from .ranks import (DECIDER, INLINE_DRAFTS, DistributedDecodeError, RankFailedError, Ranks, RanksDivergedError,
                    abort_process_groups, digest, sharding)

#: a process-wide count of distributed calls: every rank makes the same calls, so it names a call
#: the same way on every rank (the store keys of its errors)
_CALLS = itertools.count(1)


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

    def streamer(self, streamer):
        return streamer

    def check_assistant(self, model, mirrors: bool) -> None:
        pass

    def guard(self):
        return contextlib.nullcontext()

    def finish(self, sequences: torch.Tensor, stats):
        return sequences, stats


SOLO = Solo()


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


def _attempt(work: Callable):
    """(work(), None), or (None, the exception it raised)."""
    try:
        return work(), None
    except Exception as exc:  # noqa: BLE001 - handed to every rank by the next message
        return None, exc


def _agreed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as known to every rank (a message carried it): the process groups stay usable."""
    exc.__specdec_agreed__ = True
    return exc


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


class RankCall:
    """One distributed ``generate()`` call: the decisions its ranks share, what its messages cost,
    and its failures (see the package docstring)."""

    def __init__(self, ranks: Ranks, fingerprint: int):
        """The coordinator of one ``generate()`` call whose arguments digest to ``fingerprint``."""
        self.ranks, self.id, self.fingerprint = ranks, next(_CALLS), fingerprint
        self.decides = ranks.decides
        self.replicated = ranks.options.draft_placement == "replicated"
        self.messages, self.bytes, self.seconds, self.steps = 0, 0, 0.0, 0

    # -- the run's decision points ------------------------------------------------------------------
    def session(self, generator: CandidateGenerator) -> CandidateGenerator:
        """The generator's session on this rank: a :class:`Relay` where it does not draft."""
        session = generator.session()
        if self.decides or self.replicated:
            return session
        return Relay(session, generator.name or type(generator).__name__)

    def together(self, work: Callable[[], None]) -> None:
        """Run ``work`` (the generator's setup) here, then agree that it went well on every rank
        and that every rank was given the same call."""
        _, error = _attempt(work)
        self._exchange(None, 0, error, self.fingerprint, what="the call's arguments")

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
        if self.decides or self.replicated:
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
        """The decider's verdict on every rank. Greedy verification runs on every rank (they hold
        the same logits; the next message compares the tokens they commit); under sampling one
        message carries the accepted counts and the target's tokens. ``like``: the drafts [B, k]."""
        if not sampled:
            return verify()
        batch = like.shape[0]
        mine, error = _attempt(verify) if self.decides else (None, None)
        payload = None if mine is None else torch.cat([mine.accepted, mine.next_token]).cpu().to(torch.int32)
        got = self._exchange(payload, 2 * batch, error, 0).long().to(like.device)
        return mine if self.decides else Verdict(got[:batch], got[batch:])

    def cut(self, cut: Callable, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The decider's stopping decision (keep [B], finished [B]) on every rank: user stopping
        criteria may read a clock."""
        mine, error = _attempt(cut) if self.decides else (None, None)
        payload = None if mine is None else torch.cat([mine[0], mine[1].long()]).cpu().to(torch.int32)
        got = self._exchange(payload, 2 * batch, error, 0).long().to(device)
        return mine if self.decides else (got[:batch], got[batch:].bool())

    def stopper(self, stopper):
        """``stopper``, or where it holds user criteria, one that shares the decider's cuts."""
        users = [c for c in stopper.criteria if type(c).__name__ != "StopStringCriteria"]
        return SharedStopper(stopper, self) if users else stopper

    def streamer(self, streamer):
        """The streamer fed on this rank: the decider's only."""
        return streamer if self.decides else None

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
        this rank's messages cost in ``stats.coordination``."""
        import torch.distributed as dist

        stats.coordination = {"messages": self.messages, "bytes": self.bytes, "seconds": self.seconds,
                              "steps": self.steps}
        gathered: list = [None] * self.ranks.world
        try:
            dist.all_gather_object(gathered, (digest(sequences), stats if self.decides else None),
                                   group=self.ranks.group)
        except Exception as exc:  # noqa: BLE001
            raise self._lost(exc) from exc
        digests = [g[0] for g in gathered]
        if len(set(digests)) > 1:
            raise _agreed(RanksDivergedError(f"the ranks' outputs differ (digests {digests})"))
        return sequences, gathered[DECIDER][1]

    @contextlib.contextmanager
    def guard(self):
        """Around a call's run: an error raised on this rank outside a message reaches every rank."""
        try:
            yield
        except BaseException as exc:
            if getattr(exc, "__specdec_agreed__", False):
                raise
            if self.messages == 0:  # before the first message: every rank meets at together()'s
                try:
                    self._exchange(None, 0, exc, self.fingerprint)
                except BaseException as settled:
                    if getattr(settled, "__specdec_agreed__", False):
                        raise  # every rank knows (this error, or another rank's)
            others = self._peer_errors(wait=2.0 if _is_communication_error(exc) else 0.0)
            if not others:
                self._publish(exc)
            abort_process_groups()
            if others:
                raise RankFailedError(others) from exc
            raise

    # -- messages -----------------------------------------------------------------------------------
    def _exchange(self, payload: torch.Tensor | None, size: int, error: BaseException | None, digest: int,
                  what: str = "the committed tokens") -> torch.Tensor:
        """One message: every rank's digest (or -1: failed) and the decider's ``payload`` [size]
        (int32) -> the payload on every rank; raises on every rank if any rank failed or the
        digests differ."""
        import torch.distributed as dist

        ranks = self.ranks
        message = torch.zeros(ranks.world + size, dtype=torch.int32)
        message[ranks.rank] = -1 if error is not None else digest
        if error is not None:
            self._publish(error)
        elif self.decides and payload is not None:
            message[ranks.world:] = payload
        started = time.perf_counter()
        try:
            dist.all_reduce(message, group=ranks.group)
        except Exception as exc:  # noqa: BLE001 - a rank left (aborted, died) or timed out
            raise (error if error is not None else self._lost(exc)) from exc
        self.seconds += time.perf_counter() - started
        self.messages, self.bytes = self.messages + 1, self.bytes + 4 * message.numel()
        slots = message[: ranks.world]
        failed = (slots == -1).nonzero().flatten().tolist()
        if error is not None:
            raise _agreed(error)
        if failed:
            raise _agreed(RankFailedError(self._errors(failed)))
        if bool((slots != slots[0]).any()):
            raise _agreed(RanksDivergedError(
                f"the ranks disagree on {what} (digests by rank: {slots.tolist()}): every rank must run the same "
                "calls with the same arguments, and its models must compute alike"))
        return message[ranks.world:]

    def _state_digest(self, state) -> int:
        """A digest of the committed tokens of ``state`` (a ModelState)."""
        return digest(state.lengths, state.tokens[:, : int(state.lengths.max()) if state.lengths.numel() else 0])

    def _key(self, rank: int) -> str:
        return f"specdec/call{self.id}/failed/rank{rank}"

    def _publish(self, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"[:2000]
        try:
            self.ranks.store.set(self._key(self.ranks.rank), text)
        except Exception:  # noqa: BLE001 - the store is gone: the others learn it from the collective
            pass

    def _errors(self, failed: list[int]) -> str:
        """'rank r failed: <its error>' for each rank in ``failed``."""
        lines = []
        for rank in failed:
            try:
                key = self._key(rank)
                text = self.ranks.store.get(key).decode() if self.ranks.store.check([key]) else "(no message)"
            except Exception:  # noqa: BLE001
                text = "(no message: the store is unreachable)"
            lines.append(f"rank {rank} failed during generate(): {text}")
        return "\n".join(lines)

    def _peer_errors(self, wait: float) -> str:
        """The errors other ranks published for this call (waiting up to ``wait`` seconds for one)."""
        deadline = time.monotonic() + wait
        others = [r for r in range(self.ranks.world) if r != self.ranks.rank]
        while True:
            try:
                failed = [r for r in others if self.ranks.store.check([self._key(r)])]
            except Exception:  # noqa: BLE001
                failed = []
            if failed or time.monotonic() >= deadline:
                return self._errors(failed) if failed else ""
            time.sleep(0.05)

    def _lost(self, exc: BaseException) -> DistributedDecodeError:
        """What a rank whose collective failed raises: another rank's error where it published one."""
        others = self._peer_errors(wait=2.0)
        if others:
            return RankFailedError(others)
        return DistributedDecodeError(
            f"rank {self.ranks.rank} lost the other ranks during generate() ({type(exc).__name__}: {exc}); a rank "
            f"stopped without an error, or took longer than the timeout ({self.ranks.options.timeout:g} s)")


def _is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a failed collective (a peer that left), not this rank's own error."""
    text = f"{type(exc).__name__} {exc}"
    return any(word in text for word in ("DistBackendError", "gloo", "NCCL", "Connection", "Timed out"))


class SharedStopper:
    """A :class:`~specdec.stopping.Stopper` whose cuts are the decider's (see :meth:`RankCall.cut`)."""

    def __init__(self, stopper, call: RankCall):
        self.base, self.call = stopper, call

    def __getattr__(self, name):
        return getattr(self.base, name)

    def cut(self, tokens, committed, block, counts, prompt_lengths, scores=None):
        return self.call.cut(lambda: self.base.cut(tokens, committed, block, counts, prompt_lengths, scores),
                             block.shape[0], block.device)
