"""The README's table of current figures, generated from the committed benchmark results.

Each row is one method of one committed run (``benchmarks/results/<config>/``), summarised with
the bench's own definitions (``specdec.bench.summary``): the overall speedup over the run's
reference, split where the run measured specdec's loop with no drafts on the same engine into that
loop's speedup (the engine's share) and the method's over it (speculation's), its range over the
subtasks, the mean accepted length, how many outputs were identical to the reference's, and the
machine its ``run.json`` names. Nothing is typed by hand:

    python benchmarks/figures.py            # print the table
    python benchmarks/figures.py --write    # replace it in README.md between its markers
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.bench.report import load_run, machine_line
from specdec.bench.results import OVERALL
from specdec.bench.summary import summaries

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
START, END = "<!-- figures:start", "<!-- figures:end -->"

#: (results folder, method name, what the row shows)
SHOWN = (
    ("quick", "pl", "`prompt_lookup`, defaults"),
    ("spec_bench_smollm2", "pl", "`prompt_lookup`, defaults"),
    ("self_draft_eager_smollm2", "self_draft", "`self_draft`, defaults (copy + lookup), no warm-up (eager copy)"),
    ("self_draft_eager_smollm2_avx2", "self_draft", "`self_draft`, defaults (copy + lookup), no warm-up (eager copy)"),
    ("structured_smollm2", "pl", "`prompt_lookup`, defaults, each output in its JSON schema"),
    ("engine_share_smollm2", "pl_auto", "`prompt_lookup`, defaults"),
    ("eagle3_smollm2", "eagle3", "`eagle3`, the shipped head, chains"),
    ("llama_cpp_smollm2", "lcpp_f32", "the peer: llama.cpp, F32 file, plain (not specdec)"),
    ("llama_cpp_smollm2", "pl_lcpp", "`prompt_lookup` on `engine=\"llama_cpp\"` (F32 file)"),
)


def row(folder: str, method: str, what: str) -> list[str]:
    meta, rows = load_run(RESULTS / folder)
    every = summaries(meta, rows)
    mine = [s for s in every if s.method == method]
    overall = next(s for s in mine if s.subtask == OVERALL)
    by_subtask = sorted((s.speedup, s.subtask) for s in mine if s.subtask != OVERALL and s.speedup is not None)
    spread = f"{by_subtask[0][0]:.2f}x ({by_subtask[0][1]}) to {by_subtask[-1][0]:.2f}x ({by_subtask[-1][1]})"
    agreement = overall.agreement
    identical = f"{agreement.identical} of {agreement.compared}" if agreement is not None else "n/a"
    env, config = meta.get("environment", {}), meta["config"]
    engine = {m["name"]: m.get("engine", "auto") for m in config["methods"]}
    loop = next((s for s in every if s.subtask == OVERALL and s.generator == "none"
                 and engine[s.method] == engine[method] and s.speedup), None)
    split = (f"{loop.speedup:.2f}x x {overall.speedup / loop.speedup:.2f}x" if loop is not None and loop.method != method
             else "not measured")
    turns = sum(q["turns"] for q in meta["questions"])
    return [f"[`{folder}`](benchmarks/results/{folder}/report.md)", f"{config['target']}, {turns} turns", what,
            f"**{overall.speedup:.2f}x**", split, spread,
            f"{overall.mean_accepted_length:.2f}" if overall.mean_accepted_length is not None else "n/a",
            identical, f"{machine_line(env)}, {env.get('torch_threads', '?')} threads", meta.get("created", "?")[:10]]


def table() -> str:
    header = ["run", "target", "method", "speedup", "engine x speculation", "by subtask", "mean accepted length",
              "identical to `target.generate`", "machine", "date"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row(*shown)) + " |" for shown in SHOWN]
    return "\n".join(lines)


def write(readme: Path = README) -> None:
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    marker_line, _ = rest.split("\n", 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}{marker_line}\n{table()}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = parser.parse_args(argv)
    if args.write:
        write()
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
