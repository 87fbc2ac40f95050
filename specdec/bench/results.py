"""A benchmark's output directory: where it is, its files, its row keys. Read by the runner and the report.

* :func:`default_out_dir`: ``<dir>/results/<config stem>/``, where ``<dir>`` is the config's folder,
  or that folder's parent when the folder is named ``configs`` (so ``benchmarks/configs/quick.yaml``
  writes to ``benchmarks/results/quick/``);
* :class:`ResultStore`: ``results.jsonl``, one JSON object per line, appended and synced row by row;
* :func:`row_key`, :func:`planned_keys`: which rows a run has written and which it will write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RESULTS_FILE = "results.jsonl"
RUN_FILE = "run.json"
REPORT_FILE = "report.md"
SPEEDUP_PNG = "speedup.png"
ACCEPTANCE_PNG = "acceptance_by_position.png"
FORWARD_COST_PNG = "forward_cost.png"
#: files this tool writes into an output directory (the only ones ``fresh`` removes)
OWN_FILES = (RESULTS_FILE, RUN_FILE, REPORT_FILE, SPEEDUP_PNG, ACCEPTANCE_PNG, FORWARD_COST_PNG)

#: the name of the all-subtasks group in summaries and tables
OVERALL = "overall"


def default_out_dir(config_path: str | Path) -> Path:
    """``<dir>/results/<stem>/``: ``<dir>`` is the config's folder, or its parent when that folder is
    named ``configs``. Never depends on the current directory."""
    path = Path(config_path).resolve()
    folder = path.parent.parent if path.parent.name == "configs" else path.parent
    return folder / "results" / path.stem


def shown_path(path: str | Path) -> str:
    """``path`` for a message: relative to the current directory when inside it, else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def is_batched(row: dict) -> bool:
    """A row of a batch-size > 1 pass (one row per batch) rather than one (question, turn)."""
    return int(row.get("batch_size", 1)) > 1


def row_key(row: dict) -> tuple:
    """(method, question_id, turn) for a batch-size-1 row; (method, "batch", batch_size, batch_index) for a batch."""
    if is_batched(row):
        return row["method"], "batch", int(row["batch_size"]), int(row["batch_index"])
    return row["method"], int(row["question_id"]), int(row["turn"])


def batch_groups(questions: list, batch_size: int) -> list[list]:
    """Questions grouped in order into batches of ``batch_size`` (the last one may be smaller)."""
    return [questions[i: i + batch_size] for i in range(0, len(questions), batch_size)]


def planned_keys(methods: list[tuple[str, bool]], questions: list[tuple[int, int]], batch_sizes: list[int]) -> set:
    """The :func:`row_key` of every row a complete run writes. ``methods``: (name, runs at batch size > 1)
    in config order; ``questions``: (question_id, number of turns)."""
    keys = set()
    for size in batch_sizes:
        if size == 1:
            keys |= {(name, qid, turn) for name, _ in methods for qid, turns in questions for turn in range(1, turns + 1)}
        else:
            batches = len(batch_groups(questions, size))
            keys |= {(name, "batch", size, i) for name, batched in methods if batched for i in range(batches)}
    return keys


class ResultStore:
    """``results.jsonl``: one JSON object per line, appended and synced row by row."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def load(self, repair: bool = False) -> list[dict]:
        """Rows in the file; with ``repair``, cut a torn last line (an interrupted write) off the file."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if repair and end < len(data):
            with self.path.open("r+b") as f:
                f.truncate(end)
        rows = []
        for line in data[:end].splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn line in the middle (two writers): skip it, its row is redone
        return rows

    def append(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
