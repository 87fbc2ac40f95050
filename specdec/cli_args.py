"""The ``specdec`` command's arguments, checked before any model loads, and the decoder they describe.

Loading a packaged model is slow (README.md, "Models without a network"), so every argument is
checked first: numbers, model names, the device (``--device cuda`` on a machine without one), the
generator name and its ``--option`` names and values. The checks are the library's own (the
registry resolves ``--draft`` as ``SpecDecoder`` resolves ``draft``; models and devices are
checked by :mod:`specdec.models`); this module only says them in flags, as a :class:`UsageError`.
:func:`build_decoder` makes the ``SpecDecoder`` of the checked arguments. Modules are imported
where a check needs them, so that building the parser imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from .names import did_you_mean


class UsageError(ValueError):
    """A command-line argument that cannot work; reported as ``specdec: error: ...``, exit status 2."""


# -- argument types ------------------------------------------------------------------------------------
def thread_count(text: str) -> str:
    if text != "auto":
        positive_int(text)
    return text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def folder_problem(path) -> str | None:
    """Why ``path`` cannot be an output folder (it is a file, or lies below one), or None."""
    from pathlib import Path

    for at in (Path(path), *Path(path).parents):
        if at.exists():
            return None if at.is_dir() else f"{at} is a file, not a folder"
    return None


def _checked(text: str, problem: str | None) -> str:
    """``text``, or the argument's error saying ``problem``."""
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def output_folder(text: str) -> str:
    return _checked(text, folder_problem(text))


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def device_name(text: str) -> str:
    from .models import device_name_problem

    return _checked(text, device_name_problem(text))


def parse_options(pairs: list[str]) -> dict:
    """``--option KEY=VALUE`` pairs -> ``{key: value}``, a value read as an int, a float, ``true`` /
    ``false`` (any case) as a bool, else kept as text."""
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UsageError(f"--option expects KEY=VALUE, got {pair!r}")
        if key in options:
            raise UsageError(f"--option {key} given twice")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        options[key] = value
    return options


# -- the draft: checked before any model loads ------------------------------------------------------------
@dataclass
class DraftPlan:
    """What ``--draft`` and ``--option`` resolved to: nothing, a generator built already (one that
    drafts without a model), or a draft model to load (``model``) with generator ``options``."""

    generator: object = None
    model: str | None = None
    options: dict = field(default_factory=dict)


def plan_draft(draft: str | None, options: dict) -> DraftPlan:
    """Check ``--draft`` and ``--option`` without loading a model (see :class:`DraftPlan`); the
    registry resolves and checks (:func:`~specdec.registry.resolve_draft`), this says it in flags."""
    from .registry import OptionError, available_generators, check_model_draft

    if draft is None or draft == "none":
        if options:
            raise UsageError(f"--option {', '.join(options)}: plain decoding (--draft none) takes no options")
        return DraftPlan()
    if draft in available_generators():
        return DraftPlan(generator=_generator(draft, options))
    _check_draft_model(draft)
    try:
        check_model_draft(options)
    except OptionError as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:
        raise UsageError(f"--option: {exc}") from None
    return DraftPlan(model=draft, options=options)


def _generator(name: str, options: dict):
    """Generator ``name`` built with ``options``; one that drafts with a model is refused (its model is ``--draft``)."""
    from .registry import OptionError, get_candidate_generator, needs_model, resolve_draft

    label = f"candidate generator {name!r}"
    if needs_model(get_candidate_generator(name)):
        raise UsageError(f"{label} drafts with a model: give the draft model's name as --draft instead "
                         f"(e.g. --draft smollm2-135m; see `specdec list`)")
    try:
        return resolve_draft(name, options)
    except OptionError as exc:
        raise UsageError(str(exc)) from None
    except (TypeError, ValueError) as exc:  # a TypeError of a value given as text: name what was given
        given = ", ".join(f"{key}={value!r}" for key, value in options.items())
        raise UsageError(f"{label}: {exc}" + (f" (given {given})" if isinstance(exc, TypeError) and given else "")) \
            from None


def _check_draft_model(name: str) -> None:
    """``--draft`` that is not a generator name must be a loadable model name."""
    from .models import PACKAGED_MODELS, ModelNotAvailableError, check_model_name
    from .registry import available_generators

    try:
        check_model_name(name)
    except ModelNotAvailableError as exc:
        if not (name.startswith("tiny-random:") or "/" in name or name in PACKAGED_MODELS):
            generators = available_generators()
            raise UsageError(f"--draft {name!r} is neither a candidate generator nor a model."
                             f"{did_you_mean(name, [*generators, *PACKAGED_MODELS])} "
                             f"Generators: {', '.join(generators)}; models: see `specdec list`") from None
        raise UsageError(f"--draft: {exc}") from None


@dataclass(frozen=True)
class Placement:
    """Where and how the models run (``--device``, ``--dtype``, ``--cache-implementation``, ``--compile``),
    checked against this machine."""

    device: Any = None  # a torch.device; None: the CPU
    dtype: Any = None  # a torch.dtype; None: float32
    cache_implementation: str = "dynamic"
    compile: bool = False
    engine: str = "auto"  # what runs the forwards (docs/engines.md)

    def load(self, name: str):
        """``load_model(name)`` in this dtype on this device."""
        import torch

        from .models import load_model

        return load_model(name, dtype=self.dtype or torch.float32, device=self.device or torch.device("cpu"))


def check_placement(args) -> Placement:
    """The checked :class:`Placement` of the command line; a UsageError before any model loads."""
    from .models import DTYPES, resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    if args.compile and args.cache_implementation != "static":
        raise UsageError("--compile needs --cache-implementation static (a dynamic cache changes shape every step, "
                         "so compiled forwards would recompile)")
    return Placement(device, DTYPES[args.dtype], args.cache_implementation, args.compile,
                     getattr(args, "engine", "auto"))


def check_target(name: str) -> None:
    from .models import ModelNotAvailableError, check_model_name

    try:
        check_model_name(name)
    except ModelNotAvailableError as exc:
        raise UsageError(f"--target: {exc}") from None


def build_decoder(target, tokenizer, plan: DraftPlan, placement: Placement | None = None):
    """The ``SpecDecoder`` of a checked plan (loads the draft model, if any, as ``placement`` says)."""
    from .decoder import SpecDecoder

    placement = placement or Placement()
    cache = dict(cache_implementation=placement.cache_implementation, compile=placement.compile,
                 engine=placement.engine)
    if plan.model is None:
        try:
            return SpecDecoder(target, plan.generator, tokenizer=tokenizer, **cache)
        except ValueError as exc:  # an engine that cannot serve this model (--engine cpu on a GPU)
            raise UsageError(f"--engine: {exc}") from None
    draft_model, draft_tokenizer = placement.load(plan.model)
    try:
        return SpecDecoder(target, draft_model, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer, **cache,
                           **plan.options)
    except TypeError as exc:
        raise UsageError(str(exc)) from None

