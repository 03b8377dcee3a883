"""engine.writing.writer against the reference ``safetensors`` package (0.8.0).

Byte identity is checked with at most one metadata key: the reference writes metadata in
Rust HashMap order, so with more keys only the parsed content can match.  Files are read
back with the reference, not with our reader.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
import warnings

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as ref_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine.base.dtypes import NAMES, from_numpy
from engine.errors import (
    HeaderError,
    SerializationError,
    SerializationTypeError,
    SharedTensorsError,
    WriteError,
)
from engine.format.header import read_header
from engine.writing import _file_writes, writer

try:
    import safetensors.torch as ref_torch
    import torch
except ImportError:  # the numpy half of the suite runs without torch
    torch = ref_torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

# every numpy dtype the reference writes
STD_DTYPES = [
    np.dtype(n)
    for n in (
        "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32",
        "int64", "uint64", "float16", "float32", "float64", "complex64",
    )
]  # fmt: skip
ML_DTYPES = [
    np.dtype(getattr(ml_dtypes, n))
    for n in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
]
NUMPY_DTYPES = STD_DTYPES + ML_DTYPES

TORCH_DTYPES = [
    n
    for n in (
        "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, n)
]  # fmt: skip

SHAPES = [(), (0,), (7,), (2, 3), (3, 0, 2)]


def random_array(dtype, shape, seed=0) -> np.ndarray:
    """Random bytes as ``dtype``; bools kept 0/1."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype.kind == "b":
        return rng.integers(0, 2, size=n).astype(bool).reshape(shape)
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype.newbyteorder("=")).reshape(shape).astype(dtype)


def random_tensor(dtype_name, shape, seed=0):
    dtype = getattr(torch, dtype_name)
    if dtype == torch.bool:
        return torch.from_numpy(random_array(bool, shape, seed))
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, size=n * itemsize, dtype=np.uint8))
    return raw.view(dtype).reshape(shape)


def little_endian_bytes(a: np.ndarray) -> bytes:
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.tobytes()


def parse(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n])


def only_entry(directory) -> list[str]:
    return sorted(os.listdir(directory))


# --------------------------------------------------------------------------- byte identity


@pytest.mark.parametrize("metadata", [None, {"format": "np"}])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
def test_numpy_matches_reference(dtype, shape, metadata):
    tensors = {"t": random_array(dtype, shape), "u": random_array(dtype, (3,), seed=1)}
    assert writer.save(tensors, metadata) == ref_np.save(tensors, metadata)


@pytest.mark.parametrize("dtype", [d for d in STD_DTYPES if d.itemsize > 1], ids=str)
def test_big_endian_numpy_matches_reference(dtype):
    a = random_array(dtype.newbyteorder(">"), (5, 3))
    assert a.dtype.byteorder == ">"
    tensors = {"be": a, "scalar": random_array(dtype.newbyteorder(">"), ())}
    ours = writer.save(tensors)
    assert ours == ref_np.save(tensors)
    assert ref_np.load(ours)["be"].tobytes() == little_endian_bytes(a)


@needs_torch
@pytest.mark.parametrize(
    "dtype, shape",
    [(d, s) for d in TORCH_DTYPES for s in [(), (0, 3), (2, 3)] if not (d == "float4_e2m1fn_x2" and s == ())],
    ids=str,
)  # a packed FP4 scalar cannot be written: tested on its own below
def test_torch_matches_reference(dtype, shape):
    tensors = {"t": random_tensor(dtype, shape), "v": random_tensor(dtype, (4,), seed=1)}
    assert writer.save(tensors) == ref_torch.save(tensors)
    assert writer.save(tensors, {"k": "v"}) == ref_torch.save(tensors, {"k": "v"})


def test_many_mixed_tensors_match_reference():
    rng = np.random.default_rng(1)
    tensors = {}
    for i in range(300):
        dtype = NUMPY_DTYPES[rng.integers(len(NUMPY_DTYPES))]
        shape = tuple(int(s) for s in rng.integers(0, 4, size=rng.integers(0, 3)))
        tensors[f"layer.{rng.integers(1000)}.{i}"] = random_array(dtype, shape, seed=i)
    assert writer.save(tensors) == ref_np.save(tensors)
    assert writer.save(tensors, {"a": "b"}) == ref_np.save(tensors, {"a": "b"})


UNICODE_NAMES = [
    "é", "z", "Z", "日本語", "😀.weight", 'quote"d', "back\\slash", "new\nline", "tab\t", "\x00nul",
    "\x01\x1f", "\x7fdel", "\u2028sep", "\ufeffbom", "a/b.c", "", " ", "\U0010ffff",
]  # fmt: skip


def test_unicode_and_escaped_names_match_reference():
    tensors = {name: random_array(np.float32, (2,), seed=i) for i, name in enumerate(UNICODE_NAMES)}
    meta = {'ключ\n"': "значение\\\x00😀"}
    ours = writer.save(tensors, meta)
    assert ours == ref_np.save(tensors, meta)
    assert set(ref_np.load(ours)) == set(UNICODE_NAMES)


def test_no_tensors_matches_reference():
    assert writer.save({}) == ref_np.save({}) == b"\x08" + b"\x00" * 7 + b"{}      "
    assert writer.save({}, {"a": "b"}) == ref_np.save({}, {"a": "b"})


def test_empty_metadata():
    tensors = {"t": random_array(np.float32, (2,))}
    # with tensors the reference writes an empty "__metadata__" object: so do we
    assert writer.save(tensors, {}) == ref_np.save(tensors, {})
    assert parse(writer.save(tensors, {}))["__metadata__"] == {}
    # without tensors the reference writes invalid JSON that it cannot read back itself
    theirs = ref_np.save({}, {})
    with pytest.raises(Exception, match="JSON"):
        safetensors.deserialize(theirs)
    ours = writer.save({}, {})
    assert parse(ours) == {"__metadata__": {}}
    assert safetensors.deserialize(ours) == []


def test_metadata_with_many_keys_in_caller_order():
    tensors = {"b": random_array(np.int32, (3,)), "a": random_array(np.float16, (2, 2))}
    meta = {f"key{i}": f"value {i}" for i in (5, 1, 9, 3, 0)}
    ours = writer.save(tensors, meta)
    header = parse(ours)
    assert list(header) == ["__metadata__", "b", "a"]  # I32 (code 15) before F16 (code 13)
    assert list(header["__metadata__"]) == list(meta)
    assert header == parse(ref_np.save(tensors, meta))
    assert ours[len(ours) - 16 :] == ref_np.save(tensors, meta)[-16:]


names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6).filter(lambda s: s != "__metadata__")


@st.composite
def arrays(draw):
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    if dtype.itemsize > 1 and dtype in STD_DTYPES and draw(st.booleans()):
        dtype = dtype.newbyteorder(">")
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
    return random_array(dtype, shape, seed=draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(names, arrays(), max_size=8))
def test_property_matches_reference_and_round_trips(tensors):
    ours = writer.save(tensors)
    assert ours == ref_np.save(tensors)
    back = {name: info for name, info in safetensors.deserialize(ours)}
    assert set(back) == set(tensors)
    for name, a in tensors.items():
        assert back[name]["dtype"] == NAMES[from_numpy(a.dtype)]
        assert tuple(back[name]["shape"]) == a.shape
        assert bytes(back[name]["data"]) == little_endian_bytes(a)
    if all(a.dtype.newbyteorder("=") in STD_DTYPES for a in tensors.values()):
        loaded = ref_np.load(ours)
        for name, a in tensors.items():
            assert loaded[name].dtype == a.dtype.newbyteorder("=")
            assert loaded[name].tobytes() == little_endian_bytes(a)


# --------------------------------------------------------------------------- files and streaming


def test_save_file_equals_save(tmp_path):
    tensors = {"a": random_array(np.float32, (4, 4)), "b": random_array(ml_dtypes.bfloat16, (3,))}
    path = tmp_path / "m.safetensors"
    writer.save_file(tensors, path, {"x": "y"})
    data = writer.save(tensors, {"x": "y"})
    assert type(data) is bytes
    assert path.read_bytes() == data
    assert only_entry(tmp_path) == ["m.safetensors"]
    loaded = ref_np.load_file(path)
    assert loaded["a"].tobytes() == tensors["a"].tobytes()


@pytest.mark.parametrize("chunk", [8, 24])
def test_small_chunks_give_the_same_bytes(tmp_path, monkeypatch, chunk):
    tensors = {
        "le": random_array(np.float64, (9, 5)),
        "be": random_array(np.dtype(">c8"), (7,)),
        "bf": random_array(ml_dtypes.bfloat16, (13,)),
        "empty": random_array(np.int16, (0, 4)),
    }
    if torch is not None:
        tensors["t"] = random_tensor("float32", (5, 3))
    expected = writer.save(tensors)
    monkeypatch.setattr(writer, "_CHUNK", chunk)
    assert writer.save(tensors) == expected
    writer.save_file(tensors, tmp_path / "m")
    assert (tmp_path / "m").read_bytes() == expected


@needs_torch
def test_writes_come_straight_from_tensor_memory(tmp_path, monkeypatch):
    """No copy: every write after the header is a slice of the array's own memory."""
    a = random_array(np.float32, (64,))
    t = random_tensor("bfloat16", (32,))
    pieces = []
    real = _file_writes.write_at

    def spy(fd, data, offset):
        pieces.append(data)
        return real(fd, data, offset)

    monkeypatch.setattr(_file_writes, "write_at", spy)
    monkeypatch.setattr(writer, "_CHUNK", 64)
    monkeypatch.setattr(writer, "_SMALL", 0)  # every tensor on its own, in 64-byte slices
    writer.save_file({"a": a, "t": t}, tmp_path / "m")
    tensor_pieces = pieces[1:]
    assert all(len(p) <= 64 for p in tensor_pieces)
    assert sum(len(p) for p in tensor_pieces) == a.nbytes + t.numel() * 2
    for p in tensor_pieces:
        assert np.shares_memory(np.frombuffer(p, np.uint8), a) or np.shares_memory(
            np.frombuffer(p, np.uint8), t.view(torch.uint8).numpy()
        )


def test_fsync(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    tensors = {"a": random_array(np.int8, (5,))}
    writer.save_file(tensors, tmp_path / "synced")
    assert len(calls) == 2  # the file, then its directory
    calls.clear()
    writer.save_file(tensors, tmp_path / "unsynced", fsync=False)
    assert calls == []
    assert (tmp_path / "unsynced").read_bytes() == ref_np.save(tensors)


def test_mode_of_new_and_existing_files(tmp_path):
    tensors = {"a": random_array(np.int8, (5,))}
    old = os.umask(0o027)
    try:
        writer.save_file(tensors, tmp_path / "new")
        ref_np.save_file(tensors, tmp_path / "by-reference")
        os.umask(0o277)
        writer.save_file(tensors, tmp_path / "new-277")
    finally:
        os.umask(old)
    # owner only, as the reference writes a new file; the umask still narrows it
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "by-reference").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "new-277").st_mode) == 0o400

    existing = tmp_path / "existing"
    existing.write_bytes(b"old")
    os.chmod(existing, 0o604)
    writer.save_file(tensors, existing)
    assert stat.S_IMODE(os.stat(existing).st_mode) == 0o604
    assert existing.read_bytes() == ref_np.save(tensors)


def test_umask_read_matches_os_umask():
    old = os.umask(0o037)
    try:
        assert writer._umask() == 0o037
    finally:
        os.umask(old)


def test_symlink_target_is_replaced(tmp_path):
    target = tmp_path / "real.safetensors"
    target.write_bytes(b"old")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    tensors = {"a": random_array(np.float32, (3,))}
    writer.save_file(tensors, link)
    assert link.is_symlink()
    assert target.read_bytes() == ref_np.save(tensors)


# --------------------------------------------------------------------------- atomicity


def fail_on_write(monkeypatch, n, exc):
    """Make the n-th write system call raise ``exc`` (1 = the header; small tensors that
    follow each other go out together in one ``pwritev``)."""
    count = [0]

    def wrap(real):
        def write(fd, data, offset):
            count[0] += 1
            if count[0] == n:
                raise exc
            return real(fd, data, offset)

        return write

    monkeypatch.setattr(_file_writes, "write_at", wrap(_file_writes.write_at))
    monkeypatch.setattr(_file_writes, "writev_at", wrap(_file_writes.writev_at))


TWO_TENSORS = {"first": random_array(np.float32, (8,)), "second": random_array(np.float32, (4,))}


@pytest.mark.parametrize("fresh", [False, True], ids=["overwrite", "fresh"])
def test_disk_full_mid_write_leaves_old_file(tmp_path, monkeypatch, fresh):
    dest = tmp_path / "m.safetensors"
    if not fresh:
        dest.write_bytes(b"previous contents")
    fail_on_write(monkeypatch, 2, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(WriteError) as info:
        writer.save_file(TWO_TENSORS, dest)
    err = info.value
    assert isinstance(err, OSError)
    assert err.errno == errno.ENOSPC
    assert isinstance(err.__cause__, OSError)
    assert err.path == str(dest) and str(dest) in str(err)
    assert "'second'" in str(err)
    if fresh:
        assert only_entry(tmp_path) == []
    else:
        assert only_entry(tmp_path) == ["m.safetensors"]
        assert dest.read_bytes() == b"previous contents"


@pytest.mark.parametrize("fresh", [False, True], ids=["overwrite", "fresh"])
def test_interrupt_mid_write_is_reraised_and_cleaned_up(tmp_path, monkeypatch, fresh):
    dest = tmp_path / "m.safetensors"
    if not fresh:
        dest.write_bytes(b"previous contents")
    fail_on_write(monkeypatch, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        writer.save_file(TWO_TENSORS, dest)
    assert only_entry(tmp_path) == ([] if fresh else ["m.safetensors"])
    if not fresh:
        assert dest.read_bytes() == b"previous contents"


def test_zero_length_write_is_disk_full(tmp_path, monkeypatch):
    monkeypatch.setattr(_file_writes, "write_at", lambda fd, data, offset: 0)
    monkeypatch.setattr(_file_writes, "writev_at", lambda fd, views, offset: 0)
    with pytest.raises(WriteError) as info:
        writer.save_file(TWO_TENSORS, tmp_path / "m")
    assert info.value.errno == errno.ENOSPC
    assert only_entry(tmp_path) == []


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_failure_while_finishing(tmp_path, monkeypatch, step):
    dest = tmp_path / "m.safetensors"
    dest.write_bytes(b"previous contents")

    def boom(*args):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, step, boom)
    with pytest.raises(WriteError) as info:
        writer.save_file(TWO_TENSORS, dest)
    assert info.value.errno == errno.EIO
    monkeypatch.undo()
    assert only_entry(tmp_path) == ["m.safetensors"]
    assert dest.read_bytes() == b"previous contents"


def test_missing_directory_is_a_write_error(tmp_path):
    with pytest.raises(WriteError) as info:
        writer.save_file(TWO_TENSORS, tmp_path / "nope" / "m")
    assert info.value.errno == errno.ENOENT
    assert isinstance(info.value.__cause__, FileNotFoundError)
    # the directory is named, not the hidden temporary file the writer would have made there
    assert f"no such directory to write into: '{tmp_path / 'nope'}'" in str(info.value)
    assert ".tmp" not in str(info.value)


# --------------------------------------------------------------------------- rejections


def _arr(*shape):
    return random_array(np.float32, shape or (4,))


base = np.arange(12, dtype=np.float32)

REJECTIONS = {
    "metadata-name": ({"__metadata__": _arr()}, None, "InvalidTensorName", "__metadata__"),
    "non-string-name": ({1: _arr()}, None, "InvalidTensorName", "1"),
    "lone-surrogate": ({"bad\ud800": _arr()}, None, "InvalidTensorName", "bad"),
    "numpy-transposed": ({"t": _arr(3, 4).T}, None, "NonContiguous", "t"),
    "numpy-strided": ({"s": base[::2]}, None, "NonContiguous", "s"),
    "metadata-key": ({"a": _arr()}, {1: "v"}, "InvalidMetadata", "1"),
    "metadata-value": ({"a": _arr()}, {"k": 2}, "InvalidMetadata", "2"),
    "metadata-not-mapping": ({"a": _arr()}, [("k", "v")], "InvalidMetadata", "list"),
    "numpy-complex128": ({"c": np.zeros(2, np.complex128)}, None, "InvalidDtype", "c"),
    "numpy-object": ({"o": np.array([None])}, None, "InvalidDtype", "o"),
    "numpy-float4": ({"f4": np.zeros(2, ml_dtypes.float4_e2m1fn)}, None, "InvalidDtype", "f4"),
    "not-a-tensor": ({"l": [1.0, 2.0]}, None, "UnsupportedType", "l"),
    "numpy-scalar": ({"s": np.float32(1)}, None, "UnsupportedType", "s"),
    "not-a-mapping": ([("a", _arr())], None, "UnsupportedType", "list"),
}
if torch is not None:
    tbase = torch.arange(12, dtype=torch.float32)
    REJECTIONS.update(
        {
            "torch-transposed": ({"t": torch.zeros(3, 4).t()}, None, "NonContiguous", "t"),
            "torch-shared": ({"whole": tbase, "row": tbase.view(3, 4)[1]}, None, "SharedMemory", "row"),
            "torch-same-tensor": ({"x": tbase, "y": tbase}, None, "SharedMemory", "y"),
            "torch-reshaped-view": ({"x": tbase, "y": tbase.view(3, 4)}, None, "SharedMemory", "y"),
            "torch-part": ({"whole": tbase, "part": tbase[2:5]}, None, "SharedMemory", "part"),
            "sparse": ({"sp": torch.eye(3).to_sparse()}, None, "SparseTensor", "sp"),
            "torch-complex128": ({"c": torch.zeros(2, dtype=torch.complex128)}, None, "InvalidDtype", "c"),
        }
    )
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore")
        REJECTIONS["sparse-csr"] = ({"sp": torch.eye(3).to_sparse_csr()}, None, "SparseTensor", "sp")
    if hasattr(torch, "float4_e2m1fn_x2"):
        fp4_scalar = torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        REJECTIONS["fp4-scalar"] = ({"f4": fp4_scalar}, None, "MisalignedSlice", "f4")


@pytest.mark.parametrize("case", list(REJECTIONS))
def test_rejections(tmp_path, case):
    tensors, metadata, reason, mentioned = REJECTIONS[case]
    for call in (
        lambda: writer.save(tensors, metadata),
        lambda: writer.save_file(tensors, tmp_path / "m", metadata),
    ):
        with pytest.raises(SerializationError) as info:
            call()
        err = info.value
        assert isinstance(err, ValueError)
        assert err.reason == reason
        assert mentioned in str(err)
    assert only_entry(tmp_path) == []  # rejected before any file is created


TYPE_REJECTIONS = ["metadata-key", "metadata-value", "metadata-not-mapping", "non-string-name"]


@pytest.mark.parametrize("case", [*TYPE_REJECTIONS, "metadata-string"])
def test_argument_types_raise_type_error_as_the_reference(tmp_path, case):
    """Metadata that is not str to str and tensor names that are not str raise a TypeError, as
    the reference raises, that is also the engine's SerializationError (a ValueError)."""
    tensors, metadata = REJECTIONS[case][:2] if case in REJECTIONS else ({"a": _arr()}, "x")
    with pytest.raises(TypeError):
        ref_np.save_file(tensors, tmp_path / "ref", metadata)
    import engine.numpy

    for call in (
        lambda: writer.save(tensors, metadata),
        lambda: writer.save_file(tensors, tmp_path / "m", metadata),
        lambda: engine.numpy.save_file(tensors, tmp_path / "m", metadata),
        lambda: engine.numpy.save(tensors, metadata),
    ):
        with pytest.raises(SerializationTypeError) as info:
            call()
        assert isinstance(info.value, TypeError) and isinstance(info.value, SerializationError)
        assert isinstance(info.value, ValueError)
    assert only_entry(tmp_path) == []


@needs_torch
def test_shared_memory_names_every_tensor_involved():
    with pytest.raises(SharedTensorsError) as info:
        writer.save({"a": tbase[:6], "b": tbase[4:8], "c": tbase[10:], "d": tbase[11:]})
    assert sorted(info.value.tensors) == ["a", "b", "c", "d"]
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, SerializationError)


@needs_torch
def test_meta_tensors_have_no_bytes_to_write(tmp_path):
    """A RuntimeError, as torch's own error that the reference lets through."""
    from engine.errors import DeviceError

    for call in (writer.save, lambda t: writer.save_file(t, tmp_path / "m")):
        with pytest.raises(DeviceError, match="Cannot copy out of meta tensor") as info:
            call({"m": torch.empty(3, device="meta")})
        assert isinstance(info.value, RuntimeError) and info.value.reason == "NoData"
    assert only_entry(tmp_path) == []


def test_numpy_arrays_sharing_memory_are_written_as_the_reference_writes_them():
    """numpy arrays have no storages to alias: the same bytes under two names are written
    twice, as the reference's numpy API does (only torch tensors are checked for sharing)."""
    import safetensors.numpy as ref_numpy

    for tensors in ({"whole": base, "part": base[2:5]}, {"x": base, "y": base}, {"x": base, "y": base.reshape(3, 4)}):
        assert writer.save(tensors) == ref_numpy.save(tensors)


ALLOWED = {
    "disjoint-numpy-views": {"lo": base[:6], "hi": base[6:]},
    "zero-size-view": {"whole": base, "empty": base[3:3]},
}
if torch is not None:
    ALLOWED["disjoint-torch-views"] = {"lo": tbase[:6], "hi": tbase[6:]}
    ALLOWED["zero-size-torch"] = {"whole": tbase, "empty": tbase[3:3]}


@pytest.mark.parametrize("case", list(ALLOWED))
def test_disjoint_and_empty_views_are_allowed(case):
    tensors = ALLOWED[case]
    back = {name: bytes(info["data"]) for name, info in safetensors.deserialize(writer.save(tensors))}
    for name, x in tensors.items():
        assert back[name] == (x if isinstance(x, np.ndarray) else x.numpy()).tobytes()


@needs_torch
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=6))
def test_shared_memory_check_against_pairwise_oracle(bounds):
    views = {f"v{i}": tbase[min(a, b) : max(a, b)] for i, (a, b) in enumerate(bounds)}
    ranges = [(min(a, b), max(a, b)) for a, b in bounds]
    overlap = any(
        s1 < e2 and s2 < e1 and s1 < e1 and s2 < e2
        for i, (s1, e1) in enumerate(ranges)
        for (s2, e2) in ranges[i + 1 :]
    )
    if overlap:
        with pytest.raises(SerializationError, match="share memory"):
            writer.save(views)
    else:
        writer.save(views)


# --------------------------------------------------------------------------- torch


@needs_torch
def test_torch_cpu_file_round_trip(tmp_path):
    tensors = {
        "w": torch.randn(8, 4).to(torch.bfloat16),
        "q": torch.randn(16).to(torch.float8_e4m3fn),
        "e": torch.randn(4).to(torch.float8_e5m2),
        "p": torch.nn.Parameter(torch.randn(3)),  # requires_grad
        "i": torch.arange(5, dtype=torch.int64),
    }
    path = tmp_path / "m.safetensors"
    writer.save_file(tensors, path, {"format": "pt"})
    assert path.read_bytes() == ref_torch.save(tensors, {"format": "pt"})
    loaded = ref_torch.load_file(path)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype
        assert torch.equal(loaded[name].view(torch.uint8), t.detach().view(torch.uint8))


@needs_torch
def test_torch_conjugate_view_is_written_resolved():
    z = torch.randn(4, dtype=torch.complex64)
    back = ref_torch.load(writer.save({"z": z.conj()}))["z"]
    assert torch.equal(back, z.conj().resolve_conj())


@needs_torch
def test_torch_fp4_shape_counts_values():
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    packed = torch.arange(6, dtype=torch.uint8).reshape(2, 3).view(torch.float4_e2m1fn_x2)
    data = writer.save({"f4": packed})
    assert parse(data)["f4"] == {"dtype": "F4", "shape": [2, 6], "data_offsets": [0, 6]}
    assert data == ref_torch.save({"f4": packed})


@needs_torch
def test_size_one_tensors_with_odd_strides():
    """Contiguous by the frameworks' rules although the stride is not the item size."""
    x = torch.arange(20, dtype=torch.float32)
    a = np.arange(20, dtype=np.float32)
    tensors = {"pt": x[::5][:1], "pt2": x.view(4, 5)[1:2, :1], "np": a[::5][:1]}
    assert tensors["pt"].stride() == (5,) and tensors["np"].strides == (20,)
    back = ref_np.load(writer.save(tensors))
    assert back["pt"].tolist() == [0.0] and back["pt2"].tolist() == [[5.0]] and back["np"].tolist() == [0.0]


@needs_torch
def test_numpy_and_torch_mixed(tmp_path):
    tensors = {"np": random_array(np.int32, (3,)), "pt": torch.arange(4, dtype=torch.int32)}
    writer.save_file(tensors, tmp_path / "m")
    loaded = ref_np.load_file(tmp_path / "m")
    assert loaded["np"].tolist() == tensors["np"].tolist() and loaded["pt"].tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------- build_header


def test_build_header_layout():
    entries = [("b", 17, (2,), 8), ("a", "F32", [3], 12), ("c", 0, (), 1), ("d", 21, (0, 5), 0)]
    header, layout = writer.build_header(entries, None)
    assert len(header) % 8 == 0
    assert int.from_bytes(header[:8], "little") == len(header) - 8
    start = len(header)
    # U64 (21) first, then F32 by name, then BOOL; each offset follows the previous tensor
    assert layout == [(3, start), (1, start), (0, start + 12), (2, start + 20)]
    doc = json.loads(header[8:])
    assert list(doc) == ["d", "a", "b", "c"]
    assert doc["a"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}


@pytest.mark.parametrize(
    "entries, reason",
    [
        ([("a", 17, (2,), 9)], "TensorInvalidInfo"),
        ([("a", 1, (3,), 1)], "MisalignedSlice"),  # F4 x3 = 12 bits
        ([("a", 17, (2,), 8), ("a", 17, (2,), 8)], "DuplicateKey"),
        ([("a", "F33", (2,), 8)], "InvalidDtype"),
        ([("a", 99, (2,), 8)], "InvalidDtype"),
        ([("a", 17, (-1,), 0)], "InvalidShape"),
        ([("a", 17, (2.0,), 8)], "InvalidShape"),
    ],
)
def test_build_header_rejects(entries, reason):
    with pytest.raises(SerializationError) as info:
        writer.build_header(entries, None)
    assert info.value.reason == reason


# --------------------------------------------------------------------------- streaming writer


def entries_of(tensors):
    return [(name, NAMES[from_numpy(a.dtype)], a.shape) for name, a in tensors.items()]


STREAM = {
    "z": random_array(np.float32, (3, 4)),
    "a": random_array(np.int8, (5,)),
    "m": random_array(ml_dtypes.bfloat16, (2, 2)),
    "e": random_array(np.float64, (0,)),
}


def test_open_writer_any_order_matches_save(tmp_path):
    path = tmp_path / "m"
    with writer.open_writer(path, entries_of(STREAM), {"k": "v"}) as w:
        assert not path.exists()
        for name in ["a", "e", "z", "m"]:
            w.write(name, STREAM[name])
    assert path.read_bytes() == writer.save(STREAM, {"k": "v"})
    assert only_entry(tmp_path) == ["m"]


def test_open_writer_pieces_and_bytes(tmp_path):
    path = tmp_path / "m"
    with writer.open_writer(path, entries_of(STREAM)) as w:
        z = STREAM["z"]
        w.write("z", z[:1])  # a row at a time
        w.write("z", z[1:])
        w.write("a", STREAM["a"].tobytes())
        w.write("m", memoryview(STREAM["m"].view(np.uint8)))
        w.write("e", STREAM["e"])
        assert w.missing == []
    assert path.read_bytes() == writer.save(STREAM)


@needs_torch
def test_open_writer_packed_fp4(tmp_path):
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    packed = np.arange(6, dtype=np.uint8).reshape(2, 3)
    with writer.open_writer(tmp_path / "m", [("f4", "F4", (2, 6))]) as w:
        w.write("f4", packed)
    assert (tmp_path / "m").read_bytes() == ref_torch.save(
        {"f4": torch.from_numpy(packed).view(torch.float4_e2m1fn_x2)}
    )


def test_open_writer_aborts_on_exception(tmp_path):
    (tmp_path / "m").write_bytes(b"old")
    with pytest.raises(RuntimeError, match="producer failed"):
        with writer.open_writer(tmp_path / "m", entries_of(STREAM)) as w:
            w.write("z", STREAM["z"])
            raise RuntimeError("producer failed")
    assert w.closed
    assert only_entry(tmp_path) == ["m"] and (tmp_path / "m").read_bytes() == b"old"


def test_open_writer_commit_with_missing_tensor(tmp_path):
    with pytest.raises(SerializationError) as info:
        with writer.open_writer(tmp_path / "m", entries_of(STREAM)) as w:
            w.write("z", STREAM["z"])
            w.write("a", STREAM["a"][:2])
    assert info.value.reason == "TensorIncomplete"
    assert set(info.value.tensors) == {"a", "m", "e"} - {"e"}  # empty tensors need no write
    assert only_entry(tmp_path) == []


def test_open_writer_rejects_bad_writes(tmp_path):
    w = writer.open_writer(tmp_path / "m", entries_of(STREAM))
    try:
        cases = [
            ("nope", STREAM["z"], "UnknownTensor"),
            ("z", STREAM["z"].astype(np.float64), "InvalidDtype"),
            ("z", STREAM["z"].reshape(4, 3), "InvalidShape"),
            ("a", np.zeros(6, np.int8), "TensorInvalidInfo"),
            ("z", STREAM["z"].T, "NonContiguous"),
        ]
        for name, data, reason in cases:
            with pytest.raises(SerializationError) as info:
                w.write(name, data)
            assert info.value.reason == reason
        for name, a in STREAM.items():  # still usable after rejected writes
            w.write(name, a)
        w.commit()
    finally:
        w.abort()
    assert (tmp_path / "m").read_bytes() == writer.save(STREAM)
    with pytest.raises(SerializationError, match="closed"):
        w.write("z", STREAM["z"])


def test_open_writer_io_error_closes_and_cleans_up(tmp_path, monkeypatch):
    w = writer.open_writer(tmp_path / "m", entries_of(STREAM))
    fail_on_write(monkeypatch, 1, OSError(errno.EIO, "I/O error"))
    with pytest.raises(WriteError, match="'z'"):
        w.write("z", STREAM["z"])
    assert w.closed and only_entry(tmp_path) == []


@pytest.fixture(params=["unnamed", "named"])
def scheme(request, monkeypatch):
    """Both ways of writing a temporary: an unnamed O_TMPFILE file where the platform has
    one, and the named ``.<name>.<pid>.<random>.tmp`` file everywhere else."""
    from engine.base import _atomic

    if request.param == "named":
        monkeypatch.setattr(_atomic, "_linker", lambda directory: None)
    elif _atomic._linker(os.getcwd()) is None:
        pytest.skip("this platform or file system cannot name an O_TMPFILE file")
    return request.param


def test_dropped_writer_removes_its_temporary_file(tmp_path, scheme):
    w = writer.open_writer(tmp_path / "m", entries_of(STREAM))
    if scheme == "named":
        assert len(only_entry(tmp_path)) == 1
        name = only_entry(tmp_path)[0]
        assert name.startswith(f".m.{os.getpid()}.") and name.endswith(".tmp")
    else:
        assert only_entry(tmp_path) == []  # unnamed until commit
    del w
    assert only_entry(tmp_path) == []


def test_commit_through_both_schemes_new_and_existing_destination(tmp_path, scheme):
    dest = tmp_path / "m.safetensors"
    for round_ in range(2):  # a new name, then replacing an existing file
        arrays = {"x": np.full(5, round_, np.int16)}
        writer.save_file(arrays, dest)
        assert only_entry(tmp_path) == ["m.safetensors"]
        assert np.array_equal(ref_np.load_file(str(dest))["x"], arrays["x"])


def test_background_flush_overlaps_writing(tmp_path, monkeypatch):
    from engine.writing import writer as w

    monkeypatch.setattr(w, "_SYNC_EVERY", 1 << 16)
    monkeypatch.setattr(w, "_SYNC_FROM", 1 << 17)
    monkeypatch.setattr(w, "_CHUNK", 1 << 15)
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    tensors = {f"t{i}": np.full(1 << 16, i, np.float32) for i in range(6)}
    path = tmp_path / "big.safetensors"
    w.save_file(tensors, path)
    assert synced, "no background flush ran"
    assert all(t.name != "engine-fsync" for t in threading.enumerate())  # joined at commit
    loaded = ref_np.load_file(str(path))
    assert all(np.array_equal(loaded[k], v) for k, v in tensors.items())


def test_small_tensors_go_out_in_few_system_calls(tmp_path, monkeypatch):
    calls = []
    real = _file_writes.writev_at

    def spy(fd, views, offset):
        calls.append((len(views), offset))
        for v in views:  # slices of the arrays' own memory, no copies
            assert any(np.shares_memory(np.frombuffer(v, np.uint8), a) for a in many.values())
        return real(fd, views, offset)

    many = {f"t{i:03d}": random_array(np.float32, (i % 7 + 1,)) for i in range(300)}
    monkeypatch.setattr(_file_writes, "writev_at", spy)
    dest = tmp_path / "m.safetensors"
    writer.save_file(many, dest)
    assert len(calls) == 1 and calls[0][0] == 300
    assert dest.read_bytes() == ref_np.save(many)


def test_no_background_flush_below_the_size_threshold(tmp_path, monkeypatch):
    from engine.writing import writer as w

    monkeypatch.setattr(w, "_SYNC_EVERY", 1 << 16)
    monkeypatch.setattr(w, "_CHUNK", 1 << 15)
    synced = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append(fd))
    tensors = {f"t{i}": np.full(1 << 16, i, np.float32) for i in range(6)}  # 1.5 MiB
    monkeypatch.setattr(w, "_SYNC_FROM", 2 << 20)
    w.save_file(tensors, tmp_path / "small.safetensors")
    assert synced == []  # the final fsync alone
    monkeypatch.setattr(w, "_SYNC_FROM", 1 << 20)
    w.save_file(tensors, tmp_path / "large.safetensors")
    assert synced


def test_background_flush_error_fails_the_save_atomically(tmp_path, monkeypatch):
    from engine.writing import writer as w

    monkeypatch.setattr(w, "_SYNC_EVERY", 1 << 16)
    monkeypatch.setattr(w, "_SYNC_FROM", 1 << 17)
    monkeypatch.setattr(w, "_CHUNK", 1 << 15)

    def failing(fd):
        raise OSError(errno.EIO, "writeback failed")

    monkeypatch.setattr(os, "fdatasync", failing)
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"previous")
    with pytest.raises(WriteError, match="writeback failed"):
        w.save_file({f"t{i}": np.zeros(1 << 16, np.float32) for i in range(4)}, path)
    assert path.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["m.safetensors"]


# -- the header limit the readers apply ------------------------------------------------------


def test_header_larger_than_the_readers_limit_is_refused_at_write_time(tmp_path):
    from engine.format.header import MAX_HEADER_SIZE

    # one metadata value that pushes the header just past the limit both readers enforce
    big = {"x": "a" * (MAX_HEADER_SIZE - 40)}
    arrays = {"w": np.zeros(2, np.float32)}
    dest = tmp_path / "big.safetensors"
    for write in (
        lambda: writer.save_file(arrays, dest, big),
        lambda: writer.save(arrays, big),
        lambda: writer.open_writer(dest, [("w", "F32", (2,))], big),
    ):
        with pytest.raises(SerializationError) as e:
            write()
        assert e.value.reason == "HeaderTooLarge" and "max_header_size" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_max_header_size_is_the_same_keyword_as_the_readers(tmp_path):
    arrays = {"w": np.arange(4, dtype=np.float32)}
    dest = tmp_path / "m.safetensors"
    n = len(writer.save(arrays))
    header_len = int.from_bytes(writer.save(arrays)[:8], "little")
    with pytest.raises(SerializationError) as e:
        writer.save_file(arrays, dest, max_header_size=header_len - 1)
    assert e.value.reason == "HeaderTooLarge"
    with pytest.raises(HeaderError) as r:  # the reader refuses the same size with the same reason
        read_header(_written(tmp_path, arrays), max_header_size=header_len - 1)
    assert r.value.reason == "HeaderTooLarge"
    writer.save_file(arrays, dest, max_header_size=header_len)
    assert os.path.getsize(dest) == n
    assert read_header(dest, max_header_size=header_len).header_size == header_len


def _written(tmp_path, arrays):
    path = tmp_path / "plain.safetensors"
    writer.save_file(arrays, path)
    return path


# -- a save killed at any moment leaves the old file or the new one, nothing else -------------

KILL_SAVE = """
path = sys.argv[1] if len(sys.argv) > 1 else os.environ["DEST"]
seed = int(os.environ["SEED"])
arrays = {f"t{i}": np.full((1 << 20,), seed * 16 + i, np.float32) for i in range(12)}
print("ready", flush=True)
engine.save_file(arrays, path, fsync=os.environ["FSYNC"] == "1")
print("done", flush=True)
"""


def _expected(seed: int) -> dict:
    return {f"t{i}": np.full((1 << 20,), seed * 16 + i, np.float32) for i in range(12)}


def _kill_saves(tmp_path, kills: int, scheme: str) -> int:
    """Kill saves until ``kills`` kills landed during a save (at most 3x as many rounds)."""
    import killsave

    rng = np.random.default_rng(kills)
    dest = tmp_path / "m.safetensors"
    import time

    t0 = time.perf_counter()
    writer.save_file(_expected(0), dest)
    # kill within about the time a save takes, so that most kills land during one
    window = 1.5 * (time.perf_counter() - t0) + 0.01
    current = 0
    killed = 0
    for r in range(1, 3 * kills + 1):
        if killed >= kills:
            break
        env = {"DEST": str(dest), "SEED": str(r), "FSYNC": str(r % 2)}
        landed = killsave.kill_during(KILL_SAVE, window, rng, scheme=scheme, env=env)
        killed += landed
        # keep the kills inside the saves on a machine whose speed changes under load
        window = window * 1.1 if landed else max(0.005, window * 0.6)
        entries = only_entry(tmp_path)
        loaded = ref_np.load_file(str(dest))
        got = int(loaded["t0"][0]) // 16
        assert got in (current, r), f"round {r}: neither the old nor the new file"
        assert all(np.array_equal(loaded[k], v) for k, v in _expected(got).items())
        current = got
        others = [e for e in entries if e != "m.safetensors"]
        if scheme == "unnamed":
            # an unnamed file dies with its writer; only a kill between naming the finished
            # file and renaming it over the old one can leave that (complete) file
            assert len(others) <= 1, others
        if others:
            # the next save removes what a dead writer left, and only that
            writer.save_file(_expected(current), dest)
            assert only_entry(tmp_path) == ["m.safetensors"]
    return killed


def test_killed_saves_leave_old_or_new_file_only(tmp_path, scheme):
    assert _kill_saves(tmp_path, 3, scheme) == 3


@pytest.mark.slow
def test_killed_saves_leave_old_or_new_file_only_many(tmp_path, scheme):
    assert _kill_saves(tmp_path, 30, scheme) == 30
