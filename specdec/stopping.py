"""Stopping and streaming, checked token by token inside every committed block.

A verification commits up to K+1 tokens at once. Plain generation would have checked its
stopping rules after each of them, so we do too: :meth:`Stopper.cut` returns, per row, how many
of the new tokens to keep, so the output ends exactly where ``target.generate`` would have ended.
User ``StoppingCriteria`` and ``stop_strings`` see each row on its own (shape ``[1, length]``),
as they would when decoding that row alone.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


class Stopper:
    def __init__(self, *, max_new_tokens: int, eos_token_ids: Sequence[int], stop_strings=None,
                 tokenizer=None, stopping_criteria=None):
        self.max_new_tokens = max_new_tokens
        self.eos = torch.tensor(sorted(set(int(e) for e in eos_token_ids)), dtype=torch.long)
        self.criteria = list(stopping_criteria or [])
        if stop_strings:
            from transformers import StopStringCriteria

            strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
            self.criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=strings))

    def ended(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """[B, K] -> [B, K] bool: whether an end-of-sequence id is at or before each draft."""
        return torch.isin(draft_ids, self.eos.to(draft_ids.device)).cumsum(dim=1) > 0

    def worth_verifying(self, draft_ids: torch.Tensor, offered: torch.Tensor) -> torch.Tensor:
        """offered [B] cut after each row's first end-of-sequence draft: a draft after it could
        never be kept (accepted, the end stops the row; rejected, so is every later draft)."""
        if draft_ids.shape[1] == 0:
            return offered
        ended = self.ended(draft_ids)
        after = torch.cat([ended.new_zeros(ended.shape[0], 1), ended[:, :-1]], dim=1)  # an end before draft j
        return torch.minimum(offered, (~after).sum(dim=1).to(offered.dtype))

    def cut(self, tokens: torch.Tensor, committed: torch.Tensor, block: torch.Tensor, counts: torch.Tensor,
            prompt_lengths: torch.Tensor, scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decide how much of each row's new block to keep.

        tokens [B, L] holds row b's committed tokens in ``[:committed[b]]``; block [B, n] the new
        tokens, ``counts[b]`` valid in row b; prompt_lengths [B]; scores [B, n, vocab] the
        target's logits for each new token. Returns (keep [B], finished [B] bool).
        """
        batch, width = block.shape
        cols = torch.arange(width, device=block.device)[None, :]  # [1, n]
        in_block = cols < counts[:, None]  # [B, n]
        generated = (committed - prompt_lengths)[:, None] + cols + 1  # new tokens so far, counting this one
        stop = torch.isin(block, self.eos.to(block.device)) | (generated >= self.max_new_tokens)
        stop &= in_block
        # first stopping position per row, or width if none
        first = torch.where(stop.any(1), stop.float().argmax(1), torch.full_like(counts, width))
        if self.criteria:
            first = first.clone()
            for b in range(batch):
                for j in range(min(int(first[b]) + 1, int(counts[b]))):
                    row = torch.cat([tokens[b: b + 1, : int(committed[b])], block[b: b + 1, : j + 1]], dim=1)
                    row_scores = scores[b: b + 1, j] if scores is not None else None
                    # a list, not a generator: every criterion sees every token, as in generate()
                    if any([bool(c(row, row_scores).any()) for c in self.criteria]):
                        first[b] = j
                        break
        finished = first < counts
        keep = torch.where(finished, first + 1, counts)
        return keep, finished


class StreamFeed:
    """Pushes committed tokens to a ``transformers`` streamer (``put``/``end``), prompt first."""

    def __init__(self, streamer: Any):
        self.streamer = streamer

    def prompt(self, prompt_ids: torch.Tensor) -> None:
        if self.streamer is not None:
            self.streamer.put(prompt_ids.cpu())

    def tokens(self, ids: torch.Tensor) -> None:
        if self.streamer is not None and ids.numel():
            self.streamer.put(ids.cpu())

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()
