"""Acceptance of vision-language drafts on the tiny models of tests/test_multimodal.py (docs/multimodal.md).

    python benchmarks/multimodal_acceptance.py

8 image prompts x 48 new tokens per cell, K = 4 fixed, greedy; last column: transformers' assisted
generation with an exact copy of the target as assistant.
"""
import argparse, copy, sys
from pathlib import Path

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

import torch
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
torch.set_num_threads(1)
import test_multimodal as T
from helpers import ForwardRecorder
from specdec import SpecDecoder
import transformers; transformers.logging.set_verbosity_error()
for name in T.FAMILIES:
    target = T.tiny_vlm(name)
    drafts = {"(a) VLM draft": T.perturbed_copy(target, T.DRAFT_NOISE, seed=7),
              "(b) text-only draft": T.language_model_copy(name, target), "(c) prompt_lookup": "prompt_lookup",
              "exact copy": copy.deepcopy(target)}
    row = []
    for label, draft in drafts.items():
        acc = dr = steps = new = 0
        for seed in range(8):
            ids, inputs = T.image_prompt(name, seed)
            out = SpecDecoder(target, draft, num_tokens=4, schedule="fixed").generate(ids, max_new_tokens=48, **inputs)
            acc += out.stats.accepted_tokens; dr += out.stats.drafted_tokens
            steps += out.stats.steps; new += out.stats.committed_tokens
        row.append(f"{label}: {acc}/{dr} = {acc / max(dr, 1):.2f} (mean accepted length {new / steps:.2f})")
    # transformers' assisted generation with the exact copy (its assistant never sees the image)
    acc = dr = new = steps = 0
    for seed in range(8):
        ids, inputs = T.image_prompt(name, seed)
        assistant = copy.deepcopy(target)
        assistant.generation_config.num_assistant_tokens = 4
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        rec = ForwardRecorder(target)
        out = target.generate(ids, **inputs, assistant_model=assistant, max_new_tokens=48, do_sample=False)
        rec.remove()
        calls = rec.calls
        dr += (calls[0]["tokens"] - ids.shape[1]) + sum(c["tokens"] - 1 for c in calls[1:])
        acc += out.shape[1] - ids.shape[1] - len(calls)
        new += out.shape[1] - ids.shape[1]; steps += len(calls)
    row.append(f"transformers assisted, exact copy: {acc}/{dr} = {acc / dr:.2f} (mal {new / steps:.2f})")
    print(name, " | ".join(row))
