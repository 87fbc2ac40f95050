"""What a call returns: ``transformers``' own output type, with the speculative statistics.

:class:`SpecOutput` is a ``GenerateDecoderOnlyOutput``: ``sequences`` (the prompt as given, then
each row's new tokens, right-padded with the pad id), and, when the call asks for them
(``output_scores`` / ``output_logits``), ``scores`` / ``logits``: one ``[B, V]`` tensor per
generated token, as ``model.generate()`` returns them (the processed scores, float32 unless a
processor returns another dtype; the raw logits, float32).
``stats`` (:class:`~specdec.metrics.AcceptanceStats`) travels with it. ``past_key_values``,
``attentions`` and ``hidden_states`` stay None: the run's caches are its own, and per-step
attentions are refused before the call starts.

A row that ended before the longest one holds zeros in the later steps' scores (``generate()``
keeps scoring the padding it appends there; a speculative run never computes those). Where
``generate()`` pads no finished row (no EOS criterion), every row goes on to the last one's stop
and holds its own scores there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .metrics import AcceptanceStats


@dataclass
class SpecOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` (sequences [B, P + new], scores, logits) plus ``stats``."""

    stats: AcceptanceStats | None = None


class ScoreRecorder:
    """Keeps, per row of the prompt, the processed scores and raw logits of each committed token,
    for the outputs the call asked for (neither: records nothing)."""

    def __init__(self, batch: int, scores: bool, logits: bool):
        self.want_scores, self.want_logits = scores, logits
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]

    def __bool__(self) -> bool:
        return self.want_scores or self.want_logits

    def record(self, rows: torch.Tensor, kept: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor) -> None:
        """rows [B] each row's index in the prompt; kept [B] tokens committed this step; scores and
        logits [B, k+1, V]: the processed scores and raw logits at each block position."""
        for b, (row, n) in enumerate(zip(rows.tolist(), kept.tolist())):
            if self.want_scores:  # in the dtype the processors returned, as generate() keeps them
                self.scores[row].append(scores[b, :n].clone())
            if self.want_logits:
                self.logits[row].append(logits[b, :n].float().clone())

    def tuples(self, steps: int | None = None) -> tuple[tuple[torch.Tensor, ...] | None,
                                                         tuple[torch.Tensor, ...] | None]:
        """-> (scores, logits): each a tuple of one [B, V] tensor per generated token (the first
        ``steps``: a row that went on past its stop may hold more), or None."""
        return (_per_step(self.scores, steps) if self.want_scores else None,
                _per_step(self.logits, steps) if self.want_logits else None)


def _per_step(per_row: list[list[torch.Tensor]], steps: int | None = None) -> tuple[torch.Tensor, ...]:
    rows = [torch.cat(parts) if parts else None for parts in per_row]  # [n_b, V] each
    present = [r for r in rows if r is not None]
    if not present:
        return ()
    longest, vocab = max(r.shape[0] for r in present), present[0].shape[1]
    steps = longest if steps is None else min(steps, longest)
    out = present[0].new_zeros(steps, len(rows), vocab)  # [T, B, V]
    for b, r in enumerate(rows):
        if r is not None:
            out[: min(r.shape[0], steps), b] = r[:steps]
    return tuple(out.unbind(0))
