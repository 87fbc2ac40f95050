"""Acceptance statistics: every speculative-decoding metric is defined here, once.

Definitions (as vLLM and Spec-Bench use them):

* a *step* is one target forward that verifies a block of drafts for one row (a batch of B rows
  verified together counts B steps);
* *mean accepted length* = tokens committed per step, the target's own token included, so plain
  decoding scores exactly 1.0;
* *acceptance rate* = accepted drafts / drafted tokens;
* *per-position acceptance* [i] = steps whose draft at position i was accepted / steps.

The object holds raw counts only; every ratio is a property, so statistics from several runs,
rows or questions merge by adding counts (``a + b`` or :meth:`merge`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    committed_tokens: int = 0
    accepted_at_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    #: numeric counters the candidate generator reported (``CandidateGenerator.report``)
    generator: dict[str, float] = field(default_factory=dict)

    # -- recording ---------------------------------------------------------------------------
    def record_step(self, drafted: list[int], accepted: list[int], committed: list[int]) -> None:
        """Record one verification forward: per row, drafts offered, accepted and committed."""
        for d, a, c in zip(drafted, accepted, committed):
            self.steps += 1
            self.drafted_tokens += d
            self.accepted_tokens += a
            self.committed_tokens += c
            if a > len(self.accepted_at_position):
                self.accepted_at_position.extend([0] * (a - len(self.accepted_at_position)))
            for i in range(a):
                self.accepted_at_position[i] += 1

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        n = max(len(self.accepted_at_position), len(other.accepted_at_position))
        pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
        return AcceptanceStats(
            steps=self.steps + other.steps,
            drafted_tokens=self.drafted_tokens + other.drafted_tokens,
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
            committed_tokens=self.committed_tokens + other.committed_tokens,
            accepted_at_position=[a + b for a, b in zip(pad(self.accepted_at_position), pad(other.accepted_at_position))],
            draft_seconds=self.draft_seconds + other.draft_seconds,
            verify_seconds=self.verify_seconds + other.verify_seconds,
            total_seconds=self.total_seconds + other.total_seconds,
            generator={k: self.generator.get(k, 0) + other.generator.get(k, 0)
                       for k in {**self.generator, **other.generator}},
        )

    __add__ = merge

    # -- derived metrics -----------------------------------------------------------------------
    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward, bonus included (1.0 for plain decoding)."""
        return self.committed_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of steps whose i-th draft was accepted."""
        return [n / self.steps for n in self.accepted_at_position] if self.steps else []

    @property
    def tokens_per_second(self) -> float:
        return self.committed_tokens / self.total_seconds if self.total_seconds else 0.0

    @property
    def overhead_seconds(self) -> float:
        """Wall time spent outside drafting and verification (bookkeeping, stopping, streaming)."""
        return max(0.0, self.total_seconds - self.draft_seconds - self.verify_seconds)

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "committed_tokens": self.committed_tokens,
            "accepted_at_position": list(self.accepted_at_position),
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds,
            "generator": dict(self.generator),
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
            "tokens_per_second": self.tokens_per_second,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceStats":
        keys = ("steps", "drafted_tokens", "accepted_tokens", "committed_tokens", "accepted_at_position",
                "draft_seconds", "verify_seconds", "total_seconds", "generator")
        return cls(**{k: d[k] for k in keys if k in d})

    def summary(self) -> str:
        return (f"{self.tokens_per_second:.1f} tokens/s, mean accepted length {self.mean_accepted_length:.2f}, "
                f"acceptance rate {self.acceptance_rate:.1%} ({self.accepted_tokens}/{self.drafted_tokens} drafts, "
                f"{self.steps} target steps)")


def theoretical_speedup(acceptance_rate: float, k: float, cost_ratio: float) -> float:
    """Expected speedup of speculative decoding (Leviathan et al., 2023, Theorem 3.8).

    ``(1 - a^(k+1)) / ((1 - a) (k c + 1))`` with per-token acceptance ``a``, ``k`` drafts per step
    and ``c`` = cost of one drafting step / cost of one target step.
    """
    a = min(max(acceptance_rate, 0.0), 1.0)
    expected_tokens = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return expected_tokens / (k * cost_ratio + 1)
