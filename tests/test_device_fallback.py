"""engine.numerics._device_fallback: statistics and int8 with the framework's operations on the device.

Where Numba's CUDA target cannot run, torch and CuPy loads compute statistics and int8 with
their own operations on the tensor's device.  Those operations are device-agnostic, so here
CPU torch tensors stand for CUDA tensors (and numpy arrays for CuPy's, whose API numpy's
is), and every result is checked against the CPU kernels (engine.stats,
engine.quantize_int8): counts, min, max, absmax, every int8 value and scale exactly; mean and
std within rounding.  The loads are run with numba-cuda's import or its compile made to fail.
"""

from __future__ import annotations

import math
import pathlib
import threading
import warnings

import ml_dtypes
import naive
import numpy as np
import pytest
from conftest import run_python
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels import assert_stats

import engine
import engine.numpy
from engine.base import dtypes
from engine.quantize import NonFiniteWarning

torch = pytest.importorskip("torch", reason="torch is an optional extra")

from engine.numerics import _device_fallback as fb  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
KIND = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.float16): "F16", BF16: "BF16"}
FLOATS = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
QFLOATS = [np.float32, np.float16, ml_dtypes.bfloat16]


def finfo(dtype):
    return ml_dtypes.finfo(dtype) if np.dtype(dtype) == BF16 else np.finfo(dtype)


def on_device(x: np.ndarray, framework: str):
    """``x`` as the fallback gets it: a torch tensor of its bytes (torch keeps bfloat16), or
    the array itself standing for a CuPy array."""
    x = np.ascontiguousarray(x)
    if framework == "torch":
        return torch.from_numpy(x.reshape(-1).view(np.uint8).copy())
    return x.copy()


OPS = {"torch": fb.TorchOps(), "cupy-api": fb.ArrayOps(np)}


def fallback_stats(x, framework, chunk=fb.CHUNK):
    ops = OPS[framework]
    kind = KIND[x.dtype]
    return fb.stats_result(ops, kind, fb.stats_parts(ops, on_device(x, "torch" if framework == "torch" else ""), kind,
                                                     chunk))


def specials(dtype, n, seed):
    """Normal values with NaN (both signs), +-Inf, +-0, subnormals and the extremes mixed in."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10).astype(dtype)
    tiny, big = float(finfo(dtype).smallest_subnormal), float(finfo(dtype).max)
    sp = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, -np.nan, tiny, -tiny, 3 * tiny, big, -big],
                  np.float64).astype(dtype)
    k = min(n, sp.size)
    x[rng.choice(n, k, replace=False)] = sp[:k]
    return x


def assert_same_stats(got, x):
    """Equal to engine.stats (the CPU kernels) and within rounding of the NumPy oracle."""
    assert_stats(got, naive.stats(x))
    cpu = engine.stats(x)
    for f in ("count", "nan_count", "posinf_count", "neginf_count", "zero_count"):
        assert getattr(got, f) == getattr(cpu, f), f
    for f in ("min", "max", "absmax"):  # bit for bit, the sign of a zero included
        a, b = getattr(got, f), getattr(cpu, f)
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), f


FRAMEWORKS = list(OPS)


# --------------------------------------------------------------------------- statistics


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # +-max: the variance overflows
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [0, 1, 6, 11, 37, 1000])
def test_stats_equal_the_cpu_kernels(framework, dtype, n):
    x = specials(dtype, n, seed=n)
    assert_same_stats(fallback_stats(x, framework), x)
    assert_same_stats(fallback_stats(x, framework, chunk=7), x)  # many passes, merged as the kernels merge


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_stats_of_zeros_subnormals_and_nonfinite_only(framework, dtype):
    tiny = float(finfo(dtype).smallest_subnormal)
    cases = [
        np.array([tiny, -tiny, 3 * tiny, 0.0, -0.0, -2 * tiny]),
        np.array([-0.0, -0.0, -0.0]),  # min and max are -0.0, as on the CPU
        np.array([0.0, -0.0]),
        np.array([np.nan, np.inf, -np.inf]),  # no finite value: NaN min/max/mean/std
        np.array([-1.5, -2.5, -0.0]),  # all negative: the keys' other branch
        np.array([7.0]),
    ]
    for c in cases:
        x = c.astype(dtype)
        assert_same_stats(fallback_stats(x, framework), x)
        assert_same_stats(fallback_stats(x, framework, chunk=1), x)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the oracle's casts of NaN payloads
@pytest.mark.parametrize("kind", ["F16", "BF16", "F32", "F64"])
def test_nan_payloads_and_signs(kind):
    it, ut, lim, ft = engine.numerics._arrays.FLOAT_FORMATS[kind]
    sign = 1 << (8 * np.dtype(ut).itemsize - 1)
    payload = np.random.default_rng(2).integers(1, sign - 1 - lim, 20, dtype=np.uint64)
    bits = np.concatenate([lim + payload, (lim + payload) | sign, [lim, lim | sign, 0, sign]]).astype(ut)
    x = bits.view(ft)
    for framework in FRAMEWORKS:
        s = fallback_stats(x, framework)
        assert (s.nan_count, s.posinf_count, s.neginf_count, s.zero_count, s.count) == (40, 1, 1, 2, 44)
        assert_same_stats(s, x)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_float64_far_from_zero_and_near_the_overflow_threshold():
    for y in (np.full(30, 1e300), np.array([1.7e308, 1.7e308, 1.6e308]), np.full(64, 1e4) + np.arange(64)):
        for framework in FRAMEWORKS:
            assert_same_stats(fallback_stats(y, framework), y)
    y = np.full(30, 1e300)
    y[::2] = -1e300  # the variance itself overflows: std inf, as on the CPU
    assert fallback_stats(y, "torch").std == engine.stats(y).std == math.inf


# --------------------------------------------------------------------------- quantization


def fallback_quantize(x: np.ndarray, axis, framework, chunk=fb.CHUNK):
    ops = OPS[framework]
    kind = KIND[x.dtype]
    shape = x.shape
    ax = None if axis is None else axis % x.ndim
    C = 1 if ax is None else shape[ax]
    if framework == "torch":
        q, scale = torch.empty(shape, dtype=torch.int8), torch.empty(C, dtype=torch.float32)
        src = on_device(x, "torch")
    else:
        q, scale, src = np.empty(shape, np.int8), np.empty(C, np.float32), x.copy()
    bad = fb.quantize(ops, src if x.size else None, kind, shape, ax, q, scale, chunk)
    return np.asarray(q), np.asarray(scale), ops.host(bad)


def assert_bits(got_q, got_scale, want_q, want_scale):
    assert np.array_equal(got_q, want_q)
    assert np.array_equal(np.asarray(got_scale, np.float32).reshape(-1).view(np.uint32),
                          np.asarray(want_scale, np.float32).reshape(-1).view(np.uint32))


def cpu_quantize(x, axis):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        return engine.quantize_int8(x, axis, on_nonfinite="clamp")


SHAPES = [((), None), ((1,), 0), ((0,), None), ((5, 0), 0), ((0, 5), 1), ((50,), None), ((7, 33), 0), ((7, 33), 1),
          ((7, 33), None), ((3, 5, 4), 1), ((3, 5, 4), -1), ((2, 3, 40), 0), ((2, 3, 40), 2)]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", QFLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize(("shape", "axis"), SHAPES, ids=str)
def test_quantize_bit_identical_to_the_cpu(framework, dtype, shape, axis):
    x = (np.random.default_rng(len(shape)).standard_normal(shape) * 3).astype(dtype)
    want = cpu_quantize(x, axis)
    for chunk in (fb.CHUNK, 7, 40, 1):  # one pass; passes cutting channels, rows and runs
        q, scale, bad = fallback_quantize(x, axis, framework, chunk)
        assert not bad.any()
        assert_bits(q, scale, *want)
        assert_bits(q, scale, *naive.quantize_int8(x, axis))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", QFLOATS, ids=lambda d: np.dtype(d).name)
def test_quantize_edge_rows(framework, dtype):
    tiny = float(finfo(dtype).smallest_subnormal)
    big = float(finfo(dtype).max)
    x = np.zeros((7, 9), np.float64)
    x[1] = tiny * np.arange(9)  # subnormals only: the scale underflows to 0, then 1
    x[2] = [big, -big, 0.5 * big, 1, -1, 0, 0, 0, 0]
    x[3] = np.linspace(-127, 127, 9) * 0.5  # exact halves: ties round to even
    x[4] = -0.0
    x[5] = np.arange(9) - 4.5
    x[6] = [np.nan, np.inf, -np.inf, 1, -2, -np.nan, 0, 3, 4]
    x = x.astype(dtype)
    for axis in (0, 1, None):
        q, scale, bad = fallback_quantize(x, axis, framework, chunk=5)
        assert bad.tolist() == [2, 1, 1]
        assert_bits(q, scale, *cpu_quantize(x, axis))
        assert_bits(q, scale, *naive.quantize_int8(x, axis))


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(QFLOATS),
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
    framework=st.sampled_from(FRAMEWORKS),
    data=st.data(),
)
def test_quantize_random_shapes(dtype, shape, framework, data):
    axis = data.draw(st.sampled_from([None, *range(-len(shape), len(shape))]))
    seed = data.draw(st.integers(0, 2**16))
    chunk = data.draw(st.sampled_from([1, 3, 16, fb.CHUNK]))
    x = (np.random.default_rng(seed).standard_normal(shape) * 10 ** data.draw(st.integers(-3, 3))).astype(dtype)
    q, scale, _ = fallback_quantize(x, axis, framework, chunk)
    assert_bits(q, scale, *cpu_quantize(x, axis))


# --------------------------------------------------------------------------- loads


class CpuAsDevice:
    """The chunk ring's operations over the emulated CUDA runtime (tests/emucudart) for
    "device" tensors that are CPU torch tensors: the ring copies into their memory."""

    _ops: list = []

    def __new__(cls):
        if not cls._ops:  # one set for the module: a ring kept between loads keeps its stream
            from emucudart import EmulatedRingOps, Emulator

            class TorchRingOps(EmulatedRingOps):
                def address(self, target) -> int:
                    return target.data_ptr() if target.numel() else 0

            cls._ops.append(TorchRingOps(Emulator()))
        return cls._ops[0]


class TorchDeviceSink:
    """A torch device sink whose device is the CPU: the fallback's torch operations run as
    they would on a GPU, on the tensors where they are."""

    name = "torch"
    on_device = True
    device = torch.device("cpu")

    def __init__(self):
        self.staged = 0
        self.lock = threading.Lock()

    def allocate_device(self, specs, per_tensor=False):
        tensors, targets = {}, {}
        for row, code, shape, nbytes in specs:
            t = torch.empty(dtypes.packed_shape(code, shape, nbytes), dtype=dtypes.torch_dtype(code))
            tensors[row] = t
            targets[row] = t.reshape(-1).view(torch.uint8)
        return tensors, targets, CpuAsDevice()


def model(rng):
    sd = {"embed.weight": rng.standard_normal((11, 24)).astype(BF16)}
    for i in range(3):
        p = f"layers.{i}."
        sd[p + "norm.weight"] = (1 + 0.1 * rng.standard_normal(24)).astype(BF16)
        sd[p + "q_proj.weight"] = rng.standard_normal((24, 24)).astype(BF16)
        sd[p + "k_proj.weight"] = rng.standard_normal((13, 24)).astype(np.float16)
        sd[p + "up_proj.weight"] = rng.standard_normal((37, 24)).astype(np.float32)
    sd["lm_head.weight"] = rng.standard_normal((11, 24)).astype(BF16)
    sd["norm.weight"] = np.ones(24, np.float64)
    sd["position_ids"] = np.arange(17, dtype=np.int64)
    sd["empty.weight"] = np.zeros((0, 5), np.float32)
    sd["layers.1.q_proj.weight"][3, 5] = np.nan
    sd["layers.2.up_proj.weight"][0, :3] = [np.inf, -np.inf, -0.0]
    return sd


@pytest.fixture
def model_file(tmp_path):
    sd = model(np.random.default_rng(0))
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file(sd, path)
    return path, sd


@pytest.fixture
def kernels_fail(monkeypatch):
    """numba-cuda's compile fails in this process (the probe's verdict where NVVM is missing)."""
    from engine.loading import kernel_probe

    monkeypatch.setattr(kernel_probe, "_KERNELS", [])
    monkeypatch.setattr(kernel_probe, "_WARNED", [])

    def probe(index=None):
        raise RuntimeError("NvvmSupportError: libNVVM cannot be found. Do `conda install cudatoolkit`")

    from engine.numerics import device

    monkeypatch.setattr(device, "probe", probe)


def load(monkeypatch, path, sink, **kw):
    import engine.loading.loader  # noqa: F401  (get_sink patched below)

    monkeypatch.setattr(engine.loading.loader, "get_sink", lambda framework, device: sink)
    return {n: (t, s) for n, t, s in engine.stream(path, framework="pt", device="cuda", stats=True, **kw)}


def no_host_copies(monkeypatch):
    """Fail on any copy of tensor data to the host (the tiny results come back by tolist)."""
    def refuse(self, *a, **k):
        raise AssertionError("a tensor went to the host")

    monkeypatch.setattr(torch.Tensor, "cpu", refuse)
    monkeypatch.setattr(torch.Tensor, "numpy", refuse)


def test_device_load_falls_back_to_the_frameworks_operations(model_file, monkeypatch, kernels_fail):
    from engine.errors import DeviceFallbackWarning
    from engine.quantize import Int8, NonFiniteWarning, QuantizedTensor

    path, sd = model_file
    spec = Int8(include=["*proj*", "lm_head.weight"], on_nonfinite="clamp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        cpu = {n: (t, s) for n, t, s in engine.stream(path, framework="np", stats=True, quantize=spec)}
    sink = TorchDeviceSink()
    no_host_copies(monkeypatch)
    with pytest.warns(DeviceFallbackWarning) as caught:
        got = load(monkeypatch, path, sink, quantize=spec, chunk_bytes=4096, threads=2)
    warned = [w for w in caught if w.category is DeviceFallbackWarning]
    assert len(warned) == 1
    message = str(warned[0].message)
    assert "libNVVM" in message and "torch operations on the device" in message
    assert 'pip install "numba-cuda[cu' in message  # the fix
    assert got.keys() == sd.keys()
    monkeypatch.undo()  # .numpy() again, for the checks
    for name, x in sd.items():
        (t, s), (tc, sc) = got[name], cpu[name]
        if x.dtype in KIND:
            assert_same_stats(s, x)
        else:  # integers: the CPU fold of the file's bytes, as before
            assert s == sc
        if isinstance(tc, QuantizedTensor):
            assert isinstance(t, QuantizedTensor) and t.axis == tc.axis and t.dtype == tc.dtype
            assert isinstance(t.q, torch.Tensor) and t.q.dtype == torch.int8  # in the sink's framework
            assert_bits(t.q.numpy(), t.scale.numpy(), tc.q, tc.scale)
        else:
            assert np.array_equal(t.reshape(-1).view(torch.uint8).numpy(), x.reshape(-1).view(np.uint8))


def test_device_load_fallback_raises_on_nonfinite(model_file, monkeypatch, kernels_fail):
    from engine.errors import DeviceFallbackWarning, NonFiniteError

    path, _ = model_file
    with pytest.warns(DeviceFallbackWarning), pytest.raises(NonFiniteError) as err:
        load(monkeypatch, path, TorchDeviceSink(), quantize="int8", chunk_bytes=4096)
    # the first of the two tensors with NaN or Inf handed out
    assert list(err.value.tensors) in (["layers.1.q_proj.weight"], ["layers.2.up_proj.weight"])
    assert err.value.path == str(path) and err.value.nan_count + err.value.posinf_count > 0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the oracle's variance of +-max
def test_stats_alone_per_axis_and_dtype_through_a_load(tmp_path, monkeypatch, kernels_fail):
    from engine.errors import DeviceFallbackWarning
    from engine.quantize import Int8

    sd = {f"w{i}.{np.dtype(d).name}": specials(d, 97, seed=i).reshape(97, 1) for i, d in enumerate(FLOATS)}
    sd.update({f"m{i}.weight": (np.random.default_rng(i).standard_normal((5, 6, 7)) * 4).astype(d)
               for i, d in enumerate(QFLOATS)})
    path = tmp_path / "d.safetensors"
    engine.numpy.save_file(sd, path)
    with pytest.warns(DeviceFallbackWarning):
        got = load(monkeypatch, path, TorchDeviceSink())
    for name, x in sd.items():
        assert_same_stats(got[name][1], x)
    for axis in (None, 0, 1, 2):
        got = load(monkeypatch, path, TorchDeviceSink(), quantize=Int8(include="m*", axis=axis), chunk_bytes=512)
        for name in (n for n in sd if n.startswith("m")):
            qt = got[name][0]
            assert_bits(qt.q.numpy(), qt.scale.numpy(), *cpu_quantize(sd[name], axis))


def test_fixes_named_for_each_cause():
    from engine.loading.kernel_probe import fallback_fix

    assert 'pip install "numba-cuda[cu' in fallback_fix("ModuleNotFoundError: No module named 'numba_cuda'")
    assert "NVVM" in fallback_fix("NvvmSupportError: libNVVM cannot be found")
    assert "numpy 2.5" in fallback_fix("AttributeError: module 'numpy' has no attribute 'row_stack'")
    assert "driver" in fallback_fix("CudaSupportError: CUDA driver library cannot be found")
    assert "pip install" in fallback_fix("SomethingElse: ?")


def test_numba_cuda_import_failing_falls_back(tmp_path):
    # a fresh interpreter where importing numba.cuda fails (numba-cuda not installed): the
    # probe says so, the load runs on torch's operations with the same results, and the
    # kernels' module is never imported
    sd = model(np.random.default_rng(3))
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file(sd, path)
    code = f"""
import sys, warnings
sys.modules["numba.cuda"] = None  # import numba.cuda raises, as where numba-cuda is not installed
sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
import numpy as np
import engine, engine.loading.loader, engine.numpy
from engine.errors import DeviceFallbackWarning
from engine.quantize import Int8
from test_device_fallback import KIND, TorchDeviceSink, assert_bits, assert_same_stats, cpu_quantize
sink = TorchDeviceSink()
engine.loading.loader.get_sink = lambda framework, device: sink
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = {{n: (t, s) for n, t, s in engine.stream({str(path)!r}, framework="pt", device="cuda", stats=True,
                                                  quantize=Int8(include="*proj*", on_nonfinite="clamp"))}}
msgs = [str(w.message) for w in caught if w.category is DeviceFallbackWarning]
assert len(msgs) == 1 and "numba.cuda" in msgs[0] and 'pip install "numba-cuda[cu' in msgs[0], msgs
assert "engine.numerics.device" not in sys.modules
sd = engine.numpy.load_file({str(path)!r})
for name, x in sd.items():
    t, s = got[name]
    if x.dtype in KIND:
        assert_same_stats(s, x)
    if "proj" in name:
        assert_bits(t.q.numpy(), t.scale.numpy(), *cpu_quantize(x, 0))
print("ok", len(got))
"""
    assert run_python(code).split() == ["ok", str(len(sd))]
