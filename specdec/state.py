"""ModelState: one model's view of the batch, its cache, and what its next forward must feed.

Layout. Each row's tokens are stored from column 0 of ``tokens [B, capacity]`` (``lengths[b]``
valid). In the cache, row b's token i sits at slot ``offsets[b] + i``; slots below ``offsets[b]``
are padding (masked out). The cache holds ``cached_slots`` slots for every row.

Invariant between forwards: every row's cached tokens are contiguous and end exactly at
``cached_slots``. A row's tokens past that point are *pending* and are fed by the next forward,
before whatever is new. Rows therefore never hold holes or stale slots, which keeps
sliding-window layers exact: a window of W slots is W real tokens for every row.

After a forward (or a commit) rows may end at different slots. ``_realign`` restores the
invariant: if the ends are within ``REFEED_LIMIT`` of each other the cache is cropped to the
shortest and the others re-feed their few extra tokens next time; otherwise rows that lag are
shifted right inside the cache (their left padding grows), so re-feeding stays bounded.
Common left padding is trimmed, so memory is bounded by the longest row plus one block.

First iteration is explicit: ``is_first_iteration`` is True until the first forward, the only
one that receives ``prefill_inputs`` (pixel values and the like; over the prompt alone where a
media placeholder id follows it). It is not "cache is empty": ``continue_from(prefix)`` starts
from a cache that already holds a prefix.

The cache itself lives in a backend (``specdec.kv``): a ``DynamicCache`` of full-length layers,
or a ``StaticCache`` written in place, optionally with compiled forwards. ``specdec.feed`` builds
each forward's inputs and picks the logits each row reads.

Position ids come from ``positions``, a pure function of (row, token index) chosen per model by
``specdec.multimodal`` (3-D mRoPE positions for Qwen2-VL and kin), so re-feeding or shifting rows
never changes a token's position. A model with learned absolute positions (``position_limit``:
GPT-2, OPT) takes no prompt row longer than its table and feeds no token past it (an assistant's,
``strict_positions=False``, feeds them at the table's last position: drafts only).
"""

from __future__ import annotations

from typing import Any

import torch

from .cache_settings import cache_problem
from .feed import chunk, columns_from, tree_inputs
from .host import host_ints, host_long, hosted
from .kv import CacheSettings, make_kv
from .modelinfo import cache_argument, vocab_size
from .multimodal import PrefillInputs, TokenPositions
from .validation import check_prompt_positions, position_limit

__all__ = ["ModelState", "cache_problem"]


class ModelState:
    #: rows whose cached ends differ by at most this many slots re-feed instead of shifting (the
    #: default of ``refeed_limit``; a state that makes every row's next forward wider by re-feeding,
    #: as the target's does, sets it lower: docs/performance.md, "Batches")
    REFEED_LIMIT = 16
    #: token columns (and static cache slots) allocated beyond the prompt at first; both grow as they fill
    HEADROOM = 64

    @classmethod
    def margin(cls) -> int:
        """Static cache slots a call takes beyond its prompt and new tokens (a block and the re-feeds)."""
        return 2 * cls.REFEED_LIMIT + 1

    def __init__(self, model, tokens: torch.Tensor, lengths: torch.Tensor, capacity: int | None = None, *,
                 pad_token_id: int = 0, prefill_inputs: dict[str, Any] | PrefillInputs | None = None,
                 positions=None, kv: CacheSettings | None = None, max_new_tokens: int | None = None,
                 strict_positions: bool = True):
        batch = tokens.shape[0]
        self.model = model
        self.device = tokens.device
        self.position_limit, self.strict_positions = position_limit(model), strict_positions  # see the module doc
        if strict_positions:
            check_prompt_positions(model, lengths)
        capacity = tokens.shape[1] + self.HEADROOM if capacity is None else max(capacity, tokens.shape[1])
        first, reach = self.cache_slots(tokens.shape[1], max_new_tokens)
        self.kv = make_kv(model, batch, first, kv, reach=reach)
        table = getattr(model.get_input_embeddings(), "weight", None)  # None: a pipeline stage without it
        self.vocab_limit = int(table.shape[0]) if table is not None else vocab_size(model)
        self.pad_token_id = pad_token_id if 0 <= pad_token_id < self.vocab_limit else 0  # fills unattended slots
        self.tokens = torch.full((batch, capacity), self.pad_token_id, dtype=torch.long, device=self.device)
        self.tokens[:, : tokens.shape[1]] = tokens
        self.lengths = lengths.clone().long()  # [B]
        self.prompt_lengths = self.lengths.clone()  # [B] what the prefill-only inputs describe
        # left-pad so that every prompt ends at the same slot: the first forward needs no shift
        self.offsets = (self.lengths.max() - self.lengths).long()  # [B]
        self.cached_slots = 0
        self.is_first_iteration = True
        self.prefill_inputs = (prefill_inputs if isinstance(prefill_inputs, PrefillInputs)
                               else PrefillInputs(dict(prefill_inputs or {})))
        self.positions = positions if positions is not None else TokenPositions()
        self._cache_kwarg = cache_argument(model)
        self._mirrored: tuple[torch.Tensor, int] | None = None  # see mirror()
        self._lists: list[list[int]] | None = None  # see token_lists()
        self.refeed_limit = self.REFEED_LIMIT  # ends at most this far apart re-feed; farther ones shift
        #: ``output_hidden_states`` indices every forward keeps (set by the run for a generator reading them)
        self.hidden_layers: tuple[int, ...] = ()
        #: after such a forward: ({layer: [B, F, H]} of its fed columns, [B] the token index of column 0)
        self.hidden: tuple[dict[int, torch.Tensor], torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def offsets(self) -> torch.Tensor:
        """[B] the slot of each row's first token (its left padding in the cache)."""
        return self._offsets

    @offsets.setter
    def offsets(self, value: torch.Tensor) -> None:
        self._offsets, self._padded = value, None

    @property
    def padded(self) -> bool:
        """Whether some row starts after slot 0 (read once per change of :attr:`offsets`)."""
        self._padded = any(host_ints(self._offsets)) if self._padded is None else self._padded
        return self._padded

    def cache_slots(self, width: int, max_new_tokens: int | None) -> tuple[int, int]:
        """(slots a static cache starts with, slots the call can reach) for a prompt ``width`` wide: the prompt,
        the new tokens the call and positions allow, a block, the re-feed margin; ``HEADROOM`` new at first."""
        new = max_new_tokens or self.HEADROOM
        if self.position_limit is not None:
            new = min(new, self.position_limit + 1)
        reach = width + new + self.margin()
        return min(reach, width + self.HEADROOM + self.margin()), reach

    def grow(self, needed: int) -> None:
        """Make room for ``needed`` tokens per row; capacity at least doubles (amortised O(1) per token)."""
        capacity = self.tokens.shape[1]
        if needed > capacity:
            extra = self.tokens.new_full((self.batch_size, max(needed, 2 * capacity) - capacity), self.pad_token_id)
            self.tokens = torch.cat([self.tokens, extra], dim=1)

    def pending_width(self) -> int:
        """Columns the next forward feeds before any new token (pending tokens of the widest row)."""
        return max(self.ends(), default=0) - self.cached_slots

    def ends(self) -> list[int]:
        """Each row's slot after its last token (from the host values of its offsets and lengths)."""
        return [o + n for o, n in zip(host_ints(self.offsets), host_ints(self.lengths))]

    def token_lists(self) -> list[list[int]]:
        """Each row's tokens ``tokens[b, :lengths[b]]`` as host lists (read only): extended by each
        commit from its block's host values, read from the device again only after other edits."""
        lengths = host_ints(self.lengths)
        if self._lists is None or any(len(row) != n for row, n in zip(self._lists, lengths)):
            rows = self.tokens[:, : max(lengths, default=0)].tolist()
            self._lists = [row[:n] for row, n in zip(rows, lengths)]
        return self._lists

    # -- sequence edits -----------------------------------------------------------------------
    def append(self, ids: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Append ``ids [B, E]`` (the first ``counts[b]`` of each row) to the row sequences (columns
        past a row's count are written too: what a row holds past its length is never read)."""
        extra = ids.shape[1]
        if extra == 0:
            return
        lengths = host_ints(self.lengths)
        longest = max(lengths)
        self.grow(longest + extra + 1)  # and one more: a commit's token after them
        if self.batch_size == 1:  # its one row ends at the longest
            self.tokens[:, longest: longest + extra] = ids
        else:
            cols = self.lengths[:, None] + torch.arange(extra, device=self.device)[None, :]  # [B, E], within capacity
            self.tokens.scatter_(1, cols, ids.to(device=self.device, dtype=self.tokens.dtype))
        added = [extra] * len(lengths) if counts is None else host_ints(counts)
        self.lengths = hosted(self.lengths + (extra if counts is None else counts),
                              [n + a for n, a in zip(lengths, added)])

    def commit(self, start: torch.Tensor, block: torch.Tensor, keep: torch.Tensor, cached: torch.Tensor,
               placed: torch.Tensor | None = None) -> None:
        """Commit one verified block in one operation.

        Row b becomes its first ``start[b]`` tokens followed by ``block[b, :keep[b]]`` (``block
        [B, n]``: accepted drafts, then the target's token). ``cached [B]`` is how many tokens of
        each row the last forward left valid in the cache (the committed tokens plus the accepted
        drafts): the slots past it held rejected drafts. One realign, whatever was rejected.
        ``placed [B]``: where row b already holds ``block[b, :placed[b]]`` after ``start[b]`` (a
        chain's accepted drafts, appended for the forward with room for one more column), so only
        the token after them is written.
        """
        lists, self._lists = self._lists, None
        if placed is None:
            self.lengths = start  # replaced, never written in place
            self.append(block, keep)
        else:  # within what the forward's append made room for
            self.tokens.scatter_(1, (start + placed)[:, None], block.gather(1, placed[:, None]).to(self.tokens.dtype))
            self.lengths = hosted(start + keep, [s + k for s, k in zip(host_ints(start), host_ints(keep))])
        if lists is not None:  # each row's list: its first start[b] tokens, then block[b, :keep[b]]
            for row, s, k, new in zip(lists, host_ints(start), host_ints(keep), host_ints(block)):
                row[s:] = new[:k]
            self._lists = lists
        # each row's valid end: what it holds in the cache, within what the forward left valid and its length
        self._realign([o + min(self.cached_slots - o, c, n) for o, c, n in
                       zip(host_ints(self.offsets), host_ints(cached), host_ints(self.lengths))])

    def truncate(self, lengths: torch.Tensor) -> None:
        """Cut every row to at most ``lengths [B]`` tokens and drop what the cache held beyond."""
        self.lengths = hosted(torch.minimum(self.lengths, lengths),
                              [min(a, b) for a, b in zip(host_ints(self.lengths), host_ints(lengths))])
        for row, n in zip(self._lists or (), host_ints(self.lengths)):
            del row[n:]
        self._realign([o + min(self.cached_slots - o, n) for o, n in zip(host_ints(self.offsets), host_ints(self.lengths))])

    def held(self, since: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """[B]: how many leading tokens of ``block [B, n]`` row b holds right after its first
        ``since[b]`` (within its length), on the device: :meth:`sync`'s ``held``, read with a verdict."""
        width = min(block.shape[1], max([0, *(n - s for n, s in zip(host_ints(self.lengths), host_ints(since)))]))
        cols = since.to(self.device)[:, None] + torch.arange(width, device=self.device)[None, :]  # [B, W]
        same = self.tokens.gather(1, cols.clamp(max=self.tokens.shape[1] - 1)) == block[:, :width].to(self.device)
        return (same & (cols < self.lengths[:, None])).long().cumprod(dim=1).sum(dim=1)

    def sync(self, tokens: torch.Tensor, lengths: torch.Tensor, since: torch.Tensor, held: list[int] | None = None) -> None:
        """Make the rows equal ``tokens[:, :lengths]``, given they already agree before ``since``.

        Keeps the longest common prefix cached: a draft that proposed d1..dK and saw d1..da
        accepted keeps those in its cache and is never fed them again. ``held``: :meth:`held`'s
        values for what ``tokens`` holds after ``since`` (else compared here, one read).
        """
        if held is None:
            width = max([0, *(n - s for n, s in zip(host_ints(lengths), host_ints(since)))])
            cols = since.to(tokens.device)[:, None] + torch.arange(width, device=tokens.device)[None, :]
            held = host_ints(self.held(since, tokens.gather(1, cols.clamp(max=tokens.shape[1] - 1))))
        # the last token stays uncached: the next forward must produce the logits that follow it
        self.truncate(host_long([min(s + h, n - 1) for s, h, n in zip(host_ints(since), held, host_ints(lengths))],
                                self.device))
        self.grow(tokens.shape[1])
        self._lists = None
        first = min(host_ints(since))  # rows already agree before `since`: copy only what may differ
        self.tokens[:, first: tokens.shape[1]] = tokens[:, first:]
        self.lengths = lengths  # never written in place

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the batch), e.g. once others have finished."""
        if self.is_first_iteration and self.prefill_inputs:  # a late assistant's media do not split by row
            self._prefill_prompt()
        self.kv.select_rows(rows, self.cached_slots)
        kept = host_ints(rows)
        lengths, offsets = host_ints(self.lengths), host_ints(self.offsets)
        self.tokens = self.tokens[rows]
        self.lengths = hosted(self.lengths[rows], [lengths[r] for r in kept])
        self.prompt_lengths = self.prompt_lengths[rows]
        self.offsets = hosted(self.offsets[rows], [offsets[r] for r in kept])
        self._lists = None if self._lists is None else [self._lists[r] for r in kept]
        if self._mirrored is not None:  # the rows kept hold what they held at the last mirror
            self._mirrored = (self._mirrored[0][rows], self._mirrored[1])
        self.positions = self.positions.select_rows(rows)
        self._trim_left()

    def continue_from(self, prefix, owned: bool = False) -> None:
        """Start from ``prefix`` (a :class:`~specdec.multimodal.Prefix`): its cache (copied, unless ``owned``: made for
        this state alone), layout and positions; the rows extend its rows, the tokens past it pending."""
        self.kv.load(prefix.cache, int(prefix.cached_slots), owned)
        self.offsets = prefix.offsets.clone().to(self.device)
        self.cached_slots = int(prefix.cached_slots)
        self.positions = prefix.positions.continued()  # more of a prompt follows the prefix
        self.prefill_inputs = PrefillInputs()

    def mirror(self, other: "ModelState") -> None:
        """Become ``other``: its tokens, layout and cached keys and values, instead of feeding them.

        For a model that can read ``other``'s keys and values (the same cache layout and tokens: a
        copy of the target at lower precision). Only the slots ``other`` may have written since the
        last mirror are copied (from the cache length it had then), and the whole of each row that
        either state moved since (a shift); everything where every row moved (a trim) or there was
        no earlier mirror. Replaces the prefill on a first iteration, which must have no
        prefill-only inputs."""
        if self.is_first_iteration and self.prefill_inputs:
            raise RuntimeError("mirror() replaces a text-only prefill; this state takes prefill inputs")
        last = self._mirrored  # (offsets, cached slots) of `other` at the last mirror
        dtype = self.model.get_input_embeddings().weight.dtype  # what this model's keys and values are kept in
        start, rows = 0, None
        if last is not None and last[0].shape == other.offsets.shape == self.offsets.shape:
            moved = [b for b, (o, s, m) in enumerate(zip(*(host_ints(t) for t in (other.offsets, self.offsets, last[0]))))
                     if o != m or s != m]
            if len(moved) < self.batch_size:
                start = min(last[1], other.cached_slots)
                rows = host_long(moved, self.device) if moved else None
        self.kv.adopt(other.kv.cache, other.cached_slots, dtype, start=start, rows=rows)
        self.tokens, self.lengths = other.tokens.clone(), other.lengths  # lengths and offsets: never written in place
        self._lists = None
        self.offsets, self.cached_slots = other.offsets, other.cached_slots
        self.is_first_iteration = False
        self._mirrored = (self.offsets, self.cached_slots)

    def admissible_drafts(self, draft_ids: torch.Tensor, offered: torch.Tensor) -> torch.Tensor:
        """How many of ``draft_ids [B, K]`` (``offered [B]``) the next forward may take: a first
        forward that carries image features takes no draft equal to an image placeholder id."""
        return self.prefill_inputs.admissible(draft_ids, offered) if self.is_first_iteration else offered

    # -- forward ------------------------------------------------------------------------------
    def forward(self, start: torch.Tensor) -> torch.Tensor:
        """Feed every pending token; return logits for row positions ``start[b] ..`` lengths-1.

        Returns ``[B, M, vocab]`` with M = max(lengths - start), left-aligned: ``out[b, j]`` is the
        distribution after row b's token ``start[b] + j`` (entries past a row's end are filler).
        Each ``start[b]`` must be a token that is not yet cached (pending).
        """
        return self._forward(start)

    def forward_tree(self, start: torch.Tensor, tree: tuple) -> torch.Tensor:
        """:meth:`forward` where the tokens after each row's ``start[b]`` are a token tree's nodes:
        ``tree = (parents [B, K], nodes [B], engine)`` (``Proposal.parents``), fed in one forward
        through ``engine`` (specdec.engines) with the tree layout, each at its root's position plus
        its depth; ``out[b, 1 + i]`` is the distribution after node i's own chain. The cache holds
        every node afterwards (``specdec.accepted.keep_path`` keeps the accepted ones)."""
        return self._forward(start, tree)

    def _forward(self, start: torch.Tensor, tree: tuple | None = None) -> torch.Tensor:
        if self.is_first_iteration and self.prefill_inputs.placed(self.tokens, self.prompt_lengths, self.lengths):
            self._prefill_prompt()
        first_slot = self.cached_slots
        ends = self.ends()  # each row's slot after its last token
        width, first = max(ends) - first_slot, self.is_first_iteration
        starts = host_ints(start)
        # each row's chunk column of the first logits it needs
        needed = [o + s - first_slot for o, s in zip(host_ints(self.offsets), starts)]
        lowest = min(needed)
        if lowest < 0:
            raise RuntimeError("ModelState.forward asked for logits of a token that is already cached")
        layout = runner = None
        if tree is not None:
            layout, runner, width = tree_inputs(self, tree, host_long([n + 1 for n in needed], self.device), width)
        # a causal forward keeps the hidden states through the backend's forward (a tree's runner keeps them itself)
        hidden_layers = self.hidden_layers if runner is None else ()
        index, real, ids, positions = chunk(self, first_slot, width, layout)
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "position_ids": positions,
            self._cache_kwarg: self.kv.cache,
            "use_cache": True,
            "logits_to_keep": width - lowest,
        }
        if first:  # a first forward starts at slot 0 unless it continues a prefix
            kwargs.update(self.prefill_inputs.for_chunk(index[:, :width], real[:, :width]))
        # one row with no left padding holds a token in every slot up to its end: no mask to build
        needs_mask = self.batch_size > 1 or runner is not None or self.padded
        logits = self.kv.forward(self.model, kwargs, first_slot=first_slot, width=width, first=first,
                                 mask=self._slot_mask, needs_mask=needs_mask, runner=runner,
                                 hidden_layers=hidden_layers)
        if hidden_layers:
            logits, self._fed_hidden = logits  # {layer: [B, F, H]} of the fed columns
        self.is_first_iteration = False
        self.prefill_inputs = PrefillInputs()
        self.cached_slots = first_slot + width
        if self.hidden_layers:
            self.hidden = (self._fed_hidden, index[:, 0].clone())
        self._realign(ends)
        return self._from_needed(logits, width, needed, starts)

    def _prefill_prompt(self) -> None:
        """The prompt alone, with the media (a late assistant's: see select_rows and _forward's first line)."""
        lengths, self.lengths, self._lists = self.lengths, self.prompt_lengths, None
        self._forward(self.prompt_lengths - 1)
        self.lengths, self._lists = lengths, None

    def _slot_mask(self, slots: int) -> torch.Tensor:
        """[B, slots] a forward's attention mask: each row's own tokens, nothing stale."""
        at = torch.arange(slots, device=self.device)[None, :]
        inside = at < (self.offsets + self.lengths)[:, None]
        return (inside & (at >= self.offsets[:, None]) if self.padded else inside).long()

    def _from_needed(self, logits: torch.Tensor, width: int, needed: list[int], starts: list[int]) -> torch.Tensor:
        """A forward's ``logits [B, keep, V]`` (the last ``keep`` of the ``width`` columns it fed; all
        of them if the model ignores ``logits_to_keep``) -> each row's from its chunk column
        ``needed[b]`` on (the token ``starts[b]``), left-aligned."""
        shift = width - logits.shape[1]  # fed columns before the first kept one
        lowest = min(needed)
        if lowest == max(needed):  # every row's first logits at one column: width - lowest columns from there
            return columns_from(logits, lowest - shift, width - lowest)
        return columns_from(logits, host_long([n - shift for n in needed], self.device),
                            max(n - s for n, s in zip(host_ints(self.lengths), starts)))

    # -- cache maintenance --------------------------------------------------------------------
    def _realign(self, valid_ends: list[int]) -> None:
        """Restore the invariant given each row's valid slot end ``valid_ends`` (host values)."""
        lo, hi = min(valid_ends), max(valid_ends)
        if hi - lo <= self.refeed_limit:
            target = lo  # rows past `lo` re-feed at most refeed_limit tokens
        else:
            target = hi
            moves = [hi - e for e in valid_ends]
            shifts = host_long(moves, self.device)  # [B] lagging rows move right
            self.kv.shift_rows(shifts)
            self.offsets = hosted(self.offsets + shifts, [o + m for o, m in zip(host_ints(self.offsets), moves)])
        self.kv.crop(self.cached_slots, target)
        self.cached_slots = target
        if target != lo:  # rows moved: padding common to every row may have appeared
            self._trim_left()

    def _trim_left(self) -> None:
        common = min(host_ints(self.offsets)) if self.batch_size and self.padded else 0
        if common > 0 and self.cached_slots >= common:
            self.kv.trim_left(common, self.cached_slots)
            self.offsets = hosted(self.offsets - common, [o - common for o in host_ints(self.offsets)])
            self.cached_slots -= common

    @property
    def compiled(self) -> bool:
        """Whether this state's forwards run compiled (see ``specdec.kv``)."""
        return getattr(self.kv, "compiled", None) is not None

    def warm_up(self) -> None:
        """Compile what a call will run: one forward at each compiled width (after the prefill), each rolled back."""
        if self.is_first_iteration:
            self.forward(start=self.lengths - 1)
        base = self.lengths  # never written in place
        for width in self.kv.settings.widths:
            self.append(self.tokens[:, :width].clone())  # any tokens the rows already hold
            self.forward(start=base)
            self.truncate(base)

    def release(self) -> None:
        """The call is over: hand a static cache back for reuse."""
        self.kv.release()

    @property
    def cache(self):
        return self.kv.cache
