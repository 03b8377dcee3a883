"""The Numba kernels of engine.numerics.kernels against the NumPy oracles in tests/naive.py.

The whole suite also runs with NUMBA_DISABLE_JIT=1 (kernels as plain Python, so coverage
sees them): arrays stay small unless a test is guarded by ``needs_jit``.
"""

from __future__ import annotations

import importlib
import math
import time

import ml_dtypes
import naive
import numba
import numpy as np
import pytest
from gil import ticks_during

from engine.numerics import kernels as K
from engine.numerics import quantize as Q

S = importlib.import_module("engine.numerics.statistics")
A = importlib.import_module("engine.numerics._arrays")

JIT = not numba.config.DISABLE_JIT
# compiled kernels only: deselected (not skipped) when NUMBA_DISABLE_JIT=1, see conftest.py
needs_jit = pytest.mark.jit_only
ALL_U16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def ro(a):
    v = np.ascontiguousarray(a).view()
    v.flags.writeable = False
    return v


# --------------------------------------------------------------------------- widening


def _widen(fmt, bits, tile=None):
    out = np.empty(bits.size, np.float32)
    K.widen_half(fmt, ro(bits), out, out.view(np.uint32))
    return out


def _check_f16_widening(got_bits):
    want = naive.widen_half(ALL_U16, "F16")
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got_bits.view(np.float32)), nan)
    # every non-NaN pattern (normals, subnormals, +-0, +-Inf) converts bit-exactly
    assert np.array_equal(got_bits[~nan], want.view(np.uint32)[~nan])
    # NaN keeps its sign and payload and comes out quiet, as an IEEE conversion delivers it
    gb = got_bits[nan]
    assert np.array_equal(gb >> 31, ALL_U16[nan] >> 15)
    assert np.array_equal((gb >> 13) & 0x3FF, (ALL_U16[nan] & 0x3FF) | 0x200)
    assert np.array_equal(gb & 0x1FFF, np.zeros_like(gb))


def test_widen_f16_all_bit_patterns():
    _check_f16_widening(_widen(K.F16, ALL_U16).view(np.uint32))


def test_widen_f16_reference_all_bit_patterns():
    _check_f16_widening(np.array([K._f16_bits(h) for h in ALL_U16.tolist()], np.uint32))


def test_widen_f16_portable_path_all_bit_patterns():
    # the integer path serves hosts without a half->float instruction; run it here too
    out = np.empty(ALL_U16.size, np.float32)
    K._widen_f16_portable(ro(ALL_U16), out, out.view(np.uint32))
    _check_f16_widening(out.view(np.uint32))


def test_f16_conversion_follows_numba_target_cpu(monkeypatch):
    # a portable cache (NUMBA_CPU_NAME=generic) must not get the F16C instruction
    import platform

    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", "generic")
    monkeypatch.setattr(config, "CPU_FEATURES", "")
    arm = platform.machine().lower() in ("aarch64", "arm64")
    assert K._host_converts_half() is arm
    monkeypatch.setattr(config, "CPU_FEATURES", "+sse2,+avx,+f16c")
    assert K._host_converts_half() is (arm or platform.machine() == "x86_64")


def test_widen_f16_paths_agree_on_tiles():
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 1 << 16, 10_000, dtype=np.uint16)
    a = np.empty(bits.size, np.float32)
    b = np.empty(bits.size, np.float32)
    K.widen_half(K.F16, ro(bits), a, a.view(np.uint32))
    K._widen_f16_portable(ro(bits), b, b.view(np.uint32))
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_widen_bf16_all_bit_patterns():
    got = _widen(K.BF16, ALL_U16)
    assert np.array_equal(got.view(np.uint32), ALL_U16.astype(np.uint32) << 16)
    want = naive.widen_half(ALL_U16, "BF16")
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan], want[~nan])


def test_widen_f16_subnormals_exact():
    sub = np.arange(1, 0x400, dtype=np.uint16)
    sub = np.concatenate([sub, sub | 0x8000])
    got = _widen(K.F16, sub)
    mag = (sub & 0x3FF).astype(np.float64) * 2.0**-24
    assert np.array_equal(got, np.where(sub & 0x8000, -mag, mag).astype(np.float32))


def test_widen_writes_only_its_length():
    out = np.full(8, 7.0, np.float32)
    K.widen_half(K.BF16, ro(np.array([0x3F80, 0xBF80], np.uint16)), out, out.view(np.uint32))
    assert out.tolist() == [1.0, -1.0] + [7.0] * 6


# --------------------------------------------------------------------------- statistics kernels


def _run_float(x, block, tile, parallel):
    kind = {np.float32: "F32", np.float64: "F64"}.get(x.dtype.type)
    if kind is None:
        kind = "F16" if x.dtype == np.float16 else "BF16"
    return S._stats_flat(x.reshape(-1), kind, parallel, block, tile)


def assert_stats(got, want, rtol=1e-9):
    for f in ("count", "nan_count", "posinf_count", "neginf_count", "zero_count"):
        assert getattr(got, f) == want[f], f
    for f in ("min", "max", "absmax"):
        g, w = getattr(got, f), want[f]
        assert (math.isnan(g) and math.isnan(w)) or g == w, (f, g, w)
        assert type(g) is type(w), (f, type(g), type(w))
    for f in ("mean", "std"):
        g, w = getattr(got, f), want[f]
        if math.isnan(w):
            assert math.isnan(g), f
        elif g != w:  # equal covers both being inf (float64 variance overflow)
            # float64 accumulation: the kernels' error and numpy's pairwise sum are both a
            # few ulp times log2(n); 1e-9 relative (plus a floor for values near zero)
            # leaves a wide margin while still catching any float32 accumulation.
            scale = max(abs(w), want["absmax"] if not math.isnan(want["absmax"]) else 0.0)
            assert abs(g - w) <= rtol * scale + 1e-300, (f, g, w)


FLOATS = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]


def _special(dtype, n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10).astype(dtype)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, -np.nan], dtype=np.float64).astype(dtype)
    idx = rng.choice(n, size=min(n, 12), replace=False)
    x[idx] = np.resize(specials, idx.size)
    return x


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("block,tile", [(7, 3), (16, 16), (1000, 64), (1 << 16, 1 << 12)])
@pytest.mark.parametrize("parallel", [False, True])
def test_float_kernel_blocks_and_tiles(dtype, block, tile, parallel):
    x = _special(dtype, 517, seed=block + tile)
    assert_stats(_run_float(x, block, tile, parallel), naive.stats(x))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the oracle's np.std
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_float_kernel_min_max_sign_cases(dtype):
    cases = [
        [1.0, 2.0, 3.0],
        [-1.0, -2.0, -3.0],
        [-5.0, 2.0, 0.5],
        [0.0, 0.0],
        [-0.0, -0.0],
        [-0.0, 3.0],
        [-3.0, -0.0],
        [np.nan, -2.0, np.inf],
        [np.nan, np.nan],
        [np.inf, -np.inf],
        # float64 stops at 1e300: differences of values near its max overflow (std is inf
        # here anyway, as for numpy: the variance exceeds the float64 range)
        [min(float(ml_dtypes.finfo(dtype).max), 1e300), -min(float(ml_dtypes.finfo(dtype).max), 1e300)],
        [ml_dtypes.finfo(dtype).smallest_subnormal, -ml_dtypes.finfo(dtype).smallest_subnormal],
    ]
    for c in cases:
        x = np.array(c, np.float64).astype(dtype)
        got = _run_float(x, 2, 1, False)
        assert_stats(got, naive.stats(x))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # NUMBA_DISABLE_JIT=1
def test_float64_mean_near_overflow():
    # per-tile moments are exact here (one value per tile); the merge of +max and -max
    # must not form max - (-max) = inf in the mean (the variance does overflow, as in numpy)
    big = np.finfo(np.float64).max
    s = _run_float(np.array([big, -big, big, -big]), 4, 1, False)
    assert abs(s.mean) <= 1e-12 * big and s.std == np.inf


def test_float_kernel_tile_entirely_nonfinite():
    x = np.array([np.nan] * 8 + [1.0, 2.0] + [np.inf] * 8, np.float32)
    for tile in (1, 3, 8):
        assert_stats(_run_float(x, 8, tile, False), naive.stats(x))


INTS = [np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64]


@pytest.mark.parametrize("dtype", INTS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("block,tile", [(5, 2), (1 << 16, 1 << 12)])
@pytest.mark.parametrize("parallel", [False, True])
def test_int_kernel(dtype, block, tile, parallel):
    info = np.iinfo(dtype) if dtype is not np.bool_ else None
    rng = np.random.default_rng(3)
    if info is None:
        x = rng.integers(0, 2, 301).astype(np.bool_)
    else:
        x = rng.integers(info.min, info.max, 301, dtype=dtype, endpoint=True)
        x[:3] = [info.min, info.max, 0]
    kind = A.kind_of(x.dtype, S._INT, "test")
    got = S._stats_flat(x, kind, parallel, block, tile)
    assert_stats(got, naive.stats(x))


def test_merge_kernel_parallel_equals_serial():
    x = _special(np.float32, 5000, seed=9)
    a = _run_float(x, 64, 16, True)
    b = _run_float(x, 64, 16, False)
    assert (a.min, a.max, a.nan_count, a.zero_count) == (b.min, b.max, b.nan_count, b.zero_count)
    assert a.mean == pytest.approx(b.mean, rel=1e-12)


def test_decode_minmax_exhaustive_bf16():
    # all pairs of a few interesting BF16 patterns, decoded through the key trick
    pats = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F], np.uint16)
    for i in range(pats.size):
        for j in range(pats.size):
            x = pats[[i, j]].view(ml_dtypes.bfloat16)
            got = _run_float(x, 2, 2, False)
            w = x.astype(np.float64)
            assert (got.min, got.max) == (w.min(), w.max())


@needs_jit
def test_mean_std_accuracy_large_offset():
    # catastrophic-cancellation trap for a naive sum of squares: std 1 around 1e4 in float32
    rng = np.random.default_rng(0)
    x = (1e4 + rng.standard_normal(3_000_000)).astype(np.float32)
    got = S.stats(x)
    w = naive.stats(x)
    assert got.mean == pytest.approx(w["mean"], rel=1e-12)
    assert got.std == pytest.approx(w["std"], rel=1e-9)


@pytest.mark.parametrize("kind", ["F32", "F64", "BF16", "F16"])
def test_tiles_with_both_signs_and_a_far_mean(kind):
    # Unshifted sums are kept only when sum(x**2) <= 256 * M2.  One tiny negative value among
    # large, tightly spread positives fails that check (the block is summed again around a
    # shift); so does data of one sign far from zero: unshifted, its variance would lose ~1e-8.
    dt = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "BF16": ml_dtypes.bfloat16}[kind]
    center, spread = {"F32": (1e6, 1.0), "F64": (1e7, 1.0), "F16": (1000.0, 1.0), "BF16": (1000.0, 8.0)}[kind]
    rng = np.random.default_rng(5)
    x = (center + spread * rng.standard_normal(4096)).astype(dt)
    x[17] = dt(-1e-3)
    y = x.copy()
    y[17] = dt(center)  # one sign only, spread `spread`
    for data in (x, y):
        want = naive.stats(data)
        for tile in (4096, 64):
            got = S.stats(data, tile=tile, threads=1)
            assert_stats(got, want)
            # relative to the spread itself, not to the magnitude as assert_stats allows
            assert got.std == pytest.approx(want["std"], rel=1e-10), (tile, got.std, want["std"])


@pytest.mark.parametrize("kind", ["F32", "BF16"])
@pytest.mark.parametrize("pieces", [1, 7])
def test_accumulator_mixes_near_zero_and_far_blocks(kind, pieces):
    # Pieces near zero take the unshifted path, a far piece fails the check and is summed
    # again around a shift, and the pieces after it go to the shifted path directly; each
    # switch must leave the merged moments exact.  Also covers a NaN tile inside a block
    # that is summed unshifted, and a zero-variance far block (all values equal).
    dt = {"F32": np.float32, "BF16": ml_dtypes.bfloat16}[kind]
    rng = np.random.default_rng(11)
    near = (0.02 * rng.standard_normal(20_000)).astype(dt)
    near[5_000] = np.nan
    far = (300.0 + 0.5 * rng.standard_normal(20_000)).astype(dt)
    flat = np.full(9_000, 7.0, dt)
    data = np.concatenate([near, far, flat, near[::-1]])
    acc = S.Accumulator(kind, tile=1024)
    for part in np.array_split(data, pieces):
        acc.add(part)
    got = acc.result()
    want = naive.stats(data)
    assert_stats(got, want)
    assert got.nan_count == 2
    assert got.std == pytest.approx(want["std"], rel=1e-10)
    assert got.mean == pytest.approx(want["mean"], rel=1e-12)


def test_settle_rejects_unshifted_sums_that_cancel():
    # the check behind the unshifted path: sums of data far from zero relative to its spread
    # are refused (nothing merged), sums of data near zero are merged
    rng = np.random.default_rng(4)
    for center, accepted in ((0.0, True), (3.0, True), (1e4, False)):
        x = center + rng.standard_normal(4096)
        cnt = np.zeros(5, np.int64)
        mom = np.zeros(2)
        assert K._settle(x.size, x.sum(), (x * x).sum(), cnt, mom) is accepted
        assert cnt[0] == (x.size if accepted else 0)
        if accepted:
            assert mom[0] == pytest.approx(x.mean(), rel=1e-12, abs=1e-12)
            assert mom[1] == pytest.approx(((x - x.mean()) ** 2).sum(), rel=1e-9)
    cnt = np.zeros(5, np.int64)
    assert K._settle(3, 1e200, np.inf, cnt, np.zeros(2)) is False  # squares overflowed


@pytest.mark.parametrize("kind", ["F32", "F64"])
def test_unshifted_check_rejects_a_far_block(kind):
    # one block, of one sign and far from zero: its first tile predicts that, and it is summed
    # around a shift.  Summed unshifted the std would be off by ~1e-8 (float32 data) or
    # entirely (float64 data around 1e7).  16-bit formats cannot hold a mean far enough from
    # zero relative to their spread for this to matter.
    dt = {"F32": np.float32, "F64": np.float64}[kind]
    center = {"F32": 1e4, "F64": 1e7}[kind]
    x = (center + np.random.default_rng(2).standard_normal(50_000)).astype(dt)
    got = S.stats(x, threads=1)
    want = naive.stats(x)
    assert got.std == pytest.approx(want["std"], rel=1e-10)


# --------------------------------------------------------------------------- quantization kernels

SHAPES = [(3, 5, 7), (1, 1, 9), (4, 1, 1), (2, 3, 1), (0, 3, 2)]


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("grid", [(1, 1, 1), (2, 2, 3), (64, 64, 64), (100, 100, 4)])
def test_absmax_and_quantize_grid(kind, shape, grid):
    dt = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}[kind]
    x = (np.random.default_rng(1).standard_normal(shape) * 4).astype(dt)
    k = Q._FORMATS[kind]
    for axis in [None, 0, 1, 2]:
        outer, C, inner = Q._dims(x.shape, axis)
        oc, cc, ic = (max(1, min(g, n)) for g, n in zip(grid, (outer, C, inner), strict=True))
        g = K.Grid(outer, C, inner, oc, cc, ic)
        ki, ku = ro(x.reshape(-1)).view(k.it), ro(x.reshape(-1)).view(k.ut)
        part, bad = K.absmax_grid(ki, ku, k.keys, g, True)
        amax = part.max(axis=0).view(k.ft).astype(np.float32)
        want = naive.absmax(x, axis).reshape(-1)
        assert np.array_equal(amax, want)
        assert not bad.any()
        q0, s0 = naive.quantize_int8(x, axis)
        q = np.full(x.size, 99, np.int8)
        scale = np.ascontiguousarray(s0.reshape(-1))
        # float32 serially with whole-row tiles, F16/BF16 in parallel with tiles of 4
        K.quantize_grid(k.fmt, ro(x.reshape(-1)).view(k.xt), scale, g, 4 if k.fmt != K.FLOAT else 64, q,
                        k.fmt != K.FLOAT)
        assert np.array_equal(q.reshape(x.shape), q0)


@pytest.mark.parametrize("inner", [1, 6])
def test_absmax_grid_counts_nonfinite(inner):
    x = np.arange(4 * 3 * inner, dtype=np.float32).reshape(4, 3, inner) - 10
    x[0, 0, 0] = np.nan
    x[1, 2, -1] = np.inf
    x[3, 1, 0] = -np.inf
    x[3, 2, 0] = -np.nan
    k = Q._FORMATS["F32"]
    flat = ro(x.reshape(-1))
    part, bad = K.absmax_grid(flat.view(np.int32), flat.view(np.uint32), k.keys,
                              K.Grid(4, 3, inner, 2, 2, max(1, inner // 2)), False)
    assert bad.sum(axis=0).tolist() == [2, 1, 1]
    amax = part.max(axis=0).view(np.float32)
    assert np.array_equal(amax, naive.absmax(x, 1))


def test_quant_ties_round_half_even():
    # scale 1: rint of exact halves goes to the even neighbour, and clamps at +-127
    f = np.array(
        [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, 300, -300, np.inf, -np.inf, np.nan], np.float32
    )
    q = np.zeros(f.size, np.int8)
    K.quantize_grid(K.FLOAT, ro(f), np.ones(1, np.float32), K.Grid(1, 1, f.size, 1, 1, f.size), 5, q, False)
    assert q.tolist() == [0, 2, 2, 0, -2, -2, 126, 127, 127, -127, 127, -127, 0]


# --------------------------------------------------------------------------- GIL


@needs_jit
def test_serial_kernel_releases_the_gil():
    it, ut, sc, uc = A.float_consts("F32")
    for log2 in (22, 24, 26):  # grow the input until one call lasts long enough to observe
        x = ro(np.random.default_rng(0).standard_normal(1 << log2).astype(np.float32))

        def call(x=x):  # tile=1 makes the kernel slow enough to observe, without a huge array
            return K.stats_values(K.FLOAT, x, x.view(it), x.view(ut), sc, uc, 1 << 16, 1, False)

        call()  # compile outside the measurement
        start = time.perf_counter()
        call()
        if time.perf_counter() - start >= 0.05:
            break
    assert ticks_during(call) > 100


@needs_jit
def test_read_fold_releases_the_gil(tmp_path):
    import os

    from engine.statistics import Accumulator

    # tile=1 makes the fold slow enough to observe without a huge file
    data = np.random.default_rng(0).standard_normal(1 << 21).astype(np.float32)
    path = tmp_path / "f32.bin"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    dest = np.empty(data.nbytes, np.uint8)
    try:
        Accumulator("F32", tile=1).read(fd, 0, dest[:4096], 4096)  # compile outside the measurement
        assert ticks_during(lambda: Accumulator("F32", tile=1).read(fd, 0, dest, 1 << 16)) > 100
    finally:
        os.close(fd)


def test_the_shared_steps_are_pinned_where_the_device_kernels_are_cached():
    """kernels.fold_one, kernels.moments and kernels.chan are compiled into cuda_kernels' cached device
    kernels, and Numba's cache checks only cuda_kernels.py: its SHARED_SHA256 must name their
    source, so that an edit of a step also edits (and recompiles) the device side."""
    import hashlib
    import inspect

    from engine.numerics import cuda_kernels, kernels

    source = "".join(inspect.getsource(f) for f in (kernels.fold_one, kernels.moments, kernels.chan))
    assert hashlib.sha256(source.encode()).hexdigest() == cuda_kernels.SHARED_SHA256, (
        "kernels.fold_one, moments or chan changed: set cuda_kernels.SHARED_SHA256 to their new sha256")
