"""One distributed call's messages between its ranks, and where a failed rank leaves its error.

:class:`Messenger` is the channel under a :class:`~specdec.distributed.call.RankCall`. A message is
one all-reduce (sum) of an int32 vector on the call's gloo group: ``world`` slots (each rank's
digest of what it holds, or -1: that rank failed), then the decider's payload. Every rank raises
alike where a rank failed (the failed one its own error, the others :class:`RankFailedError`
naming it) or the digests differ; such an error is marked :func:`agreed` (every rank knows it: the
process groups stay usable). A failing rank leaves its error's text in the process group's store,
under the call's id, where the others read it; a rank whose collective fails (a peer left, or the
timeout passed) raises another rank's published error where there is one, and marks the groups
broken (:func:`~specdec.distributed.ranks.check_usable`).
"""

from __future__ import annotations

import itertools
import time

import torch

from .ranks import DistributedDecodeError, RankFailedError, Ranks, RanksDivergedError, check_usable, mark_broken

#: a process-wide count of distributed calls: every rank makes the same calls, so it names a call
#: the same way on every rank (the store keys of its errors)
_CALLS = itertools.count(1)


def agreed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as known to every rank (a message carried it): the process groups stay usable."""
    exc.__specdec_agreed__ = True
    return exc


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class Messenger:
    """One call's messages (see the module docstring): what they cost (``messages``, ``bytes``,
    ``seconds``), and this rank's error held for the next one (``pending``)."""

    def __init__(self, ranks: Ranks):
        """The channel of a new call on ``ranks`` (whose groups must still be usable)."""
        check_usable()
        self.ranks, self.id = ranks, next(_CALLS)
        self.decides = ranks.decides
        self.pending: BaseException | None = None  # this rank's error, held for the next message
        self.messages, self.bytes, self.seconds = 0, 0, 0.0

    def _exchange(self, payload: torch.Tensor | None, size: int, error: BaseException | None, digest: int,
                  what: str = "the committed tokens") -> torch.Tensor:
        """One message: every rank's digest (or -1: failed) and the decider's ``payload`` [size]
        (int32) -> the payload on every rank; raises on every rank if any rank failed (this
        rank's held error first) or the digests differ."""
        import torch.distributed as dist

        if self.pending is not None:  # failed since the last message: that error is this rank's
            error, self.pending = self.pending, None
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
            raise agreed(error)
        if failed:
            raise agreed(RankFailedError(self._errors(failed)))
        if bool((slots != slots[0]).any()):
            raise agreed(RanksDivergedError(
                f"the ranks disagree on {what} (digests by rank: {slots.tolist()}): every rank must run the same "
                "calls with the same arguments, and its models must compute alike"))
        return message[ranks.world:]

    def _key(self, rank: int) -> str:
        return f"specdec/call{self.id}/failed/rank{rank}"

    def _publish(self, error: BaseException) -> None:
        try:
            self.ranks.store.set(self._key(self.ranks.rank), error_text(error)[:2000])
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
        """What a rank whose collective failed raises: another rank's error where it published one.
        The groups are unusable from then on (:func:`~specdec.distributed.ranks.check_usable`)."""
        others = self._peer_errors(wait=2.0)
        mark_broken(f"call {self.id}: rank {self.ranks.rank} lost the other ranks ({type(exc).__name__})")
        if others:
            return RankFailedError(others)
        return DistributedDecodeError(
            f"rank {self.ranks.rank} lost the other ranks during generate() ({type(exc).__name__}: {exc}); a rank "
            f"stopped without an error, or took longer than the timeout ({self.ranks.options.timeout:g} s)")
