"""Batch 8, SmolLM2-135M, summarization + rag: plain batched generate vs SpecDecoder prompt lookup for
several ModelState.REFEED_LIMIT values and generator options, with the mean forward width.

    python benchmarks/refeed_width.py 16 0 2 "0:num_tokens=2:max_tokens=4"
"""
import sys, time, torch
torch.set_num_threads(2)
from specdec import SpecDecoder, load_model
from specdec.modelinfo import pad_token_id
from specdec.state import ModelState
from specdec.prompts import load_questions, encode_chat, left_pad
m, tok = load_model("smollm2-135m")
qs = load_questions()
picked = [q for c in ("summarization", "rag") for q in [x for x in qs if x["category"] == c][:4]]
rows = [encode_chat(tok, [{"role": "user", "content": q["turns"][0]}])[0] for q in picked]
ids, mask = left_pad(rows, pad_token_id(m))
m.generate(ids[:, -8:], attention_mask=torch.ones_like(ids[:, -8:]), max_new_tokens=2, do_sample=False)
widths = []
orig = ModelState.forward
def spy(self, start):
    if self.model is m:
        widths.append((self.offsets + self.lengths).max().item() - self.cached_slots)
    return orig(self, start)
ModelState.forward = spy
for variant in sys.argv[1:]:
    limit, opts = variant.split(":")[0], dict(kv.split("=") for kv in variant.split(":")[1:])
    opts = {k: int(v) if v.isdigit() else v for k, v in opts.items()}
    ModelState.REFEED_LIMIT = int(limit)
    t = time.perf_counter(); ref = m.generate(ids, attention_mask=mask, max_new_tokens=96, do_sample=False); tp = time.perf_counter() - t
    widths.clear()
    t = time.perf_counter(); out = SpecDecoder(m, "prompt_lookup", **opts).generate(ids, mask, max_new_tokens=96); ts = time.perf_counter() - t
    print(variant, f"plain {tp:.1f}s spec {ts:.1f}s ratio {tp/ts:.2f} mean width {sum(widths)/len(widths):.1f} forwards {len(widths)} MAL {out.stats.mean_accepted_length:.2f}", flush=True)
