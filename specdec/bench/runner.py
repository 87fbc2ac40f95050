"""Run a benchmark config: every method on the same prompts, interleaved per question, resumable.

Plan. Questions are selected deterministically (per subtask, evenly spaced by question_id). For
each question, turn by turn, every method runs, the reference method first (so that every other
row can record where its output first differs from the reference's) and the others in config
order; an MT-Bench question's second turn is built from the first turn, that method's *own* first
answer and the second turn, through the chat template (plain text for a model without one).
Interleaving methods per question keeps a shared, noisy machine from favouring whichever method
ran during a quiet minute. With ``repeats: N`` each turn runs N times, every method once per
repeat, and a row keeps the run of median wall time (:func:`median_run`; every run's seconds in
``seconds_runs``, and ``runs_identical``): a burst of load then moves a ratio far less.

Rows. One row is one (method, question_id, turn): a JSON line in ``results.jsonl``, appended,
flushed and fsynced as soon as it is produced (after its repeats), so an interrupted run loses at
most the turn in flight. ``run.json`` holds the validated config, the selected question ids, a hash of both, and
the machine it ran on.

Batches. ``batch_sizes`` lists the passes: size 1 is the per-question run above (its rows have no
``batch_size`` field, as before batches existed). For each size B > 1, in config order, the first
turns of the selected questions are grouped in order into batches of B (the last may be smaller),
left-padded (:func:`specdec.prompts.left_pad`) and run per batch, every method in config order:
``baseline`` = batched ``target.generate(input_ids, attention_mask=...)``, SpecDecoder methods =
``generate(input_ids, attention_mask, ...)``; ``hf_prompt_lookup`` and ``hf_assisted`` are skipped
(transformers refuses assisted generation for more than one sequence). MT-Bench second turns run
at batch size 1 only. One row is one (method, batch_size, batch_index): per-row question ids,
prompt lengths and new token ids (each cut after its first EOS: the rest is padding), the batch's
wall time, target forwards and ``AcceptanceStats``.

Resume. A rerun whose hash matches skips rows already present (a torn last line is cut off
first). A different hash is refused unless ``fresh=True``, which discards this directory's files.
A config whose ``batch_sizes`` is ``[1]`` hashes as it did before the field existed.

Measurement, the same for every method: wall time (``time.perf_counter``) around one
``generate()`` call, the new tokens back on the host before the clock stops (a CUDA call returns
before its kernels finish); new tokens = tokens after the prompt; target forwards counted by a
forward hook on the target (public ``nn.Module`` API), so methods that ``transformers`` runs
(``baseline``, ``hf_*``) get an honest mean accepted length (new tokens / target forwards).
Compiled forwards bypass module hooks, so a compiled method's rows have ``target_forwards: null``.
SpecDecoder methods also record their :class:`~specdec.metrics.AcceptanceStats`. Under greedy
decoding every row but the reference's own records ``first_difference``
(:func:`~specdec.bench.results.row_first_difference`: null when identical to the reference).

Devices and compilation. The target and the drafts are loaded with the config's ``dtype`` onto its
``device`` (a CUDA device this machine lacks is a :class:`ConfigError` when the run starts). A
method with ``compile`` is compiled before anything is timed: ``SpecDecoder.warmup`` for every
batch size it can decode (a batch shrinks as its rows finish) and a cache that holds the run's
longest call (:func:`longest_call`); ``transformers``' compiled ``generate`` by one untimed call of
that length per batch size. The seconds go to ``run.json`` (per session: a resumed run compiles
again) and the report, never into a row.

Where: ``--out`` (``out_dir``) when given, else :func:`~specdec.bench.results.default_out_dir`
(``results/<config stem>/`` beside the config, or beside its ``configs/`` folder); the run logs
the directory before it starts.

Before anything is written: the config is valid, the dataset exists and yields questions, the
device exists, every model loads, every method is built, compiled (if it compiles) and warmed up
once. So a bad config or a mismatched draft leaves no half-written directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..decoder import SpecDecoder
from ..metrics import AcceptanceStats
from ..modelinfo import ForwardTimer, eos_token_ids, pad_token_id
from ..models import load_model, resolve_device
from ..prompts import encode_chat, left_pad, load_questions, subtask_of
from .config import (HF_ASSISTED, HF_PROMPT_LOOKUP, REFERENCE_OPTIONS, BenchConfig, ConfigError, GenerationSettings,
                     MethodConfig, generator_class)
from .report import PLOTS_NEED_MATPLOTLIB, plots_available, write_report
from .results import (OWN_FILES, RESULTS_FILE, RUN_FILE, ResultStore, batch_groups, default_out_dir, planned_keys,
                      row_first_difference, row_key, shown_path)

WARMUP_PROMPT = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"


class ResultsMismatchError(RuntimeError):
    """The output directory holds results of a different config."""


# -- questions ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    subtask: str
    turns: tuple[str, ...]


def spread(items: list, count: int | None) -> list:
    """``count`` items evenly spaced over ``items`` (all when None or too few): index floor(i n / count)."""
    if count is None or count >= len(items):
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def select_questions(rows: list[dict], subtasks: list[str], categories: list[str] | None,
                     per_subtask: int | None) -> list[Question]:
    """Spec-Bench rows -> questions, grouped by subtask in the given order, each sorted by id."""
    out = []
    for subtask in subtasks:
        pool = sorted((r for r in rows if subtask_of(r["category"]) == subtask
                       and (categories is None or r["category"] in categories)), key=lambda r: r["question_id"])
        for r in spread(pool, per_subtask):
            out.append(Question(int(r["question_id"]), r["category"], subtask, tuple(r["turns"])))
    return out


def load_selected_questions(config: BenchConfig, config_dir: Path) -> list[Question]:
    """The config's questions, or a :class:`ConfigError` naming ``dataset`` (missing, malformed, empty)."""
    dataset = config.dataset_path(config_dir)
    if not dataset.is_file():
        raise ConfigError(f"dataset.path: file not found: {dataset}")
    try:
        questions = select_questions(load_questions(dataset), config.dataset.subtasks, config.dataset.categories,
                                     config.dataset.per_subtask)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"dataset.path: {dataset} is not Spec-Bench JSONL (one object per line with "
                          f"question_id, category, turns): {type(exc).__name__}: {exc}") from None
    if not questions:
        raise ConfigError(f"dataset: no question in {dataset} matches subtasks {config.dataset.subtasks}"
                          + (f" and categories {config.dataset.categories}" if config.dataset.categories else ""))
    return questions


def build_messages(turns: tuple[str, ...] | list[str], answers: list[str]) -> list[dict]:
    """Chat messages for turn ``len(turns)``: user turns interleaved with the method's own answers."""
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def question_seed(seed: int, question_id: int, turn: int) -> int:
    """Sampling seed of one (question, turn), the same for every method, stable across reruns."""
    digest = hashlib.sha256(f"{seed}:{question_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def batch_seed(seed: int, batch_size: int, batch_index: int) -> int:
    """Sampling seed of one batch, the same for every method, stable across reruns."""
    digest = hashlib.sha256(f"{seed}:batch{batch_size}:{batch_index}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def config_hash(config: BenchConfig, questions: list[Question]) -> str:
    """Identifies what the results depend on: the config (its free-text description aside) and the questions.

    ``batch_sizes: [1]`` is hashed as the single-size field it replaced (``batch_size: 1``), so results
    written before batch sizes existed still resume."""
    dumped = _without_later_defaults(config.model_dump(mode="json", exclude={"description", "batch_sizes"}))
    if config.batch_sizes == [1]:
        dumped["batch_size"] = 1
    else:
        dumped["batch_sizes"] = config.batch_sizes
    payload = json.dumps({"config": dumped, "questions": [q.question_id for q in questions]}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


#: fields added after results were first written: hashed only when set to something other than their
#: default, so those results still resume
_LATER_FIELDS = {"config": ("device", "dtype", "reference", "repeats"),
                 "method": ("cache_implementation", "compile", "fast_head")}


def _without_later_defaults(dumped: dict) -> dict:
    """``dumped`` (a config's ``model_dump``) without the :data:`_LATER_FIELDS` at their defaults."""
    def strip(data: dict, model, names) -> dict:
        return {k: v for k, v in data.items() if not (k in names and v == model.model_fields[k].default)}

    out = strip(dumped, BenchConfig, _LATER_FIELDS["config"])
    out["methods"] = [strip(m, MethodConfig, _LATER_FIELDS["method"]) for m in dumped["methods"]]
    return out


def environment(device: torch.device | None = None) -> dict:
    """The machine a session ran on; ``device`` is where its models ran (default: the CPU)."""
    import transformers

    from .. import __version__

    device = device or torch.device("cpu")
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "specdec": __version__, "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


# -- methods -----------------------------------------------------------------------------------
def hf_generation_kwargs(gen: GenerationSettings, target, max_new_tokens: int | None = None) -> dict:
    """``generate()`` settings for transformers, neutral processors spelled out so that the model's
    own generation_config cannot add any (top_k would default to 50, for one). ``max_new_tokens``
    overrides the settings' (the warm-up's shorter calls)."""
    kwargs = dict(max_new_tokens=max_new_tokens or gen.max_new_tokens, do_sample=gen.do_sample,
                  pad_token_id=pad_token_id(target), repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0)
    if gen.do_sample:
        kwargs.update(temperature=gen.temperature, top_k=gen.top_k or 0, top_p=1.0 if gen.top_p is None else gen.top_p)
    return kwargs


def hf_cache_kwargs(cache_implementation: str = "dynamic", compile: bool | dict = False) -> dict:
    """``generate()`` arguments that make ``transformers`` keep its cache and compile as asked, and no
    more: nothing for the default dynamic cache (today's calls stay as they were);
    ``cache_implementation="static"`` and ``disable_compile=True`` for a static cache without
    ``compile`` (on CUDA transformers would otherwise compile on its own, untimed warm-up or not); with
    ``compile``, a ``CompileConfig`` (``compile``'s mapping are its fields) marked to compile on every
    device (transformers compiles only on accelerators by default). Given per call, so they apply to a
    copy of the generation config: the model's own is never changed."""
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


#: decoding steps of :func:`hf_warmup`: a compiled step, then a few more (CUDA graphs are recorded on a later run)
HF_WARMUP_NEW_TOKENS = 16


def hf_warmup(target, cache: dict, batch_size: int, max_length: int, new_tokens: int = HF_WARMUP_NEW_TOKENS) -> float:
    """One untimed ``target.generate`` with ``cache`` (:func:`hf_cache_kwargs`) that compiles its decoding
    forward for ``batch_size`` rows: ``max_length - new_tokens`` prompt tokens, so the static cache, which
    transformers sizes to the longest call so far, holds every later call up to ``max_length``;
    ``min_new_tokens`` keeps an EOS from ending it before the compiled steps ran. Returns the seconds."""
    started = time.perf_counter()
    vocab = min(int(target.get_input_embeddings().weight.shape[0]), 256)
    ids = torch.arange(max(max_length - new_tokens, 1)).remainder(vocab)[None, :].repeat(batch_size, 1)
    ids = ids.to(target.device)
    with torch.no_grad():
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id(target), **cache)
    return time.perf_counter() - started


@dataclass
class MethodRunner:
    """One method, ready to run: ``run(input_ids [1, L], seed, max_new_tokens=None) -> (new token ids,
    stats or None)``; ``run_batch(input_ids [B, P], attention_mask [B, P], seed, max_new_tokens=None)
    -> ([B, N] new ids, stats or None)`` (None for the methods transformers runs only at batch size 1);
    ``warmup(batch_size, max_length) -> seconds`` compiles what the method will run (None when it
    does not compile). ``max_new_tokens`` overrides the config's (the warm-up's short calls)."""

    config: MethodConfig
    run: Callable[..., tuple[list[int], AcceptanceStats | None]]
    run_batch: Callable[..., tuple[torch.Tensor, AcceptanceStats | None]] | None = None
    warmup: Callable[[int, int], float] | None = None


def _hf_runner(target, gen: GenerationSettings, extra: Callable[[], dict], cache: dict):
    def run(input_ids, seed, max_new_tokens=None):
        if seed is not None:
            torch.manual_seed(seed)
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                              **hf_generation_kwargs(gen, target, max_new_tokens), **cache, **extra())
        return out[0, input_ids.shape[1]:].tolist(), None
    return run


def _hf_batch_runner(target, gen: GenerationSettings, cache: dict):
    """Plain batched ``target.generate`` on a left-padded batch (the ``baseline`` of a batched pass)."""
    def run_batch(input_ids, attention_mask, seed, max_new_tokens=None):
        if seed is not None:
            torch.manual_seed(seed)
        out = target.generate(input_ids, attention_mask=attention_mask,
                              **hf_generation_kwargs(gen, target, max_new_tokens), **cache)
        return out[:, input_ids.shape[1]:], None
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


def _spec_runner(method: MethodConfig, target, tokenizer, draft, gen: GenerationSettings) -> MethodRunner:
    cls = generator_class(method.generator)
    draft_model, draft_tokenizer = draft if draft is not None else (None, None)
    try:
        instance = cls(draft_model, **method.options) if draft_model is not None else cls(**method.options)
        decoder = SpecDecoder(target, instance, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer,
                              cache_implementation=method.cache_implementation, compile=method.compile,
                              fast_head=method.fast_head)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"methods: {method.name!r}: bad options for {method.generator!r}: {exc}") from None

    def call(input_ids, attention_mask, seed, max_new_tokens):
        generator = None
        if seed is not None:
            torch.manual_seed(seed)
            generator = torch.Generator(device=target.device).manual_seed(seed)
        return decoder.generate(input_ids, attention_mask, max_new_tokens=max_new_tokens or gen.max_new_tokens,
                                do_sample=gen.do_sample, temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p,
                                generator=generator)

    def run(input_ids, seed, max_new_tokens=None):
        out = call(input_ids, None, seed, max_new_tokens)
        return out.sequences[0, input_ids.shape[1]:].tolist(), out.stats

    def run_batch(input_ids, attention_mask, seed, max_new_tokens=None):
        out = call(input_ids, attention_mask, seed, max_new_tokens)
        return out.sequences[:, input_ids.shape[1]:], out.stats
    # every SpecDecoder method warms up: a generator may compile its own draft (self_draft) even
    # where the method's target does not; warmup() returns 0.0 when nothing compiles
    return MethodRunner(method, run, run_batch, decoder.warmup)


def _reference_runner(method: MethodConfig, target, tokenizer, draft, gen: GenerationSettings) -> MethodRunner:
    cache = hf_cache_kwargs(method.cache_implementation, method.compile)
    run = _hf_runner(target, gen, _hf_extra(method, target, tokenizer, draft), cache)
    run_batch = _hf_batch_runner(target, gen, cache) if method.kind.baseline else None
    warmup = partial(hf_warmup, target, cache) if method.compiles else None
    return MethodRunner(method, run, run_batch, warmup)


def build_methods(config: BenchConfig, target, tokenizer, drafts: dict) -> list[MethodRunner]:
    """Every method of the config, in config order, ready to run on ``target``."""
    build = lambda m: _reference_runner if m.is_reference else _spec_runner  # noqa: E731
    return [build(m)(m, target, tokenizer, drafts.get(m.draft) if m.draft else None, config.generation)
            for m in config.methods]


# -- the run -----------------------------------------------------------------------------------
@dataclass
class RunResult:
    out_dir: Path
    rows_total: int
    rows_done_before: int
    rows_new: int = 0
    report: Path | None = None
    notes: list[str] = field(default_factory=list)


def prepare_out_dir(out_dir: Path, digest: str, fresh: bool) -> None:
    """Refuse a directory holding another config's results (unless ``fresh``: then clear our files)."""
    run_file = out_dir / RUN_FILE
    if not run_file.exists():
        if (out_dir / RESULTS_FILE).exists() and not fresh:
            raise ResultsMismatchError(f"{out_dir} has {RESULTS_FILE} but no {RUN_FILE}; rerun with --fresh "
                                       "to discard it, or choose another --out")
    else:
        previous = json.loads(run_file.read_text()).get("config_hash")
        if previous != digest and not fresh:
            raise ResultsMismatchError(
                f"{out_dir} holds results of a different config (hash {previous}, this config {digest}); "
                "rerun with --fresh to discard them, or choose another --out")
    if fresh:
        for name in OWN_FILES:
            (out_dir / name).unlink(missing_ok=True)


def _write_run_file(out_dir: Path, config: BenchConfig, config_file: str, digest: str,
                    questions: list[Question], done: int, device: torch.device | None = None,
                    warmup_seconds: dict[str, float] | None = None) -> None:
    """Create ``run.json`` (or add this session to it): the session's machine and, per compiled
    method, the seconds its compile warm-up took."""
    path = out_dir / RUN_FILE
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    env = environment(device)
    if path.exists():
        meta = json.loads(path.read_text())
    else:
        meta = {"config_file": config_file, "config_hash": digest, "config": config.model_dump(mode="json"),
                "questions": [{"question_id": q.question_id, "subtask": q.subtask, "turns": len(q.turns)}
                              for q in questions],
                "created": now, "environment": env, "sessions": []}
    meta["sessions"].append({"started": now, "rows_done_before": done, "environment": env,
                             "warmup_seconds": warmup_seconds or {}})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(path)


def run_device(config: BenchConfig) -> torch.device:
    """The device the config's ``device`` means on this machine, or a :class:`ConfigError` naming the field."""
    try:
        return resolve_device(config.device)
    except ValueError as exc:
        raise ConfigError(f"device: {exc}") from None


def _load_drafts(config: BenchConfig, device: torch.device) -> dict:
    """Each distinct draft name loaded once, separately from the target (hooks count the target only)."""
    return {name: load_model(name, dtype=config.torch_dtype, device=device)
            for name in dict.fromkeys(m.draft for m in config.methods if m.draft)}


#: tokens added per earlier answer in :func:`longest_call` (re-encoding text may split it differently)
ANSWER_MARGIN = 8


def longest_call(questions: list[Question], tokenizer, max_new_tokens: int, every_turn: bool = True) -> int:
    """An upper bound of prompt + new tokens over the run's ``generate()`` calls: the length a compiled
    method's caches are warmed up to. A question's last turn carries the method's earlier answers, each
    counted as ``max_new_tokens`` plus :data:`ANSWER_MARGIN` (its text is encoded again, which may
    split it differently); ``every_turn=False``: first turns only (the batched passes)."""
    longest = 0
    for q in questions:
        turns = q.turns if every_turn else q.turns[:1]
        prompt = encode_chat(tokenizer, build_messages(turns, [""] * (len(turns) - 1))).shape[1]
        longest = max(longest, prompt + len(turns) * max_new_tokens + (len(turns) - 1) * ANSWER_MARGIN)
    return longest


def warmup_batch_sizes(batch_sizes: list[int], questions: int) -> list[int]:
    """Every batch size a compiled method can decode: 1 for the per-question pass, and up to B for a
    pass at B (a batch shrinks as its rows finish; the last batch may be smaller)."""
    largest = max(min(b, questions) for b in batch_sizes)
    return list(range(1, largest + 1)) if largest > 1 else [1]


def _compile(runners: list[MethodRunner], batch_sizes: list[int], max_length: int,
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
    return seconds


def _warm_up(runners: list[MethodRunner], tokenizer, new_tokens: int, device: torch.device, batched: bool = False,
             pad_id: int = 0) -> None:
    """Run every method once (``new_tokens`` each), unrecorded: first-call costs (allocations, lazy inits)
    leave the timings, and a method that cannot run at all (a mismatched draft) fails here, before
    anything is written. With ``batched``, each method that runs batches also decodes one left-padded
    batch of two prompts."""
    ids = encode_chat(tokenizer, [{"role": "user", "content": WARMUP_PROMPT}])
    for r in runners:
        try:
            r.run(ids.to(device), None, new_tokens)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"method {r.config.name!r} ({r.config.generator}) cannot run: {exc}") from None
    if not batched:
        return
    short = encode_chat(tokenizer, [{"role": "user", "content": WARMUP_PROMPT.split(".")[0]}])
    batch_ids, batch_mask = left_pad([ids[0], short[0]], pad_id)
    for r in runners:
        if r.run_batch is None:
            continue
        try:
            r.run_batch(batch_ids.to(device), batch_mask.to(device), None, new_tokens)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"batch_sizes: method {r.config.name!r} ({r.config.generator}) cannot run a batch: "
                              f"{exc}") from None


def real_new_tokens(new: torch.Tensor, eos: set[int]) -> list[list[int]]:
    """[B, N] generated ids -> per row, the ids up to and including the first EOS (the rest is padding)."""
    rows = []
    for row in new.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


@dataclass
class _Models:
    """The loaded target and the methods built on it, ready to run (the reference method first)."""

    target: torch.nn.Module
    tokenizer: object
    runners: list[MethodRunner]
    pad_id: int
    eos: set[int]
    device: torch.device
    warmup_seconds: dict[str, float] = field(default_factory=dict)  # compiled methods only


def _load_and_warm_up(config: BenchConfig, questions: list[Question], log: Callable[[str], None]) -> _Models:
    """Load the target and drafts, build every method, compile those that compile, warm each up once
    (nothing is written)."""
    device = run_device(config)
    log(f"loading {config.target} ({config.dtype} on {device}) ...")
    target, tokenizer = load_model(config.target, dtype=config.torch_dtype, device=device)
    runners = build_methods(config, target, tokenizer, _load_drafts(config, device))
    reference = config.reference_method.name
    runners.sort(key=lambda r: r.config.name != reference)  # stable: the others stay in config order
    sizes = warmup_batch_sizes(config.batch_sizes, len(questions))
    longest = longest_call(questions, tokenizer, config.generation.max_new_tokens, every_turn=1 in config.batch_sizes)
    compiled = _compile(runners, sizes, longest, log)
    pad_id = pad_token_id(target)
    _warm_up(runners, tokenizer, config.warmup_new_tokens, device, batched=any(b > 1 for b in config.batch_sizes),
             pad_id=pad_id)
    return _Models(target, tokenizer, runners, pad_id, set(eos_token_ids(target)), device, compiled)


@contextmanager
def _process_settings(threads: int) -> Iterator[None]:
    """torch threads and transformers' log level for the run; restored after, so that a library call
    leaves the process as it found it."""
    from transformers.utils import logging as hf_logging

    previous_threads, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()  # per-call generation notices would drown the progress bar
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        torch.set_num_threads(previous_threads)


class _Recorder:
    """Appends rows to the store (synced), keeps ``done`` and the progress bar up to date. With a
    ``reference`` (greedy runs), each row records where it first differs from the reference's output."""

    def __init__(self, store: ResultStore, done: dict, result: RunResult, bar, on_row: Callable[[dict], None] | None,
                 reference: str | None = None):
        self.store, self.done, self.result, self.bar, self.on_row = store, done, result, bar, on_row
        self.reference = reference

    def __call__(self, row: dict, label: str) -> None:
        if self.reference is not None:
            try:
                row["first_difference"] = row_first_difference(row, self.done, self.reference)
            except LookupError:
                pass  # the reference's own row, or no reference output to compare with
        self.store.append(row)
        self.done[row_key(row)] = row
        self.result.rows_new += 1
        self.bar.update(1)
        self.bar.set_postfix_str(f"{row['method']} {label} {_total_tokens(row) / max(row['seconds'], 1e-9):.1f} tok/s")
        if self.on_row is not None:
            self.on_row(row)


def _open_results(out_dir: Path, config: BenchConfig, config_file: str, digest: str, questions: list[Question],
                  models: _Models, fresh: bool, log: Callable[[str], None]) -> tuple[ResultStore, dict, RunResult]:
    """Create (or resume) the output directory: the store, the rows already done, the run's counts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prepare_out_dir(out_dir, digest, fresh)
    store = ResultStore(out_dir / RESULTS_FILE)
    done = {row_key(r): r for r in store.load(repair=True)}
    planned = planned_keys([(r.config.name, r.run_batch is not None) for r in models.runners],
                           [(q.question_id, len(q.turns)) for q in questions], config.batch_sizes)
    result = RunResult(out_dir, len(planned), len(planned & set(done)))
    _write_run_file(out_dir, config, config_file, digest, questions, result.rows_done_before, models.device,
                    models.warmup_seconds)
    if result.rows_done_before:
        log(f"resuming: {result.rows_done_before}/{result.rows_total} rows already in {store.path}")
    return store, done, result


def median_run(runs: list[dict]) -> dict:
    """The row of one call run ``len(runs)`` times: the run of median wall time (the lower of the two
    middle ones for an even count), with every run's ``seconds_runs`` and whether every run gave the
    same new tokens (``runs_identical``). One run is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    chosen = sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]
    return {**chosen, "seconds_runs": [r["seconds"] for r in runs],
            "runs_identical": all(r["output_ids"] == chosen["output_ids"] for r in runs)}


def _run_per_question(models: _Models, questions: list[Question], gen: GenerationSettings, done: dict,
                      record: _Recorder, repeats: int = 1) -> None:
    """The batch-size-1 pass: every question, turn by turn; each turn runs ``repeats`` times, every
    method (the reference first) once per repeat. A method's later turns carry its own recorded answers."""
    for q in questions:
        answers: dict[str, list[str]] = {r.config.name: [] for r in models.runners}
        for turn in range(1, len(q.turns) + 1):
            todo = []
            for runner in models.runners:
                key = (runner.config.name, q.question_id, turn)
                if key in done:
                    answers[runner.config.name].append(done[key]["text"])
                else:
                    todo.append(runner)
            runs: dict[str, list[dict]] = {r.config.name: [] for r in todo}
            for repeat in range(repeats):
                for runner in todo:
                    name = runner.config.name
                    runs[name].append(_run_one(runner, q, turn, answers[name], models, gen))
                    if repeat == repeats - 1:  # its last run: the row is complete
                        row = median_run(runs[name])
                        answers[name].append(row["text"])
                        record(row, q.subtask)


def _run_batches(models: _Models, questions: list[Question], batch_size: int, gen: GenerationSettings, done: dict,
                 record: _Recorder, repeats: int = 1) -> None:
    """One batch-size > 1 pass: first turns, left-padded batches, every method that runs batches
    (``repeats`` times per batch, interleaved as in :func:`_run_per_question`)."""
    for index, group in enumerate(batch_groups(questions, batch_size)):
        todo = [r for r in models.runners
                if r.run_batch is not None and (r.config.name, "batch", batch_size, index) not in done]
        if not todo:
            continue
        prompts = [encode_chat(models.tokenizer, build_messages(q.turns[:1], []))[0] for q in group]
        runs: dict[str, list[dict]] = {r.config.name: [] for r in todo}
        for repeat in range(repeats):
            for runner in todo:
                runs[runner.config.name].append(_run_batch(runner, group, prompts, batch_size, index, models, gen))
                if repeat == repeats - 1:
                    record(median_run(runs[runner.config.name]), f"batch {batch_size} #{index}")


def run_benchmark(config: BenchConfig, *, config_file: str | Path, out_dir: str | Path | None = None,
                  fresh: bool = False, progress: bool = True, on_row: Callable[[dict], None] | None = None,
                  log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> RunResult:
    """Run (or resume) ``config``; return where the results are. See the module docstring."""
    from tqdm.auto import tqdm

    config_file = str(config_file)
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir(config_file)
    questions = load_selected_questions(config, Path(config_file).parent)
    digest = config_hash(config, questions)
    if not fresh:
        prepare_out_dir(out_dir, digest, fresh=False)  # refuse early, before loading any model
    log(f"results: {shown_path(out_dir)}")
    if not plots_available():
        log(PLOTS_NEED_MATPLOTLIB)

    with _process_settings(config.threads):
        models = _load_and_warm_up(config, questions, log)
        # -- from here on, files are written ------------------------------------------------------
        store, done, result = _open_results(out_dir, config, config_file, digest, questions, models, fresh, log)
        with tqdm(total=result.rows_total, initial=result.rows_done_before, unit="row", disable=not progress,
                  desc=Path(config_file).stem, dynamic_ncols=True) as bar:
            reference = None if config.generation.do_sample else config.reference_method.name
            record = _Recorder(store, done, result, bar, on_row, reference)
            if 1 in config.batch_sizes:
                _run_per_question(models, questions, config.generation, done, record, config.repeats)
            for size in (b for b in config.batch_sizes if b > 1):
                _run_batches(models, questions, size, config.generation, done, record, config.repeats)
    result.report = write_report(out_dir, log=None)  # a missing matplotlib was reported at the start
    return result


def _run_one(runner: MethodRunner, q: Question, turn: int, answers: list[str], models: _Models,
             gen: GenerationSettings) -> dict:
    tokenizer = models.tokenizer
    input_ids = encode_chat(tokenizer, build_messages(q.turns[:turn], answers)).to(models.device)  # [1, L]
    seed = question_seed(gen.seed, q.question_id, turn) if gen.do_sample else None
    with _forward_counter(models.target, runner.config) as forwards:
        started = time.perf_counter()
        new_ids, stats = runner.run(input_ids, seed)  # a list: on the host
        seconds = time.perf_counter() - started
    return {
        "method": runner.config.name, "generator": runner.config.generator, "question_id": q.question_id,
        "category": q.category, "subtask": q.subtask, "turn": turn, "prompt_tokens": int(input_ids.shape[1]),
        "new_tokens": len(new_ids), "seconds": seconds, "target_forwards": _calls(forwards), "seed": seed,
        "stats": stats.as_dict() if stats is not None else None,
        "output_ids": new_ids, "text": tokenizer.decode(new_ids, skip_special_tokens=True),
    }


def _forward_counter(target, method: MethodConfig):
    """A :class:`ForwardTimer` on the target; nothing for a compiled method, whose compiled forwards
    bypass module hooks (a count would be wrong, and a hook must not enter a graph compiled later)."""
    return nullcontext() if method.compiles else ForwardTimer(target)


def _calls(forwards: ForwardTimer | None) -> int | None:
    return forwards.calls if forwards is not None else None


def _total_tokens(row: dict) -> int:
    return sum(row["new_tokens"]) if isinstance(row["new_tokens"], list) else row["new_tokens"]


def _run_batch(runner: MethodRunner, group: list[Question], prompts: list[torch.Tensor], batch_size: int,
               batch_index: int, models: _Models, gen: GenerationSettings) -> dict:
    """One left-padded batch of first turns through one method: one row with per-row outputs."""
    input_ids, attention_mask = left_pad(prompts, models.pad_id)
    input_ids, attention_mask = input_ids.to(models.device), attention_mask.to(models.device)
    seed = batch_seed(gen.seed, batch_size, batch_index) if gen.do_sample else None
    with _forward_counter(models.target, runner.config) as forwards:
        started = time.perf_counter()
        new, stats = runner.run_batch(input_ids, attention_mask, seed)
        new = new.cpu()  # waits for the device: its kernels are part of the call
        seconds = time.perf_counter() - started
    outputs = real_new_tokens(new, models.eos)
    return {
        "method": runner.config.name, "generator": runner.config.generator, "batch_size": batch_size,
        "batch_index": batch_index, "question_ids": [q.question_id for q in group],
        "categories": [q.category for q in group], "subtasks": [q.subtask for q in group], "turn": 1,
        "prompt_tokens": [int(p.numel()) for p in prompts], "padded_width": int(input_ids.shape[1]),
        "new_tokens": [len(o) for o in outputs], "seconds": seconds, "target_forwards": _calls(forwards), "seed": seed,
        "stats": stats.as_dict() if stats is not None else None, "output_ids": outputs,
    }
