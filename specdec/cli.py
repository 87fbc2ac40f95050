"""Command line: ``specdec generate | demo | list | bench``."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise SystemExit(f"--option expects key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        options[key] = value
    return options


def _build_decoder(target, tokenizer, draft: str | None, options: dict):
    from .decoder import SpecDecoder
    from .models import PACKAGED_MODELS, load_model
    from .registry import available_generators

    if draft is None or draft == "none":
        return SpecDecoder(target, None, tokenizer=tokenizer)
    if draft in available_generators():
        try:
            return SpecDecoder(target, draft, tokenizer=tokenizer, **options)
        except TypeError as exc:
            raise ValueError(f"{exc} (generators that draft with a model take the model's name as --draft, "
                             "e.g. --draft gemma3-270m)") from None
    if draft in PACKAGED_MODELS or draft.startswith("tiny-random:") or "/" in draft:
        draft_model, draft_tokenizer = load_model(draft)
        return SpecDecoder(target, draft_model, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer, **options)
    from .registry import get_candidate_generator

    get_candidate_generator(draft)  # raises with "did you mean"
    raise AssertionError  # pragma: no cover


def cmd_generate(args) -> int:
    from .models import load_model
    from .prompts import encode_chat

    torch.set_num_threads(args.threads)
    target, tokenizer = load_model(args.target)
    decoder = _build_decoder(target, tokenizer, args.draft, _parse_options(args.option))
    if args.raw or not getattr(tokenizer, "chat_template", None):
        input_ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    else:
        input_ids = encode_chat(tokenizer, [{"role": "user", "content": args.prompt}])
    generator = torch.Generator().manual_seed(args.seed) if args.sample else None
    out = decoder.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, generator=generator)
    print(tokenizer.decode(out.sequences[0, input_ids.shape[1]:], skip_special_tokens=True))
    s = out.stats
    print(f"\n-- {s.tokens_per_second:.1f} tokens/s | mean accepted length {s.mean_accepted_length:.2f} | "
          f"acceptance rate {s.acceptance_rate:.1%} | {s.committed_tokens} tokens in {s.total_seconds:.2f}s",
          file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    """Plain decoding (target.generate) vs speculative decoding on a few Spec-Bench prompts, side by side."""
    from .models import load_model
    from .prompts import encode_chat, load_questions

    torch.set_num_threads(args.threads)
    print(f"loading {args.target} ...", flush=True)
    target, tokenizer = load_model(args.target)
    questions = load_questions(args.dataset)
    picked = []
    for category in ("summarization", "rag", "coding", "translation"):
        picked += [q for q in questions if q["category"] == category][: args.per_category]
    spec = _build_decoder(target, tokenizer, args.draft, _parse_options(args.option))

    def plain(ids):  # the baseline is transformers' own greedy decoding
        return target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)

    warm = encode_chat(tokenizer, [{"role": "user", "content": "Hello"}])
    target.generate(warm, max_new_tokens=4, do_sample=False), spec.generate(warm, max_new_tokens=4)
    total_plain = total_spec = 0.0
    all_same = True
    print(f"{'question':>10} {'category':>14} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'accepted len':>13} {'identical':>10}")
    for q in picked:
        ids = encode_chat(tokenizer, [{"role": "user", "content": q["turns"][0]}])
        t0 = time.perf_counter()
        ref = plain(ids)
        t1 = time.perf_counter()
        out = spec.generate(ids, max_new_tokens=args.max_new_tokens)
        t2 = time.perf_counter()
        same = torch.equal(ref, out.sequences)
        all_same &= same
        total_plain, total_spec = total_plain + (t1 - t0), total_spec + (t2 - t1)
        n = out.sequences.shape[1] - ids.shape[1]
        print(f"{q['question_id']:>10} {q['category']:>14} {n / (t1 - t0):>12.1f} {n / (t2 - t1):>11.1f} "
              f"{(t1 - t0) / (t2 - t1):>7.2f}x {out.stats.mean_accepted_length:>13.2f} {str(same):>10}", flush=True)
    print(f"\n{args.draft} on {args.target}: speedup {total_plain / total_spec:.2f}x over plain decoding "
          f"({len(picked)} prompts, {args.max_new_tokens} new tokens each); outputs identical: {all_same}")
    return 0 if all_same else 1


def cmd_list(args) -> int:
    from .models import PACKAGED_MODELS, TINY_ARCHS
    from .registry import available_generators, get_candidate_generator

    print("candidate generators:")
    for name in available_generators():
        cls = get_candidate_generator(name)
        doc = (cls.__module__ and sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
        print(f"  {name:<16} {doc[0] if doc else ''}")
    print("packaged models:")
    for entry in PACKAGED_MODELS.values():
        print(f"  {entry.name:<16} {entry.description}  [{entry.install}]")
    print(f"  tiny-random:<arch>  random test models, arch in {', '.join(TINY_ARCHS)}")
    return 0


def cmd_bench(argv: list[str]) -> int:
    from .bench.cli import main as bench_main

    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--target", default="smollm2-135m", help="model name (see `specdec list`) or a local folder")
        p.add_argument("--draft", default="prompt_lookup", help="generator name, draft model name, or 'none'")
        p.add_argument("--option", action="append", metavar="KEY=VALUE", help="generator option, repeatable")
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--threads", type=int, default=2)

    g = sub.add_parser("generate", help="generate text for one prompt")
    common(g)
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="speedup over plain decoding on a few Spec-Bench prompts")
    common(d)
    d.add_argument("--per-category", type=int, default=1)
    d.add_argument("--dataset", default=None, help="Spec-Bench question.jsonl (default: ../shared/spec_bench)")
    d.set_defaults(func=cmd_demo)

    sub.add_parser("list", help="list candidate generators and packaged models").set_defaults(func=cmd_list)
    sub.add_parser("bench", help="run a YAML benchmark config: specdec bench CONFIG.yaml | specdec bench report DIR")
    args = parser.parse_args(argv)
    if getattr(args, "dataset", 1) is None:
        from .prompts import DEFAULT_SPEC_BENCH

        args.dataset = DEFAULT_SPEC_BENCH
    try:
        return args.func(args)
    except (ValueError, TypeError, KeyError, FileNotFoundError, RuntimeError) as exc:
        if type(exc).__name__ in ("ModelNotAvailableError", "UnknownGeneratorError", "ValueError", "FileNotFoundError"):
            print(f"specdec: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
