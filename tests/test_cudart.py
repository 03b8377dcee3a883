"""The CUDA runtime the chunk ring calls, on a machine without CUDA: found at run time or not
at all; the torch ops drive the ring over the emulated runtime."""

from __future__ import annotations

import os

import pytest
from conftest import run_python


def test_no_runtime_without_cuda():
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    if torch.cuda.is_available():  # pragma: no cover - depends on hardware
        pytest.skip("a CUDA runtime is present")
    # in a fresh process: other tests (Numba's CUDA compiler) may have mapped a libcudart here

    code = (
        "import torch\n"
        "from engine.gpu import cudart\n"
        "print(cudart._loaded_cudart_path())\n"
    )
    assert run_python(code, timeout=120).split() == ["None"]


# -- the torch ops over the runtime, with the CUDA calls stubbed ------------------------------------


@pytest.mark.parametrize("route", ["runtime", "driver"])
def test_torch_cuda_ops_drive_the_chunk_ring_over_the_emulated_runtime(tmp_path, monkeypatch, route):
    """TorchCudaOps on CPU tensors through the native ring, the CUDA runtime emulated: the
    torch side (device addresses from ``data_ptr``, the ring's entry points) lands every byte.
    ``driver``: the ring calls the driver's entry points in the runtime's place, as in a
    process that maps no runtime; they fail on a thread with no current context, which the
    runtime's would have bound."""
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    import numpy as np
    from emucudart import Emulator

    from engine.gpu import rings
    from engine.loading import pipeline
    from engine.planning.plan import plan_reads
    from engine.sinks import torch as torch_sink

    emu = Emulator()
    emu.reset()

    class Ops(torch_sink.TorchCudaOps):
        device_index = 0  # a CPU device has no CUDA index

        def runtime_path(self):
            return ("driver:" if route == "driver" else "") + emu.path

    ops = Ops(torch.device("cpu"))
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 3_000_000, dtype=np.uint8)
    path = tmp_path / "w.bin"
    path.write_bytes(data.tobytes())
    sizes = [0, 700_000, 1, 1_200_000, 99_999, 900_000]
    ends = np.cumsum(sizes)
    begins = ends - np.array(sizes)
    fd = os.open(path, os.O_RDONLY)
    try:
        dst = {r: torch.zeros(n, dtype=torch.uint8) for r, n in enumerate(sizes)}
        pipeline.run(fd, plan_reads(begins, ends, range(len(sizes)), 17, 1 << 18),
                     pipeline.Destination(device_targets=dst, device_ops=ops), path=str(path), slot_bytes=1 << 19)
        for r, n in enumerate(sizes):
            b = 17 + int(begins[r])
            assert bytes(dst[r].numpy()) == data[b : b + n].tobytes(), r
    finally:
        os.close(fd)
        rings.release_rings()
    st = emu.stats()
    assert st["copies"] > 0 and st["pageable"] == 0 and st["registered"] == 0 and st["events"] == 0
    assert st["streams"] == 0  # the ring's own, destroyed with it
    emu.assert_clean()
    from engine.gpu import cudart

    assert cudart.runtime(ops.runtime_path()).driver_route == (route == "driver")


# -- which libcudart: the framework's CUDA major --------------------------------------------------


def test_the_runtime_of_the_frameworks_cuda_major_is_chosen(tmp_path):
    """Two runtimes mapped (torch's and another library's), or none: the one of the
    framework's CUDA major is taken, not the first mapped or the newest soname (a 13.x runtime
    fails with "insufficient driver" on a 12.x driver)."""
    import shutil

    from emucudart import Emulator

    lib = Emulator().path
    for major in (13, 12):
        shutil.copy(lib, tmp_path / f"libcudart.so.{major}")
    code = (
        "import ctypes, sys\n"
        "from engine.gpu import cudart\n"
        f"ctypes.CDLL({str(tmp_path / 'libcudart.so.13')!r}); ctypes.CDLL({str(tmp_path / 'libcudart.so.12')!r})\n"
        "print(cudart.cuda_runtime_path(12)); print(cudart.cuda_runtime_path(13))\n"
        "print(cudart.cuda_runtime_path())\n"
    )
    twelve, thirteen, first = run_python(code, timeout=120).split()
    assert twelve == str(tmp_path / "libcudart.so.12") and thirteen == str(tmp_path / "libcudart.so.13")
    assert first in (twelve, thirteen)  # no major known: the first mapped, as before


def _loads(name: str) -> bool:
    import ctypes

    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def test_a_process_that_maps_no_runtime_is_served_by_the_driver(tmp_path):
    """CuPy links its runtime in statically: its process maps no ``libcudart``.  The driver
    (``libcuda.so.1``, which every CUDA process maps) stands for the runtime then, not some
    ``libcudart`` the loader happens to find (a second instance, of some major; here a
    ``libcudart.so.12`` is on the loader's path beside it, and the machine's own may be too).
    Without a driver there is nothing to copy through: None."""
    import shutil

    from emucudart import Emulator

    shutil.copy(Emulator().path, tmp_path / "libcudart.so.12")
    code = (
        "from engine.gpu import cudart\n"
        "path = cudart.cuda_runtime_path(12)\n"
        "print(path)\n"
        "if path:\n"
        "    rt = cudart.runtime(path)\n"
        "    print(rt.driver_route, rt.path, rt.error_string(2))\n"
    )
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    expected = [["driver:libcuda.so.1"], ["True libcuda.so.1 out of memory"]] if _loads("libcuda.so.1") else [["None"]]
    if not _loads("libcuda.so.1"):
        assert [line.split(" ", 2) for line in run_python(code, timeout=120, env=env).splitlines()] == expected
    shutil.copy(Emulator().path, tmp_path / "libcuda.so.1")  # a driver on the loader's path
    out = run_python(code, timeout=120, env=env).splitlines()
    assert out == ["driver:libcuda.so.1", "True libcuda.so.1 out of memory"]


# -- "cuda" without an index: the caller's device, resolved on the caller's thread -----------------


def test_cuda_without_an_index_is_the_callers_device_resolved_on_its_thread(monkeypatch):
    """torch's current device and stream are per thread; the ring asks for the device index
    from its own threads (the stream worker, the prepare thread), where the current device is
    GPU 0.  It is resolved once, on the caller's thread, and the consumer's fence is recorded
    there too.  A CPU build of torch has no CUDA: its per-thread current device and the
    fence's event are stood in for here (a GPU run checks the same with the real ones:
    ``scripts/driver_check.py``)."""
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    import threading

    from engine.sinks import torch as torch_sink

    local = threading.local()

    class Fence:  # recorded on the current stream of the thread that makes it
        def __init__(self, device):
            self.cuda_event = 0x1000 * (1 + getattr(local, "device", 0))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(local, "device", 0))
    monkeypatch.setattr(torch_sink, "_fence", Fence)
    local.device = 1  # the caller's torch.cuda.set_device(1)
    sink = torch_sink.TorchSink("cuda")
    seen: dict = {}

    def elsewhere():  # a thread of the engine's: its current device is GPU 0
        ops = sink.ring_ops()
        seen.update(index=ops.device_index)

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert sink.device == torch.device("cuda", 1)
    # the ops made on the engine's thread still name the caller's device; its stream there
    assert seen["index"] == 1
    ops = sink.ring_ops()
    assert ops.device_index == 1 and ops.consumer_fence() == 0x2000
