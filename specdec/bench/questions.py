"""Which questions a benchmark asks, and the prompt of each turn.

Selection is deterministic: the same config and question file give the same questions, in the
same order, on every machine (docs/benchmarks.md, "Which questions"). A later turn's prompt
carries the method's own earlier answers; seeds depend on (seed, question, turn) only, never on
the method, so every method samples alike.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..grammar import Grammar
from ..prompts import encode_chat, load_questions, subtask_of
from .config import BenchConfig, ConfigError, DatasetConfig


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    subtask: str
    turns: tuple[str, ...]
    grammar: str | None = None  # the question's own grammar (a bench config's form, as JSON text)


def spread(items: list, count: int | None) -> list:
    """``count`` items evenly spaced over ``items`` (all when None or too few): index floor(i n / count)."""
    if count is None or count >= len(items):
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def _question(row: dict, max_turns: int | None) -> Question:
    turns = row["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"question {row.get('question_id')!r}: turns must be a non-empty list of strings, "
                         f"got {turns!r:.80}")
    turns = tuple(turns)[:max_turns]
    grammar = row.get("grammar")
    if grammar is not None:
        Grammar.from_config(grammar)
        grammar = json.dumps(grammar)
    return Question(int(row["question_id"]), row["category"], subtask_of(row["category"]), turns, grammar)


def select_questions(rows: list[dict], subtasks: list[str], categories: list[str] | None,
                     per_subtask: int | None, *, first_per_category: int | None = None,
                     max_turns: int | None = None) -> list[Question]:
    """Spec-Bench rows -> questions, each turn list cut to ``max_turns``.

    By default grouped by subtask in the given order, each sorted by id and ``spread``; with
    ``first_per_category``, grouped by category in the order ``categories`` lists them, each the
    first ones by id (what ``specdec demo`` has always asked)."""
    by_id = sorted((r for r in rows if subtask_of(r["category"]) in subtasks), key=lambda r: r["question_id"])
    if first_per_category is not None:
        return [_question(r, max_turns) for category in categories or []
                for r in [r for r in by_id if r["category"] == category][:first_per_category]]
    out = []
    for subtask in subtasks:
        pool = [r for r in by_id if subtask_of(r["category"]) == subtask
                and (categories is None or r["category"] in categories)]
        out += [_question(r, max_turns) for r in spread(pool, per_subtask)]
    return out


def select_from_config(rows: list[dict], dataset: DatasetConfig) -> list[Question]:
    """:func:`select_questions` as a config's ``dataset`` section asks."""
    return select_questions(rows, dataset.subtasks, dataset.categories, dataset.per_subtask,
                            first_per_category=dataset.first_per_category, max_turns=dataset.max_turns)


def load_selected_questions(config: BenchConfig, config_dir: Path) -> list[Question]:
    """The config's questions, or a :class:`ConfigError` naming ``dataset`` (missing, malformed, empty)."""
    dataset = config.dataset_path(config_dir)
    if not dataset.is_file():
        raise ConfigError(f"dataset.path: file not found: {dataset}")
    try:
        questions = select_from_config(load_questions(dataset), config.dataset)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"dataset.path: {dataset} is not Spec-Bench JSONL (one object per line with "
                          f"question_id, category, turns): {type(exc).__name__}: {exc}") from None
    if not questions:
        raise ConfigError(f"dataset: no question in {dataset} matches subtasks {config.dataset.subtasks}"
                          + (f" and categories {config.dataset.categories}" if config.dataset.categories else ""))
    ids = [q.question_id for q in questions]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:  # rows are keyed by question id: the second would be skipped as done
        raise ConfigError(f"dataset.path: {dataset} selects question_id {', '.join(map(str, twice))} more than once; "
                          "give every question its own id")
    return questions


def build_messages(turns: tuple[str, ...] | list[str], answers: list[str]) -> list[dict]:
    """Chat messages for turn ``len(turns)``: user turns interleaved with the method's own answers."""
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def recorded_prompts(config: BenchConfig, config_dir: Path, turns: list[dict], tokenizer) -> list[list[int]]:
    """The prompt ids each of one method's recorded turns (``results.jsonl`` rows) was called with:
    its question's turns so far, with the method's own recorded answers to the earlier ones (a
    run replayed without a model: ``benchmarks/replay_policy.py``, ``benchmarks/suffix_ceiling.py``)."""
    questions = {q.question_id: q for q in load_selected_questions(config, config_dir)}
    answers = {(r["question_id"], r["turn"]): r["text"] for r in turns}
    prompts = []
    for r in turns:
        q = questions[r["question_id"]]
        previous = [answers[(q.question_id, t)] for t in range(1, r["turn"])]
        prompts.append(encode_chat(tokenizer, build_messages(q.turns[: r["turn"]], previous))[0].tolist())
    return prompts


def question_seed(seed: int, question_id: int, turn: int) -> int:
    """Sampling seed of one (question, turn), the same for every method, stable across reruns."""
    digest = hashlib.sha256(f"{seed}:{question_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def batch_seed(seed: int, batch_size: int, batch_index: int) -> int:
    """Sampling seed of one batch, the same for every method, stable across reruns."""
    digest = hashlib.sha256(f"{seed}:batch{batch_size}:{batch_index}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


#: tokens added per earlier answer in :func:`longest_call` (re-encoding text may split it differently)
ANSWER_MARGIN = 8


def longest_call(questions: list[Question], tokenizer, max_new_tokens: int, every_turn: bool = True) -> int:
    """An upper bound of prompt + new tokens over the run's ``generate()`` calls: the length a compiled
    method's caches are warmed up to. Each earlier answer counts as ``max_new_tokens`` plus
    :data:`ANSWER_MARGIN`; ``every_turn=False``: first turns only (the batched passes)."""
    longest = 0
    for q in questions:
        turns = q.turns if every_turn else q.turns[:1]
        prompt = encode_chat(tokenizer, build_messages(turns, [""] * (len(turns) - 1))).shape[1]
        longest = max(longest, prompt + len(turns) * max_new_tokens + (len(turns) - 1) * ANSWER_MARGIN)
    return longest
