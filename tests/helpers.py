"""Shared test utilities (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import copy
import weakref

import torch

from specdec.generators import CandidateGenerator, DraftingInfo, Proposal
from specdec.kv import CacheSettings
from specdec.models import tiny_random
from specdec.policy import COST_GRID, SHAPE_RATE, CostModel
from specdec.prompts import left_pad  # noqa: F401  (re-exported for the tests)


#: torch.compile options for tests of what dynamo decides (which graphs a call compiles, its guards, its
#: warm-ups): dynamo's capture and guards, the captured graph run as it is
FAST_COMPILE = {"backend": "eager"}
#: torch.compile options for tests that a compiled forward is exact on each architecture: also
#: AOTAutograd's tracing, which inductor's code generation starts from (inductor itself takes seconds
#: a graph on a 2-core CPU; tests/test_static_cache.py and tests/test_self_draft.py run it once each)
AOT_COMPILE = {"backend": "aot_eager"}


def tiny_llava():
    """A tiny random LLaVA (vision-language model) for refusal tests."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=16, patch_size=8)
    return LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_id=63)).eval()


def perturbed_copy(model, scale: float = 0.3, seed: int = 0):
    """A draft that agrees with ``model`` often but not always: its weights plus relative noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return draft


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_checksum(model) -> dict:
    """Name -> (dtype, shape, the sum of the tensor's bit patterns as integers, wrapping) of every
    parameter and buffer: any change of any one element changes it, and a 1 GB model takes a tenth
    of a second (a float64 sum takes eight times as long, and can miss a change below its rounding)."""
    sums = {}
    for name, t in model.state_dict().items():  # detached tensors
        bits = t.contiguous().view(_SAME_SIZE_INT[t.element_size()])
        sums[name] = (t.dtype, tuple(t.shape), int(bits.sum(dtype=bits.dtype)))
    return sums


def repetitive_prompt(length: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    """[1, ~2*length] random ids with repeats, so prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (length,), generator=g)
    return torch.cat([base, base[: length // 2], base])[None, :]


def assert_batch_is_exact(decoder, target, new_tokens: int = 24) -> None:
    """A left-padded batch of two rows (one with repeats, one random) decodes to each row's own
    ``target.generate(do_sample=False)``."""
    rows = [repetitive_prompt(8, seed=3)[0], torch.randint(0, 250, (9,), generator=torch.Generator().manual_seed(4))]
    padded, mask = left_pad(rows, pad_id=257)
    out = decoder.generate(padded, mask, max_new_tokens=new_tokens)
    for b, row in enumerate(rows):
        want = reference(target, row[None, :], new_tokens)[0, row.numel():]
        assert torch.equal(out.sequences[b, padded.shape[1]: padded.shape[1] + want.numel()], want), b


def tiny_pair(arch: str, seed: int = 1, noise: float = 0.3, **overrides):
    """(target, perturbed draft, tokenizer) of one tiny architecture, the target's costs pinned."""
    target, tokenizer = tiny_random(arch, seed=seed, **overrides)
    return pin_costs(target), perturbed_copy(target, noise, seed=seed + 100), tokenizer


#: seconds of a tiny model's forward by tokens fed (``COST_GRID``): about a millisecond and nearly
#: flat, the shape the policy's calibration measures for the tiny models on a CPU
TINY_COSTS = tuple(1e-3 * (1 + (x - 1) / 32) for x in COST_GRID)
#: a forward "costs" a second at any width (pin it with rate 0, so that no timing moves it): next to
#: it drafting costs nothing, and the policy drafts every step whatever the machine's load
DRAFTING_PAYS = (1.0,) * len(COST_GRID)


def pin_costs(model, seconds: tuple = TINY_COSTS, rate: float = SHAPE_RATE):
    """Pin ``seconds`` as ``model``'s cost curve for every cache kind, so that its first greedy
    call skips the policy's timed calibration forwards (with ``rate`` > 0 the curve still follows
    the timings the loop observes). For tiny test models; returns ``model``."""
    for implementation, compile in (("dynamic", False), ("static", False), ("static", True)):
        for fast_head in (True, False):
            CostModel.pin(model, CostModel(list(seconds), rate=rate),
                          CacheSettings.make(implementation, compile, fast_head=fast_head))
    return model


_REFERENCES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def reference(model, ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """``model.generate(ids [B, P], max_new_tokens=..., do_sample=False, **kwargs)`` [B, P+N],
    computed once per model, prompt, settings and generation config (greedy output is a function
    of those) and kept while the model lives. Settings are told apart by their ``repr`` (give a
    stopping criterion one that names what it does); a test that changes a model's weights in
    place calls ``generate`` itself."""
    key = (tuple(ids.shape), tuple(ids.flatten().tolist()), max_new_tokens, repr(sorted(kwargs.items())),
           model.generation_config.to_json_string())
    known = _REFERENCES.setdefault(model, {})
    if key not in known:
        known[key] = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return known[key].clone()


class ForwardRecorder:
    """Records every forward of a model: tokens fed and keyword names, via a forward pre-hook."""

    def __init__(self, model):
        self.calls: list[dict] = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls.append({"tokens": int(ids.shape[1]) if ids is not None else 0, "batch": int(ids.shape[0]),
                           "input_ids": ids.clone() if ids is not None else None, "kwargs": set(kwargs)})

    def remove(self) -> None:
        self._handle.remove()


def chi_square_pooled(observed: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float]:
    """Pearson chi-square goodness of fit of ``observed`` counts to ``expected_probs`` (any shape,
    compared cell by cell; the probabilities need not sum to 1), with every cell of expected count
    < 5 pooled into one bin (the usual validity condition of the chi-square approximation).

    Cells of probability 0 must be empty (asserted) and take no part in the test.
    Returns ``(p_value, total_variation)``, the total variation distance between the observed
    frequencies and the normalised probabilities."""
    from scipy.stats import chisquare

    observed, expected_probs = observed.double().flatten(), expected_probs.double().flatten()
    impossible = expected_probs <= 0
    assert float(observed[impossible].sum()) == 0, "sampled a token or sequence the target cannot produce"
    n = float(observed.sum())
    probs = expected_probs / expected_probs.sum()
    expected = probs * n
    small = (expected < 5) & ~impossible
    big = ~small & ~impossible
    obs, exp = observed[big], expected[big]
    if bool(small.any()):  # pooled into one bin
        obs, exp = torch.cat([obs, observed[small].sum()[None]]), torch.cat([exp, expected[small].sum()[None]])
    p_value = float(chisquare(obs.numpy(), exp.numpy()).pvalue)
    tv = 0.5 * float((observed / n - probs).abs().sum())
    return p_value, tv


class RecordingStreamer:
    """A streamer that keeps what it gets: ``puts`` (each call's ids, flattened) and ``ended``."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, ids):
        self.puts.append(ids.clone().flatten())

    def end(self):
        self.ended = True


def every_generator(target, draft, target_tokenizer, draft_tokenizer, tokenizer=None) -> dict:
    """One ``SpecDecoder`` per built-in generator on ``target`` (``draft`` for the draft models),
    each drafting a fixed 4 tokens so that drafting happens, the self-drafts on an eager bfloat16
    copy (alone, and with prompt lookup: the hybrid, its default); ``tokenizer`` is given to each
    (the cross-tokenizer decoder always gets both)."""
    from specdec import SpecDecoder

    fixed = {"num_tokens": 4, "schedule": "fixed"}
    copy = {"weights": "bfloat16", "compile_draft": False, **fixed}
    return {
        "none": SpecDecoder(target, tokenizer=tokenizer),
        "prompt_lookup": SpecDecoder(target, "prompt_lookup", tokenizer=tokenizer, **fixed),
        "draft_model": SpecDecoder(target, draft, tokenizer=tokenizer, **fixed),
        "self_draft": SpecDecoder(target, "self_draft", lookup=False, tokenizer=tokenizer, **copy),  # the copy alone
        "self_draft_lookup": SpecDecoder(target, "self_draft", lookup=True, tokenizer=tokenizer, **copy),
        "cross_tokenizer": SpecDecoder(target, draft, tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer,
                                       min_confidence=0.0, **fixed),
    }


def merged_tokenizer_world(target_merges, draft_merges, texts):
    """A tiny Llama (seed 7) on a byte-level tokenizer with ``target_merges``, its costs pinned; a
    perturbed copy as the draft; a draft tokenizer with ``draft_merges``; one decoder per built-in
    generator (``every_generator``, the target's tokenizer given to each); the first of ``texts``
    as a single prompt and all of them as a left-padded batch.
    -> (target, target tokenizer, draft tokenizer, decoders, {"single"|"batch": (ids, mask)})"""
    from specdec.models import byte_tokenizer

    target_tok, draft_tok = byte_tokenizer(target_merges), byte_tokenizer(draft_merges)
    target, _ = tiny_random("llama", seed=7, tokenizer=target_tok)
    pin_costs(target)
    draft = perturbed_copy(target, 0.1, seed=8)
    decoders = every_generator(target, draft, target_tok, draft_tok, tokenizer=target_tok)
    single = target_tok(texts[0], return_tensors="pt").input_ids
    batch = left_pad([target_tok(t, return_tensors="pt").input_ids[0] for t in texts], target_tok.pad_token_id)
    return target, target_tok, draft_tok, decoders, {"single": (single, torch.ones_like(single)), "batch": batch}


def commit_verdict(out: torch.Tensor, count: torch.Tensor, drafts: torch.Tensor, verdict) -> torch.Tensor:
    """Append each row's accepted drafts (of ``drafts [N, K]``, in path order) and the verdict's own
    token to ``out [N, L]`` at ``count [N]``, in place (``count`` advances); -> the token [N]. For the
    tests that decode a Markov chain in lockstep through a verifier."""
    n, k = drafts.shape
    rows = torch.arange(n)
    block = torch.cat([drafts, drafts.new_zeros(n, 1)], 1)  # [N, K+1]
    block[rows, verdict.accepted] = verdict.next_token
    for j in range(k + 1):
        take = j <= verdict.accepted
        out[rows[take], count[take] + j] = block[take, j]
    count += verdict.accepted + 1
    return verdict.next_token


class BlindAssistant(CandidateGenerator):
    """Drafts sampled from an assistant's warped distribution, blind to the call's logits
    processors and grammar (as docs/plugins.md's assistant example drafts): some drafts are
    tokens the target can never take there. A fixed number of drafts a step, no policy."""

    def __init__(self, assistant, num_tokens: int = 3):
        self.assistant, self.num_tokens = assistant, num_tokens

    def drafting(self) -> DraftingInfo:
        return DraftingInfo(max_drafts=None)

    def setup(self, ctx) -> None:
        self.handle = ctx.attach(self.assistant)

    def propose(self, ctx, max_drafts: torch.Tensor) -> Proposal:
        k = int(max_drafts.clamp(0, self.num_tokens).max())
        if k == 0 or not ctx.sampling.do_sample:
            return Proposal.empty(ctx.batch_size, ctx.tokens.device)
        ids, probs = [], []
        for i in range(k):
            p = ctx.sampling.probs(self.handle.next_logits())  # [B, V]
            ids.append(torch.multinomial(p, 1, generator=ctx.generator).squeeze(1))
            probs.append(p)
            if i + 1 < k:
                self.handle.feed(ids[-1])
        return Proposal(torch.stack(ids, 1), max_drafts.clamp(0, k), torch.stack(probs, 1))
