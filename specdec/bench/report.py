"""Benchmark report: ``results.jsonl`` + ``run.json`` -> ``report.md`` and PNG plots.

The same code ends ``specdec bench CONFIG`` and runs alone as ``specdec bench report DIR``, so a
report can always be rebuilt from the JSON lines. It formats what :mod:`.summary` computes and
defines no figure of its own; without matplotlib (the ``bench`` extra) report.md is written
alone. It reads the rows a resume would reuse (:func:`~specdec.bench.provenance.check_rows`
against ``run.json``) and says how many it left out and why. How to read one:
docs/benchmarks.md, "What the columns mean".

This module loads and checks a run and writes its page; the page's parts come from
:mod:`.report_frame` (the header and the notes), :mod:`.report_tables` (the result tables) and
:mod:`.report_methods` (how each method decoded).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from ..prompts import SUBTASKS
from .config import ConfigError, reference_name
from .plots import plot_acceptance, plot_forward_cost, plot_speedup
from .provenance import Fingerprints, RowCheck, check_rows
from .report_frame import INSTALL_PLOTS, _cache_words, _header, _notes, machine_line
from .report_methods import (_choices_section, _draft_lengths_section, _structured_section, _tree_section,
                             _warmup_section, k_distribution)
from .report_tables import (_batch_section, _engine_share_section, _later_calls_section, _pairs_section,
                            _subtask_tables, first_calls_of, gain_ends)
from .results import (ACCEPTANCE_PNG, FORWARD_COST_PNG, REPORT_FILE, RESULTS_FILE, RUN_FILE, SPEEDUP_PNG, ResultStore,
                      is_batched)
from .summary import Summary, cross_session_pairs, mean_forward_ms, method_stats, planned_keys_of, summaries

#: what other modules and the tests import from here, some of it defined in the modules above
__all__ = ["PLOTS_NEED_MATPLOTLIB", "_cache_words", "_engine_share_section", "check_run", "first_calls_of",
           "gain_ends", "k_distribution", "load_checked_run", "load_run", "machine_line", "plots_available",
           "render_markdown", "write_report"]

PLOTS_NEED_MATPLOTLIB = f"matplotlib is not installed: report.md is written without plots (plots need {INSTALL_PLOTS})"


def plots_available() -> bool:
    """Whether matplotlib imports (the ``bench`` extra); without it the report has no plots."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


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
    try:
        meta = json.loads(run_file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{run_file} is not JSON ({exc}): rerun the benchmark with --fresh to write it again") from None
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
