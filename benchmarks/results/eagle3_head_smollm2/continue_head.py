"""Continue training the shipped SmolLM2 head on the target's answers to prompts it writes itself.

    THREADS=2 python benchmarks/results/eagle3_head_smollm2/continue_head.py OUT PROMPTS STEPS

The shipped head's weights are written as ``OUT/checkpoint.pt`` at step 0 (a fresh optimizer, the
shipped draft vocabulary) unless a checkpoint is there already; then ``train_head`` runs with
``PROMPTS`` synthetic prompts and no others, and resumes from ``OUT`` when rerun (README.md).
"""

import os
import sys
import time
from pathlib import Path

import torch

from specdec import load_model
from specdec.engines import import_torchao_quietly

import_torchao_quietly()

from candidate_generators.eagle3.generator import shipped_head  # noqa: E402
from candidate_generators.eagle3.layouts import load_head  # noqa: E402
from candidate_generators.eagle3.train import TrainSettings, _save_checkpoint, train_head  # noqa: E402

torch.set_num_threads(int(os.environ.get("THREADS", "1")))
out, prompts, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
target, tokenizer = load_model("smollm2-135m")
target.eval()
settings = TrainSettings(steps=steps, lr=5e-4, doc_text_tokens=300_000, generate_batch=32, synthetic_prompts=prompts)
out.mkdir(parents=True, exist_ok=True)
if not (out / "checkpoint.pt").is_file():
    head = load_head(shipped_head(target), target.config).float()
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=settings.lr,
                                  betas=(0.9, 0.95), weight_decay=0.0)
    _save_checkpoint(out / "checkpoint.pt", head, optimizer, settings, "smollm2-135m", step=0, seconds=0.0,
                     order=None, cursor=0)
started = time.time()
print(train_head(target, tokenizer, out, settings, prompts=[], target_name="smollm2-135m"), time.time() - started)
