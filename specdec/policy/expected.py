"""What a block of drafts is worth: the tokens a verification commits on average, and the width
that commits the most per second.

If the drafts at positions 1..K are accepted with conditional probabilities a_1..a_K (a_i:
accepted at i given 1..i-1 were), one verification commits on average

    E(K) = 1 + sum_{i=1..K} prod_{j<=i} a_j        tokens (the target's own token included)

(Leviathan et al. 2023). :func:`choose_width` is a pure function (tested with hypothesis): never
above what rows can offer, zero when no width pays, and never a wider block when acceptance
falls.
"""

from __future__ import annotations

import torch


def expected_tokens(accept: torch.Tensor) -> torch.Tensor:
    """accept [B, K] conditional acceptance per position -> [B, K+1]: E(k) for k = 0..K."""
    rows = [expected_row(rates) for rates in accept.double().tolist()]
    return torch.tensor(rows, dtype=torch.float64).reshape(accept.shape[0], accept.shape[1] + 1)


def expected_row(rates: list[float]) -> list[float]:
    """E(k) for k = 0..K of one row (plain floats: the loop asks every step, and B x K is small)."""
    out, reach = [1.0], 1.0
    for a in rates:
        reach *= a  # P(drafts 1..i all accepted)
        out.append(out[-1] + reach)
    return out


def _floats(x):
    """A tensor's values as (nested lists of) Python floats; a list as it is."""
    return x.double().tolist() if isinstance(x, torch.Tensor) else x


def choose_width(accept: torch.Tensor | list, available: torch.Tensor | list, step_seconds: torch.Tensor | list,
                 value: torch.Tensor | list | None = None) -> int:
    """The number of drafts W that maximises the batch's committed tokens per second, each row's
    tokens weighted by ``value [B]`` (default 1: see :meth:`~.plan.DraftPolicy.row_values`).

    accept [B, K] conditional acceptance per row and position; available [B] drafts each row can
    offer (at most K); step_seconds [K+1] the cost of a step that verifies w drafts (w = 0..K),
    drafting included. Row b verifies ``min(W, available[b])``. Ties go to the smaller W. Each
    argument may be a tensor or (nested) lists of numbers (what the loop passes: fewer operations).
    """
    rows, seconds = _floats(accept), _floats(step_seconds)
    k = accept.shape[1] if isinstance(accept, torch.Tensor) else len(rows[0]) if rows else len(seconds) - 1
    offers = [int(a) for a in (available.tolist() if isinstance(available, torch.Tensor) else available)]
    total = [0.0] * (k + 1)  # committed tokens of the batch for w = 0..K, weighted
    weights = [1.0] * len(rows) if value is None else _floats(value)
    for rates, offer, weight in zip(rows, offers, weights):
        expected = expected_row(rates)
        offer = min(max(offer, 0), k)
        for w in range(k + 1):
            total[w] += weight * expected[min(w, offer)]
    widest = max(offers, default=0)
    rate = [t / max(c, 1e-12) for t, c in zip(total, seconds)][: widest + 1]
    best = max(rate)
    return next(w for w, r in enumerate(rate) if r >= best * (1 - 1e-9))  # the smallest of the best

