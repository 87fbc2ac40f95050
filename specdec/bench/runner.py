"""Run a benchmark config: every method on the same prompts, interleaved per question, resumable.

Invariants: nothing is written before the config, the dataset, the device and every method have
been checked (models loaded, compiled, warmed up once); each row is appended and synced as soon as
it exists, so an interruption loses at most the call in flight; a rerun with the same config hash
resumes, a different hash is refused unless ``fresh``; every method is timed alike, around one
``generate()`` call with its new tokens back on the host. A resume reuses a row only when it passes
:func:`~specdec.bench.provenance.check_rows` (this config's fingerprint, its own digest) and its
turn or batch was timed whole in one session (:func:`~specdec.bench.provenance.whole_units`); the
rest is run again, whole, and the run says how much. How a run goes: docs/benchmarks.md.

This module loads and warms up the models and runs the loop; :mod:`.runner_hash` says what the
results depend on, :mod:`.runner_outdir` opens (or resumes) the output directory and records each
row, :mod:`.runner_calls` times one call of one method.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..modelinfo import eos_token_ids, pad_token_id
from ..models import load_model, resolve_device
from ..prompts import encode_chat
from .config import BenchConfig, ConfigError, GenerationSettings
from .methods import build_methods, compile_methods, load_drafts, warm_up, warmup_batch_sizes
from .questions import Question, build_messages, load_selected_questions, longest_call
from .provenance import new_session_id
from .report import PLOTS_NEED_MATPLOTLIB, plots_available, write_report
from .results import batch_groups, default_out_dir, shown_path
from .runner_calls import _Models, _run_batch, _run_one, real_new_tokens
from .runner_hash import _without_later_defaults, config_hash, row_fingerprints
from .runner_outdir import ResultsMismatchError, RunResult, _open_shared, _Recorder, check_out_dir, prepare_out_dir
from .sharded import begin, is_rank0, load_target, on_rank0, rank0_log
from .summary import median_run

#: what other modules, the benchmarks and the tests import from here, some of it defined in the modules above
__all__ = ["ResultsMismatchError", "RunResult", "_without_later_defaults", "build_messages", "config_hash",
           "load_selected_questions", "prepare_out_dir", "real_new_tokens", "row_fingerprints", "run_benchmark",
           "run_device"]


def run_device(config: BenchConfig) -> torch.device:
    """The device the config's ``device`` means on this machine, or a :class:`ConfigError` naming the field."""
    try:
        return resolve_device(config.device)
    except ValueError as exc:
        raise ConfigError(f"device: {exc}") from None


def _load_and_warm_up(config: BenchConfig, questions: list[Question], log: Callable[[str], None]) -> _Models:
    """Load the target and drafts, build every method, compile those that compile, warm each up once
    (nothing is written)."""
    device = run_device(config)
    log(f"loading {config.target} ({config.dtype} on {device}) ...")
    if config.distributed is not None:  # sharded over this torchrun launch (bench/sharded.py)
        target, tokenizer = load_target(config, device)
    else:
        target, tokenizer = load_model(config.target, dtype=config.torch_dtype, device=device)
    runners = build_methods(config, target, tokenizer, load_drafts(config, device, log))
    reference = config.reference_method.name
    runners.sort(key=lambda r: r.config.name != reference)  # stable: the others stay in config order
    sizes = warmup_batch_sizes(config.batch_sizes, len(questions))
    longest = longest_call(questions, tokenizer, config.generation.max_new_tokens, every_turn=1 in config.batch_sizes)
    compiled = compile_methods(runners, sizes, longest, log)
    pad_id = pad_token_id(target)
    models = _Models(target, tokenizer, runners, pad_id, set(eos_token_ids(target)), device, compiled)
    _compile_grammars(models, questions, config.generation)
    warm_up(runners, tokenizer, config.warmup_new_tokens, device, batched=any(b > 1 for b in config.batch_sizes),
            pad_id=pad_id)
    return models


def _compile_grammars(models: _Models, questions: list[Question], gen: GenerationSettings) -> None:
    """Compile every grammar the run decodes under (kept for the run), so that one that does not
    compile stops it before a file is written."""
    for spec in dict.fromkeys(models.grammar_of(q, gen) for q in questions):
        try:
            models.compile(spec)
        except ValueError as exc:
            where = "generation.grammar" if spec == json.dumps(gen.grammar) else "a question's grammar"
            raise ConfigError(f"{where}: {exc}") from None


@contextmanager
def _process_settings(threads: int) -> Iterator[None]:
    """torch threads and transformers' log level for the run; restored after, so that a library call
    leaves the process as it found it."""
    from transformers.utils import logging as hf_logging

    previous_threads, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()  # per-call generation notices would drown the progress bar
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        torch.set_num_threads(previous_threads)


def _run_per_question(models: _Models, questions: list[Question], gen: GenerationSettings, done: dict,
                      record: _Recorder, repeats: int = 1) -> None:
    """The batch-size-1 pass: every question, turn by turn; each turn runs ``repeats`` times, every
    method (the reference first) once per repeat. A method's later turns carry its own recorded answers."""
    for q in questions:
        answers: dict[str, list[str]] = {r.config.name: [] for r in models.runners}
        for turn in range(1, len(q.turns) + 1):
            todo = []
            for runner in models.runners:
                key = (runner.config.name, q.question_id, turn)
                if key in done:
                    answers[runner.config.name].append(done[key]["text"])
                else:
                    todo.append(runner)
            runs: dict[str, list[dict]] = {r.config.name: [] for r in todo}
            for repeat in range(repeats):
                for runner in todo:
                    name = runner.config.name
                    runs[name].append(_run_one(runner, q, turn, answers[name], models, gen))
                    if repeat == repeats - 1:  # its last run: the row is complete
                        row = median_run(runs[name])
                        answers[name].append(row["text"])
                        record(row, q.subtask)


def _run_batches(models: _Models, questions: list[Question], batch_size: int, gen: GenerationSettings, done: dict,
                 record: _Recorder, repeats: int = 1) -> None:
    """One batch-size > 1 pass: first turns, left-padded batches, every method that runs batches
    (``repeats`` times per batch, interleaved as in :func:`_run_per_question`)."""
    for index, group in enumerate(batch_groups(questions, batch_size)):
        todo = [r for r in models.runners
                if r.run_batch is not None and (r.config.name, "batch", batch_size, index) not in done]
        if not todo:
            continue
        prompts = [encode_chat(models.tokenizer, build_messages(q.turns[:1], []))[0] for q in group]
        runs: dict[str, list[dict]] = {r.config.name: [] for r in todo}
        for repeat in range(repeats):
            for runner in todo:
                runs[runner.config.name].append(_run_batch(runner, group, prompts, batch_size, index, models, gen))
                if repeat == repeats - 1:
                    record(median_run(runs[runner.config.name]), f"batch {batch_size} #{index}")


def run_benchmark(config: BenchConfig, *, config_file: str | Path, out_dir: str | Path | None = None,
                  fresh: bool = False, progress: bool = True, on_row: Callable[[dict], None] | None = None,
                  log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> RunResult:
    """Run (or resume) ``config``; return where the results are (docs/benchmarks.md, "How a run goes").

    ``on_row(row)`` is called once per row, after the row is on disk."""
    from tqdm.auto import tqdm

    config_file = str(config_file)
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir(config_file)
    begin(config)  # a distributed config: this is one rank of a torchrun launch; rank 0 alone writes
    log, on_row, progress = rank0_log(log), on_row if is_rank0() else None, progress and is_rank0()
    questions = load_selected_questions(config, Path(config_file).parent)
    digest, fingerprints = config_hash(config, questions), row_fingerprints(config, questions)
    session = new_session_id()  # every row this run writes carries it
    check_out_dir(out_dir)  # refuse early, before loading any model
    if not fresh:
        on_rank0(lambda: prepare_out_dir(out_dir, digest, fresh=False))
    log(f"results: {shown_path(out_dir)}")
    if not plots_available():
        log(PLOTS_NEED_MATPLOTLIB)

    with _process_settings(config.threads):
        models = _load_and_warm_up(config, questions, log)
        # -- from here on, files are written ------------------------------------------------------
        store, done, result = _open_shared(out_dir, config, config_file, digest, questions, models, fresh, log,
                                           session, fingerprints)
        with tqdm(total=result.rows_total, initial=result.rows_done_before, unit="row", disable=not progress,
                  desc=Path(config_file).stem, dynamic_ncols=True) as bar:
            reference = None if config.generation.do_sample else config.reference_method.name
            record = _Recorder(store, done, result, bar, on_row, reference, session, fingerprints)
            if 1 in config.batch_sizes:
                _run_per_question(models, questions, config.generation, done, record, config.repeats)
            for size in (b for b in config.batch_sizes if b > 1):
                _run_batches(models, questions, size, config.generation, done, record, config.repeats)
    result.report = on_rank0(lambda: write_report(out_dir, log=None))  # a missing matplotlib was reported at the start
    return result
