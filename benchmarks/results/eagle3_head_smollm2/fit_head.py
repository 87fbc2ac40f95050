"""Can a head fit what it is shown? A fresh head trained on a handful of the target's answers.

    THREADS=1 python benchmarks/results/eagle3_head_smollm2/fit_head.py ANSWERS OUT COUNT STEPS

``ANSWERS`` is an ``answers.jsonl`` that ``train_head`` wrote (the target's own answers); the first
``COUNT`` first-turn answers of over 150 tokens are copied to ``OUT/answers.jsonl`` and a new head
is trained on them alone (no documentation text) for ``STEPS`` steps: its per-step log in
``OUT/log.jsonl`` gives its agreement with the target on those answers. A rerun resumes from
``OUT`` (README.md, "Can the head fit what it sees?").
"""

import json
import os
import sys
from pathlib import Path

import torch

from specdec import load_model
from candidate_generators.eagle3.train import TrainSettings, train_head

torch.set_num_threads(int(os.environ.get("THREADS", "1")))
source, out, count, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out.mkdir(parents=True, exist_ok=True)
rows = [json.loads(line) for line in source.open()]
rows = [r for r in rows if r["turn"] == 0 and len(r["ids"]) - r["prompt_length"] > 150][:count]
if not (out / "answers.jsonl").is_file():
    (out / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
target, tokenizer = load_model("smollm2-135m")
settings = TrainSettings(steps=steps, doc_text_tokens=0, warmup=20)
train_head(target, tokenizer, out, settings, prompts=[{"key": r["key"], "turns": ["(answered)"]} for r in rows],
           progress=False, target_name="smollm2-135m")
