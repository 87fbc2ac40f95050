"""What a :class:`~specdec.state.ModelState`'s next forward feeds, and how a row reads its outputs.

A forward feeds one chunk: the columns from the state's first uncached slot to its longest row's
end, padded to a compiled width where the cache backend compiles (:func:`chunk`). Each column
holds a row's token id (the pad token where the row has none there, or where its id lies past this
model's vocabulary) at that token's position. Under learned absolute positions a row that would
need a further position stops the run with a ValueError where ``generate()`` raises an IndexError
(:func:`check_positions`); padded columns get a position inside the table. A token tree's forward
runs through an engine with the tree layout, each node at its root's position plus its depth
(:func:`tree_inputs`). The logits come back for the last columns; :func:`columns_from` takes each
row's from its first needed one.

The functions take the state itself and read its rows, layout and backend; they are its
forward's parts, kept apart from its bookkeeping.
"""

from __future__ import annotations

import torch

from .engines import Layout


def chunk(state, first_slot: int, width: int, layout: Layout | None = None) -> tuple[torch.Tensor, ...]:
    """The columns the next forward feeds, ``width`` of them padded to a compiled width F ->
    (index [B, F]: each row's token index there, real [B, F] (None after a prefill when every
    column is real), ids [B, F], positions [B, F] or
    [3, B, F] for mRoPE). A tree ``layout`` feeds ``width`` columns exactly (its forward is never
    compiled), each at the position of its column in its own chain (``Layout.chain_columns``)."""
    # a tree's forward, and one that keeps hidden states, is never compiled: nothing to pad to
    unpadded = layout is not None or state.hidden_layers
    fed = width if unpadded else state.kv.padded_width(width, state.is_first_iteration)
    chunk_slots = torch.arange(first_slot, first_slot + fed, device=state.device)[None, :]  # [1, F]
    if state.batch_size == 1 and not state.padded:  # one row from slot 0: its tokens, then a compiled width's padding
        state.grow(first_slot + fed)
        index, ids = chunk_slots, state.tokens[:, first_slot: first_slot + fed]
        if fed == width:  # every column real (only a prefill reads which)
            real = torch.ones_like(index, dtype=torch.bool) if state.is_first_iteration else None
            bad = ids >= state.vocab_limit
        else:
            real = index < first_slot + width
            bad = ~real | (ids >= state.vocab_limit)
    else:
        index = chunk_slots - state.offsets[:, None]  # [B, F] token index at each chunk slot
        real = (index >= 0) & (index < state.lengths[:, None])
        ids = state.tokens.gather(1, index.clamp(0, state.tokens.shape[1] - 1))
        bad = ~real | (ids >= state.vocab_limit)
    # ids a smaller (padded) embedding lacks can only come from the target's tokens: the
    # model sees padding there, which can only change what an assistant proposes
    ids = ids.masked_fill(bad, state.pad_token_id)  # [B, F]
    at = index
    if layout is not None:  # a node at its root's position plus its depth
        columns = torch.arange(fed, device=state.device)[None, :]
        at = index + layout.chain_columns(fed, state.batch_size, state.device) - columns
    if state.position_limit is not None:  # learned positions: refuse a token past them, keep padding inside
        if state.strict_positions:
            check_positions(state)
        at = at.clamp(max=state.position_limit - 1)  # only padded columns move (and an assistant's past the table)
    return index, real, ids, state.positions(at)


def check_positions(state) -> None:
    """Before a forward: no row may feed a token at or past the learned positions. ``generate()``
    fails there with an ``IndexError`` inside the forward; the run stops before it, saying why."""
    longest = int(state.lengths.max())
    if longest > state.position_limit:
        limit = state.position_limit
        raise ValueError(f"{type(state.model).__name__} learned {limit} positions (config.max_position_embeddings"
                         f"={limit}) and a row now holds {longest} tokens without having stopped: its next "
                         f"forward would need position {longest - 1}. transformers' generate() fails at this "
                         f"token too (an IndexError inside the forward); ask for fewer new tokens (a row's prompt "
                         f"and max_new_tokens together at most {limit + 1})")


def tree_inputs(state, tree: tuple, node0: torch.Tensor, width: int):
    """``tree = (parents [B, K], nodes [B], engine)``, ``node0 [B]`` the chunk column of each
    row's node 0 -> (the checked tree layout, the runner that feeds it through the engine, the
    chunk width: wide enough for every row's K node columns, the ones past a row's end padding)."""
    parents, nodes, engine = tree
    width = max(width, int((node0 + parents.shape[1]).max()))
    layout = Layout.tree(parents.to(state.device), start=node0, lengths=nodes.to(state.device))
    return layout, engine_runner(state, engine, layout), width


def engine_runner(state, engine, layout: Layout):
    """A forward's runner through ``engine`` with ``layout``; it keeps the hidden states of the
    state's ``hidden_layers`` in its ``_fed_hidden``."""
    cache_key = state._cache_kwarg
    plain = {"input_ids", "position_ids", cache_key, "use_cache", "attention_mask", "logits_to_keep"}

    def runner(model, kwargs: dict) -> torch.Tensor:
        out = engine.forward(kwargs["input_ids"], kwargs["position_ids"], layout=layout, cache=kwargs[cache_key],
                             attention_mask=kwargs.get("attention_mask"), hidden_layers=state.hidden_layers,
                             logits_to_keep=kwargs.get("logits_to_keep"),
                             model_inputs={k: v for k, v in kwargs.items() if k not in plain})
        state._fed_hidden = out.hidden
        return out.logits

    return runner


def columns_from(logits: torch.Tensor, first: torch.Tensor | int, count: int) -> torch.Tensor:
    """logits [B, keep, V] -> [B, count, V]: row b's ``count`` columns from ``first[b]`` (an int:
    every row's), the last column repeated past the end. Contiguous, as a gather's: a fast output
    layer's logits are a transposed view, and a processor may write into the scores through their
    data (xgrammar's bitmask does)."""
    if isinstance(first, int):
        return logits[:, first: first + count].contiguous()
    cols = (first[:, None] + torch.arange(count, device=first.device)[None, :]).clamp(max=logits.shape[1] - 1)
    return logits.gather(1, cols[..., None].expand(-1, -1, logits.shape[-1]))
