"""Run a benchmark config: every method on the same prompts, interleaved per question, resumable.

Invariants: nothing is written before the config, the dataset, the device and every method have
been checked (models loaded, compiled, warmed up once); each row is appended and synced as soon as
it exists, so an interruption loses at most the call in flight; a rerun with the same config hash
resumes, a different hash is refused unless ``fresh``; every method is timed alike, around one
``generate()`` call with its new tokens back on the host. A resume reuses a row only when it passes
:func:`~specdec.bench.provenance.check_rows` (this config's fingerprint, its own digest) and its
turn or batch was timed whole in one session (:func:`~specdec.bench.provenance.whole_units`); the
rest is run again, whole, and the run says how much. How a run goes: docs/benchmarks.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..grammar import Grammar, check_output, compile_grammar
from ..modelinfo import ForwardTimer, eos_token_ids, pad_token_id, vocab_size
from ..models import load_model, resolve_device
from ..prompts import encode_chat, left_pad
from .config import BenchConfig, ConfigError, DatasetConfig, GenerationSettings, MethodConfig
from .methods import MethodRunner, build_methods, compile_methods, load_drafts, warm_up, warmup_batch_sizes
from .questions import Question, batch_seed, build_messages, load_selected_questions, longest_call, question_seed
from .report import PLOTS_NEED_MATPLOTLIB, plots_available, write_report
from .provenance import FINGERPRINT, SESSION, Fingerprints, Units, check_rows, new_session_id, stamped, whole_units
from .sharded import begin, is_rank0, load_target, on_rank0, rank0_log
from .sharded import environment as launch_environment
from .results import (OWN_FILES, RESULTS_FILE, RUN_FILE, ResultStore, batch_groups, default_out_dir, planned_keys,
                      row_first_difference, row_key, shown_path)
from .summary import median_run, new_tokens


class ResultsMismatchError(RuntimeError):
    """The output directory holds results of a different config."""


# -- what the results depend on ------------------------------------------------------------------
def config_hash(config: BenchConfig, questions: list[Question]) -> str:
    """Identifies what the results depend on: the config (its free-text description and what the report
    sets apart aside) and the questions.

    ``batch_sizes: [1]`` is hashed as the single-size field it replaced (``batch_size: 1``), so results
    written before batch sizes existed still resume."""
    dumped = _without_later_defaults(config.model_dump(mode="json", exclude={"description", "batch_sizes",
                                                                             "first_calls"}))
    if config.batch_sizes == [1]:
        dumped["batch_size"] = 1
    else:
        dumped["batch_sizes"] = config.batch_sizes
    content = {"config": dumped, "questions": [q.question_id for q in questions]}
    if any(q.grammar for q in questions):  # questions that carry their own grammar
        content["grammars"] = [q.grammar for q in questions]
    payload = json.dumps(content, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


#: fields added after results were first written: hashed only when set to something other than their
#: default, so those results still resume
_LATER_FIELDS = {"config": ("device", "dtype", "reference", "repeats", "distributed"),
                 "dataset": ("first_per_category", "max_turns"),
                 "method": ("cache_implementation", "compile", "fast_head", "engine"),
                 "generation": ("min_p", "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
                                "min_new_tokens", "bad_words_ids", "suppress_tokens", "grammar")}


def _without_later_defaults(dumped: dict) -> dict:
    """``dumped`` (a config's ``model_dump``) without the :data:`_LATER_FIELDS` at their defaults."""
    def strip(data: dict, model, names) -> dict:
        return {k: v for k, v in data.items() if not (k in names and v == model.model_fields[k].default)}

    out = strip(dumped, BenchConfig, _LATER_FIELDS["config"])
    out["dataset"] = strip(dumped["dataset"], DatasetConfig, _LATER_FIELDS["dataset"])
    out["methods"] = [strip(m, MethodConfig, _LATER_FIELDS["method"]) for m in dumped["methods"]]
    out["generation"] = strip(dumped["generation"], GenerationSettings, _LATER_FIELDS["generation"])
    return out


#: config fields a row does not depend on: the methods (each row has its own), which questions are asked and
#: in what batches (the question part of a fingerprint covers what one row asks), the reference (whose row
#: is a row of its own), the free text, what the report sets apart
_NOT_PER_ROW = ("methods", "dataset", "batch_sizes", "batch_size", "reference", "description", "first_calls")


def row_fingerprints(config: BenchConfig, questions: list[Question]) -> Fingerprints:
    """What each row of this config must carry (:class:`~specdec.bench.provenance.Fingerprints`): per
    method, its definition and every setting its calls share; per question and turn, the question as
    asked so far (category, grammar, turn texts). Fields added later hash only when set, as in
    :func:`config_hash`."""
    dumped = _without_later_defaults(config.model_dump(mode="json"))
    shared = {k: v for k, v in dumped.items() if k not in _NOT_PER_ROW}
    methods = {m["name"]: {"method": m, "settings": shared} for m in dumped["methods"]}
    asked = [(q.question_id, [{"question_id": q.question_id, "category": q.category, "grammar": q.grammar,
                               "turns": list(q.turns[:turn])} for turn in range(1, len(q.turns) + 1)])
             for q in questions]
    return Fingerprints.build(methods, asked)


def environment(device: torch.device | None = None) -> dict:
    """The machine a session ran on; ``device`` is where its models ran (default: the CPU)."""
    import transformers

    from .. import __version__, machine

    device = device or torch.device("cpu")
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "specdec": __version__, "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device),
           "cpu_model": machine.cpu_model(), "cpu_capability": machine.cpu_capability(), "cpu_flags": machine.cpu_flags()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    env.update(launch_environment())  # a torchrun launch: its world size and backend
    return env


# -- the output directory --------------------------------------------------------------------------
@dataclass
class RunResult:
    out_dir: Path
    rows_total: int
    rows_done_before: int
    rows_new: int = 0
    report: Path | None = None
    notes: list[str] = field(default_factory=list)  # what the resume did not reuse, and why (also logged)
    units: Units = field(default_factory=Units)  # turns and batches kept whole, and run again whole, on resume


def prepare_out_dir(out_dir: Path, digest: str, fresh: bool) -> None:
    """Refuse a directory holding another config's results (unless ``fresh``: then clear our files)."""
    run_file = out_dir / RUN_FILE
    if not run_file.exists():
        if (out_dir / RESULTS_FILE).exists() and not fresh:
            raise ResultsMismatchError(f"{out_dir} has {RESULTS_FILE} but no {RUN_FILE}; rerun with --fresh "
                                       "to discard it, or choose another --out")
    else:
        previous = json.loads(run_file.read_text()).get("config_hash")
        if previous != digest and not fresh:
            raise ResultsMismatchError(
                f"{out_dir} holds results of a different config (hash {previous}, this config {digest}); "
                "rerun with --fresh to discard them, or choose another --out")
    if fresh:
        for name in OWN_FILES:
            (out_dir / name).unlink(missing_ok=True)


def _read_run_file(out_dir: Path) -> dict | None:
    path = out_dir / RUN_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _write_run_file(out_dir: Path, config: BenchConfig, config_file: str, digest: str,
                    questions: list[Question], done: int, device: torch.device | None = None,
                    warmup_seconds: dict[str, float] | None = None, session: dict | None = None,
                    fingerprints: Fingerprints | None = None, legacy_rows: int = 0) -> None:
    """Create ``run.json`` (or add this session to it): the session's machine, per compiled method the
    seconds its compile warm-up took, and ``session`` (its id and what its resume kept); the row
    fingerprints of this config, and ``legacy_rows`` (rows found without fingerprints when a checking run
    first opened the folder: see :func:`~specdec.bench.provenance.row_problem`)."""
    path = out_dir / RUN_FILE
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    env = environment(device)
    meta = _read_run_file(out_dir)
    if meta is None:
        meta = {"config_file": config_file, "config_hash": digest, "config": config.model_dump(mode="json"),
                "questions": [{"question_id": q.question_id, "subtask": q.subtask, "turns": len(q.turns)}
                              for q in questions],
                "created": now, "environment": env, "sessions": []}
    if fingerprints is not None:
        meta["fingerprints"] = fingerprints.to_json()
        meta.setdefault("legacy_rows", legacy_rows)
    meta["sessions"].append({"started": now, "rows_done_before": done, "environment": env,
                             "warmup_seconds": warmup_seconds or {}, **(session or {})})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(path)


def run_device(config: BenchConfig) -> torch.device:
    """The device the config's ``device`` means on this machine, or a :class:`ConfigError` naming the field."""
    try:
        return resolve_device(config.device)
    except ValueError as exc:
        raise ConfigError(f"device: {exc}") from None


def real_new_tokens(new: torch.Tensor, eos: set[int]) -> list[list[int]]:
    """[B, N] generated ids -> per row, the ids up to and including the first EOS (the rest is padding)."""
    rows = []
    for row in new.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


@dataclass
class _Models:
    """The loaded target and the methods built on it, ready to run (the reference method first)."""

    target: torch.nn.Module
    tokenizer: object
    runners: list[MethodRunner]
    pad_id: int
    eos: set[int]
    device: torch.device
    warmup_seconds: dict[str, float] = field(default_factory=dict)  # compiled methods only

    def grammar_of(self, q: Question, gen: GenerationSettings) -> str | None:
        """The grammar a question is decoded under (JSON text of a config's form), or None."""
        return q.grammar or (json.dumps(gen.grammar) if gen.grammar else None)

    def compile(self, spec: str | None):
        """The grammar ``spec`` compiled for the target (cached by ``compile_grammar``), or None; the
        target's EOS ids end it."""
        if spec is None:
            return None
        return compile_grammar(Grammar.from_config(json.loads(spec)), self.tokenizer, vocab_size(self.target),
                               sorted(self.eos))

    def grammars(self, questions: list[Question], gen: GenerationSettings):
        """A batch's grammar: None, the one all its rows share, or a list of one per row."""
        specs = [self.grammar_of(q, gen) for q in questions]
        if all(s is None for s in specs):
            return None
        if any(s is None for s in specs):
            raise ConfigError("a batch mixes questions with and without a grammar; give every question one "
                              "(or generation.grammar)")
        return self.compile(specs[0]) if len(set(specs)) == 1 else [self.compile(s) for s in specs]


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
    warm_up(runners, tokenizer, config.warmup_new_tokens, device, batched=any(b > 1 for b in config.batch_sizes),
            pad_id=pad_id)
    return _Models(target, tokenizer, runners, pad_id, set(eos_token_ids(target)), device, compiled)


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


class _Recorder:
    """Appends rows to the store (synced), keeps ``done`` and the progress bar up to date. With a
    ``reference`` (greedy runs), each row records where it first differs from the reference's output."""

    def __init__(self, store: ResultStore, done: dict, result: RunResult, bar, on_row: Callable[[dict], None] | None,
                 reference: str | None = None, session: str = "", fingerprints: Fingerprints | None = None):
        self.store, self.done, self.result, self.bar, self.on_row = store, done, result, bar, on_row
        self.reference, self.session, self.fingerprints = reference, session, fingerprints

    def __call__(self, row: dict, label: str) -> None:
        if self.reference is not None:
            try:
                row["first_difference"] = row_first_difference(row, self.done, self.reference)
            except LookupError:
                pass  # the reference's own row, or no reference output to compare with
        row[SESSION] = self.session  # what a resume and the report check a row read back against
        if self.fingerprints is not None:
            row[FINGERPRINT] = self.fingerprints.of(row_key(row))
        if self.store is not None:  # rank 0's (bench/sharded.py): the other ranks only keep count
            self.store.append(stamped(row))
        self.done[row_key(row)] = row
        self.result.rows_new += 1
        self.bar.update(1)
        self.bar.set_postfix_str(f"{row['method']} {label} {new_tokens([row]) / max(row['seconds'], 1e-9):.1f} tok/s")
        if self.on_row is not None:
            self.on_row(row)


def _open_results(out_dir: Path, config: BenchConfig, config_file: str, digest: str, questions: list[Question],
                  models: _Models, fresh: bool, log: Callable[[str], None], session: str = "",
                  fingerprints: Fingerprints | None = None) -> tuple[ResultStore, dict, RunResult]:
    """Create (or resume) the output directory: the store, the rows a resume keeps, the run's counts.

    A row read back is kept only when it is this config's (:func:`~specdec.bench.provenance.check_rows`)
    and its turn or batch was timed whole in one session (:func:`~specdec.bench.provenance.whole_units`);
    what is not kept is run again, whole, and said (logged, in ``run.json``'s session, in the report)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prepare_out_dir(out_dir, digest, fresh)
    fingerprints = fingerprints or row_fingerprints(config, questions)
    store = ResultStore(out_dir / RESULTS_FILE)
    rows = store.load(repair=True)
    meta = _read_run_file(out_dir)
    # rows without fingerprints are an older specdec's only while no checking run has opened the folder
    legacy_rows = len(rows) if meta is not None and "fingerprints" not in meta else (meta or {}).get("legacy_rows", 0)
    planned = planned_keys([(r.config.name, r.run_batch is not None) for r in models.runners],
                           [(q.question_id, len(q.turns)) for q in questions], config.batch_sizes)
    check = check_rows(rows, {r.config.name for r in models.runners}, planned, fingerprints, legacy_rows)
    done, units = whole_units(check.rows, planned)
    result = RunResult(out_dir, len(planned), len(done), notes=check.notes(), units=units)
    resumed = {"id": session, "kept_units": units.kept, "rerun_units": units.rerun,
               "rows_not_reused": dict(check.left_out)}
    _write_run_file(out_dir, config, config_file, digest, questions, result.rows_done_before, models.device,
                    models.warmup_seconds, resumed, fingerprints, legacy_rows)
    for note in result.notes:
        log(f"not reused: {note}")  # a planned call among them is run again
    if units.rerun:
        log(f"run again whole: {units.rerun} turn(s) or batch(es) whose methods were not all timed in one session "
            "(a speedup compares calls timed side by side)")
    if result.rows_done_before:
        log(f"resuming: {result.rows_done_before}/{result.rows_total} rows already in {store.path} "
            f"({units.kept} turn(s) or batch(es) kept whole)")
    return store, done, result


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
    if not fresh:  # refuse early, before loading any model
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


def _open_shared(out_dir: Path, config: BenchConfig, config_file: str, digest: str, questions: list[Question],
                 models: _Models, fresh: bool, log: Callable[[str], None], session: str = "",
                 fingerprints: Fingerprints | None = None) -> tuple[ResultStore | None, dict, RunResult]:
    """:func:`_open_results` on rank 0, whose rows done and counts every rank gets (each runs the rows
    left); the store is rank 0's alone (None elsewhere)."""
    kept = []

    def work():
        store, done, result = _open_results(out_dir, config, config_file, digest, questions, models, fresh, log,
                                            session, fingerprints)
        kept.append(store)
        return done, result

    done, result = on_rank0(work)
    return (kept[0] if kept else None), done, result


def _run_one(runner: MethodRunner, q: Question, turn: int, answers: list[str], models: _Models,
             gen: GenerationSettings) -> dict:
    tokenizer = models.tokenizer
    input_ids = encode_chat(tokenizer, build_messages(q.turns[:turn], answers)).to(models.device)  # [1, L]
    seed = question_seed(gen.seed, q.question_id, turn) if gen.do_sample else None
    spec = models.grammar_of(q, gen)
    grammar = models.compile(spec)
    with _forward_counter(models.target, runner.config) as forwards:
        started = time.perf_counter()
        new_ids, stats = runner.run(input_ids, seed, grammar=grammar)  # a list: on the host
        seconds = time.perf_counter() - started
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    checked = {} if grammar is None else {"grammar": check_output(
        grammar, Grammar.from_config(json.loads(spec)), new_ids, text)}
    return {
        "method": runner.config.name, "generator": runner.config.generator, "question_id": q.question_id,
        "category": q.category, "subtask": q.subtask, "turn": turn, "prompt_tokens": int(input_ids.shape[1]),
        "new_tokens": len(new_ids), "seconds": seconds, "target_forwards": _calls(forwards), "seed": seed,
        "stats": stats.as_dict() if stats is not None else None,
        "output_ids": new_ids, "text": text, **checked,
    }


def _forward_counter(target, method: MethodConfig):
    """A :class:`ForwardTimer` on the target; nothing for a compiled method, whose compiled forwards
    bypass module hooks (a count would be wrong, and a hook must not enter a graph compiled later)."""
    return nullcontext() if method.compiles else ForwardTimer(target)


def _calls(forwards: ForwardTimer | None) -> int | None:
    return forwards.calls if forwards is not None else None


def _run_batch(runner: MethodRunner, group: list[Question], prompts: list[torch.Tensor], batch_size: int,
               batch_index: int, models: _Models, gen: GenerationSettings) -> dict:
    """One left-padded batch of first turns through one method: one row with per-row outputs."""
    input_ids, attention_mask = left_pad(prompts, models.pad_id)
    input_ids, attention_mask = input_ids.to(models.device), attention_mask.to(models.device)
    seed = batch_seed(gen.seed, batch_size, batch_index) if gen.do_sample else None
    with _forward_counter(models.target, runner.config) as forwards:
        started = time.perf_counter()
        new, stats = runner.run_batch(input_ids, attention_mask, seed, grammar=models.grammars(group, gen))
        new = new.cpu()  # waits for the device: its kernels are part of the call
        seconds = time.perf_counter() - started
    outputs = real_new_tokens(new, models.eos)
    return {
        "method": runner.config.name, "generator": runner.config.generator, "batch_size": batch_size,
        "batch_index": batch_index, "question_ids": [q.question_id for q in group],
        "categories": [q.category for q in group], "subtasks": [q.subtask for q in group], "turn": 1,
        "prompt_tokens": [int(p.numel()) for p in prompts], "padded_width": int(input_ids.shape[1]),
        "new_tokens": [len(o) for o in outputs], "seconds": seconds, "target_forwards": _calls(forwards), "seed": seed,
        "stats": stats.as_dict() if stats is not None else None, "output_ids": outputs,
    }
