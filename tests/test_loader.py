"""stream(), owned loads and load_into, on CPU destinations (CUDA ones skip without a GPU)."""

from __future__ import annotations

import gc
import itertools
import os
import threading

import numpy as np
import pytest
from conftest import SplitCopies, in_threads

import engine
import engine.loading.cpu_stats
import engine.loading.loader
import engine.loading.pipeline
import engine.numpy
from engine.errors import ReadError, TensorMismatchError, TensorNotFoundError

torch = pytest.importorskip("torch", reason="torch is an optional extra")
import engine.torch  # noqa: E402


def _model(n_layers=8, width=64):
    rng = np.random.default_rng(0)
    sd = {"model.embed_tokens.weight": rng.standard_normal((100, width), dtype=np.float32)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = rng.standard_normal((width, width), dtype=np.float32)
        sd[p + "mlp.up_proj.weight"] = rng.standard_normal((2 * width, width), dtype=np.float32)
        sd[p + "input_layernorm.weight"] = np.ones(width, np.float32)
    sd["model.norm.weight"] = np.ones(width, np.float32)
    sd["empty"] = np.zeros((0, 3), np.float32)
    sd["ids"] = np.arange(10, dtype=np.int64)
    return sd


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    sd = _model()
    path = tmp_path_factory.mktemp("loader") / "model.safetensors"
    engine.numpy.save_file(sd, path)
    return path, sd


class CountingReads:
    """Counts the bytes a load really reads: those os.preadv returns and those the native
    split copies deliver."""

    def __init__(self, monkeypatch):
        self.lock = threading.Lock()
        self.preadv_bytes = 0
        self.copies = SplitCopies(monkeypatch)
        real = os.preadv

        def counting(fd, buffers, offset):
            n = real(fd, buffers, offset)
            with self.lock:
                self.preadv_bytes += n
            return n

        monkeypatch.setattr(os, "preadv", counting)

    @property
    def bytes(self) -> int:
        return self.preadv_bytes + self.copies.bytes


@pytest.mark.parametrize("framework", ["np", "pt"])
@pytest.mark.parametrize("threads, chunk", [(1, None), (3, 4096), (2, 1 << 20)])
def test_stream_yields_every_tensor_once(model_file, framework, threads, chunk):
    path, sd = model_file
    got = dict(engine.stream(path, framework=framework, device="cpu", threads=threads, chunk_bytes=chunk))
    assert got.keys() == sd.keys()
    for name, arr in sd.items():
        value = got[name].numpy() if framework == "pt" else got[name]
        np.testing.assert_array_equal(value, arr)
        if framework == "np":
            assert value.flags.writeable and value.flags.c_contiguous


def test_selective_load_reads_only_the_selected_bytes(model_file, monkeypatch):
    path, sd = model_file
    counter = CountingReads(monkeypatch)
    chosen = dict(engine.stream(path, framework="np", device="cpu", patterns="model.layers.3.*", chunk_bytes=4096))
    assert sorted(chosen) == sorted(n for n in sd if n.startswith("model.layers.3."))
    assert counter.bytes == sum(sd[n].nbytes for n in chosen)


def test_selection_by_names_predicate_and_layers(model_file):
    path, sd = model_file
    by_names = dict(engine.stream(path, framework="np", device="cpu", names=["ids", "model.norm.weight"]))
    assert sorted(by_names) == ["ids", "model.norm.weight"]
    by_pred = dict(engine.stream(path, framework="np", device="cpu", predicate=lambda n: n.endswith("up_proj.weight")))
    assert len(by_pred) == 8
    by_layers = dict(engine.stream(path, framework="np", device="cpu", layers=range(2, 4)))
    assert sorted({n.split(".")[2] for n in by_layers}) == ["2", "3"]
    with pytest.raises(TensorNotFoundError) as info:
        list(engine.stream(path, framework="np", device="cpu", names=["nope"]))
    assert str(path) in str(info.value)
    with pytest.raises(TensorNotFoundError):
        list(engine.stream(path, framework="np", device="cpu", patterns="*.nothing"))


def test_early_break_leaks_no_thread_or_descriptor(model_file):
    path, _ = model_file
    from engine.gpu import rings

    rings.release_rings()  # a ring an earlier test kept would close its descriptors meanwhile
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    for _ in range(10):
        for _name, _t in engine.stream(path, framework="np", device="cpu", chunk_bytes=4096, threads=3):
            break
    gc.collect()
    assert threading.active_count() == threads
    assert len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.parametrize("source", ["mmap", "pread", "auto"])
@pytest.mark.parametrize("framework", ["np", "pt"])
def test_truncated_mid_load_is_a_read_error(tmp_path, monkeypatch, framework, source):
    monkeypatch.setenv("ENGINE_COPY_SOURCE", source)
    sd = {f"t{i}": np.full((256, 256), i, np.float32) for i in range(8)}
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file(sd, path)
    monkeypatch.setattr(engine.loading.pipeline, "HOST_BATCH_BYTES", 65_536)  # a copy call per request

    def truncating(call, fd, offsets, targets):  # another process cuts the file during the load
        if call == 3:
            os.truncate(path, os.path.getsize(path) // 2)

    SplitCopies(monkeypatch, before=truncating)
    with pytest.raises(ReadError) as info:
        list(engine.stream(path, framework=framework, device="cpu", threads=2, chunk_bytes=65_536))
    assert str(path) in str(info.value) and info.value.size and info.value.offset


@pytest.mark.parametrize("window", [None, 64])
def test_stream_stats_of_tensors_at_odd_file_offsets(tmp_path, monkeypatch, window):
    # Files from other writers need not align tensors: a BF16/F32 tensor may start at an odd
    # offset, so the kernels see unaligned memory in a staging slot or a packed block.
    pytest.importorskip("numba", reason="statistics need Numba (a test extra)")
    import json
    import struct

    import ml_dtypes

    if window:
        monkeypatch.setattr(engine.loading.cpu_stats.StatsCollector, "WINDOW", window)
    rng = np.random.default_rng(9)
    parts = {
        "u8": np.arange(3, dtype=np.uint8),
        "bf16": rng.standard_normal(301).astype(ml_dtypes.bfloat16),
        "f32": rng.standard_normal(77).astype(np.float32),
    }
    names = {"u8": "U8", "bf16": "BF16", "f32": "F32"}
    header, blobs, pos = {}, [], 0
    for k, v in parts.items():
        b = v.tobytes()
        header[k] = {"dtype": names[k], "shape": list(v.shape), "data_offsets": [pos, pos + len(b)]}
        blobs.append(b)
        pos += len(b)
    h = json.dumps(header).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    got = {n: (t, s) for n, t, s in engine.stream(path, framework="np", device="cpu", stats=True, threads=2,
                                                   chunk_bytes=128)}
    for k, v in parts.items():
        assert got[k][0].tobytes() == v.tobytes()
        piecewise, whole = got[k][1], engine.stats(v)
        assert (piecewise.count, piecewise.min, piecewise.max, piecewise.zero_count) == (
            whole.count, whole.min, whole.max, whole.zero_count), k
        assert piecewise.mean == pytest.approx(whole.mean, rel=1e-9, abs=1e-12), k
        assert piecewise.std == pytest.approx(whole.std, rel=1e-9), k


def test_stream_stats_truncated_mid_load_is_a_read_error(tmp_path, monkeypatch):
    pytest.importorskip("numba", reason="statistics need Numba (a test extra)")
    sd = {f"t{i}": np.full((256, 256), i, np.float32) for i in range(8)}
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file(sd, path)
    from engine.statistics import Accumulator

    monkeypatch.setattr(engine.loading.cpu_stats.StatsCollector, "WINDOW", 4096)
    real = Accumulator.read
    calls = itertools.count(1)  # next() is atomic: the reader threads share the count

    def truncating(self, fd, offset, dest, window):  # another process cuts the file during the load
        if next(calls) == 12:  # in t2 (4 pieces per tensor): cut inside t5
            os.truncate(path, os.path.getsize(path) - 3 * 256 * 256 * 4 - 100)
        return real(self, fd, offset, dest, window)

    monkeypatch.setattr(Accumulator, "read", truncating)
    got = {}
    with pytest.raises(ReadError) as info:
        for name, _t, s in engine.stream(path, framework="np", device="cpu", stats=True, threads=1,
                                        chunk_bytes=65_536):
            got[name] = s
    assert str(path) in str(info.value) and info.value.size and info.value.offset
    assert got and all(s.max == int(n[1:]) and s.count == 256 * 256 for n, s in got.items())  # before the cut


def test_concurrent_loads_from_several_threads(model_file):
    path, sd = model_file

    def work():
        for _ in range(5):
            got = engine.torch.load_file(path, backend="pread")
            assert all(np.array_equal(got[k].numpy(), v) for k, v in sd.items())

    in_threads(*[work] * 4)


# -- load_into -----------------------------------------------------------------------------------
def test_load_into_numpy_and_torch_in_place(model_file):
    path, sd = model_file
    dst_np = {k: np.empty_like(v) for k, v in sd.items()}
    filled = engine.load_into(path, dst_np)
    assert sorted(filled) == sorted(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(dst_np[k], v)
    params = {k: torch.nn.Parameter(torch.empty(v.shape)) for k, v in sd.items() if v.dtype == np.float32}
    ptrs = {k: p.data_ptr() for k, p in params.items()}
    engine.load_into(path, params)
    for k, p in params.items():
        assert p.data_ptr() == ptrs[k]  # in place: no new allocation
        np.testing.assert_array_equal(p.detach().numpy(), sd[k])


def test_load_into_checks_before_reading(model_file, monkeypatch):
    path, sd = model_file
    counter = CountingReads(monkeypatch)
    with pytest.raises(TensorMismatchError, match="q_proj") as info:
        engine.load_into(path, {"model.layers.0.self_attn.q_proj.weight": np.empty((64, 65), np.float32)})
    assert str(path) in str(info.value)
    with pytest.raises(TensorMismatchError, match="F64"):
        engine.load_into(path, {"ids": np.empty(10, np.float64)})
    with pytest.raises(TensorMismatchError, match="contiguous"):
        engine.load_into(path, {"ids": np.empty(20, np.int64)[::2]})
    with pytest.raises(TensorMismatchError, match="contiguous and writable"):
        ro = np.empty(10, np.int64)
        ro.flags.writeable = False
        engine.load_into(path, {"ids": ro})
    with pytest.raises(TensorNotFoundError):
        engine.load_into(path, {"nope": np.empty(1)})
    with pytest.raises(TensorNotFoundError, match="no destination"):
        engine.load_into(path, {"ids": np.empty(10, np.int64)}, strict=True)
    assert counter.bytes == 0  # every check happens before a byte of tensor data is read


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("per_tensor", [False, True])
def test_stream_to_cuda(model_file, per_tensor):
    path, sd = model_file
    got = dict(engine.stream(path, framework="pt", device="cuda:0", per_tensor=per_tensor, chunk_bytes=8192))
    for k, v in sd.items():
        assert got[k].is_cuda
        np.testing.assert_array_equal(got[k].cpu().numpy(), v)
    if not per_tensor:
        ptrs = [t.data_ptr() for t in got.values() if t.numel()]
        assert all(p % 256 == 0 for p in ptrs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_load_into_cuda(model_file):
    path, sd = model_file
    dst = {k: torch.empty(v.shape, dtype=torch.float32, device="cuda") for k, v in sd.items() if v.dtype == np.float32}
    engine.load_into(path, dst)
    for k, t in dst.items():
        np.testing.assert_array_equal(t.cpu().numpy(), sd[k])


@pytest.mark.cuda
@pytest.mark.parametrize("per_tensor", [False, True])
def test_stream_to_cupy(model_file, per_tensor):
    cupy = pytest.importorskip("cupy", reason="CuPy is an optional extra")
    if cupy.cuda.runtime.getDeviceCount() == 0:  # pragma: no cover - depends on hardware
        pytest.skip("needs an NVIDIA GPU")
    path, sd = model_file
    got = dict(engine.stream(path, framework="cupy", device="cuda:0", per_tensor=per_tensor, chunk_bytes=8192))
    for k, v in sd.items():
        np.testing.assert_array_equal(cupy.asnumpy(got[k]), v)
    with engine.safe_open(path, framework="cupy", device=0) as f:
        np.testing.assert_array_equal(cupy.asnumpy(f.get_slice("ids")[2:5]), sd["ids"][2:5])


@pytest.mark.cuda
def test_load_into_cupy(model_file):
    cupy = pytest.importorskip("cupy", reason="CuPy is an optional extra")
    if cupy.cuda.runtime.getDeviceCount() == 0:  # pragma: no cover - depends on hardware
        pytest.skip("needs an NVIDIA GPU")
    path, sd = model_file
    dst = {k: cupy.empty(v.shape, v.dtype) for k, v in sd.items() if v.size}
    assert sorted(engine.load_into(path, dst)) == sorted(dst)
    for k, a in dst.items():
        np.testing.assert_array_equal(cupy.asnumpy(a), sd[k])


class EmulatedArray:
    """A tensor of a framework the engine does not know, in the emulated device's memory."""

    def __init__(self, code, shape, nbytes):
        self.code, self.shape, self.data = code, shape, bytearray(nbytes)


@pytest.mark.parametrize("gpu_path", ["copy", "auto"])
def test_load_into_reaches_a_device_through_the_destinations_own_ops(model_file, monkeypatch, gpu_path):
    """load_into knows no framework: each destination's fill target gives its bytes and, on a
    device, the operations that copy into it (how CuPy arrays and CUDA tensors are filled).
    Host and device destinations in one call, the device emulated on the CPU."""
    from emucudart import EmulatedRingOps, Emulator

    import engine.loading.fill
    from engine.base import dtypes
    from engine.sinks._targets import FillTarget

    path, sd = model_file
    emulator = Emulator()
    emulator.reset()
    emu = EmulatedRingOps(emulator)
    made: list[str] = []

    class EmulatedTarget(FillTarget):
        device = ("emulated", 0)

        def __init__(self, arr):
            super().__init__(arr, arr.code, arr.shape, True, "emulated")

        def device_bytes(self):
            return memoryview(self.tensor.data)

        def device_ops(self):
            made.append("ops")
            return emu

    real = engine.loading.fill.fill_target
    monkeypatch.setattr(engine.loading.fill, "fill_target",
                        lambda x: EmulatedTarget(x) if isinstance(x, EmulatedArray) else real(x))
    on_device = [k for k in sd if "proj" in k or k == "ids"]
    dst = {k: EmulatedArray(dtypes.from_numpy(sd[k].dtype), sd[k].shape, sd[k].nbytes) for k in on_device}
    host = {k: np.zeros_like(v) for k, v in sd.items() if k not in dst}
    try:
        filled = engine.load_into(path, {**dst, **host}, strict=True, gpu_path=gpu_path, chunk_bytes=4096)
    finally:
        emulator.assert_clean()
        emu.close()
    assert sorted(filled) == sorted(sd) and made == ["ops"]  # one device load for all its tensors
    for k in on_device:
        assert bytes(dst[k].data) == sd[k].tobytes(), k
    for k, a in host.items():
        np.testing.assert_array_equal(a, sd[k])
    assert emulator.stats()["copies"] > 0
    with pytest.raises(TensorMismatchError, match="F64"):  # checked through the target too
        engine.load_into(path, {"ids": EmulatedArray(dtypes.BY_NAME["F64"].code, (10,), 80)})


def test_load_into_a_device_it_cannot_fill_is_a_device_error(model_file):
    from engine.errors import DeviceError

    path, _ = model_file
    with pytest.raises(DeviceError, match="'meta'") as err:
        engine.load_into(path, {"ids": torch.empty(10, dtype=torch.int64, device="meta")})
    assert err.value.reason == "UnsupportedDevice" and list(err.value.tensors) == ["ids"]
    with pytest.raises(TensorMismatchError, match="cannot load into a list"):
        engine.load_into(path, {"ids": [0] * 10})


# -- statistics while loading -------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [64, 4096, None])
@pytest.mark.parametrize("window", [None, 64, 1024])
def test_stream_stats_equal_stats_of_the_loaded_tensors(tmp_path, monkeypatch, chunk, window):
    pytest.importorskip("numba", reason="statistics need Numba (a test extra)")
    if window:  # pieces of at least `window` bytes take the native read-and-fold path
        monkeypatch.setattr(engine.loading.cpu_stats.StatsCollector, "WINDOW", window)
    import ml_dtypes

    rng = np.random.default_rng(3)
    sd = {
        "f32": rng.standard_normal((300, 7)).astype(np.float32),
        "bf16": rng.standard_normal((50, 33)).astype(ml_dtypes.bfloat16),
        "ids": rng.integers(-5, 5, 1000),
        "nan": np.array([1.0, np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32),
        "fp8": rng.standard_normal(16).astype(ml_dtypes.float8_e4m3fn),
        "empty": np.zeros((0, 4), np.float32),
    }
    path = tmp_path / "s.safetensors"
    engine.numpy.save_file(sd, path)
    got = {n: (t, s) for n, t, s in engine.stream(path, framework="np", device="cpu", stats=True, chunk_bytes=chunk,
                                                   threads=3)}
    assert got.keys() == sd.keys()
    assert got["fp8"][1] is None  # not summarised
    for name in ("f32", "bf16", "ids", "nan", "empty"):
        whole = engine.stats(sd[name])
        piecewise = got[name][1]
        assert (piecewise.count, piecewise.nan_count, piecewise.posinf_count, piecewise.neginf_count,
                piecewise.zero_count) == (whole.count, whole.nan_count, whole.posinf_count, whole.neginf_count,
                                          whole.zero_count), name
        for field in ("min", "max", "absmax"):
            a, b = getattr(piecewise, field), getattr(whole, field)
            assert (np.isnan(a) and np.isnan(b)) or a == b, (name, field)
        for field in ("mean", "std"):
            a, b = getattr(piecewise, field), getattr(whole, field)
            assert (np.isnan(a) and np.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=1e-12), (name, field)
    files = engine.stats_file(path)
    assert "fp8" not in files and files["ids"].max == sd["ids"].max()


# -- several files as one load ------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    sd = _model()
    names = list(sd)
    folder = tmp_path_factory.mktemp("shards")
    paths = []
    for i, part in enumerate((names[:10], names[10:20], names[20:])):
        p = folder / f"model-{i + 1:05d}-of-00003.safetensors"
        engine.numpy.save_file({n: sd[n] for n in part}, p)
        paths.append(p)
    return paths, sd


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_stream_over_several_files_is_one_load(shards, framework):
    paths, sd = shards
    got = dict(engine.stream(paths, framework=framework, device="cpu", threads=3, chunk_bytes=4096))
    assert got.keys() == sd.keys()
    for name, arr in sd.items():
        np.testing.assert_array_equal(got[name].numpy() if framework == "pt" else got[name], arr)


def test_selection_over_several_files(shards):
    paths, sd = shards
    got = dict(engine.stream(paths, framework="np", device="cpu", names=["ids"], patterns="model.layers.7.*"))
    assert set(got) == {"ids"} | {n for n in sd if n.startswith("model.layers.7.")}
    with pytest.raises(TensorNotFoundError):
        list(engine.stream(paths, framework="np", device="cpu", names=["nope"]))
    with pytest.raises(TensorNotFoundError):
        list(engine.stream(paths, framework="np", device="cpu", patterns="nope.*"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("gpu_path", ["auto", "copy"])
def test_stream_several_files_to_cuda_by_each_path(shards, gpu_path):
    paths, sd = shards
    got = dict(engine.stream(paths, framework="pt", device="cuda:0", gpu_path=gpu_path, slot_bytes=1 << 16))
    assert got.keys() == sd.keys()
    for k, v in sd.items():
        assert got[k].is_cuda
        np.testing.assert_array_equal(got[k].cpu().numpy(), v)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("gpu_path", ["auto", "copy"])
def test_every_dtype_and_a_selection_to_cuda_equal_the_reference(tmp_path, gpu_path):
    safetensors_torch = pytest.importorskip("safetensors.torch", reason="the reference is a test dependency")
    gen = torch.Generator().manual_seed(0)
    sd = {}
    for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
               torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2):
        raw = torch.randint(0, 256, (1 + 3 * 1024 * 1024 // 8 * 8,), dtype=torch.uint8, generator=gen)
        n = raw.numel() // dt.itemsize * dt.itemsize
        t = raw[:n].view(dt) if dt is not torch.bool else raw[:n] % 2 == 1
        sd[f"t.{dt}".replace("torch.", "")] = t.reshape(-1, 8) if t.numel() % 8 == 0 else t
    path = tmp_path / "all.safetensors"
    safetensors_torch.save_file(sd, path)
    want = safetensors_torch.load_file(path, device="cuda:0")
    got = dict(engine.stream(path, framework="pt", device="cuda:0", gpu_path=gpu_path, slot_bytes=1 << 20))
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
    picked = ["t.bfloat16", "t.int8"]
    some = dict(engine.stream(path, framework="pt", device="cuda:0", names=picked, gpu_path=gpu_path))
    assert sorted(some) == picked
    for k in picked:
        assert torch.equal(some[k].view(torch.uint8), want[k].view(torch.uint8)), k


def test_load_into_refuses_devices_without_memory_it_can_fill(tmp_path):
    """A meta (or other non-CPU, non-CUDA) destination is an engine DeviceError naming the
    file and tensor, not torch's own error about CUDA."""
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    path = tmp_path / "m.safetensors"
    engine.torch.save_file({"a": torch.arange(4, dtype=torch.float32)}, path)
    with pytest.raises(engine.DeviceError) as info:
        engine.load_into(path, {"a": torch.empty(4, device="meta")})
    assert info.value.tensors == ("a",) and info.value.path == str(path) and "meta" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_load_into_a_float4_destination(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch build has no float4_e2m1fn_x2")
    x = torch.arange(8, dtype=torch.uint8).view(torch.float4_e2m1fn_x2).reshape(2, 4)
    path = tmp_path / "f4.safetensors"
    engine.torch.save_file({"x": x}, path)
    for dst in (torch.empty(2, 4, dtype=torch.float4_e2m1fn_x2), torch.empty(2, 4, dtype=torch.uint8)):
        engine.load_into(path, {"x": dst})
        assert torch.equal(dst.view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize("gpu_path", ["copy", "auto"])
def test_load_file_into_a_device_is_one_pipeline_in_file_order(model_file, monkeypatch, gpu_path):
    """loader.load_file: the short path of torch.load_file(f, device=...) with no handle."""
    path, sd = model_file
    real = engine.loading.pipeline.run_sources
    runs = []

    def counting(*a, **k):
        runs.append(1)
        return real(*a, **{**k, "gpu_path": gpu_path})

    monkeypatch.setattr(engine.loading.pipeline, "run_sources", counting)
    from emucudart import EmulatedRingOps, EmulatedSink, Emulator

    emulator = Emulator()
    emulator.reset()
    sink = EmulatedSink(EmulatedRingOps(emulator))
    try:
        out = engine.loading.loader.load_file(path, sink)
    finally:
        emulator.assert_clean()
        sink.ops.close()
    assert runs == [1]
    assert list(out) == engine.read_header(path).offset_keys()
    for name, a in sd.items():
        assert bytes(out[name]) == a.tobytes(), name
    assert emulator.stats()["copies"] > 0 and sink.allocations == [len(sd)]
    assert sink.per_tensor == [True]  # each tensor the framework allocator's own (record_stream holds)


def test_a_device_stream_asks_one_allocation_per_tensor_unless_told(model_file, monkeypatch):
    """torch's record_stream holds only on storages its caching allocator made: a device
    load gives every tensor its own by default, one shared block only when asked."""
    path, sd = model_file
    from emucudart import EmulatedRingOps, EmulatedSink, Emulator

    emulator = Emulator()
    emulator.reset()
    sink = EmulatedSink(EmulatedRingOps(emulator))
    monkeypatch.setattr(engine.loading.loader, "sink_for", lambda framework, device: sink)
    try:
        for options in ({}, {"per_tensor": False}):
            got = dict(engine.stream(path, framework="np", device="emulated", **options))
            assert {k: bytes(v) for k, v in got.items()} == {k: a.tobytes() for k, a in sd.items()}
    finally:
        emulator.assert_clean()
        sink.ops.close()
    assert sink.per_tensor == [True, False]


def test_torch_load_file_pread_takes_the_short_path_and_equals_the_reference(model_file, monkeypatch):
    import safetensors.torch

    path, _ = model_file
    calls = []
    real = engine.loading.loader.load_file
    monkeypatch.setattr(engine.loading.loader, "load_file", lambda *a, **k: calls.append(1) or real(*a, **k))
    ours = engine.torch.load_file(path, backend="pread")
    ref = safetensors.torch.load_file(path)
    assert calls == [1] and list(ours) == list(ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    assert engine.torch.load_file(path, backend="mmap").keys() == ref.keys() and calls == [1]


def test_prepare_device_needs_a_cuda_device():
    import engine

    with pytest.raises(ValueError, match="CUDA device"):
        engine.prepare_device("cpu")
    with pytest.raises(ValueError, match="CUDA device"):
        engine.prepare_device("cpu", framework="np")
