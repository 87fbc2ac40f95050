"""Thread settings on a shared machine: decoding speed with every core free and with one core busy.

Each setting runs in a fresh process (OpenMP reads its environment once, at start-up), loads
SmolLM2-135M-Instruct, warms up, and times greedy decoding of one Spec-Bench prompt with
``target.generate`` (plain) and with ``SpecDecoder(target, "prompt_lookup")``. "Busy" starts one
process spinning on a core for the whole measurement, as another user's job would.

    python benchmarks/threads.py                  # all settings, idle and busy
    python benchmarks/threads.py --new-tokens 48  # shorter runs

Prints one line per (load, setting): tokens/s plain and speculative, median of ``--reps`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

#: name -> (environment additions, argument to specdec.threads.configure_threads or an int)
SETTINGS = {
    "1 thread": ({}, "1"),
    "2 threads": ({}, "2"),
    "2 threads, OMP_WAIT_POLICY=PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, "2"),
    "auto (specdec default)": ({}, "auto"),
}

CHILD = r"""
import json, statistics, sys, time
import torch
from specdec import SpecDecoder, load_model
from specdec.prompts import encode_chat, load_questions
from specdec.threads import configure_threads
threads = configure_threads(sys.argv[1])
target, tok = load_model("smollm2-135m")
q = next(q for q in load_questions() if q["category"] == "summarization")
ids = encode_chat(tok, [{"role": "user", "content": q["turns"][0]}])
new, reps = int(sys.argv[2]), int(sys.argv[3])
spec = SpecDecoder(target, "prompt_lookup")
target.generate(ids, max_new_tokens=4, do_sample=False); spec.generate(ids, max_new_tokens=4)
plain, ours = [], []
for _ in range(reps):
    t = time.perf_counter(); target.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
    plain.append(new / (time.perf_counter() - t))
    t = time.perf_counter(); out = spec.generate(ids, max_new_tokens=new)
    ours.append((out.sequences.shape[1] - ids.shape[1]) / (time.perf_counter() - t))
print(json.dumps({"threads": threads, "plain": statistics.median(plain), "spec": statistics.median(ours)}))
"""


def measure(env_extra: dict, threads: str, new: int, reps: int) -> dict:
    env = {**os.environ, **env_extra}
    done = subprocess.run([sys.executable, "-c", CHILD, threads, str(new), str(reps)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}; {args.new_tokens} new tokens; median of {args.reps}", flush=True)
    for load in ("idle", "one core busy"):
        spinner = None
        if load != "idle":
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(2)
        try:
            for name, (env_extra, threads) in SETTINGS.items():
                result = measure(env_extra, threads, args.new_tokens, args.reps)
                print(f"{load:>14} | {name:<36} | threads {result['threads']} | plain {result['plain']:6.1f} tok/s "
                      f"| prompt_lookup {result['spec']:6.1f} tok/s", flush=True)
        finally:
            if spinner is not None:
                spinner.kill()


if __name__ == "__main__":
    main()
