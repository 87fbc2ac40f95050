"""Assistant: the narrow handle a candidate generator gets for a model it attached.

A generator that drafts with a model never touches that model's cache, layout or first-iteration
flag: the controller owns them (a :class:`~specdec.state.ModelState` per model) and the generator
holds an :class:`Assistant`, which can only

* ``next_logits()``: feed every pending token and return the distribution of each row's next token;
* ``feed(ids)``: append drafted tokens (fed by the next ``next_logits``);
* ``rewrite(keep, tails)``: for an assistant in its own token space (another tokenizer), replace
  each row's tokens after ``keep[b]`` by ``tails[b]``; the longest common prefix stays cached;
* read its rows (``lengths``, ``row(b)``).

An assistant attached without tokens shares the target's ids, and the controller brings it to
the committed prefix after every verification (tokens it already holds stay cached and are never
fed again); ``rewrite`` is refused for it. Everything else (its one prefill with the prefill-only
inputs its forward declares, dropping finished rows) happens without the generator's help.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .host import host_ints, host_long, hosted
from .state import ModelState


class Assistant:
    def __init__(self, state: ModelState, *, follows_target: bool):
        self._state = state
        self.follows_target = follows_target

    @property
    def model(self):
        return self._state.model

    @property
    def batch_size(self) -> int:
        return self._state.batch_size

    @property
    def lengths(self) -> torch.Tensor:
        """[B] tokens per row (committed, plus drafts fed since the last verification)."""
        return hosted(self._state.lengths.clone(), list(host_ints(self._state.lengths)))

    def row(self, b: int, start: int = 0, end: int | None = None) -> list[int]:
        """Row b's tokens ``[start:end]`` (end defaults to the row's length)."""
        end = int(self._state.lengths[b]) if end is None else end
        return self._state.tokens[b, start:end].tolist()

    def next_logits(self) -> torch.Tensor:
        """Feed every pending token; return ``[B, vocab]`` logits of each row's next token."""
        state = self._state
        return state.forward(start=host_long([n - 1 for n in host_ints(state.lengths)], state.device))[:, -1]

    def feed(self, ids: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Append ``ids [B]`` (one token per row) or ``ids [B, n]`` (the first ``counts[b]`` of row b)."""
        self._state.append(ids[:, None] if ids.dim() == 1 else ids, counts)

    def rewrite(self, keep: Sequence[int] | torch.Tensor, tails: Sequence[Sequence[int]]) -> None:
        """Row b becomes its first ``keep[b]`` tokens followed by ``tails[b]`` (own token space only).

        Tokens that are unchanged stay cached, so re-tokenizing a tail that comes out the same
        costs no forward; each row must end with at least one token."""
        if self.follows_target:
            raise RuntimeError("this assistant shares the target's tokens: the controller keeps it in step")
        state = self._state
        device = state.device
        keep = torch.as_tensor(keep, dtype=torch.long, device=device).reshape(-1)  # [B]
        counts = torch.tensor([len(t) for t in tails], dtype=torch.long, device=device)  # [B]
        if keep.shape[0] != state.batch_size or len(tails) != state.batch_size:
            raise ValueError(f"rewrite needs one entry per row ({state.batch_size}), got {keep.shape[0]} and {len(tails)}")
        lengths = keep + counts
        if bool((lengths < 1).any()):
            raise ValueError("rewrite would leave a row empty")
        widest = int(counts.max()) if counts.numel() else 0
        tokens = state.tokens.new_full((state.batch_size, max(int(lengths.max()), state.tokens.shape[1])),
                                       state.pad_token_id)
        tokens[:, : state.tokens.shape[1]] = state.tokens
        if widest:
            block = torch.tensor([list(t) + [state.pad_token_id] * (widest - len(t)) for t in tails],
                                 dtype=torch.long, device=device)  # [B, widest]
            cols = keep[:, None] + torch.arange(widest, device=device)[None, :]  # [B, widest]
            valid = torch.arange(widest, device=device)[None, :] < counts[:, None]
            rows = torch.arange(state.batch_size, device=device)[:, None].expand_as(cols)
            tokens[rows[valid], cols[valid]] = block[valid]
        state.sync(tokens, lengths, since=torch.minimum(keep, state.lengths))
