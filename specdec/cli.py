"""Command line: ``specdec generate | demo | list | bench | train-head`` (``train_cli.py``).

Modules are imported where a command needs them: this one, and building its parser, import
neither torch nor transformers (``specdec --help`` answers at once on a busy machine, where those
imports take seconds), and ``specdec list`` reads the generators' descriptions from their
entry points' source without importing them.

This module builds the parser and runs the command asked for; the arguments' checks and the
decoder they describe are :mod:`specdec.cli_args`, the commands :mod:`specdec.cli_commands`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cli_args import device_name, output_folder, positive_float, positive_int, probability, thread_count
from .cli_commands import cmd_bench, cmd_demo, cmd_generate, cmd_list, generator_summaries
from .names import DTYPE_NAMES, ENTRY_POINT_GROUP
from .names import ENGINE_CHOICES as ENGINE_NAMES  # torch-free, so building the parser imports no torch
from .train_cli import add_parser as add_train_parser

#: what other modules and the tests read here
__all__ = ["DTYPE_NAMES", "ENGINE_NAMES", "ENTRY_POINT_GROUP", "build_parser", "generator_summaries", "main"]


# -- the parser ---------------------------------------------------------------------------------------
def _demo_defaults() -> dict:
    """The packaged demo config's ``dataset`` section, read without importing the bench (for ``--help``)."""
    import yaml

    return yaml.safe_load((Path(__file__).parent / "bench" / "configs" / "demo.yaml").read_text())["dataset"]


def _common_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of every command that runs models: what runs, and where and how."""
    p.add_argument("--target", default="smollm2-135m", help="model name (see `specdec list`) or a local folder")
    p.add_argument("--draft", default="prompt_lookup", help="generator name, draft model name, or 'none'")
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="generator option, repeatable (numbers, true/false, else text)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--threads", type=thread_count, default="auto",
                   help="intra-op threads: a number, or 'auto' (default): the cores idle right now")
    p.add_argument("--device", type=device_name, default="cpu",
                   help="where the models run: cpu (default), cuda, cuda:N, or auto (cuda when there is one)")
    p.add_argument("--dtype", choices=list(DTYPE_NAMES), default="float32",
                   help="the models' weights (default float32)")
    p.add_argument("--cache-implementation", choices=["dynamic", "static"], default="dynamic",
                   help="key/value caches: dynamic (default) or static (allocated once; needed by --compile)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the forwards (with --cache-implementation static), before timing anything")


def _generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt")
    _common_arguments(g)
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--engine", choices=list(ENGINE_NAMES), default="auto",
                   help="what runs the forwards: auto (default), cpu (specdec's CPU forwards where they pay) or "
                        "eager (the model's own forward); printed with the first call's choices")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=positive_float, default=None, help="with --sample (default 1.0)")
    g.add_argument("--top-k", type=positive_int, default=None, help="with --sample")
    g.add_argument("--top-p", type=probability, default=None, help="with --sample")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-return-sequences", type=positive_int, default=1, metavar="N",
                   help="with --sample: N texts for the prompt, each printed under its number")
    g.set_defaults(func=cmd_generate)


def _demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="speedup over plain decoding on a few Spec-Bench prompts")
    _common_arguments(d)
    demo = _demo_defaults()
    d.add_argument("--per-category", type=positive_int, default=None,
                   help=f"the first N questions of each category (default: {demo['first_per_category']})")
    d.add_argument("--categories", default=None,
                   help=f"comma-separated Spec-Bench categories (default: {','.join(demo['categories'])})")
    d.add_argument("--dataset", default=None, help="Spec-Bench question.jsonl (default: $SPECDEC_SPEC_BENCH, else "
                        "../shared/spec_bench/question.jsonl beside the checkout)")
    d.add_argument("--out", default=None, metavar="DIR", type=output_folder,
                   help="keep the results and a full report.md in DIR (default: a temporary directory, removed "
                        "at the end)")
    d.set_defaults(func=cmd_demo)


def _run(args) -> int:
    """``args.func(args)``; a usage error (a bad name, value or file) is one line and exit status 2."""
    try:
        return args.func(args)
    except (ValueError, TypeError, KeyError, FileNotFoundError, RuntimeError) as exc:
        if type(exc).__name__ in ("UsageError", "ModelNotAvailableError", "UnknownGeneratorError", "ValueError",
                                  "FileNotFoundError"):
            print(f"specdec: error: {exc}", file=sys.stderr)
            return 2
        raise


def build_parser() -> argparse.ArgumentParser:
    """The ``specdec`` command's parser (``bench`` parses its own arguments: :mod:`specdec.bench.cli`).
    Building it imports neither torch nor transformers (the commands import what they use)."""
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _demo_parser(sub)
    sub.add_parser("list", help="list candidate generators and packaged models").set_defaults(func=cmd_list)
    sub.add_parser("bench", help="run a YAML benchmark config: specdec bench CONFIG.yaml | specdec bench report DIR")
    add_train_parser(sub, positive_int, positive_float, thread_count)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "dataset", 1) is None:
        from .prompts import DEFAULT_SPEC_BENCH

        args.dataset = DEFAULT_SPEC_BENCH
    return _run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
