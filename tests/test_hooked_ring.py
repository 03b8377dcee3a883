"""Loads with device kernels (``stats=True``, ``quantize="int8"``) through the chunk ring, on the
emulated CUDA runtime (tests/emucudart): the ring moves the file as a plain load does and the
kernels run on each tensor as the ring reports it landed (engine.loading.load_hooks).

Three ways the kernels run, each checked against the CPU kernels (``engine.stats``,
``engine.quantize_int8``):

* ``numba``: Numba's kernels, under the simulator only (CI's ``NUMBA_ENABLE_CUDASIM=1`` pass);
* ``fallback``: the framework operations of engine.numerics._device_fallback (numpy arrays
  standing for CuPy's, as in tests/test_device_fallback.py);
* ``cpu``: a sink of another framework where the kernels cannot run: statistics folded on the
  CPU from the file, quantization on the CPU as each tensor is handed out.
"""

from __future__ import annotations

import naive
import numba
import numpy as np
import pytest
from emucudart import EmulatedRingOps, EmulatedSink, Emulator
from test_kernels import assert_stats
from test_load_hooks import BF16, ScratchCounting, default_selection, model

import engine
import engine.loading.loader
import engine.numpy
from engine.errors import DeviceError, ReadError
from engine.gpu import rings
from engine.gpu.records import load_records
from engine.loading import _staging, kernel_probe, load_hooks
from engine.numerics import _device_fallback
from engine.quantize import Int8, QuantizedTensor

SIM = bool(numba.config.ENABLE_CUDASIM)
MODES = [pytest.param("numba", marks=pytest.mark.skipif(
    not SIM, reason="Numba's kernels need NUMBA_ENABLE_CUDASIM=1 set before Numba is imported (CI's simulator pass)")),
    "fallback", "cpu"]
CHUNK = 4096  # the ring's chunk: the big tensors span several


class EmuSink(ScratchCounting, EmulatedSink):
    """A device sink over the emulated runtime that also allocates the hooks' device arrays
    (numpy), counting the scratch buffers of source bytes alive at once."""

    name = "emu"

    def __init__(self, ops) -> None:
        super().__init__(ops)
        self.to_host_calls = 0

    def to_host(self, x):
        self.to_host_calls += 1
        return np.array(x)

    def from_host(self, a):
        return np.array(a)


@pytest.fixture(scope="module")
def emu():
    return Emulator()


@pytest.fixture
def sink(emu, monkeypatch):
    emu.reset()
    ops = EmulatedRingOps(emu)
    s = EmuSink(ops)
    monkeypatch.setattr(engine.loading.loader, "get_sink", lambda framework, device: s)
    yield s
    rings.release_rings()
    ops.close()
    st = emu.stats()
    assert st["registered"] == 0 and st["events"] == 0 and st["pageable"] == 0, st  # nothing left locked
    emu.reset()


@pytest.fixture
def mode(request, monkeypatch):
    """How the kernels run (see the module docstring)."""
    kind = request.param
    from engine.numerics import device

    if kind == "numba":
        monkeypatch.setattr(kernel_probe, "_KERNELS", [None])
        monkeypatch.setattr(device, "DEFAULT_LAUNCH", device.LaunchConfig(threads=8, blocks=2))
        return kind
    monkeypatch.setattr(kernel_probe, "_KERNELS", ["NvvmSupportError: libNVVM cannot be found"])
    monkeypatch.setattr(kernel_probe, "_WARNED", [True])  # the warning is tested elsewhere
    if kind == "fallback":
        real = _device_fallback.ops_for
        monkeypatch.setattr(_device_fallback, "ops_for",
                            lambda name: _device_fallback.ArrayOps(np) if name == "emu" else real(name))
    return kind


def with_big(sd):
    """The model with tensors that span several ring chunks (and a gap of small ones)."""
    rng = np.random.default_rng(5)
    sd["model.layers.9.mlp.gate_proj.weight"] = rng.standard_normal((30, 41)).astype(np.float32)
    sd["model.layers.9.mlp.up_proj.weight"] = (rng.standard_normal((26, 190)) * 3).astype(BF16)
    sd["model.layers.9.self_attn.o_proj.weight"] = rng.standard_normal((13, 257)).astype(np.float16)
    return sd


@pytest.fixture
def model_file(tmp_path):
    sd = with_big(model(np.random.default_rng(0), layers=2))
    sd["model.layers.1.self_attn.q_proj.weight"][3, 5] = np.nan
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file(sd, path)
    return path, sd


def watch_reports(monkeypatch, sd, seen):
    """Check each tensor's bytes on the "device" at the moment the ring reports it landed
    (before its kernels are launched), against the file's."""
    real = load_hooks.LoadWork.landed
    names = list(sd)

    def landed(self, row):
        name = self._names[row]
        target = self._targets[row] if self._targets is not None else None
        want = sd[name].reshape(-1).view(np.uint8)
        assert target is not None and np.array_equal(np.asarray(target), want), f"{name}: not landed when reported"
        seen.append(name)
        return real(self, row)

    monkeypatch.setattr(load_hooks.LoadWork, "landed", landed)
    return names


def assert_same_stats(got, x):
    assert_stats(got, naive.stats(x))
    cpu = engine.stats(x)
    assert (got.count, got.nan_count, got.posinf_count, got.neginf_count, got.zero_count) == \
        (cpu.count, cpu.nan_count, cpu.posinf_count, cpu.neginf_count, cpu.zero_count)
    if cpu.count:
        assert (float(got.min), float(got.max), float(got.absmax)) == (float(cpu.min), float(cpu.max),
                                                                        float(cpu.absmax))


def assert_int8(qt, x, axis):
    assert isinstance(qt, QuantizedTensor) and qt.axis == axis
    q, scale = engine.quantize_int8(x, axis, on_nonfinite="clamp")
    assert np.array_equal(np.asarray(qt.q), q)
    assert np.array_equal(np.asarray(qt.scale, np.float32).view(np.uint32), np.asarray(scale, np.float32).view(np.uint32))


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_stats_and_int8_through_the_ring(model_file, sink, mode, monkeypatch, emu):
    path, sd = model_file
    emu.delay(0.0002)  # copies complete late: a report before its copy would see stale bytes
    seen: list[str] = []
    watch_reports(monkeypatch, sd, seen)
    spec = Int8(on_nonfinite="clamp")
    with load_records() as records:
        got = {}
        for name, t, s in engine.stream(path, framework="np", device="cuda", stats=True, quantize=spec,
                                        chunk_bytes=4096, slot_bytes=CHUNK):
            x = sd[name]  # checked as each is handed out
            assert_same_stats(s, x)
            if name in default_selection(sd):
                assert_int8(t, x, 0)
            else:
                assert np.array_equal(np.asarray(t).reshape(-1).view(np.uint8), x.reshape(-1).view(np.uint8))
            got[name] = t
    assert got.keys() == sd.keys()
    assert records and sum(r.bytes for r in records) == sum(x.nbytes for x in sd.values())
    assert max(r.chunks for r in records) > 1 and all(r.chunk_bytes == CHUNK for r in records)
    if mode != "cpu":  # the kernels were launched as the tensors landed, from the ring's reports
        assert all(r.hooked for r in records) and sum(r.reported for r in records) == len(seen)
        assert set(seen) == {n for n, x in sd.items() if x.nbytes}
    # int8: each tensor's source bytes landed once in a scratch buffer, freed since
    chosen = default_selection(sd)
    if mode == "cpu":
        assert sink.staged == 0
    else:  # one block per window for the scratch, each tensor's at an aligned offset of it
        assert 0 <= sink.staged - sum(sd[n].nbytes for n in chosen) < _staging.ALIGN * len(chosen)
    assert sink.live == 0


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_int8_scratch_is_bounded_by_windows(tmp_path, sink, mode, monkeypatch):
    rng = np.random.default_rng(2)
    sd = {f"layers.{i}.proj.weight": rng.standard_normal((17, 41 + i)).astype(BF16 if i % 2 else np.float32)
          for i in range(16)}
    sd["layers.3.norm.weight"] = np.ones(33, np.float32)
    path = tmp_path / "w.safetensors"
    engine.numpy.save_file(sd, path)
    budget = 6 << 10
    monkeypatch.setattr(load_hooks, "STAGING_BYTES", budget)
    chosen = default_selection(sd)
    with load_records() as records:
        got = dict(engine.stream(path, framework="np", device="cuda", quantize=Int8(axis=None, on_nonfinite="clamp"),
                                 chunk_bytes=2048, slot_bytes=CHUNK))
    for name in chosen:
        assert_int8(got[name], sd[name], None)
    if mode == "cpu":
        return
    quantized = sum(sd[n].nbytes for n in chosen)
    biggest = max(sd[n].nbytes for n in chosen)
    assert len(records) > 2  # one ring run per window
    assert 0 <= sink.staged - quantized < _staging.ALIGN * len(chosen) and sink.live == 0
    # never every quantized tensor's source at once (padding: the offsets' alignment)
    assert sink.peak <= budget + 2 * biggest + _staging.ALIGN * len(chosen) < quantized


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_stats_alone_and_nonfinite_raise(model_file, sink, mode):
    path, sd = model_file
    got = {n: s for n, _, s in engine.stream(path, framework="np", device="cuda", stats=True, slot_bytes=CHUNK)}
    for name, x in sd.items():
        assert_same_stats(got[name], x)
    assert got["position_ids"].max == 16  # integers: the CPU fold, from the file
    with pytest.raises(engine.errors.NonFiniteError) as err:
        list(engine.stream(path, framework="np", device="cuda", quantize="int8", slot_bytes=CHUNK))
    assert list(err.value.tensors) == ["model.layers.1.self_attn.q_proj.weight"] and err.value.path == str(path)


# --------------------------------------------------------------------------- error paths


def _leaks(sink):
    rings.release_rings()
    assert rings.locked_bytes() == 0
    st = sink.ops.emulator.stats()
    assert st["registered"] == 0 and st["events"] == 0, st
    import gc

    gc.collect()
    assert sink.live == 0  # every scratch buffer freed


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_a_failed_copy_raises_and_leaks_nothing(model_file, sink, mode):
    path, _ = model_file
    sink.ops.emulator.fail_copy(5, asynchronous=True)
    with pytest.raises(DeviceError, match="copying .* to the device failed"):
        list(engine.stream(path, framework="np", device="cuda", stats=True, quantize=Int8(on_nonfinite="clamp"),
                           chunk_bytes=4096, slot_bytes=CHUNK))
    _leaks(sink)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "cpu"], indirect=True)
@pytest.mark.parametrize("nth", [1, 3, 7])  # 1: a window's set-up; 3: nothing launched waits in a gather yet
def test_a_failed_kernel_launch_raises_and_leaks_nothing(model_file, sink, mode, monkeypatch, nth):
    path, sd = model_file
    calls = [0]
    if mode == "numba":
        from engine.numerics import device

        real = device._launch

        def launch(kernel, config, *args):
            calls[0] += 1
            if calls[0] == nth:
                raise RuntimeError("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")  # as the driver refuses one
            return real(kernel, config, *args)

        monkeypatch.setattr(device, "_launch", launch)
        # the launches queued before the refused one are waited for before their memory goes
        waits = []
        real_sync = device.synchronize
        monkeypatch.setattr(device, "synchronize", lambda stream=None: (waits.append(calls[0]), real_sync(stream)))
    else:
        real = _device_fallback.quantize

        def quantize(*a, **k):
            calls[0] += 1
            if calls[0] == min(nth, 2):
                raise RuntimeError("out of memory")
            return real(*a, **k)

        monkeypatch.setattr(_device_fallback, "quantize", quantize)
    with pytest.raises(DeviceError, match="the device kernels of (tensor .*|.* tensor.s.) failed") as err:
        list(engine.stream(path, framework="np", device="cuda", stats=True, quantize=Int8(on_nonfinite="clamp"),
                           chunk_bytes=4096, slot_bytes=CHUNK))
    assert err.value.path == str(path) and err.value.tensors and set(err.value.tensors) <= set(sd)
    if mode == "numba" and nth > 1:  # launches were queued before the refused one
        assert waits and waits[-1] >= nth
    del err  # its traceback holds the load's frames (and so its buffers)
    _leaks(sink)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_a_cancel_stops_the_load_and_leaks_nothing(model_file, sink, mode, monkeypatch):
    path, sd = model_file
    # two chunks in flight: the ring waits on its slots (and polls) rather than on its stream
    monkeypatch.setenv("ENGINE_RING", f"{CHUNK / (1 << 20)},2,2")
    kw = dict(stats=True, quantize=Int8(on_nonfinite="clamp"), chunk_bytes=4096, slot_bytes=CHUNK)
    assert len(list(engine.stream(path, framework="np", device="cuda", **kw))) == len(sd)  # compiled, warm
    sink.ops.emulator.delay(0.02)  # slow copies: the load is still running when it is left
    with load_records() as records:
        it = engine.stream(path, framework="np", device="cuda", **kw)
        name = next(it)[0]
        while not sd[name].nbytes:  # tensors without bytes come before anything is read
            name = next(it)[0]
        it.close()  # breaking out of the loop cancels the load
    sink.ops.emulator.delay(0)
    # the ring stopped before the end: not every tensor was reported
    assert records and sum(r.reported for r in records) < sum(1 for x in sd.values() if x.nbytes)
    _leaks(sink)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_a_failed_read_raises_read_error(model_file, sink, mode, monkeypatch):
    path, _ = model_file
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])  # the last tensors' bytes are missing
    with pytest.raises((ReadError, engine.errors.HeaderError)):
        list(engine.stream(path, framework="np", device="cuda", stats=True, quantize=Int8(on_nonfinite="clamp"),
                           slot_bytes=CHUNK))
    _leaks(sink)


@pytest.mark.parametrize("mode", MODES[:1], indirect=True)
def test_a_kernel_failing_on_the_device_raises_at_the_gather(model_file, sink, mode, monkeypatch):
    # a launch the runtime took, whose kernel then faults: the wait of the gather reports it
    from engine.numerics import device

    def fault(stream=None):
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")

    monkeypatch.setattr(device, "synchronize", fault)
    path, _ = model_file
    with pytest.raises(DeviceError, match="the device kernels of .* tensor.* failed: RuntimeError") as err:
        list(engine.stream(path, framework="np", device="cuda", stats=True, slot_bytes=CHUNK))
    assert err.value.path == str(path) and err.value.tensors
    del err
    _leaks(sink)


# --------------------------------------------------------------------------- the torch fallback, stream-ordered


def test_windowed_fallback_quantize_never_overwrites_scratch_still_being_read(tmp_path, emu, monkeypatch):
    """The torch fallback queues its operations on the consumer's stream, where they read a
    window's scratch when the stream gets to them; the scratch is freed as soon as they are
    queued, and a caching allocator hands its block to the next window's staging at once.  The
    next window's copies must wait for those reads (a fence recorded after each window's work),
    or they overwrite the bytes still to be read: wrong int8 values and scales."""
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    from engine.base import dtypes

    emu.reset()
    monkeypatch.setattr(kernel_probe, "_KERNELS", ["NvvmSupportError: libNVVM cannot be found"])
    monkeypatch.setattr(kernel_probe, "_WARNED", [True])
    rng = np.random.default_rng(9)
    sd = {f"layers.{i}.proj.weight": (rng.standard_normal((32, 64)) * (i + 1)).astype(np.float32) for i in range(6)}
    path = tmp_path / "w.safetensors"
    engine.numpy.save_file(sd, path)
    monkeypatch.setattr(load_hooks, "STAGING_BYTES", 2 * sd["layers.0.proj.weight"].nbytes)  # two a window

    class Ops(EmulatedRingOps):
        def address(self, target) -> int:
            return target.data_ptr() if target.numel() else 0

    def pool_tensor(shape, dt):
        n = int(np.prod(shape)) * np.dtype(dt).itemsize
        return torch.from_numpy(emu.pool_empty(n)).view(getattr(torch, np.dtype(dt).name)).reshape(shape)

    class Sink:
        """torch "device" tensors from the emulated caching allocator, for the default stream."""

        name = "emutorch"
        on_device = True

        def __init__(self) -> None:
            self.ops = Ops(emu, consumer=0)

        def allocate_device(self, specs, per_tensor=False):
            tensors = {r: pool_tensor(dtypes.packed_shape(c, s, n), dtypes.numpy_dtype(c)) for r, c, s, n in specs}
            return tensors, {r: t.reshape(-1).view(torch.uint8) for r, t in tensors.items()}, self.ops

        empty_device = staticmethod(pool_tensor)

    later: list = []

    class QueuedTorchOps(_device_fallback.TorchOps):
        def host(self, x):  # the one wait: the stream's work queued so far done first
            ready = len(later)  # the loading thread may queue more meanwhile
            assert emu.synchronize(0) == 0
            for _ in range(ready):
                later.pop(0)()
            return super().host(x)

    real_quantize = _device_fallback.quantize

    def queued(ops, src, kind, shape, axis, q, scale, chunk=_device_fallback.CHUNK):
        """The operations queued on the default stream: they read ``src`` when it runs them
        (a slow first one holds the rest back), not now."""
        if src is None:
            return real_quantize(ops, src, kind, shape, axis, q, scale, chunk)
        read = torch.empty(src.numel() * src.element_size(), dtype=torch.uint8)
        emu.launch_copy(0, read, src.data_ptr(), 0.05)
        bad = torch.zeros(3, dtype=torch.int64)
        later.append(lambda: bad.copy_(real_quantize(ops, read, kind, shape, axis, q, scale, chunk)))
        return bad

    real_ops_for = _device_fallback.ops_for
    monkeypatch.setattr(_device_fallback, "ops_for",
                        lambda name: QueuedTorchOps() if name == "emutorch" else real_ops_for(name))
    monkeypatch.setattr(_device_fallback, "quantize", queued)
    sink = Sink()
    monkeypatch.setattr(engine.loading.loader, "get_sink", lambda framework, device: sink)
    try:
        with load_records() as records:
            got = dict(engine.stream(path, framework="pt", device="cuda", quantize=Int8(axis=0, on_nonfinite="clamp"),
                                     chunk_bytes=4096, slot_bytes=CHUNK))
        assert len(records) == 3 and emu.pool_reused() > 0  # windows, whose scratch blocks came back
        for name, x in sd.items():
            qt = got[name]
            q, scale = engine.quantize_int8(x, 0)
            assert np.array_equal(qt.q.numpy(), q), f"{name}: int8 values quantized from another tensor's bytes"
            assert np.array_equal(qt.scale.numpy().view(np.uint32), np.asarray(scale).view(np.uint32)), name
    finally:
        rings.release_rings()
        sink.ops.close()
    st = emu.stats()
    assert st["registered"] == 0 and st["events"] == 0, st


def test_a_device_streams_ring_fits_its_memory_limit(model_file, sink):
    """``memory_limit`` on a device stream sizes the ring's page-locked chunks within it (the
    ring's default is 128 MiB), and the tensors still land whole."""
    from engine.gpu.geometry import default_geometry

    path, sd = model_file
    limit = default_geometry().chunks * 16384
    with load_records() as records:
        got = dict(engine.stream(path, framework="np", device="cuda", memory_limit=limit))
    assert got.keys() == sd.keys()
    for name, x in sd.items():
        assert np.array_equal(np.asarray(got[name]).reshape(-1).view(np.uint8), x.reshape(-1).view(np.uint8))
    assert records and all(r.chunk_bytes * r.slots <= limit for r in records), [(r.chunk_bytes, r.slots) for r in records]


def test_one_files_device_load_takes_the_rings_chunk_size(model_file, sink):
    """``engine.loading.loader.load_file`` (the path of ``engine.torch.load_file(f, device=...)``,
    which sizes the chunks from ``memory_limit``) builds its ring from ``slot_bytes``."""
    path, sd = model_file
    with load_records() as records:
        got = engine.loading.loader.load_file(path, sink, slot_bytes=16384)
    assert got.keys() == sd.keys()
    for name, x in sd.items():
        assert np.array_equal(np.asarray(got[name]).reshape(-1).view(np.uint8), x.reshape(-1).view(np.uint8))
    assert records and all(r.chunk_bytes == 16384 for r in records), [(r.chunk_bytes, r.slots) for r in records]
