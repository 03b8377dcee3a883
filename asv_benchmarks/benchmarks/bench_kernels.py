"""Kernels (fused statistics, int8 quantization) against their NumPy and torch equivalents.

Every suite takes an ``impl`` parameter: ``engine`` (the Numba kernels), ``numpy`` and
``torch`` (what a user would write without the engine: the separate
``min/max/mean/std/isnan/isinf`` calls the issue measured, or the quantization formula in
array operations).  ``KernelSpeedup`` tracks baseline/engine time ratios directly.

Sizes are moderate (64 MiB of F32) so that ``asv run --python=same --quick`` stays short
on two cores; ``scripts/bench_kernels.py`` measures the issue's full sizes (1 GiB F32,
512 MiB BF16).  Numba compiles on first call; every ``setup`` makes one small untimed call
of the same signature first (the compiled code is also cached on disk).

The baselines live here as plain functions so that ``scripts/bench_kernels.py`` times
exactly the same code.
"""

import os
import statistics
import time

import numpy as np

from . import common

common.ensure_engine_importable()

F32_ELEMS = 1 << 24  # 64 MiB of float32
BF16_ELEMS = 1 << 24  # 32 MiB of bfloat16
ROWS = 4096  # quantization input: ROWS x (F32_ELEMS // ROWS)


# --------------------------------------------------------------------------- data


def make_data(dtype: str, n: int, seed: int = 0) -> np.ndarray:
    """Normal values in float32, as ``dtype`` ("F32", "BF16" or "F16"), without a float64
    intermediate (the full-size script makes 1 GiB of it)."""
    import ml_dtypes

    x = np.random.default_rng(seed).standard_normal(n, dtype=np.float32)
    if dtype == "F32":
        return x
    return x.astype(ml_dtypes.bfloat16 if dtype == "BF16" else np.float16)


def to_torch(a: np.ndarray):
    """Zero-copy torch tensor of a numpy array (bfloat16 through an int16 view)."""
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# --------------------------------------------------------------------------- baselines


def numpy_stats(a):
    """The separate NumPy calls (on the ml_dtypes array for BF16, as the issue did)."""
    return a.min(), a.max(), a.mean(), a.std(), int(np.isnan(a).sum()), int(np.isinf(a).sum())


def torch_stats(t):
    """The separate torch calls the issue measured."""
    return t.min(), t.max(), t.mean(), t.std(), int(t.isnan().sum()), int(t.isinf().sum())


def numpy_quantize(x, axis):
    """The quantization formula in NumPy array operations (float32 temporaries)."""
    xf = x.astype(np.float32, copy=False)
    amax = np.abs(xf).max(axis=None if axis is None else 1 - axis, keepdims=axis is not None)
    scale = amax.astype(np.float32) / np.float32(127)
    scale = np.where(scale == 0, np.float32(1), scale).astype(np.float32)
    q = np.clip(np.rint(xf / scale), -127, 127).astype(np.int8)
    return q, scale


def torch_quantize(t, axis):
    """The quantization formula in torch operations (``torch.round`` is half-to-even)."""
    import torch

    tf = t.float()
    amax = tf.abs().max() if axis is None else tf.abs().amax(dim=1 - axis, keepdim=True)
    scale = amax / 127.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(tf / scale), -127, 127).to(torch.int8)
    return q, scale


def engine_stats(a):
    import engine

    return engine.stats(a)


def engine_quantize(x, axis):
    import engine

    return engine.quantize_int8(x, axis)


def stats_op(impl: str, a: np.ndarray):
    """The operation to time for ``impl`` on ``a``, warmed up (compiled) on a slice."""
    if impl == "engine":
        engine_stats(a[:1000])
        return lambda: engine_stats(a)
    if impl == "torch":
        t = to_torch(a)
        torch_stats(t[:1000])
        return lambda: torch_stats(t)
    return lambda: numpy_stats(a)


def quantize_op(impl: str, x: np.ndarray, axis):
    if impl == "engine":
        engine_quantize(x[:2], axis)
        return lambda: engine_quantize(x, axis)
    if impl == "torch":
        t = to_torch(x)
        torch_quantize(t[:2], axis)
        return lambda: torch_quantize(t, axis)
    return lambda: numpy_quantize(x, axis)


def trim_heap() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim``), so that a peak-RSS
    measurement is not hidden by pages an earlier run freed; no-op elsewhere."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------- suites


class Stats(common.OneCallPerSample):
    """``engine.stats`` vs the separate NumPy / torch reductions."""

    param_names = ["dtype", "impl"]
    params = [["F32", "BF16", "F16"], ["engine", "numpy", "torch"]]

    def setup(self, dtype, impl):
        if impl == "torch" and not _have_torch():
            raise NotImplementedError("torch is not installed")
        self.a = make_data(dtype, F32_ELEMS if dtype == "F32" else BF16_ELEMS)
        self.op = stats_op(impl, self.a)

    def time_stats(self, dtype, impl):
        self.op()

    def peakmem_stats(self, dtype, impl):
        self.op()

    def track_gbps(self, dtype, impl):
        t0 = time.perf_counter()
        self.op()
        return self.a.nbytes / (time.perf_counter() - t0) / 1e9

    track_gbps.unit = "GB/s"


class Quantize(common.OneCallPerSample):
    """``engine.quantize_int8`` per tensor and per row vs NumPy / torch array code."""

    param_names = ["dtype", "granularity", "impl"]
    params = [["F32", "BF16", "F16"], ["tensor", "row"], ["engine", "numpy", "torch"]]

    def setup(self, dtype, granularity, impl):
        if impl == "torch" and not _have_torch():
            raise NotImplementedError("torch is not installed")
        self.x = make_data(dtype, F32_ELEMS).reshape(ROWS, -1)
        self.op = quantize_op(impl, self.x, None if granularity == "tensor" else 0)

    def time_quantize(self, dtype, granularity, impl):
        self.op()

    def peakmem_quantize(self, dtype, granularity, impl):
        self.op()

    def track_extra_peak_mib(self, dtype, granularity, impl):
        """Peak RSS above the input while quantizing (the int8 output is 1/4 of F32)."""
        import gc

        gc.collect()
        trim_heap()
        before = common.rss_bytes()
        if not common.reset_hwm():
            raise NotImplementedError("needs Linux /proc/self/clear_refs")
        self.op()
        return (common.hwm_bytes() - before) / (1 << 20)

    track_extra_peak_mib.unit = "MiB"


class Dequantize(common.OneCallPerSample):
    """``engine.dequantize_int8`` per row to F32 and BF16."""

    param_names = ["dtype"]
    params = [["F32", "BF16"]]

    def setup(self, dtype):
        import ml_dtypes

        import engine

        x = make_data("F32", F32_ELEMS).reshape(ROWS, -1)
        self.q, self.s = engine.quantize_int8(x, 0)
        self.dt = np.float32 if dtype == "F32" else ml_dtypes.bfloat16
        engine.dequantize_int8(self.q[:2], self.s[:2], 0, self.dt)

    def time_dequantize(self, dtype):
        import engine

        engine.dequantize_int8(self.q, self.s, 0, self.dt)


class KernelSpeedup:
    """Baseline time / engine time, measured in the same process (median of 3 each).

    The engine's runs come first, then the baseline's, not interleaved: right after torch
    has churned through large temporaries the OS is slow to hand out fresh pages, which
    would be charged to the engine's next output allocation (see scripts/bench_kernels.py).
    """

    number = 1
    repeat = 1
    warmup_time = 0
    timeout = 900
    unit = "ratio"
    SAMPLES = 3

    @classmethod
    def _ratio(cls, ops):
        times = {}
        for k in ("engine", "baseline"):
            times[k] = []
            for _ in range(cls.SAMPLES):
                t0 = time.perf_counter()
                ops[k]()
                times[k].append(time.perf_counter() - t0)
        return statistics.median(times["baseline"]) / statistics.median(times["engine"])

    def setup(self):
        if not _have_torch():
            raise NotImplementedError("torch is not installed")

    def track_stats_f32_vs_torch(self):
        a = make_data("F32", F32_ELEMS)
        return self._ratio({"engine": stats_op("engine", a), "baseline": stats_op("torch", a)})

    def track_stats_bf16_vs_numpy(self):
        a = make_data("BF16", BF16_ELEMS)
        return self._ratio({"engine": stats_op("engine", a), "baseline": stats_op("numpy", a)})

    def track_quantize_tensor_f32_vs_torch(self):
        x = make_data("F32", F32_ELEMS).reshape(ROWS, -1)
        return self._ratio(
            {"engine": quantize_op("engine", x, None), "baseline": quantize_op("torch", x, None)}
        )

    def track_quantize_row_f32_vs_torch(self):
        x = make_data("F32", F32_ELEMS).reshape(ROWS, -1)
        return self._ratio({"engine": quantize_op("engine", x, 0), "baseline": quantize_op("torch", x, 0)})


def _weights_checkpoint() -> str:
    """A cached 256 MiB BF16 checkpoint of weight-like values (normal, std 0.02)."""
    import engine.numpy

    path = os.path.join(common.cache_dir(), f"v{common.GEN_VERSION}-weights-256M.safetensors")
    if not os.path.exists(path):
        bf16 = make_data("BF16", 1).dtype
        tensors = {f"model.layers.{i}.mlp.weight": (make_data("F32", 1 << 24, seed=i) * np.float32(0.02))
                   .astype(bf16).reshape(4096, 4096) for i in range(8)}
        engine.numpy.save_file(tensors, path)
    return path


def _stream(path, stats):
    import engine

    for _ in engine.stream(path, framework="np", device="cpu", stats=stats):
        pass


class StreamStats(common.OneCallPerSample):
    """``engine.stream(device="cpu")`` of the weight-like checkpoint, with and without
    ``stats=True``."""

    params = [[False, True]]
    param_names = ["stats"]

    def setup_cache(self):
        return _weights_checkpoint()

    def setup(self, path, stats):
        common.warm_cache(path)
        _stream(path, True)  # load the compiled kernels outside the measurement

    def time_stream(self, path, stats):
        _stream(path, stats)


class StreamStatsOverhead:
    """What ``stats=True`` adds to the load, in percent: the median of paired ratios (the
    full-size figure comes from ``scripts/bench_reader.py --only stats``)."""

    number = 1
    repeat = 1
    warmup_time = 0
    timeout = 600
    PAIRS = 7

    def setup_cache(self):
        return _weights_checkpoint()

    def setup(self, path):
        common.warm_cache(path)
        _stream(path, True)

    def track_overhead_percent(self, path):
        ratios = []
        for _ in range(self.PAIRS):
            times = []
            for with_stats in (False, True):
                t0 = time.perf_counter()
                _stream(path, with_stats)
                times.append(time.perf_counter() - t0)
            ratios.append(times[1] / times[0])
        return 100 * (statistics.median(ratios) - 1)

    track_overhead_percent.unit = "%"
