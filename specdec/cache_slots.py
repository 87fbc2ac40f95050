"""Slot operations on a ``transformers`` cache's layers, in place: what both cache backends of
``specdec.kv`` do alike to the slots they hold (a tree's accepted nodes gathered into chain order,
rows shifted right)."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def filled_layers(cache: DynamicCache):
    """The layers of ``cache`` that hold tensors."""
    return [layer for layer in cache.layers
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel()]


def gather_cache_slots(cache, first: int, sources: torch.Tensor) -> None:
    """Every layer's slots ``first .. first + W - 1`` of row b take slots ``sources [B, W]``: one
    gather per tensor along the slot dimension (sources may point inside or past the window)."""
    width = sources.shape[1]
    if width == 0:
        return
    for layer in filled_layers(cache):
        for tensor in (layer.keys, layer.values):  # [B, heads, slots, dim]
            index = sources.to(tensor.device)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
            tensor[:, :, first: first + width] = tensor.gather(2, index)


def shift_cache_rows(cache, shifts: torch.Tensor) -> None:
    """Move row b's cached entries right by ``shifts[b]`` slots inside the same tensors; the slots
    it leaves are zeroed (a static cache masks them anyway). One gather per tensor over the rows
    that move, whatever the batch."""
    moving = (shifts > 0).nonzero().flatten()  # [M] the rows that move
    if moving.numel() == 0:
        return
    by = shifts[moving]  # [M] how far each moves
    for layer in filled_layers(cache):
        for tensor in (layer.keys, layer.values):  # [B, heads, slots, dim]
            rows, slots = moving.to(tensor.device), torch.arange(tensor.shape[2], device=tensor.device)
            source = slots[None, :] - by.to(tensor.device)[:, None]  # [M, slots]: where each slot's entry comes from
            index = source.clamp_min(0)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
            moved = tensor[rows].gather(2, index)  # [M, heads, slots, dim]
            tensor[rows] = moved.masked_fill((source < 0)[:, None, :, None], 0)
