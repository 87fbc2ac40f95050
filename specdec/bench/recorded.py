"""A greedy run read back without a model: its config, rows, and the reference method's turns
with the prompt ids each was called with. Under greedy decoding every method commits the same
tokens, so these fix what any drafter could have had accepted; the replay scripts start here
(``benchmarks/replay_policy.py``, ``benchmarks/suffix_ceiling.py``, ``benchmarks/lookup_followers.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import BenchConfig, load_config
from .questions import recorded_prompts
from .results import default_out_dir, is_batched


def add_run_arguments(parser, what: str = "a greedy run on a packaged model") -> None:
    """A replay script's two arguments for :func:`load_recorded_run`: the config, and ``--results``."""
    parser.add_argument("config", help=f"the YAML config of {what}")
    parser.add_argument("--results", help="its results directory (default: where `specdec bench` wrote them)")


@dataclass
class RecordedRun:
    config: BenchConfig
    folder: Path  # the results directory
    rows: list[dict]  # every row of its results.jsonl
    turns: list[dict]  # the reference method's (the config's first) one-row turns, by question and turn
    prompts: list[list[int]]  # the prompt ids each of those turns was called with


def load_recorded_run(config_file: str | Path, results: str | Path | None = None, tokenizer=None) -> RecordedRun:
    """The run of ``config_file`` from ``results`` (default: where ``specdec bench`` writes it); its
    prompts encoded with ``tokenizer`` (default: a packaged target's own, read from its GGUF file
    without its weights)."""
    config = load_config(config_file)
    folder = Path(results) if results else default_out_dir(Path(config_file))
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
    if tokenizer is None:
        from transformers import AutoTokenizer

        from ..gguf_read import gguf_parsed_once
        from ..models import packaged_location

        location, gguf = packaged_location(config.target)
        with gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(location, gguf_file=gguf)
    reference = config.methods[0].name
    turns = sorted((r for r in rows if r["method"] == reference and not is_batched(r)),
                   key=lambda r: (r["question_id"], r["turn"]))
    return RecordedRun(config, folder, rows, turns, recorded_prompts(config, Path(config_file).parent, turns, tokenizer))
