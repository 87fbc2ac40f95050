"""What a step keeps of what its target forward fed, beyond the tokens themselves.

After a token tree's forward the accepted nodes' cache entries and hidden states sit at node
slots, not in chain order: :func:`keep_path` moves them into place (then the commit drops the
rest), :func:`keep_hidden_path` does the same for the hidden states a generator reads. After a
commit, :func:`committed_hidden` gives those generators the hidden states of the tokens the step
committed. Each takes a :class:`~specdec.state.ModelState` and reads its layout.
"""

from __future__ import annotations

import torch

__all__ = ["committed_hidden", "keep_hidden_path", "keep_path"]


def committed_hidden(state, end: torch.Tensor):
    """After a forward with ``state.hidden_layers`` and its commit: the hidden states of the
    tokens it fed that are committed, up to token ``end[b]`` (exclusive) -> ``(states {layer:
    [B, M, H]}, start [B], count [B])``, column j of row b holding token ``start[b] + j``."""
    states, first = state.hidden
    start = first.clamp(min=0)  # [B] a row's first fed token (its pending one; 0 at a prefill)
    count = (torch.minimum(end.to(state.device), state.lengths) - start).clamp(min=0)  # [B]
    width = max(int(count.max()), 1)
    cols = (start - first)[:, None] + torch.arange(width, device=state.device)[None, :]  # [B, M]
    out = {}
    for layer, h in states.items():
        cols_h = cols.clamp(max=h.shape[1] - 1)[..., None].expand(-1, -1, h.shape[-1])
        out[layer] = h.gather(1, cols_h)  # [B, M, H]
    return out, start, count


def keep_path(state, start: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor) -> None:
    """After a tree forward (tokens ``start[b] ..`` of row b were its nodes): move the cached
    entries of each row's accepted nodes ``path[b, :accepted[b]]`` (node indices, root to
    deepest) to the slots of the chain they make, ``start[b] .. start[b] + accepted[b] - 1``,
    in one gather per cache tensor; ``ModelState.commit`` then drops the rest."""
    count = int(accepted.max()) if accepted.numel() else 0
    if count == 0:
        return
    depth = torch.arange(count, device=state.device)[None, :]  # [1, A]
    moved = (path[:, :count].to(state.device) != depth) & (depth < accepted.to(state.device)[:, None])  # [B, A]
    if not bool(moved.any()):  # the accepted path is the leading chain: already in place
        return
    base = state.offsets + start.to(state.device)  # [B] slot of each row's node 0
    if bool((base[:, None] + path[:, :count].to(state.device) >= state.cached_slots)[moved].any()):
        raise RuntimeError("keep_path: an accepted node is no longer cached")
    first = int(base.min())
    width = int((base + accepted.to(state.device)).max()) - first
    cols = first + torch.arange(width, device=state.device)[None, :].repeat(state.batch_size, 1)  # [B, W]
    along = cols - base[:, None]  # [B, W] depth - 1 of each slot in its row's chain
    take = (along >= 0) & (along < accepted.to(state.device)[:, None])
    nodes = path.to(state.device).gather(1, along.clamp(0, path.shape[1] - 1))
    state.kv.gather_slots(first, torch.where(take, base[:, None] + nodes, cols))
    if state.hidden is not None:  # the accepted nodes' hidden states in chain order too
        keep_hidden_path(state, start.to(state.device), path[:, :count].to(state.device),
                         depth < accepted.to(state.device)[:, None])


def keep_hidden_path(state, start: torch.Tensor, path: torch.Tensor, take: torch.Tensor) -> None:
    """After a tree's forward: token ``start[b] + j`` takes the hidden states of node ``path[b, j]``
    where ``take[b, j]`` (the accepted nodes' states in chain order, as :func:`keep_path`
    moves their cache entries)."""
    states, first = state.hidden
    dest = (start - first)[:, None] + torch.arange(path.shape[1], device=state.device)[None, :]  # [B, A]
    source = (start - first)[:, None] + path  # [B, A]
    rows = torch.arange(state.batch_size, device=state.device)[:, None].expand_as(dest)
    for h in states.values():
        h[rows[take], dest[take]] = h[rows[take], source[take]].clone()
