"""Several sampled sequences per prompt (``num_return_sequences``) on SmolLM2-135M: ``target.generate``
against ``SpecDecoder(target, draft)``, whose target prefills each prompt once, and against the same
decoder prefilling every row as ``generate()`` does (the ablation: ``shared_prefix`` switched off).

    python benchmarks/several_sequences.py [--draft prompt_lookup] [--n 4] [--max-new-tokens 96] [--rounds 2]

One Spec-Bench first turn per category (the ``--question``-th), through the chat template. Each
round runs the three methods on every prompt in turn, in one process, each call seeded alike.
Tokens/s counts each row's new tokens up to its EOS; a method's speedup for a prompt is its
tokens/s over ``target.generate``'s in the same round, and the report gives the median over
rounds per prompt and over all (prompt, round) pairs. Results go to ``--out`` (results.json,
report.md) with the machine named.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

CATEGORIES = ("summarization", "rag", "translation", "qa", "math_reasoning", "writing")


def new_tokens(sequences: torch.Tensor, width: int, eos: set[int]) -> int:
    """New tokens of every row, each up to and including its first EOS."""
    total = 0
    for row in sequences[:, width:].tolist():
        total += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="prompt_lookup")
    parser.add_argument("--n", type=int, default=4, help="num_return_sequences")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--question", type=int, default=1, help="which question of each category (0-based)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "several_sequences"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import specdec.run
    from specdec import SpecDecoder, load_model
    from specdec.machine import describe
    from specdec.modelinfo import token_id_list
    from specdec.prompts import encode_chat, load_questions

    target, tok = load_model("smollm2-135m")
    questions = load_questions()
    prompts = {c: encode_chat(tok, [{"role": "user", "content": [q for q in questions if q["category"] == c]
                                     [args.question]["turns"][0]}]) for c in CATEGORIES}
    eos = set(token_id_list(target.generation_config.eos_token_id))
    decoder = SpecDecoder(target, args.draft, tokenizer=tok)
    shared = specdec.run.shared_prefix
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature,
                    num_return_sequences=args.n)

    def call(method: str, ids: torch.Tensor, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)  # generate()'s draws
        if method == "generate":
            return target.generate(ids, **settings)
        # the ablation prefills every row, as generate() does
        specdec.run.shared_prefix = shared if method == "specdec" else (lambda *args: None)
        return decoder.generate(ids, **settings, generator=torch.Generator().manual_seed(seed)).sequences

    decoder.generate(prompts[CATEGORIES[0]], max_new_tokens=4)  # one-time work (calibration) untimed
    rows = []
    for round_ in range(args.rounds):
        for category, ids in prompts.items():
            for method in ("generate", "specdec", "specdec, every row prefilled"):
                started = time.perf_counter()
                sequences = call(method, ids, round_)
                seconds = time.perf_counter() - started
                rows.append({"round": round_, "category": category, "prompt_tokens": ids.shape[1], "method": method,
                             "seconds": seconds, "new_tokens": new_tokens(sequences, ids.shape[1], eos)})
                print(json.dumps(rows[-1]), flush=True)
    specdec.run.shared_prefix = shared
    write(args, rows, describe())


def speedups(rows: list[dict], method: str) -> dict[tuple[int, str], float]:
    """(round, category) -> ``method``'s tokens/s over ``generate``'s."""
    rate = {(r["round"], r["category"], r["method"]): r["new_tokens"] / r["seconds"] for r in rows}
    return {(r, c): rate[r, c, method] / rate[r, c, "generate"] for r, c, m in rate if m == method}


def write(args, rows: list[dict], machine: str) -> None:
    names = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "generate"]
    ratios = {name: speedups(rows, name) for name in names}
    lengths = {r["category"]: r["prompt_tokens"] for r in rows}
    lines = [f"# Several sequences per prompt: `num_return_sequences={args.n}`, `{args.draft}`", "",
             f"Machine: {machine}; torch {torch.__version__}, {args.threads} threads; smollm2-135m; one Spec-Bench "
             f"first turn per category (question {args.question}), chat template; sampling at temperature "
             f"{args.temperature}, {args.max_new_tokens} new tokens; {args.rounds} rounds, methods in turn.", "",
             f"Command: `python benchmarks/several_sequences.py --draft {args.draft} --n {args.n} --max-new-tokens "
             f"{args.max_new_tokens} --rounds {args.rounds} --threads {args.threads}`", "",
             "Tokens/s over `target.generate(..., num_return_sequences=n)`'s in the same round, median over rounds.",
             "", "| category | prompt tokens | " + " | ".join(f"`{n}`" for n in names) + " |",
             "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for category, width in lengths.items():
        cells = [statistics.median(v for (r, c), v in ratios[n].items() if c == category) for n in names]
        lines.append(f"| {category} | {width} | " + " | ".join(f"{x:.2f}x" for x in cells) + " |")
    lines.append("| all (median of prompt x round) | | " + " | ".join(
        f"**{statistics.median(ratios[n].values()):.2f}x**" for n in names) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "machine": machine, "rows": rows}, indent=1))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
