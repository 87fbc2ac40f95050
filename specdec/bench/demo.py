"""``specdec demo``: the packaged bench config ``configs/demo.yaml``, run by the bench runner.

The command line's flags become fields of that config (:func:`demo_config`); the runner loads,
compiles, warms up and times both methods exactly as ``specdec bench`` does, and this module only
prints: one table line per prompt as its rows arrive, then the overall figures, every figure
from :mod:`.summary`. Results go to a temporary directory removed at the end, or to ``out``
(kept, with report.md; the same command resumes there). docs/benchmarks.md, "The demo".
"""

from __future__ import annotations

import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import yaml

from .config import BenchConfig, load_yaml, parse_config
from .questions import Question, load_selected_questions
from .report import load_run
from .results import OVERALL, first_difference, shown_path
from .runner import config_hash, prepare_out_dir, run_benchmark
from .runner_outdir import check_out_dir
from .summary import merged_stats, speedup, summaries, tokens_per_second

#: the packaged config (package data: see pyproject.toml)
DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo.yaml"
#: the name the demo's config file gets in its output directory (the report's title)
CONFIG_NAME = "demo.yaml"


def packaged_config() -> dict:
    """``configs/demo.yaml`` as a mapping."""
    return load_yaml(DEMO_CONFIG.read_text(), str(DEMO_CONFIG))


def default_categories() -> list[str]:
    """The Spec-Bench categories the packaged config asks."""
    return list(packaged_config()["dataset"]["categories"])


@dataclass(frozen=True)
class DemoSettings:
    """What the command line asks for; None keeps the packaged config's value."""

    method: dict  # the speculative method: name, generator, options and, for a draft model, draft
    target: str | None = None
    dataset: str | None = None
    categories: list[str] | None = None
    per_category: int | None = None
    max_new_tokens: int | None = None
    threads: int | None = None
    device: str | None = None
    dtype: str | None = None
    cache_implementation: str = "dynamic"
    compile: bool = False


def demo_config(settings: DemoSettings) -> BenchConfig:
    """The packaged config with the command line's settings; a :class:`ConfigError` when they cannot work."""
    data = packaged_config()
    top = {"target": settings.target, "threads": settings.threads, "device": settings.device, "dtype": settings.dtype}
    data.update({k: v for k, v in top.items() if v is not None})
    dataset = {"path": str(Path(settings.dataset).resolve()) if settings.dataset else None,
               "categories": settings.categories, "first_per_category": settings.per_category}
    data["dataset"].update({k: v for k, v in dataset.items() if v is not None})
    if settings.max_new_tokens is not None:
        data["generation"]["max_new_tokens"] = settings.max_new_tokens
    cache = {"cache_implementation": settings.cache_implementation, "compile": settings.compile}
    baseline = next(m for m in data["methods"] if m["generator"] == "baseline")
    data["methods"] = [{**baseline, **cache}, {**settings.method, **cache}]
    return parse_config(data, "demo")


@contextmanager
def _output_dir(out: str | Path | None) -> Iterator[Path]:
    """``out`` (created, kept), or a temporary directory removed on the way out."""
    if out is not None:
        check_out_dir(Path(out))
        Path(out).mkdir(parents=True, exist_ok=True)
        yield Path(out)
        return
    with tempfile.TemporaryDirectory(prefix="specdec-demo-") as folder:
        yield Path(folder)


class _PromptTable:
    """Prints each prompt's line once both its rows are in (the reference's comes first), and says on
    ``status`` how long each method took."""

    HEADER = (f"{'question':>10} {'category':>14} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} "
              f"{'accepted len':>13} {'identical':>10}")

    def __init__(self, questions: list[Question], reference: str, status: Callable[[str], None]):
        self.index = {q.question_id: i for i, q in enumerate(questions, 1)}
        self.count, self.reference, self.status = len(questions), reference, status
        self.plain: dict[int, dict] = {}
        self.printed = False

    def __call__(self, row: dict) -> None:
        qid = row["question_id"]
        where = f"[{self.index[qid]}/{self.count}] {row['category']} (question {qid})"
        what = "plain decoding" if row["method"] == self.reference else "speculative decoding"
        self.status(f"{where}: {what} took {row['seconds']:.1f}s")
        if row["method"] == self.reference:
            self.plain[qid] = row
            return
        base = self.plain[qid]
        stats = merged_stats([row])
        if not self.printed:
            print(self.HEADER, flush=True)
            self.printed = True
        print(f"{qid:>10} {row['category']:>14} {tokens_per_second([base]):>12.1f} {tokens_per_second([row]):>11.1f} "
              f"{speedup([row], [base]) or 0.0:>7.2f}x "
              f"{stats.mean_accepted_length if stats is not None else float('nan'):>13.2f} "
              f"{str(first_difference(row['output_ids'], base['output_ids']) is None):>10}", flush=True)


def run_demo(config: BenchConfig, *, out: str | Path | None = None,
             status: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)) -> bool:
    """Run the demo config; print the table and the overall line; return whether every output was identical."""
    questions = load_selected_questions(config, DEMO_CONFIG.parent)
    reference, method = config.reference_method.name, config.methods[-1].name
    with _output_dir(out) as folder:
        prepare_out_dir(folder, config_hash(config, questions), fresh=False)  # before writing anything there
        config_file = folder / CONFIG_NAME
        config_file.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        run_benchmark(config, config_file=config_file, out_dir=folder, progress=False,
                      on_row=_PromptTable(questions, reference, status), log=status)
        overall = next(s for s in summaries(*load_run(folder)) if s.method == method and s.subtask == OVERALL)
    status(f"results and report: {shown_path(folder)}" if out is not None else
           "the results and report.md were in a temporary directory, now removed (--out DIR keeps them)")
    identical = overall.agreement is not None and overall.agreement.identical == overall.agreement.compared
    print(f"\n{method} on {config.target}: speedup {overall.speedup or 0.0:.2f}x over plain decoding "
          f"({len(questions)} prompts, {config.generation.max_new_tokens} new tokens each); "
          f"outputs identical: {identical}", flush=True)
    return identical
