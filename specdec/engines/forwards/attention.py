"""Grouped-query attention without a copy of the cache per query head.

transformers' ``sdpa`` attention repeats each key/value head for its group of query heads
(``repeat_kv``) whenever a forward feeds several tokens with a mask, or is compiled with one:
every verification of drafts, and every compiled draft step, copies the whole cache ``groups``
times over, layer by layer, before attending. On a CPU that copy costs more than the attention
itself, and grows with the batch and the context (the measurements: docs/performance.md,
"Grouped-query attention in verification forwards").

:func:`grouped_sdpa` computes the same attention without the copy:

* on a CPU, eagerly, for several queries, torch's kernel takes the grouped heads itself
  (``enable_gqa=True``): its output is bit for bit the one with repeated heads (checked in
  tests/test_attention.py), so the target's logits, and the tokens chosen from them, do not
  change; one query goes to ``sdpa``, which folds it without a copy, as in the model's own
  one-token steps;
* elsewhere, for a mask shared by all heads, a group's query heads become extra query rows of
  their key/value head (``[B, kv, groups * q, D]``, the mask repeated to match): the same
  attention up to rounding, used by the draft copies (``lowbit.py``), whose drafts the target
  verifies;
* anything else goes to transformers' ``sdpa``.

A copy uses it for good (its own config, :data:`GROUPED_SDPA`). The user's model uses it only
inside specdec's own eager forwards on a CPU (:func:`grouped_attention`, around each forward):
its config names ``sdpa`` again as soon as the forward returns, and its compiled forwards are
left as they are.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

GROUPED_SDPA = "specdec_grouped_sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, kv, S, D],
    ``attention_mask [B, 1, q, S]`` -> ([B, q, H, D], None). See the module doc."""
    groups = getattr(module, "num_key_value_groups", 1)
    grouped = not (groups == 1 or attention_mask is None or kwargs.get("softcap") is not None
                   or kwargs.get("position_bias") is not None)
    eager_cpu = query.device.type == "cpu" and not torch.compiler.is_compiling()
    # one query goes to transformers, which folds it without a copy, as in the model's own steps
    if grouped and eager_cpu and query.shape[2] > 1:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    if grouped and not eager_cpu and attention_mask.shape[1] == 1:
        return folded_sdpa(query, key, value, attention_mask, groups, dropout, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def folded_sdpa(query, key, value, mask, groups: int, dropout: float = 0.0, scaling=None) -> torch.Tensor:
    """The attention of query [B, H, q, D] over key/value [B, H / groups, S, D] with ``mask
    [B, 1, q, S]``, each group's query heads folded into query rows of its key/value head ->
    [B, q, H, D]."""
    batch, heads, q, dim = query.shape
    mask_batch, slots = mask.shape[0], mask.shape[-1]
    mask = mask[:, :, None].expand(mask_batch, 1, groups, q, slots).reshape(mask_batch, 1, groups * q, slots)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(batch, heads // groups, groups * q, dim),
                                                           key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, q, dim).transpose(1, 2).contiguous()


def register_grouped_sdpa() -> None:
    """Register :func:`grouped_sdpa` with transformers under :data:`GROUPED_SDPA` (on first use:
    importing transformers' modeling code at import time would load torchao with it, and its
    messages, for a command that only checks a config)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if GROUPED_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
        AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


@contextmanager
def grouped_attention(model, device: torch.device, width: int | None = None):
    """Run ``model``'s text attention as :func:`grouped_sdpa` inside the block, where it is
    transformers' ``sdpa``, ``device`` is a CPU and the forward feeds more than one token a row
    (``width``; None: unknown): one query goes back to transformers there anyway, so a one-token
    forward skips the wrapper. Its own setting again afterwards."""
    config = model.config.get_text_config()
    if (width == 1 or device.type != "cpu"
            or getattr(config, "_attn_implementation", None) != "sdpa"):
        yield
        return
    register_grouped_sdpa()
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
