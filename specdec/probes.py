"""What two small forwards of a model tell about it that its code does not say.

Where a model gives cause to ask, and once per model (never for a sharded model: its forwards
need every rank at once):

* :func:`both_ways_problem`: a verifying forward feeds several tokens at once, and gives what
  one-token steps give only where no token attends to a later one. A decoder-only LM never does,
  but a BERT-like model loaded without ``is_decoder=True`` (``BertLMHeadModel``, Megatron-BERT,
  BigBird, ...) attends both ways, and transformers only logs a warning. Asked where the config
  says ``is_decoder=False`` (only BERT-like configs have the field) or a self-attention module of
  the text decoder has ``is_causal=False``: six tokens, then the same with the last one changed;
  the first five positions' logits must not move.
* :func:`slot_problem`: rows of a batch that accept different numbers of drafts sit at other
  cache slots than ``generate()`` puts them; a model that takes ``position_ids`` is told each
  token's position, but one whose ``forward`` takes none may number tokens by their slots (BART's
  decoders, RoFormer) or not (BLOOM's ALiBi counts the mask, MPT's is relative). Asked of a model
  without ``position_ids`` in a batch of several rows: four tokens, then the same after two
  masked pads; the last position's logits must not move.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from .distributed.ranks import sharding
from .modelinfo import vocab_size

#: relative change of a probe's logits above which they moved (where the model looks only back, or
#: places tokens by position_ids: at most 3e-7 in every architecture tried, 0 in nearly all; where
#: it looks ahead or counts slots, from 8e-4 in tiny random models)
MOVED = 1e-5
_found: dict[str, weakref.WeakKeyDictionary] = {"both_ways": weakref.WeakKeyDictionary(),
                                                 "slots": weakref.WeakKeyDictionary()}


def both_ways_problem(model) -> str | None:
    """Why ``model`` cannot verify a block of drafts because its tokens attend to later ones, or None."""
    return _once("both_ways", model, lambda m: _both_ways(m) if _suspect(m) else None)


def slot_problem(model, batch_size: int) -> str | None:
    """Why ``model`` cannot decode ``batch_size`` rows speculatively because it numbers tokens by
    their cache slots, or None."""
    if batch_size < 2 or "position_ids" in inspect.signature(model.forward).parameters:
        return None
    return _once("slots", model, _slots)


def _once(kind: str, model, probe) -> str | None:
    found = _found[kind]
    if model not in found:
        found[model] = None if sharding(model) else probe(model)
    return found[model]


def _suspect(model) -> bool:
    """A config that says ``is_decoder=False`` (BERT-like ones: transformers' other configs have no
    such field), or a self-attention module with ``is_causal=False`` in the text decoder (a vision
    tower's bidirectional attention is not asked about)."""
    decoding = getattr(model.config, "is_decoder", None)
    if decoding is not None:
        return not decoding
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return any(getattr(m, "is_causal", None) is False and "Cross" not in type(m).__name__
               for m in (decoder if isinstance(decoder, torch.nn.Module) else model).modules())


def _both_ways(model) -> str | None:
    ids = _ids(model, 6)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab_size(model)
    moved = _moved(model, dict(input_ids=ids), dict(input_ids=changed), slice(0, -1))
    if moved is None or moved <= MOVED:
        return None
    return (f"{type(model).__name__} attends both ways (changing a token moved the logits before it by "
            f"{moved:.2g} of their scale), so a block of drafts would see tokens after its own; a BERT-like "
            "model decodes causally when loaded with is_decoder=True")


def _slots(model) -> str | None:
    ids = _ids(model, 4)
    padded = torch.cat([torch.zeros_like(ids[:, :2]), ids], dim=1)
    mask = torch.ones_like(padded)
    mask[:, :2] = 0
    moved = _moved(model, dict(input_ids=ids, attention_mask=torch.ones_like(ids)),
                   dict(input_ids=padded, attention_mask=mask), slice(-1, None))
    if moved is None or moved <= MOVED:
        return None
    return (f"{type(model).__name__}.forward takes no position_ids and numbers tokens by their cache slots (two "
            f"pads before a row moved its logits by {moved:.2g} of their scale), and rows that accept different "
            "numbers of drafts move to other slots; decode one row at a time")


def _ids(model, count: int) -> torch.Tensor:
    return (torch.arange(1, count + 1) % vocab_size(model))[None].to(next(model.parameters()).device)


@torch.no_grad()
def _moved(model, first: dict, second: dict, positions: slice) -> float | None:
    """How far the logits at ``positions`` of a forward on ``second`` are from those on ``first``,
    relative to the latter's largest; None where the model needs more than these inputs to run."""
    try:
        before = model(**first, use_cache=False).logits[0, positions].float()
        after = model(**second, use_cache=False).logits[0, positions].float()
    except Exception:  # nothing learnt here
        return None
    return float((before - after).abs().max() / before.abs().max().clamp(min=1e-6))
