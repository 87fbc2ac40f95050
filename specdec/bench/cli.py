"""``specdec bench CONFIG.yaml [--out DIR] [--fresh]`` and ``specdec bench report DIR``.

Exit status: 0 done; 2 bad config or refused output directory (one line per problem on stderr,
nothing written); 130 interrupted (rows so far are kept, a partial report is written, rerunning
the same command resumes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

USAGE_ERRORS = ("ConfigError", "ResultsMismatchError", "ModelNotAvailableError", "FileNotFoundError",
                "UnknownGeneratorError")


def _error(exc: BaseException) -> int:
    for line in str(exc).splitlines() or [type(exc).__name__]:
        print(f"specdec bench: error: {line}", file=sys.stderr)
    return 2


def cmd_report(argv: list[str]) -> int:
    from .report import write_report

    parser = argparse.ArgumentParser(prog="specdec bench report",
                                     description="Rebuild report.md and the plots from DIR/results.jsonl.")
    parser.add_argument("dir", type=Path, help="a benchmark output directory (holds run.json, results.jsonl)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.dir)
    except FileNotFoundError as exc:
        return _error(exc)
    print(path)
    return 0


def cmd_run(argv: list[str]) -> int:
    from .config import load_config
    from .report import write_report
    from .runner import RESULTS_FILE, default_out_dir, run_benchmark

    parser = argparse.ArgumentParser(prog="specdec bench", description=(
        "Run a YAML benchmark config (resumes an interrupted run of the same config). "
        "`specdec bench report DIR` rebuilds a report."))
    parser.add_argument("config", type=Path, help="benchmark config, e.g. benchmarks/configs/quick.yaml")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: benchmarks/results/<config stem>)")
    parser.add_argument("--fresh", action="store_true", help="discard this directory's earlier results and start over")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    out_dir = args.out or default_out_dir(args.config)
    try:
        config = load_config(args.config)
        result = run_benchmark(config, config_file=args.config, out_dir=out_dir, fresh=args.fresh,
                               progress=not args.no_progress)
    except KeyboardInterrupt:
        if (out_dir / RESULTS_FILE).exists():
            try:
                write_report(out_dir)
            except Exception as exc:  # noqa: BLE001 - the rows are safe; a report failure must not hide that
                print(f"specdec bench: partial report failed: {exc}", file=sys.stderr)
        if (out_dir / RESULTS_FILE).exists():
            print(f"\nspecdec bench: interrupted; finished rows are kept in {out_dir / RESULTS_FILE}. "
                  f"Run the same command again to resume.", file=sys.stderr)
        else:
            print("\nspecdec bench: interrupted before the first row; nothing was written.", file=sys.stderr)
        return 130
    except Exception as exc:
        if type(exc).__name__ in USAGE_ERRORS:
            return _error(exc)
        raise
    print(f"{result.rows_new} new rows ({result.rows_done_before} already done) of {result.rows_total}; "
          f"report: {result.report}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        return cmd_report(argv[1:])
    return cmd_run(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
