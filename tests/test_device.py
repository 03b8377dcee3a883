"""engine.device and its CUDA kernels against the NumPy oracles and the CPU kernels.

Runs on a GPU, or on the CPU under Numba's CUDA simulator: CI runs this module in a pass of
its own with ``NUMBA_ENABLE_CUDASIM=1`` (the flag must be set before Numba is imported, so
the main pass, which imports Numba without it, skips here).  Under the simulator every GPU
thread is a Python thread: arrays stay small and launches use a few threads and blocks,
which also makes every tensor span several blocks and several passes of each thread.

The simulator is made to refuse what a GPU refuses (``simulated_gpu.install``): device
functions called from the host, kernels called without a launch configuration, launch sizes
beyond a GPU's limits.  Device functions are tested through small kernels that call them.
"""

from __future__ import annotations

import math

import ml_dtypes
import naive
import numba
import numpy as np
import pytest
import simulated_gpu
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels import FLOATS, assert_stats

import engine
from engine.errors import NonFiniteError

SIM = bool(numba.config.ENABLE_CUDASIM)
if not SIM:
    from numba import cuda

    GPU = cuda.is_available()
else:
    from numba import cuda

    GPU = False
    simulated_gpu.install()  # refuse what a GPU refuses, in this module and every one run beside it

pytestmark = pytest.mark.skipif(
    not (SIM or GPU),
    reason="needs an NVIDIA GPU, or NUMBA_ENABLE_CUDASIM=1 set before Numba is imported (CI's simulator pass)",
)

if SIM or GPU:
    from engine.numerics import cuda_kernels as ck
    from engine.numerics import device as D

    LAUNCH = D.LaunchConfig(threads=8, blocks=3)
    TINY = D.LaunchConfig(threads=2, blocks=1)

    # device functions run only inside kernels, on a GPU as under the (patched) simulator:
    # these kernels call them, a few threads striding the inputs

    @cuda.jit
    def half_values(fmt, u, out):
        i = cuda.grid(1)
        while i < u.size:
            out[i] = ck._half_value(fmt, u[i])
            i += cuda.gridsize(1)

    @cuda.jit
    def decoded(bits, mbits, bias, out):
        i = cuda.grid(1)
        while i < bits.size:
            out[i] = ck._decode(bits[i], mbits, bias)
            i += cuda.gridsize(1)

STRIDE = (4, 32)  # blocks, threads of the decoding kernels: every thread takes many elements

KIND = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.float16): "F16",
        np.dtype(ml_dtypes.bfloat16): "BF16"}
BF16 = np.dtype(ml_dtypes.bfloat16)


def finfo(dtype):
    return ml_dtypes.finfo(dtype) if np.dtype(dtype) == BF16 else np.finfo(dtype)


def dev(a: np.ndarray):
    """Device copy of a host array (the array itself under the simulator)."""
    a = np.ascontiguousarray(a)
    if SIM:
        return a.copy()
    return cuda.to_device(a)


def host(d) -> np.ndarray:
    return np.asarray(d) if SIM else d.copy_to_host()


def alloc(shape, dtype):
    return np.empty(shape, dtype) if SIM else cuda.device_array(shape, dtype)


def device_stats(x: np.ndarray, cuts=(), launch=None):
    """Stats of ``x`` folded on the device in pieces cut at element indices ``cuts``."""
    kind = KIND[x.dtype]
    acc = D.DeviceAccumulator(kind, launch or LAUNCH)
    b = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    edges = [0, *(c * x.itemsize for c in cuts), b.size]
    for lo, hi in zip(edges, edges[1:], strict=False):
        if hi > lo:
            acc.add(dev(b[lo:hi]))
    return acc.result()


def specials(dtype, n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10).astype(dtype)
    sp = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, -np.nan], np.float64).astype(dtype)
    k = min(n, sp.size)
    x[rng.choice(n, k, replace=False)] = sp[:k]
    return x


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_half_decoding_every_finite_pattern(kind):
    # the device's exact rebuild of a value from its bits, against numpy/ml_dtypes widening
    u = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = naive.widen_half(u, kind)
    finite = np.isfinite(want)
    fmt = ck.F16 if kind == "F16" else ck.BF16
    out = alloc(int(finite.sum()), np.float32)
    half_values[STRIDE](fmt, dev(u[finite]), out)
    assert np.array_equal(host(out).view(np.uint32), want[finite].view(np.uint32))


def test_decoding_float32_keys_including_subnormals():
    rng = np.random.default_rng(1)
    bits = np.concatenate([np.arange(0, 300, dtype=np.uint32), rng.integers(0, 0x7F800000, 3000, dtype=np.uint32),
                           np.array([0x007FFFFF, 0x00800000, 0x7F7FFFFF], np.uint32)])
    out = alloc(bits.size, np.float32)
    decoded[STRIDE](dev(bits), 23, 127, out)
    assert np.array_equal(host(out).view(np.uint32), bits)


# the three calls the simulator let pass and a GPU refused (issue 37): a device function
# called from the host
HOST_CALLS = {
    "half_value[F16]": lambda: ck._half_value(ck.F16, np.uint16(0x3C00)),
    "half_value[BF16]": lambda: ck._half_value(ck.BF16, np.uint16(0x3F80)),
    "decode[F32]": lambda: ck._decode(np.uint32(0x3F800000), 23, 127),
}


@pytest.mark.parametrize("call", list(HOST_CALLS))
def test_device_functions_refuse_host_calls(call):
    with pytest.raises(ValueError, match="Kernel launch configuration was not specified"):
        HOST_CALLS[call]()


def test_kernels_refuse_calls_without_a_launch_configuration():
    a = dev(np.ones(4, np.int32))
    ck.fill_zero[1, 4](a)
    assert not host(a).any()
    with pytest.raises(ValueError, match="Kernel launch configuration was not specified"):
        ck.fill_zero(a)  # the configuration of the launch before is not kept


@pytest.mark.skipif(not SIM, reason="the simulator's own limits check (a GPU refuses natively)")
@pytest.mark.parametrize("config", [(0, 4), (1, 2048), ((1, 65536), 4), ((1, 1), (32, 64)), (2**31, 1)], ids=str)
def test_the_simulator_refuses_launch_sizes_a_gpu_refuses(config):
    with pytest.raises(ValueError):
        ck.fill_zero[config]


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [0, 1, 6, 37, 150])
def test_stats_against_oracle_and_cpu(dtype, n):
    x = specials(dtype, n, seed=n)
    got = device_stats(x)
    assert_stats(got, naive.stats(x))
    cpu = engine.stats(x)
    for f in ("count", "nan_count", "posinf_count", "neginf_count", "zero_count"):
        assert getattr(got, f) == getattr(cpu, f)
    for f in ("min", "max", "absmax"):
        a, b = getattr(got, f), getattr(cpu, f)
        assert (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_stats_of_pieces_split_at_odd_offsets(dtype):
    x = specials(dtype, 97, seed=3)
    whole = naive.stats(x)
    assert_stats(device_stats(x, cuts=(1, 8, 9, 50, 95)), whole)
    # two accumulators (two streams of a load) merged on the host, as the loads merge them
    a, b = x[:33], x[33:]
    assert_stats(device_stats(a).merge(device_stats(b)), whole)


@pytest.mark.parametrize("kind", ["F16", "BF16", "F32", "F64"])
def test_nan_payloads_and_signs_are_nan(kind):
    it, ut, lim, ft = engine.numerics._arrays.FLOAT_FORMATS[kind]
    nbits = 8 * np.dtype(ut).itemsize
    sign = 1 << (nbits - 1)
    rng = np.random.default_rng(2)
    payload = rng.integers(1, sign - 1 - lim, 20, dtype=np.uint64)
    bits = np.concatenate([lim + payload, (lim + payload) | sign, [lim, lim | sign, 0, sign]]).astype(ut)
    s = device_stats(bits.view(ft))
    assert (s.nan_count, s.posinf_count, s.neginf_count, s.zero_count, s.count) == (40, 1, 1, 2, 44)
    assert s.min == 0.0 and s.max == 0.0 and s.std == 0.0


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_subnormals_and_zeros(dtype):
    tiny = float(finfo(dtype).smallest_subnormal)
    x = np.array([tiny, -tiny, 3 * tiny, 0.0, -0.0, -2 * tiny], np.float64).astype(dtype)
    assert_stats(device_stats(x), naive.stats(x))
    z = np.zeros(40, dtype)
    z[::3] = -0.0
    s = device_stats(z)
    assert (s.zero_count, s.min, s.max, s.mean, s.std) == (40, 0.0, 0.0, 0.0, 0.0)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the variance of +-1e300 is inf
def test_one_thread_one_block_and_far_from_zero():
    x = (np.random.default_rng(4).standard_normal(64) + 1e4).astype(np.float32)
    assert_stats(device_stats(x, launch=TINY), naive.stats(x))
    y = np.full(30, 1e300)
    y[::2] = -1e300
    assert_stats(device_stats(y), naive.stats(y))


def test_an_accumulator_block_holds_many_tensors_statistics():
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float64):
        kind = KIND[np.dtype(dtype)]
        these = [specials(dtype, n, seed) for seed, n in enumerate((300, 1, 77))]
        block = D.AccumulatorBlock(3, kind, LAUNCH)
        taken = []
        for x in these:
            acc, i = block.take()
            acc.add(dev(x.view(np.uint8)))
            taken.append(i)
        assert taken == [0, 1, 2] and block.full()
        with pytest.raises(ValueError, match="all taken"):
            block.take()
        # rows brought over for a span of the block: each accumulator's own, none shared
        rows = block.queue_rows(1, 3)
        cuda.synchronize()
        for i in (1, 2):
            assert_stats(block.merge_rows(i, 1, rows), naive.stats(these[i]))
        rows = block.queue_rows(0, 1)
        cuda.synchronize()
        assert_stats(block.merge_rows(0, 0, rows), naive.stats(these[0]))
    with pytest.raises(TypeError, match="not I32"):
        D.AccumulatorBlock(2, "I32", LAUNCH)


def test_device_stats_of_an_array():
    x = specials(BF16, 40, seed=5)
    if SIM:
        assert_stats(D.device_stats(x, launch=LAUNCH), naive.stats(x))
    with pytest.raises(TypeError, match="not I32"):
        D.DeviceAccumulator("I32")


def test_launch_config_is_checked():
    for bad in (dict(threads=3), dict(threads=0), dict(threads=2 * ck.MAX_THREADS), dict(blocks=0),
                dict(blocks=D.MAX_GRID[1] + 1)):
        with pytest.raises(ValueError):
            D.LaunchConfig(**bad)


def test_launches_are_checked_against_the_grid_limits():
    from engine.errors import DeviceError

    D.check_launch((D.MAX_GRID[0], D.MAX_GRID[1]), D.MAX_BLOCK_THREADS)
    for grid, threads in [(0, 1), (D.MAX_GRID[0] + 1, 1), ((1, D.MAX_GRID[1] + 1), 1), (1, 0),
                          (1, D.MAX_BLOCK_THREADS + 1), ((1, 1, 1, 1), 1)]:
        with pytest.raises(DeviceError):
            D.check_launch(grid, threads)
    with pytest.raises(DeviceError):  # before anything runs
        D._launch(ck.fill_zero, (D.MAX_GRID[0] + 1, 1, 0), dev(np.ones(1, np.int32)))


@pytest.mark.parametrize("launch", [(256, 264), (256, D.MAX_GRID[1]), (1, D.MAX_GRID[1]), (8, 3)] if SIM or GPU
                         else [], ids=str)
def test_quantization_grids_stay_within_the_limits(launch):
    lc = D.LaunchConfig(*launch)
    # shapes of up to ~2**37 elements (a whole H200): long and short runs, many channels
    for outer, C, inner in [(1, 1, 2**37), (2**36, 2, 1), (1, 2**37 // 4096, 4096), (2**30, 128, 1),
                            (2**35, 3, 1), (7, 5, 1), (1, 1, 1), (2**20, 2**17, 1)]:
        kernel, grid, step = D.absmax_grid(outer, C, inner, lc)
        D.check_launch(grid, lc.threads)
        if kernel == "columns":  # every (outer, column) is covered by one block's slab
            bx, by = grid
            assert bx * lc.threads >= C * inner and by * step >= outer


@pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU (its own limits)")
def test_grid_limits_are_the_devices():
    d = cuda.get_current_device()
    assert D.MAX_GRID == (d.MAX_GRID_DIM_X, d.MAX_GRID_DIM_Y, d.MAX_GRID_DIM_Z)
    assert D.MAX_BLOCK_THREADS == d.MAX_THREADS_PER_BLOCK


# --------------------------------------------------------------------------- quantization


def device_quantize(x: np.ndarray, axis, launch=None, on_nonfinite="raise"):
    kind = KIND[x.dtype]
    shape = x.shape
    ax = None if axis is None else axis % x.ndim
    C = 1 if ax is None else shape[ax]
    q, scale = alloc(math.prod(shape), np.int8), alloc(C, np.float32)
    bad = D.DeviceQuantizer(launch or LAUNCH).quantize(dev(x.reshape(-1).view(np.uint8)), kind, shape, ax, q, scale)
    return host(q).reshape(shape), host(scale), bad


def assert_bits(got_q, got_scale, want_q, want_scale):
    assert np.array_equal(got_q, want_q)
    assert np.array_equal(np.asarray(got_scale, np.float32).reshape(-1).view(np.uint32),
                          np.asarray(want_scale, np.float32).reshape(-1).view(np.uint32))


QFLOATS = [np.float32, np.float16, ml_dtypes.bfloat16]
SHAPES = [((), None), ((1,), 0), ((0,), None), ((5, 0), 0), ((0, 5), 1), ((50,), None), ((7, 33), 0), ((7, 33), 1),
          ((7, 33), None), ((3, 5, 4), 1), ((3, 5, 4), -1), ((2, 3, 40), 0)]


@pytest.mark.parametrize("dtype", QFLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize(("shape", "axis"), SHAPES, ids=str)
def test_quantize_bit_identical_to_oracle_and_cpu(dtype, shape, axis):
    x = (np.random.default_rng(len(shape)).standard_normal(shape) * 3).astype(dtype)
    q, scale, bad = device_quantize(x, axis)
    assert not bad.any()
    assert_bits(q, scale, *naive.quantize_int8(x, axis))
    assert_bits(q, scale, *engine.quantize_int8(x, axis))


def test_quantize_into_counts_and_keys_zeroed_by_the_caller():
    x = specials(np.float32, 7 * 33, 5).reshape(7, 33)
    block = dev(np.full(64, -1, np.int64))
    D.zero(block)
    counts, keys = block[:3], block[3:3 + 17].view(np.uint32)[:33]
    q, scale = alloc(x.size, np.int8), alloc(33, np.float32)
    got = D.DeviceQuantizer(LAUNCH).launch_quantize(dev(x.reshape(-1).view(np.uint8)), "F32", x.shape, 1, q, scale,
                                                    counts=counts, keys=keys)
    cuda.synchronize()
    assert got is counts and host(counts).tolist() == [int(np.isnan(x).sum()), int((x == np.inf).sum()),
                                                       int((x == -np.inf).sum())]
    want = engine.quantize_int8(x, 1, on_nonfinite="clamp")
    assert_bits(host(q).reshape(x.shape), host(scale), *want)
    with pytest.raises(ValueError, match="come together"):
        D.DeviceQuantizer(LAUNCH).launch_quantize(dev(x.reshape(-1).view(np.uint8)), "F32", x.shape, 1, q, scale,
                                                  counts=counts)
    with pytest.raises(ValueError, match="keys of 33"):
        D.DeviceQuantizer(LAUNCH).launch_quantize(dev(x.reshape(-1).view(np.uint8)), "F32", x.shape, 1, q, scale,
                                                  counts=counts, keys=keys[:5])


@pytest.mark.parametrize("dtype", QFLOATS, ids=lambda d: np.dtype(d).name)
def test_quantize_edge_rows(dtype):
    tiny = float(finfo(dtype).smallest_subnormal)
    big = float(finfo(dtype).max)
    x = np.zeros((6, 9), np.float64)
    x[1] = tiny * np.arange(9)  # subnormals only: scale underflows to 0, then 1
    x[2] = [big, -big, 0.5 * big, 1, -1, 0, 0, 0, 0]
    x[3] = np.linspace(-127, 127, 9) * 0.5  # exact halves: ties round to even
    x[4] = -0.0
    x[5] = np.arange(9) - 4.5
    x = x.astype(dtype)
    for axis in (0, 1, None):
        q, scale, _ = device_quantize(x, axis)
        assert_bits(q, scale, *naive.quantize_int8(x, axis))


@pytest.mark.parametrize("dtype", QFLOATS, ids=lambda d: np.dtype(d).name)
def test_nonfinite_counted_clamped_and_raised(dtype):
    x = np.array([[1, np.nan, np.inf, 2], [-np.inf, 2, 3, -np.nan], [0, 0, 0, 0]], np.float64).astype(dtype)
    q, scale, bad = device_quantize(x, 0)
    assert bad.tolist() == [2, 1, 1]
    assert_bits(q, scale, *naive.quantize_int8(x, 0))
    if SIM:
        with pytest.raises(NonFiniteError) as err:
            D.quantize_int8_device(x, 0, launch=LAUNCH, name="w")
        assert (err.value.nan_count, err.value.posinf_count, err.value.neginf_count) == (2, 1, 1)
        qt = D.quantize_int8_device(x, 1, launch=LAUNCH, on_nonfinite="clamp")
        assert qt.axis == 1 and qt.dtype == KIND[np.dtype(dtype)]
        assert_bits(qt.q, qt.scale, *naive.quantize_int8(x, 1))
        qt = D.quantize_int8_device(x[2], None, launch=LAUNCH)
        assert qt.scale.shape == () and qt.axis is None


@settings(max_examples=15, deadline=None)
@given(
    dtype=st.sampled_from(QFLOATS),
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
    data=st.data(),
)
def test_quantize_random_shapes(dtype, shape, data):
    axis = data.draw(st.sampled_from([None, *range(-len(shape), len(shape))]))
    seed = data.draw(st.integers(0, 2**16))
    x = (np.random.default_rng(seed).standard_normal(shape) * 10 ** data.draw(st.integers(-3, 3))).astype(dtype)
    launch = data.draw(st.sampled_from([LAUNCH, TINY, D.LaunchConfig(threads=4, blocks=2)]))
    q, scale, _ = device_quantize(x, axis, launch)
    assert_bits(q, scale, *naive.quantize_int8(x, axis))


# --------------------------------------------------------------------------- the PTX lane's signatures


def test_every_launch_is_compiled_by_the_ptx_lane(monkeypatch):
    # scripts/ptx_lane.py compiles a table of signatures for a GPU without one: record the
    # argument types of every launch the device code makes here and check each is in it
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "scripts" / "ptx_lane.py"
    spec = importlib.util.spec_from_file_location("ptx_lane", path)
    lane = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lane)
    table = {(name, sig) for name, _, sig in lane.signatures()}
    seen = set()
    launch = D._launch

    def recording(kernel, config, *args):
        seen.add((kernel.__name__, tuple(numba.typeof(a) for a in args)))
        launch(kernel, config, *args)

    monkeypatch.setattr(D, "_launch", recording)
    D.probe()
    for dtype in FLOATS:
        device_stats(specials(dtype, 20, seed=1))
    for dtype in QFLOATS:
        x = (np.random.default_rng(0).standard_normal((3, 5, 20)) * 3).astype(dtype)
        for axis in (None, 0, 1, 2):  # long runs and short runs
            device_quantize(x, axis)
    names = {name for name, _ in seen}
    assert names == {name for name, _ in table}  # every kernel launched, every kernel compiled
    assert seen <= table, sorted(map(str, seen - table))
