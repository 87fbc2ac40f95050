"""``specdec bench CONFIG.yaml [--out DIR] [--fresh]`` and ``specdec bench report DIR``.

Results go to ``--out DIR``, else ``results/<config stem>/`` beside the config (beside its folder
when that folder is named ``configs``); the directory is printed before the run starts.

Exit status: 0 done; 2 bad config or refused output directory (one line per problem on stderr,
nothing written); 130 interrupted by Ctrl-C (SIGINT) or SIGTERM (rows so far are kept, a partial
report is written, rerunning the same command resumes). Further signals while that report is
being written are ignored, so a second Ctrl-C cannot lose it.

The arguments are parsed before the bench's modules are imported (they import torch and
transformers, seconds on a busy machine), so ``--help`` and a usage error answer at once.

Without matplotlib (the ``bench`` extra) report.md is written without plots, and the command
says so before it starts.

A config with ``distributed: {tp_size: N, ...}`` runs under ``torchrun --nproc-per-node N -m specdec
bench CONFIG``: every rank runs it, rank 0 writes and prints (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

USAGE_ERRORS = ("ConfigError", "ResultsMismatchError", "ModelNotAvailableError", "FileNotFoundError",
                "UnknownGeneratorError")


def _error(exc: BaseException) -> int:
    from .sharded import is_rank0

    if is_rank0():  # under torchrun every rank has the same error: rank 0 says it
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"specdec bench: error: {line}", file=sys.stderr)
    return 2


def report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec bench report",
                                     description="Rebuild report.md and the plots from DIR/results.jsonl.")
    parser.add_argument("dir", type=Path, help="a benchmark output directory (holds run.json, results.jsonl)")
    return parser


def cmd_report(argv: list[str]) -> int:
    args = report_parser().parse_args(argv)
    from .report import write_report  # after parsing: --help needs none of the bench's imports

    try:
        path = write_report(args.dir)
    except Exception as exc:
        if type(exc).__name__ in USAGE_ERRORS:
            return _error(exc)
        raise
    print(path)
    return 0


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def _interrupts_as_keyboard_interrupt() -> Iterator[None]:
    """Inside the block, the first SIGINT or SIGTERM raises KeyboardInterrupt; every later one is
    ignored (the wind-down writes the partial report); the previous handlers are restored after."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers: main thread only
        yield
        return
    received = []

    def handler(signum, frame):
        received.append(signum)
        if len(received) == 1:
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _partial_report(out_dir: Path) -> None:
    """After an interruption: the report of the rows so far (when there are any), and what to do next."""
    from .report import write_report
    from .results import RESULTS_FILE, shown_path
    from .sharded import is_rank0

    if not is_rank0():  # rank 0 writes (docs/distributed.md)
        return
    results = out_dir / RESULTS_FILE
    if not results.exists():
        print("\nspecdec bench: interrupted before the first row; nothing was written.", file=sys.stderr)
        return
    print("\nspecdec bench: interrupted; writing the report of the finished rows ...", file=sys.stderr)
    try:
        path = write_report(out_dir)
        print(f"specdec bench: partial report: {shown_path(path)}", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - the rows are safe; a report failure must not hide that
        print(f"specdec bench: partial report failed: {exc}", file=sys.stderr)
    print(f"specdec bench: finished rows are kept in {shown_path(results)}. Run the same command again to resume.",
          file=sys.stderr)


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec bench", description=(
        "Run a YAML benchmark config (resumes an interrupted run of the same config). "
        "`specdec bench report DIR` rebuilds a report."))
    parser.add_argument("config", type=Path, help="benchmark config, e.g. benchmarks/configs/quick.yaml")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: results/<config stem>/ "
                        "beside the config, or beside its folder when that folder is named configs)")
    parser.add_argument("--fresh", action="store_true", help="discard this directory's earlier results and start over")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def cmd_run(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    from .config import load_config  # after parsing: --help needs none of these (torch, transformers)
    from .results import default_out_dir, shown_path
    from .runner import run_benchmark

    out_dir = args.out or default_out_dir(args.config)
    with _interrupts_as_keyboard_interrupt():
        try:
            config = load_config(args.config)
            result = run_benchmark(config, config_file=args.config, out_dir=out_dir, fresh=args.fresh,
                                   progress=not args.no_progress)
        except KeyboardInterrupt:
            _partial_report(out_dir)
            return 130
        except Exception as exc:
            if type(exc).__name__ in USAGE_ERRORS:
                return _error(exc)
            raise
    from .sharded import is_rank0

    if is_rank0():
        print(f"{result.rows_new} new rows ({result.rows_done_before} already done) of {result.rows_total}; "
              f"report: {shown_path(result.report)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        return cmd_report(argv[1:])
    return cmd_run(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
