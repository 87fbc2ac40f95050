"""Rows that repeat one prompt are prefilled once: the target's cache is copied to each of them.

A batch often holds the same prompt several times: ``num_return_sequences=n`` repeats each prompt
``n`` times (``specdec/return_sequences.py``), and callers that sample several answers per prompt
(best-of-n, reinforcement-learning rollouts) repeat prompts in the batch themselves.
``generate()`` prefills every row. Here the target runs once over each distinct prompt's tokens
but its last (one row per distinct prompt), and every row continues from a copy of its prompt's
keys and values, as from a :class:`~specdec.multimodal.Prefix`: its first step feeds the last
token (with any drafts). The cost of the prefill then scales with the distinct prompts, not the
rows.

The run asks for it once its generator is set up and every check has passed, just before its
first forward (``DecodeRun``): a call refused is refused before any forward, and a generator that
learns in ``setup`` that it reads the target's hidden states is known to.

Exact as a prefill of every row: each row's cache holds what a prefill of its prompt computes (a
forward over fewer rows may round the last bits apart, as any other batch shape does), and from
the first step on every row draws, drafts and stops on its own. Not done where it cannot be: no
row repeats another, a row of one token, model inputs (media, type ids), a prefix given, a static
cache, ``engine="llama_cpp"``, a sharded target, a generator that reads the target's hidden
states (``eagle3``, ``mtp``: the prefill's states are its first drafts').
"""

from __future__ import annotations

import torch

from .distributed import SOLO
from .multimodal import Prefix, PrefillSpec, present_inputs
from .request import CallSettings, Prompt
from .state import ModelState


def shared_prefix(target, prompt: Prompt, settings: CallSettings, hidden_layers: tuple[int, ...]) -> Prefix | None:
    """For every row of ``prompt`` (validated, no prefix of its own), the target's keys and values of
    its prompt but the last token, computed once per distinct prompt; None where rows do not repeat
    or the call cannot share (see the module doc). ``hidden_layers``: those the generator reads."""
    cache = settings.cache
    if (prompt.rows.shape[0] == 1 or prompt.prefix is not None or int(prompt.lengths.min()) < 2 or hidden_layers
            or present_inputs(prompt.spec.user_inputs) or cache.static or cache.engine == "llama_cpp"
            or settings.ranks is not SOLO):
        return None
    batch, width = prompt.rows.shape
    inside = torch.arange(width, device=prompt.rows.device)[None, :] < prompt.lengths[:, None]
    keys = torch.cat([prompt.lengths[:, None], prompt.rows.masked_fill(~inside, -1)], 1)  # [B, 1 + P]
    distinct, copy_of = torch.unique(keys, dim=0, return_inverse=True)  # [U, 1 + P], [B]
    if distinct.shape[0] == batch:
        return None
    order = torch.arange(batch, device=keys.device)
    first = torch.full((distinct.shape[0],), batch, device=keys.device).scatter_reduce(0, copy_of, order, "amin")
    # each distinct prompt but its last token [U, P], [U]; then its cache's rows gathered for every row,
    # in place (the prefix is this call's own, and the run takes its cache without a copy)
    spec = PrefillSpec.from_call(prompt.rows[first], prompt.lengths[first] - 1, {})
    head = prefilled(target, spec, settings.pad, cache)
    head.cache.batch_select_indices(copy_of)
    spec = PrefillSpec(spec.tokens[copy_of], spec.lengths[copy_of], {}, {})
    return Prefix(target, spec, head.offsets[copy_of], head.cached_slots, head.cache,
                  head.positions.select_rows(copy_of))


def prefilled(target, spec: PrefillSpec, pad: int, cache) -> Prefix:
    """The target's forward over ``spec``'s rows (and their prefill-only inputs) on a cache of
    ``cache``'s kind, kept as a :class:`~specdec.multimodal.Prefix`."""
    prefill, positions = spec.for_model(target)
    state = ModelState(target, spec.tokens, spec.lengths, pad_token_id=pad, prefill_inputs=prefill,
                       positions=positions, kv=cache)
    with torch.no_grad():
        state.forward(start=spec.lengths - 1)
    return Prefix(target, spec, state.offsets.clone(), state.cached_slots, state.cache, state.positions)
