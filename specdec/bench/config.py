"""The benchmark YAML schema, validated with pydantic before any work is done.

A config names a target (a :func:`specdec.models.load_model` name), a dataset (Spec-Bench JSONL,
filtered by subtask and category, with a per-subtask count), generation settings, run settings
(threads, warm-up, batch sizes) and a list of methods. A method is either a registered candidate
generator with its options (and a ``draft`` model name when the generator takes a model), or one
of the reference methods that call ``transformers`` directly::

    methods:
      - {name: baseline, generator: baseline}                     # target.generate()
      - {name: pl10, generator: prompt_lookup, options: {num_tokens: 10}}
      - {name: dm, generator: draft_model, draft: tiny-random:llama}
      - {name: hf_pl10, generator: hf_prompt_lookup, options: {num_tokens: 10}}
      - {name: hf_dm, generator: hf_assisted, draft: tiny-random:llama}

Invariants: unknown fields are refused at every level; every error is one line naming the field
(``methods[1].generator``) and the allowed values; names are checked against the registry and the
reference methods; model names must be loadable (packaged, ``tiny-random:<arch>`` or a folder).
Validation never loads a model and never writes a file.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..models import PACKAGED_MODELS, TINY_ARCHS
from ..prompts import DEFAULT_SPEC_BENCH, MT_BENCH_CATEGORIES, SUBTASKS
from ..registry import UnknownGeneratorError, available_generators, get_candidate_generator

#: the reference methods: ``transformers`` itself, not a registered candidate generator
BASELINE = "baseline"
HF_ASSISTED = "hf_assisted"
HF_PROMPT_LOOKUP = "hf_prompt_lookup"
REFERENCE_METHODS = (BASELINE, HF_ASSISTED, HF_PROMPT_LOOKUP)

Subtask = Literal["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
assert set(Subtask.__args__) == set(SUBTASKS)  # noqa: S101 - keep the Literal in step with prompts.SUBTASKS


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


REFERENCE_OPTIONS: dict[str, type[_Strict]] = {
    BASELINE: BaselineOptions, HF_ASSISTED: HFAssistedOptions, HF_PROMPT_LOOKUP: HFPromptLookupOptions}
#: reference methods that need a draft model
REFERENCE_NEEDS_DRAFT = {BASELINE: False, HF_ASSISTED: True, HF_PROMPT_LOOKUP: False}


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


def generator_needs_draft(cls: type) -> bool:
    """A generator takes a draft model when its constructor has a required positional parameter."""
    params = list(inspect.signature(cls).parameters.values())
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


def generator_option_problem(cls: type, options: dict, with_draft: bool) -> str | None:
    """Why ``cls(draft?, **options)`` cannot bind, or None (checks names only, not values)."""
    sig = inspect.signature(cls)
    try:
        sig.bind(*([object()] if with_draft else []), **options)
    except TypeError:
        accepted = [p.name for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY
                    or (p.kind == p.POSITIONAL_OR_KEYWORD and p.default is not p.empty)]
        unknown = sorted(set(options) - set(accepted))
        what = f"unknown option(s) {unknown}" if unknown else "options do not fit"
        return f"{what} for {cls.name or cls.__name__!r}; allowed: {', '.join(accepted) or '(none)'}"
    return None


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


# -- the schema --------------------------------------------------------------------------------
class DatasetConfig(_Strict):
    path: str | None = Field(None, description="Spec-Bench question.jsonl; relative paths are relative to the "
                                               "config file; default: ../shared/spec_bench/question.jsonl")
    subtasks: list[Subtask] = Field(default_factory=lambda: list(SUBTASKS), min_length=1)
    categories: list[str] | None = Field(None, description="keep only these raw categories (e.g. writing, qa)")
    per_subtask: int | None = Field(None, ge=1, description="questions per subtask, spread evenly by question_id; "
                                                            "default: all")


    @field_validator("categories")
    @classmethod
    def _known_categories(cls, value: list[str] | None) -> list[str] | None:
        allowed = [*MT_BENCH_CATEGORIES, *SUBTASKS[1:]]
        unknown = [c for c in value or [] if c not in allowed]
        if unknown:
            raise ValueError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {unknown}; allowed: {', '.join(allowed)}")
        return value


class GenerationSettings(_Strict):
    max_new_tokens: int = Field(128, ge=1)
    do_sample: bool = False
    temperature: float = Field(1.0, gt=0)
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int = Field(0, ge=0, description="sampling: question q, turn t uses a seed derived from (seed, q, t)")


class MethodConfig(_Strict):
    name: str = Field("", description="label in the results; default: the generator name")
    generator: str
    draft: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("generator")
    @classmethod
    def _known_generator(cls, value: str) -> str:
        if value in REFERENCE_METHODS:
            return value
        known = available_generators()
        if value not in known:
            allowed = [*REFERENCE_METHODS, *known]
            raise ValueError(f"unknown method {value!r}.{_did_you_mean(value, allowed)} Allowed: {', '.join(allowed)}")
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
                cls = get_candidate_generator(self.generator)
            except UnknownGeneratorError as exc:  # pragma: no cover - checked by the field validator
                raise ValueError(str(exc)) from None
            needs_draft = generator_needs_draft(cls)
            problem = generator_option_problem(cls, self.options, needs_draft)
            if problem:
                raise ValueError(f"options: {problem}")
        if needs_draft and self.draft is None:
            raise ValueError(f"draft: method {self.generator!r} needs a draft model (a load_model name)")
        if not needs_draft and self.draft is not None:
            raise ValueError(f"draft: method {self.generator!r} takes no draft model; remove 'draft'")
        return self

    @property
    def kind(self) -> MethodKind:
        return method_kind(self.generator)

    @property
    def is_reference(self) -> bool:
        return self.kind.reference


class BenchConfig(_Strict):
    description: str = ""
    target: str
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    methods: list[MethodConfig] = Field(min_length=1)
    threads: int = Field(2, ge=1, description="torch.set_num_threads for the whole run")
    warmup_new_tokens: int = Field(16, ge=1, description="each method generates this many tokens once, unrecorded")
    batch_sizes: list[int] = Field(default_factory=lambda: [1], min_length=1,
                                   description="prompts per generate() call, one pass per size; 1 = per question, "
                                               "both MT-Bench turns; > 1 = first turns in batches, left-padded")

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
    def _one_baseline(self) -> "BenchConfig":
        names = [m.name for m in self.methods]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"methods: duplicate method name(s) {dupes}; give each a distinct 'name'")
        baselines = [m.name for m in self.methods if m.kind.baseline]
        if len(baselines) != 1:
            raise ValueError(f"methods: need exactly one method with generator 'baseline' (speedups are measured "
                             f"against it), found {len(baselines)}")
        return self

    @property
    def baseline(self) -> MethodConfig:
        return next(m for m in self.methods if m.kind.baseline)

    def dataset_path(self, config_dir: str | Path | None = None) -> Path:
        """The question file: the default Spec-Bench set, or ``dataset.path`` relative to the config."""
        if self.dataset.path is None:
            return Path(DEFAULT_SPEC_BENCH)
        path = Path(self.dataset.path).expanduser()
        return path if path.is_absolute() or config_dir is None else Path(config_dir) / path


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


def format_errors(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per pydantic error: ``field.path: what is wrong; allowed: ...``."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            holder = _model_at(root, loc[:-1])
            allowed = ", ".join(holder.model_fields) if holder else "?"
            lines.append(f"{_loc(loc)}: unknown field {loc[-1]!r}; allowed: {allowed}")
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


def load_config(path: str | Path) -> BenchConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    return parse_config(data, str(path))
