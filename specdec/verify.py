"""Verification math: pure functions of tensors, no models, no state.

Every function takes a padded block of drafts ``draft_ids [B, K]`` with ``draft_lengths [B]``
valid entries per row (rows may offer different numbers of drafts, including none) and the
target's scores for the K+1 positions "after the last committed token, after d1, ..., after dK".
It returns, per row, how many drafts were accepted (``0 <= accepted[b] <= draft_lengths[b]``) and
the one token the target adds after them: the argmax (greedy), the *recovered* token resampled
from the residual after a rejection, or the *bonus* token when every draft was accepted.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft d with probability
min(1, target_probs[d] / draft_probs[d]); after a rejection sample from
norm(max(0, target_probs - draft_probs)). A draft with no distribution (prompt lookup) is a point
mass: accept with probability target_probs[d], resample from target_probs with d removed.
Committed tokens are then distributed exactly as the target's own samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B] long, accepted drafts per row
    next_token: torch.Tensor  # [B] long, the target's token after the accepted drafts


def _valid_mask(draft_ids: torch.Tensor, draft_lengths: torch.Tensor) -> torch.Tensor:
    k = draft_ids.shape[1]
    return torch.arange(k, device=draft_ids.device)[None, :] < draft_lengths[:, None]  # [B, K]


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """[B, K] bool per position -> [B] length of the all-true prefix."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def greedy_verify(target_logits: torch.Tensor, draft_ids: torch.Tensor,
                  draft_lengths: torch.Tensor) -> Verdict:
    """target_logits [B, K+1, V]; draft_ids [B, K]; draft_lengths [B]."""
    target_ids = target_logits.argmax(dim=-1)  # [B, K+1]
    k = draft_ids.shape[1]
    match = (draft_ids == target_ids[:, :k]) & _valid_mask(draft_ids, draft_lengths)  # [B, K]
    accepted = _accepted_prefix(match)  # [B]
    next_token = target_ids.gather(1, accepted[:, None]).squeeze(1)  # [B]
    return Verdict(accepted, next_token)


def speculative_sample(target_probs: torch.Tensor, draft_ids: torch.Tensor, draft_lengths: torch.Tensor,
                       draft_probs: torch.Tensor | None = None,
                       generator: torch.Generator | None = None) -> Verdict:
    """target_probs [B, K+1, V]; draft_ids [B, K]; draft_lengths [B]; draft_probs [B, K, V] or None.

    ``draft_probs`` None means the drafts are point masses (a draft with no distribution).
    """
    batch, k = draft_ids.shape
    vocab = target_probs.shape[-1]
    valid = _valid_mask(draft_ids, draft_lengths)  # [B, K]
    if k > 0:
        target_at_draft = target_probs[:, :k].gather(2, draft_ids[..., None]).squeeze(-1)  # [B, K]
        if draft_probs is None:
            draft_at_draft = torch.ones_like(target_at_draft)
        else:
            draft_at_draft = draft_probs.gather(2, draft_ids[..., None]).squeeze(-1)  # [B, K]
        u = torch.rand(batch, k, generator=generator, device=target_probs.device)  # [B, K]
        # u < t/d  <=>  accept with probability min(1, t/d); d > 0 because the draft sampled it
        accept = (u * draft_at_draft < target_at_draft) & valid
        accepted = _accepted_prefix(accept)  # [B]
    else:
        accepted = torch.zeros(batch, dtype=torch.long, device=target_probs.device)

    rows = torch.arange(batch, device=target_probs.device)
    target_next = target_probs[rows, accepted]  # [B, V]
    rejected = accepted < draft_lengths  # [B]: a draft was rejected at position `accepted`
    if k > 0 and bool(rejected.any()):
        pos = accepted.clamp(max=k - 1)
        if draft_probs is None:
            draft_next = torch.nn.functional.one_hot(draft_ids[rows, pos], vocab).to(target_next.dtype)
        else:
            draft_next = draft_probs[rows, pos]  # [B, V]
        draft_next = draft_next * rejected[:, None]  # bonus rows keep the plain target distribution
        residual = (target_next - draft_next).clamp_min(0.0)  # [B, V]
        mass = residual.sum(dim=-1, keepdim=True)
        # mass == 0 only if target == draft at this position, where rejection has probability 0
        target_next = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_next)
    next_token = torch.multinomial(target_next, 1, generator=generator).squeeze(1)  # [B]
    return Verdict(accepted, next_token)
