"""The llama.cpp engine as a cache backend of :class:`~specdec.state.ModelState`.

llama.cpp keeps its own keys and values, so the engine takes the backend's place (``specdec.kv``):
``ModelState`` keeps the layout (which slot holds which row's token) and calls ``forward``,
``crop``, ``shift_rows``, ``trim_left`` and ``select_rows``; this backend turns each into llama.cpp
terms. Row b is llama.cpp sequence ``seq[b]``, and a token sits at its own index in the row as its
position, so a shift or a trim of ``ModelState``'s slots moves nothing here (``offsets`` follow
them), and a rollback is ``llama_memory_seq_rm`` from the first dropped position.

A forward feeds every real column (padding columns feed nothing and get zero logits) and asks
logits of the last ``logits_to_keep`` columns only. After the prefill, decodes feed at most
:data:`~.library.QUERY_TILE` tokens each (see there). Each token's logits are the ones a one-token
decode gives it: the library checks that of its build (``library.check_batch_invariant``).
"""

from __future__ import annotations

import torch

from . import library

#: the engine keeps keys and values in F32, as transformers' fp32 forward does
KV_TYPE = "f32"


class LlamaCppKV:
    """Keys and values held by a llama.cpp context (see the module doc)."""

    slots = 0
    cache = None  # no transformers cache: nothing may read or adopt one (checked where a caller would)
    returns_hidden = False  # hidden states of the verifying forward (eagle3, mtp)
    trees = False  # tree layouts (chains only, until trees go through llama.cpp sequences)

    def __init__(self, model, path: str, batch: int, capacity: int, settings, reach: int = 0):
        self.settings = settings
        most = library.bindings().llama_max_parallel_sequences()
        if batch > most:
            raise ValueError(f"engine='llama_cpp' decodes at most {most} rows at once (llama.cpp's sequences); "
                             f"this call has {batch}: split the batch")
        threads = max(torch.get_num_threads(), 1)
        library.check_batch_invariant(path, threads, KV_TYPE)
        loaded, embedded = library.load(path), model.get_input_embeddings().weight.shape[0]
        if loaded.vocab < embedded:
            raise ValueError(f"{path} has {loaded.vocab} tokens, {type(model).__name__} embeds {embedded}: "
                             "not a file of this model")
        self.vocab = loaded.vocab
        self.ctx = library.context(path, batch, batch * max(capacity, reach, 1), threads, KV_TYPE)
        self.seq = list(range(batch))  # row -> llama.cpp sequence
        self.offsets = [None] * batch  # row -> slot of its token 0 (None: nothing fed yet)

    def forward(self, model, kwargs: dict, *, first_slot: int, width: int, first: bool, mask,
                needs_mask: bool, direct: bool = False, runner=None, hidden_layers: tuple[int, ...] = ()):
        if runner is not None or hidden_layers:
            raise ValueError("engine='llama_cpp' verifies chains and returns logits only (no token trees, no "
                             "hidden states)")
        ids, positions = kwargs["input_ids"], kwargs["position_ids"]
        rows, fed = ids.shape
        positions = positions.expand(rows, -1) if positions.shape[0] != rows else positions
        real = (mask(first_slot + width)[:, first_slot:first_slot + fed].bool() if needs_mask
                else torch.ones(rows, fed, dtype=torch.bool))
        keep = min(int(kwargs.get("logits_to_keep") or width), width)
        first_kept = width - keep
        tokens, at, seqs, wanted, where = [], [], [], [], []
        id_rows, pos_rows, real_rows = ids.tolist(), positions.tolist(), real.tolist()
        for b in range(rows):
            for j in range(width):
                if not real_rows[b][j]:
                    continue
                if self.offsets[b] is None:
                    self.offsets[b] = first_slot + j - pos_rows[b][j]
                tokens.append(id_rows[b][j])
                at.append(pos_rows[b][j])
                seqs.append(self.seq[b])
                wanted.append(j >= first_kept)
                if j >= first_kept:
                    where.append((b, j - first_kept))
        split = None if first else library.QUERY_TILE
        logits = self.ctx.decode(tokens, at, seqs, wanted, split=split)
        if len(where) == rows * keep:  # every kept column real: the logits are already in (row, column) order
            return logits.view(rows, keep, self.vocab)
        out = torch.zeros(rows, keep, self.vocab)
        if where:
            index = torch.tensor(where)
            out[index[:, 0], index[:, 1]] = logits
        return out

    def padded_width(self, width: int, first: bool) -> int:
        return width

    def crop(self, old_slots: int, new_slots: int) -> None:
        """Every row keeps its slots before ``new_slots``."""
        for b, offset in enumerate(self.offsets):
            if offset is not None:
                self.ctx.remove(self.seq[b], new_slots - offset)

    def shift_rows(self, shifts: torch.Tensor) -> None:
        for b, n in enumerate(shifts.tolist()):
            if self.offsets[b] is not None:
                self.offsets[b] += int(n)

    def trim_left(self, count: int, cached_slots: int) -> None:
        self.offsets = [None if o is None else o - count for o in self.offsets]

    def select_rows(self, rows: torch.Tensor, cached_slots: int) -> None:
        kept = rows.tolist()
        for b in set(range(len(self.seq))) - set(kept):
            self.ctx.remove(self.seq[b], 0)
        self.seq = [self.seq[b] for b in kept]
        self.offsets = [self.offsets[b] for b in kept]

    def gather_slots(self, first: int, sources: torch.Tensor) -> None:
        raise ValueError("engine='llama_cpp' verifies chains, not token trees")

    def load(self, cache, slots: int) -> None:
        raise ValueError("engine='llama_cpp' cannot continue from a transformers cache (a prefix from prefill())")

    def adopt(self, cache, slots: int, dtype: torch.dtype, start: int = 0, rows: torch.Tensor | None = None) -> None:
        raise ValueError("engine='llama_cpp' keeps its own keys and values; a copy cannot mirror them")

    def release(self) -> None:
        if self.ctx is not None:
            library.give_back(self.ctx)
            self.ctx = None
