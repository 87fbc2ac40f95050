"""Build benchmarks/data/extraction.jsonl: structured-output prompts from Spec-Bench contexts.

Each line is a Spec-Bench-style question (``question_id``, ``category``, ``turns``) with its own
``grammar`` (a bench config's form: ``{"json_schema": ...}``): fields pulled from a Spec-Bench RAG
passage (the answer to its question, the supporting quote) or from a summarization article
(headline, people, places, topic, one-sentence summary). The ids are the Spec-Bench questions'
own. Run from the repository root:

    python benchmarks/data/make_extraction.py [--spec-bench ../shared/spec_bench/question.jsonl]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.bench.questions import spread
from specdec.prompts import DEFAULT_SPEC_BENCH, load_questions

PER_CATEGORY = 8
CONTEXT_CHARS = 1800  # keeps prompts near 450 tokens

RAG_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 100},
        "quote": {"type": "string", "maxLength": 300},
        "confidence": {"enum": ["high", "medium", "low"]},
    },
    "required": ["answer", "quote", "confidence"],
    "additionalProperties": False,
}
ARTICLE_SCHEMA = {
    "type": "object",
    "properties": {
        "headline": {"type": "string", "maxLength": 100},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "places": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "topic": {"enum": ["politics", "crime", "health", "science", "sports", "business", "entertainment", "other"]},
        "summary": {"type": "string", "maxLength": 250},
    },
    "required": ["headline", "people", "places", "topic", "summary"],
    "additionalProperties": False,
}


def cut(text: str, chars: int = CONTEXT_CHARS) -> str:
    """``text`` cut at the last sentence end before ``chars`` characters."""
    if len(text) <= chars:
        return text
    head = text[:chars]
    end = head.rfind(". ")
    return head[: end + 1] if end > chars // 2 else head


def rag_prompt(turn: str) -> str:
    passage, _, question = turn.rpartition("\n")
    return ("Answer the question from the passage. Reply with JSON only, with the fields answer (a short "
            "answer), quote (the sentence of the passage that supports it, copied exactly) and confidence.\n\n"
            f"Passage: {cut(passage)}\n\nQuestion: {question}")


def article_prompt(turn: str) -> str:
    article = turn.removeprefix("Summarize: ")
    return ("Read the article and reply with JSON only, with the fields headline, people (up to three names "
            "as written in the article), places (up to three), topic and summary (one sentence).\n\n"
            f"Article: {cut(article)}")


def build(rows: list[dict]) -> list[dict]:
    out = []
    for category, prompt, schema in (("rag", rag_prompt, RAG_SCHEMA), ("summarization", article_prompt, ARTICLE_SCHEMA)):
        pool = sorted((r for r in rows if r["category"] == category), key=lambda r: r["question_id"])
        for row in spread(pool, PER_CATEGORY):
            out.append({"question_id": row["question_id"], "category": category,
                        "turns": [prompt(row["turns"][0])], "grammar": {"json_schema": schema}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec-bench", default=str(DEFAULT_SPEC_BENCH))
    parser.add_argument("--out", default=str(Path(__file__).with_name("extraction.jsonl")))
    args = parser.parse_args()
    questions = build(load_questions(args.spec_bench))
    with open(args.out, "w") as f:
        for q in questions:
            f.write(json.dumps(q) + "\n")
    print(f"{len(questions)} questions -> {args.out}")


if __name__ == "__main__":
    main()
