"""specdec/gguf_read.py: the fast GGUF header reader gives what ``gguf``'s reader and ``transformers``'
parsing give, field by field and tensor by tensor; a load parses each file once and restores
what it patched."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType
from transformers import modeling_gguf_pytorch_utils as hf_gguf
from transformers.integrations.ggml import _gguf_parse_value

from specdec.gguf_read import FastReader, _fits, gguf_parsed_once, parse_value

VALUES = [  # (key, value, GGUF type, item type of an array)
    ("t.u8", 200, GGUFValueType.UINT8, None), ("t.i8", -100, GGUFValueType.INT8, None),
    ("t.u16", 60000, GGUFValueType.UINT16, None), ("t.i16", -30000, GGUFValueType.INT16, None),
    ("t.u32", 4_000_000_000, GGUFValueType.UINT32, None), ("t.i32", -2_000_000_000, GGUFValueType.INT32, None),
    ("t.u64", 2**63 + 5, GGUFValueType.UINT64, None), ("t.i64", -(2**62), GGUFValueType.INT64, None),
    ("t.f32", 0.1, GGUFValueType.FLOAT32, None), ("t.f64", 1e-300, GGUFValueType.FLOAT64, None),
    ("t.bool", True, GGUFValueType.BOOL, None), ("t.str", "héllo ▁wörld", GGUFValueType.STRING, None),
    ("t.empty_str", "", GGUFValueType.STRING, None),
    ("t.tokens", ["<pad>", "", "▁the", "日本", "\n", "a" * 300], GGUFValueType.ARRAY, GGUFValueType.STRING),
    ("t.scores", [0.0, -1.5, 3.25, float("inf")], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    ("t.types", [1, 2, 3, 6], GGUFValueType.ARRAY, GGUFValueType.INT32),
    ("t.u8s", [0, 255, 7], GGUFValueType.ARRAY, GGUFValueType.UINT8),
    ("t.i64s", [-(2**40), 2**40], GGUFValueType.ARRAY, GGUFValueType.INT64),
    ("t.f64s", [1e-300, -2.5], GGUFValueType.ARRAY, GGUFValueType.FLOAT64),
    ("t.bools", [True, False, True], GGUFValueType.ARRAY, GGUFValueType.BOOL),
    ("t.one_str", ["only"], GGUFValueType.ARRAY, GGUFValueType.STRING),
    ("t.nested", [[1, 2], [3]], GGUFValueType.ARRAY, GGUFValueType.ARRAY),
]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A GGUF file with every value type, arrays of each, and tensors of two types."""
    path = tmp_path_factory.mktemp("gguf") / "every_type.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value, vtype, sub in VALUES:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    rng = np.random.default_rng(0)
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((8, 32)).astype(np.float32))
    writer.add_tensor("token_embd.weight", rng.standard_normal((4, 16)).astype(np.float16))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path


def outcome(parse) -> list:
    """What ``parse()`` returns, or its error's type and message (transformers refuses nested arrays)."""
    try:
        return parse()
    except ValueError as error:
        return [str(error)]


def assert_same_reading(path) -> None:
    """FastReader's fields and tensors equal gguf's GGUFReader's, and every field parses (as
    ``transformers`` parses it) to the same value with :func:`parse_value` as with its own."""
    stock, fast = gguf.GGUFReader(path), FastReader(path)
    assert list(fast.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        mine = fast.fields[name]
        assert (mine.offset, mine.name, mine.data, mine.types) == (field.offset, field.name, field.data, field.types), name
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        theirs = outcome(lambda: [_gguf_parse_value(field.parts[i], field.types) for i in field.data])
        ours = outcome(lambda: [parse_value(mine.parts[i], mine.types, _original=_gguf_parse_value) for i in mine.data])
        assert ours == theirs and [type(v) for v in ours] == [type(v) for v in theirs], name
    assert fast.data_offset == stock.data_offset and fast.alignment == stock.alignment
    assert len(fast.tensors) == len(stock.tensors)
    for a, b in zip(fast.tensors, stock.tensors):
        assert (a.name, a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


def test_every_value_type_reads_and_parses_as_gguf_and_transformers_do(gguf_file):
    assert_same_reading(gguf_file)
    tokens = FastReader(gguf_file).fields["t.tokens"]  # the strings themselves, not only agreement
    assert [parse_value(tokens.parts[i], tokens.types, _original=_gguf_parse_value) for i in tokens.data] == VALUES[13][1]


@pytest.mark.real_model
def test_the_packaged_smollm2_file_reads_as_gguf_reads_it():
    from specdec.models import packaged_location

    folder, name = packaged_location("smollm2-135m")
    assert_same_reading(f"{folder}/{name}")


def test_a_load_reads_each_file_once_and_restores_what_it_patched(gguf_file, monkeypatch):
    built = []
    monkeypatch.setattr(FastReader, "__init__", lambda self, *a, **kw: built.append(a) or gguf.GGUFReader.__init__(self, *a, **kw))
    reader, parse, names = gguf.GGUFReader, hf_gguf._gguf_parse_value, gguf.get_tensor_name_map
    with gguf_parsed_once():
        first, again = gguf.GGUFReader(str(gguf_file)), gguf.GGUFReader(gguf_file)
        assert first is again and isinstance(first, FastReader) and len(built) == 1
        assert hf_gguf._gguf_parse_value is not parse
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert (gguf.GGUFReader, hf_gguf._gguf_parse_value, gguf.get_tensor_name_map) == (reader, parse, names)


def test_a_gguf_whose_reader_differs_is_read_by_its_own_reader(gguf_file):
    assert _fits(gguf.GGUFReader)  # the installed gguf: FastReader reads it (compared above)

    class Other(gguf.GGUFReader):
        def _get_field_parts(self, offset, raw_type, extra=None):  # internals renamed in some other version
            return super()._get_field_parts(offset, raw_type)

    assert not _fits(Other)
