"""Benchmark statistics from result rows: the one definition of each figure a report shows.

Pure functions of rows (``results.jsonl``) and ``run.json``; nothing here formats text. Every
acceptance figure is :class:`~specdec.metrics.AcceptanceStats`' own, on the rows' counts merged
(never an average of per-question ratios); "identical" is :class:`~specdec.bench.results.Agreement`.
A speedup divides the times of two rows only when one session timed both
(:func:`~specdec.bench.provenance.same_session`): times taken under another load never meet.
Which method is the reference, and how each kind is treated, comes from
:func:`~specdec.bench.config.method_kind`, never from a method's name. Definitions:
docs/benchmarks.md, "What the columns mean".
"""

from __future__ import annotations

from dataclasses import dataclass

from ..metrics import AcceptanceStats, theoretical_speedup
from ..prompts import SUBTASKS
from .config import MethodKind, method_kind, reference_name
from .provenance import same_session
from .results import OVERALL, Agreement, is_batched, planned_keys, reference_outputs, row_key


# -- the figures -------------------------------------------------------------------------------
def new_tokens(rows: list[dict]) -> int:
    """New tokens of ``rows``: a batch row counts every output in it."""
    return sum(sum(r["new_tokens"]) if isinstance(r["new_tokens"], list) else r["new_tokens"] for r in rows)


def tokens_per_second(rows: list[dict]) -> float:
    """Sum of new tokens / sum of wall seconds (0.0 without seconds)."""
    seconds = sum(r["seconds"] for r in rows)
    return new_tokens(rows) / seconds if seconds else 0.0


def speedup(rows: list[dict], reference_rows: list[dict]) -> float | None:
    """tokens/s of ``rows`` / tokens/s of the reference's rows of the same calls (Spec-Bench's
    definition); None when the reference has no throughput to compare with."""
    base = tokens_per_second(reference_rows)
    return tokens_per_second(rows) / base if base else None


def merged_stats(rows: list[dict]) -> AcceptanceStats | None:
    """The rows' :class:`AcceptanceStats` added up, or None unless every row has them (transformers ran it)."""
    measured = [r["stats"] for r in rows if r.get("stats") is not None]
    if not measured or len(measured) != len(rows):
        return None
    return sum((AcceptanceStats.from_dict(d) for d in measured), AcceptanceStats())


def draft_cost_ratio(stats: AcceptanceStats) -> float | None:
    """c = (draft seconds per drafted token) / (target verify seconds per step), or None if nothing was drafted.

    Leviathan et al.'s c is the cost of one draft-model run relative to one target run; a drafted
    token costs one draft run (or one n-gram lookup), a step costs one target forward."""
    if not stats.drafted_tokens or not stats.steps or stats.verify_seconds <= 0:
        return None
    return (stats.draft_seconds / stats.drafted_tokens) / (stats.verify_seconds / stats.steps)


def median_run(runs: list[dict]) -> dict:
    """The row of one call run ``len(runs)`` times: the run of median wall time (the lower of the two
    middle ones for an even count), with every run's ``seconds_runs`` and whether every run gave the
    same new tokens (``runs_identical``). One run is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    chosen = sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]
    return {**chosen, "seconds_runs": [r["seconds"] for r in runs],
            "runs_identical": all(r["output_ids"] == chosen["output_ids"] for r in runs)}


def counted_mean_accepted_length(generator: str, rows: list[dict]) -> float | None:
    """New tokens / counted target forwards, for methods that transformers runs. A compiled method's
    forwards are not counted (``target_forwards`` null): plain decoding (``baseline``) commits one token
    per forward by definition; for the others it is unknown."""
    if any(r["target_forwards"] is None for r in rows):
        return 1.0 if method_kind(generator).baseline else None
    counted = AcceptanceStats(steps=sum(r["target_forwards"] for r in rows), committed_tokens=new_tokens(rows))
    return counted.mean_accepted_length if counted.steps else None


# -- one method on one group of rows -------------------------------------------------------------
@dataclass
class Summary:
    """One method on one group of rows (a subtask, or ``overall``)."""

    method: str
    generator: str
    subtask: str
    turns: int
    new_tokens: int
    seconds: float
    speedup: float | None
    mean_accepted_length: float | None
    forwards_only: bool  # mean accepted length from counted forwards, no acceptance counts
    stats: AcceptanceStats | None
    agreement: Agreement | None  # outputs against the reference's (None: the reference itself, or sampling)
    reference: bool = False  # the method speedups are measured against

    @property
    def kind(self) -> MethodKind:
        return method_kind(self.generator)

    @property
    def exact_match(self) -> float | None:
        return self.agreement.share if self.agreement is not None else None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.stats.acceptance_rate if self.stats is not None and self.stats.drafted_tokens else None

    @property
    def k_per_step(self) -> float | None:
        return self.stats.drafted_tokens / self.stats.steps if self.stats is not None and self.stats.steps else None

    @property
    def cost_ratio(self) -> float | None:
        return draft_cost_ratio(self.stats) if self.stats is not None else None

    @property
    def theoretical_speedup(self) -> float | None:
        if self.stats is None or not self.stats.steps:
            return None
        c = self.cost_ratio
        return theoretical_speedup(self.stats.acceptance_rate, self.k_per_step, c if c is not None else 0.0)

    @property
    def efficiency(self) -> float | None:
        theory = self.theoretical_speedup
        return self.speedup / theory if self.speedup is not None and theory else None


def summarize(method: str, generator: str, subtask: str, rows: list[dict], baseline: dict, greedy: bool,
              is_reference: bool) -> Summary:
    """``rows``: one method's rows in the group; ``baseline``: (question_id, turn) -> the reference's row."""
    keyed = {(r["question_id"], r["turn"]): r for r in rows}
    shared = [k for k in keyed if k in baseline]
    timed = [k for k in shared if same_session(keyed[k], baseline[k])]  # side by side: one session
    ratio = speedup([keyed[k] for k in timed], [baseline[k] for k in timed]) if timed else None
    stats = merged_stats(rows)
    mean_len = stats.mean_accepted_length if stats is not None else counted_mean_accepted_length(generator, rows)
    agreement = None
    if greedy and shared and not is_reference:
        agreement = Agreement.of((keyed[k]["output_ids"], baseline[k]["output_ids"]) for k in shared)
    return Summary(method, generator, subtask, len(rows), new_tokens(rows), sum(r["seconds"] for r in rows),
                   1.0 if is_reference and shared else ratio, mean_len, stats is None, stats, agreement, is_reference)


def _methods(config: dict) -> list[tuple[str, str]]:
    """(name, generator) of every method, in config order."""
    return [(m["name"] or m["generator"], m["generator"]) for m in config["methods"]]


def summaries(meta: dict, rows: list[dict]) -> list[Summary]:
    """Every method (config order) x every subtask present (Spec-Bench order), then ``overall``."""
    config = meta["config"]
    rows = [r for r in rows if not is_batched(r)]
    greedy = not config["generation"]["do_sample"]
    base_name = reference_name(config)
    present = {r["subtask"] for r in rows}
    groups = [s for s in SUBTASKS if s in present] + [OVERALL]
    out = []
    for name, generator in _methods(config):
        mine = [r for r in rows if r["method"] == name]
        for group in groups:
            in_group = lambda r: group == OVERALL or r["subtask"] == group  # noqa: E731
            base = {(r["question_id"], r["turn"]): r for r in rows if r["method"] == base_name and in_group(r)}
            picked = [r for r in mine if in_group(r)]
            if picked:
                out.append(summarize(name, generator, group, picked, base, greedy, name == base_name))
    return out


def pair_comparisons(meta: dict) -> dict[str, list[tuple[str, str]]]:
    """Our generator -> (ours, transformers') method-name pairs: every reference method whose kind names
    a generator to compare with (``MethodKind.compared_with``) against every method of that generator."""
    methods = meta["config"]["methods"]
    pairs: dict[str, list[tuple[str, str]]] = {}
    for ref in methods:
        ours_generator = method_kind(ref["generator"]).compared_with
        for ours in methods:
            if ours_generator is not None and ours["generator"] == ours_generator:
                pairs.setdefault(ours_generator, []).append((ours["name"], ref["name"]))
    return pairs


def identical_share(rows: list[dict], a: str, b: str) -> float | None:
    """Share of (question, turn) whose outputs of methods ``a`` and ``b`` are equal."""
    pick = lambda name: {(r["question_id"], r["turn"]): r["output_ids"] for r in rows if r["method"] == name}  # noqa: E731
    ours, theirs = pick(a), pick(b)
    return Agreement.of((ours[k], theirs[k]) for k in ours if k in theirs).share


def method_stats(meta: dict, rows: list[dict]) -> dict[str, AcceptanceStats]:
    """Method name -> the stats of all its rows (every batch size) merged, in config order; methods
    whose rows carry no stats (transformers ran them) are left out."""
    out = {}
    for name, _ in _methods(meta["config"]):
        measured = [r["stats"] for r in rows if r["method"] == name and r.get("stats") is not None]
        if measured:
            out[name] = sum((AcceptanceStats.from_dict(d) for d in measured), AcceptanceStats())
    return out


def mean_forward_ms(stats: AcceptanceStats) -> dict[int, float]:
    """Tokens fed -> mean milliseconds per target forward (``stats.forward_costs``), by tokens fed."""
    return {t: 1000.0 * sec / n for t, (n, sec) in sorted(stats.forward_costs.items()) if n}


def planned_keys_of(meta: dict) -> set:
    """The row keys a complete run of this config writes (:func:`~specdec.bench.results.planned_keys`)."""
    config = meta["config"]
    return planned_keys([(m["name"], method_kind(m["generator"]).batched) for m in config["methods"]],
                        [(q["question_id"], q["turns"]) for q in meta["questions"]], batch_sizes_of(config))


def planned_rows(meta: dict) -> int:
    """Rows a complete run of this config writes."""
    return len(planned_keys_of(meta))


def cross_session_pairs(meta: dict, rows: list[dict]) -> int:
    """Rows that share a call with the reference's row but were timed in another session: left out of every
    speedup (a resume by this runner leaves none; hand-joined results may)."""
    base_name = reference_name(meta["config"])
    by_key = {row_key(r): r for r in rows}
    count = 0
    for key, row in by_key.items():
        base = by_key.get((base_name, *key[1:]))
        if key[0] != base_name and base is not None and not same_session(row, base):
            count += 1
    return count


# -- batch sizes -------------------------------------------------------------------------------
def batch_sizes_of(config: dict) -> list[int]:
    """The config's batch sizes (``batch_sizes``, or the older single ``batch_size``)."""
    return list(config.get("batch_sizes") or [config.get("batch_size", 1)])


@dataclass
class BatchSummary:
    """One method at one batch size, over all its batches (or, at size 1, all first turns)."""

    method: str
    generator: str
    batch_size: int
    prompts: int
    new_tokens: int
    seconds: float
    speedup: float | None
    mean_accepted_length: float | None
    exact_match: float | None

    @property
    def kind(self) -> MethodKind:
        return method_kind(self.generator)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def batch_summaries(meta: dict, rows: list[dict]) -> list[BatchSummary]:
    """Every method (config order) x every batch size (config order) it ran at."""
    config = meta["config"]
    greedy = not config["generation"]["do_sample"]
    base_name = reference_name(config)
    singles = [r for r in rows if not is_batched(r) and int(r["turn"]) == 1]
    by_key = {row_key(r): r for r in rows}
    out = []
    for size in batch_sizes_of(config):
        if size == 1:
            out += _size_one_summaries(_methods(config), singles, base_name, greedy)
            continue
        batched = [r for r in rows if is_batched(r) and int(r["batch_size"]) == size]
        base = {r["batch_index"]: r for r in batched if r["method"] == base_name}
        for name, generator in _methods(config):
            mine = {r["batch_index"]: r for r in batched if r["method"] == name}
            if mine:
                agreement = None if not greedy else Agreement.of(
                    pair for r in mine.values() for pair in zip(r["output_ids"], reference_outputs(r, by_key, base_name)))
                out.append(_batched_summary(name, generator, size, mine, base, agreement))
    return out


def _size_one_summaries(methods: list[tuple[str, str]], singles: list[dict], base_name: str,
                        greedy: bool) -> list[BatchSummary]:
    """The batch-size-1 column: each method over the first turns of its per-question rows."""
    base = {(r["question_id"], 1): r for r in singles if r["method"] == base_name}
    out = []
    for name, generator in methods:
        mine = [r for r in singles if r["method"] == name]
        if mine:
            s = summarize(name, generator, "first turns", mine, base, greedy, name == base_name)
            out.append(BatchSummary(name, generator, 1, len(mine), s.new_tokens, s.seconds, s.speedup,
                                    s.mean_accepted_length, s.exact_match))
    return out


def _batched_summary(name: str, generator: str, size: int, mine: dict[int, dict], base: dict[int, dict],
                     agreement: Agreement | None) -> BatchSummary:
    """One method at one batch size > 1. ``mine``, ``base``: batch index -> row of this method, of the
    reference; ``agreement``: its outputs against :func:`~specdec.bench.results.reference_outputs`
    (None when sampling: no exact match)."""
    shared = [i for i in mine if i in base and same_session(mine[i], base[i])]  # side by side: one session
    ratio = speedup([mine[i] for i in shared], [base[i] for i in shared]) if shared else None
    if method_kind(generator).baseline:
        mean_len = 1.0  # plain decoding commits one token per row per forward
    else:
        stats = merged_stats(list(mine.values()))
        mean_len = stats.mean_accepted_length if stats is not None else None
    rows = list(mine.values())
    return BatchSummary(name, generator, size, sum(len(r["question_ids"]) for r in rows), new_tokens(rows),
                        sum(r["seconds"] for r in rows), ratio, mean_len,
                        agreement.share if agreement is not None else None)
