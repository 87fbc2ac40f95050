"""The report's result tables: overall and by subtask, outputs identical to the reference's, the
engine's share, beside llama.cpp, after the first calls, by batch size, ours against transformers';
and the Markdown cells and tables every section of the report is built of.
"""

from __future__ import annotations

from .config import LLAMA_CPP, MethodKind, method_kind, reference_name
from .results import OVERALL
from .summary import (BatchSummary, Summary, batch_sizes_of, batch_summaries, identical_share, pair_comparisons,
                      summaries)

MAX_POSITIONS = 16  # per-position columns shown in the table
NA = "n/a"


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


def _subtask_tables(meta: dict, all_summaries: list[Summary], subtasks: list[str]) -> list[str]:
    """Overall, speedup by subtask, per subtask, and per-position acceptance (when any method drafted)."""
    overall = [s for s in all_summaries if s.subtask == OVERALL]
    by = {(s.method, s.subtask): s for s in all_summaries}
    out = ["", "## Overall", ""]
    out += _table(["method"] + METRIC_HEADER, [[f"`{s.method}`"] + _metric_cells(s) for s in overall])
    out += _identical_section(meta, overall)
    out += _engine_share_section(meta, overall)
    out += _peer_section(meta, all_summaries, subtasks)
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


def _engine_share_section(meta: dict, overall: list[Summary]) -> list[str]:
    """Where the run has specdec's loop with no drafts (generator ``none``) on an engine, each
    method's speedup split in two: that loop's over the reference (the engine's share: the same
    tokens, one per forward) and the method's over that loop (speculation's share)."""
    engines = {m["name"]: m.get("engine", "auto") for m in meta["config"]["methods"]}
    loops = {engines[s.method]: s for s in overall if s.generator == "none" and s.speedup}
    if not loops:
        return []
    body = []
    for s in overall:
        loop = loops.get(engines[s.method])
        if s.reference or s.speedup is None or loop is None or s.kind.reference:
            continue
        body.append([f"`{s.method}`", f"`{engines[s.method]}`", _f(s.speedup, ".2f", "x"),
                     f"{loop.speedup:.2f}x (`{loop.method}`)",
                     _f(s.speedup / loop.speedup if s.method != loop.method else None, ".2f", "x")])
    ref = next((s.method for s in overall if s.reference), "the reference")
    return ["", "## The engine's share and speculation's", "",
            f"Speedup over `{ref}` = the loop's with no drafts on the same engine (the engine's share: one "
            "token a forward, the same tokens) x the method's over that loop (speculation's share).", ""] + \
        _table(["method", "engine", "speedup", "loop, no drafts, same engine", "speculation alone"], body)


def _peer_section(meta: dict, all_summaries: list[Summary], subtasks: list[str]) -> list[str]:
    """Where the run has llama.cpp's plain decoding (``llama_cpp`` methods with no lookup), every
    method's tokens/s over that of llama.cpp's F32 and Q4_1 plain rows, overall and by subtask."""
    plain = {}
    for m in meta["config"]["methods"]:
        options = m.get("options") or {}
        if m["generator"] == LLAMA_CPP and not options.get("lookup"):
            plain.setdefault(options.get("weights", "F32"), m["name"])
    peers = [(w, plain[w]) for w in ("F32", "Q4_1") if w in plain]
    if not peers:
        return []
    by = {(s.method, s.subtask): s for s in all_summaries}
    out = ["", "## Beside llama.cpp", "",
           "Tokens/s over llama.cpp's plain decoding of the F32 file (the weights the fp32 target decodes) and of "
           "the Q4_1 file, overall and by subtask (above 1.00x: faster than llama.cpp).", ""]
    groups = [OVERALL] + subtasks
    for weights, peer in peers:
        body = []
        for m in meta["config"]["methods"]:
            cells = []
            for g in groups:
                a, b = by.get((m["name"], g)), by.get((peer, g))
                ok = a is not None and b is not None and b.tokens_per_second
                cells.append(_f(a.tokens_per_second / b.tokens_per_second if ok else None, ".2f", "x"))
            body.append([f"`{m['name']}`"] + cells)
        out += [f"Over `{peer}` (llama.cpp {weights}, plain):", ""]
        out += _table(["method"] + groups, body) + [""]
    return out[:-1]


def first_calls_of(meta: dict) -> set[tuple[int, int]]:
    """The (question_id, turn) of the run's first ``first_calls`` calls: questions in the run's order,
    each one's turns in order (1-based), as the runner asks them."""
    order = [(q["question_id"], turn) for q in meta["questions"] for turn in range(1, q["turns"] + 1)]
    return set(order[: meta["config"].get("first_calls") or 0])


def _later_calls_section(meta: dict, rows: list[dict]) -> list[str]:
    """With ``first_calls: N``: every method over the rows after the run's first N calls."""
    first = first_calls_of(meta)
    if not first:
        return []
    later = [r for r in rows if (r["question_id"], r["turn"]) not in first]
    overall = [s for s in summaries(meta, later) if s.subtask == OVERALL]
    named = ", ".join(f"question {q} turn {t}" for q, t in sorted(first))
    return (["", f"## After the first {len(first)} calls", "",
             f"The rows after the run's first {len(first)} calls ({named} left out): a method that learns from "
             "earlier calls, past its cold start.", ""]
            + _table(["method"] + METRIC_HEADER, [[f"`{s.method}`"] + _metric_cells(s) for s in overall]))


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
            body.append([f"`{ours}` / `{hf}`"] + cells + [_f(identical_share(rows, ours, hf), ".0%")])
        out += _table(["ours / transformers"] + subtasks + [OVERALL, "identical"], body)
    return out
