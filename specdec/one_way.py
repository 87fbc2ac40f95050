"""Whether a model's attention looks only backwards, as verifying a block of drafts needs.

A verifying forward feeds several tokens at once; it gives what one-token steps give only where
no token attends to a later one. A decoder-only LM never does, but a BERT-like model loaded
without ``is_decoder=True`` (``BertLMHeadModel``, Megatron-BERT, BigBird, ...) attends both ways,
and transformers only logs a warning. Where a model gives cause to ask (a config with
``is_decoder=False``, which only BERT-like configs have; or a self-attention module of the text
decoder with ``is_causal=False``), a forward of six tokens and one with the last token changed
tell: the first five positions' logits must not move. Once per model; never for a sharded model
(its forwards need every rank at once).
"""

from __future__ import annotations

import weakref

import torch

from .distributed.ranks import sharding
from .modelinfo import vocab_size

#: relative change of the earlier positions' logits above which a model is taken to look ahead
#: (at most 3e-7 in every causal architecture tried, 0 in nearly all; 8e-4 to 1 in tiny random
#: ones that look ahead)
LOOKS_AHEAD = 1e-5
_found: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def both_ways_problem(model) -> str | None:
    """Why ``model`` cannot verify a block of drafts because its tokens attend to later ones, or None."""
    if model not in _found:
        _found[model] = _problem(model) if _suspect(model) and not sharding(model) else None
    return _found[model]


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


@torch.no_grad()
def _problem(model) -> str | None:
    vocab = vocab_size(model)
    ids = (torch.arange(1, 7) % vocab)[None].to(next(model.parameters()).device)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab
    try:
        before = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        after = model(input_ids=changed, use_cache=False).logits[0, :-1].float()
    except Exception:  # a model that needs more than token ids to run: nothing learnt here
        return None
    moved = float((before - after).abs().max() / before.abs().max().clamp(min=1e-6))
    if moved <= LOOKS_AHEAD:
        return None
    return (f"{type(model).__name__} attends both ways (changing a token moved the logits before it by "
            f"{moved:.2g} of their scale), so a block of drafts would see tokens after its own; a BERT-like "
            "model decodes causally when loaded with is_decoder=True")
