"""The report's text around its tables: the header (the command, target, dataset, machine, rows and
methods of the run, what each resumed session kept, the logits processors' share of the time) and the
closing notes (definitions, what the config means for reading the figures, the figures themselves).
"""

from __future__ import annotations

from pathlib import Path

from .config import PROCESSOR_SETTINGS, method_kind, reference_name
from .results import RESULTS_FILE, row_key
from .summary import batch_sizes_of, planned_rows

INSTALL_PLOTS = 'pip install "specdec[bench]"'


def machine_line(env: dict) -> str:
    """The CPU a run's figures come from, as its ``run.json`` recorded it (runs before the CPU was
    recorded name the processor architecture only)."""
    if "cpu_model" not in env:
        return f"{env.get('processor', '?')} (CPU model not recorded)"
    flags = [f for f in env.get("cpu_flags", []) if f.startswith("amx")]
    return f"{env['cpu_model']} ({env.get('cpu_capability', '?')}{'; ' + ', '.join(flags) if flags else ''})"


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
