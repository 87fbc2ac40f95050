"""A seeded random sweep of greedy calls: specdec against ``target.generate`` on tiny random models.

Each combination draws an architecture, a generator, a call site (``SpecDecoder.generate`` or
``model.generate(custom_generate=specdec.generate)``), a batch (one row, or a left-padded batch
of two or three) and a handful of ``generate()`` settings (processors, EOS ids or none, stop
strings, a user's stopping criterion, lengths); the row records whether every output token equals
``target.generate``'s with the same settings, and where the first difference is. Rows are written
as they finish to a JSON-lines file, and a rerun with the same ``--out`` skips the combinations
already there, so an interrupted sweep resumes.

    python benchmarks/sweep.py --count 240 --out benchmarks/results/sweep/rows.jsonl

Nothing here is timed: the sweep is about exactness, not speed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import traceback
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, StopStringCriteria

import specdec
from specdec import SpecDecoder
from specdec.models import byte_tokenizer, tiny_random
from specdec.prompts import left_pad

ARCHS = ("llama", "mistral", "qwen2", "gemma3_text", "gpt2", "phi3")
GENERATORS = ("none", "prompt_lookup", "draft_model", "self_draft", "self_draft_lookup", "cross_tokenizer")
EOS, PAD = 256, 257


class Criterion(StoppingCriteria):
    """A user's criterion set by one ``value``, named by it (the reference cache tells settings apart by repr)."""

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return f"{type(self).__name__}({self.value!r})"


class LastTokenIn(Criterion):
    """Stops a row whose last token is one of ``value`` (per row, as generate() asks)."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], torch.tensor(self.value))


class WidthAtLeast(Criterion):
    """Stops every row once the padded batch is ``value`` wide: a criterion on the tensor's shape."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.value, dtype=torch.bool)


class SumAbove(Criterion):
    """Stops a row whose ids, padding included, sum past ``value``: it reads the row as generate() lays it out."""

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.sum(dim=1) > self.value


class PaddedRowsAfter(Criterion):
    """Stops the rows whose column 0 is padding once the batch is ``value`` wide: a criterion on
    column 0 and on the width, which only the left-padded batch generate() passes answers alike."""

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, 0] == PAD) & (input_ids.shape[1] >= self.value)


def draw(rng: random.Random, index: int) -> dict:
    """One combination, from ``rng`` alone (the same seed gives the same sweep)."""
    combo = {"index": index, "arch": rng.choice(ARCHS), "generator": rng.choice(GENERATORS),
             "site": rng.choice(("decoder", "custom_generate")), "rows": rng.choice((1, 1, 2, 3)),
             "prompt_seed": rng.randrange(10_000), "max_new_tokens": rng.randint(6, 40), "settings": {}}
    s = combo["settings"]
    if rng.random() < 0.3:
        s["repetition_penalty"] = rng.choice((1.2, 2.0, 0.8))
    if rng.random() < 0.25:
        s["no_repeat_ngram_size"] = rng.choice((2, 3))
    if rng.random() < 0.2:
        s["min_new_tokens"] = rng.randint(1, 8)
    if rng.random() < 0.2:
        s["suppress_tokens"] = rng.sample(range(256), 3)
    if rng.random() < 0.15:
        s["bad_words_ids"] = [rng.sample(range(256), 2)]
    if rng.random() < 0.4:
        s["eos_token_id"] = rng.choice((None, None, [EOS, rng.randrange(256)], rng.randrange(256)))
    if rng.random() < 0.2:
        s["stop_strings"] = ["".join(chr(rng.randrange(97, 123)) for _ in range(rng.randint(1, 2)))]
    if rng.random() < 0.4:  # widths and sums past the prompt's, so that criteria end rows mid-call
        s["criterion"] = rng.choice((["last", rng.sample(range(256), 24)], ["width", rng.randint(2, 30)],
                                     ["sum", rng.randint(200, 3_000)], ["padded", rng.randint(1, 20)]))
    return combo


def criteria_of(spec, ids) -> StoppingCriteriaList | None:
    """The user's criterion of a combination; widths and sums count from the prompt ``ids [B, P]``."""
    if spec is None:
        return None
    kind, value = spec
    if kind == "last":
        return StoppingCriteriaList([LastTokenIn(value)])
    if kind == "sum":
        return StoppingCriteriaList([SumAbove(int(ids.sum(dim=1).min()) + value)])
    made = {"width": WidthAtLeast, "padded": PaddedRowsAfter}[kind]
    return StoppingCriteriaList([made(ids.shape[1] + value)])


class Models:
    """The tiny targets, drafts and tokenizer of each architecture, built once."""

    def __init__(self):
        self.built = {}

    def __call__(self, arch: str):
        if arch not in self.built:
            target, tokenizer = tiny_random(arch, seed=1)
            draft, _ = tiny_random(arch, seed=1)
            with torch.no_grad():  # a draft that agrees often but not always
                g = torch.Generator().manual_seed(7)
                for p in draft.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std().clamp_min(1e-3))
            self.built[arch] = (target, draft, tokenizer)
        return self.built[arch]


#: the cross-tokenizer draft reads the same bytes through other merges: a tokenizer that is not the target's
DRAFT_TOKENIZER = byte_tokenizer([("t", "h"), ("th", "e"), ("a", "n"), ("o", "r"), ("Ġ", "a"), ("i", "n")])


def drafter(generator: str, draft, tokenizer) -> tuple[object, dict, dict]:
    """(what SpecDecoder takes as ``draft``, its generator options, decoder keywords) of a generator name."""
    fixed = {"num_tokens": 4, "schedule": "fixed"}
    copy = {"weights": "bfloat16", "compile_draft": False, **fixed}
    return {
        "none": (None, {}, {}),
        "prompt_lookup": ("prompt_lookup", fixed, {}),
        "draft_model": (draft, fixed, {}),
        "self_draft": ("self_draft", {"lookup": False, **copy}, {}),
        "self_draft_lookup": ("self_draft", {"lookup": True, **copy}, {}),
        "cross_tokenizer": (draft, {"min_confidence": 0.0, **fixed}, {"draft_tokenizer": DRAFT_TOKENIZER}),
    }[generator]


def run(combo: dict, models: Models) -> dict:
    target, draft, tokenizer = models(combo["arch"])
    g = torch.Generator().manual_seed(combo["prompt_seed"])
    rows = [torch.randint(97, 123, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g)
            for _ in range(combo["rows"])]
    for row in rows:  # repeats, so that lookups find matches
        row.copy_(torch.cat([row[: row.numel() // 2], row[: row.numel() - row.numel() // 2]]))
    ids, mask = left_pad(rows, pad_id=PAD)
    settings = dict(combo["settings"])
    criteria = criteria_of(settings.pop("criterion", None), ids)
    extra = {"tokenizer": tokenizer} if "stop_strings" in settings else {}
    common = dict(max_new_tokens=combo["max_new_tokens"], **settings)
    want = target.generate(ids, attention_mask=mask, do_sample=False, stopping_criteria=criteria, **common, **extra)
    name, options, keywords = drafter(combo["generator"], draft, tokenizer)
    if combo["site"] == "decoder":
        decoder = SpecDecoder(target, name, tokenizer=tokenizer, **keywords, **options)
        got = decoder.generate(ids, mask, stopping_criteria=criteria, **common).sequences
    else:  # generate() gives a callable loop no tokenizer: stop strings go as the criterion it would build
        strings = common.pop("stop_strings", None)
        if strings:
            criteria = StoppingCriteriaList([*(criteria or []), StopStringCriteria(tokenizer, strings)])
        got = target.generate(ids, attention_mask=mask, do_sample=False, stopping_criteria=criteria,
                              custom_generate=specdec.generate, draft=name, draft_options=options,
                              target_tokenizer=tokenizer if keywords else None,
                              draft_tokenizer=keywords.get("draft_tokenizer"), **common)
    same = got.shape == want.shape and torch.equal(got, want)
    first = None
    if not same:
        width = min(got.shape[1], want.shape[1])
        differs = (got[:, :width] != want[:, :width]).any(dim=0).nonzero()
        first = int(differs[0]) - ids.shape[1] if differs.numel() else width - ids.shape[1]
    return {**combo, "identical": same, "first_difference": first,
            "shapes": [list(got.shape), list(want.shape)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=240)
    parser.add_argument("--seed", type=int, default=47)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sweep/rows.jsonl"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    combos = [draw(rng, i) for i in range(args.count)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if args.out.exists():
        for line in args.out.read_text().splitlines():
            row = json.loads(line)
            if row.get("seed") == args.seed:
                done[row["index"]] = row
    models = Models()
    with args.out.open("a") as sink:
        for combo in combos:
            if combo["index"] in done:
                continue
            try:
                row = run(combo, models)
            except Exception as error:  # a refusal is a finding too: recorded, not fatal to the sweep
                row = {**combo, "identical": False, "error": f"{type(error).__name__}: {error}",
                       "trace": traceback.format_exc(limit=3)}
            row["seed"] = args.seed
            done[combo["index"]] = row
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            mark = "ok" if row["identical"] else ("ERROR " + row["error"] if "error" in row else
                                                 f"DIFFERS at {row['first_difference']}")
            print(f"[{combo['index'] + 1}/{args.count}] {combo['arch']} {combo['generator']} {combo['site']} "
                  f"rows={combo['rows']} {combo['settings']}: {mark}", flush=True)
    rows = [done[c["index"]] for c in combos]
    bad = [r for r in rows if not r["identical"]]
    archs = sorted({r["arch"] for r in rows})
    print(f"{len(rows) - len(bad)} of {len(rows)} combinations identical to target.generate "
          f"({len(archs)} architectures: {', '.join(archs)})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
