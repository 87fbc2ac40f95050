"""How often an EAGLE-3 head's drafts agree with its target, teacher-forced, on a run's held-out answers.

Under greedy decoding every method commits the reference's tokens, so a recorded run's outputs
(``results.jsonl``) are the target's own answers to questions the head was not trained on (the
bench configs' questions are left out of ``specdec train-head``'s prompts). Each answer is read
by the target once (its hidden states at the head's layers, its distribution at every position),
and the head drafts from every answer position as it does when decoding: depth 1 from the
target's features, each later depth from its own outputs (EAGLE-3's training-time test, the
measure ``train-head``'s log reports). Per depth: the share of positions where the head's top
draft is the target's top token within the head's draft vocabulary, and the share of the answers'
tokens that vocabulary holds at all (a token outside it can never be drafted).

    python benchmarks/head_agreement.py benchmarks/configs/eagle3_smollm2.yaml [--results DIR] [--head DIR ...]
"""

from __future__ import annotations

import argparse

import torch

from specdec.engines import import_torchao_quietly

import_torchao_quietly()  # before the head's modules import transformers' modeling code

from candidate_generators.eagle3.generator import shipped_head  # noqa: E402
from candidate_generators.eagle3.layouts import load_head  # noqa: E402
from candidate_generators.eagle3.train import target_features, ttt_loss  # noqa: E402
from specdec import load_model  # noqa: E402
from specdec.bench.recorded import add_run_arguments, load_recorded_run  # noqa: E402


@torch.no_grad()
def agreement(head, target, run, depth: int) -> tuple[list[float], float, int]:
    """(agreement per depth, the draft vocabulary's coverage of the answers' tokens, positions)."""
    draft_ids = head.target_ids(torch.arange(head.config.draft_vocab_size))
    embed = target.get_input_embeddings()
    hits, counts = torch.zeros(depth), torch.zeros(depth)
    covered = tokens = 0
    for turn, prompt in zip(run.turns, run.prompts):
        answer_ids = turn["output_ids"]
        ids = torch.tensor([prompt + answer_ids])
        valid = torch.ones_like(ids, dtype=torch.bool)
        answer = torch.arange(ids.shape[1])[None, :] >= len(prompt)
        aux, top_ids, top_probs = target_features(target, ids, valid, head.config.aux_layers, draft_ids)
        _, accuracy, count = ttt_loss(head, embed, aux.float(), ids, valid, answer, top_ids.long(), top_probs, depth)
        hits += accuracy * count
        counts += count
        covered += int(head.t2d[torch.tensor(answer_ids, dtype=torch.long)].sum())  # t2d: in its draft vocabulary
        tokens += len(answer_ids)
    return (hits / counts.clamp(min=1)).tolist(), covered / max(tokens, 1), int(counts[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, "a greedy run of a target with a head")
    parser.add_argument("--head", action="append", help="a head's folder (repeatable; default: the shipped head)")
    parser.add_argument("--depth", type=int, default=4, help="draft depths to measure (default 4)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = load_recorded_run(args.config, args.results)
    target, _ = load_model(run.config.target)
    for folder in args.head or [shipped_head(target)]:
        head = load_head(folder, target.config, dtype=torch.float32).eval()
        per_depth, coverage, positions = agreement(head, target, run, args.depth)
        print(f"{folder}: {len(run.turns)} answers, {positions} positions; draft vocabulary holds "
              f"{coverage:.1%} of the answers' tokens; agreement by depth: "
              + ", ".join(f"{d + 1}: {a:.3f}" for d, a in enumerate(per_depth)))


if __name__ == "__main__":
    main()
