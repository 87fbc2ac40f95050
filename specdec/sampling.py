"""Logits -> probabilities, applied identically to draft and target.

Losslessness needs the draft and the target distributions to be warped by the very same
function: temperature, then top-k, then top-p (the order ``transformers`` uses). Greedy decoding
never goes through here: it takes the argmax of the raw logits, as ``generate(do_sample=False)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def validate(self) -> None:
        if not self.do_sample:
            return
        if not (self.temperature > 0):
            raise ValueError(f"do_sample=True needs temperature > 0, got {self.temperature}; "
                             "use do_sample=False for greedy decoding")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or None: no top-k), got {self.top_k}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., vocab] logits -> warped logits (-inf outside the kept set)."""
        return warp_logits(logits, self.temperature, self.top_k, self.top_p)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., vocab] logits -> [..., vocab] float32 probabilities."""
        return torch.softmax(self.warp(logits.float()), dim=-1)


def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> torch.Tensor:
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
    return logits


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, vocab] probabilities -> [B] sampled ids."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
