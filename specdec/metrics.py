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
    #: [k] row-steps that verified k drafts (the chosen draft lengths)
    drafts_verified: list[int] = field(default_factory=list)
    #: row-steps where the cost-aware policy chose no drafts (drafting skipped): it asked for
    #: none, or verified none of those offered
    skipped_steps: int = 0
    #: target forwards by tokens fed (width x batch): {tokens: [forwards, seconds]}, prefill excluded
    forward_costs: dict[int, list[float]] = field(default_factory=dict)
    #: seconds spent calibrating the forward-cost model (once per model and process)
    calibration_seconds: float = 0.0
    #: seconds of forwards that compiled a graph (the first of each compiled shape in the process),
    #: packed a model's weights (``engines/forwards/packed.py``, once per model) or decided its direct
    #: forward (``engines/forwards/direct.py``, once per model)
    compile_seconds: float = 0.0
    #: one-time choices made for the call and why, e.g. {"weights": "w8a8", "weights_choice": "..."}
    choices: dict[str, str] = field(default_factory=dict)
    #: seconds spent applying the call's logits processors (target scores, drafts, forbidden lookups)
    processor_seconds: float = 0.0
    #: a distributed call's messages between ranks: {messages, bytes, seconds, steps} (specdec/distributed/)
    coordination: dict[str, float] = field(default_factory=dict)
    #: of the drafted and accepted tokens, the grammar's own drafts (specdec/grammar.py)
    grammar_drafts: int = 0
    grammar_accepted: int = 0
    #: row-steps that verified a token tree, its nodes and the depth accepted (docs/trees.md); such a
    #: step also counts its nodes as drafted tokens and its depth as accepted ones above
    tree_steps: int = 0
    tree_nodes: int = 0
    tree_depth: int = 0

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
            if d >= len(self.drafts_verified):
                self.drafts_verified.extend([0] * (d + 1 - len(self.drafts_verified)))
            self.drafts_verified[d] += 1

    def record_grammar(self, grammar: list[int], drafted: list[int], accepted: list[int]) -> None:
        """Of one forward's drafts per row, the last ``grammar`` were the grammar's own (forced or suggested)."""
        for f, d, a in zip(grammar, drafted, accepted):
            self.grammar_drafts += f
            self.grammar_accepted += max(0, a - (d - f))

    def record_tree(self, nodes: list[int], depth: list[int]) -> None:
        """One tree forward's nodes and accepted depth per row (``record_step`` counted them as drafts)."""
        self.tree_steps += len(nodes)
        self.tree_nodes += sum(nodes)
        self.tree_depth += sum(depth)

    def record_forward(self, tokens: int, seconds: float) -> None:
        """One target forward (not the prefill) that fed ``tokens`` took ``seconds``."""
        entry = self.forward_costs.setdefault(int(tokens), [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        return AcceptanceStats(
            steps=self.steps + other.steps,
            drafted_tokens=self.drafted_tokens + other.drafted_tokens,
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
            committed_tokens=self.committed_tokens + other.committed_tokens,
            accepted_at_position=_add_lists(self.accepted_at_position, other.accepted_at_position),
            draft_seconds=self.draft_seconds + other.draft_seconds,
            verify_seconds=self.verify_seconds + other.verify_seconds,
            total_seconds=self.total_seconds + other.total_seconds,
            generator=_add_dicts(self.generator, other.generator, 0),
            drafts_verified=_add_lists(self.drafts_verified, other.drafts_verified),
            skipped_steps=self.skipped_steps + other.skipped_steps,
            forward_costs=_add_dicts(self.forward_costs, other.forward_costs, [0, 0.0]),
            calibration_seconds=self.calibration_seconds + other.calibration_seconds,
            compile_seconds=self.compile_seconds + other.compile_seconds,
            choices={**other.choices, **self.choices},
            processor_seconds=self.processor_seconds + other.processor_seconds,
            coordination=_add_dicts(self.coordination, other.coordination, 0),
            grammar_drafts=self.grammar_drafts + other.grammar_drafts,
            grammar_accepted=self.grammar_accepted + other.grammar_accepted,
            tree_steps=self.tree_steps + other.tree_steps,
            tree_nodes=self.tree_nodes + other.tree_nodes,
            tree_depth=self.tree_depth + other.tree_depth,
        )

    __add__ = merge

    # -- derived metrics -----------------------------------------------------------------------
    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward, bonus included (1.0 for plain decoding)."""
        return self.committed_tokens / self.steps if self.steps else 0.0

    @property
    def skipped_share(self) -> float:
        """Share of row-steps where the policy skipped drafting (0.0 with no steps)."""
        return self.skipped_steps / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def grammar_share(self) -> float:
        """Share of committed tokens that were the grammar's own drafts (accepted by the target)."""
        return self.grammar_accepted / self.committed_tokens if self.committed_tokens else 0.0

    @property
    def drafter_acceptance_rate(self) -> float:
        """Acceptance rate of the drafts that were not the grammar's (the generator's)."""
        drafted = self.drafted_tokens - self.grammar_drafts
        return (self.accepted_tokens - self.grammar_accepted) / drafted if drafted else 0.0

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
            "drafts_verified": list(self.drafts_verified),
            "skipped_steps": self.skipped_steps,
            "skipped_share": self.skipped_share,
            "forward_costs": {str(t): list(v) for t, v in sorted(self.forward_costs.items())},
            "calibration_seconds": self.calibration_seconds,
            "compile_seconds": self.compile_seconds,
            "one_time_seconds": self.one_time_seconds,
            "decoding_tokens_per_second": self.decoding_tokens_per_second,
            "choices": dict(self.choices),
            "processor_seconds": self.processor_seconds,
            **({"coordination": dict(self.coordination)} if self.coordination else {}),  # distributed calls only
            **({"grammar_drafts": self.grammar_drafts, "grammar_accepted": self.grammar_accepted,
                "grammar_share": self.grammar_share, "drafter_acceptance_rate": self.drafter_acceptance_rate}
               if self.grammar_drafts else {}),  # grammar-constrained calls only
            **({"tree_steps": self.tree_steps, "tree_nodes": self.tree_nodes, "tree_depth": self.tree_depth}
               if self.tree_steps else {}),  # calls that verified token trees only
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
            "tokens_per_second": self.tokens_per_second,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceStats":
        keys = ("steps", "drafted_tokens", "accepted_tokens", "committed_tokens", "accepted_at_position",
                "draft_seconds", "verify_seconds", "total_seconds", "generator", "drafts_verified",
                "skipped_steps", "calibration_seconds", "compile_seconds", "choices", "processor_seconds", "coordination",
                "grammar_drafts", "grammar_accepted", "tree_steps", "tree_nodes", "tree_depth")
        stats = cls(**{k: d[k] for k in keys if k in d})
        stats.forward_costs = {int(t): list(v) for t, v in d.get("forward_costs", {}).items()}
        return stats

    @property
    def one_time_seconds(self) -> float:
        """Seconds of the call spent on work done once (per process, model or machine), not on
        decoding: calibrating the policy's costs, compiling, and the generator's setup (building
        or choosing a draft copy: ``generator["setup_seconds"]``)."""
        return self.calibration_seconds + self.compile_seconds + float(self.generator.get("setup_seconds", 0.0))

    @property
    def decoding_tokens_per_second(self) -> float:
        """Committed tokens per second of decoding, the one-time work left out: what a later call runs at."""
        seconds = self.total_seconds - self.one_time_seconds
        return self.committed_tokens / seconds if seconds > 0 else 0.0

    def summary(self) -> str:
        """One line: the decoding speed, the drafts' record, and any one-time work apart."""
        line = (f"{self.decoding_tokens_per_second:.1f} tokens/s, mean accepted length {self.mean_accepted_length:.2f}, "
                f"acceptance rate {self.acceptance_rate:.1%} ({self.accepted_tokens}/{self.drafted_tokens} drafts, "
                f"{self.steps} target steps)")
        return line + (f"; {self.one_time_summary()}" if self.one_time_seconds > 0.005 else "")

    def one_time_summary(self) -> str:
        """The one-time work of the call, e.g. ``one-time 3.1 s (calibration 1.2 s, setup 1.9 s): 7.4 tokens/s
        with it``."""
        parts = [(name, seconds) for name, seconds in (
            ("calibration", self.calibration_seconds), ("compiling/packing", self.compile_seconds),
            ("setup", float(self.generator.get("setup_seconds", 0.0)))) if seconds > 0.005]
        inner = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in parts)
        return f"one-time {self.one_time_seconds:.1f} s ({inner}): {self.tokens_per_second:.1f} tokens/s with it"


def _add_lists(a: list, b: list) -> list:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(list(a) + [0] * (n - len(a)), list(b) + [0] * (n - len(b)))]


def _add_dicts(a: dict, b: dict, zero):
    """Key-wise sum; values are numbers or equal-length lists of numbers."""
    add = (lambda x, y: x + y) if not isinstance(zero, list) else _add_lists
    return {k: add(a.get(k, zero), b.get(k, zero)) for k in {**a, **b}}


def theoretical_speedup(acceptance_rate: float, k: float, cost_ratio: float) -> float:
    """Expected speedup of speculative decoding (Leviathan et al., 2023, Theorem 3.8).

    ``(1 - a^(k+1)) / ((1 - a) (k c + 1))`` with per-token acceptance ``a``, ``k`` drafts per step
    and ``c`` = cost of one drafting step / cost of one target step.
    """
    a = min(max(acceptance_rate, 0.0), 1.0)
    expected_tokens = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return expected_tokens / (k * cost_ratio + 1)
