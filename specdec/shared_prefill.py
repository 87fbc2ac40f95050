"""Rows that repeat one prompt are prefilled once: the target's cache is copied to each of them.

A batch often holds the same prompt several times: ``num_return_sequences=n`` repeats each prompt
``n`` times (``specdec/return_sequences.py``), and callers that sample several answers per prompt
(best-of-n, reinforcement-learning rollouts) repeat prompts in the batch themselves.
``generate()`` prefills every row. Here the target runs once over each distinct prompt's tokens
but its last (one row per distinct prompt), and every row continues from a copy of its prompt's
keys and values, as from a :class:`~specdec.multimodal.Prefix`: its first step feeds the last
token (with any drafts). The cost of the prefill then scales with the distinct prompts, not the
rows.

Exact as a prefill of every row: each row's cache holds what a prefill of its prompt computes (a
forward over fewer rows may round the last bits apart, as any other batch shape does), and from
the first step on every row draws, drafts and stops on its own. Not done where it cannot be: no
row repeats another, a row of one token, model inputs (media, type ids), a prefix given, a static
cache, ``engine="llama_cpp"``, a sharded target, a cache that cannot gather rows, a generator that
reads the target's hidden states (``eagle3``, ``mtp``: the prefill's states are its first drafts').
"""

from __future__ import annotations

import torch

from .multimodal import present_inputs


def shared_prefill(decoder, prompt):
    """``prompt`` (a validated :class:`~specdec.request.Prompt` of ``decoder``'s target) continued
    from one prefill of each distinct row where rows repeat, else unchanged."""
    if not _may_share(decoder, prompt):
        return prompt
    batch, width = prompt.rows.shape
    inside = torch.arange(width, device=prompt.rows.device)[None, :] < prompt.lengths[:, None]
    keys = torch.cat([prompt.lengths[:, None], prompt.rows.masked_fill(~inside, -1)], 1)  # [B, 1 + P]
    distinct, copy_of = torch.unique(keys, dim=0, return_inverse=True)  # [U, 1 + P], [B]
    if distinct.shape[0] == batch:
        return prompt
    order = torch.arange(batch, device=keys.device)
    first = torch.full((distinct.shape[0],), batch, device=keys.device).scatter_reduce(0, copy_of, order, "amin")
    head = decoder._prompt(prompt.input_ids[first, :-1], prompt.mask()[first, :-1], {}, None)
    prefix = decoder._prefilled(head).rows(copy_of)
    return prompt if prefix is None else decoder._prompt(prompt.input_ids, prompt.mask(), {}, prefix)


def _may_share(decoder, prompt) -> bool:
    """Whether ``prompt``'s rows could continue from a shared prefill (before looking for repeats)."""
    cache = decoder.cache
    return not (prompt.rows.shape[0] == 1 or prompt.prefix is not None or int(prompt.lengths.min()) < 2
                or present_inputs(prompt.spec.user_inputs) or cache.static or cache.engine == "llama_cpp"
                or decoder.ranks is not None
                or decoder.candidate_generator.drafting().hidden_layers)  # a head would miss the prompt's states
