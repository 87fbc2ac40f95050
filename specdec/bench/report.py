"""Benchmark report: ``results.jsonl`` + ``run.json`` -> ``report.md`` and PNG plots.

The same code ends ``specdec bench CONFIG`` and runs alone as ``specdec bench report DIR``, so a
report can always be rebuilt from the JSON lines. It formats what :mod:`.summary` computes and
defines no figure of its own; without matplotlib (the ``bench`` extra) report.md is written
alone. It reads the rows a resume would reuse (:func:`~specdec.bench.provenance.check_rows`
against ``run.json``) and says how many it left out and why. How to read one:
docs/benchmarks.md, "What the columns mean".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from ..metrics import AcceptanceStats
from ..prompts import SUBTASKS
from .config import LLAMA_CPP, PROCESSOR_SETTINGS, MethodKind, method_kind, reference_name
from .plots import plot_acceptance, plot_forward_cost, plot_speedup
from .provenance import Fingerprints, RowCheck, check_rows
from .results import (OVERALL, ACCEPTANCE_PNG, FORWARD_COST_PNG, REPORT_FILE, RESULTS_FILE, RUN_FILE, SPEEDUP_PNG,
                      ResultStore, is_batched, row_key)
from .summary import (BatchSummary, Summary, batch_sizes_of, batch_summaries, cross_session_pairs, identical_share,
                      mean_forward_ms, method_stats, pair_comparisons, planned_keys_of, planned_rows, summaries)

MAX_POSITIONS = 16  # per-position columns shown in the table
NA = "n/a"
INSTALL_PLOTS = 'pip install "specdec[bench]"'
PLOTS_NEED_MATPLOTLIB = f"matplotlib is not installed: report.md is written without plots (plots need {INSTALL_PLOTS})"


def machine_line(env: dict) -> str:
    """The CPU a run's figures come from, as its ``run.json`` recorded it (runs before the CPU was
    recorded name the processor architecture only)."""
    if "cpu_model" not in env:
        return f"{env.get('processor', '?')} (CPU model not recorded)"
    flags = [f for f in env.get("cpu_flags", []) if f.startswith("amx")]
    return f"{env['cpu_model']} ({env.get('cpu_capability', '?')}{'; ' + ', '.join(flags) if flags else ''})"


def plots_available() -> bool:
    """Whether matplotlib imports (the ``bench`` extra); without it the report has no plots."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


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
            f"sampling (temperature {gen['temperature']}, top_k {gen['top_k']}, top_p {gen['top_p']}"
            + (f", min_p {gen['min_p']}" if gen.get("min_p") is not None else "") + f", seed {gen['seed']})")
    processors = {k: gen[k] for k in PROCESSOR_SETTINGS if gen.get(k) is not None}
    if processors:
        mode += ", logits processors " + ", ".join(f"`{k}={v}`" for k, v in processors.items())
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
        f"- Machine: {machine_line(env)}, {env.get('platform', '?')}, {env.get('cpu_count', '?')} CPUs "
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
    ] + _resumes(meta) + _processor_time(rows, processors)


def _resumes(meta: dict) -> list[str]:
    """What each resumed session kept and ran again (sessions that recorded it: later than the first)."""
    parts = []
    for number, session in enumerate(meta.get("sessions", []), 1):
        if number == 1 or "kept_units" not in session:
            continue
        not_reused = sum(session.get("rows_not_reused", {}).values())
        parts.append(f"session {number} kept {session['kept_units']} turn(s) or batch(es) and ran "
                     f"{session['rerun_units']} again whole" + (f", {not_reused} row(s) not reused" if not_reused else ""))
    if not parts:
        return []
    return ["- Resumed: " + "; ".join(parts) + ". A turn (or batch) is kept only when every method's row of it was "
            "timed in one session, so each speedup compares calls timed side by side."]


def _processor_time(rows: list[dict], processors: dict) -> list[str]:
    """With logits processors configured: the share of each SpecDecoder method's decoding time they took."""
    if not processors:
        return []
    spent: dict[str, list[float]] = {}
    for row in rows:
        stats = row.get("stats") or {}
        if stats.get("total_seconds"):
            entry = spent.setdefault(row["method"], [0.0, 0.0, 0])
            entry[0] += stats.get("processor_seconds", 0.0)
            entry[1] += stats["total_seconds"]
            entry[2] += stats.get("steps", 0)
    shares = "; ".join(f"`{name}` {p / t:.1%} ({1e3 * p / max(n, 1):.2f} ms a step)" for name, (p, t, n) in spent.items())
    return [f"- Logits processors: every method applies {', '.join(f'`{k}`' for k in processors)} (transformers' "
            f"in each step, SpecDecoder's at every verified position). Their share of SpecDecoder's decoding time: "
            f"{shares or 'n/a'}."]


def _cache_words(method: dict) -> str:
    """How a method keeps its cache, what runs its forwards and computes its output layer, in words
    (nothing for the defaults; what ``engine: auto`` chose is in the choices section)."""
    compile = method.get("compile", False)
    engine = method.get("engine", "auto")
    words = "" if engine == "auto" else f", engine `{engine}`"
    words += "" if method.get("fast_head", True) else ", the model's own output layer (fast_head: false)"
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


def _structured_section(meta: dict, rows: list[dict]) -> list[str]:
    """Grammar-constrained rows: per method, valid outputs, the share of output tokens the grammar
    forced (a property of the text), the share committed as the grammar's own drafts, and the
    acceptance of the other drafts (docs/structured.md)."""
    constrained = [r for r in rows if r.get("grammar") and not is_batched(r)]
    if not constrained:
        return []
    stats = method_stats(meta, constrained)
    out = ["", "## Structured output", "",
           "Every method decodes under the same compiled grammar (transformers with xgrammar's logits processor). "
           "*Forced*: output tokens at positions where the grammar allowed exactly one token. *Grammar drafts*: "
           "committed tokens that were the grammar's own drafts (forced tokens, and xgrammar's spelling of a forced "
           "string, proposed after the generator's drafts). *Other drafts accepted*: acceptance of the "
           "generator's drafts.", ""]
    body = []
    for m in meta["config"]["methods"]:
        mine = [r for r in constrained if r["method"] == m["name"]]
        if not mine:
            continue
        st = stats.get(m["name"])
        tokens = sum(r["new_tokens"] for r in mine)
        body.append([f"`{m['name']}`", f"{sum(r['grammar']['valid'] for r in mine)} of {len(mine)}",
                     _f(sum(r["grammar"]["forced"] for r in mine) / tokens if tokens else None, ".1%"),
                     _f(st.grammar_share if st is not None else None, ".1%"),
                     _f(st.drafter_acceptance_rate if st is not None and st.drafted_tokens > st.grammar_drafts
                        else None, ".1%")])
    return out + _table(["method", "valid outputs", "forced", "grammar drafts", "other drafts accepted"], body)


def _tree_section(meta: dict, rows: list[dict]) -> list[str]:
    """Per method that verified token trees (docs/trees.md): how many of its steps did, their mean
    node count and mean accepted depth (drafts accepted on the path the target took)."""
    stats = {name: st for name, st in method_stats(meta, rows).items() if st.tree_steps}
    if not stats:
        return []
    out = ["", "## Token trees", "", "*Tree steps*: steps whose drafts were a tree, verified in one forward; "
           "*nodes*: drafts per tree step; *accepted depth*: drafts accepted per tree step (the path the target "
           "took).", ""]
    body = [[f"`{name}`", f"{st.tree_steps} of {st.steps}", f"{st.tree_nodes / st.tree_steps:.2f}",
             f"{st.tree_depth / st.tree_steps:.2f}"] for name, st in stats.items()]
    return out + _table(["method", "tree steps", "nodes", "accepted depth"], body)


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


def _choices_section(meta: dict, rows: list[dict]) -> list[str]:
    """Per method, the one-time choices its calls made and why (``AcceptanceStats.choices``: e.g.
    the precision ``self_draft``'s ``weights="auto"`` measured best on this machine)."""
    made = {name: stats.choices for name, stats in method_stats(meta, rows).items() if stats.choices}
    if not made:
        return []
    out = ["", "## Choices made on this machine", "",
           "What each method chose for itself, and why (`AcceptanceStats.choices`); the measuring was done in the "
           "untimed warm-up call, so no tokens/s above includes it.", ""]
    body = [[f"`{name}`", f"`{key}`", value.replace("|", "/")] for name, choices in made.items()
            for key, value in choices.items()]
    return out + _table(["method", "choice", "value"], body)


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
            body.append([f"`{ours}` / `{hf}`"] + cells + [_f(identical_share(rows, ours, hf), ".0%")])
        out += _table(["ours / transformers"] + subtasks + [OVERALL, "identical"], body)
    return out


def _notes(meta: dict, figures: list[str], plots_skipped: bool, left_out: list[str] = (),
           cross_session: int = 0) -> list[str]:
    config = meta["config"]
    out = ["", "## Notes", ""]
    if left_out:
        out.append(f"- Rows in `{RESULTS_FILE}` left out of this page: {'; '.join(left_out)}.")
    if cross_session:
        out.append(f"- {cross_session} row(s) left out of the speedups: timed in another session than the "
                   "reference's row of the same call.")
    out += ["- Definitions and formulas: `docs/benchmarks.md` (every metric comes from `specdec.metrics`).",
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
                    plots_skipped: bool = False, left_out: list[str] = ()) -> str:
    """``rows``: the usable rows (:func:`load_checked_run`); ``left_out``: its notes on the others."""
    subtasks = [g for g in SUBTASKS if any(s.subtask == g for s in all_summaries)]
    single = [r for r in rows if not is_batched(r)]
    out = (_header(meta, rows) + _subtask_tables(meta, all_summaries, subtasks) + _later_calls_section(meta, single)
           + _structured_section(meta, single)
           + _tree_section(meta, single) + _warmup_section(meta)
           + _choices_section(meta, rows) + _draft_lengths_section(meta, rows, all_summaries, figures)
           + _batch_section(meta, rows)
           + _pairs_section(meta, single, all_summaries, subtasks)
           + _notes(meta, figures, plots_skipped, left_out, cross_session_pairs(meta, rows)))
    return "\n".join(out) + "\n"


# -- entry point -------------------------------------------------------------------------------
def check_run(meta: dict, rows: list[dict]) -> RowCheck:
    """``rows`` (file order) checked against ``run.json``'s config: the usable ones, the last of each key
    (a key written twice: a unit run again on resume, or two sessions racing)."""
    methods = {m["name"] for m in meta["config"]["methods"]}
    return check_rows(rows, methods, planned_keys_of(meta), Fingerprints.from_json(meta.get("fingerprints")),
                      meta.get("legacy_rows", 0))


def load_checked_run(out_dir: str | Path) -> tuple[dict, RowCheck]:
    """``run.json`` and the :func:`check_run` of ``results.jsonl``."""
    out_dir = Path(out_dir)
    run_file = out_dir / RUN_FILE
    if not run_file.is_file():
        raise FileNotFoundError(f"{out_dir} is not a benchmark output directory (no {RUN_FILE})")
    meta = json.loads(run_file.read_text())
    return meta, check_run(meta, ResultStore(out_dir / RESULTS_FILE).load())


def load_run(out_dir: str | Path) -> tuple[dict, list[dict]]:
    """``run.json`` and the usable rows of ``results.jsonl`` (:func:`load_checked_run`)."""
    meta, check = load_checked_run(out_dir)
    return meta, list(check.rows.values())


def write_report(out_dir: str | Path, log: Callable[[str], None] | None = lambda msg: print(msg, file=sys.stderr)) -> Path:
    """(Re)build ``report.md`` and the plots in ``out_dir`` from its JSON lines; return the report path.

    Without matplotlib the plots are skipped, ``log`` (None: silent) is told so, and report.md is
    written all the same."""
    out_dir = Path(out_dir)
    meta, check = load_checked_run(out_dir)
    rows = list(check.rows.values())
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
    tmp.write_text(render_markdown(meta, rows, all_summaries, figures, plots_skipped=not plots, left_out=check.notes()))
    tmp.replace(path)
    return path
