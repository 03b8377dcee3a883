"""engine.quantize_int8 / dequantize_int8: bit-identical to the NumPy oracle (tests/naive.py)."""

from __future__ import annotations

import pickle
import tracemalloc
import warnings

import ml_dtypes
import naive
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_kernels import needs_jit

import engine
from engine.errors import SafetensorError
from engine.quantize import NonFiniteError, NonFiniteWarning, dequantize_int8, quantize_int8

BF16 = np.dtype(ml_dtypes.bfloat16)
INPUTS = [np.dtype(np.float32), np.dtype(np.float16), BF16]
AXES = [None, 0, 1, 2, -1, -2, -3]


def _x(dtype, shape=(4, 5, 6), seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * rng.uniform(0.1, 50, shape[-1:])).astype(dtype)
    if x.ndim == 3 and min(x.shape) >= 3:
        x[1] = 0  # an all-zero slab: zero rows / channels along every axis
        x[2, -1, :] = 0
        x[:, :, -1] = 0
    return x


def assert_same(x, axis, **kw):
    q, s = quantize_int8(x, axis, **kw)
    q0, s0 = naive.quantize_int8(x, axis)
    assert q.dtype == np.int8 and s.dtype == np.float32
    assert q.shape == x.shape and q.flags.c_contiguous
    assert s.shape == (() if axis is None else (x.shape[axis],))
    assert np.array_equal(q, q0), np.argwhere(q != q0)[:5]
    assert np.array_equal(s.view(np.uint32), s0.reshape(s.shape).view(np.uint32))
    return q, s


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
@pytest.mark.parametrize("axis", AXES, ids=str)
def test_bit_identical_every_axis(dtype, axis):
    x = _x(dtype)
    assert_same(x, axis)
    # tiny blocks and tiles: many tasks, split channels and segments, several tiles
    assert_same(x, axis, block=4, tile=3)
    assert_same(x, axis, threads=1)


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
def test_fused_rows(dtype):
    from engine.numerics.quantize import _fusable

    x = _x(dtype, (6, 2, 150), seed=7)  # axis=0: rows of 300 contiguous elements
    assert _fusable(x, 0) and not _fusable(x, 1) and not _fusable(x[:, :1], 0)
    x[2] = 0
    x[4, 0, :3] = np.float32(1e-45).astype(dtype)
    for kw in ({}, {"block": 1}, {"block": 1000, "tile": 7}, {"threads": 1}):
        assert_same(x, 0, **kw)
    x[1, 1, 5] = np.nan
    x[3, 0, 0] = -np.inf
    with pytest.raises(NonFiniteError) as ei:
        quantize_int8(x, 0)
    assert (ei.value.nan_count, ei.value.posinf_count, ei.value.neginf_count) == (1, 0, 1)
    with pytest.warns(NonFiniteWarning):
        assert_same(x, 0, on_nonfinite="clamp")


def test_long_rows_not_fused():
    from engine.numerics.quantize import _fusable

    x = _x(np.float32, (2, 70_000), seed=8)
    assert not _fusable(x, 0)
    assert_same(x, 0)


def test_public_names():
    assert engine.quantize_int8 is quantize_int8
    assert engine.dequantize_int8 is dequantize_int8


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
def test_all_zero_tensor_and_rows(dtype):
    x = np.zeros((3, 4), dtype)
    q, s = assert_same(x, None)
    assert s == 1 and not q.any()
    x[1] = 2
    q, s = assert_same(x, 0)
    assert s.tolist() == [1.0, np.float32(2) / np.float32(127), 1.0]
    assert q[1].tolist() == [127] * 4 and not q[[0, 2]].any()


def test_underflowing_scale_is_one():
    tiny = np.float32(1e-45)  # smallest float32 subnormal: tiny / 127 rounds to 0
    x = np.array([tiny, -tiny, 0], np.float32)
    q, s = assert_same(x, None)
    assert s == 1 and not q.any()


def test_ties_round_half_to_even():
    x = np.array([127, 0.5, 1.5, 2.5, -2.5, -3.5, 126.5], np.float32)  # scale exactly 1
    q, s = assert_same(x, None)
    assert s == 1 and q.tolist() == [127, 0, 2, 2, -2, -4, 126]


def test_half_subnormals_and_extremes():
    for dt in (np.float16, BF16):
        fi = ml_dtypes.finfo(dt)
        x = np.array(
            [fi.smallest_subnormal, -fi.smallest_subnormal * 3, fi.max, -fi.max, fi.tiny], np.float64
        ).astype(dt)
        assert_same(x, None)
        assert_same(x.reshape(5, 1), 0)
        sub = np.arange(1, 0x400, dtype=np.uint16).view(np.float16) if dt == np.float16 else None
        if sub is not None:
            assert_same(sub, None)


@pytest.mark.parametrize(
    "shape,axis", [((), None), ((0,), None), ((0,), 0), ((3, 0), 0), ((3, 0), 1), ((0, 2, 3), 1)]
)
def test_empty_and_scalar(shape, axis):
    x = np.ones(shape, np.float32) * 3
    q, s = assert_same(x, axis)
    assert np.all(s == (1 if x.size == 0 else 3 / np.float32(127)))


def test_bad_arguments():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(np.exceptions.AxisError):
        quantize_int8(x, 2)
    with pytest.raises(ValueError):
        quantize_int8(x, -3)
    with pytest.raises(np.exceptions.AxisError):
        quantize_int8(np.float32(1), 0)
    with pytest.raises(ValueError):
        quantize_int8(x, on_nonfinite="ignore")
    for dt in (np.float64, np.int8, np.int32, ml_dtypes.float8_e4m3fn):
        with pytest.raises(TypeError):
            quantize_int8(x.astype(dt))
    with pytest.raises(ValueError):
        quantize_int8(x, block=0)


# --------------------------------------------------------------------------- NaN / Inf


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
def test_nonfinite_raises_with_counts_and_name(dtype):
    x = _x(dtype, (3, 4, 5))
    x[0, 0, 0] = np.nan
    x[0, 1, 1] = -np.nan
    x[2, 2, 2] = np.inf
    x[1, 3, 4] = -np.inf
    with pytest.raises(NonFiniteError) as ei:
        quantize_int8(x, 1, name="model.layers.0.w")
    e = ei.value
    assert isinstance(e, ValueError) and isinstance(e, SafetensorError)
    assert (e.nan_count, e.posinf_count, e.neginf_count) == (2, 1, 1)
    assert e.tensors == ("model.layers.0.w",) and e.reason == "NonFinite"
    assert "model.layers.0.w" in str(e) and "2 NaN" in str(e)
    e2 = pickle.loads(pickle.dumps(e))
    assert (type(e2), e2.nan_count, str(e2)) == (NonFiniteError, 2, str(e))


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
@pytest.mark.parametrize("axis", [None, 0, 2])
def test_nonfinite_clamp(dtype, axis):
    x = _x(dtype, (3, 4, 5))
    x[0, 0, 0] = np.nan
    x[2, 2, 2] = np.inf
    x[1, 3, 4] = -np.inf
    with pytest.warns(NonFiniteWarning) as rec:
        q, s = assert_same(x, axis, on_nonfinite="clamp", name="w")
    w = rec[0].message
    assert (w.name, w.nan_count, w.posinf_count, w.neginf_count) == ("w", 1, 1, 1)
    assert (q[0, 0, 0], q[2, 2, 2], q[1, 3, 4]) == (0, 127, -127)


def test_only_nonfinite_clamp():
    x = np.array([np.nan, np.inf, -np.inf, np.nan], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        q, s = assert_same(x, None, on_nonfinite="clamp")
    assert s == 1 and q.tolist() == [0, 127, -127, 0]


# --------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
@pytest.mark.parametrize("chunk", [1, 10, 1 << 22])
def test_non_contiguous_every_axis(dtype, chunk):
    base = _x(dtype, (6, 5, 8), seed=3)
    views = [base.transpose(2, 0, 1), base[:, ::2, 1:], base.T, base[::-1], base[..., ::3]]
    for v in views:
        for axis in AXES:
            assert_same(v, axis, chunk=chunk)


def test_read_only_and_big_endian():
    x = _x(np.float32)
    x.flags.writeable = False
    assert_same(x, 1)
    assert_same(x.astype(">f4"), 0)


def test_threads_agree():
    x = _x(np.float32, (64, 50, 40), seed=4)
    for axis in (None, 0, 2):
        q1, s1 = quantize_int8(x, axis, threads=1, block=1000)
        q2, s2 = quantize_int8(x, axis, threads=2, block=1000)
        assert np.array_equal(q1, q2) and np.array_equal(s1, s2)


@settings(max_examples=60, deadline=None)
@given(
    x=hnp.arrays(
        st.sampled_from(INPUTS),
        hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=6),
        elements=st.floats(width=16, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    ),
    axis=st.integers(-3, 3) | st.none(),
    block=st.sampled_from([3, 64, 1 << 16]),
)
def test_hypothesis_bit_identical(x, axis, block):
    if axis is not None and not -x.ndim <= axis < x.ndim:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        assert_same(x, axis, on_nonfinite="clamp", block=block)


@settings(max_examples=30, deadline=None)
@given(
    x=hnp.arrays(
        np.float32,
        st.integers(1, 200),
        elements=st.floats(-float(np.float32(1e38)), float(np.float32(1e38)), width=32),
    ),
)
def test_round_trip_error_bound(x):
    q, s = quantize_int8(x)
    back = dequantize_int8(q, s)
    # |x - q*s| <= s/2 from rounding; plus the float32 errors of x/s and q*s
    assert np.all(np.abs(back.astype(np.float64) - x) <= 0.5 * float(s) * (1 + 1e-5) + 1e-44)


# --------------------------------------------------------------------------- memory


@needs_jit
def test_no_float32_copy_of_the_input():
    x = np.random.default_rng(0).standard_normal((1024, 2048)).astype(BF16)
    quantize_int8(x[:2], 0)  # compile
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        q, s = quantize_int8(x, 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # numpy allocations: the int8 output and small per-channel vectors (a float32 copy
    # would be 8 MiB, the output is 2 MiB)
    assert peak < q.nbytes + (1 << 18), peak


# --------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("out", INPUTS, ids=str)
@pytest.mark.parametrize("axis", AXES, ids=str)
def test_dequantize_bit_identical(out, axis):
    x = _x(np.float32)
    q, s = quantize_int8(x, axis)
    got = dequantize_int8(q, s, axis, dtype=out)
    want = naive.dequantize_int8(q, s, axis, out)
    assert got.dtype == out and got.shape == x.shape
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_dequantize_overflow_near_float32_max():
    # scale = fl(max / 127) rounds up, so 127 * scale exceeds the float32 range: documented
    big = np.finfo(np.float32).max
    q, s = quantize_int8(np.array([big, 1.0], np.float32))
    with np.errstate(over="ignore"):
        assert np.isposinf(dequantize_int8(q, s)[0])


def test_dequantize_errors():
    q = np.zeros((2, 3), np.int8)
    with pytest.raises(ValueError):
        dequantize_int8(q, np.ones(2, np.float32))  # per tensor needs one scale
    with pytest.raises(ValueError):
        dequantize_int8(q, np.ones(3, np.float32), axis=0)
    with pytest.raises(TypeError):
        dequantize_int8(q.astype(np.int16), np.float32(1))
    with pytest.raises(TypeError):
        dequantize_int8(q, np.float32(1), dtype=np.float64)


# --------------------------------------------------------------------------- torch


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_torch_round_trip(name):
    torch = pytest.importorskip("torch")
    dt = getattr(torch, name)
    t = torch.randn(6, 5).to(dt).t()  # non-contiguous
    q, s = quantize_int8(t, 0)
    assert isinstance(q, torch.Tensor) and q.dtype == torch.int8 and s.dtype == torch.float32
    ref = t.float().numpy() if dt == torch.bfloat16 else t.numpy()
    q0, s0 = naive.quantize_int8(ref.astype(t.numpy().dtype if dt != torch.bfloat16 else BF16), 0)
    assert np.array_equal(q.numpy(), q0) and np.array_equal(s.numpy(), s0)
    back = dequantize_int8(q, s, 0, dtype=dt)
    assert isinstance(back, torch.Tensor) and back.dtype == dt
    want = naive.dequantize_int8(q0, s0, 0, BF16 if dt == torch.bfloat16 else ref.dtype)
    assert np.array_equal(
        back.view(torch.int16 if dt != torch.float32 else torch.int32).numpy(),
        want.view(np.int16 if dt != torch.float32 else np.int32),
    )


# -- Int8's include/exclude globs: one compiled expression, fnmatchcase's answers -------------------

_GLOB_CHARS = "ab.*?[]!-\\|^()~\n0"


@settings(max_examples=400, deadline=None)
@given(name=st.text(_GLOB_CHARS, max_size=12),
       patterns=st.lists(st.text(_GLOB_CHARS, max_size=8), max_size=4))
def test_glob_matching_agrees_with_fnmatchcase(name, patterns):
    import fnmatch

    from engine.numerics.quantize import _matches

    assert _matches(name, patterns) == any(fnmatch.fnmatchcase(name, p) for p in patterns)
    assert _matches(name, iter(patterns)) == _matches(name, tuple(patterns))  # any iterable, as before


def test_glob_matching_is_case_sensitive_and_empty_lists_match_nothing():
    from engine.numerics.quantize import _matches

    assert _matches("model.Embed.weight", ["*Embed*"]) and not _matches("model.embed.weight", ["*Embed*"])
    assert not _matches("anything", []) and not _matches("", [])
