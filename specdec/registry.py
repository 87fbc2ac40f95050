"""Candidate-generator registry: a decorator for code, an entry-point group for packages.

Built-ins are declared in this project's ``pyproject.toml`` under the entry-point group
``specdec.candidate_generators``, exactly as a third-party package would declare its own; the
core never imports them. Entry points are *loaded* lazily, the first time a name is looked up,
but their *names* are read (cheaply, without importing anything) at the first registration, so a
class registered under a name an installed entry point declares is refused at once, whichever
comes first, instead of silently replacing the entry point's generator.

One class may be registered under several names: each name then resolves to a class whose
``name`` is that name (the first registration sets ``cls.name``; a later one registers a thin
subclass of ``cls`` carrying the other name).

Draft resolution lives here too, once: :func:`resolve_draft` turns what ``SpecDecoder`` is given
as ``draft`` (a model, a generator name, class or instance, or None) with keyword options into the
generator that runs; :func:`check_model_draft` checks the options of a draft model not loaded yet
(the command line's ``--draft <model> --option ...``). Options are checked against the generator's
``__init__`` (:func:`fit_options`), so a plugin's options need no declaration of their own.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points

import torch

from .generators import CandidateGenerator, NoDraft
from .names import ENTRY_POINT_GROUP, did_you_mean  # the group is named torch-free, for the command line

_REGISTRY: dict[str, type] = {}
_entry_points_loaded = False
_entry_point_index: dict | None = None  # name -> EntryPoint, read once (names and values only)
_loading: set[str] = set()  # entry-point names whose module is being imported right now


class UnknownGeneratorError(KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def register_candidate_generator(name: str):
    """Class decorator: ``@register_candidate_generator("my_method")``.

    Refuses a name that another class holds, or that an installed entry point of the
    ``specdec.candidate_generators`` group declares for another class."""
    if not name or not isinstance(name, str):
        raise ValueError("a candidate generator needs a non-empty string name")

    def decorator(cls):
        existing = _REGISTRY.get(name)
        if existing is cls or (existing is not None and existing.__dict__.get("_registry_alias_of") is cls):
            return cls  # the same class (or its alias) again: harmless
        if existing is not None and _qualname(existing.__dict__.get("_registry_alias_of", existing)) != _qualname(cls):
            raise ValueError(_clash(name, cls, _describe_owner(name, existing)))
        # (the same qualified name is a reloaded module's class: it replaces the old one)
        ep = _declared_entry_points().get(name)
        if ep is not None and not _is_entry_point_target(ep, cls):
            raise ValueError(_clash(name, cls, _describe_entry_point(ep)))
        own_name = cls.__dict__.get("name")
        if own_name and own_name != name and _REGISTRY.get(own_name) is cls:
            # already registered under another name: this name gets a subclass that says so
            alias = type(cls.__name__, (cls,), {"name": name, "__module__": cls.__module__,
                                                "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                                                "_registry_alias_of": cls})
            _REGISTRY[name] = alias
        else:
            _REGISTRY[name] = cls
            cls.name = name
        return cls

    return decorator


def unregister_candidate_generator(name: str) -> None:
    _REGISTRY.pop(name, None)


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _clash(name: str, cls: type, owner: str) -> str:
    return (f"candidate generator {name!r} is already registered by {owner}; cannot register "
            f"{_qualname(cls)} under the same name (choose another name)")


def _describe_entry_point(ep) -> str:
    dist = getattr(ep, "dist", None)
    package = f" of package {dist.name!r}" if dist is not None and getattr(dist, "name", None) else ""
    return f"the entry point {ep.name} = {ep.value}{package}"


def _describe_owner(name: str, existing: type) -> str:
    ep = _declared_entry_points().get(name)
    if ep is not None and _is_entry_point_target(ep, existing):
        return _describe_entry_point(ep)  # the same words whether or not the plugin is loaded yet
    return _qualname(existing.__dict__.get("_registry_alias_of", existing))


def _declared_entry_points() -> dict:
    """Entry points of the group by name, read from package metadata without importing them."""
    global _entry_point_index
    if _entry_point_index is None:
        _entry_point_index = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return _entry_point_index


def _is_entry_point_target(ep, cls: type) -> bool:
    """``cls`` is what ``ep`` declares, judged without importing ``ep``'s module: the entry point
    is being loaded now (its module registering its class), or it names ``cls``'s module (or a
    package above it)."""
    if ep.name in _loading:
        return True
    module = ep.value.split(":", 1)[0].strip()
    return cls.__module__ == module or cls.__module__.startswith(module + ".")


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from .engines import import_torchao_quietly

    import_torchao_quietly()  # a plugin's module may import transformers' modeling code, which imports torchao
    for ep in _declared_entry_points().values():
        if ep.name in _REGISTRY:
            continue
        _loading.add(ep.name)
        try:
            cls = ep.load()  # importing the module usually registers it through the decorator
            if ep.name not in _REGISTRY:
                register_candidate_generator(ep.name)(cls)
        except Exception as exc:  # one broken plugin must not hide the others
            warnings.warn(f"candidate generator plugin {ep.name!r} ({ep.value}) failed to load: {exc}", stacklevel=2)
        finally:
            _loading.discard(ep.name)


def available_generators() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def get_candidate_generator(name: str) -> type:
    _load_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = sorted(_REGISTRY)
        raise UnknownGeneratorError(f"unknown candidate generator {name!r}.{did_you_mean(name, known)} "
                                    f"Known: {', '.join(known) or '(none)'}") from None


# -- options: checked against the generator's __init__ ---------------------------------------------
class OptionError(TypeError):
    """Options that do not fit a generator's ``__init__``: an unknown name, a required one missing."""


@dataclass(frozen=True)
class OptionFit:
    """How keyword ``options`` fit a generator class (see :func:`fit_options`)."""

    params: dict  # the options it takes: {name: inspect.Parameter}, in signature order
    var_kw: bool  # it takes **kwargs too
    unknown: list  # given but not among ``params`` (empty with ``var_kw``), in the order given
    missing: list  # required by ``params`` but not given

    @property
    def ok(self) -> bool:
        return not self.unknown and not self.missing


def needs_model(cls) -> bool:
    """``cls.__init__`` has a required positional parameter: the draft model, passed first."""
    if cls.__init__ is object.__init__:
        return False
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return bool(params) and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD) \
        and params[0].default is params[0].empty


def generator_options(cls, takes_model: bool) -> tuple[dict, bool]:
    """The options of generator class ``cls``: ``{name: inspect.Parameter}`` of its ``__init__``
    parameters that can be passed by keyword (the draft model, passed first by position, left
    out when ``takes_model``), and whether it also takes ``**kwargs``."""
    if cls.__init__ is object.__init__:
        return {}, False
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self
    if takes_model and params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind == p.VAR_KEYWORD for p in params)


def fit_options(cls, options: dict, takes_model: bool) -> OptionFit:
    """How ``options`` fit ``cls(model?, **options)``, by name only (values are the generator's to judge)."""
    params, var_kw = generator_options(cls, takes_model)
    unknown = [] if var_kw else [key for key in options if key not in params]
    missing = [n for n, p in params.items() if p.default is p.empty and n not in options]
    return OptionFit(params, var_kw, unknown, missing)


def describe_options(params: dict) -> str:
    if not params:
        return "it takes no options"
    shown = [name if p.default is p.empty else f"{name}={p.default!r}" for name, p in params.items()]
    return f"its options (with defaults): {', '.join(shown)}"


def option_problem(cls, options: dict, takes_model: bool) -> str | None:
    """What is wrong with ``options`` for generator class ``cls`` (an unknown name, with a "did you
    mean" and the options it has; a required option missing), or None."""
    fit = fit_options(cls, options, takes_model)
    if fit.var_kw:
        return None
    if fit.unknown:
        key = fit.unknown[0]
        return f"has no option {key!r}.{did_you_mean(key, fit.params)} {describe_options(fit.params).capitalize()}."
    return f"needs the option(s) {', '.join(fit.missing)}" if fit.missing else None


# -- drafts: what SpecDecoder's ``draft`` argument means ---------------------------------------------
#: the generator a draft model drafts with when it shares the target's tokenizer
MODEL_DRAFT_GENERATOR = "draft_model"
#: the generator a draft model drafts with when the two tokenizers given differ
CROSS_TOKENIZER_GENERATOR = "cross_tokenizer"


def model_generator(tokenizers_differ: bool) -> str:
    """The name of the generator a draft *model* drafts with."""
    return CROSS_TOKENIZER_GENERATOR if tokenizers_differ else MODEL_DRAFT_GENERATOR


def resolve_draft(draft, options: dict, *, tokenizers_differ: bool = False) -> CandidateGenerator:
    """The generator that runs for ``SpecDecoder(target, draft, **options)``.

    ``draft`` is a :class:`CandidateGenerator` instance (taken as it is, without options), None
    (plain decoding: :class:`NoDraft`), a registered generator name or a generator class (built
    with ``options``), or a model (built into the generator :func:`model_generator` names).
    Raises TypeError for a ``draft`` of another kind, :class:`OptionError` for options that do not
    fit, and whatever the generator's ``__init__`` raises for values it refuses."""
    if isinstance(draft, CandidateGenerator):
        if options:
            raise TypeError(f"options {sorted(options)} cannot be applied to a generator instance")
        return draft
    if draft is None:
        if options:
            raise TypeError(f"options {sorted(options)} need a draft (a model or a generator name)")
        return NoDraft()
    if isinstance(draft, str):
        cls, args = get_candidate_generator(draft), ()
    elif isinstance(draft, type) and issubclass(draft, CandidateGenerator):
        cls, args = draft, ()
    elif isinstance(draft, torch.nn.Module):
        cls, args = get_candidate_generator(model_generator(tokenizers_differ)), (draft,)
    else:
        raise TypeError(f"draft must be a model, a generator name or a CandidateGenerator, got {type(draft).__name__}")
    problem = option_problem(cls, options, takes_model=bool(args))
    if problem:
        raise OptionError(f"candidate generator {cls.name or cls.__name__!r} {problem}")
    return cls(*args, **options)


def check_model_draft(options: dict) -> None:
    """Check ``options`` for a draft model that is not loaded yet, so that a bad one is refused
    before any model loads. Which generator the model drafts with is known only once both
    tokenizers are (:func:`model_generator`), so options valid for either installed one pass.

    Names: :class:`OptionError` for an option neither takes. Values: each generator whose names
    fit is resolved around an empty stand-in module; ValueError (``"<generator>: why"``) when
    every one refuses them, nothing when one accepts or needs the real model to tell."""
    known = available_generators()
    names = [n for n in (MODEL_DRAFT_GENERATOR, CROSS_TOKENIZER_GENERATOR) if n in known]
    fits = {n: fit_options(get_candidate_generator(n), options, takes_model=True) for n in names}
    params = {}
    for fit in fits.values():
        params.update({k: p for k, p in fit.params.items() if k not in params})
    if not any(fit.var_kw for fit in fits.values()):
        for key in options:
            if key not in params:
                raise OptionError(f"a draft model (generators {' / '.join(names)}) has no option {key!r}."
                                  f"{did_you_mean(key, params)} {describe_options(params).capitalize()}.")
    refusals = []
    for name, fit in fits.items():
        if fit.unknown:
            continue
        try:
            resolve_draft(torch.nn.Module(), options, tokenizers_differ=name == CROSS_TOKENIZER_GENERATOR)
            return
        except ValueError as exc:
            refusals.append(f"{name}: {exc}")
        except Exception:  # needs the real model to tell: checked once it is loaded
            return
    if refusals:
        raise ValueError(refusals[0])
