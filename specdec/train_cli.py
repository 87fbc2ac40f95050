"""``specdec train-head``: train a draft head for a target (docs/eagle3.md).

The core imports no plugin: the command finds the generator by name through the registry and
calls its ``train(target, tokenizer, out, settings)`` hook (a generator that can be trained
defines it; ``eagle3`` does), with the settings it declares in ``train_settings(**flags)``.
Building the parser imports neither torch nor transformers.
"""

from __future__ import annotations


from .cli_args import output_folder


def add_parser(sub, positive_int, positive_float, threads) -> None:
    t = sub.add_parser("train-head", help="train a draft head (EAGLE-3) for a target on its own answers")
    t.add_argument("--target", default="smollm2-135m", help="model name (see `specdec list`) or a local folder")
    t.add_argument("--out", required=True, metavar="DIR", type=output_folder,
                   help="where the answers, checkpoints and the head (DIR/head) go; a rerun resumes from it")
    t.add_argument("--steps", type=positive_int, default=None, help="stop after N optimizer steps (in all runs)")
    t.add_argument("--minutes", type=positive_float, default=None,
                   help="stop after M minutes of training (in all runs together)")
    t.add_argument("--prompts", default=None, metavar="FILE",
                   help="JSON lines, each {\"turns\": [...]} or {\"prompt\": ...}, to train on (default: the "
                        "Spec-Bench questions no benchmark config evaluates, and the standard library's docs)")
    t.add_argument("--generator", default="eagle3", help="the generator whose head is trained (default eagle3)")
    t.add_argument("--draft-vocab", type=positive_int, default=None, help="draft vocabulary size (default 8192)")
    t.add_argument("--depth", type=positive_int, default=None, help="training-time-test steps (default 4)")
    t.add_argument("--batch-tokens", type=positive_int, default=None, help="tokens per step (default 4096)")
    t.add_argument("--lr", type=positive_float, default=None, help="peak learning rate (default 1e-3)")
    t.add_argument("--answer-tokens", type=positive_int, default=None,
                   help="new tokens per self-distilled answer (default 256)")
    t.add_argument("--synthetic-prompts", type=positive_int, default=None, metavar="N",
                   help="also answer N user turns the target writes itself (a chat model; default 0)")
    t.add_argument("--threads", type=threads, default="auto", help="intra-op threads: a number, or 'auto'")
    t.set_defaults(func=cmd_train_head)


#: flag -> the settings field it sets
FLAGS = {"steps": "steps", "minutes": "minutes", "draft_vocab": "draft_vocab_size", "depth": "depth",
         "batch_tokens": "batch_tokens", "lr": "lr", "answer_tokens": "answer_tokens",
         "synthetic_prompts": "synthetic_prompts"}


def cmd_train_head(args) -> int:
    from .models import check_model_name, load_model
    from .registry import get_candidate_generator
    from .threads import configure_threads

    if args.steps is None and args.minutes is None:
        raise ValueError("train-head needs a limit: --steps N, --minutes M, or both")
    generator = get_candidate_generator(args.generator)
    if not callable(getattr(generator, "train", None)):
        raise ValueError(f"generator {args.generator!r} has nothing to train (eagle3 does)")
    check_model_name(args.target)
    settings = generator.train_settings(**{field: getattr(args, flag) for flag, field in FLAGS.items()
                                           if getattr(args, flag) is not None})
    prompts = read_prompts(args.prompts) if args.prompts is not None else None
    configure_threads(args.threads)
    target, tokenizer = load_model(args.target)
    target.eval()
    folder = generator.train(target, tokenizer, args.out, settings, prompts=prompts, target_name=args.target)
    print(folder)
    return 0


def read_prompts(path) -> list[dict]:
    """``--prompts FILE``: JSON lines of ``{"turns": [...]}`` or ``{"prompt": "..."}`` -> prompt records
    ``{"key", "turns"}``; a line that is neither is refused with its number."""
    import json
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--prompts: no such file: {path}")
    records = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"--prompts {path}, line {number}: not JSON ({error.msg})") from None
        turns = row.get("turns", [row["prompt"]] if isinstance(row, dict) and "prompt" in row else None) \
            if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"--prompts {path}, line {number}: expected {{\"turns\": [text, ...]}} or "
                             f"{{\"prompt\": text}}")
        records.append({"key": str(row.get("key", f"line:{number}")), "turns": turns})
    if not records:
        raise ValueError(f"--prompts {path}: no prompts")
    return records
