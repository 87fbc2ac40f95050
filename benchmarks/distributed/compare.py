"""Compare the outputs of two benchmark runs row by row: a sharded run against a single-process run.

    python benchmarks/distributed/compare.py benchmarks/results/quick benchmarks/results/quick_tp

Rows are matched by (method, question, turn) and, for batches, (method, batch size, batch index).
Prints, per method, how many rows have identical output ids and, for each differing row, where the
first difference is; with ``--coordination`` the messages the sharded run's specdec methods
exchanged (per step: bytes each rank sent into the all-reduce, and seconds waiting in it). Exit
status 1 if any row differs or is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def rows(folder: Path) -> dict[tuple, dict]:
    out = {}
    for line in (folder / "results.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            key = ((row["method"], "batch", row["batch_size"], row["batch_index"]) if "batch_size" in row
                   else (row["method"], row["question_id"], row["turn"]))
            out[key] = row
    return out


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def coordination(sharded: dict[tuple, dict]) -> dict[str, dict[str, float]]:
    """Per method: messages, bytes and seconds of the ranks' coordination, per step."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (method, *_), row in sharded.items():
        counts = (row.get("stats") or {}).get("coordination")
        if counts:
            for name, value in counts.items():
                totals[method][name] += value
    return {m: {"steps": t["steps"], "messages_per_step": t["messages"] / max(t["steps"], 1),
                "bytes_per_step": t["bytes"] / max(t["steps"], 1),
                "ms_per_step": 1000 * t["seconds"] / max(t["steps"], 1)} for m, t in totals.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", type=Path, help="results of the single-process run")
    parser.add_argument("sharded", type=Path, help="results of the sharded run")
    parser.add_argument("--coordination", action="store_true", help="also print the messages per step")
    args = parser.parse_args(argv)
    reference, sharded = rows(args.reference), rows(args.sharded)
    same, differing = defaultdict(int), []
    for key, row in sorted(sharded.items(), key=lambda item: str(item[0])):
        if key not in reference:
            differing.append((key, "missing from the reference"))
            continue
        diff = first_difference(reference[key]["output_ids"], row["output_ids"])
        if diff is None:
            same[key[0]] += 1
        else:
            differing.append((key, f"first difference at new token {diff}"))
    missing = [key for key in reference if key not in sharded and key[0] in {k[0] for k in sharded}]
    for method in sorted({k[0] for k in sharded}):
        total = sum(1 for k in sharded if k[0] == method)
        print(f"{method:14s} {same[method]}/{total} rows identical")
    for key, what in differing:
        print(f"  {key}: {what}")
    for key in missing:
        print(f"  {key}: missing from the sharded run")
    if args.coordination:
        for method, numbers in coordination(sharded).items():
            print(f"{method:14s} " + ", ".join(f"{k} {v:.3g}" for k, v in numbers.items()))
    return 1 if differing or missing else 0


if __name__ == "__main__":
    sys.exit(main())
