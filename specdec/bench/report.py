"""Benchmark report: ``results.jsonl`` + ``run.json`` -> ``report.md`` and PNG plots.

The same code runs at the end of ``specdec bench CONFIG`` and for ``specdec bench report DIR``,
so a report can always be rebuilt from the JSON lines alone.

Groups are method x subtask, and method x all ("overall"). In a group, over the rows present:

* tokens/s = sum of new tokens / sum of wall seconds;
* speedup = tokens/s of the method / tokens/s of the reference (the config's ``baseline`` method, or
  the one ``reference`` names), both over the (question, turn) keys that both have (Spec-Bench's
  definition; with identical outputs it equals the ratio of total reference time to total method
  time);
* mean accepted length, acceptance rate, per-position acceptance: the rows'
  :class:`~specdec.metrics.AcceptanceStats` merged (SpecDecoder methods). Methods that
  ``transformers`` runs expose no acceptance counts: their mean accepted length is
  ``AcceptanceStats(steps=target forwards, committed_tokens=new tokens).mean_accepted_length``
  (forwards counted by a hook; compiled forwards bypass hooks, so a compiled ``baseline`` gets
  plain decoding's 1.0 and another compiled reference method n/a) and the acceptance rate is n/a;
* K = drafted tokens / steps; c = :func:`draft_cost_ratio`; theoretical speedup =
  :func:`specdec.metrics.theoretical_speedup` (a = acceptance rate, K, c); efficiency = speedup /
  theoretical speedup;
* exact match = share of keys whose new token ids equal the reference's; identical count and the
  first position where the others differ (earliest, median) in "Identical to the reference"; all
  from :class:`~specdec.bench.results.Agreement` (greedy only; n/a when sampling).

"Warm-up (compile) seconds": per method that compiles, the seconds its compile warm-up took in
each session (``run.json``), which no tokens/s includes.

"Draft lengths chosen" shows, per drafting method over the same rows as the overall table, the
merged stats' mean K (drafted tokens / steps, as in the tables), the K distribution
(``AcceptanceStats.drafts_verified`` [k] / steps), the share of row-steps that skipped drafting
(``AcceptanceStats.skipped_share``), and the seconds spent calibrating the cost model (summed over
all the method's rows, batches included). ``forward_cost.png`` draws the measured cost curve: mean
milliseconds per target forward against tokens fed (width x batch; ``AcceptanceStats.forward_costs``
of all the method's rows, batches included, so batched runs extend the curve). Rows written before
these counters existed carry none: the section and the plot leave them out.

Batch sizes > 1 (rows with ``batch_size``) are kept out of the tables above and summarized in
"throughput by batch size": per method and batch size, tokens/s = total real new tokens / total
batch wall time; speedup over the batched ``baseline`` at the same batch size (same batches);
mean accepted length from the merged ``AcceptanceStats`` (1.0 for ``baseline`` by definition);
exact match per row against the batch-size-1 ``baseline`` output of the same question when that
run has it (decoding the row alone), else against the batched ``baseline`` row. The batch-size-1
column is computed from the first turns of the per-question rows, so every column covers the
same prompts.

Nothing here redefines a metric that ``specdec.metrics`` defines, and nothing tests a method's
name: which method is the baseline, which run in batches and which are set side by side with
transformers' come from :func:`specdec.bench.config.method_kind`. Plots need matplotlib (the
``bench`` extra); without it report.md is written alone.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..metrics import AcceptanceStats, theoretical_speedup
from ..prompts import SUBTASKS
from .config import MethodKind, method_kind, reference_name
from .plots import plot_acceptance, plot_forward_cost, plot_speedup
from .results import (OVERALL, ACCEPTANCE_PNG, FORWARD_COST_PNG, REPORT_FILE, RESULTS_FILE, RUN_FILE, SPEEDUP_PNG, Agreement,
                      ResultStore, is_batched, planned_keys, reference_outputs, row_key)

MAX_POSITIONS = 16  # per-position columns shown in the table
NA = "n/a"
INSTALL_PLOTS = 'pip install "specdec[bench]"'
PLOTS_NEED_MATPLOTLIB = f"matplotlib is not installed: report.md is written without plots (plots need {INSTALL_PLOTS})"


def plots_available() -> bool:
    """Whether matplotlib imports (the ``bench`` extra); without it the report has no plots."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def draft_cost_ratio(stats: AcceptanceStats) -> float | None:
    """c = (draft seconds per drafted token) / (target verify seconds per step), or None if nothing was drafted.

    Leviathan et al.'s c is the cost of one draft-model run relative to one target run; a drafted
    token costs one draft run (or one n-gram lookup), a step costs one target forward.
    """
    if not stats.drafted_tokens or not stats.steps or stats.verify_seconds <= 0:
        return None
    return (stats.draft_seconds / stats.drafted_tokens) / (stats.verify_seconds / stats.steps)


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


# -- aggregation (pure) ------------------------------------------------------------------------
def _throughput(rows: list[dict]) -> float:
    seconds = sum(r["seconds"] for r in rows)
    return sum(r["new_tokens"] for r in rows) / seconds if seconds else 0.0


def summarize(method: str, generator: str, subtask: str, rows: list[dict], baseline: dict, greedy: bool,
              is_reference: bool) -> Summary:
    """``rows``: one method's rows in the group; ``baseline``: (question_id, turn) -> the reference's row."""
    keyed = {(r["question_id"], r["turn"]): r for r in rows}
    shared = [k for k in keyed if k in baseline]
    speedup = None
    if shared:
        base = _throughput([baseline[k] for k in shared])
        speedup = _throughput([keyed[k] for k in shared]) / base if base else None
    measured = [r["stats"] for r in rows if r.get("stats") is not None]
    stats = None
    if measured and len(measured) == len(rows):
        stats = AcceptanceStats()
        for d in measured:
            stats = stats.merge(AcceptanceStats.from_dict(d))
        mean_len = stats.mean_accepted_length
    else:  # transformers ran it: count target forwards
        mean_len = _counted_mean_accepted_length(generator, rows)
    agreement = None
    if greedy and shared and not is_reference:
        agreement = Agreement.of((keyed[k]["output_ids"], baseline[k]["output_ids"]) for k in shared)
    return Summary(method, generator, subtask, len(rows), sum(r["new_tokens"] for r in rows),
                   sum(r["seconds"] for r in rows), 1.0 if is_reference and shared else speedup, mean_len,
                   stats is None, stats, agreement, is_reference)


def _counted_mean_accepted_length(generator: str, rows: list[dict]) -> float | None:
    """New tokens / counted target forwards, for methods that transformers runs. A compiled method's
    forwards are not counted (``target_forwards`` null): plain decoding (``baseline``) commits one token
    per forward by definition; for the others it is unknown."""
    if any(r["target_forwards"] is None for r in rows):
        return 1.0 if method_kind(generator).baseline else None
    counted = AcceptanceStats(steps=sum(r["target_forwards"] for r in rows),
                              committed_tokens=sum(r["new_tokens"] for r in rows))
    return counted.mean_accepted_length if counted.steps else None


def summaries(meta: dict, rows: list[dict]) -> list[Summary]:
    """Every method (config order) x every subtask present (Spec-Bench order), then ``overall``."""
    config = meta["config"]
    rows = [r for r in rows if not is_batched(r)]
    greedy = not config["generation"]["do_sample"]
    methods = [(m["name"] or m["generator"], m["generator"]) for m in config["methods"]]
    base_name = reference_name(config)
    present = {r["subtask"] for r in rows}
    groups = [s for s in SUBTASKS if s in present] + [OVERALL]
    out = []
    for name, generator in methods:
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


def method_stats(meta: dict, rows: list[dict]) -> dict[str, AcceptanceStats]:
    """Method name -> the stats of all its rows (every batch size) merged, in config order; methods
    whose rows carry no stats (transformers ran them) are left out."""
    out = {}
    for m in meta["config"]["methods"]:
        name = m["name"] or m["generator"]
        measured = [r["stats"] for r in rows if r["method"] == name and r.get("stats") is not None]
        if measured:
            out[name] = sum((AcceptanceStats.from_dict(d) for d in measured), AcceptanceStats())
    return out


def k_distribution(stats: AcceptanceStats, shown: int = MAX_POSITIONS) -> str:
    """``"K: share, ..."``: every draft length verified at least once, as a share of row-steps
    (``drafts_verified[k] / steps``); lengths from ``shown`` up are folded into one entry."""
    if not stats.steps or not stats.drafts_verified:
        return NA
    counts = stats.drafts_verified
    parts = [f"{k}: {n / stats.steps:.0%}" for k, n in enumerate(counts[:shown]) if n]
    if sum(counts[shown:]):
        parts.append(f"≥{shown}: {sum(counts[shown:]) / stats.steps:.0%}")
    return ", ".join(parts)


def mean_forward_ms(stats: AcceptanceStats) -> dict[int, float]:
    """Tokens fed -> mean milliseconds per target forward (``stats.forward_costs``), by tokens fed."""
    return {t: 1000.0 * sec / n for t, (n, sec) in sorted(stats.forward_costs.items()) if n}


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
    methods = [(m["name"] or m["generator"], m["generator"]) for m in config["methods"]]
    base_name = reference_name(config)
    singles = [r for r in rows if not is_batched(r) and int(r["turn"]) == 1]
    by_key = {row_key(r): r for r in rows}
    out = []
    for size in batch_sizes_of(config):
        if size == 1:
            out += _size_one_summaries(methods, singles, base_name, greedy)
            continue
        batched = [r for r in rows if is_batched(r) and int(r["batch_size"]) == size]
        base = {r["batch_index"]: r for r in batched if r["method"] == base_name}
        for name, generator in methods:
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
    kind = method_kind(generator)
    tokens = lambda rs: sum(sum(r["new_tokens"]) for r in rs)  # noqa: E731
    seconds = lambda rs: sum(r["seconds"] for r in rs)  # noqa: E731
    shared = [i for i in mine if i in base]
    speedup = None
    if shared and seconds([base[i] for i in shared]) and tokens([base[i] for i in shared]):
        speedup = ((tokens([mine[i] for i in shared]) / seconds([mine[i] for i in shared]))
                   / (tokens([base[i] for i in shared]) / seconds([base[i] for i in shared])))
    measured = [r["stats"] for r in mine.values() if r.get("stats") is not None]
    mean_len = None
    if kind.baseline:
        mean_len = 1.0  # plain decoding commits one token per row per forward
    elif measured and len(measured) == len(mine):
        stats = AcceptanceStats()
        for d in measured:
            stats = stats.merge(AcceptanceStats.from_dict(d))
        mean_len = stats.mean_accepted_length
    return BatchSummary(name, generator, size, sum(len(r["question_ids"]) for r in mine.values()),
                        tokens(mine.values()), seconds(mine.values()), speedup, mean_len,
                        agreement.share if agreement is not None else None)


def gain_ends(batch: list[BatchSummary]) -> list[str]:
    """One sentence per drafting method: the batch sizes where it beats batched decoding, and where that ends."""
    lines = []
    for method in dict.fromkeys(b.method for b in batch if not b.kind.baseline):
        points = sorted((b.batch_size, b.speedup) for b in batch if b.method == method and b.speedup is not None)
        if not any(size > 1 for size, _ in points):
            continue  # not run in batches (hf_*), or no batched baseline to compare with
        shown = ", ".join(f"{size}: {speedup:.2f}x" for size, speedup in points)
        ends = next((size for size, speedup in points if speedup <= 1.0), None)
        if ends is None:
            what = f"faster than the batched baseline at every batch size measured (largest: {points[-1][0]})"
        elif all(speedup <= 1.0 for _, speedup in points):
            what = "no faster than the batched baseline at any batch size measured"
        elif ends == points[0][0]:
            what = f"no faster than the batched baseline at batch size {ends}"
        else:
            last = max(size for size, speedup in points if size < ends)
            what = f"the gain ends between batch size {last} and {ends}"
        lines.append(f"- `{method}`: {what} (speedup by batch size: {shown}).")
    return lines


def planned_rows(meta: dict) -> int:
    """Rows a complete run of this config writes."""
    config = meta["config"]
    return len(planned_keys([(m["name"], method_kind(m["generator"]).batched) for m in config["methods"]],
                            [(q["question_id"], q["turns"]) for q in meta["questions"]], batch_sizes_of(config)))


# -- rendering ---------------------------------------------------------------------------------
def _f(value: float | None, fmt: str, suffix: str = "") -> str:
    return NA if value is None else f"{value:{fmt}}{suffix}"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in body]


def _metric_cells(s: Summary) -> list[str]:
    dash, baseline = "—", s.kind.baseline
    return [
        str(s.turns), str(s.new_tokens), _f(s.tokens_per_second, ".1f"), _f(s.speedup, ".2f", "x"),
        _f(s.mean_accepted_length, ".2f", "†" if s.forwards_only and s.mean_accepted_length is not None else ""),
        dash if baseline else _f(s.acceptance_rate, ".1%"),
        dash if baseline else _f(s.k_per_step, ".2f"),
        dash if baseline else _f(s.cost_ratio, ".3f"),
        dash if baseline else _f(s.theoretical_speedup, ".2f", "x"),
        dash if baseline else _f(s.efficiency, ".0%"),
        "ref" if s.reference else _f(s.exact_match, ".0%"),
    ]


METRIC_HEADER = ["turns", "new tokens", "tokens/s", "speedup", "mean accepted length", "acceptance rate",
                 "drafts/step K", "draft cost c", "theoretical speedup", "efficiency", "exact match"]


def _header(meta: dict, rows: list[dict]) -> list[str]:
    """Title, description, and what was run where: command, target, dataset, machine, rows, methods."""
    config, env = meta["config"], meta.get("environment", {})
    gen, methods, sizes = config["generation"], config["methods"], batch_sizes_of(config)
    total = planned_rows(meta)
    done = len({row_key(r) for r in rows})
    per_subtask: dict[str, int] = {}
    for q in meta["questions"]:
        per_subtask[q["subtask"]] = per_subtask.get(q["subtask"], 0) + 1
    placed = f"{config.get('dtype', 'float32')} on {env.get('device', 'cpu')}"
    mode = ("greedy" if not gen["do_sample"] else
            f"sampling (temperature {gen['temperature']}, top_k {gen['top_k']}, top_p {gen['top_p']}, seed {gen['seed']})")
    batched = [str(b) for b in sizes if b > 1]
    out = [f"# Benchmark `{Path(meta['config_file']).stem}`", ""]
    if config.get("description"):
        out += [config["description"].strip(), ""]
    return out + [
        f"- Command: `specdec bench {meta['config_file']}`; rebuild this page from the JSON lines with "
        f"`specdec bench report <this directory>`.",
        f"- Target: `{config['target']}` ({placed}). Dataset: {len(meta['questions'])} questions "
        f"({', '.join(f'{k} {v}' for k, v in per_subtask.items())}), {sum(q['turns'] for q in meta['questions'])} turns; "
        f"{mode}, max_new_tokens {gen['max_new_tokens']}.",
        f"- Machine: {env.get('platform', '?')}, {env.get('processor', '?')}, {env.get('cpu_count', '?')} CPUs "
        f"({env.get('device', 'cpu')}{', ' + env['gpu'] if env.get('gpu') else ''}), torch {env.get('torch', '?')} "
        f"with {config['threads']} threads, "
        f"transformers {env.get('transformers', '?')}, specdec {env.get('specdec', '?')}. Started {meta.get('created', '?')}.",
        f"- Rows: {done} of {total} (method x question x turn"
        + (f"; method x batch at batch sizes {', '.join(batched)})" if batched else ")")
        + ("." if done >= total else " — **incomplete run**: rerun the command to resume."),
        "- Methods, interleaved per question after one warm-up each"
        + (f", each call run {config['repeats']} times (rows keep the run of median time)"
           if config.get("repeats", 1) > 1 else "") + ": "
        + "; ".join(f"`{m['name']}` = {m['generator']}" + (f" {m['options']}" if m["options"] else "")
                    + (f" draft `{m['draft']}`" if m.get("draft") else "") + _cache_words(m) for m in methods) + ".",
        f"- Reference (speedup 1.00x, exact match `ref`): `{reference_name(config)}`.",
    ]


def _cache_words(method: dict) -> str:
    """How a method keeps its cache and computes its output layer, in words (nothing for the defaults)."""
    compile = method.get("compile", False)
    words = "" if method.get("fast_head", True) else ", the model's own output layer (fast_head: false)"
    if method.get("cache_implementation", "dynamic") == "dynamic" and compile is False:
        return words
    words = f", {method['cache_implementation']} cache" + words
    if compile is not False:
        words += ", compiled" + (f" {compile}" if isinstance(compile, dict) and compile else "")
    return words


def _subtask_tables(meta: dict, all_summaries: list[Summary], subtasks: list[str]) -> list[str]:
    """Overall, speedup by subtask, per subtask, and per-position acceptance (when any method drafted)."""
    overall = [s for s in all_summaries if s.subtask == OVERALL]
    by = {(s.method, s.subtask): s for s in all_summaries}
    out = ["", "## Overall", ""]
    out += _table(["method"] + METRIC_HEADER, [[f"`{s.method}`"] + _metric_cells(s) for s in overall])
    out += _identical_section(meta, overall)
    out += ["", "## Speedup over baseline by subtask", ""]
    out += _table(["method"] + subtasks + [OVERALL],
                  [[f"`{m['name']}`"] + [_f(by[(m["name"], g)].speedup, ".2f", "x") if (m["name"], g) in by else NA
                                         for g in subtasks + [OVERALL]] for m in meta["config"]["methods"]])
    out += ["", "## Per subtask", ""]
    out += _table(["subtask", "method"] + METRIC_HEADER,
                  [[g, f"`{s.method}`"] + _metric_cells(s) for g in subtasks for s in all_summaries if s.subtask == g])
    measured = [s for s in overall if s.stats is not None and s.stats.accepted_at_position]
    if measured:
        width = min(MAX_POSITIONS, max(len(s.stats.per_position_acceptance) for s in measured))
        out += ["", "## Acceptance by draft position (overall)", "",
                "Share of target steps whose i-th draft was accepted (`AcceptanceStats.per_position_acceptance`).", ""]
        out += _table(["method"] + [str(i + 1) for i in range(width)],
                      [[f"`{s.method}`"] + [f"{v:.2f}" for v in (s.stats.per_position_acceptance + [0.0] * width)[:width]]
                       for s in measured])
    return out


def _identical_section(meta: dict, overall: list[Summary]) -> list[str]:
    """Per method: outputs identical to the reference's, and where the others first differ (greedy only)."""
    compared = [s for s in overall if s.agreement is not None and s.agreement.compared]
    if not compared:
        return []
    out = ["", "## Identical to the reference", "",
           f"Rows (question, turn) whose new token ids equal `{reference_name(meta['config'])}`'s, of the rows both "
           "have; for the rows that differ, the first position where they do (0 = the first new token; "
           "`first_difference` in results.jsonl), earliest and median.", ""]
    body = [[f"`{s.method}`", f"{s.agreement.identical} of {s.agreement.compared}", _f(s.agreement.earliest, "d"),
             _f(s.agreement.median, "g")] for s in compared]
    return out + _table(["method", "identical", "first difference: earliest", "median"], body)


def _warmup_section(meta: dict) -> list[str]:
    """Seconds each compiled method spent compiling before the timed runs, per session."""
    sessions = [s.get("warmup_seconds") or {} for s in meta.get("sessions", [])]
    names = [m["name"] for m in meta["config"]["methods"] if any(m["name"] in s for s in sessions)]
    if not names:
        return []
    out = ["", "## Warm-up (compile) seconds", "",
           "Compiling each compiled method before the first timed call (every batch size it decodes, caches as long "
           "as the run's longest call); no tokens/s above includes it. One value per session: a resumed run "
           "compiles again.", ""]
    body = [[f"`{n}`", ", ".join(_f(s.get(n), ".1f", " s") for s in sessions if n in s)] for n in names]
    return out + _table(["method", "warm-up (compile)"], body)


def _draft_lengths_section(meta: dict, rows: list[dict], all_summaries: list[Summary],
                           figures: list[str]) -> list[str]:
    """Per drafting method: mean K, the K distribution, the skipped-drafting share, calibration time."""
    drafting = [s for s in all_summaries if s.subtask == OVERALL and s.stats is not None and s.stats.steps]
    if not any(s.stats.drafts_verified for s in drafting):
        return []  # nothing drafted, or rows written before the chosen draft lengths were recorded
    every_row = method_stats(meta, rows)
    out = ["", "## Draft lengths chosen", "",
           "Over the rows of the overall table: mean K = drafts per step; K distribution = share of row-steps that "
           "verified K drafts (`AcceptanceStats.drafts_verified`); drafting skipped = share of row-steps where the "
           "draft-length policy chose no drafts: asked for none, or verified none of those offered "
           "(`AcceptanceStats.skipped_share`); calibration = seconds spent measuring the target's forward costs, "
           "over all the method's rows.", ""]
    body = [[f"`{s.method}`", _f(s.k_per_step, ".2f"), f"{s.stats.skipped_share:.1%}", k_distribution(s.stats),
             _f(every_row[s.method].calibration_seconds if s.method in every_row else None, ".2f", " s")]
            for s in drafting]
    out += _table(["method", "mean K", "drafting skipped", "K distribution", "calibration"], body)
    if FORWARD_COST_PNG in figures:
        out += ["", f"Measured cost curve (mean time per target forward against tokens fed): "
                    f"[{FORWARD_COST_PNG}]({FORWARD_COST_PNG})."]
    return out


def _batch_cell(b: BatchSummary | None, size: int, kind: MethodKind, reference: bool) -> str:
    if b is None:
        return "not run" if size > 1 and not kind.batched else NA
    exact = "ref" if b.exact_match is None and reference else _f(b.exact_match, ".0%")
    return (f"{b.tokens_per_second:.1f} tok/s; {_f(b.speedup, '.2f', 'x')}; {_f(b.mean_accepted_length, '.2f')}; "
            f"{exact}")


def _batch_section(meta: dict, rows: list[dict]) -> list[str]:
    """Throughput by batch size (only when a size > 1 was configured) and where each method's gain ends."""
    config = meta["config"]
    methods, sizes, base_name = config["methods"], batch_sizes_of(config), reference_name(config)
    if not any(b > 1 for b in sizes):
        return []
    batch = batch_summaries(meta, rows)
    out = ["", "## Throughput by batch size", "",
           "First turns only, the same prompts in every column, grouped in order into left-padded batches. "
           "Each cell: tokens/s; speedup over `" + base_name + "` at the same batch size (batched "
           "`target.generate`); mean accepted length; exact match per row against decoding the row alone "
           "(the batch-size-1 `" + base_name + "` output; against the batched `" + base_name
           + "` when batch size 1 was not run).", ""]
    bb = {(b.method, b.batch_size): b for b in batch}
    body = [[f"`{m['name']}`"] + [_batch_cell(bb.get((m["name"], size)), size, method_kind(m["generator"]),
                                              m["name"] == base_name) for size in sizes] for m in methods]
    out += _table(["method"] + [f"batch {s}" for s in sizes], body)
    ends = gain_ends(batch)
    if ends:
        out += ["", "Where the gain ends:", ""] + ends
    return out


def _pairs_section(meta: dict, rows: list[dict], all_summaries: list[Summary], subtasks: list[str]) -> list[str]:
    """Our implementation of an algorithm against transformers' (``MethodKind.compared_with``), per subtask."""
    by = {(s.method, s.subtask): s for s in all_summaries}
    out = []
    for generator, pairs in pair_comparisons(meta).items():
        label = generator.replace("_", " ")
        out += ["", f"## Our {label} vs transformers' {label}", "",
                "Same prompts. Each cell: our tokens/s / transformers' tokens/s (above 1.00x: ours is faster). "
                "identical = share of (question, turn) whose outputs are token-for-token equal.", ""]
        body = []
        for ours, hf in pairs:
            cells = []
            for g in subtasks + [OVERALL]:
                a, b = by.get((ours, g)), by.get((hf, g))
                ok = a is not None and b is not None and b.tokens_per_second
                cells.append(_f(a.tokens_per_second / b.tokens_per_second if ok else None, ".2f", "x"))
            body.append([f"`{ours}` / `{hf}`"] + cells + [_f(_identical_share(rows, ours, hf), ".0%")])
        out += _table(["ours / transformers"] + subtasks + [OVERALL, "identical"], body)
    return out


def _notes(meta: dict, figures: list[str], plots_skipped: bool) -> list[str]:
    config = meta["config"]
    out = ["", "## Notes", "",
           "- Definitions and formulas: `docs/benchmarks.md` (every metric comes from `specdec.metrics`).",
           "- † mean accepted length from counted target forwards (new tokens / forwards): transformers runs this "
           "method and exposes no acceptance counts, so its acceptance rate, K, c and theoretical speedup are n/a.",
           "- Theoretical speedup: Leviathan et al. (1 - a^(K+1)) / ((1 - a)(K c + 1)) with the measured acceptance "
           "rate a, drafts per step K and draft cost c; efficiency = measured speedup / theoretical speedup."]
    compiled = [m["name"] for m in config["methods"] if m.get("compile", False) is not False]
    if compiled:
        out.append(f"- Compiled: {', '.join(f'`{n}`' for n in compiled)}. Compiled forwards bypass module hooks, so "
                   "their target forwards are not counted (a compiled `baseline` shows plain decoding's 1.00 mean "
                   "accepted length by definition); compiling happened before the first timed call (\"Warm-up "
                   "(compile) seconds\") and is in no tokens/s.")
    if config["generation"]["do_sample"]:
        out.append("- Sampling: outputs of different methods are different samples, so exact match is n/a; "
                   "each (question, turn) uses the same seed in every method and every rerun.")
    if any(b > 1 for b in batch_sizes_of(config)):
        refused = [m["name"] for m in config["methods"] if not method_kind(m["generator"]).batched]
        if refused:
            out.append(f"- Batch size > 1: {', '.join(f'`{n}`' for n in refused)} not run (\"not run\" in the table): "
                       "transformers refuses assisted and prompt-lookup generation for more than one sequence.")
        out.append("- Batch size > 1 runs first turns only: an MT-Bench second turn is measured at batch size 1, "
                   "where it follows the method's own first answer.")
    if plots_skipped:
        out.append(f"- No figures: matplotlib was not installed when this page was written (`{INSTALL_PLOTS}`, "
                   "then `specdec bench report <this directory>`).")
    if figures:
        out += ["", "## Figures", ""] + [f"![{f}]({f})" for f in figures]
    return out


def render_markdown(meta: dict, rows: list[dict], all_summaries: list[Summary], figures: list[str],
                    plots_skipped: bool = False) -> str:
    subtasks = [g for g in SUBTASKS if any(s.subtask == g for s in all_summaries)]
    single = [r for r in rows if not is_batched(r)]
    out = (_header(meta, rows) + _subtask_tables(meta, all_summaries, subtasks) + _warmup_section(meta)
           + _draft_lengths_section(meta, rows, all_summaries, figures) + _batch_section(meta, rows)
           + _pairs_section(meta, single, all_summaries, subtasks) + _notes(meta, figures, plots_skipped))
    return "\n".join(out) + "\n"


def _identical_share(rows: list[dict], a: str, b: str) -> float | None:
    pick = lambda name: {(r["question_id"], r["turn"]): r["output_ids"] for r in rows if r["method"] == name}  # noqa: E731
    ours, theirs = pick(a), pick(b)
    return Agreement.of((ours[k], theirs[k]) for k in ours if k in theirs).share


# -- entry point -------------------------------------------------------------------------------
def load_run(out_dir: str | Path) -> tuple[dict, list[dict]]:
    out_dir = Path(out_dir)
    run_file = out_dir / RUN_FILE
    if not run_file.is_file():
        raise FileNotFoundError(f"{out_dir} is not a benchmark output directory (no {RUN_FILE})")
    meta = json.loads(run_file.read_text())
    rows = ResultStore(out_dir / RESULTS_FILE).load()
    latest = {row_key(r): r for r in rows}  # a key written twice (two sessions racing): keep the last
    return meta, list(latest.values())


def write_report(out_dir: str | Path, log: Callable[[str], None] | None = lambda msg: print(msg, file=sys.stderr)) -> Path:
    """(Re)build ``report.md`` and the plots in ``out_dir`` from its JSON lines; return the report path.

    Without matplotlib the plots are skipped, ``log`` (None: silent) is told so, and report.md is
    written all the same."""
    out_dir = Path(out_dir)
    meta, rows = load_run(out_dir)
    all_summaries = summaries(meta, rows)
    figures = []
    plots = plots_available()
    if plots:
        base_name = reference_name(meta["config"])
        for name, draw in ((SPEEDUP_PNG, lambda p: plot_speedup(all_summaries, base_name, p)),
                           (ACCEPTANCE_PNG, lambda p: plot_acceptance(all_summaries, p)),
                           (FORWARD_COST_PNG, lambda p: plot_forward_cost(
                               {m: mean_forward_ms(st) for m, st in method_stats(meta, rows).items()}, p))):
            if draw(out_dir / name):
                figures.append(name)
    elif log is not None:
        log(PLOTS_NEED_MATPLOTLIB)
    path = out_dir / REPORT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(render_markdown(meta, rows, all_summaries, figures, plots_skipped=not plots))
    tmp.replace(path)
    return path
