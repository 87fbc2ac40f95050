"""A call's model keyword arguments: the prefill-only inputs among them, and what ``generate()``
manages per step instead.

``generate()`` takes any keyword its model's ``forward`` declares. Media and their grids reach the
model at the prefill only; specdec passes them on (``specdec/multimodal.py``). The rest it handles
itself at every step, so each is treated here by what it does to ``generate()``'s tokens:

* no effect on them: dropped (``use_cache``, ``return_dict``, ``labels``, an integer
  ``logits_to_keep``, an empty cache, position ids equal to the ones ``generate()`` derives from
  the attention mask);
* an effect specdec does not reproduce: refused by name before any forward (``inputs_embeds``,
  other position ids, a cache holding tokens, ``token_type_ids`` on a text-only model, which
  ``generate()`` extends with each row's last type at every step).

Through ``custom_generate`` the arguments are those ``generate()`` prepared (``prepared=True``): the
position ids and the cache are its own unless the user passed theirs.
"""

from __future__ import annotations

from typing import Any

import torch

from .multimodal import is_multimodal

#: keywords that change no token of ``generate()``'s output
NO_EFFECT = ("use_cache", "return_dict", "labels", "output_attentions", "output_hidden_states")


def prefill_only(model, inputs: dict[str, Any], attention_mask: torch.Tensor, *, prepared: bool = False) -> dict:
    """``inputs`` (the call's model keywords, :func:`check_token_input` passed) -> the prefill-only
    ones; ValueError naming what a speculative run cannot reproduce. ``attention_mask [B, L]`` is
    the prompt's."""
    inputs = {k: v for k, v in inputs.items() if k not in NO_EFFECT and k not in ("attention_mask", "inputs_embeds")
              and not _empty(v)}  # (generate() passes an empty mm_encoder_outputs where a model takes one)
    keep = inputs.pop("logits_to_keep", None)
    if keep is not None and not isinstance(keep, int):
        raise ValueError("logits_to_keep as a tensor of positions is not reproduced; leave it out (each step "
                         "reads the last position's logits)")
    for name in ("past_key_values", "cache"):
        cache = inputs.pop(name, None)
        length = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else 0
        if length:
            raise ValueError(f"{name} holds {length} tokens; specdec builds its own caches "
                             "(SpecDecoder.prefill() keeps a prefix's)")
    cache_position = inputs.pop("cache_position", None)
    if cache_position is not None and not prepared:
        raise ValueError("cache_position: specdec places every token itself; leave it out")
    _check_positions(model, inputs.pop("position_ids", None), attention_mask, prepared)
    if "token_type_ids" in inputs and inputs["token_type_ids"] is not None and not is_multimodal(model):
        raise ValueError(f"token_type_ids on {type(model).__name__}: generate() gives every new token its row's "
                         "last token type, at every step, and specdec passes model inputs at the prefill only; "
                         "leave them out")
    return inputs


def _empty(value) -> bool:
    """An input that means what leaving it out means: None, or an empty dict, list or tuple."""
    return value is None or isinstance(value, (dict, list, tuple)) and not value


def check_token_input(inputs: dict[str, Any]) -> None:
    """Refuse a prompt given as embeddings (``generate()`` then passes empty ``input_ids``)."""
    if inputs.get("inputs_embeds") is not None:
        raise ValueError("inputs_embeds: specdec decodes from token ids (drafts and the cache are kept in ids); "
                         "pass input_ids")


def _check_positions(model, positions, attention_mask: torch.Tensor, prepared: bool) -> None:
    """Refuse position ids other than those ``generate()`` derives from the mask: the mask's
    running count, 0 on padding."""
    if positions is None:
        return
    if positions.dim() != 2:  # 3-D (mRoPE): through custom_generate, those generate() computed from the grids
        if prepared:
            return
        raise ValueError(f"position_ids of shape {tuple(positions.shape)}: specdec computes "
                         f"{type(model).__name__}'s positions from the prompt and its media; leave them out")
    mask = attention_mask.to(positions.device).long()
    default = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    if positions.shape != default.shape or not torch.equal(positions.long(), default):
        raise ValueError("position_ids other than the attention mask's running count (what generate() uses "
                         "when none are given) are not reproduced; leave them out")
