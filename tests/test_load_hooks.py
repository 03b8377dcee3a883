"""engine.loading.load_hooks through engine.stream: statistics and int8 quantization while loading.

CPU destinations run in every pass.  Device destinations with the kernels run only under
Numba's CUDA simulator (CI's ``NUMBA_ENABLE_CUDASIM=1`` pass), with a device double whose
"device memory" is numpy arrays, moved there by the chunk ring on the emulated CUDA runtime
(tests/emucudart); tests/test_hooked_ring.py covers the ring's side of hooked loads (reports,
errors, cancels, the framework fallback).
"""

from __future__ import annotations

import math
import threading
import weakref

import ml_dtypes
import naive
import numba
import numpy as np
import pytest
from test_kernels import assert_stats

import engine
import engine.loading.loader  # noqa: F401  (sim_stream patches its get_sink)
import engine.numpy
from engine.base import dtypes
from engine.errors import DeviceFallbackWarning, NonFiniteError, SerializationError
from engine.format.header import parse_buffer
from engine.quantize import Int8, NonFiniteWarning, QuantizedTensor

SIM = bool(numba.config.ENABLE_CUDASIM)
BF16 = np.dtype(ml_dtypes.bfloat16)
needs_device = pytest.mark.skipif(
    not SIM, reason="needs NUMBA_ENABLE_CUDASIM=1 set before Numba is imported (CI's simulator pass)"
)


def model(rng, layers=3):
    """A small Llama-shaped state dict (rows of odd widths so pieces split tensors anywhere)."""
    sd = {"model.embed_tokens.weight": rng.standard_normal((11, 24)).astype(BF16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(24)).astype(BF16)
        sd[p + "self_attn.q_proj.weight"] = rng.standard_normal((24, 24)).astype(BF16)
        sd[p + "self_attn.k_proj.weight"] = rng.standard_normal((13, 24)).astype(np.float16)
        sd[p + "mlp.up_proj.weight"] = rng.standard_normal((37, 24)).astype(np.float32)
        sd[p + "mlp.down_proj.weight"] = rng.standard_normal((24, 37)).astype(BF16)
    sd["lm_head.weight"] = rng.standard_normal((11, 24)).astype(BF16)
    sd["model.norm.weight"] = np.linspace(-1.5, 1, 24)  # F64 of either sign: every key of the statistics
    sd["position_ids"] = np.arange(17, dtype=np.int64)
    sd["empty.weight"] = np.zeros((0, 5), np.float32)
    return sd


@pytest.fixture
def model_file(tmp_path):
    sd = model(np.random.default_rng(0))
    sd["model.layers.1.self_attn.q_proj.weight"][3, 5] = np.nan  # stats must count it
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file(sd, path)
    return path, sd


def default_selection(sd):
    return {n for n, x in sd.items() if x.ndim >= 2 and x.dtype != np.int64 and "embed" not in n}


def assert_quantized(qt, x, axis):
    assert isinstance(qt, QuantizedTensor) and qt.axis == axis
    assert qt.dtype == dtypes.NAMES[dtypes.from_numpy(x.dtype)]
    q, scale = engine.quantize_int8(x, axis, on_nonfinite="clamp") if np.isfinite(
        x.astype(np.float32)).all() else naive.quantize_int8(x, axis)
    assert np.array_equal(np.asarray(qt.q), q)
    assert np.array_equal(np.asarray(qt.scale, np.float32).view(np.uint32),
                          np.asarray(scale, np.float32).view(np.uint32))


# --------------------------------------------------------------------------- CPU destinations


def test_cpu_quantize_on_load_default_selection(model_file):
    path, sd = model_file
    del sd  # the file holds a NaN in one weight: only clamp loads it
    path2 = path.with_name("finite.safetensors")
    sd = model(np.random.default_rng(0))
    engine.numpy.save_file(sd, path2)
    got = dict(engine.stream(path2, framework="np", device="cpu", quantize="int8", chunk_bytes=4096))
    assert got.keys() == sd.keys()
    chosen = default_selection(sd)
    assert "lm_head.weight" in chosen and "model.embed_tokens.weight" not in chosen
    for name, x in sd.items():
        if name in chosen:
            assert_quantized(got[name], x, 0)
        else:  # norms, embeddings, integers, 1-D: as stored
            assert not isinstance(got[name], QuantizedTensor)
            assert np.array_equal(got[name].view(np.uint8), x.view(np.uint8))


def test_cpu_quantize_spec_and_nonfinite(model_file):
    path, sd = model_file
    with pytest.raises(NonFiniteError) as err:
        list(engine.stream(path, framework="np", device="cpu", quantize="int8"))
    assert list(err.value.tensors) == ["model.layers.1.self_attn.q_proj.weight"] and err.value.path == str(path)
    spec = Int8(axis=None, include=["*proj*", "model.embed_tokens.weight"], exclude="*k_proj*", on_nonfinite="clamp")
    with pytest.warns(engine.quantize.NonFiniteWarning):
        got = {n: t for n, t, s in engine.stream(path, framework="np", device="cpu", quantize=spec, stats=True)}
    for name, x in sd.items():
        if ("proj" in name and "k_proj" not in name) or name == "model.embed_tokens.weight":
            assert_quantized(got[name], x, None)
        else:
            assert not isinstance(got[name], QuantizedTensor)


def test_quantize_spec_is_checked(model_file):
    path, _ = model_file
    with pytest.raises(SerializationError, match="has no axis 2"):
        list(engine.stream(path, framework="np", device="cpu", quantize=Int8(axis=2)))
    with pytest.raises(ValueError, match="quantize must be"):
        list(engine.stream(path, framework="np", device="cpu", quantize="int4"))
    with pytest.raises(TypeError):
        Int8(axis=1.5)
    with pytest.raises(ValueError):
        Int8(on_nonfinite="ignore")
    assert Int8(embeddings=True).select("wte.weight", "F32", (3, 4)) == (True, 0)
    assert Int8().select("wte.weight", "F32", (3, 4)) == (False, None)
    assert Int8().select("x.weight", "I32", (3, 4)) == (False, None)


# --------------------------------------------------------------------------- device destinations


_OPS: list = []


def ring_ops():
    """The chunk ring's operations over the emulated CUDA runtime, one set for the module
    (a ring kept between loads keeps the stream they made)."""
    if not _OPS:
        from emucudart import EmulatedRingOps, Emulator

        _OPS.append(EmulatedRingOps(Emulator()))
    return _OPS[0]


class ScratchCounting:
    """Device arrays as numpy arrays, counting the scratch buffers of source bytes (1-D
    uint8) alive at once, at peak, and in all."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.lock = threading.Lock()
        self.live = self.peak = self.staged = 0

    def _freed(self, n) -> None:
        with self.lock:
            self.live -= n

    def empty_device(self, shape, dtype):
        a = np.empty(shape, dtype)
        if np.dtype(dtype) == np.uint8 and len(shape) == 1:  # a scratch buffer of source bytes
            with self.lock:
                self.live += a.nbytes
                self.staged += a.nbytes
                self.peak = max(self.peak, self.live)
            weakref.finalize(a, self._freed, a.nbytes)
        return a


class SimSink(ScratchCounting):
    """A device sink whose device arrays are numpy arrays; counts live staging bytes."""

    name = "sim"
    on_device = True

    def allocate_device(self, specs, per_tensor=False):
        tensors, targets = {}, {}
        for row, code, shape, nbytes in specs:
            buf = np.zeros(nbytes, np.uint8)
            targets[row] = buf
            tensors[row] = buf.view(dtypes.numpy_dtype(code)).reshape(dtypes.packed_shape(code, shape, nbytes))
        return tensors, targets, ring_ops()


def sim_stream(monkeypatch, path, **kw):
    from engine.numerics import device

    # a few simulated GPU threads (each one is a Python thread under the simulator)
    monkeypatch.setattr(device, "DEFAULT_LAUNCH", device.LaunchConfig(threads=8, blocks=2))
    sink = SimSink()
    monkeypatch.setattr(engine.loading.loader, "get_sink", lambda framework, device: sink)
    return sink, engine.stream(path, framework="np", device="cuda", **kw)


@needs_device
@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_device_stats_on_load(model_file, monkeypatch, chunk):
    path, sd = model_file
    _, it = sim_stream(monkeypatch, path, stats=True, chunk_bytes=chunk, threads=3)
    got = {n: (t, s) for n, t, s in it}
    assert got.keys() == sd.keys()
    for name, x in sd.items():
        t, s = got[name]
        assert np.array_equal(t.view(np.uint8), x.view(np.uint8))
        assert_stats(s, naive.stats(x))
    assert got["model.layers.1.self_attn.q_proj.weight"][1].nan_count == 1
    assert got["position_ids"][1].max == 16  # integers keep the CPU fold (of the file's bytes)


@needs_device
def test_device_quantize_on_load_bit_identical_and_bounded(monkeypatch, tmp_path):
    sd = model(np.random.default_rng(1), layers=4)
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file(sd, path)
    from engine.loading import _staging, load_hooks

    chunk, threads = 4096, 2
    monkeypatch.setattr(load_hooks, "STAGING_BYTES", 2 * chunk)  # windows of the ring's runs
    sink, it = sim_stream(monkeypatch, path, quantize="int8", stats=True, chunk_bytes=chunk, threads=threads,
                          slot_bytes=chunk)
    got = {n: (t, s) for n, t, s in it}
    chosen = default_selection(sd)
    for name, x in sd.items():
        t, s = got[name]
        assert_stats(s, naive.stats(x))  # statistics of the source values, quantized or not
        if name in chosen:
            assert_quantized(t, x, 0)
        else:
            assert np.array_equal(t.view(np.uint8), x.view(np.uint8))
    quantized_bytes = sum(sd[n].nbytes for n in chosen)
    # each staged once, at an aligned offset of its window's block
    assert 0 <= sink.staged - quantized_bytes < _staging.ALIGN * len(chosen)
    biggest = max(sd[n].nbytes for n in chosen)
    # scratch held at once: a window's tensors and the one straddling into it, not the model
    assert sink.peak <= 2 * chunk + 2 * biggest + _staging.ALIGN * len(chosen) < quantized_bytes
    assert sink.live == 0


@needs_device
def test_device_quantize_nonfinite(model_file, monkeypatch):
    path, sd = model_file
    _, it = sim_stream(monkeypatch, path, quantize="int8", chunk_bytes=4096)
    with pytest.raises(NonFiniteError) as err:
        list(it)
    assert list(err.value.tensors) == ["model.layers.1.self_attn.q_proj.weight"] and err.value.path == str(path)
    _, it = sim_stream(monkeypatch, path, quantize=Int8(axis=-1, on_nonfinite="clamp"), chunk_bytes=4096)
    got = dict(it)
    for name in default_selection(sd):
        assert_quantized(got[name], sd[name], 1)
    assert math.prod(got["empty.weight"].q.shape) == 0 and got["empty.weight"].scale.shape == (5,)


# --------------------------------------------------------------------------- no usable device kernels


class HostRoundTripSink(SimSink):
    """SimSink with the host round trip a sink of another framework brings (numpy both ways),
    counting the tensors moved each way."""

    def __init__(self):
        super().__init__()
        self.to_host_calls = 0
        self.from_host_calls = 0

    def to_host(self, x):
        self.to_host_calls += 1
        return np.array(x)

    def from_host(self, a):
        self.from_host_calls += 1
        return np.array(a)


@pytest.fixture
def no_device_kernels(monkeypatch):
    """A process whose Numba CUDA target cannot compile: the probe's verdict, as it is where
    NVVM is missing (a fresh warning state too)."""
    from engine.loading import kernel_probe

    monkeypatch.setattr(kernel_probe, "_KERNELS", ["NvvmSupportError: libNVVM cannot be found"])
    monkeypatch.setattr(kernel_probe, "_WARNED", [])


def test_device_loads_fall_back_to_the_cpu_where_the_kernels_cannot_run(model_file, monkeypatch,
                                                                         no_device_kernels):
    from engine.errors import DeviceFallbackWarning

    path, sd = model_file
    spec = Int8(on_nonfinite="clamp")
    clamped = "holds 1 NaN, 0 \\+Inf and 0 -Inf values; quantized NaN to 0"  # the file's one NaN, by design
    with pytest.warns(NonFiniteWarning, match=clamped):
        cpu = {n: (t, s) for n, t, s in engine.stream(path, framework="np", stats=True, quantize=spec)}
    sink = HostRoundTripSink()
    monkeypatch.setattr(engine.loading.loader, "get_sink", lambda framework, device: sink)
    with pytest.warns(NonFiniteWarning, match=clamped), pytest.warns(DeviceFallbackWarning, match="libNVVM") as caught:
        got = {n: (t, s) for n, t, s in engine.stream(path, framework="np", device="cuda", stats=True,
                                                      quantize=spec, chunk_bytes=4096, threads=2)}
    assert len([w for w in caught if w.category is DeviceFallbackWarning]) == 1
    assert got.keys() == cpu.keys() == sd.keys()
    chosen = default_selection(sd)
    for name, x in sd.items():
        (t, s), (tc, sc) = got[name], cpu[name]
        assert_stats(s, naive.stats(x))  # the CPU fold of the file's bytes, as the CPU load folds
        assert (s.count, s.min, s.max, s.nan_count) == (sc.count, sc.min, sc.max, sc.nan_count)
        if name in chosen:
            assert np.array_equal(t.q, tc.q) and np.array_equal(t.scale.view(np.uint32), tc.scale.view(np.uint32))
            assert_quantized(t, x, 0)
        else:
            assert np.array_equal(t.view(np.uint8), x.view(np.uint8))
    # each quantized tensor went to the host once and came back as values and scales
    assert sink.to_host_calls == len(chosen) and sink.from_host_calls == 2 * len(chosen)
    assert sink.staged == 0  # no device staging buffer: nothing was quantized on the device
    import warnings

    with warnings.catch_warnings():  # once per process
        warnings.simplefilter("error", DeviceFallbackWarning)
        assert len(list(engine.stream(path, framework="np", device="cuda", stats=True))) == len(sd)


def test_device_stats_alone_fall_back_to_the_cpu_fold(model_file, monkeypatch, no_device_kernels):
    from engine.errors import DeviceFallbackWarning

    path, sd = model_file
    sink = HostRoundTripSink()
    monkeypatch.setattr(engine.loading.loader, "get_sink", lambda framework, device: sink)
    with pytest.warns(DeviceFallbackWarning):
        got = {n: s for n, _, s in engine.stream(path, framework="np", device="cuda", stats=True)}
    for name, x in sd.items():
        assert_stats(got[name], naive.stats(x))


def test_the_probe_names_why_the_kernels_cannot_run(monkeypatch):
    from engine.loading import kernel_probe
    from engine.numerics import device

    monkeypatch.setattr(kernel_probe, "_KERNELS", [])

    def broken(index=None):
        raise RuntimeError("CUDA driver version is insufficient\nsecond line")

    monkeypatch.setattr(device, "probe", broken)
    assert kernel_probe.device_kernels_unusable() == "RuntimeError: CUDA driver version is insufficient"
    monkeypatch.setattr(device, "probe", lambda index=None: None)
    assert kernel_probe.device_kernels_unusable() is not None  # asked once per process
    monkeypatch.setattr(kernel_probe, "_KERNELS", [])
    assert kernel_probe.device_kernels_unusable() is None


def test_the_real_probe_on_this_machine(monkeypatch):
    from numba import cuda

    from engine.loading import kernel_probe

    monkeypatch.setattr(kernel_probe, "_KERNELS", [])
    why = kernel_probe.device_kernels_unusable()
    if SIM or cuda.is_available():
        assert why is None  # the simulator, or a GPU with a working toolkit, runs the kernels
    else:
        assert why  # no device: the load would take the CPU paths, and says why


def test_the_probe_runs_on_the_loads_device(monkeypatch):
    """The kernels' probe compiles and runs on the load's GPU: on a thread with no current
    device, Numba's default would make a context on GPU 0 of a rank that uses GPU 1."""
    from engine.loading import kernel_probe, load_hooks
    from engine.numerics import device

    monkeypatch.setattr(kernel_probe, "_KERNELS", [])
    seen: list = []

    def probe(index=None):
        seen.append(index)
        raise RuntimeError("no kernels here")

    class Sink:  # a device sink of GPU 1, as a CuPy sink of device 1 is
        name = "numpy"
        on_device = True
        device_id = 1

    monkeypatch.setattr(device, "probe", probe)
    hdr = parse_buffer(engine.numpy.save({"w": np.ones(4, np.float32)}))
    with pytest.warns(DeviceFallbackWarning):
        assert load_hooks.plan(hdr, [0], Sink(), stats=True, quantize=None) is None
    assert seen == [1]


@pytest.mark.skipif(not SIM, reason="needs NUMBA_ENABLE_CUDASIM=1 set before Numba is imported (CI's simulator pass)")
def test_the_probe_makes_its_device_current(monkeypatch):
    import contextlib

    from engine.numerics import device

    entered: list = []

    @contextlib.contextmanager
    def on_gpu(index):
        entered.append(index)
        yield

    monkeypatch.setattr(device, "on_gpu", on_gpu)
    device.probe(1)
    assert entered == [1]


def test_the_side_stream_waits_for_the_consumers_fence(monkeypatch):
    """The kernels' side stream (a Numba stream) waits for the consumer's fence before anything
    is queued on it: the kernels write memory the framework's allocator handed out on the
    consumer's stream (here not the legacy default stream), which work queued there before the
    load may still write.  The emulated runtime stands for the device; Numba's stream for one
    of its streams."""
    import ctypes

    from emucudart import EmulatedRingOps, EmulatedSink, Emulator
    from numba import cuda

    from engine.loading import load_hooks
    from engine.numerics import device

    emu = Emulator()
    emu.reset()
    consumer, side = emu.new_stream(0), emu.new_stream(0)
    ops = None
    try:
        memory = np.zeros(4096, np.uint8)  # a block the allocator hands out again
        emu.launch_fill(consumer, memory, 0xAA, 0.3)  # its last user, queued on the consumer's stream
        ops = EmulatedRingOps(emu, consumer=consumer)  # the load's: its fence recorded now

        class NumbaStream:
            handle = ctypes.c_void_p(side)

        monkeypatch.setattr(device, "SIMULATOR", False)
        monkeypatch.setattr(cuda, "stream", NumbaStream)
        hdr = parse_buffer(engine.numpy.save({"w": np.ones(4, np.float32)}))
        class Sink(EmulatedSink):
            empty_device = staticmethod(np.empty)

        work = load_hooks.LoadWork(hdr, [0], Sink(ops), None, True, None, None)
        work.destination(hdr, [0], False)
        stream = work._side_stream()
        assert isinstance(stream, NumbaStream)
        emu.launch_fill(side, memory, 0x11, 0.0)  # a kernel writing its output there
        assert emu.synchronize(side) == 0 and emu.synchronize(consumer) == 0
        assert (memory == 0x11).all(), "the kernel wrote before the consumer's queued work, which overwrote it"
    finally:
        if ops is not None:
            ops.close()
        emu.destroy_stream(side, 0)
        emu.destroy_stream(consumer, 0)


def _cupy_device_guard(emu):
    """cupy.cuda.Device's guard over the emulated runtime: the current device kept on entry,
    set back on exit."""
    import ctypes

    class Device:
        stack: list = []

        def __init__(self, index):
            self.id = index

        def __enter__(self):
            current = ctypes.c_int(-1)
            assert emu.lib.cudaGetDevice(ctypes.byref(current)) == 0
            Device.stack.append(current.value)
            if current.value != self.id:
                assert emu.lib.cudaSetDevice(self.id) == 0
            return self

        def __exit__(self, *exc):
            assert emu.lib.cudaSetDevice(Device.stack.pop()) == 0

    return Device


def test_a_cupy_load_to_gpu_1_from_a_fresh_thread_makes_no_context_on_gpu_0(monkeypatch):
    """The CuPy sink's own calls on the caller's thread (the ring's operations and their fence,
    the destinations, a tensor moved up) enter CuPy's ``Device`` guard; on a thread that never
    used CUDA the guard would come out setting device 0, making its context.  The sink pushes
    the load's device's context first.  CuPy is played by its guard's logic and a few names
    over the emulated runtime, on two devices."""
    import ctypes
    import sys
    import types

    from emucudart import Emulator

    emu = Emulator()
    emu.reset()
    emu.devices(2)
    Device = _cupy_device_guard(emu)

    events: list = []

    class Event:
        def __init__(self, disable_timing=False):
            handle = ctypes.c_void_p()
            assert emu.lib.cudaEventCreateWithFlags(ctypes.byref(handle), 2) == 0
            self.ptr = handle.value
            events.append(self.ptr)

        def record(self, stream):
            assert emu.lib.cudaEventRecord(ctypes.c_void_p(self.ptr), None) == 0

    class Stream:
        ptr = 0

        def wait_event(self, event):
            assert emu.lib.cudaStreamWaitEvent(None, ctypes.c_void_p(event.ptr), 0) == 0

    runtime = types.SimpleNamespace(getDeviceCount=lambda: 2, runtimeGetVersion=lambda: 12080,
                                    getDevice=lambda: 0)
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(Device=Device, Event=Event, get_current_stream=Stream,  # type: ignore[attr-defined]
                                      runtime=runtime)
    fake.empty, fake.asarray, fake.uint8, fake.dtype = np.empty, np.asarray, np.uint8, np.dtype  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.delitem(sys.modules, "engine.sinks.cupy", raising=False)
    import engine.sinks

    # the package's attribute as it was, after the module made here over the stand-in
    monkeypatch.setattr(engine.sinks, "cupy", getattr(engine.sinks, "cupy", None), raising=False)
    import engine.sinks.cupy as cupy_sink

    monkeypatch.setattr(cupy_sink, "_runtime_path", lambda: emu.path)  # before the first _pusher()
    done: list = []

    def load() -> None:  # a thread with no context current
        sink = cupy_sink.CupySink("cuda:1")
        tensors, targets, ops = sink.allocate_device([(0, engine.base.dtypes.BY_NAME["F32"].code, [2, 3], 24)])
        ops.fence_again()
        sink.to_device(np.ones(4, np.float32))
        done.append(tensors[0].shape)

    try:
        worker = threading.Thread(target=load)
        worker.start()
        worker.join()
        assert done == [(2, 3)]
        assert emu.contexts(0) == 0, "a context was made on GPU 0"
    finally:
        with emu.on_device(1):
            for handle in events:
                assert emu.lib.cudaEventDestroy(ctypes.c_void_p(handle)) == 0
        monkeypatch.delitem(sys.modules, "engine.sinks.cupy", raising=False)
        emu.reset()
        emu.devices(1)


def test_scratch_for_a_load_to_gpu_1_makes_no_context_on_gpu_0(monkeypatch):
    """A CuPy load to GPU 1 stages its tensors to quantize, and records its fence again after
    each window, on one of the engine's threads (no context current there): CuPy's ``Device``
    guard reads the current device on entry and sets it back on exit, which makes device 0's
    primary context where none was current.  The
    engine pushes the load's device's context around the allocations first.  CuPy's guard is
    played by its logic over the emulated runtime, on two devices."""
    import sys
    import types

    from emucudart import EmulatedRingOps, EmulatedSink, Emulator

    from engine.loading import load_hooks
    from engine.quantize import Int8

    emu = Emulator()
    emu.reset()
    emu.devices(2)

    Device = _cupy_device_guard(emu)
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(Device=Device)  # type: ignore[attr-defined]
    fake.empty = np.empty  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", fake)

    class Sink(EmulatedSink):
        name = "cupy"
        device_id = 1

    class Ops(EmulatedRingOps):
        def fence_again(self):  # as CupyOps records it: inside CuPy's guard
            with Device(1):
                super().fence_again()

    ops = Ops(emu, device=1)
    try:
        sd = {"a.weight": np.ones((4, 8), np.float32), "b.weight": np.ones((3, 8), np.float32)}
        hdr = parse_buffer(engine.numpy.save(sd))
        work = load_hooks.LoadWork(hdr, [0, 1], Sink(ops), Int8(include=["*"]), False, None, None)
        work.destination(hdr, [0, 1], False)
        made: list = []

        def stage():  # on a thread of the engine's own: a window's staging, a buffer made at first use
            work._targets.stage([0])
            made.append(work._targets[1])

        for job in (stage, work._fence_again):  # and the fence recorded again after a window, on another
            worker = threading.Thread(target=job)
            worker.start()
            worker.join()
        assert made and made[0].nbytes == sd["b.weight"].nbytes
        assert emu.contexts(0) == 0, "a context was made on GPU 0"
    finally:
        ops.close()
        emu.reset()
        emu.devices(1)
