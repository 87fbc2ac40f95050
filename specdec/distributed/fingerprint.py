"""What ranks compare before a call's first forward: a digest of each part of its arguments.

Every rank of a sharded target must run the same call. The call's first message carries one
digest per rank (:meth:`Fingerprint.value`, see ``call.py``); where they differ, the ranks
exchange the parts' digests (:attr:`Fingerprint.parts`) and every rank raises one error naming
the parts that differ. A part is what could change the call's course:

* ``prompt``: the token ids (shape, ids, attention mask);
* ``model inputs``: prefill-only inputs (pixel values, ...), tensors by their bytes;
* ``settings``: new-token budget, sampling parameters, EOS and pad ids, stop strings, outputs
  asked for, the generator plugin, the caches, the coordination options;
* ``logits processors`` and ``stopping criteria``: each by its class and its settings
  (:func:`describe`);
* ``generator state``: under sampling, the ``torch.Generator``'s state (the seed and the draws
  since): the decider's draws every random number, and a rank given another seed was given
  another call. Without sampling no random number is drawn, and none is compared.

:func:`describe` reads an object's settings from its attributes, cheaply and without addresses
(a ``repr`` with ``0x...`` differs between processes): values, containers of values, tensors of
up to :data:`TENSOR_LIMIT` elements by their bytes (larger ones by shape and dtype), functions
and classes by qualified name, other objects by class name only (one level: a processor's
tokenizer or model is named, not walked). Attributes that record when an object was made, not
what it does (``MaxTimeCriteria.initial_timestamp``), are left out; a compiled grammar is its
grammar's text.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import zlib
from dataclasses import dataclass

import torch

#: tensors past this many elements are described by shape and dtype only
TENSOR_LIMIT = 1 << 16
#: attributes that record a moment, not a setting: they differ between ranks by nature
VOLATILE = frozenset({"initial_timestamp"})
#: how deep the attributes of an object of no known kind are described (then its class alone)
OBJECT_DEPTH = 2


@dataclass(frozen=True)
class Fingerprint:
    """One call's arguments, digested by part (``{part: digest}``, see the module docstring)."""

    parts: dict

    @property
    def value(self) -> int:
        """The digest of every part, in [0, 2**31) (-1 marks a failed rank in a message)."""
        return digest(*sorted(self.parts.items()))

    def differing(self, others: list["Fingerprint"]) -> list[str]:
        """The parts whose digests differ between this fingerprint and ``others``, in order."""
        names = sorted({name for f in [self, *others] for name in f.parts})
        return [n for n in names if len({f.parts.get(n) for f in [self, *others]}) > 1]


def call_fingerprint(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *settings, model_inputs=None,
                     drafting=None, processors=(), criteria=(), generator: torch.Generator | None = None,
                     sampled: bool = False) -> Fingerprint:
    """The fingerprint of one call: its prompt [B, P] and mask [B, P], ``settings`` (values),
    its prefill-only inputs, what its candidate generator declares (``drafting``: values), logits
    processors, stopping criteria and, under sampling, the state of its ``generator``."""
    parts = {
        "prompt": digest(tuple(input_ids.shape), input_ids, attention_mask),
        "model inputs": digest(describe(dict(model_inputs or {}))),
        "settings": digest(describe(settings)),
        "drafting declarations": digest(describe(drafting)),
        "logits processors": digest(*(settings_of(p) for p in processors or ())),
        "stopping criteria": digest(*(settings_of(c) for c in criteria or ())),
    }
    if sampled:
        parts["generator state"] = digest(None if generator is None else generator.get_state())
    return Fingerprint(parts)


def settings_of(obj) -> tuple:
    """(class, {attribute: described value}) of a processor or criterion: what it is set to do."""
    if type(obj).__name__ == "GrammarConstraint":  # its attributes are the call's matchers: its grammars say it
        return _name(type(obj)), describe(list(obj.compiled))
    attributes = getattr(obj, "__dict__", {})
    return _name(type(obj)), {k: describe(v) for k, v in sorted(attributes.items()) if k not in VOLATILE}


def describe(value, depth: int = 0):
    """``value`` as plain data with no address in it (see the module docstring); an object of no
    known kind by its attributes, ``OBJECT_DEPTH`` levels deep (a processor holding a helper that
    holds the settings), then by its class."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, enum.Enum):
        return "enum", _name(type(value)), describe(value.value)
    if type(value).__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "shape"):  # an array
        return ("array", str(value.dtype), tuple(value.shape),
                zlib.crc32(value.tobytes()) if value.size <= TENSOR_LIMIT else None)
    if isinstance(value, numbers.Number):  # numpy's scalars, ...
        return "number", repr(value)
    if isinstance(value, torch.Tensor):
        if value.numel() > TENSOR_LIMIT or value.is_meta:
            return "tensor", str(value.dtype), tuple(value.shape)
        return "tensor", str(value.dtype), tuple(value.shape), digest(value)
    if isinstance(value, torch.Generator):
        return "generator", str(value.device), digest(value.get_state())
    if isinstance(value, dict):
        return "dict", tuple(sorted((repr(describe(k, depth)), describe(v, depth)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(describe(v, depth) for v in value)
    if isinstance(value, (set, frozenset)):
        return "set", tuple(sorted(repr(describe(v, depth)) for v in value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # settings objects: every field
        return _name(type(value)), tuple((f.name, describe(getattr(value, f.name), depth))
                                         for f in dataclasses.fields(value))
    if type(value).__name__ == "CompiledGrammar":
        return "grammar", str(value.grammar)
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return "callable", _name(value)
    attributes = getattr(value, "__dict__", None)
    if attributes and depth < OBJECT_DEPTH:
        return "object", _name(type(value)), tuple((k, describe(v, depth + 1)) for k, v in sorted(attributes.items())
                                                   if k not in VOLATILE)
    return "object", _name(type(value))


def _name(thing) -> str:
    return f"{getattr(thing, '__module__', '?')}.{getattr(thing, '__qualname__', type(thing).__name__)}"


def digest(*parts) -> int:
    """A crc32 of tensors (their bytes) and other values (their repr), in [0, 2**31)."""
    value = 0
    for part in parts:
        if isinstance(part, torch.Tensor):
            data = part.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if part.numel() \
                else repr((part.dtype, tuple(part.shape))).encode()
        else:
            data = repr(part).encode()
        value = zlib.crc32(data, value)
    return value & 0x7FFFFFFF  # >= 0: -1 marks a failed rank
