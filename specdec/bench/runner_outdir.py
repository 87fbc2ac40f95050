"""A run's output directory: another config's results refused, ``run.json`` and its sessions (the
machine, the compile warm-ups, what a resume kept), the rows a resume may keep, each new row
recorded as soon as it exists.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from ..cli_args import folder_problem
from .config import BenchConfig, ConfigError
from .provenance import FINGERPRINT, SESSION, Fingerprints, Units, check_rows, stamped, whole_units
from .questions import Question
from .results import OWN_FILES, RESULTS_FILE, RUN_FILE, ResultStore, planned_keys, row_first_difference, row_key
from .runner_calls import _Models
from .runner_hash import row_fingerprints
from .sharded import environment as launch_environment
from .sharded import on_rank0
from .summary import new_tokens


class ResultsMismatchError(RuntimeError):
    """The output directory holds results of a different config."""


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


@dataclass
class RunResult:
    out_dir: Path
    rows_total: int
    rows_done_before: int
    rows_new: int = 0
    report: Path | None = None
    notes: list[str] = field(default_factory=list)  # what the resume did not reuse, and why (also logged)
    units: Units = field(default_factory=Units)  # turns and batches kept whole, and run again whole, on resume


def check_out_dir(out_dir: Path) -> None:
    """Refuse an output folder that is a file or lies below one, before any model loads."""
    problem = folder_problem(out_dir)
    if problem:
        raise ConfigError(f"--out {out_dir}: {problem}")


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
