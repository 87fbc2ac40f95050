"""Candidate-generator registry: a decorator for code, an entry-point group for packages.

Built-ins are declared in this project's ``pyproject.toml`` under the entry-point group
``specdec.candidate_generators``, exactly as a third-party package would declare its own; the
core never imports them. Entry points are loaded lazily, the first time a name is looked up.
"""

from __future__ import annotations

import difflib
import warnings
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "specdec.candidate_generators"

_REGISTRY: dict[str, type] = {}
_entry_points_loaded = False


class UnknownGeneratorError(KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def register_candidate_generator(name: str):
    """Class decorator: ``@register_candidate_generator("my_method")``."""
    if not name or not isinstance(name, str):
        raise ValueError("a candidate generator needs a non-empty string name")

    def decorator(cls):
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls and _qualname(existing) != _qualname(cls):
            raise ValueError(f"candidate generator {name!r} is already registered by {_qualname(existing)}")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return decorator


def unregister_candidate_generator(name: str) -> None:
    _REGISTRY.pop(name, None)


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        try:
            cls = ep.load()  # importing the module usually registers it through the decorator
        except Exception as exc:  # one broken plugin must not hide the others
            warnings.warn(f"candidate generator plugin {ep.name!r} ({ep.value}) failed to load: {exc}", stacklevel=2)
            continue
        if ep.name not in _REGISTRY:
            register_candidate_generator(ep.name)(cls)


def available_generators() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def get_candidate_generator(name: str) -> type:
    _load_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = sorted(_REGISTRY)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownGeneratorError(
            f"unknown candidate generator {name!r}.{hint} Known: {', '.join(known) or '(none)'}") from None
