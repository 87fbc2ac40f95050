"""Reading a GGUF file's header for ``transformers``, once and quickly.

``transformers`` loads a GGUF checkpoint through ``gguf``'s ``GGUFReader``, and reads the file's
header anew for the config, the tokenizer and the weights. For a model with a large vocabulary
that header is most of the load: Gemma-3's holds 262,144 tokens, scores and token types, and
``GGUFReader`` builds every element of those arrays through a memory map's Python-level indexing,
then ``transformers`` converts each one from a NumPy array to a Python value byte by byte.
:func:`gguf_parsed_once` makes each of those steps fast, with the same result:

* each file is read once per load (the readers are kept for the duration), and ``gguf``'s
  tensor-name map built once per architecture;
* :class:`FastReader` is ``GGUFReader`` with the same fields, parts and tensors, sliced from a
  plain NumPy view of the mapped file, and an array of numbers or strings read in one pass;
* :func:`parse_value` is ``transformers``' ``_gguf_parse_value`` with a string decoded from its
  bytes in one call.

``tests/test_gguf_read.py`` checks every field against ``gguf``'s own reader and ``transformers``'
own parsing, on a file with every value type and on the packaged SmolLM2 file. A version of
``gguf`` whose reader's internals differ from those :class:`FastReader` replaces is read by its
own reader (:func:`_fits`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading

import gguf
import numpy as np
from gguf import GGUFValueType

_PATCH = threading.Lock()  # held while gguf_parsed_once's stand-ins are in place
_U64 = np.dtype("<u8")


class FastReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` reading from a plain ``ndarray`` view of its memory map (slicing a
    ``np.memmap`` runs Python code per slice), with arrays of numbers and of strings read in one
    pass. Its ``fields`` and ``tensors`` hold the same values, types and offsets as the original's;
    only the arrays' class differs (``ndarray`` views of the same mapped bytes, not ``memmap``)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        dtype = np.dtype(dtype)
        array = plain[offset: offset + dtype.itemsize * count].view(dtype)[:count]
        return array.view(array.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item_type, count = GGUFValueType(raw_itype[0]), int(alen[0])
        start = orig_offs + 12
        types = [GGUFValueType.ARRAY] + ([item_type] if count else [])
        numbers = self.gguf_scalar_to_np.get(item_type)
        if numbers is not None:
            values = self._get(start, numbers, count)
            return 12 + int(values.nbytes), [raw_itype, alen, *values.reshape(count, 1)], list(range(2, 2 + count)), types
        if item_type != GGUFValueType.STRING:  # nested arrays: as gguf reads them
            return super()._get_field_parts(orig_offs, raw_type)
        plain, parts, offs = self._plain, [raw_itype, alen], start  # lengths read as little-endian: checked above
        for _ in range(count):
            length = plain[offs: offs + 8].view(_U64)
            parts += (length, plain[offs + 8: offs + 8 + int(length[0])])
            offs += 8 + int(length[0])
        return offs - orig_offs, parts, list(range(3, 2 + 2 * count, 2)), types


def parse_value(value, data_type, _original=None):
    """``transformers``' ``_gguf_parse_value`` (``_original``) for a field's element ``value`` (an
    array's item, alone or as an array's): the same Python value, with a string decoded from its
    bytes at once instead of a byte at a time, and a number or a truth value read without the
    original's type dispatch; anything else as the original does it."""
    item_type = data_type
    if isinstance(data_type, list):
        item_type = data_type[-1] if len(data_type) == 2 and data_type[0] == GGUFValueType.ARRAY else data_type[0]
    if isinstance(value, np.ndarray):
        if item_type == GGUFValueType.STRING and value.dtype == np.uint8:
            return value.tobytes().decode()
        convert = _SCALARS.get(item_type)
        if convert is not None:
            return convert(value[0])
    return _original(value, data_type)


#: how ``_gguf_parse_value`` converts a scalar element, by its GGUF value type
_SCALARS = {**dict.fromkeys([0, 1, 2, 3, 4, 5, 10, 11], int), 6: float, 12: float, 7: bool}


@contextlib.contextmanager
def gguf_parsed_once():
    """For the duration, each GGUF file is read once, by :class:`FastReader`, its values parsed
    by :func:`parse_value`, and each tensor-name map built once. ``transformers`` looks
    ``gguf.GGUFReader`` and ``gguf.get_tensor_name_map`` up at call time, and its GGUF module's
    ``_gguf_parse_value`` at module level, so the stand-ins set here are what its calls get; the
    originals are restored after. Loads from several threads take turns (the stand-ins are the
    modules', for everyone)."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    with _PATCH:
        name_map, parse = gguf.get_tensor_name_map, getattr(hf_gguf, "_gguf_parse_value", None)
        original = gguf.GGUFReader
        reader, readers = (FastReader if _fits(original) else original), {}

        def read_once(path, mode="r"):
            key = (os.path.realpath(path), mode)
            if key not in readers:
                readers[key] = reader(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
        if parse is not None:
            hf_gguf._gguf_parse_value = functools.partial(parse_value, _original=parse)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = original, name_map
            if parse is not None:
                hf_gguf._gguf_parse_value = parse


def _fits(reader: type) -> bool:
    """Whether ``gguf``'s reader has the internals :class:`FastReader` replaces, as this module
    knows them (another version of ``gguf`` is read by its own reader)."""
    try:
        get = list(inspect.signature(reader._get).parameters)
        parts = list(inspect.signature(reader._get_field_parts).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return get == ["self", "offset", "dtype", "count", "override_order"] and parts == ["self", "orig_offs", "raw_type"]
