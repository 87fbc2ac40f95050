"""Prompts from the Spec-Bench question set, built the way a user would build them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

#: ``../shared/spec_bench/question.jsonl`` next to this checkout, unless SPECDEC_SPEC_BENCH says otherwise
DEFAULT_SPEC_BENCH = Path(os.environ.get(
    "SPECDEC_SPEC_BENCH", Path(__file__).resolve().parent.parent.parent / "shared" / "spec_bench" / "question.jsonl"))

#: where the question file comes from, for a machine without it
WHERE_SPEC_BENCH = ("It is data/spec_bench/question.jsonl of github.com/hemingkx/Spec-Bench (Apache-2.0): put it at "
                    "../shared/spec_bench/question.jsonl beside the checkout, or set SPECDEC_SPEC_BENCH to its path")

#: Spec-Bench subtasks; MT-Bench's eight categories form the ``mt_bench`` subtask
SUBTASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def subtask_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def load_questions(path: str | Path = DEFAULT_SPEC_BENCH) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Spec-Bench question file not found: {path}. {WHERE_SPEC_BENCH}")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def encode_chat(tokenizer, messages: list[dict]) -> torch.Tensor:
    """[1, L] prompt ids: the chat template when the tokenizer has one, else the plain text."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        return out["input_ids"]
    text = "\n\n".join(m["content"] for m in messages)
    return tokenizer(text, return_tensors="pt")["input_ids"]


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D id rows -> left-padded ``input_ids [B, P]`` and ``attention_mask [B, P]`` for a batch."""
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.numel():] = r
        mask[i, width - r.numel():] = 1
    return ids, mask
