"""The methods a benchmark runs: SpecDecoder configurations and ``transformers``' own ``generate``.

Each config method becomes a :class:`MethodRunner` with the same three calls, so the run loop
never asks which kind it holds. Invariants: every call, ``transformers``' and SpecDecoder's, gets
the same generation settings (:func:`generation_kwargs`: the config's processors, the neutral
value of every other one spelled out, so a model's ``generation_config`` adds nothing); the user's models and generation configs are never changed; anything that compiles is
compiled here, before the first timed call (docs/benchmarks.md, "Static caches and compiled
forwards").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from ..decoder import SpecDecoder
from ..metrics import AcceptanceStats
from ..modelinfo import pad_token_id
from ..models import load_model
from ..prompts import encode_chat, left_pad
from .config import (HF_ASSISTED, HF_PROMPT_LOOKUP, LLAMA_CPP, REFERENCE_OPTIONS, BenchConfig, ConfigError, GenerationSettings,
                     MethodConfig, generator_class)

WARMUP_PROMPT = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"
#: decoding steps of :func:`hf_warmup`: a compiled step, then a few more (CUDA graphs are recorded on a later run)
HF_WARMUP_NEW_TOKENS = 16


@dataclass
class MethodRunner:
    """One method, ready to run: ``run(input_ids [1, L], seed, max_new_tokens=None, grammar=None) -> (new
    token ids, stats or None)``; ``run_batch(input_ids [B, P], attention_mask [B, P], seed,
    max_new_tokens=None, grammar=None) -> ([B, N] new ids, stats or None)``, None for the methods
    transformers runs only at batch size 1; ``warmup(batch_size, max_length) -> seconds`` compiles
    what the method will run (None when it does not compile). ``max_new_tokens`` overrides the
    config's (the warm-up's short calls); ``grammar`` is a compiled grammar, or a list of one per row."""

    config: MethodConfig
    run: Callable[..., tuple[list[int], AcceptanceStats | None]]
    run_batch: Callable[..., tuple[torch.Tensor, AcceptanceStats | None]] | None = None
    warmup: Callable[[int, int], float] | None = None


# -- transformers' generate ----------------------------------------------------------------------
def generation_kwargs(gen: GenerationSettings, target, max_new_tokens: int | None = None) -> dict:
    """The generation settings of every call, ``transformers``' and SpecDecoder's alike (both take
    them by these names): the config's processors, and the neutral value of each one it leaves
    unset spelled out, so that the model's own generation_config adds none (top_k would default to
    50, for one)."""
    kwargs = dict(max_new_tokens=max_new_tokens or gen.max_new_tokens, do_sample=gen.do_sample,
                  pad_token_id=pad_token_id(target), repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0)
    kwargs.update(gen.processor_settings())
    if gen.do_sample:
        kwargs.update(temperature=gen.temperature, top_k=gen.top_k or 0, top_p=1.0 if gen.top_p is None else gen.top_p,
                      min_p=gen.min_p)
    return kwargs


hf_generation_kwargs = generation_kwargs  # the earlier name


def hf_cache_kwargs(cache_implementation: str = "dynamic", compile: bool | dict = False) -> dict:
    """``generate()`` arguments that keep transformers' cache and compilation as asked and no more:
    nothing for the dynamic cache; a static cache with ``disable_compile=True`` (on CUDA transformers
    would otherwise compile on its own); with ``compile``, a ``CompileConfig`` (``compile``'s mapping
    are its fields) marked to compile on every device. Per call: the model's own config never changes."""
    if cache_implementation == "dynamic":
        return {}
    if compile is False:
        return {"cache_implementation": cache_implementation, "disable_compile": True}
    from transformers import CompileConfig

    options = dict(compile) if isinstance(compile, dict) else {}
    if options.get("backend", "inductor") != "inductor":
        options.setdefault("mode", None)  # CompileConfig's "reduce-overhead" is an inductor mode
    config = CompileConfig(**options)
    config._compile_all_devices = True
    return {"cache_implementation": cache_implementation, "compile_config": config}


def hf_warmup(target, cache: dict, batch_size: int, max_length: int, new_tokens: int = HF_WARMUP_NEW_TOKENS) -> float:
    """One untimed ``target.generate`` with ``cache`` (:func:`hf_cache_kwargs`) that compiles its decoding
    forward for ``batch_size`` rows, its prompt long enough that the static cache (sized to the longest
    call so far) holds every later call up to ``max_length``. Returns the seconds."""
    started = time.perf_counter()
    vocab = min(int(target.get_input_embeddings().weight.shape[0]), 256)
    ids = torch.arange(max(max_length - new_tokens, 1)).remainder(vocab)[None, :].repeat(batch_size, 1)  # [B, L]
    ids = ids.to(target.device)
    with torch.no_grad():  # min_new_tokens: an EOS must not end it before the compiled steps ran
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id(target), **cache)
    return time.perf_counter() - started


def hf_grammar_kwargs(grammar) -> dict:
    """``generate()``'s arguments for a compiled grammar (or one per row): xgrammar's own logits
    processor, a fresh one per call (it counts its calls); nothing without a grammar."""
    if grammar is None:
        return {}
    from xgrammar.contrib.hf import LogitsProcessor

    return {"logits_processor": [LogitsProcessor(grammar)]}


def _hf_runner(target, gen: GenerationSettings, extra: Callable[[], dict], cache: dict):
    def run(input_ids, seed, max_new_tokens=None, grammar=None):  # input_ids [1, L]
        if seed is not None:
            torch.manual_seed(seed)
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                              **hf_generation_kwargs(gen, target, max_new_tokens), **cache, **extra(),
                              **hf_grammar_kwargs(grammar))
        return out[0, input_ids.shape[1]:].tolist(), None
    return run


def _hf_batch_runner(target, gen: GenerationSettings, cache: dict):
    """Plain batched ``target.generate`` on a left-padded batch (the ``baseline`` of a batched pass)."""
    def run_batch(input_ids, attention_mask, seed, max_new_tokens=None, grammar=None):  # [B, P] each
        if seed is not None:
            torch.manual_seed(seed)
        out = target.generate(input_ids, attention_mask=attention_mask,
                              **hf_generation_kwargs(gen, target, max_new_tokens), **cache,
                              **hf_grammar_kwargs(grammar))
        return out[:, input_ids.shape[1]:], None  # [B, N]
    return run_batch


def _config_vocab_size(model) -> int:
    """The config's vocabulary size: what transformers compares to decide whether an assistant needs
    tokenizers (not :func:`specdec.modelinfo.vocab_size`, the logits width, which may be padded)."""
    return model.config.get_text_config().vocab_size


def _hf_extra(method: MethodConfig, target, tokenizer, draft) -> Callable[[], dict]:
    """Per-call keyword arguments of a reference method (built once, called before every generate)."""
    options = REFERENCE_OPTIONS[method.generator].model_validate(method.options)
    if method.generator == HF_PROMPT_LOOKUP:
        return lambda: {"prompt_lookup_num_tokens": options.num_tokens, "max_matching_ngram_size": options.max_ngram}
    if method.generator == HF_ASSISTED:
        model, draft_tokenizer = draft
        same_vocab = _config_vocab_size(model) == _config_vocab_size(target)  # transformers' test for a universal assistant

        def extra():
            # transformers reads these from the assistant's generation_config and, under "heuristic",
            # writes the adapted value back between calls: reset before every call so each question
            # starts alike. The assistant is this run's own copy, never the user's.
            model.generation_config.num_assistant_tokens = options.num_tokens
            model.generation_config.num_assistant_tokens_schedule = options.schedule
            model.generation_config.assistant_confidence_threshold = options.confidence_threshold
            kw = {"assistant_model": model}
            if not same_vocab:
                kw.update(tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer)
            return kw
        return extra
    return dict  # baseline: nothing extra


def _reference_runner(method: MethodConfig, target, tokenizer, draft, gen: GenerationSettings) -> MethodRunner:
    if method.generator == LLAMA_CPP:
        from .peer import llama_cpp_runner

        return MethodRunner(method, llama_cpp_runner(REFERENCE_OPTIONS[LLAMA_CPP].model_validate(method.options),
                                                     target, gen))
    cache = hf_cache_kwargs(method.cache_implementation, method.compile)
    run = _hf_runner(target, gen, _hf_extra(method, target, tokenizer, draft), cache)
    run_batch = _hf_batch_runner(target, gen, cache) if method.kind.baseline else None
    warmup = partial(hf_warmup, target, cache) if method.compiles else None
    return MethodRunner(method, run, run_batch, warmup)


# -- SpecDecoder ---------------------------------------------------------------------------------
def _spec_runner(method: MethodConfig, target, tokenizer, draft, gen: GenerationSettings,
                 distributed: dict | None = None) -> MethodRunner:
    cls = generator_class(method.generator)
    draft_model, draft_tokenizer = draft if draft is not None else (None, None)
    # the generator's options and SpecDecoder's settings are refused apart, each naming its own keys
    try:
        instance = cls(draft_model, **method.options) if draft_model is not None else cls(**method.options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"methods: {method.name!r}: options: bad options for {method.generator!r}: {exc}") from None
    try:
        decoder = SpecDecoder(target, instance, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer,
                              cache_implementation=method.cache_implementation, compile=method.compile,
                              fast_head=method.fast_head, engine=method.engine, distributed=distributed)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"methods: {method.name!r}: SpecDecoder refused its settings (cache_implementation "
                          f"{method.cache_implementation!r}, compile {method.compile!r}, fast_head "
                          f"{method.fast_head!r}, engine {method.engine!r}): {exc}") from None

    def call(input_ids, attention_mask, seed, max_new_tokens, grammar):
        generator = None
        if seed is not None:
            torch.manual_seed(seed)
            generator = torch.Generator(device=target.device).manual_seed(seed)
        return decoder.generate(input_ids, attention_mask, generator=generator, grammar=grammar,
                                **generation_kwargs(gen, target, max_new_tokens))

    def run(input_ids, seed, max_new_tokens=None, grammar=None):  # input_ids [1, L]
        out = call(input_ids, None, seed, max_new_tokens, grammar)
        return out.sequences[0, input_ids.shape[1]:].tolist(), out.stats

    def run_batch(input_ids, attention_mask, seed, max_new_tokens=None, grammar=None):  # [B, P] each
        out = call(input_ids, attention_mask, seed, max_new_tokens, grammar)
        return out.sequences[:, input_ids.shape[1]:], out.stats  # [B, N]
    # every SpecDecoder method warms up: a generator may compile its own draft (self_draft) even
    # where the method's target does not; warmup() returns 0.0 when nothing compiles
    return MethodRunner(method, run, run_batch, decoder.warmup)


def load_drafts(config: BenchConfig, device: torch.device, log: Callable[[str], None] = lambda msg: None) -> dict:
    """Each distinct draft name loaded once, separately from the target (hooks count the target only)."""
    drafts = {}
    for name in dict.fromkeys(m.draft for m in config.methods if m.draft):
        log(f"loading the draft {name} ...")
        drafts[name] = load_model(name, dtype=config.torch_dtype, device=device)
    return drafts


def build_methods(config: BenchConfig, target, tokenizer, drafts: dict) -> list[MethodRunner]:
    """Every method of the config, in config order, ready to run on ``target``."""
    shards = config.distributed.options() if config.distributed is not None else None  # SpecDecoder(distributed=)
    build = lambda m: _reference_runner if m.is_reference else partial(_spec_runner, distributed=shards)  # noqa: E731
    return [build(m)(m, target, tokenizer, drafts.get(m.draft) if m.draft else None, config.generation)
            for m in config.methods]


# -- before the first timed call -------------------------------------------------------------------
def warmup_batch_sizes(batch_sizes: list[int], questions: int) -> list[int]:
    """Every batch size a compiled method can decode: 1 for the per-question pass, and up to B for a
    pass at B (a batch shrinks as its rows finish; the last batch may be smaller)."""
    largest = max(min(b, questions) for b in batch_sizes)
    return list(range(1, largest + 1)) if largest > 1 else [1]


def compile_methods(runners: list[MethodRunner], batch_sizes: list[int], max_length: int,
                    log: Callable[[str], None]) -> dict[str, float]:
    """Compile every method that compiles, before anything is timed: method name -> seconds."""
    seconds = {}
    for r in runners:
        if r.warmup is None:
            continue
        if r.config.compiles:
            log(f"compiling {r.config.name} (batch sizes {', '.join(map(str, batch_sizes))}, up to {max_length} "
                "tokens) ...")
        try:
            spent = sum(r.warmup(b, max_length) for b in batch_sizes)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"method {r.config.name!r} ({r.config.generator}) cannot compile: {exc}") from None
        if spent > 0:
            seconds[r.config.name] = spent
            log(f"{r.config.name}: compiled in {spent:.1f}s (not counted in any timing)")
    return seconds


def warm_up(runners: list[MethodRunner], tokenizer, new_tokens: int, device: torch.device, batched: bool = False,
            pad_id: int = 0) -> None:
    """Run every method once (``new_tokens`` each), unrecorded: first-call costs leave the timings, and a
    method that cannot run at all (a mismatched draft) fails here, before anything is written. With
    ``batched``, each method that runs batches also decodes one left-padded batch of two prompts."""
    ids = encode_chat(tokenizer, [{"role": "user", "content": WARMUP_PROMPT}])  # [1, L]
    for r in runners:
        try:
            r.run(ids.to(device), None, new_tokens)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"method {r.config.name!r} ({r.config.generator}) cannot run: {exc}") from None
    if not batched:
        return
    short = encode_chat(tokenizer, [{"role": "user", "content": WARMUP_PROMPT.split(".")[0]}])
    batch_ids, batch_mask = left_pad([ids[0], short[0]], pad_id)  # [2, P] each
    for r in runners:
        if r.run_batch is None:
            continue
        try:
            r.run_batch(batch_ids.to(device), batch_mask.to(device), None, new_tokens)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"batch_sizes: method {r.config.name!r} ({r.config.generator}) cannot run a batch: "
                              f"{exc}") from None
