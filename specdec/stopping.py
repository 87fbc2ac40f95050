"""Stopping and streaming, checked token by token inside every committed block.

A verification commits up to K+1 tokens at once. Plain generation would have checked its
stopping rules after each of them, so we do too: :meth:`Stopper.cut` returns, per row, the
position of its first stop in the new block, so the output ends exactly where ``target.generate``
would have ended. Everything here follows ``generate()``'s own rules (``GenerationMixin._sample``):

* **What a criterion sees.** ``generate()`` calls its ``StoppingCriteriaList`` once per step on the
  whole batch: ``input_ids [B, P + t]`` (the prompt as given, left padding included, then every
  row's t new tokens, a finished row's padding included) and its ``scores``: the tuple of the t
  processed ``[B, V]`` scores so far when the call returns them (``return_dict_in_generate`` and
  ``output_scores``), else None. Rows of a speculative batch are at different lengths, so the
  criteria are called once per new-token count t that some row reaches in a block, on that
  batch: row r is exact for every row that has reached t (the rows checked, the rows ahead of
  them, the finished ones); a row behind holds the pad id past its own tokens. The contract is
  the one ``generate()``'s loop implies and :mod:`specdec.processors` states for processors:
  row r of a criterion's answer depends on row r of its inputs. A criterion's answer is combined
  as ``generate()`` combines it (``is_done | answer``, then ``unfinished & ~is_done``), so what
  ``generate()`` takes (a tensor of bools or ints, a Python bool) works alike.
* **Which rows are padded.** ``generate()`` pads a finished row (its later tokens become the pad
  id) only when one of its criteria has an ``eos_token_id`` (``EosTokenCriteria``, there whenever
  the call has EOS ids). Without one, a row that a criterion or a stop string stopped goes on
  generating until every row has stopped, and every row then holds the same number of new
  tokens: that of the row that stopped last. :meth:`Stopper.settle` applies this to the shared
  decision of a step (every rank runs it on the same numbers): it records each row's first stop,
  says how many tokens each row commits (a stopped row keeps going, without padding) and which
  rows leave the batch; :meth:`Stopper.length` is the number of new tokens ``generate()`` returns.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .host import host_ints, host_long


class Stopper:
    """A call's stopping rules: EOS ids, the new-token budget, stop strings, the user's criteria.

    ``pads_finished`` overrides ``generate()``'s rule for whether finished rows are padded (one of
    the criteria has an ``eos_token_id``; an EOS id is such a criterion): a caller whose config
    holds an empty EOS list, which ``generate()`` still makes an ``EosTokenCriteria`` of, says so.
    A run calls :meth:`begin` before its first step."""

    def __init__(self, *, max_new_tokens: int, eos_token_ids: Sequence[int], stop_strings=None,
                 tokenizer=None, stopping_criteria=None, pads_finished: bool | None = None):
        self.max_new_tokens = max_new_tokens
        self.eos_ids = frozenset(int(e) for e in eos_token_ids)
        self.eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        self.criteria = list(stopping_criteria or [])
        if stop_strings:
            from transformers import StopStringCriteria

            strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
            self.criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=strings))
        if pads_finished is None:  # generate(): has_eos_stopping_criteria
            pads_finished = bool(self.eos.numel()) or any(hasattr(c, "eos_token_id") for c in self.criteria)
        self.pads_finished = bool(pads_finished)
        self.prompt_ids: torch.Tensor | None = None

    def begin(self, prompt_ids: torch.Tensor, pad: int, outputs: list, keep_scores: bool) -> None:
        """A call's batch as ``generate()`` holds it: ``prompt_ids [B0, P]`` as given; ``outputs``
        the run's list of each row's new tokens once it left the batch (None before); with
        ``keep_scores`` (``return_dict_in_generate`` and ``output_scores``) the criteria get the
        processed scores of every step, as in ``generate()``, else None."""
        batch, device = prompt_ids.shape[0], prompt_ids.device
        self.prompt_ids, self.pad, self.outputs = prompt_ids, int(pad), outputs
        self.eos = self.eos.to(device)
        self.rows = torch.arange(batch, device=device)  # [B] each batch row's row of the prompt as given
        self.stops = torch.full((batch,), -1, dtype=torch.long, device=device)  # [B0] new tokens at each row's stop
        self._length: int | None = None  # :meth:`length`, set once the last row stops
        self.history: list[torch.Tensor] | None = [] if keep_scores and self.criteria else None  # [B0, V] a step

    def ended(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """[B, K] -> [B, K] bool: whether an end-of-sequence id is at or before each draft."""
        return torch.isin(draft_ids, self.eos).cumsum(dim=1) > 0

    def worth_verifying(self, draft_ids: torch.Tensor, offered: torch.Tensor) -> torch.Tensor:
        """offered [B] cut after each row's first end-of-sequence draft: a draft after it could
        never be kept (accepted, the end stops the row; rejected, so is every later draft)."""
        if draft_ids.shape[1] == 0 or not self.eos_ids:
            return offered
        # host values (the proposal's check has read the drafts): each row's count, cut after its first end
        return host_long([next((i + 1 for i, token in enumerate(row[:n]) if token in self.eos_ids), n)
                          for row, n in zip(host_ints(draft_ids), host_ints(offered))], offered.device)

    def quiet(self, generated: list[int], block: list[list[int]]) -> bool:
        """Whether no row can stop within its ``block`` row (host values, n tokens each) after its
        ``generated`` new tokens: no criterion to ask, no end-of-sequence id anywhere in the block,
        and every row more than n tokens short of :meth:`end`. Then :meth:`cut` and :meth:`settle`
        would keep every row's whole block and retire none, so a step need not run them."""
        if self.criteria or not generated:
            return False
        if self.eos_ids and any(not self.eos_ids.isdisjoint(row) for row in block):
            return False
        return max(generated) + len(block[0]) < self.end()

    def cut(self, tokens: torch.Tensor, committed: torch.Tensor, block: torch.Tensor, counts: torch.Tensor,
            prompt_lengths: torch.Tensor, scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each row's new block stops.

        tokens [B, L] holds row b's committed tokens in ``[:committed[b]]``; block [B, n] the new
        tokens, ``counts[b]`` valid in row b; prompt_lengths [B]; scores [B, n, V] the processed
        scores ``generate()`` would have chosen each new token from. Returns (keep [B]: the tokens up
        to and including the row's first stop, all ``counts[b]`` without one; stopped [B] bool).
        A row that stopped in an earlier block (and goes on, unpadded) is not checked again.
        """
        # first [B]: the block's first position that stops its row (the budget's last token, or an
        # EOS); one at or past counts[b] (a rejected draft's) stops nothing
        first = (self.max_new_tokens - 1 - (committed - prompt_lengths)).clamp_min(0)  # [B] the budget's
        if self.eos.numel():
            cols = torch.arange(block.shape[1], device=block.device)[None, :]  # [1, n]
            first = torch.minimum(first, torch.where(torch.isin(block, self.eos), cols, block.shape[1]).amin(1))
        if self.criteria:
            first = self._criteria(tokens, committed, block, counts, prompt_lengths, first, scores)
        stopped = first < counts
        return torch.minimum(first + 1, counts), stopped

    def _criteria(self, tokens, committed, block, counts, prompt_lengths, first, scores) -> torch.Tensor:
        """first [B] (each row's first EOS or budget stop, at or past n where none) -> with the criteria's
        stops: each new-token count t a row reaches up to its first stop (that token included:
        ``generate()`` calls every criterion at every step) is shown to the criteria once, for
        all the rows that reach it."""
        batch, width = block.shape
        rows = self.rows
        cols = torch.arange(width, device=block.device)[None, :]
        generated = committed - prompt_lengths
        steps = generated[:, None] + cols + 1  # [B, n] new tokens at each position, counting it
        check = (cols <= first[:, None]) & (cols < counts[:, None]) & (self.stops[rows] < 0)[:, None]
        if not bool(check.any()):
            return first
        ids = self._new_tokens(tokens, committed, block, counts, prompt_lengths)  # [B0, G]
        history = self._scores(scores, generated, counts)
        first, found = first.clone(), torch.zeros(batch, dtype=torch.bool, device=block.device)
        for t in sorted(set(steps[check].tolist())):
            b, j = (check & (steps == t) & ~found[:, None]).nonzero(as_tuple=True)  # at most one position a row
            if not b.numel():
                continue
            batch_ids = torch.cat([self.prompt_ids, ids[:, :t]], dim=1)  # [B0, P + t]
            done = self._ask(batch_ids, tuple(history[:t]) if history is not None else None)  # [B0]
            hit = done[rows[b]]
            first[b[hit]], found[b[hit]] = j[hit], True
        if history is not None and self.pads_finished:  # a padded row's steps after its stop: zeros (outputs.py)
            for b in (first < counts).nonzero().flatten().tolist():
                for step in range(int(generated[b] + first[b]) + 1, int(generated[b] + counts[b])):
                    history[step][rows[b]] = 0
        return first

    def _ask(self, input_ids: torch.Tensor, scores) -> torch.Tensor:
        """Every criterion on ``input_ids [B0, P + t]`` -> [B0] bool: the rows ``generate()`` would
        mark finished (its own arithmetic, so a Python bool or an int tensor works as there)."""
        batch = input_ids.shape[0]
        is_done = torch.full((batch,), False, dtype=torch.bool, device=input_ids.device)
        for criterion in self.criteria:  # every criterion, as in generate(): one may count or record
            is_done = is_done | criterion(input_ids, scores)
        unfinished = torch.ones(batch, dtype=torch.long, device=input_ids.device) & ~is_done
        if unfinished.shape != (batch,):
            raise ValueError(f"the stopping criteria returned shape {tuple(is_done.shape)} for input_ids of shape "
                             f"{tuple(input_ids.shape)}; generate() takes a bool or one value per row ([{batch}])")
        return unfinished == 0

    def _new_tokens(self, tokens, committed, block, counts, prompt_lengths) -> torch.Tensor:
        """[B0, G] every row's new tokens as ``generate()`` holds them: the batch rows' committed
        tokens then their block, a finished row's output then padding; the pad id past what a row has."""
        device = block.device
        generated = committed - prompt_lengths  # [B]
        known = generated + counts  # [B]
        done = [o for o in self.outputs if o is not None]
        longest = max([int(known.max())] + [o.numel() for o in done])
        out = torch.full((self.prompt_ids.shape[0], longest), self.pad, dtype=tokens.dtype, device=device)
        cols = torch.arange(longest, device=device)[None, :]  # [1, G]
        mine = tokens.gather(1, (prompt_lengths[:, None] + cols).clamp(max=tokens.shape[1] - 1))  # [B, G]
        new = block.to(tokens.dtype).gather(1, (cols - generated[:, None]).clamp(0, block.shape[1] - 1))
        pad = torch.full_like(mine, self.pad)
        out[self.rows] = torch.where(cols < generated[:, None], mine, torch.where(cols < known[:, None], new, pad))
        for row, o in enumerate(self.outputs):
            if o is not None:
                out[row, : o.numel()] = o.to(device)
        return out

    def _scores(self, scores: torch.Tensor | None, generated: torch.Tensor, counts: torch.Tensor):
        """The scores ``generate()`` passes its criteria: every step's processed [B0, V] scores (this
        block's written in at its rows' steps), or None when the call does not return them."""
        if self.history is None or scores is None:
            return None
        history, rows = self.history, self.rows.tolist()
        while len(history) < int((generated + counts).max()):
            history.append(scores.new_zeros(self.prompt_ids.shape[0], scores.shape[-1]))
        for b, (g, n) in enumerate(zip(generated.tolist(), counts.tolist())):
            for j in range(n):
                history[g + j][rows[b]] = scores[b, j]
        return history

    def settle(self, generated: torch.Tensor, counts: torch.Tensor, keep: torch.Tensor,
               stopped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's cut (``keep``, ``stopped`` [B]; the same on every rank) -> (commit [B]: the new
        tokens each row commits, retire [B] bool: the rows that leave the batch), ``generated`` [B]
        new tokens before the block, ``counts`` [B] the block's tokens. Records each row's first
        stop. With padding a stopped row keeps its tokens up to the stop and leaves; without, it
        goes on until every row has stopped, and leaves once it holds :meth:`length` tokens (or
        its budget's worth: :meth:`length` is never more)."""
        if bool(stopped.any()):  # most steps stop no row: nothing to record, and no device sync
            rows = self.rows
            first = stopped & (self.stops[rows] < 0)
            self.stops[rows[first]] = (generated + keep)[first]
            if bool((self.stops >= 0).all()):
                self._length = int(self.stops.max())
        if self.pads_finished:
            return keep, stopped
        end = self.end()
        commit = torch.minimum(counts, (end - generated).clamp_min(0))  # past its stop too: generate() pads none
        return commit, generated + commit >= end

    def end(self) -> int:
        """The new tokens no row goes past: :meth:`length` once every row has stopped, else the budget."""
        return self.max_new_tokens if self._length is None else self._length

    def length(self) -> int | None:
        """The new tokens ``generate()`` returns per row (its steps) once every row has stopped, else None."""
        return self._length

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the batch) of the rows still decoding."""
        self.rows = self.rows[rows]


class StreamFeed:
    """Pushes committed tokens to a ``transformers`` streamer (``put``/``end``), prompt first."""

    def __init__(self, streamer: Any):
        self.streamer = streamer

    def prompt(self, prompt_ids: torch.Tensor) -> None:
        if self.streamer is not None:
            self.streamer.put(prompt_ids.cpu())

    def tokens(self, block: torch.Tensor, kept: torch.Tensor) -> None:
        """A step's committed tokens, row 0's (a streamer takes one row): ``block[0, :kept[0]]``."""
        if self.streamer is None:
            return
        ids = block[0, : int(kept[0])]
        if ids.numel():
            self.streamer.put(ids.cpu())

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()
