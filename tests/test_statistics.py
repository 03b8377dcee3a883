"""engine.stats / engine.Stats against the NumPy oracle in tests/naive.py."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import naive
import numpy as np
import pytest
from conftest import run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_kernels import FLOATS, INTS, assert_stats

import engine
from engine.statistics import Stats, stats


def _data(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_).reshape(shape)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True).reshape(shape)
    x = (rng.standard_normal(n) * 100).astype(dtype)
    if n >= 8:
        x[:8] = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, np.nan, 1e-40, -1e-40]).astype(dtype)
        rng.shuffle(x)
    return x.reshape(shape)


ALL = FLOATS + INTS


@pytest.mark.parametrize(
    "first", ["engine.Stats", "engine.quantize_int8", "import engine.statistics", "engine.stats"]
)
def test_engine_stats_callable_whatever_was_imported_first(first):
    # engine.stats is the function whatever was imported first (the module is engine.statistics)
    pre = first if first.startswith("import") else f"import engine; {first}"
    code = f"{pre}\nimport engine, numpy as np\nassert engine.stats(np.arange(4.0)).max == 3.0\n"
    run_python(code)


def test_public_names():
    assert engine.stats(np.ones(1)).count == 1
    assert engine.Stats is Stats
    s = stats(np.ones(2, np.float32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.count = 3  # type: ignore[misc]
    assert [f.name for f in dataclasses.fields(Stats)] == [
        "count",
        "min",
        "max",
        "mean",
        "std",
        "absmax",
        "nan_count",
        "posinf_count",
        "neginf_count",
        "zero_count",
    ]


@pytest.mark.parametrize("dtype", ALL, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (1,), (0,), (3, 0, 2), (37,), (4, 5, 6)], ids=str)
def test_all_dtypes_and_shapes(dtype, shape):
    x = _data(dtype, shape, seed=len(shape))
    assert_stats(stats(x), naive.stats(x))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_no_finite_values(dtype):
    x = np.array([np.nan, np.inf, -np.inf, np.nan], np.float64).astype(dtype)
    s = stats(x)
    assert (s.count, s.nan_count, s.posinf_count, s.neginf_count, s.zero_count, s.finite_count) == (
        4,
        2,
        1,
        1,
        0,
        0,
    )
    assert all(math.isnan(v) for v in (s.min, s.max, s.mean, s.std, s.absmax))


def test_empty():
    s = stats(np.zeros(0, np.float32))
    assert s.count == 0 and math.isnan(s.min) and math.isnan(s.std)
    e = Stats.empty()
    assert dataclasses.astuple(e)[0] == 0


def test_single_value_and_negative_zero():
    s = stats(np.array(-0.0, np.float32))
    assert (s.count, s.zero_count, s.std, s.mean) == (1, 1, 0.0, 0.0)
    assert s.min == 0.0 and s.max == 0.0  # -0.0 == 0.0
    s = stats(np.array([3.5], ml_dtypes.bfloat16))
    assert (s.min, s.max, s.absmax, s.mean, s.std) == (3.5, 3.5, 3.5, 3.5, 0.0)


def test_subnormals():
    for dt in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        tiny = ml_dtypes.finfo(dt).smallest_subnormal
        x = np.array([tiny, -tiny, 2 * tiny, 0], np.float64).astype(dt)
        assert_stats(stats(x), naive.stats(x))


def test_integer_extremes_exact():
    x = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max], np.int64)
    s = stats(x)
    assert (s.min, s.max, s.absmax) == (-(2**63), 2**63 - 1, 2**63)
    x = np.array([0, 2**64 - 1], np.uint64)
    assert stats(x).max == 2**64 - 1
    assert stats(np.array([True, False, True])).mean == pytest.approx(2 / 3)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int16], ids=lambda d: np.dtype(d).name)
def test_read_only(dtype):
    x = _data(dtype, (50,))
    x.flags.writeable = False
    assert_stats(stats(x), naive.stats(x))


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.bool_], ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize("chunk", [1, 7, 1 << 22])
def test_non_contiguous(dtype, chunk):
    base = _data(dtype, (6, 7, 8), seed=5)
    views = [
        base[:, ::2],  # strided
        base.transpose(2, 0, 1),  # neither C nor F
        base.T,  # F-contiguous: read in place
        base[::-1, :, 1],
        base[..., ::3][1:],
    ]
    for v in views:
        assert_stats(stats(v, chunk=chunk), naive.stats(v))


def test_non_native_byte_order():
    assert stats(np.array(1.5, ">f4")).max == 1.5
    x = _data(np.float32, (40,)).astype(">f4")
    assert_stats(stats(x), naive.stats(x))
    y = _data(np.int64, (3, 4)).astype(">i8")[:, ::2]
    assert_stats(stats(y, chunk=2), naive.stats(y))


def test_array_likes():
    assert stats([1, 2, 3]).max == 3
    assert stats(2.5).mean == 2.5
    assert stats(np.float32(-1.0)).min == -1.0


@pytest.mark.parametrize(
    "dtype", [np.complex64, np.dtype("O"), ml_dtypes.float8_e4m3fn, np.dtype("U3")], ids=str
)
def test_unsupported_dtype(dtype):
    with pytest.raises(TypeError):
        stats(np.zeros(3, dtype))


def test_bad_tunables():
    for kw in ({"threads": 0}, {"block": 0}, {"tile": -1}, {"chunk": 0}, {"block": 2.5}):
        with pytest.raises(ValueError):
            stats(np.ones(200_000, np.float32), **kw)


def test_threads_and_blocks_agree():
    x = _data(np.float32, (300_003,), seed=1)
    ref = stats(x)
    for kw in ({"threads": 1}, {"threads": 2}, {"block": 1000}, {"block": 1000, "tile": 10}):
        s = stats(x, **kw)
        assert (s.count, s.min, s.max, s.nan_count, s.zero_count) == (
            ref.count,
            ref.min,
            ref.max,
            ref.nan_count,
            ref.zero_count,
        )
        assert s.mean == pytest.approx(ref.mean, rel=1e-12)
        assert s.std == pytest.approx(ref.std, rel=1e-12)


# --------------------------------------------------------------------------- merging


def _merge_all(parts):
    out = Stats.empty()
    for p in parts:
        out = out.merge(p)
    return out


def test_merge_identity_and_symmetry():
    a = stats(_data(np.float32, (100,), 1))
    b = stats(_data(np.float32, (50,), 2))
    assert Stats.empty().merge(a) == a
    assert a.merge(Stats.empty()) == a
    ab, ba = a.merge(b), b.merge(a)
    assert (ab.count, ab.min, ab.max, ab.nan_count) == (ba.count, ba.min, ba.max, ba.nan_count)
    assert ab.mean == pytest.approx(ba.mean, rel=1e-14)


floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    x=hnp.arrays(np.float32, st.integers(0, 300), elements=floats32),
    cuts=st.lists(st.integers(0, 300), max_size=6),
)
def test_chunked_merge_equals_whole(x, cuts):
    cuts = sorted({min(c, x.size) for c in cuts})
    parts = np.split(x, cuts)
    merged = _merge_all(stats(p) for p in parts)
    whole = stats(x)
    want = naive.stats(x)
    assert_stats(whole, want)
    # each merge recovers M2 as std**2 * n (a few ulp); 1e-10 leaves a wide margin
    assert_stats(merged, want, rtol=1e-10)


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(
        st.sampled_from([np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64)]),
        st.integers(0, 200),
        elements=st.floats(allow_nan=True, allow_infinity=True, width=16),
    ),
    cut=st.integers(0, 200),
)
def test_chunked_merge_halves(x, cut):
    a, b = x[:cut], x[cut:]
    assert_stats(stats(a).merge(stats(b)), naive.stats(x), rtol=1e-10)


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(st.sampled_from([np.dtype(d) for d in INTS]), st.integers(0, 200)),
    cut=st.integers(0, 200),
)
def test_chunked_merge_ints(x, cut):
    assert_stats(stats(x[:cut]).merge(stats(x[cut:])), naive.stats(x), rtol=1e-10)


# --------------------------------------------------------------------------- torch


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize(
    "name", ["float32", "float64", "float16", "bfloat16", "int8", "int64", "uint8", "bool"]
)
def test_torch_tensors(name):
    torch = _torch()
    dt = getattr(torch, name)
    base = torch.tensor([[1.5, -2.0, 0.0], [4.0, float("nan"), float("inf")]])
    if not dt.is_floating_point:
        base = torch.nan_to_num(base, nan=0.0, posinf=7.0)
    t = base.to(dt)
    ref = t.float().numpy() if dt == torch.bfloat16 else t.numpy()  # bf16 -> f32 is exact
    assert_stats(stats(t), naive.stats(ref))
    # non-contiguous and requires_grad
    tt = t.t()
    assert_stats(stats(tt), naive.stats(ref.T))
    if dt.is_floating_point:
        g = t.clone().requires_grad_(True)
        assert_stats(stats(g), naive.stats(ref))


def test_torch_bf16_is_zero_copy_view():
    torch = _torch()
    from engine.numerics._arrays import as_numpy

    t = torch.randn(10).to(torch.bfloat16)
    a, is_torch = as_numpy(t)
    assert is_torch and a.dtype == np.dtype(ml_dtypes.bfloat16)
    assert a.__array_interface__["data"][0] == t.data_ptr()


def test_torch_not_on_cpu():
    torch = _torch()
    from engine.errors import DeviceError

    with pytest.raises(DeviceError):
        stats(torch.empty(3, device="meta"))


def test_torch_unsupported_dtype():
    torch = _torch()
    with pytest.raises(TypeError):
        stats(torch.zeros(3, dtype=torch.complex64))
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(TypeError):
            stats(torch.zeros(3, dtype=torch.float8_e4m3fn))


# --------------------------------------------------------------------------- Accumulator


def _kind_of(dtype):
    return engine.base.dtypes.NAMES[engine.base.dtypes.from_numpy(np.dtype(dtype))]


@pytest.mark.parametrize("dtype", ALL, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [0, 1, 37, 5000])
def test_accumulator_add_in_pieces_equals_stats(dtype, n):
    from engine.statistics import Accumulator

    x = _data(dtype, (n,), seed=n)
    acc = Accumulator(_kind_of(dtype), tile=16)
    rng = np.random.default_rng(n)
    cuts = np.sort(rng.integers(0, n + 1, 4)) if n else []
    for part in np.split(x, cuts):
        acc.add(part)  # arrays
    assert_stats(acc.result(), naive.stats(x))
    raw = Accumulator(_kind_of(dtype))
    for part in np.split(x, cuts):
        raw.add(memoryview(part.view(np.uint8)))  # raw bytes
    assert_stats(raw.result(), naive.stats(x))


@pytest.mark.parametrize("dtype", ALL, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("window", [64, 192, 4096])
def test_accumulator_read_folds_file_bytes(tmp_path, dtype, window):
    import os

    from engine.statistics import Accumulator

    x = _data(dtype, (3001,), seed=7)
    raw = x.view(np.uint8).tobytes()
    path = tmp_path / "raw.bin"
    path.write_bytes(b"\x00" * 13 + raw)
    dest = np.empty(len(raw), np.uint8)
    acc = Accumulator(_kind_of(dtype))
    fd = os.open(path, os.O_RDONLY)
    try:
        done = acc.read(fd, 13, dest, window)
    finally:
        os.close(fd)
    assert done == len(raw)
    assert dest.tobytes() == raw  # the bytes land, and they are what was summarised
    assert_stats(acc.result(), naive.stats(x))


def test_accumulator_read_stops_at_end_of_file(tmp_path):
    import os

    from engine.statistics import Accumulator

    x = np.arange(1000, dtype=np.float32)
    path = tmp_path / "short.bin"
    path.write_bytes(x[:700].tobytes())  # the file ends inside the sixth 512-byte window
    acc = Accumulator("F32")
    dest = np.zeros(x.nbytes, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = acc.read(fd, 0, dest, 512)
        bad = acc.read(-1, 0, np.zeros(64, np.uint8), 64)  # a failing read folds nothing
    finally:
        os.close(fd)
    assert done == 5 * 512  # whole windows only: the partial one is left to the caller
    assert bad == 0
    assert_stats(acc.result(), naive.stats(x[: done // 4]))


def test_accumulator_rejects_bad_arguments():
    from engine.statistics import Accumulator

    with pytest.raises(TypeError, match="F8_E4M3"):
        Accumulator("F8_E4M3")
    with pytest.raises(ValueError, match="tile"):
        Accumulator("F32", tile=0)
    with pytest.raises(ValueError, match="multiple of 64"):
        Accumulator("F32").read(0, 0, np.zeros(64, np.uint8), 100)
    with pytest.raises(ValueError, match="whole number of F64"):
        Accumulator("F64").read(0, 0, np.zeros(12, np.uint8), 64)
    for bad in (np.zeros(16, np.float32), np.zeros((4, 4), np.uint8), np.zeros(32, np.uint8)[::2], b"\0" * 16):
        with pytest.raises(TypeError, match="uint8"):
            Accumulator("F32").read(0, 0, bad, 64)
    empty = Accumulator("BF16").result()
    assert empty.count == 0 and math.isnan(empty.mean) and math.isnan(empty.min)
