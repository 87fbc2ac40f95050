"""A newcomer's first calls: ``SpecDecoder(target, draft).generate(ids, max_new_tokens=64)`` in a
fresh process against plain decoding of the same call.

    python benchmarks/first_call.py [--draft self_draft] [--max-new-tokens 64] [--calls 4] [--trials 3]

Each trial is a new Python process whose weight cache holds the de-quantized target (loading is
not timed) but no choice measured earlier (``weights="auto"`` measures on its first call, as on
a new machine). In it: plain ``target.generate`` twice (the second, warmed-up one is the
reference), then ``--calls`` calls of the same prompt through ``SpecDecoder(target, draft)``,
each timed whole (setup, calibration and any compiling included). Ratios are call time / plain
time; the median over trials is reported with its range. Results go to ``--out`` (results.json,
report.md), with the machine named.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TRIAL = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from specdec import SpecDecoder, load_model
from specdec.prompts import encode_chat, load_questions
target, tok = load_model("smollm2-135m")
question = next(q for q in load_questions() if q["category"] == sys.argv[2])
ids = encode_chat(tok, [{"role": "user", "content": question["turns"][0]}])
new = int(sys.argv[3])
plain = []
for _ in range(2):
    started = time.perf_counter()
    want = target.generate(ids, max_new_tokens=new, do_sample=False)
    plain.append(time.perf_counter() - started)
calls, identical, choices = [], [], {}
for _ in range(int(sys.argv[5])):
    started = time.perf_counter()
    if not calls:
        decoder = SpecDecoder(target, sys.argv[4], tokenizer=tok)
    out = decoder.generate(ids, max_new_tokens=new, do_sample=False)
    calls.append(time.perf_counter() - started)
    identical.append(bool(torch.equal(out.sequences, want)))
    choices.update(out.stats.choices)
print(json.dumps({"plain": plain, "calls": calls, "identical": identical, "choices": choices}))
"""


def weight_root() -> Path:
    from specdec.weight_cache import weight_cache_root

    root = weight_cache_root()
    if root is None:
        sys.exit("the weight cache is off (SPECDEC_NO_WEIGHT_CACHE): a trial would de-quantize the model each time")
    return root


def trial(args, root: Path) -> dict:
    """One fresh process whose weight cache holds the target's weights (links to ``root``'s) and
    nothing measured (no ``auto-weights``)."""
    with tempfile.TemporaryDirectory(prefix="specdec-first-") as fresh:
        weights = Path(fresh) / root.name
        weights.mkdir()
        for entry in root.iterdir():
            if entry.name != "auto-weights":
                os.symlink(entry, weights / entry.name)
        done = subprocess.run([sys.executable, "-c", TRIAL, str(args.threads), args.category, str(args.max_new_tokens),
                               args.draft, str(args.calls)], env={**os.environ, "SPECDEC_CACHE": fresh},
                              capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"a trial failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="self_draft")
    parser.add_argument("--category", default="writing", help="Spec-Bench category of the prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "first_call"))
    args = parser.parse_args()
    from specdec.machine import describe

    root = weight_root()
    trials = [trial(args, root) for _ in range(args.trials)]
    ratios = [[c / t["plain"][1] for c in t["calls"]] for t in trials]
    lines = [f"# First calls: `SpecDecoder(target, \"{args.draft}\")` in a fresh process", "",
             f"Machine: {describe()}; torch {__import__('torch').__version__}, {args.threads} threads; smollm2-135m; "
             f"one Spec-Bench `{args.category}` prompt, {args.max_new_tokens} new tokens, greedy; {args.trials} trials, "
             "each a fresh process with nothing measured before (no cached `weights=\"auto\"` choice).", "",
             f"Command: `python benchmarks/first_call.py --draft {args.draft} --max-new-tokens {args.max_new_tokens} "
             f"--calls {args.calls} --trials {args.trials} --threads {args.threads}`", "",
             "Call time / plain `generate` time (its second call), median over trials [range]; below 1.0 is faster.", "",
             "| call | time / plain | identical to plain |", "| --- | --- | --- |"]
    for i in range(args.calls):
        values = [r[i] for r in ratios]
        same = sum(t["identical"][i] for t in trials)
        lines.append(f"| {i + 1} | {statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}] | "
                     f"{same} of {len(trials)} |")
    lines += ["", f"Plain call: {statistics.median(t['plain'][1] for t in trials):.2f} s (median). "
              f"Choices: {trials[0]['choices']}."]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "machine": describe(), "trials": trials},
                                                 indent=1))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
