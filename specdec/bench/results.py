"""A benchmark's output directory: where it is, its files, its row keys. Read by the runner and the report.

* :func:`default_out_dir`: ``<dir>/results/<config stem>/``, where ``<dir>`` is the config's folder,
  or that folder's parent when the folder is named ``configs`` (so ``benchmarks/configs/quick.yaml``
  writes to ``benchmarks/results/quick/``);
* :class:`ResultStore`: ``results.jsonl``, one JSON object per line, appended and synced row by row;
* :func:`row_key`, :func:`planned_keys`: which rows a run has written and which it will write;
* :func:`first_difference`, :func:`reference_outputs`, :class:`Agreement`: how a row's outputs
  compare with the reference method's, token for token. The one definition of "identical": the
  runner writes each row's ``first_difference`` with it, the report counts with it.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

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


# -- outputs against the reference -----------------------------------------------------------------
def first_difference(ids: list[int], reference: list[int]) -> int | None:
    """The first position (0 = the first new token) where ``ids`` and ``reference`` differ, or None
    when they are identical. Where one is a prefix of the other, they differ where the shorter ends
    (one stopped, the other went on)."""
    for position, (a, b) in enumerate(zip(ids, reference)):
        if a != b:
            return position
    return None if len(ids) == len(reference) else min(len(ids), len(reference))


def reference_outputs(row: dict, rows: dict[tuple, dict], reference: str) -> list[list[int] | None]:
    """What each output of ``row`` is compared with (one entry per output; one for a batch-size-1 row):
    ``reference``'s output of the same question and turn decoded alone (batch size 1) when ``rows``
    (:func:`row_key` -> row) has it, else, for a row of a batch, the reference's output of the same row
    of the same batch; None where neither exists. The reference's own rows are compared only with it
    decoding alone (a batch against batch size 1), never with themselves."""
    own = row["method"] == reference
    if not is_batched(row):
        alone = None if own else rows.get((reference, int(row["question_id"]), int(row["turn"])))
        return [alone["output_ids"] if alone else None]
    batch = None if own else rows.get((reference, "batch", int(row["batch_size"]), int(row["batch_index"])))
    out = []
    for j, qid in enumerate(row["question_ids"]):
        alone = rows.get((reference, int(qid), 1))
        out.append(alone["output_ids"] if alone else batch["output_ids"][j] if batch else None)
    return out


def row_first_difference(row: dict, rows: dict[tuple, dict], reference: str) -> int | list[int | None] | None:
    """``first_difference`` of a row against its :func:`reference_outputs` (a list for a batch row).
    Raises LookupError when an output has no reference output to compare with (the row then gets no
    ``first_difference`` field: the field's null means identical)."""
    refs = reference_outputs(row, rows, reference)
    if any(r is None for r in refs):
        raise LookupError("no reference output to compare with")
    if not is_batched(row):
        return first_difference(row["output_ids"], refs[0])
    return [first_difference(ids, ref) for ids, ref in zip(row["output_ids"], refs)]


@dataclass(frozen=True)
class Agreement:
    """A method's outputs against the reference's, over the outputs both have: how many were compared,
    and the :func:`first_difference` of each one that differs."""

    compared: int = 0
    first_differences: tuple[int, ...] = field(default=())

    @classmethod
    def of(cls, pairs: Iterable[tuple[list[int], list[int] | None]]) -> "Agreement":
        """From (output, reference output) pairs; pairs without a reference output are left out."""
        compared, differences = 0, []
        for ids, reference in pairs:
            if reference is None:
                continue
            compared += 1
            position = first_difference(ids, reference)
            if position is not None:
                differences.append(position)
        return cls(compared, tuple(differences))

    @property
    def identical(self) -> int:
        return self.compared - len(self.first_differences)

    @property
    def share(self) -> float | None:
        """Identical outputs / outputs compared (the report's "exact match"), or None if none was compared."""
        return self.identical / self.compared if self.compared else None

    @property
    def earliest(self) -> int | None:
        return min(self.first_differences) if self.first_differences else None

    @property
    def median(self) -> float | None:
        return statistics.median(self.first_differences) if self.first_differences else None
