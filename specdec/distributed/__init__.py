"""Decoding with a target sharded across processes: transformers' tensor and pipeline parallelism.

A target loaded with ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N |
pp_size=N))`` under ``torchrun`` is one computation spread over N processes: every forward is a
collective, so every rank must feed it the same tokens, in the same order, with the same shapes.
Each rank runs the whole loop (``SpecDecoder.generate`` on the same prompt); what a rank could
decide differently from another is decided once, by the *decider* (group rank 0), and sent:

* before each target forward, the drafts it verifies: each row's count and ids (the draft-length
  policy decides from wall-clock timings, which differ between ranks; a drafter may sample);
* under sampling, after the forward, the verdict: accepted drafts and the target's token per row
  (the verifier draws random numbers); greedy with logits processors, an agreement that they ran
  well on every rank;
* with user stopping criteria (which may read a clock), where each row stops.

Everything else follows from the committed tokens and every rank computes it alike: greedy
verification (every rank holds the same logits: the sharded model gathers them itself), EOS,
``max_new_tokens``, stop strings. A message is one all-reduce (sum) of an int32 vector on a gloo
group of its own (CPU, whatever the target's backend), whose first ``world`` entries hold one
value per rank: a digest of the tokens that rank has committed (or of its call's arguments at
the first message: ``fingerprint.py``, naming the parts that differ), or -1 where that rank
failed. So each message also checks that the ranks agree, and carries any rank's failure: every
rank then raises (the failed one its own error, the others :class:`RankFailedError` naming it),
and the process group stays usable for the next call.

Ranks stay in step from one call to the next, whatever fails where: a call is coordinated from
before its arguments are checked (a check that fails on one rank is that rank's -1 at the first
message), and user code that runs between messages (logits processors, the streamer, the
generator's hooks) has its error held for the next message (``call.py``). Only a rank that fails
where no message comes next in step (inside a forward, where the others wait in the model's own
collectives) publishes its error in the process group's store and aborts the process groups, so
that the others' collectives fail at once; they raise :class:`RankFailedError` with that error,
and a later call on any rank raises a clear :class:`DistributedDecodeError` (the launch must
start again). Waiting is bounded by ``DistributedOptions.timeout``. Sizes of each message and the
measured overhead: docs/distributed.md.

Drafters (``DistributedOptions.draft_placement``): ``"one_rank"`` (the default) runs the generator
on the decider only; the other ranks hold a stand-in that declares the same drafting and never
runs, so a draft model is never run, nor given a cache, there. ``"replicated"`` runs it on every
rank (each drafts on its own copy, the decider's drafts are the ones verified, the others'
assistants are brought back to the committed tokens after each step, as always). A draft that is
itself sharded is refused: its forwards would be collectives the ranks issue differently.

A call that is not distributed meets :data:`SOLO`, which takes every decision in place.
"""

from .call import SOLO, Deferred, RankCall, Relay, SharedStopper, Solo, coordinated
from .fingerprint import Fingerprint, call_fingerprint
from .ranks import (DECIDER, INLINE_DRAFTS, PLACEMENTS, DistributedDecodeError, DistributedOptions, RankFailedError,
                    Ranks, RanksDivergedError, abort_process_groups, check_usable, sharding,
                    stage_layout)

__all__ = ["DECIDER", "INLINE_DRAFTS", "PLACEMENTS", "SOLO", "Deferred", "DistributedDecodeError",
           "DistributedOptions", "Fingerprint", "RankCall", "RankFailedError", "Ranks", "RanksDivergedError", "Relay",
           "SharedStopper", "Solo", "abort_process_groups", "call_fingerprint", "check_usable", "coordinated",
           "sharding", "stage_layout"]
