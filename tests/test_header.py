"""Tests of the header parser (engine.format._header) and its public wrapper (engine.format.header)."""

from __future__ import annotations

import gc
import json
import math
import mmap
import os
import pickle
import struct
from typing import Any, NamedTuple

import numpy as np
import pytest
from conftest import build_file, encode_header, entry, layout, write_raw
from gil import ticks_during
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine.base.dtypes import BITS, NAMES
from engine.errors import HEADER_REASONS, HeaderError, ReadError, TensorNotFoundError
from engine.format import _header
from engine.format.header import (
    MAX_HEADER_SIZE,
    Header,
    TensorInfo,
    parse_buffer,
    parse_prefix,
    read_header,
    read_header_fd,
)

safetensors = pytest.importorskip("safetensors")

# ---------------------------------------------------------------------------------------
# the table of malformed files: one defect each
# ---------------------------------------------------------------------------------------

ANY = object()  # .position is not checked
E = b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'  # a valid entry, 4 data bytes


def one(name: bytes, e: bytes = E) -> bytes:
    """A header with one tensor ``name`` (raw bytes between the quotes) and entry ``e``."""
    return b'{"' + name + b'":' + e + b"}"


def ent(dtype: bytes = b'"F32"', shape: bytes = b"[1]", offsets: bytes = b"[0,4]") -> bytes:
    return b'{"dtype":' + dtype + b',"shape":' + shape + b',"data_offsets":' + offsets + b"}"


class Case(NamedTuple):
    id: str
    file: bytes
    reason: str
    tensors: tuple[str, ...] = ()
    position: Any = ANY  # int, None, or ANY
    ref_rejects: bool = True  # the reference (safetensors 0.8) rejects it too
    strict: bool = False  # rejected only with strict=True


def at(header: bytes, marker: bytes, occurrence: int = 1, delta: int = 0) -> int:
    """Byte offset of the ``occurrence``-th ``marker`` in ``header``, plus ``delta``."""
    pos = -1
    for _ in range(occurrence):
        pos = header.index(marker, pos + 1)
    return pos + delta


def bad(id, header, data=b"", reason="", tensors=(), position=ANY, ref_rejects=True, strict=False, **kw) -> Case:
    """A case whose file is ``header`` (a dict of entries or the raw JSON bytes) and ``data``,
    laid out by :func:`conftest.build_file` (``length=``, ``pad=`` as it takes them)."""
    return Case(id, build_file(header, data, **kw), reason, tuple(tensors), position, ref_rejects, strict)


#: the files of the table that are too long to write in place
LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 4\n"
DEEP = b"[" * 100_000
DUP_TENSOR = b'{"a":' + E + b',"a":' + E + b"}"
DUP_ESCAPED = b'{"a":' + E + b',"\\u0061":' + E + b"}"
DUP_METADATA = b'{"__metadata__":{},"__metadata__":{}}'
DUP_FIELD = one(b"a", b'{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}')
DUP_METADATA_KEY = b'{"__metadata__":{"k":"1","k":"2"}}'


def _two(a, b):
    return {"a": entry("F32", (1,), *a), "b": entry("F32", (1,), *b)}


#: the table of malformed files: one defect each (``bad`` builds a file from its header)
CASES: list[Case] = [
    # -- the 8-byte length ---------------------------------------------------------------
    Case("empty-file", b"", "HeaderTooSmall", position=None),
    Case("file-under-8-bytes", b"\x02\x00\x00", "HeaderTooSmall", position=None),
    Case("length-2**64-1", struct.pack("<Q", 2**64 - 1) + b"{}", "HeaderTooLarge", position=None),
    Case("length-2**63", struct.pack("<Q", 2**63) + b"{}", "HeaderTooLarge", position=None),
    Case("length-over-cap", struct.pack("<Q", MAX_HEADER_SIZE + 1) + b"{}", "HeaderTooLarge"),
    bad("length-past-eof", b"{}", length=100, reason="InvalidHeaderLength", position=None),
    bad("length-one-past-eof", b"{}", length=9, reason="InvalidHeaderLength"),
    # -- not safetensors at all: named, not read as a length -----------------------------------
    Case("git-lfs-pointer", LFS, "NotSafetensors", position=None),
    Case("html-page", b"<!DOCTYPE html><html><body>Not found</body></html>\n", "NotSafetensors"),
    Case("json-file", b'{"architectures": ["LlamaForCausalLM"]}\n', "NotSafetensors"),
    Case("text-file", b"hello world, these are not weights\n", "NotSafetensors"),
    # -- start, UTF-8 --------------------------------------------------------------------
    bad("header-empty", b"", pad=False, reason="InvalidHeaderStart", position=0),
    bad("first-byte-not-brace", b"[]", reason="InvalidHeaderStart", position=0),
    # the reference skips leading whitespace; the format says the header starts with '{'
    bad("leading-space", b" {}", pad=False, reason="InvalidHeaderStart", position=0, ref_rejects=False),
    *(
        bad(id, one(b"a" + defect), 4, reason="InvalidHeader", position=3)
        for id, defect in [
            ("utf8-overlong-2", b"\xc0\xaf"),
            ("utf8-overlong-3", b"\xe0\x80\xaf"),
            ("utf8-overlong-4", b"\xf0\x80\x80\xaf"),
            ("utf8-surrogate", b"\xed\xa0\x80"),
            ("utf8-above-10ffff", b"\xf4\x90\x80\x80"),
            ("utf8-f5-lead", b"\xf5\x80\x80\x80"),
            ("utf8-lone-continuation", b"\x80"),
            ("utf8-truncated", b"\xe2\x82"),
            ("utf8-truncated-4", b"\xf0\x9f\x98"),
        ]
    ),
    bad("utf8-invalid-in-padding", b"{}\xff", pad=False, reason="InvalidHeader", position=2),
    bad("utf8-cut-by-header-end", b'{"a":' + E + b',"\xe2\x82', pad=False, reason="InvalidHeader"),
    # -- JSON syntax ---------------------------------------------------------------------
    bad("bad-escape", one(b"a\\x"), 4, reason="InvalidHeaderDeserialization", position=3),
    bad("short-u-escape", one(b"a\\u12"), 4, reason="InvalidHeaderDeserialization", position=3),
    bad("bad-hex-escape", one(b"a\\u12G4"), 4, reason="InvalidHeaderDeserialization", position=3),
    bad("lone-high-surrogate", one(b"a\\ud800"), 4, reason="InvalidHeaderDeserialization", position=3),
    bad("lone-low-surrogate", one(b"a\\udc00"), 4, reason="InvalidHeaderDeserialization", position=3),
    bad(
        "high-surrogate-then-bmp",
        one(b"\\ud800\\u0041"),
        4,
        reason="InvalidHeaderDeserialization",
        position=2,
    ),
    bad("control-char-in-string", one(b"a\x01b"), 4, reason="InvalidHeaderDeserialization", position=3),
    bad("newline-in-string", one(b"a\nb"), 4, reason="InvalidHeaderDeserialization", position=3),
    bad("trailing-garbage", b"{}x", pad=False, reason="InvalidHeaderDeserialization", position=2),
    bad("trailing-second-object", b"{} {}", pad=False, reason="InvalidHeaderDeserialization", position=3),
    bad(
        "nul-padding",
        b"{}\x00\x00\x00\x00\x00\x00",
        pad=False,
        reason="InvalidHeaderDeserialization",
        position=2,
    ),
    bad("non-ascii-padding", b"{}\xc2\xa0", pad=False, reason="InvalidHeaderDeserialization", position=2),
    bad("trailing-comma", b'{"a":' + E + b",}", 4, reason="InvalidHeaderDeserialization", position=len(E) + 6),
    bad("missing-colon", b'{"a"' + E + b"}", 4, reason="InvalidHeaderDeserialization", position=4),
    bad("unterminated-string", b'{"abc', pad=False, reason="InvalidHeaderDeserialization", position=1),
    bad("truncated-json", one(b"a")[:-12], pad=False, reason="InvalidHeaderDeserialization", tensors=["a"]),
    bad("not-an-object", b"{1:2}", reason="InvalidHeaderDeserialization", position=1),
    bad("single-quotes", b"{'a':1}", reason="InvalidHeaderDeserialization", position=1),
    # -- shape of the JSON ---------------------------------------------------------------
    bad("entry-not-object", b'{"a":"F32"}', reason="InvalidHeaderDeserialization", tensors=["a"], position=5),
    bad("entry-null", b'{"a":null}', reason="InvalidHeaderDeserialization", tensors=["a"], position=5),
    bad(
        "unknown-field",
        one(b"a", b'{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}'),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
        position=53,
        ref_rejects=False,
        strict=True,
    ),
    bad(
        "missing-shape",
        one(b"a", b'{"dtype":"F32","data_offsets":[0,4]}'),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
    ),
    bad(
        "missing-dtype",
        one(b"a", b'{"shape":[1],"data_offsets":[0,4]}'),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
    ),
    bad(
        "missing-offsets",
        one(b"a", b'{"dtype":"F32","shape":[1]}'),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
    ),
    bad("empty-entry", one(b"a", b"{}"), 4, reason="InvalidHeaderDeserialization", tensors=["a"]),
    bad(
        "dtype-not-string",
        one(b"a", ent(dtype=b"32")),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
        position=14,
    ),
    bad(
        "shape-not-array",
        one(b"a", ent(shape=b'"1"')),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
    ),
    bad(
        "shape-of-strings",
        one(b"a", ent(shape=b'["1"]')),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
    ),
    bad(
        "offsets-object",
        one(b"a", ent(offsets=b"{}")),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
    ),
    bad(
        "three-offsets",
        one(b"a", ent(offsets=b"[0,4,4]")),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
    ),
    bad("one-offset", one(b"a", ent(offsets=b"[4]")), 4, reason="InvalidHeaderDeserialization", tensors=["a"]),
    bad(
        "negative-dim",
        one(b"a", ent(shape=b"[-1]")),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
        position=29,
    ),
    bad(
        "negative-offset",
        one(b"a", ent(offsets=b"[-0,4]")),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
    ),
    bad(
        "float-dim",
        one(b"a", ent(shape=b"[1.0]")),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
        position=29,
    ),
    bad(
        "exponent-dim",
        one(b"a", ent(shape=b"[1e0]")),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
        position=29,
    ),
    bad(
        "exponent-offset",
        one(b"a", ent(offsets=b"[0,4E0]")),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
    ),
    bad(
        "leading-zero",
        one(b"a", ent(shape=b"[01]")),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
        position=29,
    ),
    bad(
        "plus-sign",
        one(b"a", ent(shape=b"[+1]")),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
        position=29,
    ),
    bad(
        "nested-in-shape",
        one(b"a", ent(shape=b"[[1]]")),
        4,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
        position=29,
    ),
    bad(
        "metadata-non-string-value",
        b'{"__metadata__":{"k":1}}',
        reason="InvalidHeaderDeserialization",
        position=21,
    ),
    bad(
        "metadata-nested-value",
        b'{"__metadata__":{"k":{"x":"y"}}}',
        reason="InvalidHeaderDeserialization",
        position=21,
    ),
    bad(
        "metadata-null",
        b'{"__metadata__":null}',
        reason="InvalidHeaderDeserialization",
        position=16,
        ref_rejects=False,
    ),
    bad("metadata-array", b'{"__metadata__":["a"]}', reason="InvalidHeaderDeserialization", position=16),
    bad("metadata-string", b'{"__metadata__":"a"}', reason="InvalidHeaderDeserialization", position=16),
    # -- no recursion: nesting fails at once, whatever the depth ---------------------------
    bad("deep-nesting-top", DEEP, reason="InvalidHeaderStart", position=0),
    bad(
        "deep-nesting-entry",
        b'{"a":' + DEEP,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
        position=5,
    ),
    bad(
        "deep-nesting-shape",
        b'{"a":{"shape":' + DEEP,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
        position=15,
    ),
    bad(
        "deep-nesting-metadata",
        b'{"__metadata__":{"k":' + DEEP,
        reason="InvalidHeaderDeserialization",
        position=21,
    ),
    bad(
        "deep-nesting-objects",
        b'{"a":{"dtype":' + b'{"a":' * 50_000,
        reason="InvalidHeaderDeserialization",
        tensors=["a"],
        position=14,
    ),
    # -- numbers that do not fit ---------------------------------------------------------
    bad(
        "dim-above-u64",
        one(b"a", ent(shape=b"[18446744073709551616]")),
        4,
        reason="ValidationOverflow",
        tensors=["a"],
        position=29,
    ),
    bad(
        "offset-above-u64",
        one(b"a", ent(offsets=b"[0,99999999999999999999]")),
        4,
        reason="ValidationOverflow",
        tensors=["a"],
    ),
    bad(
        "shape-product-overflow",
        one(b"a", ent(shape=b"[4294967296,4294967296]")),
        4,
        reason="ValidationOverflow",
        tensors=["a"],
    ),
    # folded left to right like the reference: overflow before the 0 is reached
    bad(
        "shape-product-overflow-before-zero",
        one(b"a", ent(shape=b"[4294967296,4294967296,0]", offsets=b"[0,0]")),
        reason="ValidationOverflow",
        tensors=["a"],
    ),
    bad(
        "bits-overflow",
        one(b"a", ent(shape=b"[1152921504606846976]")),
        4,
        reason="ValidationOverflow",
        tensors=["a"],
    ),
    # -- dtype ---------------------------------------------------------------------------
    bad("unknown-dtype", one(b"a", ent(dtype=b'"F33"')), 4, reason="InvalidDtype", tensors=["a"], position=14),
    bad("lowercase-dtype", one(b"a", ent(dtype=b'"f32"')), 4, reason="InvalidDtype", tensors=["a"]),
    bad("empty-dtype", one(b"a", ent(dtype=b'""')), 4, reason="InvalidDtype", tensors=["a"]),
    # -- duplicates ----------------------------------------------------------------------
    bad(
        "duplicate-tensor",
        DUP_TENSOR,
        4,
        reason="DuplicateKey",
        tensors=["a"],
        position=at(DUP_TENSOR, b'"a"', 2),
        ref_rejects=False,
    ),
    bad("duplicate-tensor-escaped", DUP_ESCAPED, 4, reason="DuplicateKey", tensors=["a"], ref_rejects=False),
    bad("duplicate-metadata", DUP_METADATA, reason="DuplicateKey", position=19),
    bad("duplicate-field", DUP_FIELD, 4, reason="DuplicateKey", tensors=["a"], position=at(DUP_FIELD, b'"dtype"', 2)),
    bad("duplicate-metadata-key", DUP_METADATA_KEY, reason="DuplicateKey", position=25, ref_rejects=False),
    # -- per-tensor sizes ----------------------------------------------------------------
    bad("f4-odd-count", one(b"a", ent(b'"F4"', b"[3]", b"[0,1]")), 1, reason="MisalignedSlice", tensors=["a"]),
    bad(
        "f6-misaligned",
        one(b"a", ent(b'"F6_E2M3"', b"[2]", b"[0,1]")),
        1,
        reason="MisalignedSlice",
        tensors=["a"],
    ),
    bad("size-mismatch", one(b"a", ent(shape=b"[2]")), 4, reason="TensorInvalidInfo", tensors=["a"]),
    bad(
        "end-before-begin",
        one(b"a", ent(shape=b"[0]", offsets=b"[4,0]")),
        4,
        reason="TensorInvalidInfo",
        tensors=["a"],
    ),
    # -- regions -------------------------------------------------------------------------
    bad("gap", _two((0, 4), (8, 12)), 12, reason="InvalidOffset", tensors=["a", "b"], position=None),
    bad(
        "overlap",
        {"a": entry("F32", (2,), 0, 8), "b": entry("F32", (1,), 4, 8)},
        8,
        reason="InvalidOffset",
        tensors=["a", "b"],
        position=None,
    ),
    bad("same-region-twice", _two((0, 4), (0, 4)), 4, reason="InvalidOffset", tensors=["a", "b"]),
    bad("not-starting-at-0", {"a": entry("F32", (1,), 4, 8)}, 8, reason="InvalidOffset", tensors=["a"]),
    bad(
        "zero-size-inside-tensor",
        {"a": entry("F32", (2,), 0, 8), "z": entry("F32", (0,), 4, 4)},
        8,
        reason="InvalidOffset",
        tensors=["z", "a"],
    ),
    bad(
        "data-too-long",
        {"a": entry("F32", (1,), 0, 4)},
        8,
        reason="MetadataIncompleteBuffer",
        tensors=["a"],
        position=None,
    ),
    bad(
        "data-too-short", {"a": entry("F32", (2,), 0, 8)}, 4, reason="MetadataIncompleteBuffer", tensors=["a"]
    ),
    bad("no-tensors-but-data", b"{}", 4, reason="MetadataIncompleteBuffer", position=None),
    bad(
        "zero-size-past-end",
        _two((0, 4), (0, 4)) | {"b": entry("F32", (0,), 8, 8)},
        4,
        reason="InvalidOffset",
        tensors=["b", "a"],
    ),
]


def test_every_reason_is_covered():
    covered = {case.reason for case in CASES}
    assert covered == HEADER_REASONS - {"InvalidMetadata", "NestingTooDeep"}


def _check(err: HeaderError, case: Case, path: str | None) -> None:
    assert err.reason == case.reason, str(err)
    text = str(err)
    if path is not None:
        assert err.path == path
        assert path in text
    for name in case.tensors:
        assert repr(name) in text
    assert set(err.tensors) == set(case.tensors)
    if case.position is not ANY:
        assert err.position == case.position, text
    if err.position is not None:
        assert 0 <= err.position <= len(case.file)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_file(case: Case, tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(case.file)
    with pytest.raises(HeaderError) as info:
        read_header(path, strict=case.strict)
    _check(info.value, case, str(path))
    # the same defect in memory
    with pytest.raises(HeaderError) as info:
        parse_buffer(case.file, strict=case.strict)
    _check(info.value, case, None)
    if case.strict:  # a rule of strict mode only: the default accepts it, as the reference
        assert len(read_header(path)) == len(parse_buffer(case.file))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_file_reference(case: Case, tmp_path):
    """Where the reference rejects a file too, it must fail; where it does not, we are
    stricter on purpose (and say so in the table)."""
    from safetensors import safe_open

    path = tmp_path / "bad.safetensors"
    path.write_bytes(case.file)
    if case.ref_rejects:
        with pytest.raises(Exception):  # noqa: B017 - its error types vary by version
            with safe_open(path, "np") as f:
                f.keys()
    else:
        with safe_open(path, "np") as f:
            f.keys()


def test_error_is_value_error_and_picklable(st_file):
    path = st_file(b'{"a":1}')
    with pytest.raises(ValueError) as info:
        read_header(path)
    err = pickle.loads(pickle.dumps(info.value))
    assert isinstance(err, HeaderError)
    assert (err.reason, err.position, err.path, err.tensors) == (
        info.value.reason,
        info.value.position,
        info.value.path,
        info.value.tensors,
    )
    assert str(err) == str(info.value)


def test_region_message_names_both_tensors(st_file):
    path = st_file({"a": entry("F32", (4,), 0, 16), "b": entry("F32", (1,), 12, 16)}, 16)
    with pytest.raises(
        HeaderError, match=r"tensor 'b' starts at 12 but the previous tensor 'a' ends at 16 \(overlap"
    ):
        read_header(path)


def test_long_names_are_shortened_in_messages(st_file):
    name = "x" * 10_000
    path = st_file({name: entry("F32", (2,), 0, 4)}, 4)
    with pytest.raises(HeaderError) as info:
        read_header(path)
    assert len(str(info.value)) < 1000
    assert info.value.tensors == (name,)


# ---------------------------------------------------------------------------------------
# the 8-byte length
# ---------------------------------------------------------------------------------------


def test_header_length_limits():
    prefix = struct.pack("<Q", 150_000_000)
    with pytest.raises(HeaderError) as info:
        _header.header_length(prefix, 10**9)
    assert info.value.reason == "HeaderTooLarge"
    # a raised cap accepts it
    assert _header.header_length(prefix, 10**9, max_header_size=200_000_000) == 150_000_000
    # 8 + N must not wrap around 2**64
    with pytest.raises(HeaderError) as info:
        _header.header_length(b"\xff" * 8, 2**63, max_header_size=2**64 - 1)
    assert info.value.reason == "InvalidHeaderLength"
    with pytest.raises(HeaderError) as info:
        _header.header_length(b"\xff" * 8, 2**63, max_header_size=2**70)
    assert info.value.reason == "InvalidHeaderLength"
    assert _header.header_length(struct.pack("<Q", 2) + b"{}", 10) == 2
    with pytest.raises(ValueError):
        _header.header_length(b"\x00" * 4, 10)


def test_max_header_size_keyword(st_file):
    header, size = layout({"w": ("F32", (2,))})
    path = st_file(header, size)
    n = len(encode_header(header))
    n += -n % 8
    with pytest.raises(HeaderError) as info:
        read_header(path, max_header_size=n - 1)
    assert info.value.reason == "HeaderTooLarge"
    assert read_header(path, max_header_size=n)["w"].shape == (2,)
    with pytest.raises(HeaderError):
        parse_buffer(path.read_bytes(), max_header_size=n - 1)


def test_file_shorter_than_it_claims(st_file):
    """A file that shrinks after its size was taken raises, never hangs."""
    header, size = layout({"w": ("F32", (2,))})
    path = st_file(header, size)
    data = path.read_bytes()
    path.write_bytes(data[:20])  # cut inside the header
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ReadError) as info:
            read_header_fd(fd, path=path, file_size=len(data))
        assert str(path) in str(info.value)
        assert isinstance(info.value, OSError)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------
# valid files
# ---------------------------------------------------------------------------------------


def test_empty_header_is_valid(st_file):
    h = read_header(st_file(b"{}"))
    assert len(h) == 0 and h.keys() == [] and h.metadata is None
    assert h.data_size == 0 and h.header_size == 8 and h.data_start == 16
    assert h.parameters() == {"total": 0}
    assert h.table.order.shape == (0,)
    h = parse_buffer(build_file(b"{}", pad=False))
    assert h.header_size == 2


def test_zero_size_tensors_share_offsets(st_file):
    header = {
        "d": entry("F32", (0,), 4, 4),
        "c": entry("F32", (1,), 0, 4),
        "a": entry("F32", (0,), 0, 0),
        "b": entry("BF16", (2, 0, 3), 0, 0),
        "e": entry("U8", (0,), 4, 4),
    }
    h = read_header(st_file(header, 4))
    assert h.names == ["d", "c", "a", "b", "e"]
    assert h.offset_keys() == ["a", "b", "c", "d", "e"]
    assert h["b"] == TensorInfo("b", "BF16", (2, 0, 3), (0, 0))
    assert h["b"].numel == 0 and h["b"].nbytes == 0


def test_header_api(valid_file):
    h = read_header(valid_file)
    raw = json.loads(valid_file.read_bytes()[8 : 8 + h.header_size])
    assert h.path == str(valid_file)
    assert h.file_size == valid_file.stat().st_size
    assert h.data_start == 8 + h.header_size and h.header_size % 8 == 0
    assert h.data_size == h.nbytes == h.file_size - h.data_start
    assert h.metadata == {"format": "pt", "note": "ünïcode ✓"}
    assert h.names == [k for k in raw if k != "__metadata__"]
    assert h.keys() == sorted(h.names) == list(h)
    assert h.offset_keys() == h.names  # laid out in header order
    assert len(h) == 7 and "scale" in h and "nope" not in h and 3 not in h
    info = h["layer.0.weight"]
    assert info == h.info("layer.0.weight") == h.get("layer.0.weight")
    assert isinstance(info, TensorInfo)
    assert (info.dtype, info.shape, info.code, info.numel, info.nbytes) == ("F32", (3, 3), 17, 9, 36)
    assert info.data_offsets == tuple(raw["layer.0.weight"]["data_offsets"])
    assert h["scale"].shape == () and h["scale"].numel == 1
    assert h["packed"].numel == 8 and h["packed"].nbytes == 4
    assert h.get("nope") is None and h.get("nope", 1) == 1
    assert h.to_dict() == raw
    assert [n for n, _ in h.items()] == h.names
    assert h.infos() == h.values() == [h[n] for n in h.names]
    assert h["mask"] is h["mask"]  # cached once items()/infos() have been built
    assert h.parameters() == {"BOOL": 5, "F4": 8, "I8": 0, "BF16": 12, "F32": 12, "F64": 1, "total": 38}
    assert "7 tensors" in repr(h)
    t = h.table
    assert t.codes.dtype == np.uint8 and t.begins.dtype == np.int64 and t.ends.dtype == np.int64
    assert not t.codes.flags.writeable and not t.begins.flags.writeable
    assert t.index == {n: i for i, n in enumerate(h.names)}
    assert len(t) == 7 and "7 tensors" in repr(t)
    assert t.row(-1) == t.rows()[-1] == tuple(h["packed"])
    assert t.items(TensorInfo) == h.items()
    with pytest.raises(IndexError):
        t.row(7)
    with pytest.raises(TypeError):
        t.row(0, list)


def test_rows_are_not_tracked_by_the_gc(valid_file):
    """Rows and shapes hold only str, int and such tuples: the cyclic GC need not see them."""
    h = read_header(valid_file)
    info = h["layer.0.weight"]
    assert not gc.is_tracked(info) and not gc.is_tracked(info.shape) and not gc.is_tracked(info.data_offsets)
    for pair in h.items():
        assert not gc.is_tracked(pair) and not gc.is_tracked(pair[1])
    assert all(not gc.is_tracked(shape) for shape in h.table.shapes)
    gc.collect()
    assert h["layer.0.weight"] == info == TensorInfo("layer.0.weight", "F32", (3, 3), info.data_offsets)


def test_table_pickles(valid_file):
    t = read_header(valid_file).table
    u = pickle.loads(pickle.dumps(t))
    for attr in ("names", "index", "shapes", "metadata", "header_size", "data_size"):
        assert getattr(u, attr) == getattr(t, attr)
    for attr in ("codes", "begins", "ends", "order"):
        np.testing.assert_array_equal(getattr(u, attr), getattr(t, attr))
    assert u.row(2) == t.row(2)
    # columns that do not match the names (a doctored pickle) are refused, never read past
    fn, args = t.__reduce__()
    for i in (2, 4, 5, 6):
        bad = list(args)
        bad[i] = bad[i][:-1]
        with pytest.raises(ValueError, match="columns"):
            fn(*bad)
    with pytest.raises(TypeError):
        fn(*args[:2], np.asarray(t.codes), *args[3:])
    bad = list(args)
    bad[2] = bytes([0xF0]) + bad[2][1:]  # a dtype code past the table: C readers index by it
    with pytest.raises(ValueError, match="unknown dtype code 240"):
        fn(*bad)


def test_table_columns_without_numpy_match_the_arrays():
    """dtype_names, file_order and bytes_per_code (built in C, no numpy) against a numpy
    oracle over the array columns, on a shuffled layout of mixed dtypes."""
    rng = np.random.default_rng(5)
    names = [f"t{i}" for i in range(200)]
    dts = ["F32", "BF16", "I8", "F4", "BOOL", "F64", "U16"]
    tensors = {n: (dts[i % len(dts)], [int(rng.integers(0, 5)), 2]) for i, n in enumerate(names)}
    header, size = layout(dict(sorted(tensors.items(), key=lambda kv: rng.random())))
    t = _header.parse_header(json.dumps(header).encode(), size)
    assert t.dtype_names() == [NAMES[c] for c in t.codes.tolist()]
    assert t.file_order() == t.order.tolist() == np.lexsort((t.ends, t.begins)).tolist()
    nbytes = t.ends - t.begins
    oracle = {int(c): int(nbytes[t.codes == c].sum()) for c in np.unique(t.codes)}
    assert t.bytes_per_code() == oracle and list(t.bytes_per_code()) == sorted(oracle)
    for attr in ("codes", "begins", "ends", "order"):
        assert not getattr(t, attr).flags.writeable
        assert getattr(t, attr) is getattr(t, attr)  # made once
    with pytest.raises(ValueError):
        t.codes[0] = 1


def test_dtypes_and_names_are_copies(valid_file):
    """A caller's edit of Header.dtypes or Header.names does not reach the header."""
    h = read_header(valid_file)
    want, first = list(h.dtypes), h.names[0]  # snapshots
    got = h.dtypes
    got[0] = "F64" if got[0] != "F64" else "I8"
    h.names[0] = "doctored"
    assert h.dtypes == want and h.names[0] == first


def test_tensor_not_found(valid_file):
    h = read_header(valid_file)
    with pytest.raises(TensorNotFoundError) as info:
        h["layer.0.weigth"]
    err = info.value
    assert isinstance(err, KeyError)
    assert str(valid_file) in str(err) and "'layer.0.weigth'" in str(err)
    assert "did you mean 'layer.0.weight'" in str(err)
    assert err.tensors == ("layer.0.weigth",)
    with pytest.raises(KeyError):
        h[None]


def test_parse_buffer_kinds(valid_file):
    data = valid_file.read_bytes()
    ref = read_header(valid_file).to_dict()
    as_u8 = np.frombuffer(data, np.uint8)
    kinds = [data, bytearray(data), memoryview(data), as_u8, as_u8.reshape(1, -1)]
    if len(data) % 4 == 0:
        kinds.append(as_u8.view(np.uint32))  # itemsize 4: read as bytes
    for buf in kinds:
        h = parse_buffer(buf, path="mem")
        assert h.to_dict() == ref and h.path == "mem" and h.file_size == len(data)


def test_parse_prefix_reads_the_header_another_process_read(valid_file):
    """A group load's rank without a copy parses the ``8 + N`` bytes a rank with one sent: the
    same header, checked the same way; fewer bytes than the length says is a HeaderError."""
    data = valid_file.read_bytes()
    ref = read_header(valid_file)
    h = parse_prefix(data[: ref.data_start], file_size=len(data), path="elsewhere")
    assert h.to_dict() == ref.to_dict() and h.path == "elsewhere" and h.data_start == ref.data_start
    with pytest.raises(HeaderError) as err:
        parse_prefix(data[: ref.data_start - 1], file_size=len(data), path="elsewhere")
    assert err.value.reason == "InvalidHeaderLength" and "elsewhere" in str(err.value)
    with pytest.raises(HeaderError) as err:
        parse_prefix(data[: ref.data_start], file_size=ref.data_start + 1, path="elsewhere")
    assert err.value.reason in HEADER_REASONS


def test_parse_buffer_mmap_can_close(valid_file, tmp_path):
    with open(valid_file, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    h = parse_buffer(mm)
    assert h["layer.0.bias"].shape == (3,)
    mm.close()  # no export of the buffer is left behind
    bad = tmp_path / "bad.safetensors"
    write_raw(bad, b'{"a":1}')
    with open(bad, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with pytest.raises(HeaderError):
        parse_buffer(mm)
    mm.close()


def test_read_header_fd(valid_file):
    fd = os.open(valid_file, os.O_RDONLY)
    try:
        os.lseek(fd, 5, os.SEEK_SET)
        h = read_header_fd(fd, path=valid_file)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 5  # pread leaves the position alone
        assert h.path == str(valid_file) and len(h) == 7
        assert read_header_fd(fd).path is None
    finally:
        os.close(fd)


def test_escaped_and_unicode_names(st_file):
    head = (
        '{"a\\"b":' + E.decode() + ',"\\u00e9t\\u00C9":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},'
        '"\\ud83d\\ude00 \\/\\\\\\b\\f\\n\\r\\t":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},'
        '"日本\U0001f600":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},'
        '"__metadata__":{"\\u005f":"v\\u0000\\"","":""}}'
    )
    h = read_header(st_file(head, 4))
    assert h.names == list(k for k in json.loads(head) if k != "__metadata__")
    assert h.names == ['a"b', "étÉ", "\U0001f600 /\\\b\f\n\r\t", "日本\U0001f600"]
    assert h.metadata == {"_": 'v\x00"', "": ""}


def test_whitespace_everywhere(st_file):
    head = (
        b' \t{ \n"a" :\r\n { "shape" : [ 1 , 2 ] , "data_offsets" : [ 0 , 8 ] , "dtype" : "F32" } ,'
        b' "__metadata__" : { } }\n\t \r'
    )
    h = read_header(st_file(head[2:], 8))
    assert h["a"] == TensorInfo("a", "F32", (1, 2), (0, 8)) and h.metadata == {}


def test_escaped_keys_and_dtype(st_file):
    head = (
        b'{"a":{"\\u0064type":"F\\u00332","sh\\u0061pe":[1],"data_\\u006fffsets":[0,4]},'
        b'"\\u005f_metadata__":{"k":"v"}}'
    )
    h = read_header(st_file(head, 4))
    assert h["a"].dtype == "F32" and h.metadata == {"k": "v"}
    assert h.to_dict() == json.loads(head)


def test_big_numbers(st_file):
    big = 2**64 - 1
    h = read_header(st_file({"a": entry("U8", (big, 0), 0, 0)}))
    assert h["a"].shape == (big, 0)


def test_tensor_nbytes():
    code = NAMES.index
    assert _header.tensor_nbytes(code("F32"), (2, 3)) == 24
    assert _header.tensor_nbytes(code("F4"), (2, 3)) == 3
    assert _header.tensor_nbytes(code("BOOL"), ()) == 1
    assert _header.tensor_nbytes(code("F6_E3M2"), (4,)) == 3
    with pytest.raises(HeaderError, match="MisalignedSlice"):
        _header.tensor_nbytes(code("F4"), (3,))
    with pytest.raises(HeaderError, match="ValidationOverflow"):
        _header.tensor_nbytes(code("F64"), (2**61,))
    with pytest.raises(HeaderError, match="ValidationOverflow"):
        _header.tensor_nbytes(code("U8"), (2**32, 2**32, 0))
    with pytest.raises(ValueError):
        _header.tensor_nbytes(99, (1,))


def test_parse_header_accepts_bytes_like():
    head = b'{"a":' + E + b"}"
    for buf in (head, bytearray(head), memoryview(head), memoryview(head).cast("b")):
        assert _header.parse_header(buf, 4).names == ["a"]
    with pytest.raises(ValueError):
        _header.parse_header(head, -1)


# ---------------------------------------------------------------------------------------
# agreement with the reference on files it writes
# ---------------------------------------------------------------------------------------


def _reference_view(path):
    from safetensors import safe_open

    with safe_open(path, "np") as f:
        keys = list(f.keys())
        infos = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in keys}
        meta = f.metadata()
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    offsets = {
        k: tuple(v["data_offsets"]) for k, v in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"
    }
    return keys, infos, meta, offsets


def _assert_same_as_reference(path):
    keys, infos, meta, offsets = _reference_view(path)
    h = read_header(path)
    assert h.keys() == keys
    assert {k: (h[k].dtype, h[k].shape) for k in h} == infos
    assert {k: h[k].data_offsets for k in h} == offsets
    assert h.metadata == meta
    assert h.data_size == (max(e for _, e in offsets.values()) if offsets else 0)


def test_reference_numpy_files(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {}
    for i, dt in enumerate(
        [
            "bool",
            "uint8",
            "int8",
            "int16",
            "uint16",
            "float16",
            "int32",
            "uint32",
            "float32",
            "float64",
            "int64",
            "uint64",
            "complex64",
        ]
    ):
        shape = tuple(rng.integers(0, 4, size=i % 4))
        tensors[f"t.{dt}"] = np.zeros(shape, dtype=dt)
    path = tmp_path / "np.safetensors"
    save_file(tensors, path, metadata={"format": "np", "ü": "✓"})
    _assert_same_as_reference(path)
    save_file({}, path)
    _assert_same_as_reference(path)


def test_reference_torch_files(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    tensors = {}
    for name in [
        "bool",
        "uint8",
        "int8",
        "int16",
        "uint16",
        "float16",
        "bfloat16",
        "int32",
        "uint32",
        "float32",
        "float64",
        "int64",
        "uint64",
        "complex64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e8m0fnu",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    ]:
        dt = getattr(torch, name, None)
        if dt is not None:
            tensors[f"w.{name}"] = torch.zeros((2, 3)).to(dt)
            tensors[f"s.{name}"] = torch.zeros(()).to(dt)
    if getattr(torch, "float4_e2m1fn_x2", None) is not None:
        tensors["w.f4"] = torch.zeros((3, 4), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    path = tmp_path / "pt.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    _assert_same_as_reference(path)


# ---------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def regions_oracle(begins, ends, data_size) -> bool:
    """O(n^2): non-empty regions tile [0, data_size) exactly without overlapping; empty
    regions sit on a boundary, never strictly inside a region or past the end."""
    n = len(begins)
    if any(e < b for b, e in zip(begins, ends, strict=True)):
        return False
    full = [(b, e) for b, e in zip(begins, ends, strict=True) if e > b]
    for i in range(len(full)):
        b, e = full[i]
        if b < 0 or e > data_size:
            return False
        for j in range(i):
            if full[j][0] < e and b < full[j][1]:
                return False
    if sum(e - b for b, e in full) != data_size:
        return False
    for k in range(n):
        p = begins[k]
        if ends[k] == p:
            if not 0 <= p <= data_size or any(b < p < e for b, e in full):
                return False
    return True


@st.composite
def region_sets(draw):
    sizes = draw(st.lists(st.integers(0, 6), max_size=10))
    begins, ends, pos = [], [], 0
    for s in sizes:
        begins.append(pos)
        ends.append(pos + s)
        pos += s
    data_size = pos
    perm = draw(st.permutations(range(len(sizes))))
    begins = [begins[i] for i in perm]
    ends = [ends[i] for i in perm]
    for _ in range(draw(st.integers(0, 2))):  # perturbations, to get rejections too
        kind = draw(st.sampled_from(["begin", "end", "size", "add", "drop"]))
        if kind == "size":
            data_size = max(0, data_size + draw(st.integers(-3, 3)))
        elif kind == "add":
            p = draw(st.integers(0, data_size + 2))
            begins.append(p)
            ends.append(p + draw(st.integers(0, 3)))
        elif begins:
            i = draw(st.integers(0, len(begins) - 1))
            if kind == "drop":
                del begins[i], ends[i]
            elif kind == "begin":
                begins[i] = max(0, begins[i] + draw(st.integers(-3, 3)))
            else:
                ends[i] = max(0, ends[i] + draw(st.integers(-3, 3)))
    return begins, ends, data_size


@FAST
@given(region_sets())
def test_check_regions_matches_oracle(regions):
    begins, ends, data_size = regions
    expected = regions_oracle(begins, ends, data_size)
    names = [f"t{i}" for i in range(len(begins))]
    try:
        order = _header.check_regions(np.array(begins, np.int64), np.array(ends, np.int64), data_size, names)
    except HeaderError as err:
        assert not expected
        assert err.reason in {"InvalidOffset", "MetadataIncompleteBuffer", "TensorInvalidInfo"}
        assert all(t in names for t in err.tensors)
    else:
        assert expected
        assert sorted(order.tolist()) == list(range(len(begins)))
        keys = [(begins[i], ends[i], i) for i in order.tolist()]
        assert keys == sorted(keys)


@pytest.mark.parametrize("n", [31, 32, 33, 64, 65, 100, 1000, 4099])
def test_check_regions_order_of_large_sets(n):
    """Sets beyond the insertion-sort runs exercise the merge passes; many zero-size
    regions share offsets, so ties on (begin, end) are broken by row."""
    rng = np.random.default_rng(n)
    sizes = rng.integers(0, 3, n)
    ends = np.cumsum(sizes)
    begins = ends - sizes
    perm = rng.permutation(n)
    b, e = begins[perm], ends[perm]
    order = _header.check_regions(b, e, int(ends[-1]))
    np.testing.assert_array_equal(order, np.lexsort((np.arange(n), e, b)))
    e2 = e.copy()
    e2[perm.argmax()] += 1  # one region too long: an overlap (or a longer data region) somewhere
    with pytest.raises(HeaderError):
        _header.check_regions(b, e2, int(ends[-1]))


def test_check_regions_inputs():
    order = _header.check_regions([4, 0], [8, 4], 8)
    assert order.tolist() == [1, 0] and order.dtype == np.intp
    assert _header.check_regions(
        np.array([0], np.uint64), np.array([2**63 + 1], np.uint64), 2**63 + 1
    ).tolist() == [0]
    with pytest.raises(HeaderError) as info:
        _header.check_regions(np.array([-4, 0]), np.array([0, 4]), 4, ["x", "y"])
    assert info.value.reason == "TensorInvalidInfo" and info.value.tensors == ("x",)
    with pytest.raises(ValueError):
        _header.check_regions([0], [1, 2], 2)
    with pytest.raises(TypeError):
        _header.check_regions([0.0], [1.0], 1)
    assert _header.check_regions([], [], 0).tolist() == []


# names: any text without lone surrogates (JSON cannot carry those as UTF-8)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
SHORT_ESC = {
    '"': '\\"',
    "\\": "\\\\",
    "/": "\\/",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}


def _json_str(s: str, rnd) -> str:
    """A JSON string literal for ``s`` with randomly chosen (valid) escape forms."""
    out = ['"']
    for ch in s:
        cp = ord(ch)
        forms = []
        if ch not in '"\\' and cp >= 0x20:
            forms.append(ch)
        if ch in SHORT_ESC:
            forms.append(SHORT_ESC[ch])
        if cp < 0x10000:
            forms.append(f"\\u{cp:04x}" if rnd.random() < 0.5 else f"\\u{cp:04X}")
        else:
            hi, lo = 0xD800 + ((cp - 0x10000) >> 10), 0xDC00 + ((cp - 0x10000) & 0x3FF)
            forms.append(f"\\u{hi:04x}\\u{lo:04X}")
        out.append(rnd.choice(forms))
    out.append('"')
    return "".join(out)


def _ws(rnd) -> str:
    return rnd.choice(["", "", "", " ", "\n", "\t", "\r\n  "])


def _json_obj(pairs, rnd) -> str:
    if not pairs:
        return "{" + _ws(rnd) + "}"
    body = ",".join(_ws(rnd) + k + _ws(rnd) + ":" + _ws(rnd) + v + _ws(rnd) for k, v in pairs)
    return "{" + body + "}"


@st.composite
def headers(draw):
    """(header text, data size, expected names, dtypes, shapes, offsets, metadata)."""
    rnd = draw(st.randoms(use_true_random=False))
    specs = draw(
        st.dictionaries(
            TEXT.filter(lambda s: s != "__metadata__"),
            st.tuples(st.sampled_from(NAMES), st.lists(st.integers(0, 4), max_size=3)),
            max_size=6,
        )
    )
    meta = draw(st.none() | st.dictionaries(TEXT, TEXT, max_size=3))
    names = list(specs)
    sizes = {}
    for name, (dtype, shape) in list(specs.items()):
        bits = math.prod(shape) * BITS[NAMES.index(dtype)]
        if bits % 8:
            specs[name] = ("U8", shape)
            bits = math.prod(shape) * 8
        sizes[name] = bits // 8
    offsets, pos = {}, 0
    for name in draw(st.permutations(names)):  # file order differs from header order
        offsets[name] = (pos, pos + sizes[name])
        pos += sizes[name]
    pairs = []
    for name in names:
        dtype, shape = specs[name]
        fields = [
            (_json_str("dtype", rnd), _json_str(dtype, rnd)),
            (_json_str("shape", rnd), "[" + ",".join(_ws(rnd) + str(d) + _ws(rnd) for d in shape) + "]"),
            (_json_str("data_offsets", rnd), "[" + ",".join(_ws(rnd) + str(o) for o in offsets[name]) + "]"),
        ]
        rnd.shuffle(fields)
        pairs.append((_json_str(name, rnd), _json_obj(fields, rnd)))
    if meta is not None:
        mpairs = [(_json_str(k, rnd), _json_str(v, rnd)) for k, v in meta.items()]
        pairs.insert(rnd.randint(0, len(pairs)), (_json_str("__metadata__", rnd), _json_obj(mpairs, rnd)))
    text = _json_obj(pairs, rnd) + rnd.choice(["", " " * rnd.randint(1, 7), "\n"])
    return text, pos


@settings(FAST, max_examples=60)
@given(headers())
def test_scanner_matches_json_loads(generated):
    text, data_size = generated
    raw = text.encode("utf-8")
    expected = json.loads(text, object_pairs_hook=list)
    table = _header.parse_header(raw, data_size)
    tensors = [(k, v) for k, v in expected if k != "__metadata__"]
    meta = [v for k, v in expected if k == "__metadata__"]
    assert table.names == [k for k, _ in tensors]
    assert table.metadata == (dict(meta[0]) if meta else None)
    for row, (_, fields) in enumerate(tensors):
        f = dict(fields)
        assert NAMES[table.codes[row]] == f["dtype"]
        assert table.shapes[row] == tuple(f["shape"])
        assert (table.begins[row], table.ends[row]) == tuple(f["data_offsets"])
    assert table.header_size == len(raw) and table.data_size == data_size


def _valid_header_bytes() -> tuple[bytes, int]:
    header, size = layout(
        {"a.weight": ("F32", (2, 3)), "b": ("F4", (4,)), "é": ("BF16", ())}, metadata={"k": "v", "x": "ÿ"}
    )
    head = encode_header(header)
    head = head.replace(b"\xc3\xa9", b"\\u00e9", 1)
    return head + b"    ", size


@FAST
@given(st.data())
def test_fuzz_mutations_only_raise_header_error(data):
    head, size = _valid_header_bytes()
    buf = bytearray(head)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        i = data.draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[i] = data.draw(
                st.sampled_from(b'{}[]":,\\0123456789-.eE uU\x00\x1f\x7f\x80\xbf\xc0\xed\xf4\xff')
            )
        elif op == "insert":
            buf[i:i] = data.draw(st.binary(max_size=4))
        elif op == "delete":
            del buf[i : i + data.draw(st.integers(1, 4))]
        else:
            del buf[i:]
    try:
        table = _header.parse_header(bytes(buf), size + data.draw(st.integers(-2, 2)))
    except HeaderError as err:
        assert err.reason in HEADER_REASONS
        assert err.position is None or 0 <= err.position <= len(buf)
    else:
        assert len(table.names) == len(table.shapes)
    file = build_file(bytes(buf), size, pad=False)
    try:
        parse_buffer(file)
    except HeaderError:
        pass


@FAST
@given(st.binary(min_size=1, max_size=6))
def test_utf8_position_matches_python(junk):
    """Arbitrary bytes inside a name: rejected iff Python's strict UTF-8 decoder rejects
    them (or they hold a control character, quote or backslash), at the same byte."""
    head = b'{"n' + junk + b'":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        with pytest.raises(HeaderError) as info:
            _header.parse_header(head, 0)
        if info.value.reason == "InvalidHeader":
            assert info.value.position == exc.start
        else:  # a syntax error met before the bad byte
            assert info.value.position < exc.start
        return
    assume(not any(ch in text[3 : 3 + len(junk)] for ch in '"\\') and all(ord(ch) >= 0x20 for ch in text))
    assert _header.parse_header(head, 0).names == ["n" + junk.decode("utf-8")]


# ---------------------------------------------------------------------------------------
# the GIL
# ---------------------------------------------------------------------------------------


def test_region_check_releases_the_gil():
    """While check_regions sorts a few million regions, another Python thread keeps
    running (see tests/gil.py)."""
    n = 2_000_000
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 8, n)
    ends = np.cumsum(sizes)
    begins = ends - sizes
    perm = rng.permutation(n)  # unsorted: the qsort path
    begins, ends = np.ascontiguousarray(begins[perm]), np.ascontiguousarray(ends[perm])
    data_size = int(ends.max())
    assert ticks_during(lambda: _header.check_regions(begins, ends, data_size)) > 100


def test_scanner_releases_the_gil():
    """The same for phase 1 of the parser: a long non-ASCII metadata string (UTF-8 checked
    byte by byte), then a syntax error at the very end, so no Python objects are built."""
    head = b'{"__metadata__":{"k":"' + "é".encode() * 40_000_000 + b'"}} x'
    assert ticks_during(lambda: pytest.raises(HeaderError, _header.parse_header, head, 0)) > 100


def test_header_class_is_exported():
    import engine
    from engine.apps import entry_points

    # the root's read_header also takes a URL, and reads a local file with this module's function
    assert engine.read_header is entry_points.read_header and engine.Header is Header and engine.TensorInfo is TensorInfo
    assert engine.MAX_HEADER_SIZE == MAX_HEADER_SIZE == 100_000_000


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=12,
)


def _finite_float(text: str) -> float:
    """``float(text)``, refusing what overflows a double (the reference's parser refuses it)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is out of range")
    return value


def _entry_with(field: str) -> bytes:
    return ('{"a":{"dtype":"F32","extra":' + field + ',"shape":[1],"data_offsets":[0,4]}}').encode()


@settings(FAST, max_examples=80)
@given(JSON_VALUES)
def test_unknown_fields_are_ignored(value):
    """Any JSON value under a field the format does not define is skipped, as the reference
    does; strict mode rejects the field."""
    raw = _entry_with(json.dumps(value, ensure_ascii=bool(value) and isinstance(value, str)))
    table = _header.parse_header(raw, 4)
    assert table.names == ["a"] and table.shapes[0] == (1,) and (table.begins[0], table.ends[0]) == (0, 4)
    with pytest.raises(HeaderError) as info:
        _header.parse_header(raw, 4, strict=True)
    assert info.value.reason == "InvalidHeaderDeserialization" and "extra" in str(info.value)


@settings(FAST, max_examples=300)
@given(st.text(alphabet='{}[]",:-+.eE0123 tfalsnu\\', max_size=14))
def test_ignored_values_are_checked_like_json_loads(junk):
    """An ignored field's value is still strict JSON: accepted exactly when json.loads
    accepts it (no NaN/Infinity in the alphabet: Python's extensions)."""
    try:
        json.loads(junk, parse_float=_finite_float)
        valid = bool(junk.strip())
    except ValueError:
        valid = False
    raw = _entry_with(junk)
    if valid:
        assert _header.parse_header(raw, 4).names == ["a"]
    else:
        with pytest.raises(HeaderError) as info:
            _header.parse_header(raw, 4)
        assert info.value.reason == "InvalidHeaderDeserialization"


def test_ignored_values_nest_at_most_125_levels():
    assert _header.parse_header(_entry_with("[" * 125 + "]" * 125), 4).names == ["a"]
    with pytest.raises(HeaderError) as info:
        _header.parse_header(_entry_with("[" * 126 + "]" * 126), 4)
    assert "125" in str(info.value)
    # a hostile depth fails fast, on a fixed-size stack
    with pytest.raises(HeaderError):
        _header.parse_header(_entry_with("[" * 5_000_000), 4)


def test_unrepresentable_shapes_open(st_file):
    """Valid headers whose tensors numpy or torch cannot build still open; the shape is
    readable, and only building the tensor is an error naming the file and tensor."""
    import engine

    cases = {
        "rank1000": ('{"a":{"dtype":"F32","shape":[' + ",".join(["1"] * 1000) + '],"data_offsets":[0,4]}}', 4),
        "huge-empty": ('{"a":{"dtype":"F32","shape":[0,18446744073709551615],"data_offsets":[0,0]}}', 0),
    }
    for text, size in cases.values():
        path = st_file(text.encode(), b"\0" * size)
        with engine.safe_open(path, framework="np") as f:
            shape = f.get_slice("a").get_shape()
            assert shape == list(json.loads(text)["a"]["shape"])
            with pytest.raises(engine.UnrepresentableTensorError) as info:
                f.get_tensor("a")
            assert info.value.path == str(path) and info.value.tensors == ("a",)
            assert isinstance(info.value, ValueError) and len(str(info.value)) < 400


# ---------------------------------------------------------------------------------------
# ignored fields: the reference's JSON parser (serde_json) limits, byte for byte
# ---------------------------------------------------------------------------------------

#: (value of an ignored tensor-entry field, accepted by the reference)
IGNORED_VALUE_LIMITS = [
    ("[" * 125 + "]" * 125, True),  # 125 levels + the header object + the entry = 127
    ("[" * 126 + "]" * 126, False),  # serde_json stops at its 128th level
    ('{"k":' * 124 + "{}" + "}" * 124, True),
    ('{"k":' * 125 + "{}" + "}" * 125, False),
    ("[" * 124 + "1e400" + "]" * 124, False),
    ("1e400", False),
    ("-1e400", False),
    ('{"k":[1e400]}', False),
    ("1" + "0" * 309, False),  # an integer past 64 bits is read as a double: 1e309
    ("1e99999999999999999999", False),  # the exponent overflows 32 bits
    ("1.7976931348623158e308", False),  # serde_json's arithmetic overflows where rounding would not
    ("1e308", True),
    ("1.7976931348623157e308", True),
    ("1" + "0" * 308, True),  # 1e308 as an integer
    ("1e-400", True),  # underflow is zero, not an error
    ("1e-99999999999999999999", True),
    ("0e99999999999999999999", True),
    ("0.0e9999", True),
    ("18446744073709551616", True),  # past u64, a double
    ("-9223372036854775809", True),
    ("1" * 400 + "e-100", True),
]


def _file_with(value: str) -> bytes:
    raw = _entry_with(value)
    return struct.pack("<Q", len(raw)) + raw + b"\0" * 4


@pytest.mark.parametrize("value,accepted", IGNORED_VALUE_LIMITS, ids=lambda v: str(v)[:24])
def test_ignored_value_limits_match_the_reference(value, accepted):
    """Numbers out of a double's range and nesting past serde_json's recursion limit are
    refused, as by the reference, with the engine's own error; the values next to each
    limit are accepted, as by the reference."""
    from safetensors.numpy import load as ref_load

    data = _file_with(value)
    if accepted:
        assert parse_buffer(data).names == ["a"]
        assert list(ref_load(data)) == ["a"]
    else:
        with pytest.raises(HeaderError) as info:
            parse_buffer(data)
        assert info.value.reason == "InvalidHeaderDeserialization" and info.value.tensors == ("a",)
        with pytest.raises(Exception, match="out of range|recursion limit"):
            ref_load(data)


@settings(FAST, max_examples=300)
@given(st.integers(1, 40), st.integers(0, 40), st.integers(270, 330), st.booleans())
def test_ignored_large_numbers_agree_with_the_reference(digits, point, exponent, negative):
    """Numbers near a double's largest value: accepted exactly when the reference accepts them."""
    from safetensors.numpy import load as ref_load

    mantissa = "17976931348623157081452742373170435679807"[:digits]
    point = min(point, digits)
    text = ("-" if negative else "") + mantissa[:point] + ("." + mantissa[point:] if point < digits else "")
    text = (text if point else ("-" if negative else "") + "0." + mantissa) + f"e{exponent}"
    data = _file_with(text)
    try:
        ref_load(data)
        ref_ok = True
    except Exception:  # noqa: BLE001 - the reference raises its own SafetensorError
        ref_ok = False
    try:
        parse_buffer(data)
        ok = True
    except HeaderError:
        ok = False
    assert ok == ref_ok, text


@pytest.mark.parametrize(
    "body, named",
    [
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 4\n", "Git LFS pointer"),
        (b"<!DOCTYPE html><html><body>Sign in</body></html>", "HTML page"),
        (b"  <html><body>502 Bad Gateway</body></html>", "HTML page"),
        (b'{"architectures": ["LlamaForCausalLM"]}', "JSON"),
        (b"hello world, these are not weights\n", "text file"),
    ],
)
def test_files_that_are_not_safetensors_are_named(tmp_path, body, named):
    """A pointer, a page or text saved as .safetensors is named for what it is, not taken for a
    huge header length (no advice to raise max_header_size), by every local reader."""
    import engine
    import engine.numpy

    path = tmp_path / "model.safetensors"
    path.write_bytes(body)
    for call in (
        lambda: read_header(path),
        lambda: parse_buffer(body, path=path),
        lambda: engine.safe_open(path, "np"),
        lambda: engine.numpy.load_file(path),
        lambda: read_header(path, max_header_size=2**64),  # no limit: still not a length
    ):
        with pytest.raises(HeaderError) as info:
            call()
        err = info.value
        assert err.reason == "NotSafetensors" and named in str(err) and str(path) in str(err), str(err)
        assert "max_header_size" not in str(err)


def test_binary_garbage_keeps_the_length_errors():
    """Only text is named as not safetensors: a damaged length keeps the reference's reasons,
    even when its first byte happens to be '<' or '{'."""
    for first in (b"<", b"{", b"v"):
        data = first + b"\xff" * 7 + b"{}"
        with pytest.raises(HeaderError) as info:
            parse_buffer(data)
        assert info.value.reason == "HeaderTooLarge"
    data = struct.pack("<Q", ord("<") + 256) + b"{}"  # a length past the end of a short file
    with pytest.raises(HeaderError) as info:
        parse_buffer(data)
    assert info.value.reason == "InvalidHeaderLength"



# --------------------------------------------------------------------------- a handle's open in C


def test_the_extension_has_the_dtype_rows_of_engine_base():
    """setup.py writes the parser's dtype names and bits from engine.base._dtype_rows: the
    extension and the dtype module agree (a stale build fails here)."""
    assert _header._NAMES == NAMES and _header._BITS == BITS


def test_read_table_reads_what_parse_header_parses(tmp_path):
    import engine.numpy

    path = str(tmp_path / "a.safetensors")
    engine.numpy.save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.int8)}, path,
                           metadata={"k": "v"})
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        table = _header.read_table(fd, size, MAX_HEADER_SIZE, path)
        assert table.items() == read_header(path).table.items() and table.metadata == {"k": "v"}
        # what the full reader must name instead: a length past the file or the limit, a
        # file shorter than the size given (it shrank), a file of fewer than 8 bytes
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        assert _header.read_table(fd, size, n - 1, path) is None
        assert _header.read_table(fd, 7, MAX_HEADER_SIZE, path) is None
        assert _header.read_table(fd, 8 + n - 1, MAX_HEADER_SIZE, path) is None
    finally:
        os.close(fd)
    short = tmp_path / "short.safetensors"
    short.write_bytes(open(path, "rb").read()[:20])
    fd = os.open(short, os.O_RDONLY)
    try:
        assert _header.read_table(fd, size, MAX_HEADER_SIZE, str(short)) is None  # the reads come back short
    finally:
        os.close(fd)


def test_read_table_names_the_file_in_a_parse_error(tmp_path):
    path = tmp_path / "bad.safetensors"
    body = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 5]}}'
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * 5)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(HeaderError) as info:
            _header.read_table(fd, os.fstat(fd).st_size, MAX_HEADER_SIZE, str(path))
    finally:
        os.close(fd)
    assert info.value.path == str(path) and info.value.reason == "TensorInvalidInfo"


def test_open_regular_in_c_opens_files_and_leaves_the_rest_to_the_checked_open(tmp_path):
    from engine.base import _files

    path = tmp_path / "a.bin"
    path.write_bytes(b"12345678")
    for name in (str(path), os.fsencode(path)):
        fd = _header.open_regular(name)
        try:
            assert os.pread(fd, 8, 0) == b"12345678" and os.get_blocking(fd) and not os.get_inheritable(fd)
        finally:
            os.close(fd)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    for bad in (str(tmp_path / "missing"), str(fifo), str(loop), "a\0b"):
        with pytest.raises((OSError, ValueError)) as ours:
            _header.open_regular(bad)
        with pytest.raises((OSError, ValueError)) as checked:
            _files.open_regular(bad)
        assert type(ours.value) is type(checked.value) and str(ours.value) == str(checked.value), bad
        assert getattr(ours.value, "reason", None) == getattr(checked.value, "reason", None)


def test_the_verify_flag_is_the_one_verification_sets():
    from engine.format.verification import verification, verifying

    assert verifying is _header.verifying and _header.verifying() is True
    with verification(False):
        assert _header.verifying() is False
        with verification(None):
            assert _header.verifying() is False
    assert _header.verifying() is True
