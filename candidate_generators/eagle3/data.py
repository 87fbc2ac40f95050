"""Training data for a head: prompts, and the target's own answers to them (self-distillation).

A head learns to predict what *its target* writes, so the answers come from the target itself,
generated greedily in batches (sorted by prompt length, left-padded), and written one JSON line
per answer to ``answers.jsonl`` as each batch finishes: a rerun skips the prompts already
answered. Hidden states are never stored here; training takes them from the target on the fly.

Prompts (:func:`held_out_prompts`): the Spec-Bench questions that no benchmark config evaluates on
(first turns, then each second turn after the target's own first answer), summaries and
questions over the standard library's module documentation (text every Python install carries),
and, as many as asked, user turns the target writes itself (:func:`synthetic_prompts`): a chat
model given its template up to where a user's message begins writes one, so the prompts are
bounded by time, not by what text the machine holds.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import warnings
from pathlib import Path

import torch

from specdec.compiled import say
from specdec.prompts import encode_chat, left_pad

#: the standard library's documentation, as prompts: what is asked of each module's text
DOC_TASKS = ("Summarize the following documentation in a few sentences.\n\n{doc}",
             "Read this documentation and explain, with a short example, what the module is for.\n\n{doc}")


def evaluated_question_ids(config_dirs: list[Path]) -> set[int]:
    """The Spec-Bench question ids any benchmark config in ``config_dirs`` selects."""
    from specdec.bench.config import load_config
    from specdec.bench.questions import load_selected_questions

    ids: set[int] = set()
    for folder in config_dirs:
        for path in sorted(Path(folder).glob("*.yaml")):
            try:
                config = load_config(path)
                ids |= {q.question_id for q in load_selected_questions(config, path.parent)}
            except Exception:  # a config of another dataset (agent, extraction): not Spec-Bench's ids
                continue
    return ids


def held_out_prompts(questions: list[dict], excluded: set[int]) -> list[dict]:
    """Spec-Bench rows not in ``excluded`` -> prompt records ``{"key", "turns": [...]}`` (every turn;
    a later turn is asked after the target's answer to the one before)."""
    return [{"key": f"spec_bench:{row['question_id']}", "turns": list(row["turns"])}
            for row in questions if int(row["question_id"]) not in excluded]


def documentation_prompts(limit: int = 200, max_chars: int = 1600) -> list[dict]:
    """Prompts over the standard library's module docstrings (those of 400 characters or more),
    alternating :data:`DOC_TASKS`, sorted by module name, at most ``limit``."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(sys.stdlib_module_names):
            if name.startswith("_") or name in ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"):
                continue
            try:
                doc = inspect.getdoc(importlib.import_module(name)) or ""
            except Exception:
                continue
            if len(doc) >= 400:
                task = DOC_TASKS[len(out) % len(DOC_TASKS)]
                out.append({"key": f"doc:{name}", "turns": [task.format(doc=doc[:max_chars])]})
            if len(out) >= limit:
                break
    return out


def documentation_text(tokenizer, tokens: int, chunk: int = 512) -> list[dict]:
    """The standard library's documentation (each module's docstring and its public members'),
    tokenized into records of ``chunk`` tokens, ``tokens`` in all: text the target reads with no
    answer of its own (``prompt_length`` 0: every position is trained on)."""
    ids: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(sys.stdlib_module_names):
            if len(ids) >= tokens:
                break
            if name.startswith("_") or name in ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"):
                continue
            try:
                module = importlib.import_module(name)
            except Exception:
                continue
            parts = [inspect.getdoc(module) or ""]
            for member in sorted(getattr(module, "__all__", None) or dir(module)):
                if member.startswith("_"):
                    continue
                doc = inspect.getdoc(getattr(module, member, None)) or ""
                if len(doc) >= 200 and doc not in parts:
                    parts.append(f"{name}.{member}\n\n{doc}")
            text = "\n\n".join(p for p in parts if p)
            if text:
                ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids[:tokens]
    return [{"key": f"doc_text:{i}", "turn": 0, "prompt_length": 0, "ids": ids[i: i + chunk]}
            for i in range(0, len(ids) - 1, chunk)]


#: the first word of a synthetic prompt, one per batch in turn ("": the model's own choice)
OPENERS = ("", "Write", "Explain", "Translate", "Summarize", "Solve", "How", "What", "Why", "Calculate", "Compare",
           "Describe", "Give", "List", "Create", "Rewrite", "Imagine", "Suggest", "If", "Can")


def synthetic_prompts(model, tokenizer, count: int, path: Path, *, seed: int = 0, batch_size: int = 16,
                      max_tokens: int = 96, progress: bool = True) -> list[dict]:
    """``count`` distinct user turns written by ``model`` itself: its chat template up to where a
    user's message begins and the batch's first word (:data:`OPENERS`, in turn: kinds of request
    the model would seldom start with on its own), then sampled (temperature 1, top-p 0.95) until
    the turn ends. A turn cut off at ``max_tokens``, shorter than 16 characters, or already
    written is dropped. Each batch draws from its own seed (``seed`` and its number), so a rerun
    writes the same prompts; kept ones are appended to ``path`` as each batch finishes and a rerun
    continues from there. -> prompt records ``{"key": "synthetic:N", "turns": [text]}``."""
    from tqdm import tqdm

    start, end = _user_turn_frame(tokenizer)
    rows = read_jsonl(path)
    seen = {_normalized(r["text"]) for r in rows}
    batch = max((r["batch"] for r in rows), default=-1) + 1
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end[0]
    bar = tqdm(total=count, initial=min(len(rows), count), desc="prompts", unit="prompt", disable=not progress)
    with path.open("a") as out:
        while len(rows) < count and batch < 4 * (count // batch_size + 1):  # a model that seldom ends its turns
            opener = tokenizer(OPENERS[batch % len(OPENERS)], add_special_tokens=False)["input_ids"]
            ids = torch.tensor([start + opener] * batch_size)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 1_000_003 + batch)
                made = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      temperature=1.0, top_p=0.95, top_k=0, max_new_tokens=max_tokens,
                                      eos_token_id=end, pad_token_id=pad)[:, ids.shape[1]:].tolist()
            for row in made:
                ended = next((i for i, token in enumerate(row) if token in end), None)
                if ended is None:
                    continue
                text = tokenizer.decode(opener + row[:ended], skip_special_tokens=True).strip()
                if len(text) >= 16 and _normalized(text) not in seen and len(rows) < count:
                    seen.add(_normalized(text))
                    rows.append({"batch": batch, "text": text})
                    out.write(json.dumps(rows[-1]) + "\n")
                    bar.update(1)
            out.flush()
            batch += 1
    bar.close()
    if len(rows) < count:
        say(f"synthetic prompts: {len(rows)} of {count} after {batch} batches (the model seldom finished a "
            f"turn within {max_tokens} tokens, or repeated itself); training goes on with those")
    return [{"key": f"synthetic:{i}", "turns": [r["text"]]} for i, r in enumerate(rows[:count])]


def _user_turn_frame(tokenizer) -> tuple[list[int], list[int]]:
    """(the chat template's ids up to where a user's message begins, the ids that may end it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("synthetic prompts need a chat model: this tokenizer has no chat template")
    mark = "\x00SPECDEC\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    before, after = text.split(mark, 1)
    start = tokenizer(before, add_special_tokens=False)["input_ids"]
    closing = tokenizer(after, add_special_tokens=False)["input_ids"][:1]  # the template's end of a turn
    eos = tokenizer.eos_token_id
    end = list(dict.fromkeys(closing + (eos if isinstance(eos, list) else [eos] if eos is not None else [])))
    if not start or not end:
        raise ValueError("synthetic prompts: the chat template neither opens nor closes a user's turn with tokens")
    return start, end


def _normalized(text: str) -> str:
    return " ".join(text.lower().split())


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file written so far. A torn tail, from an interrupted run, is
    cut off the file, so that lines appended next start on a line of their own (glued onto it, they
    were lost, and every rerun appended the same answers again)."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    rows, whole = [], 0
    for line in data.splitlines(keepends=True):
        try:
            if not line.endswith(b"\n"):
                break
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
        whole += len(line)
    if whole < len(data):
        with path.open("r+b") as file:
            file.truncate(whole)
    return rows


@torch.no_grad()
def self_distill(model, tokenizer, prompts: list[dict], path: Path, *, answer_tokens: int = 256,
                 batch_size: int = 16, max_prompt_tokens: int = 1024, progress: bool = True) -> list[dict]:
    """Answer every turn of every prompt with ``model`` (greedy, ``answer_tokens`` at most),
    appending ``{"key", "turn", "ids": prompt + answer, "prompt_length"}`` lines to ``path``;
    turns already answered there are skipped. -> every answer in ``path``."""
    from tqdm import tqdm

    done = read_jsonl(path)
    answered = {(r["key"], r["turn"]): r for r in done}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    turns = max((len(p["turns"]) for p in prompts), default=0)
    total = sum(len(p["turns"]) for p in prompts)
    bar = tqdm(total=total, initial=len(answered), desc="answers", unit="answer", disable=not progress)
    with path.open("a") as out:
        for turn in range(turns):
            todo = []
            for p in prompts:
                if turn >= len(p["turns"]) or (p["key"], turn) in answered:
                    continue
                if turn and (p["key"], turn - 1) not in answered:
                    continue  # its earlier answer is missing (a prompt too long): the turn cannot be asked
                messages = _messages(p, turn, answered, tokenizer)
                ids = encode_chat(tokenizer, messages)[0]
                if ids.numel() <= max_prompt_tokens:
                    todo.append((p["key"], ids))
                else:
                    bar.update(1)
            todo.sort(key=lambda item: item[1].numel())
            for start in range(0, len(todo), batch_size):
                chunk = todo[start: start + batch_size]
                ids, mask = left_pad([ids for _, ids in chunk], pad)
                out_ids = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=answer_tokens,
                                         do_sample=False, pad_token_id=pad)
                for row, (key, prompt) in enumerate(chunk):
                    answer = out_ids[row, ids.shape[1]:]
                    answer = answer[: _answer_end(answer, tokenizer)]
                    record = {"key": key, "turn": turn, "prompt_length": prompt.numel(),
                              "ids": prompt.tolist() + answer.tolist()}
                    out.write(json.dumps(record) + "\n")
                    answered[(key, turn)] = record
                out.flush()
                bar.update(len(chunk))
    bar.close()
    return read_jsonl(path)


def _messages(prompt: dict, turn: int, answered: dict, tokenizer) -> list[dict]:
    messages = []
    for t in range(turn + 1):
        messages.append({"role": "user", "content": prompt["turns"][t]})
        if t < turn:
            record = answered[(prompt["key"], t)]
            text = tokenizer.decode(record["ids"][record["prompt_length"]:], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": text})
    return messages


def _answer_end(answer: torch.Tensor, tokenizer) -> int:
    """Length of ``answer`` up to and including its first end-of-sequence token."""
    eos = tokenizer.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    for i, token in enumerate(answer.tolist()):
        if token in eos:
            return i + 1
    return answer.numel()
