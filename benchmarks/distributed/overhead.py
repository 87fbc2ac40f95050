"""What a sharded target's decoding exchanges between ranks, and what it costs: run under torchrun.

    torchrun --standalone --nproc-per-node 2 benchmarks/distributed/overhead.py [--model smollm2-135m]
        [--tp-plan replicate-attention] [--draft FOLDER] [--tokens 64] [--out FILE.json]

1. specdec's own messages: the latency of one all-reduce of the sizes its messages have (int32
   vectors of ``world + payload`` entries) on its gloo group, median of many;
2. one greedy prompt-lookup call on the sharded target: per step, the bytes and seconds of
   specdec's messages (``stats.coordination``), and the collectives inside the target's forwards
   (transformers' tensor parallelism: all-reduces and all-gathers) with their bytes and time,
   from the torch profiler;
3. with ``--draft``: the same call with a draft model held by one rank (``one_rank``) and
   replicated on every rank (``replicated``): seconds per call, median of ``--repeats``.

Rank 0 prints a JSON summary (and writes it to ``--out``). Figures from one run: docs/distributed.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

ATTENTION = {f"model.layers.*.self_attn.{p}": "replicate" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}


def message_latency(group, sizes=(15, 21, 35), reps: int = 300) -> dict:
    """Median seconds of one all-reduce of ``n`` int32 on ``group``, per size."""
    import torch.distributed as dist

    out = {}
    for n in sizes:
        message, times = torch.zeros(n, dtype=torch.int32), []
        for _ in range(reps):
            started = time.perf_counter()
            dist.all_reduce(message, group=group)
            times.append(time.perf_counter() - started)
        out[f"{4 * n} bytes"] = statistics.median(times)
    return out


def forward_collectives(model, ids: torch.Tensor) -> dict:
    """The collectives of one forward over ``ids`` [1, T] (a prefill: T tokens) by the profiler:
    count, bytes (the input tensors' sizes, 4 bytes an element) and CPU seconds (waiting for the
    other ranks included) per kind of the backend's own events."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(ids)
    kinds: dict[str, dict] = {}
    for event in prof.events():
        name = event.name
        if name.split(":")[0] not in ("gloo", "nccl"):  # the backend's own events: the c10d ones wrap them
            continue
        entry = kinds.setdefault(name, {"count": 0, "bytes": 0, "seconds": 0.0})
        entry["count"] += 1
        for shape in event.input_shapes or []:
            if shape:
                entry["bytes"] += 4 * int(torch.tensor(shape).prod())  # float32 / int32 elements
        entry["seconds"] += event.cpu_time_total / 1e6
    return kinds


def one_call(decoder, ids, tokens: int) -> tuple[list, dict, float]:
    started = time.perf_counter()
    output = decoder.generate(ids, max_new_tokens=tokens)
    return output.sequences[0, ids.shape[1]:].tolist(), output.stats.as_dict(), time.perf_counter() - started


def placements(target, draft, ids, tokens: int, repeats: int) -> dict:
    from specdec import SpecDecoder

    names = ("one_rank", "replicated")
    decoders = {name: SpecDecoder(target, draft, distributed={"draft_placement": name}) for name in names}
    runs: dict[str, list] = {name: [] for name in names}
    for repeat in range(repeats + 1):  # interleaved, so that a change of the machine's load skews neither
        for name in names:
            run = one_call(decoders[name], ids, tokens)
            if repeat:  # the first warms up
                runs[name].append(run)
    out = {name: {"seconds": statistics.median(r[2] for r in runs[name]), "seconds_runs": [r[2] for r in runs[name]],
                  "coordination": runs[name][0][1].get("coordination")} for name in names}
    out["same_tokens"] = runs["one_rank"][0][0] == runs["replicated"][0][0]
    return out


def main() -> None:
    import torch.distributed as dist

    from specdec import SpecDecoder
    from specdec.distributed import Ranks
    from specdec.distributed.load import init_ranks, load_sharded

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tp-plan", choices=["model", "replicate-attention"], default="replicate-attention")
    parser.add_argument("--draft", default=None, help="a draft model folder (for one_rank against replicated)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    plan = ATTENTION if args.tp_plan == "replicate-attention" else None
    _, world = init_ranks("cpu")
    target, tokenizer = load_sharded(args.model, tp_size=world, tp_plan=plan)
    text = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"
    ids = tokenizer(text, return_tensors="pt").input_ids if tokenizer is not None else torch.arange(32)[None]
    summary = {"world": dist.get_world_size(), "model": args.model, "tp_plan": args.tp_plan,
               "message_latency_seconds": message_latency(Ranks.of(target).group)}
    tokens, stats, seconds = one_call(SpecDecoder(target, "prompt_lookup"), ids, args.tokens)
    _, stats, seconds = one_call(SpecDecoder(target, "prompt_lookup"), ids, args.tokens)  # calibrated now
    counts = stats["coordination"]
    summary["prompt_lookup"] = {
        "seconds": seconds, "steps": counts["steps"], "new_tokens": stats["committed_tokens"],
        "messages_per_step": counts["messages"] / counts["steps"], "bytes_per_step": counts["bytes"] / counts["steps"],
        "coordination_seconds_per_step": counts["seconds"] / counts["steps"]}
    summary["forward_collectives_1_token"] = forward_collectives(target, ids[:, :1])
    summary["forward_collectives_8_tokens"] = forward_collectives(target, ids[:, :8])
    if args.draft:
        from transformers import AutoModelForCausalLM

        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
        summary["draft_placement"] = placements(target, draft, ids, args.tokens, args.repeats)
    if dist.get_rank() == 0:
        text = json.dumps(summary, indent=1)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main()
