"""Sampling parameters, and logits -> probabilities by them.

``SamplingParams`` are the call's sampling settings as a plugin reads them (``ctx.sampling``).
:func:`warp_logits` applies them in ``transformers``' order: temperature, then top-k, then top-p,
then min-p. A decode run samples the target from the scores its logits processors give
(``specdec/processors.py``, where ``generate()``'s own warpers are the last processors), and a
drafter drafts from the same processed scores (``DecodeContext.scores``). Speculative sampling is
lossless for any draft distribution that is the one the drafts were sampled from; drafting from
the target's processed distribution only makes drafts more likely to be accepted. Greedy decoding
never goes through here: it takes the argmax of the (processed) scores, as ``generate(do_sample=False)``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def validate(self) -> None:
        """Refuse wrong types always and out-of-range values when sampling, before any forward."""
        real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)  # noqa: E731
        if not isinstance(self.do_sample, (bool, int)) or self.do_sample not in (0, 1):
            raise TypeError(f"do_sample must be a bool, got {self.do_sample!r}")
        if not real(self.temperature):
            raise TypeError(f"temperature must be a number, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool)):
            raise TypeError(f"top_k must be an int (0 or None: no top-k), got {self.top_k!r}")
        if self.top_p is not None and not real(self.top_p):
            raise TypeError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.min_p is not None and not real(self.min_p):
            raise TypeError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not self.do_sample:
            return
        if not (self.temperature > 0):
            raise ValueError(f"do_sample=True needs temperature > 0, got {self.temperature}; "
                             "use do_sample=False for greedy decoding")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or None: no top-k), got {self.top_k}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., vocab] logits -> warped logits (-inf outside the kept set)."""
        return warp_logits(logits, self.temperature, self.top_k, self.top_p, self.min_p)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., vocab] logits -> [..., vocab] float32 probabilities."""
        return torch.softmax(self.warp(logits.float()), dim=-1)


def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, min_p: float | None = None) -> torch.Tensor:
    if temperature != 1.0:
        logits = logits / temperature
    vocab = logits.shape[-1]
    if top_k and top_k < vocab:  # 0 or None: no top-k, as in transformers
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly ranked above
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p is not None:  # drop tokens below min_p times the most likely one's probability
        probs = torch.softmax(logits, dim=-1)
        drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
        drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, vocab] probabilities -> [B] sampled ids."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
