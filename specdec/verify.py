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

Token trees (docs/trees.md). A tree block holds ``K`` nodes per row, ``parents [B, K]`` giving
each node's parent (-1: the root, i.e. the last committed token), parents before children; the
target's scores come for ``K + 1`` columns: column 0 after the root, column ``i + 1`` after node
i (each node's own root-to-node chain). Verification walks from the root:

* greedy (:func:`tree_greedy_verify`): the longest root-to-node path whose every node is the
  target's argmax after its parent, then the target's argmax at its end;
* sampling with point-mass nodes (:func:`tree_point_mass_sample`): sample the target's token at
  the root, descend to a child holding that token if there is one, repeat; the first sample with
  no such child is the next token. Each committed token is then a sample of the target's
  distribution given the path before it, whatever the tree, so the output is exact;
* sampling with drafted siblings (:func:`tree_speculative_sample`, multi-draft speculative
  sampling by recursive rejection): at a node, its children are tried in node order, child j
  accepted with probability min(1, P(x_j) / Q_j(x_j)), where ``Q_j`` is the distribution child j
  was drawn from *given its earlier siblings* (the proposal's ``probs[b, j]``: the parent's
  draft distribution for siblings drawn with replacement, that distribution without the earlier
  siblings' tokens, renormalized, for siblings drawn without replacement), and ``P`` the target's
  distribution there, replaced after each rejection by norm(max(0, P - Q_j)); the first accepted
  child is descended into, and where none is, the next token is sampled from what ``P`` became.
  Each round is a speculative sampling step whose result is exactly its ``P`` (whatever its
  proposal, so long as the child was drawn from it), so each committed token is the target's.

Each returns a :class:`TreeVerdict`: the accepted depth, the next token, and the accepted path as
node indices (``path[b, :accepted[b]]``, root to deepest), from which the run builds the chain it
commits. :func:`leaf_chains` gives the root-to-leaf chains along which the run processes a tree's
scores.
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
    if k == 0:  # nothing to accept: the target's token
        return Verdict(target_ids.new_zeros(target_ids.shape[0]), target_ids[:, 0])
    # the agreeing prefix, no longer than the row's drafts (a prefix of a prefix mask's AND)
    accepted = torch.minimum(_accepted_prefix(draft_ids == target_ids[:, :k]), draft_lengths)  # [B]
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


# -- token trees ----------------------------------------------------------------------------------
@dataclass
class TreeVerdict(Verdict):
    path: torch.Tensor = None  # [B, K] long: path[b, j] the accepted node at depth j+1 (0 past accepted[b])


def _tree_parents(parents: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, K] parents with every node at or past its row's length marked -2 (no node's child, never
    accepted)."""
    k = parents.shape[1]
    real = torch.arange(k, device=parents.device)[None, :] < lengths.to(parents.device)[:, None]  # [B, K]
    return torch.where(real, parents.long(), -2)


def _path_of(node: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """node [B] (-1: none), parents [B, K], depth [B] -> path [B, K]: the node indices from depth 1
    to ``depth[b]`` along node's ancestors (0 past the depth)."""
    batch, k = parents.shape
    path = torch.zeros(batch, k, dtype=torch.long, device=parents.device)
    rows = torch.arange(batch, device=parents.device)
    at, level = node.clone(), depth.clone()
    for _ in range(k):  # climb one level per pass; a row stops at the root
        live = at >= 0
        if not bool(live.any()):
            break
        path[rows[live], level[live] - 1] = at[live]
        at = torch.where(live, parents.gather(1, at.clamp(min=0)[:, None])[:, 0], at)
        level = level - live.long()
    return path


def tree_greedy_verify(target_logits: torch.Tensor, node_ids: torch.Tensor, parents: torch.Tensor,
                       lengths: torch.Tensor) -> TreeVerdict:
    """target_logits [B, K+1, V] (column 0: after the root, i+1: after node i); node_ids [B, K];
    parents [B, K]; lengths [B] -> the deepest node whose every ancestor and itself is the target's
    argmax after its parent (the first in node order among equally deep ones), and the argmax after it."""
    batch, k = node_ids.shape
    target_ids = target_logits.argmax(dim=-1)  # [B, K+1]
    parents = _tree_parents(parents, lengths)
    ok = torch.zeros(batch, k, dtype=torch.bool, device=node_ids.device)  # [B, K] node on an all-argmax path
    depth = torch.zeros(batch, k, dtype=torch.long, device=node_ids.device)  # [B, K]
    for i in range(k):  # parents come first: their verdict is final
        p = parents[:, i]
        parent_ok = torch.where(p >= 0, ok.gather(1, p.clamp(min=0)[:, None])[:, 0], p == -1)
        wanted = target_ids.gather(1, (p.clamp(min=-1) + 1)[:, None])[:, 0]  # the argmax after the parent
        ok[:, i] = parent_ok & (node_ids[:, i] == wanted)
        depth[:, i] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0)[:, None])[:, 0], 0) + 1
    reached = torch.where(ok, depth, 0)  # [B, K]
    accepted = reached.amax(dim=1) if k else torch.zeros(batch, dtype=torch.long, device=node_ids.device)
    node = torch.where(accepted > 0, reached.argmax(dim=1) if k else accepted, -1)  # argmax: the first deepest
    next_token = target_ids.gather(1, (node + 1)[:, None])[:, 0]  # [B]
    return TreeVerdict(accepted, next_token, _path_of(node, parents, accepted))


def tree_point_mass_sample(target_probs: torch.Tensor, node_ids: torch.Tensor, parents: torch.Tensor,
                           lengths: torch.Tensor, generator: torch.Generator | None = None) -> TreeVerdict:
    """target_probs [B, K+1, V] (as :func:`tree_greedy_verify`'s columns); point-mass nodes
    node_ids [B, K] -> sample the target at the root, descend to a child holding the sampled token,
    repeat; the first token without such a child is the next token (see the module docstring)."""
    batch, k = node_ids.shape
    device = target_probs.device
    parents = _tree_parents(parents, lengths)
    rows = torch.arange(batch, device=device)
    node = torch.full((batch,), -1, dtype=torch.long, device=device)  # [B] current node (-1: the root)
    accepted = torch.zeros(batch, dtype=torch.long, device=device)
    next_token = torch.zeros(batch, dtype=torch.long, device=device)
    open_rows = torch.ones(batch, dtype=torch.bool, device=device)
    for _ in range(k + 1):
        token = torch.multinomial(target_probs[rows, node + 1], 1, generator=generator)[:, 0]  # [B]
        child = (parents == node[:, None]) & (node_ids == token[:, None])  # [B, K]
        found = child.any(dim=1) & open_rows
        next_token = torch.where(open_rows & ~found, token, next_token)
        open_rows = found
        if not bool(found.any()):
            break
        node = torch.where(found, child.float().argmax(dim=1), node)
        accepted = accepted + found.long()
    return TreeVerdict(accepted, next_token, _path_of(torch.where(accepted > 0, node, -1), parents, accepted))


def tree_speculative_sample(target_probs: torch.Tensor, node_ids: torch.Tensor, parents: torch.Tensor,
                            lengths: torch.Tensor, draft_probs: torch.Tensor,
                            generator: torch.Generator | None = None) -> TreeVerdict:
    """target_probs [B, K+1, V] (as :func:`tree_greedy_verify`'s columns); nodes node_ids [B, K]
    drawn from draft_probs [B, K, V] (node i from ``draft_probs[b, i]``, given its parent and its
    earlier siblings) -> recursive rejection from the root down (see the module docstring)."""
    batch, k = node_ids.shape
    device = target_probs.device
    parents = _tree_parents(parents, lengths)
    draft_probs = draft_probs.to(device=device, dtype=target_probs.dtype)
    rows = torch.arange(batch, device=device)
    node = torch.full((batch,), -1, dtype=torch.long, device=device)  # [B] current node (-1: the root)
    accepted = torch.zeros(batch, dtype=torch.long, device=device)
    next_token = torch.zeros(batch, dtype=torch.long, device=device)
    open_rows = torch.ones(batch, dtype=torch.bool, device=device)
    for _ in range(k + 1):
        residual = target_probs[rows, node + 1]  # [B, V] the target at the current node
        chosen = torch.full_like(node, -1)  # [B] the accepted child (-1: none yet)
        for j in range(k):  # children in node order: each a round of speculative sampling
            trying = open_rows & (chosen < 0) & (parents[:, j] == node)
            if not bool(trying.any()):
                continue
            q, x = draft_probs[:, j], node_ids[:, j]  # [B, V], [B]
            p_x, q_x = residual.gather(1, x[:, None])[:, 0], q.gather(1, x[:, None])[:, 0]
            u = torch.rand(batch, device=device, generator=generator, dtype=residual.dtype)
            take = trying & (u * q_x < p_x)  # accepted with probability min(1, p(x) / q(x))
            chosen = torch.where(take, j, chosen)
            rejected = trying & ~take
            left = (residual - q).clamp_min(0)
            mass = left.sum(dim=-1, keepdim=True)
            residual = torch.where(rejected[:, None] & (mass > 0), left / mass.clamp_min(1e-30), residual)
        found = chosen >= 0
        token = torch.multinomial(residual, 1, generator=generator)[:, 0]  # [B] where no child was taken
        next_token = torch.where(open_rows & ~found, token, next_token)
        open_rows = found
        if not bool(found.any()):
            break
        node = torch.where(found, chosen, node)
        accepted = accepted + found.long()
    return TreeVerdict(accepted, next_token, _path_of(torch.where(accepted > 0, node, -1), parents, accepted))


def _depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, K] parents (-1: the root; -2: padding) -> [B, K] each node's depth (1: a root child)."""
    depth = torch.ones_like(parents)
    for i in range(parents.shape[1]):  # parents come first: their depth is final
        p = parents[:, i]
        depth[:, i] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1, 1)
    return depth


def leaf_chains(parents: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, k], nodes per row counts [B] -> (paths [L, B, k]: the root-to-leaf node indices
    of each row's l-th leaf (its last leaf again where it has fewer; 0 past the depth), depths
    [L, B]), L the most leaves of any row (one path of depth 0 for a row without nodes)."""
    batch, k = parents.shape
    parents = _tree_parents(parents, counts)
    real = parents > -2  # [B, k]
    has_child = torch.zeros_like(real)
    rows = torch.arange(batch, device=parents.device)
    for i in range(k):
        p = parents[:, i]
        has_child[rows[p >= 0], p[p >= 0]] = True
    leaf = real & ~has_child  # [B, k]
    depth = _depths(parents)  # [B, k]
    count = leaf.sum(dim=1)  # [B]
    rank = leaf.long().cumsum(dim=1) - 1  # [B, k] each leaf's rank in its row
    paths, depths = [], []
    for l in range(max(int(count.max()) if batch else 0, 1)):
        want = torch.minimum(torch.full_like(count, l), (count - 1).clamp(min=0))  # [B]
        pick = leaf & (rank == want[:, None])  # [B, k]
        found = pick.any(dim=1)
        node = torch.where(found, pick.float().argmax(dim=1), -1)  # [B]
        d = torch.where(found, depth.gather(1, node.clamp(min=0)[:, None])[:, 0], 0)  # [B]
        paths.append(_path_of(node, parents, d))
        depths.append(d)
    return torch.stack(paths), torch.stack(depths)
