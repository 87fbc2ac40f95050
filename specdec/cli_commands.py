"""The ``specdec`` commands that run: ``generate``, ``demo``, ``list`` and ``bench``.

Each imports what it uses when it runs. ``--device``, ``--dtype``, ``--cache-implementation`` and
``--compile`` say where and how the models run (checked by :mod:`specdec.cli_args`); with
``--compile`` every forward is compiled (``SpecDecoder.warmup``, and for the demo's plain decoding
one untimed ``generate``) before anything is timed, and the seconds that took are printed apart.
``specdec list`` reads the generators' descriptions from their entry points' source without
importing them. What a command is doing goes to stderr, its result to stdout.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .cli_args import UsageError, build_decoder, check_placement, check_target, parse_options, plan_draft
from .names import ENTRY_POINT_GROUP


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

    if not args.sample and (args.temperature is not None or args.top_k is not None or args.top_p is not None
                            or args.num_return_sequences > 1):
        raise UsageError("--temperature, --top-k, --top-p and --num-return-sequences apply only with --sample")
    check_target(args.target)
    placement = check_placement(args)
    plan = plan_draft(args.draft, parse_options(args.option))
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
                    top_k=args.top_k, top_p=args.top_p, num_return_sequences=args.num_return_sequences
                    ) if args.sample else {"do_sample": False}  # not the config's
    seeded = lambda: torch.Generator(device=placement.device).manual_seed(args.seed) if args.sample else None  # noqa: E731
    _first_call(decoder, input_ids, min(2, args.max_new_tokens), dict(sampling, generator=seeded()))
    out = decoder.generate(input_ids, max_new_tokens=args.max_new_tokens, generator=seeded(), **sampling)
    texts = tokenizer.batch_decode(out.sequences[:, input_ids.shape[1]:], skip_special_tokens=True)
    print("\n\n".join(texts) if len(texts) == 1 else "\n\n".join(f"-- {i + 1}\n{t}" for i, t in enumerate(texts)))
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
    options = parse_options(args.option)
    plan = plan_draft(args.draft, options)
    if not Path(args.dataset).is_file():
        from .prompts import WHERE_SPEC_BENCH

        raise UsageError(f"Spec-Bench question file not found: {args.dataset} (pass --dataset). {WHERE_SPEC_BENCH}")
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
