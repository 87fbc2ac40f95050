"""The benchmark YAML schema, validated with pydantic before any work is done.

A config names a target, where and how its models run, the questions, the generation and run
settings, and the methods: registered candidate generators (with a ``draft`` model when one takes
a model) and reference methods that call ``transformers`` itself; speedups are measured against
one ``baseline`` method, the reference. The schema, field by field: docs/benchmarks.md, "Schema".

Invariants: unknown fields are refused at every level, and so is a key given twice in one YAML
mapping (PyYAML would keep the last silently); every error is one line naming the field
(``methods[1].generator``, or the file and line) and the allowed values; a method's SpecDecoder
settings (``cache_implementation``, ``compile``, ``fast_head``, ``engine``) are its own keys, its generator's
options go in ``options``, and a key in the wrong one is named as such; validation never loads a
model, never writes a file, and checks the spelling of ``device`` only (the run checks the device
when it starts).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..engines import resolve_engine_name
from ..generators import NoDraft
from ..grammar import Grammar
from ..models import DTYPES, PACKAGED_MODELS, TINY_ARCHS, device_name_problem
from ..names import did_you_mean
from ..prompts import DEFAULT_SPEC_BENCH, MT_BENCH_CATEGORIES, SUBTASKS
from ..registry import UnknownGeneratorError, available_generators, fit_options, get_candidate_generator, needs_model

#: the reference methods: ``transformers`` itself, not a registered candidate generator
BASELINE = "baseline"
HF_ASSISTED = "hf_assisted"
HF_PROMPT_LOOKUP = "hf_prompt_lookup"
#: the peer on a CPU: llama.cpp (through llama-cpp-python) decoding a GGUF file of the target's weights
LLAMA_CPP = "llama_cpp"
REFERENCE_METHODS = (BASELINE, HF_ASSISTED, HF_PROMPT_LOOKUP, LLAMA_CPP)
#: a SpecDecoder method that drafts nothing: plain decoding through SpecDecoder's own loop (as ``--draft none``)
NO_DRAFT = "none"

Subtask = Literal["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
assert set(Subtask.__args__) == set(SUBTASKS)  # noqa: S101 - keep the Literal in step with prompts.SUBTASKS
DType = Literal["float32", "bfloat16", "float16"]
assert set(DType.__args__) == set(DTYPES)  # noqa: S101 - keep the Literal in step with models.DTYPES


class ConfigError(ValueError):
    """A bad benchmark config: the message is one line per problem, naming the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- reference-method options ------------------------------------------------------------------
class BaselineOptions(_Strict):
    """``baseline`` takes no options: it is ``target.generate`` with the generation settings."""


class HFPromptLookupOptions(_Strict):
    num_tokens: int = Field(10, ge=1, description="prompt_lookup_num_tokens")
    max_ngram: int = Field(2, ge=1, description="max_matching_ngram_size (transformers' default: 2)")


class HFAssistedOptions(_Strict):
    num_tokens: int = Field(20, ge=1, description="the assistant's generation_config.num_assistant_tokens")
    schedule: Literal["constant", "heuristic", "heuristic_transient"] = "constant"
    confidence_threshold: float = Field(0.4, ge=0, le=1, description="assistant_confidence_threshold: the assistant "
                                        "stops drafting below this probability (transformers' default 0.4; 0 = never)")


class LlamaCppOptions(_Strict):
    """``llama_cpp``: llama-cpp-python's ``Llama.generate``, greedy, on the target's packaged GGUF file
    re-written by llama.cpp's quantizer with weights of type ``weights`` (docs/benchmarks.md)."""

    weights: Literal["F32", "BF16", "F16", "Q8_0", "Q4_0", "Q4_1"] = Field(
        "F32", description="the GGUF file's weight type: F32 holds the weights the fp32 target decodes")
    lookup: int = Field(0, ge=0, description="tokens llama-cpp-python's prompt-lookup decoding drafts a step "
                                             "(LlamaPromptLookupDecoding num_pred_tokens); 0: plain decoding")
    max_ngram: int = Field(2, ge=1, description="LlamaPromptLookupDecoding max_ngram_size")
    kv_type: Literal["f32", "f16"] = Field("f32", description="the KV cache's type: f32 as specdec's llama_cpp "
                                                              "engine keeps it; f16 is llama.cpp's default")


REFERENCE_OPTIONS: dict[str, type[_Strict]] = {
    BASELINE: BaselineOptions, HF_ASSISTED: HFAssistedOptions, HF_PROMPT_LOOKUP: HFPromptLookupOptions,
    LLAMA_CPP: LlamaCppOptions}
#: reference methods that need a draft model
REFERENCE_NEEDS_DRAFT = {BASELINE: False, HF_ASSISTED: True, HF_PROMPT_LOOKUP: False, LLAMA_CPP: False}


@dataclass(frozen=True)
class MethodKind:
    """What the runner and the report need to know about a method, as data: the one place that
    maps generator names to roles, so that neither branches on a name."""

    baseline: bool = False  # plain ``target.generate``: speedups and exact match are measured against it
    reference: bool = False  # transformers runs it: no acceptance counts, target forwards counted instead
    batched: bool = True  # runs at batch size > 1 (transformers refuses assisted generation for several rows)
    compared_with: str | None = None  # the report sets it side by side with every method of this generator


#: the kind of every reference method; every registered candidate generator is ``MethodKind()``
REFERENCE_KINDS: dict[str, MethodKind] = {
    BASELINE: MethodKind(baseline=True, reference=True),
    HF_ASSISTED: MethodKind(reference=True, batched=False),
    HF_PROMPT_LOOKUP: MethodKind(reference=True, batched=False, compared_with="prompt_lookup"),
    LLAMA_CPP: MethodKind(reference=True, batched=False),
}


def method_kind(generator: str) -> MethodKind:
    """The :class:`MethodKind` of a method running ``generator`` (a reference method or a registered one)."""
    return REFERENCE_KINDS.get(generator, MethodKind())


# -- small pure checks -------------------------------------------------------------------------
def model_name_problem(name: str) -> str | None:
    """Why ``name`` is not a loadable model name, or None. Does not load anything."""
    if name in PACKAGED_MODELS or os.path.isdir(name):
        return None
    if name.startswith("tiny-random:"):
        arch = name.split(":", 1)[1]
        return None if arch in TINY_ARCHS else f"unknown tiny-random architecture {arch!r}; allowed: {', '.join(TINY_ARCHS)}"
    allowed = ", ".join([*PACKAGED_MODELS, "tiny-random:<arch>", "an existing local folder"])
    return f"unknown model {name!r}; allowed: {allowed}"


def generator_class(name: str) -> type:
    """The candidate-generator class a SpecDecoder method runs: the registry's, or ``NoDraft`` for ``none``."""
    return NoDraft if name == NO_DRAFT else get_candidate_generator(name)


#: a SpecDecoder method's keys beside ``options`` that set SpecDecoder itself, not its generator
DECODER_KEYS = ("cache_implementation", "compile", "fast_head", "engine")


def generator_option_problem(cls: type, options: dict, with_draft: bool) -> str | None:
    """Why ``cls(draft?, **options)`` cannot bind (the registry's :func:`~specdec.registry.fit_options`,
    said in this schema's words), or None (checks names only, not values). An unknown option that is
    (or is close to) one of the method's own keys (:data:`DECODER_KEYS`, ``draft``, ...) is named as that
    key, at ``options.<key>``: it belongs beside ``options``, not in it."""
    fit = fit_options(cls, options, takes_model=with_draft)
    if fit.ok:
        return None
    generator = cls.name or cls.__name__
    allowed = ", ".join(fit.params) or "(none)"
    method_keys = [k for k in MethodConfig.model_fields if k != "options"]
    for key in fit.unknown:
        if key in method_keys:
            return (f"options.{key}: {key!r} is a key of the method (beside options), not an option of "
                    f"{generator!r}; move it out of options (options of {generator!r}: {allowed})")
        if not did_you_mean(key, fit.params) and did_you_mean(key, method_keys):
            return (f"options.{key}: {generator!r} has no option {key!r}.{did_you_mean(key, method_keys)[:-1]}, "
                    f"the method's own key (beside options, not in it)? (options of {generator!r}: {allowed})")
    if not fit.unknown:
        return f"options do not fit for {generator!r}; allowed: {allowed}"
    return (f"unknown option(s) {sorted(fit.unknown)} for {generator!r}; allowed: {allowed}."
            + did_you_mean(sorted(fit.unknown)[0], fit.params))


def compile_option_names(generator: str) -> list[str]:
    """The keys a method's ``compile:`` mapping may hold: ``transformers``' ``CompileConfig`` fields for
    a reference method (``generate`` compiles itself), ``torch.compile``'s keyword arguments for a
    SpecDecoder method (``SpecDecoder(compile=...)`` passes them on)."""
    if generator in REFERENCE_METHODS:
        from transformers import CompileConfig

        return [f.name for f in dataclasses.fields(CompileConfig)]
    return [name for name in inspect.signature(torch.compile).parameters if name != "model"]


# -- the schema --------------------------------------------------------------------------------
class DatasetConfig(_Strict):
    path: str | None = Field(None, description="Spec-Bench question.jsonl; relative paths are relative to the "
                                               "config file; default: ../shared/spec_bench/question.jsonl")
    subtasks: list[Subtask] = Field(default_factory=lambda: list(SUBTASKS), min_length=1)
    categories: list[str] | None = Field(None, description="keep only these raw categories (e.g. writing, qa)")
    per_subtask: int | None = Field(None, ge=1, description="questions per subtask, spread evenly by question_id; "
                                                            "default: all")
    first_per_category: int | None = Field(None, ge=1, description="instead of per_subtask: the first N questions "
                                           "(by question_id) of each of `categories`, in the order listed")
    max_turns: int | None = Field(None, ge=1, description="turns asked per question (1: first turns only); "
                                                          "default: all")

    @field_validator("categories")
    @classmethod
    def _known_categories(cls, value: list[str] | None) -> list[str] | None:
        allowed = [*MT_BENCH_CATEGORIES, *SUBTASKS[1:]]
        if value == []:
            raise ValueError("an empty list selects no question; leave categories out to take every category")
        unknown = [c for c in value or [] if c not in allowed]
        if unknown:
            raise ValueError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {unknown}; allowed: {', '.join(allowed)}")
        return value

    @model_validator(mode="after")
    def _one_selection(self) -> "DatasetConfig":
        if self.first_per_category is not None and not self.categories:
            raise ValueError("first_per_category: needs categories (the categories to take questions from, in order)")
        if self.first_per_category is not None and self.per_subtask is not None:
            raise ValueError("first_per_category: give per_subtask or first_per_category, not both")
        return self


class GenerationSettings(_Strict):
    """The generation settings every method decodes with (transformers' baselines and SpecDecoder
    alike, passed to both by the same names: docs/generation.md); the logits-processor settings
    apply under greedy decoding and sampling, the sampling ones when ``do_sample``."""

    max_new_tokens: int = Field(128, ge=1)
    do_sample: bool = False
    temperature: float = Field(1.0, gt=0)
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int = Field(0, ge=0, description="sampling: question q, turn t uses a seed derived from (seed, q, t)")
    repetition_penalty: float | None = Field(None, gt=0)
    encoder_repetition_penalty: float | None = Field(None, gt=0)
    no_repeat_ngram_size: int | None = Field(None, ge=0)
    min_new_tokens: int | None = Field(None, ge=0)
    bad_words_ids: list[list[int]] | None = None
    suppress_tokens: list[int] | None = None
    grammar: dict[str, Any] | None = Field(None, description="constrain every output: {json_schema: {...}}, "
                                           "{regex: ...} or {ebnf: ...} (docs/structured.md); a question's own "
                                           "`grammar` field takes precedence")

    @field_validator("grammar")
    @classmethod
    def _grammar(cls, value: dict | None) -> dict | None:
        if value is not None:
            try:
                Grammar.from_config(value)
            except TypeError as exc:  # pydantic reports ValueErrors only
                raise ValueError(str(exc)) from None
        return value

    def processor_settings(self) -> dict[str, Any]:
        """The logits-processor settings this config sets (those left None: none)."""
        return {name: getattr(self, name) for name in PROCESSOR_SETTINGS if getattr(self, name) is not None}


#: GenerationSettings fields that build logits processors (transformers' names), and min_p
PROCESSOR_SETTINGS = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "min_new_tokens",
                      "bad_words_ids", "suppress_tokens")


class MethodConfig(_Strict):
    name: str = Field("", description="label in the results; default: the generator name")
    generator: str
    draft: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    cache_implementation: Literal["dynamic", "static"] = Field(
        "dynamic", description="how the target (and the draft) keep their key/value caches")
    compile: bool | dict[str, Any] = Field(False, description="torch.compile the forwards (static caches only): "
                                                              "true, or a mapping of compile options")
    fast_head: bool = Field(True, description="specdec methods: compute the output layer as W @ h.T where a CPU "
                                              "runs that faster (docs/performance.md); false: the model's own head")
    engine: str = Field("auto", description="specdec methods: what runs the forwards (docs/engines.md): auto, cpu "
                                            "(specdec's CPU forwards where they pay), eager (the model's own forward "
                                            "and nothing else)")

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_is_a_switch_or_options(cls, value: Any) -> Any:
        """One clear line instead of pydantic's one line per member of the union."""
        if isinstance(value, (bool, dict)):
            return value
        raise ValueError(f"expected true, false or a mapping of compile options (e.g. {{backend: aot_eager}}), "
                         f"got {value!r}")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        return resolve_engine_name(value)  # a ValueError with a hint for a misspelt name

    @field_validator("generator")
    @classmethod
    def _known_generator(cls, value: str) -> str:
        if value in REFERENCE_METHODS or value == NO_DRAFT:
            return value
        known = available_generators()
        if value not in known:
            allowed = [*REFERENCE_METHODS, NO_DRAFT, *known]
            raise ValueError(f"unknown method {value!r}.{did_you_mean(value, allowed)} Allowed: {', '.join(allowed)}")
        return value

    @field_validator("draft")
    @classmethod
    def _known_draft(cls, value: str | None) -> str | None:
        problem = value is not None and model_name_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "MethodConfig":
        if not self.name:
            object.__setattr__(self, "name", self.generator)
        if self.generator in REFERENCE_METHODS:
            needs_draft = REFERENCE_NEEDS_DRAFT[self.generator]
            try:
                REFERENCE_OPTIONS[self.generator].model_validate(self.options)
            except ValidationError as exc:
                raise ValueError(f"options.{_one_line(exc, REFERENCE_OPTIONS[self.generator])}") from None
        else:
            try:
                cls = generator_class(self.generator)
            except UnknownGeneratorError as exc:  # pragma: no cover - checked by the field validator
                raise ValueError(str(exc)) from None
            needs_draft = needs_model(cls)
            problem = generator_option_problem(cls, self.options, needs_draft)
            if problem:
                raise ValueError(problem if problem.startswith("options.") else f"options: {problem}")
        runs = "llama.cpp" if self.generator == LLAMA_CPP else "transformers' own generate"
        if self.generator in REFERENCE_METHODS and not self.fast_head:
            raise ValueError(f"fast_head: {self.generator!r} runs {runs}, whose output layer is its own; "
                             "remove 'fast_head'")
        if self.generator in REFERENCE_METHODS and self.engine != "auto":
            raise ValueError(f"engine: {self.generator!r} runs {runs}, whose forwards are its own; remove 'engine'")
        if needs_draft and self.draft is None:
            raise ValueError(f"draft: method {self.generator!r} needs a draft model (a load_model name)")
        if not needs_draft and self.draft is not None:
            raise ValueError(f"draft: method {self.generator!r} takes no draft model; remove 'draft'")
        problem = self._cache_problem()
        if problem:
            raise ValueError(problem)
        return self

    def _cache_problem(self) -> str | None:
        """Why ``cache_implementation`` or ``compile`` cannot work for this method (``field: why``), or None."""
        if self.generator == LLAMA_CPP and (self.cache_implementation != "dynamic" or self.compiles):
            return f"cache_implementation: {self.generator!r} runs llama.cpp, which keeps its own cache; remove it"
        if self.cache_implementation == "static" and self.is_reference and not self.kind.baseline:
            return (f"cache_implementation: {self.generator!r} takes the dynamic cache only: transformers' assisted "
                    "generation writes drafted tokens past the end of a static cache (IndexError near max_new_tokens, "
                    "transformers 5.24)")
        if not self.compiles:
            return None
        if self.cache_implementation != "static":
            return ("compile: needs cache_implementation: static (a dynamic cache changes shape every step, so "
                    "compiled forwards would recompile)")
        if isinstance(self.compile, dict):
            allowed = compile_option_names(self.generator)
            unknown = sorted(set(self.compile) - set(allowed))
            if unknown:
                return f"compile: unknown option(s) {unknown}; allowed: {', '.join(allowed)}"
        return None

    @property
    def compiles(self) -> bool:
        """Whether this method runs compiled forwards (and so is compiled during the warm-up)."""
        return self.compile is not False

    @property
    def kind(self) -> MethodKind:
        return method_kind(self.generator)

    @property
    def is_reference(self) -> bool:
        return self.kind.reference


class DistributedSettings(_Strict):
    """The target sharded across the processes ``torchrun`` starts (docs/distributed.md): every rank
    runs the config, rank 0 writes the results and the report."""

    tp_size: int = Field(1, ge=1, description="tensor parallelism: ranks each layer's weights are split over")
    pp_size: int = Field(1, ge=1, description="pipeline parallelism: ranks the layers are split over")
    tp_plan: dict[str, str] | None = Field(None, description="rules over the model's own tensor-parallel plan "
                                           "(transformers' DistributedConfig.tp_plan), e.g. attention 'replicate' "
                                           "where its heads do not divide by tp_size")
    draft_placement: Literal["one_rank", "replicated"] = Field(
        "one_rank", description="where the drafter runs: on the deciding rank only, or on every rank")
    timeout: float = Field(300.0, gt=0, description="seconds a rank waits for the others before the run fails")

    @model_validator(mode="after")
    def _sharded(self) -> "DistributedSettings":
        if self.tp_size * self.pp_size < 2:
            raise ValueError("tp_size * pp_size must be at least 2 (1: leave distributed out)")
        return self

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def options(self) -> dict:
        """``SpecDecoder(distributed=...)``."""
        return {"draft_placement": self.draft_placement, "timeout": self.timeout}


class BenchConfig(_Strict):
    description: str = ""
    target: str
    device: str = Field("cpu", description="where the models run: cpu, cuda, cuda:N, or auto (cuda when "
                                           "torch.cuda.is_available(), else cpu); checked when the run starts")
    dtype: DType = Field("float32", description="the target's and the drafts' weights")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    methods: list[MethodConfig] = Field(min_length=1)
    threads: int = Field(2, ge=1, description="torch.set_num_threads for the whole run")
    warmup_new_tokens: int = Field(16, ge=1, description="each method generates this many tokens once, unrecorded")
    repeats: int = Field(1, ge=1, description="times each call runs (methods interleaved per repeat); a row keeps "
                                              "the run of median wall time, and every run's seconds")
    batch_sizes: list[int] = Field(default_factory=lambda: [1], min_length=1,
                                   description="prompts per generate() call, one pass per size; 1 = per question, "
                                               "both MT-Bench turns; > 1 = first turns in batches, left-padded")
    reference: str | None = Field(None, description="the baseline method speedups and identical outputs are "
                                                    "measured against; needed only when there are several")
    distributed: DistributedSettings | None = Field(None, description="shard the target across the processes "
                                                     "torchrun starts (tp_size, pp_size, ...); None: one process")
    first_calls: int = Field(0, ge=0, description="the report also gives every method over the rows after the "
                                                  "run's first N calls (questions in order, each one's turns in "
                                                  "order): a method that learns from earlier calls (suffix) apart "
                                                  "from its cold start; 0: not")

    @field_validator("device")
    @classmethod
    def _device_spelling(cls, value: str) -> str:
        problem = device_name_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("target")
    @classmethod
    def _known_target(cls, value: str) -> str:
        problem = model_name_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="before")
    @classmethod
    def _batch_size_alias(cls, data: Any) -> Any:
        """``batch_size: N`` (the older single-size field) means ``batch_sizes: [N]``."""
        if isinstance(data, dict) and "batch_size" in data:
            data = dict(data)
            if "batch_sizes" in data:
                raise ValueError("batch_size: give batch_sizes only (batch_size is its older one-value spelling)")
            value = data.pop("batch_size")
            data["batch_sizes"] = value if isinstance(value, list) else [value]
        return data

    @field_validator("batch_sizes", mode="before")
    @classmethod
    def _positive_batch_sizes(cls, value: Any) -> Any:
        items = value if isinstance(value, list) else [value]
        bad = [v for v in items if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"batch sizes must be positive integers (allowed: 1, 2, 3, ...), got {bad[0]!r}")
        if len(set(items)) != len(items):
            raise ValueError(f"duplicate batch size(s) {sorted({v for v in items if items.count(v) > 1})}")
        return value

    @model_validator(mode="after")
    def _one_reference(self) -> "BenchConfig":
        names = [m.name for m in self.methods]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"methods: duplicate method name(s) {dupes}; give each a distinct 'name'")
        baselines = [m.name for m in self.methods if m.kind.baseline]
        if not baselines:
            raise ValueError("methods: need a method with generator 'baseline' (speedups are measured against it)")
        if self.reference is None and len(baselines) > 1:
            raise ValueError(f"reference: {len(baselines)} baseline methods ({', '.join(baselines)}); name the one "
                             f"speedups are measured against with reference: <method name>")
        if self.reference is not None and self.reference not in baselines:
            raise ValueError(f"reference: {self.reference!r} is not a method with generator 'baseline'; "
                             f"allowed: {', '.join(baselines)}")
        return self

    @model_validator(mode="after")
    def _llama_cpp_greedy(self) -> "BenchConfig":
        gen = self.generation
        if any(m.generator == LLAMA_CPP for m in self.methods) and (
                gen.do_sample or gen.processor_settings() or gen.grammar is not None):
            raise ValueError(f"methods: {LLAMA_CPP!r} decodes greedily with no logits processors or grammar; "
                             "this config's generation sets some")
        return self

    @model_validator(mode="after")
    def _shardable_target(self) -> "BenchConfig":
        if self.distributed is not None and self.target.startswith("tiny-random:"):
            raise ValueError("distributed: the target must be a packaged model or a local folder (transformers "
                             "shards a checkpoint as it loads it); tiny-random models are built in code")
        return self

    @property
    def reference_method(self) -> MethodConfig:
        """The method speedups and identical outputs are measured against (:func:`reference_name`)."""
        name = reference_name(self.model_dump(mode="json"))
        return next(m for m in self.methods if m.name == name)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def dataset_path(self, config_dir: str | Path | None = None) -> Path:
        """The question file: the default Spec-Bench set, or ``dataset.path`` relative to the config."""
        if self.dataset.path is None:
            return Path(DEFAULT_SPEC_BENCH)
        path = Path(self.dataset.path).expanduser()
        return path if path.is_absolute() or config_dir is None else Path(config_dir) / path


def reference_name(config: dict) -> str:
    """The name of the reference method of a config as dumped (``run.json``): ``reference`` when given,
    else the only method with generator ``baseline`` (configs written before ``reference`` existed)."""
    return config.get("reference") or next(m["name"] for m in config["methods"] if method_kind(m["generator"]).baseline)


# -- loading and error messages ----------------------------------------------------------------
def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that holds the field at ``loc`` (for listing allowed fields)."""
    model = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        inner = [a for a in (getattr(ann, "__args__", None) or (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not inner:
            return None
        model = inner[0]
    return model


_FIELD_PATH = re.compile(r"[A-Za-z_][\w.\[\]]*")


#: what an unknown field of a model most likely meant: (model, field) -> hint
FIELD_HINTS = {
    ("MethodConfig", "decoder_options"): "a bench method gives SpecDecoder's settings as its own keys "
                                         f"({', '.join(DECODER_KEYS)}) and its generator's in options",
    ("MethodConfig", "draft_options"): "a bench method gives its generator's options in options",
}


def format_errors(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per pydantic error: ``field.path: what is wrong; allowed: ...``."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            holder = _model_at(root, loc[:-1])
            allowed = (", ".join(holder.model_fields) or "none") if holder else "?"
            hint = FIELD_HINTS.get((holder.__name__ if holder else "", loc[-1]))
            close = did_you_mean(str(loc[-1]), holder.model_fields) if holder and not hint else ""
            lines.append(f"{_loc(loc)}: unknown field {loc[-1]!r}" + (f" ({hint})" if hint else "")
                         + f"; allowed: {allowed}." + close)
        elif err["type"] == "value_error":
            message = str(err["ctx"]["error"])
            # model-level checks put the field name first ("draft: ..."): join it to the location
            head, _, rest = message.partition(": ")
            if rest and _FIELD_PATH.fullmatch(head):
                lines.append(f"{_loc(loc)}.{head}: {rest}" if loc else f"{head}: {rest}")
            else:
                lines.append(f"{_loc(loc) or 'config'}: {message}")
        elif err["type"] == "missing":
            lines.append(f"{_loc(loc)}: required field is missing")
        else:
            got = err.get("input")
            shown = f" (got {got!r})" if isinstance(got, (str, int, float, bool)) or got is None else ""
            lines.append(f"{_loc(loc) or 'config'}: {err['msg']}{shown}")
    return lines


def _one_line(exc: ValidationError, root: type[BaseModel]) -> str:
    return "; ".join(format_errors(exc, root))


def parse_config(data: Any, source: str = "config") -> BenchConfig:
    """Validate a mapping (parsed YAML); raise :class:`ConfigError` with one line per problem."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the file must hold a YAML mapping (target:, methods:, ...), got {type(data).__name__}")
    try:
        return BenchConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(f"{source}: {line}" for line in format_errors(exc, BenchConfig))) from None


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one YAML mapping; ``line`` is the second one's (1-based)."""

    def __init__(self, key: Any, line: int, first: int):
        super().__init__(f"duplicate key {key!r} (first given at line {first}); give each key once")
        self.line = line


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (its own keeps the last silently,
    so a second ``max_new_tokens:`` would override the first without a word). Merge keys (``<<``) are
    PyYAML's own, overridden by the mapping's keys as YAML says."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in first:
                        raise DuplicateKeyError(key, line, first[key])
                    first[key] = line
                except TypeError:  # an unhashable key: the base loader says so
                    continue
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str) -> Any:
    """``text`` parsed by :class:`UniqueKeyLoader`; a :class:`ConfigError` naming ``source`` (and the line
    of a duplicate key) when it is not valid YAML."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except DuplicateKeyError as exc:
        raise ConfigError(f"{source}:{exc.line}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(exc).split())}") from None


def load_config(path: str | Path) -> BenchConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    return parse_config(load_yaml(path.read_text(), str(path)), str(path))
