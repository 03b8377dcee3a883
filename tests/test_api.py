"""safe_open, load_file/load and get_slice against the reference safetensors package."""

from __future__ import annotations

import gc
import os
import threading

import ml_dtypes
import numpy as np
import pytest
from conftest import in_threads, run_python
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
import engine.numpy
from engine.errors import HeaderError, SafetensorError, TensorNotFoundError
from engine.planning.plan import InvalidSliceError

safetensors = pytest.importorskip("safetensors", reason="the reference package is a test extra")
import safetensors.numpy as ref_np  # noqa: E402

torch = pytest.importorskip("torch", reason="torch is an optional extra")
import safetensors.torch as ref_pt  # noqa: E402

import engine.torch  # noqa: E402

BACKENDS = ["mmap", "pread"]

# numpy dtypes the reference can write and read
REF_NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.float16, np.int32, np.uint32,
                    np.float32, np.complex64, np.float64, np.int64, np.uint64]
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float16, torch.bfloat16,
                torch.int32, torch.uint32, torch.float32, torch.complex64, torch.float64, torch.int64, torch.uint64,
                torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                torch.float8_e8m0fnu]


def _np_sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    raw = rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8)
    if np.dtype(dtype) == np.bool_:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _torch_sample(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape))
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bits_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


SHAPES = [(), (0,), (3, 0, 2), (7,), (4, 5), (2, 3, 4)]


# -- reading what the reference wrote ---------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", REF_NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_reads_reference_files(tmp_path, dtype, backend):
    tensors = {f"t{i}": _np_sample(dtype, s, i) for i, s in enumerate(SHAPES)}
    path = tmp_path / "ref.safetensors"
    ref_np.save_file(tensors, str(path), metadata={"k": "v"})
    loaded = engine.numpy.load_file(path, backend=backend)
    assert loaded.keys() == tensors.keys()
    for name, arr in tensors.items():
        assert _bits_equal(loaded[name], arr), name
    with engine.safe_open(path, framework="np", backend=backend) as f:
        assert f.metadata() == {"k": "v"}
        assert f.keys() == sorted(tensors)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_reads_reference_files(tmp_path, dtype, backend):
    tensors = {f"t{i}": _torch_sample(dtype, s, i) for i, s in enumerate(SHAPES)}
    path = tmp_path / "ref.safetensors"
    ref_pt.save_file(tensors, str(path))
    loaded = engine.torch.load_file(path, backend=backend)
    expected = ref_pt.load_file(str(path))
    assert loaded.keys() == expected.keys()
    for name in tensors:
        assert _bits_equal(loaded[name], expected[name]), name
        assert _bits_equal(loaded[name], tensors[name]), name


# -- the reference reading what we wrote --------------------------------------------------------
@pytest.mark.parametrize("dtype", REF_NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_reference_reads_our_numpy_files(tmp_path, dtype):
    tensors = {f"t{i}": _np_sample(dtype, s, i) for i, s in enumerate(SHAPES)}
    path = tmp_path / "ours.safetensors"
    engine.numpy.save_file(tensors, path, metadata={"a": "b"})
    loaded = ref_np.load_file(str(path))
    for name, arr in tensors.items():
        assert _bits_equal(loaded[name], arr), name
    assert engine.numpy.save(tensors, {"a": "b"}) == path.read_bytes()
    assert ref_np.save(tensors, {"a": "b"}) == path.read_bytes()


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_reference_reads_our_torch_files(tmp_path, dtype):
    tensors = {f"t{i}": _torch_sample(dtype, s, i) for i, s in enumerate(SHAPES)}
    path = tmp_path / "ours.safetensors"
    engine.torch.save_file(tensors, path)
    loaded = ref_pt.load_file(str(path))
    for name in tensors:
        assert _bits_equal(loaded[name], tensors[name]), name
    assert ref_pt.save(tensors) == path.read_bytes()


def test_numpy_gets_bf16_and_fp8_which_the_reference_cannot(tmp_path):
    tensors = {
        "bf16": torch.randn(4, 3).to(torch.bfloat16),
        "e4m3": torch.randn(5).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(2, 2).to(torch.float8_e5m2),
    }
    path = tmp_path / "m.safetensors"
    ref_pt.save_file(tensors, str(path))
    loaded = engine.numpy.load_file(path)
    assert loaded["bf16"].dtype == ml_dtypes.bfloat16
    assert loaded["e4m3"].dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(loaded["bf16"].astype(np.float32), tensors["bf16"].float().numpy())
    np.testing.assert_array_equal(loaded["e5m2"].astype(np.float32), tensors["e5m2"].float().numpy())


# -- load from bytes ------------------------------------------------------------------------------
def test_load_from_bytes_matches_reference():
    tensors = {"a": _np_sample(np.float32, (3, 4)), "b": _np_sample(np.int64, (5,)), "c": np.zeros((0,), np.int8)}
    data = ref_np.save(tensors)
    for name, arr in engine.numpy.load(data).items():
        assert _bits_equal(arr, tensors[name])
        assert arr.flags.writeable and ref_np.load(data)[name].flags.writeable
    arrays = engine.numpy.load(data)
    arrays["a"] *= 2  # as with the reference: the arrays are the caller's, `data` is untouched
    assert data == ref_np.save(tensors)
    assert _bits_equal(arrays["a"], tensors["a"] * 2)
    assert _bits_equal(engine.numpy.load(bytearray(data))["a"], tensors["a"])
    pt = engine.torch.load(data)
    for name, t in ref_pt.load(data).items():
        assert _bits_equal(pt[name], t)
    pt["a"].add_(1)  # owned copy: writable, and `data` untouched
    assert engine.numpy.load(data)["a"].tobytes() == tensors["a"].tobytes()


def test_load_from_bytes_rejects_garbage():
    with pytest.raises(HeaderError) as info:
        engine.numpy.load(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    assert info.value.reason == "InvalidHeaderLength"


# -- handle semantics ---------------------------------------------------------------------------
@pytest.fixture
def sample_file(tmp_path):
    tensors = {
        "w": _np_sample(np.float32, (6, 8), 1),
        "b": _np_sample(np.float16, (8,), 2),
        "ids": _np_sample(np.int64, (3, 4, 5), 3),
        "s": np.array(3.5, np.float64),
        "empty": np.zeros((2, 0), np.float32),
    }
    path = tmp_path / "sample.safetensors"
    ref_np.save_file(tensors, str(path), metadata={"format": "np"})
    return path, tensors


@pytest.mark.parametrize("backend", BACKENDS)
def test_safe_open_api(sample_file, backend):
    path, tensors = sample_file
    with ref_np.safe_open(str(path), framework="np") as r, engine.safe_open(path, "np", backend=backend) as f:
        assert f.keys() == r.keys() == sorted(tensors)
        assert f.offset_keys() == r.offset_keys()
        assert f.metadata() == r.metadata()
        for k in f.keys():
            assert f.get_slice(k).get_shape() == r.get_slice(k).get_shape()
            assert f.get_slice(k).get_dtype() == r.get_slice(k).get_dtype()
            assert _bits_equal(f.get_tensor(k), tensors[k])
        got = f.get_tensors()
        assert list(got) == f.offset_keys()


def test_mmap_views_are_zero_copy_and_writable_but_never_write_the_file(sample_file):
    """As the reference's, numpy arrays are writable (``a[k] *= 2``); they view a private
    mapping, so no byte is copied up front and no write reaches the file."""
    path, tensors = sample_file
    before = path.read_bytes()
    with engine.safe_open(path, "np") as f:
        w1, w2 = f.get_tensor("w"), f.get_tensor("w")
        piece = f.get_slice("ids")[1:, ::2]
    with ref_np.safe_open(str(path), framework="np") as r:
        assert r.get_tensor("w").flags.writeable and r.get_slice("ids")[1:, ::2].flags.writeable
    assert w1.flags.writeable and piece.flags.writeable
    assert not np.shares_memory(w1, w2)  # independent, as the reference's: each views its own mapping
    w1[0, 0] = 1.0
    piece[...] = -1
    loaded = engine.numpy.load_file(path)
    assert all(a.flags.writeable for a in loaded.values())
    loaded["b"] *= 2
    del w1, w2, piece, loaded
    gc.collect()
    assert path.read_bytes() == before
    assert _bits_equal(engine.numpy.load_file(path)["w"], tensors["w"])


def test_pread_gives_owned_writable_memory(sample_file):
    path, tensors = sample_file
    with engine.safe_open(path, "np", backend="pread") as f:
        w = f.get_tensor("w")
    assert w.flags.writeable
    with engine.safe_open(path, "np", backend="pread") as f:
        assert not np.shares_memory(w, f.get_tensor("w"))  # each load owns its memory
    w[0, 0] = 42.0
    assert engine.numpy.load_file(path)["w"][0, 0] == tensors["w"][0, 0]


def test_torch_mmap_tensors_are_writable_but_never_write_the_file(sample_file):
    path, tensors = sample_file
    before = path.read_bytes()
    t = engine.torch.load_file(path)["w"]
    t.fill_(7.0)
    del t
    gc.collect()
    assert path.read_bytes() == before


def test_tensors_outlive_the_handle(sample_file):
    path, tensors = sample_file
    with engine.safe_open(path, "np") as f:
        w = f.get_tensor("w")
    gc.collect()
    assert _bits_equal(w, tensors["w"])
    with pytest.raises(SafetensorError, match="closed"):
        f.get_tensor("w")


def test_missing_tensor_names_file_and_tensor(sample_file):
    path, _ = sample_file
    with engine.safe_open(path, "np") as f:
        with pytest.raises(TensorNotFoundError) as info:
            f.get_tensor("ww")
        with pytest.raises(KeyError):  # drop-in: callers catching KeyError keep working
            f.get_slice("nope")
    assert str(path) in str(info.value) and "ww" in str(info.value)


def test_bad_framework_backend_device(sample_file):
    path, _ = sample_file
    with pytest.raises(SafetensorError, match="framework"):
        engine.safe_open(path, "tensorflow2")  # "tf" opens, as with the reference (test_compat)
    with pytest.raises(SafetensorError, match="backend"):
        engine.safe_open(path, "np", backend="cufile")
    with pytest.raises(engine.DeviceError):
        engine.safe_open(path, "np", device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where no GPU exists")
def test_cuda_without_gpu_is_a_clear_error(sample_file):
    path, _ = sample_file
    with pytest.raises(engine.DeviceError, match="CUDA"):
        engine.safe_open(path, "pt", device="cuda:0")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_load(sample_file):
    path, tensors = sample_file
    got = engine.torch.load_file(path, device="cuda:0")
    for k, v in tensors.items():
        assert got[k].device.type == "cuda"
        assert got[k].cpu().numpy().tobytes() == v.tobytes()


def test_no_fd_leak(sample_file):
    path, _ = sample_file
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        with engine.safe_open(path, "np", backend="pread") as f:
            f.get_tensors()
        f = engine.safe_open(path, "pt")
        f.get_tensor("w")
        del f
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds


# -- slicing -----------------------------------------------------------------------------------------
INDICES = [
    0, -1, slice(None), slice(1, 3), slice(None, None, 2), slice(None, None, -1), slice(-2, None),
    (slice(None), 1), (Ellipsis, 2), (1, Ellipsis), (slice(0, 6, 4), slice(1, 8, 3)), (slice(5, 0, -2), -1),
    (slice(3, 3),), (2, 3), Ellipsis, (slice(10, 20),), (2, slice(None, None, -1)), (-1, slice(6, 1, -2)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", INDICES, ids=repr)
def test_get_slice_numpy_matches_numpy_indexing(sample_file, backend, index):
    path, tensors = sample_file
    with engine.safe_open(path, "np", backend=backend) as f:
        if _past_an_axis(tensors["w"].shape, index):
            # as the reference's numpy slices: a bound past the axis is refused, not clamped
            with pytest.raises(InvalidSliceError, match="out of bounds"):
                f.get_slice("w")[index]
            return
        got = f.get_slice("w")[index]
    np.testing.assert_array_equal(got, tensors["w"][index])
    assert got.shape == tensors["w"][index].shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", [i for i in INDICES], ids=repr)
def test_get_slice_torch(sample_file, backend, index):
    path, tensors = sample_file
    expected = tensors["w"][index]
    with engine.safe_open(path, "pt", backend=backend) as f:
        got = f.get_slice("w")[index]
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), expected)


def test_get_slice_agrees_with_reference_torch(sample_file):
    path, _ = sample_file
    with ref_pt.safe_open(str(path), framework="pt") as r, engine.safe_open(path, "pt") as f:
        for index in [(slice(1, 4),), (slice(None), slice(2, 6)), (slice(None, None, 2), slice(0, 8, 3)), (Ellipsis, 1)]:
            assert torch.equal(f.get_slice("ids")[index], r.get_slice("ids")[index])


def test_slice_dtypes_survive_an_edit_of_header_dtypes(sample_file):
    """get_slice reads dtype names from a list of its own, by index in C: a caller's edit of
    the header's ``dtypes`` does not change what a slice says."""
    sample_file, _ = sample_file
    with engine.safe_open(sample_file, framework="np") as f:
        name = f.header.names[0]
        want = f.get_slice(name).get_dtype()
        f.header.dtypes[0] = "I8" if want != "I8" else "F64"
        assert f.get_slice(name).get_dtype() == want
    with engine.safe_open(sample_file, framework="np") as f:
        name = f.header.names[0]
        f.header.dtypes[0] = "I8" if want != "I8" else "F64"  # before the first lookup too
        assert f.get_slice(name).get_dtype() == want


@pytest.mark.parametrize("bad", [(0, 0, 0), 6, -7, (slice(None), 8), "a", 1.5, [0, 1], None, (Ellipsis, Ellipsis)])
def test_get_slice_rejects_bad_indices(sample_file, bad):
    path, _ = sample_file
    with engine.safe_open(path, "np") as f:
        with pytest.raises((InvalidSliceError, IndexError)) as info:
            f.get_slice("w")[bad]
    assert isinstance(info.value, SafetensorError)
    assert "'w'" in str(info.value) and str(path) in str(info.value)


def _rchar() -> int:
    """Bytes this process has read with read-family system calls (the kernel's count)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's /proc/self/io to count reads")
def test_pread_slice_reads_only_needed_bytes(tmp_path):
    arr = _np_sample(np.float32, (256, 1024))
    path = tmp_path / "big.safetensors"
    ref_np.save_file({"m": arr}, str(path))
    with engine.safe_open(path, "np", backend="pread") as f:
        sl = f.get_slice("m")
        sl[0]  # first use imports the native reader: keep those reads out of the count
        before = _rchar()
        rows = sl[10:20]
        after_rows = _rchar()
        col = sl[:, 5:9]
        after_cols = _rchar()
    # /proc/self/io itself is read between the calls: subtract what those reads return
    probe = _rchar() - after_cols
    assert after_rows - before - probe == 10 * 1024 * 4
    assert after_cols - after_rows - probe == 256 * 4 * 4
    np.testing.assert_array_equal(rows, arr[10:20])
    np.testing.assert_array_equal(col, arr[:, 5:9])


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_get_slice_property(tmp_path_factory, data):
    shape = tuple(data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    arr = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    path = tmp_path_factory.mktemp("s") / "t.safetensors"
    ref_np.save_file({"x": arr}, str(path))

    def axis_index(dim):
        ints = st.integers(-dim, dim - 1) if dim else st.nothing()
        bound = st.none() | st.integers(-dim - 2, dim + 2)
        step = st.none() | st.integers(-3, 3).filter(bool)
        return ints | st.builds(slice, bound, bound, step)

    index = tuple(data.draw(axis_index(d)) for d in shape[: data.draw(st.integers(0, len(shape)))])
    for backend in BACKENDS:
        with engine.safe_open(path, "np", backend=backend) as f:
            if _past_an_axis(shape, index):
                with pytest.raises(InvalidSliceError):
                    f.get_slice("x")[index]
            else:
                np.testing.assert_array_equal(f.get_slice("x")[index], arr[index])
        with engine.safe_open(path, "pt", backend=backend) as f:  # torch slices clamp, as the reference's
            np.testing.assert_array_equal(f.get_slice("x")[index].numpy(), arr[index])


def _past_an_axis(shape, index) -> bool:
    """True when a slice bound of ``index`` (no ellipsis) lies past its axis."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1 :]
    return any(
        isinstance(ix, slice) and any(b is not None and not -d <= b <= d for b in (ix.start, ix.stop))
        for ix, d in zip(index, shape, strict=False)
    )


def test_numpy_slices_refuse_bounds_past_the_axis_like_the_reference(tmp_path):
    arr = np.arange(50, dtype=np.float32).reshape(10, 5)
    path = tmp_path / "a.safetensors"
    ref_np.save_file({"a": arr}, str(path))
    for index in (np.s_[:20], np.s_[:11], np.s_[:, :6], np.s_[3:12], np.s_[:10], np.s_[2:, :5]):
        for lib, err in ((engine, InvalidSliceError), (safetensors, Exception)):
            with lib.safe_open(path, framework="np") as f:
                past = _past_an_axis(arr.shape, index)
                if past:
                    with pytest.raises(err):
                        f.get_slice("a")[index]
                else:
                    np.testing.assert_array_equal(f.get_slice("a")[index], arr[index])
            with lib.safe_open(path, framework="pt") as f:
                np.testing.assert_array_equal(f.get_slice("a")[index].numpy(), arr[index])


# -- robustness ----------------------------------------------------------------------------------
def test_pread_truncated_file_is_a_read_error(tmp_path):
    arr = _np_sample(np.float32, (64, 64))
    path = tmp_path / "t.safetensors"
    ref_np.save_file({"a": arr, "b": arr}, str(path))
    f = engine.safe_open(path, "np", backend="pread")
    os.truncate(path, os.path.getsize(path) - 100)  # another process truncates it while open
    with pytest.raises(engine.ReadError) as info:
        f.get_tensors()
    f.close()
    assert info.value.offset is not None and info.value.size
    assert str(path) in str(info.value)
    assert isinstance(info.value, OSError)


def test_truncated_file_is_a_header_error_at_open(tmp_path):
    path = tmp_path / "t.safetensors"
    ref_np.save_file({"a": np.zeros(10, np.float32)}, str(path))
    os.truncate(path, os.path.getsize(path) - 1)
    with pytest.raises(HeaderError) as info:
        engine.safe_open(path, "np")
    assert info.value.reason == "MetadataIncompleteBuffer"


def test_concurrent_handles(tmp_path):
    tensors = {f"t{i}": _np_sample(np.float32, (32, 32), i) for i in range(20)}
    path = tmp_path / "c.safetensors"
    ref_np.save_file(tensors, str(path))

    def work(backend):
        for _ in range(20):
            got = engine.numpy.load_file(path, backend=backend)
            assert all(_bits_equal(got[k], v) for k, v in tensors.items())

    in_threads(*[lambda b=b: work(b) for b in BACKENDS * 3])


def test_torch_headers_import_no_sink_and_no_cuda_runtime(sample_file):
    """A torch process that reads names, dtypes and shapes pays for no torch sink and no CUDA
    bindings (first open as light as the reference's); the first tensor brings the sink only."""
    path, _ = sample_file
    code = (
        "import torch, sys, engine\n"
        f"with engine.safe_open({str(path)!r}, framework='pt') as f:\n"
        "    rows = [(f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()]\n"
        "    seen = [m for m in ('engine.sinks.torch',) if m in sys.modules]\n"
        "    t = f.get_tensor('w')\n"
        "print(seen, [m for m in ('engine.sinks.torch',) if m in sys.modules], t.dtype)"
    )
    assert run_python(code).strip() == "[] ['engine.sinks.torch'] torch.float32"


def test_missing_torch_still_fails_at_open(sample_file):
    """The torch sink is made with the first tensor, yet a missing torch fails at open, as
    with the reference (bad devices: test_bad_framework_backend_device)."""
    path, _ = sample_file
    code = (
        "import sys, engine\n"
        "sys.modules['torch'] = None  # torch missing\n"
        "try:\n"
        f"    engine.safe_open({str(path)!r}, framework='pt')\n"
        "except ImportError as e:\n"
        "    print('ImportError')\n"
    )
    assert run_python(code).strip() == "ImportError"


def test_safe_open_takes_an_index_or_a_directory(tmp_path):
    tensors = {f"layer{i}.w": _np_sample(np.float32, (64, 64), i) for i in range(4)}
    engine.save_sharded(tensors, tmp_path / "ck", max_shard_size=40_000)
    assert (tmp_path / "ck" / "model.safetensors.index.json").exists()
    for target in (tmp_path / "ck", tmp_path / "ck" / "model.safetensors.index.json"):
        with engine.safe_open(target, framework="np") as f:
            assert f.keys() == sorted(tensors)
            for k, v in tensors.items():
                assert _bits_equal(f.get_tensor(k), v)
                np.testing.assert_array_equal(f.get_slice(k)[3:5, ::7], v[3:5, ::7])


def test_load_from_bytes_with_no_tensor_bytes():
    for tensors in ({"e": np.zeros((0, 3), np.float32)}, {}):
        data = engine.numpy.save(tensors)
        assert {k: v.shape for k, v in engine.numpy.load(data).items()} == {k: v.shape for k, v in tensors.items()}
        assert {k: tuple(v.shape) for k, v in engine.torch.load(data).items()} == {
            k: v.shape for k, v in tensors.items()}


def test_safe_open_handle_reads_file_objects(valid_file, tmp_path):
    """The reference's _safe_open_handle: a real file through its descriptor (text mode
    too, as the reference allows), anything else read into memory; the caller's object is
    left open."""
    import io

    from engine import _safe_open_handle

    with engine.safe_open(valid_file, framework="np") as f:
        expected = {k: f.get_tensor(k).copy() for k in f.keys()}
    for mode in ("rb", "r"):
        with open(valid_file, mode) as fobj:
            with _safe_open_handle(fobj, framework="np", device="cpu") as g:
                got = {k: g.get_tensor(k) for k in g.keys()}
                assert str(valid_file) in repr(g)
            assert not fobj.closed
        assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in got)
    memory = io.BytesIO(valid_file.read_bytes())
    memory.seek(5)  # read from the start whatever the position
    with _safe_open_handle(memory, framework="np", backend="pread") as g:
        assert all(np.array_equal(g.get_tensor(k), expected[k]) for k in expected)
    with pytest.raises(engine.HeaderError):
        _safe_open_handle(io.BytesIO(b"\x04" + b"\0" * 10), framework="np")


def test_closed_handle_refuses_everything(valid_file):
    f = engine.safe_open(valid_file, framework="np")
    name = f.keys()[0]
    f.close()
    for call in (f.keys, f.offset_keys, f.metadata, lambda: f.get_tensor(name), lambda: f.get_slice(name)):
        with pytest.raises(engine.SafetensorError, match="closed"):
            call()


def test_get_slice_takes_str_subclasses_and_a_dropped_handle_is_closed(valid_file):
    f = engine.safe_open(valid_file, framework="np")
    name = f.keys()[0]
    assert f.get_slice(np.str_(name)).get_shape() == f.get_slice(name).get_shape()
    assert np.array_equal(f.get_slice(np.str_(name))[...], f.get_tensor(np.str_(name)))
    get_slice = f.get_slice
    del f
    gc.collect()
    with pytest.raises(SafetensorError) as e:
        get_slice(name)
    assert e.value.reason == "FileClosed"


# -- close() racing reads on a shared handle --------------------------------------------


def _race_close_against_reads(tmp_path, seconds: float) -> tuple[int, int]:
    """Threads slice a shared pread handle while the main thread closes it and at once opens
    another file, hoping to be handed the freed descriptor number.  A read must return the
    handle's own bytes or raise FileClosed, never the other file's bytes."""
    import time

    rows = 4096
    good = tmp_path / "good.safetensors"
    other = tmp_path / "other.safetensors"
    engine.numpy.save_file({"x": np.full((rows, 8), 0xAA, np.uint8)}, good)
    engine.numpy.save_file({"x": np.full((rows, 8), 0x55, np.uint8)}, other)  # same layout, other bytes
    reads = closed = 0
    wrong: list = []
    deadline = time.monotonic() + seconds
    rng = np.random.default_rng(0)
    while time.monotonic() < deadline:
        h = engine.safe_open(good, "numpy", backend="pread")
        started = threading.Barrier(3)
        counts = [0, 0]

        def reader(k: int, h=h, started=started, counts=counts) -> None:
            started.wait()
            while True:
                try:
                    # one small read per row: a long native loop on the descriptor
                    got = h.get_slice("x")[:, :1] if k else h.get_tensor("x")
                except SafetensorError as exc:
                    # an assert here would only warn (it fails a thread, not the test)
                    if exc.reason != "FileClosed":
                        wrong.append(repr(exc))
                    return
                except BaseException as exc:  # noqa: BLE001 - reported to the test below
                    wrong.append(repr(exc))
                    return
                counts[k] += 1
                if not (got == 0xAA).all():
                    wrong.append(np.unique(got).tolist())
                    return

        threads = [threading.Thread(target=reader, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        started.wait()
        time.sleep(float(rng.uniform(0, 0.003)))
        h.close()
        # grab the freed numbers: a read that still used one would now read this file
        fds = [os.open(other, os.O_RDONLY) for _ in range(4)]
        for t in threads:
            t.join()
        for fd in fds:
            os.close(fd)
        reads += sum(counts)
        closed += 1
        assert not wrong, f"a read failed otherwise than FileClosed, or returned another file's bytes: {wrong}"
    return reads, closed


def test_close_during_reads_never_returns_other_bytes(tmp_path):
    reads, closed = _race_close_against_reads(tmp_path, 2.0)
    assert closed > 10 and reads > closed


@pytest.mark.slow
def test_close_during_reads_never_returns_other_bytes_long(tmp_path):
    reads, closed = _race_close_against_reads(tmp_path, 30.0)
    assert closed > 100 and reads > closed


def test_reads_after_close_raise_file_closed(tmp_path):
    path = tmp_path / "a.safetensors"
    engine.numpy.save_file({"x": np.arange(6, dtype=np.float32)}, path)
    for backend in BACKENDS:
        h = engine.safe_open(path, "numpy", backend=backend)
        h.close()
        h.close()  # idempotent
        for read in (lambda h=h: h.get_tensor("x"), lambda h=h: h.get_slice("x")[1:], h.get_tensors):
            with pytest.raises(SafetensorError) as e:
                read()
            assert e.value.reason == "FileClosed" and e.value.path == str(path)


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_a_second_get_of_a_tensor_written_to_gives_the_files_bytes(tmp_path, framework):
    """The reference hands out an independent numpy array each time; mapped views of one
    private mapping would share a write made to the first one with every later view.  (The
    reference's torch tensors of one handle do share their memory; the engine's do not, so
    that a write never shows up in a tensor asked for later.)"""
    if framework == "pt":
        pytest.importorskip("torch", reason="torch is an optional extra")
    import safetensors

    sd = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.float32)}
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file(sd, path)
    before = path.read_bytes()
    for lib in (safetensors, engine) if framework == "np" else (engine,):
        with lib.safe_open(path, framework=framework) as f:
            first = f.get_tensor("w")
            first[0, 0] = 100.0
            again = f.get_tensor("w")
            part = f.get_slice("w")[0:2]
            many = [f.get_tensor(k) for k in f.keys()]  # after a write to one of them
            again[1, 1] = -5.0
            third = f.get_tensor("w")
            as_np = [np.asarray(x) for x in (first, again, part, third, many[1])]
        assert as_np[0][0, 0] == 100.0, lib.__name__  # the first array keeps its own write
        np.testing.assert_array_equal(as_np[1][0], sd["w"][0], err_msg=lib.__name__)
        np.testing.assert_array_equal(as_np[2], sd["w"][0:2], err_msg=lib.__name__)
        np.testing.assert_array_equal(as_np[3], sd["w"], err_msg=lib.__name__)
        np.testing.assert_array_equal(as_np[4], sd["w"], err_msg=lib.__name__)
        assert path.read_bytes() == before  # no write reaches the file


# -- a file on a network mount (a real FUSE mount) ----------------------------------------------


def test_a_handle_on_a_network_mount_advises_sequential_reads_and_leaves_the_faults_to_the_copy(
        fuse_file, monkeypatch):
    import engine.loading.handle_reads
    from engine.io import reader

    via_fuse, direct, tensors = fuse_file
    # every tensor counts as large: a local handle prefetches them, a network one must not
    monkeypatch.setattr(engine.loading.handle_reads, "PREFETCH_MIN_BYTES", 1)
    prefetched, advised = [], []
    real_prefetch, real_fadvise = reader.prefetch_mapping, os.posix_fadvise
    monkeypatch.setattr(reader, "prefetch_mapping", lambda *a, **k: prefetched.append(a[1]) or real_prefetch(*a, **k))
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: advised.append((fd, off, n, advice))
                        or real_fadvise(fd, off, n, advice))
    for path, network in ((direct, False), (via_fuse, True)):
        prefetched.clear()
        advised.clear()
        with engine.safe_open(path, "np") as f:
            got = f.get_tensors()
            assert f._network is network
            sequential = [a for a in advised if a[3] == os.POSIX_FADV_SEQUENTIAL]
            assert sequential == ([(f._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)] if network else [])
        assert bool(prefetched) is not network
        assert got.keys() == tensors.keys()
        for name, want in tensors.items():
            assert np.array_equal(got[name], want)
