"""Several sampled sequences per prompt (``num_return_sequences=n``), as ``generate()`` returns them.

``generate()`` repeats each prompt row ``n`` times in place (row ``b`` becomes rows ``b*n`` to
``b*n + n - 1``) and samples the ``n * B`` rows as one batch, each row on its own draws; greedy
search with ``n > 1`` it refuses (its config validation, which specdec's resolution shares). A
speculative run does the same: the rows are repeated before the run, so every row drafts,
verifies and stops on its own, and each is distributed as the target's own sample. (``generate()``'s
assisted decoding refuses ``n > 1``.)

Through ``model.generate(custom_generate=specdec.generate)`` the rows arrive already repeated
(``generate()`` expands them, its encoded media included, before calling the loop). Through
``SpecDecoder.generate`` they are repeated here: token ids and mask. A call whose media would have
to be split by row (pixel values, grids) is refused: images are not laid out one per row, and
``generate()`` repeats their encoded features, which a vision-language draft cannot read.
"""

from __future__ import annotations

from typing import Any

import torch

from .call_inputs import NO_EFFECT
from .multimodal import present_inputs, rope_index_function


def repeated_prompt(target, copies: int, input_ids: torch.Tensor, attention_mask, model_inputs: dict[str, Any],
                    prefix=None) -> tuple[torch.Tensor, Any]:
    """``(input_ids, attention_mask)`` with each row repeated ``copies`` times in place (a mask that
    is not a tensor is left for the prompt's checks to refuse); ValueError for what cannot be
    repeated: model inputs (media, grids, type ids), or a ``prefix`` that does not already hold
    every returned row."""
    effective = {k: v for k, v in model_inputs.items() if k not in (*NO_EFFECT, "logits_to_keep")}
    given = sorted(present_inputs(effective))
    if given:
        other_door = ("" if rope_index_function(target) is not None else  # custom_generate refuses its images
                      ", or call model.generate(..., num_return_sequences=n, custom_generate=specdec.generate), "
                      "which repeats them as generate() does")
        raise ValueError(f"num_return_sequences={copies} with model inputs {given}: SpecDecoder.generate repeats "
                         f"token ids only; repeat each prompt with its images yourself (the processor on n copies, "
                         f"and num_return_sequences=1){other_door}")
    rows = (input_ids.shape[0] if input_ids.dim() > 1 else 1) * copies
    if prefix is not None and prefix.spec.tokens.shape[0] != rows:
        raise ValueError(f"num_return_sequences={copies}: the prefix has {prefix.spec.tokens.shape[0]} rows and "
                         f"the call returns {rows}; prefill every returned row "
                         f"(decoder.prefill(prefix_ids.repeat_interleave({copies}, dim=0)))")
    if isinstance(attention_mask, torch.Tensor):
        attention_mask = _repeated_rows(attention_mask, copies)
    return _repeated_rows(input_ids, copies), attention_mask


def _repeated_rows(rows: torch.Tensor, copies: int) -> torch.Tensor:
    """``rows [B, L]`` (or one row, 1-D) -> ``[B * copies, L]``, each row's copies together."""
    return (rows[None] if rows.dim() == 1 else rows).repeat_interleave(copies, dim=0)


def grammars_per_row(grammar, copies: int, rows: int):
    """``grammar=`` for the ``rows`` returned rows (``copies`` per prompt): a list of one grammar per
    prompt gives each prompt's rows its grammar; one per returned row, one grammar, or a list of
    one stays as it is; any other length is refused, counted in prompts and rows."""
    if not isinstance(grammar, (list, tuple)) or len(grammar) <= 1 or copies == 1 or len(grammar) == rows:
        return grammar
    if len(grammar) * copies == rows:
        return [g for g in grammar for _ in range(copies)]
    raise ValueError(f"{len(grammar)} grammars for {rows // copies} prompts of {copies} sequences each: pass one "
                     f"grammar, a list of one per prompt ({rows // copies}) or one per returned row ({rows})")
