"""Replay draft-length policies for prompt lookup on recorded greedy outputs, without a model.

Under greedy decoding every method commits the same tokens, so a benchmark run's recorded
outputs (``results.jsonl``) fix what prompt lookup would propose and what the target would
accept at every step, for any choice of K. This script replays a policy over those outputs and
prices each step with the cost curve that run measured (``forward_costs``: seconds per target
forward by tokens fed) plus a fixed per-step overhead, so policies can be compared on this
machine's costs without the noise of timing them. Timings of real runs remain the judge; this
is the quick way to see why one policy beats another.

    python benchmarks/replay_policy.py benchmarks/configs/spec_bench_smollm2.yaml

Policies: ``auto`` (the defaults: n-grams 4..2, two sources per match length, uncontested and
contested, untried sources priced at ``policy.UNTRIED``), ``adaptive from 4`` with n-grams 3..2
(the earlier default) and ``fixed 10`` with n-grams 2..1 (transformers' settings), as the
configs' methods run them.
Prints, per policy: estimated speedup over plain decoding (each step costs t(pending + K)), mean
accepted length, mean K, skipped share (steps where the policy chose no drafts); overall and per
subtask.
"""

from __future__ import annotations

import argparse

import torch

from candidate_generators.prompt_lookup import Match, PromptLookupGenerator, lookup_match, ngram_source

from specdec.bench.recorded import add_run_arguments, load_recorded_run
from specdec.generators import StepRecord
from specdec.metrics import AcceptanceStats
from specdec.policy import COST_GRID, UNTRIED, AcceptanceTracker, CostModel, DraftPolicy

NO_MATCH = Match(0, False, torch.zeros(0, dtype=torch.long))  # no lookup this step


def measured_curve(rows: list[dict]) -> CostModel:
    stats = AcceptanceStats()
    for row in rows:
        if row.get("stats"):
            stats = stats + AcceptanceStats.from_dict(row["stats"])
    points = {t: v[1] / v[0] for t, v in stats.forward_costs.items() if v[0]}
    known = sorted(points)
    seconds = [points[min(known, key=lambda t: abs(t - x))] if x not in points else points[x] for x in COST_GRID]
    return CostModel(seconds, rate=0.0)


def replay(prompt: list[int], output: list[int], policy: DraftPolicy | None, fixed: tuple[str, int] | None,
           ngrams: tuple[int, int], costs: CostModel, overhead: float) -> tuple[float, AcceptanceStats]:
    """-> (seconds, stats) for one turn. ``policy`` (auto) or ``fixed`` = ("fixed" | "adaptive", K);
    ``ngrams`` = (max_ngram, min_ngram) of the lookup."""
    sequence = torch.tensor(prompt + output)
    committed, end = len(prompt), len(prompt) + len(output)
    seconds, stats, k_now = 0.0, AcceptanceStats(), (fixed[1] if fixed else 0)
    while committed < end:
        remaining = torch.tensor([end - committed - 1])
        ask = policy.plan(remaining, 1, 0, []) if policy else torch.minimum(torch.tensor([k_now]), remaining)
        match = lookup_match(sequence[:committed], *ngrams, int(ask[0])) if int(ask[0]) > 0 else NO_MATCH
        found, source = match.drafts, torch.tensor([ngram_source(ngrams[0], match.n, match.contested)])
        made = torch.tensor([found.numel()])
        offered = policy.admit(made, source, None) if policy else made
        k = int(offered[0])
        truth = sequence[committed: committed + k]
        accepted = int((found[:k] == truth).long().cumprod(0).sum()) if k else 0
        seconds += float(costs.predict(1 + k)) + overhead
        stats.record_step([k], [accepted], [accepted + 1])
        stats.skipped_steps += int(bool(policy) and (ask[0] == 0 or (found.numel() > 0 and k == 0)) and remaining[0] > 0)
        if policy:  # timing-free (measured=False, a fixed curve): it learns the acceptance only
            policy.observe(StepRecord(offered, torch.tensor([accepted]), asked=ask, made=made, candidates=made,
                                      kept=torch.tensor([accepted + 1]), room=remaining, sources=source))
        elif fixed[0] == "adaptive" and k > 0:
            k_now = min(k_now + 2, 10) if accepted == k else max(k_now - 1, 1)
        committed += accepted + 1
    return seconds, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, "a greedy prompt-lookup run on a packaged model")
    parser.add_argument("--overhead-ms", type=float, default=3.0, help="per-step cost outside the forward")
    args = parser.parse_args()
    run = load_recorded_run(args.config, args.results)
    costs, overhead = measured_curve(run.rows), args.overhead_ms / 1000
    turns, prompts = run.turns, run.prompts
    default = PromptLookupGenerator()  # auto: the defaults, two sources per match length
    policies = {"auto": (None, (default.max_ngram, default.min_ngram)),
                "adaptive from 4": (("adaptive", 4), (3, 2)),  # the earlier default
                "fixed 10": (("fixed", 10), (2, 1))}  # transformers' settings
    for name, (fixed, ngrams) in policies.items():
        by_subtask: dict[str, list[float]] = {}
        total = AcceptanceStats()
        for r, prompt in zip(turns, prompts):
            policy = None if fixed else DraftPolicy(
                costs, AcceptanceTracker(1, 10, prior=default.drafting().priors, untried=UNTRIED), 10,
                step_overhead=overhead, measured=False)
            spent, stats = replay(prompt, r["output_ids"], policy, fixed, ngrams, costs, overhead)
            plain = len(r["output_ids"]) * (float(costs.predict(1)) + overhead)
            by_subtask.setdefault(r["subtask"], [0.0, 0.0])
            by_subtask[r["subtask"]][0] += plain
            by_subtask[r["subtask"]][1] += spent
            total = total + stats
        overall = sum(v[0] for v in by_subtask.values()) / sum(v[1] for v in by_subtask.values())
        per = ", ".join(f"{s} {v[0] / v[1]:.2f}x" for s, v in by_subtask.items())
        print(f"{name:<16} {overall:.2f}x | accepted length {total.mean_accepted_length:.2f} | mean K "
              f"{total.drafted_tokens / total.steps:.2f} | skipped {total.skipped_share:.0%} | {per}")


if __name__ == "__main__":
    main()
