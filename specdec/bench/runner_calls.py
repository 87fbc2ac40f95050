"""One timed call of one method: the loaded models it runs on, a question's turn or a left-padded
batch of first turns in, one row out (tokens, seconds, counted target forwards, the method's stats,
the grammar check of a constrained output).
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ..grammar import Grammar, compile_grammar
from .grammar_check import check_output
from ..modelinfo import ForwardTimer, vocab_size
from ..prompts import encode_chat, left_pad
from .config import ConfigError, GenerationSettings, MethodConfig
from .methods import MethodRunner
from .questions import Question, batch_seed, build_messages, question_seed


def real_new_tokens(new: torch.Tensor, eos: set[int]) -> list[list[int]]:
    """[B, N] generated ids -> per row, the ids up to and including the first EOS (the rest is padding)."""
    rows = []
    for row in new.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


@dataclass
class _Models:
    """The loaded target and the methods built on it, ready to run (the reference method first)."""

    target: torch.nn.Module
    tokenizer: object
    runners: list[MethodRunner]
    pad_id: int
    eos: set[int]
    device: torch.device
    warmup_seconds: dict[str, float] = field(default_factory=dict)  # compiled methods only

    def grammar_of(self, q: Question, gen: GenerationSettings) -> str | None:
        """The grammar a question is decoded under (JSON text of a config's form), or None."""
        return q.grammar or (json.dumps(gen.grammar) if gen.grammar else None)

    def compile(self, spec: str | None):
        """The grammar ``spec`` compiled for the target (cached by ``compile_grammar``), or None; the
        target's EOS ids end it."""
        if spec is None:
            return None
        return compile_grammar(Grammar.from_config(json.loads(spec)), self.tokenizer, vocab_size(self.target),
                               sorted(self.eos))

    def grammars(self, questions: list[Question], gen: GenerationSettings):
        """A batch's grammar: None, the one all its rows share, or a list of one per row."""
        specs = [self.grammar_of(q, gen) for q in questions]
        if all(s is None for s in specs):
            return None
        if any(s is None for s in specs):
            raise ConfigError("a batch mixes questions with and without a grammar; give every question one "
                              "(or generation.grammar)")
        return self.compile(specs[0]) if len(set(specs)) == 1 else [self.compile(s) for s in specs]


def _run_one(runner: MethodRunner, q: Question, turn: int, answers: list[str], models: _Models,
             gen: GenerationSettings) -> dict:
    tokenizer = models.tokenizer
    input_ids = encode_chat(tokenizer, build_messages(q.turns[:turn], answers)).to(models.device)  # [1, L]
    seed = question_seed(gen.seed, q.question_id, turn) if gen.do_sample else None
    spec = models.grammar_of(q, gen)
    grammar = models.compile(spec)
    with _forward_counter(models.target, runner.config) as forwards:
        started = time.perf_counter()
        new_ids, stats = runner.run(input_ids, seed, grammar=grammar)  # a list: on the host
        seconds = time.perf_counter() - started
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    checked = {} if grammar is None else {"grammar": check_output(
        grammar, Grammar.from_config(json.loads(spec)), new_ids, text)}
    return {
        "method": runner.config.name, "generator": runner.config.generator, "question_id": q.question_id,
        "category": q.category, "subtask": q.subtask, "turn": turn, "prompt_tokens": int(input_ids.shape[1]),
        "new_tokens": len(new_ids), "seconds": seconds, "target_forwards": _calls(forwards), "seed": seed,
        "stats": stats.as_dict() if stats is not None else None,
        "output_ids": new_ids, "text": text, **checked,
    }


def _forward_counter(target, method: MethodConfig):
    """A :class:`ForwardTimer` on the target; nothing for a compiled method, whose compiled forwards
    bypass module hooks (a count would be wrong, and a hook must not enter a graph compiled later)."""
    return nullcontext() if method.compiles else ForwardTimer(target)


def _calls(forwards: ForwardTimer | None) -> int | None:
    return forwards.calls if forwards is not None else None


def _run_batch(runner: MethodRunner, group: list[Question], prompts: list[torch.Tensor], batch_size: int,
               batch_index: int, models: _Models, gen: GenerationSettings) -> dict:
    """One left-padded batch of first turns through one method: one row with per-row outputs."""
    input_ids, attention_mask = left_pad(prompts, models.pad_id)
    input_ids, attention_mask = input_ids.to(models.device), attention_mask.to(models.device)
    seed = batch_seed(gen.seed, batch_size, batch_index) if gen.do_sample else None
    with _forward_counter(models.target, runner.config) as forwards:
        started = time.perf_counter()
        new, stats = runner.run_batch(input_ids, attention_mask, seed, grammar=models.grammars(group, gen))
        new = new.cpu()  # waits for the device: its kernels are part of the call
        seconds = time.perf_counter() - started
    outputs = real_new_tokens(new, models.eos)
    return {
        "method": runner.config.name, "generator": runner.config.generator, "batch_size": batch_size,
        "batch_index": batch_index, "question_ids": [q.question_id for q in group],
        "categories": [q.category for q in group], "subtasks": [q.subtask for q in group], "turn": 1,
        "prompt_tokens": [int(p.numel()) for p in prompts], "padded_width": int(input_ids.shape[1]),
        "new_tokens": [len(o) for o in outputs], "seconds": seconds, "target_forwards": _calls(forwards), "seed": seed,
        "stats": stats.as_dict() if stats is not None else None, "output_ids": outputs,
    }
