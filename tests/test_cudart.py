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
        "from engine.gpu import device_ring\n"
        "print(device_ring._loaded_cudart_path())\n"
    )
    assert run_python(code, timeout=120).split() == ["None"]


# -- the torch ops over the runtime, with the CUDA calls stubbed ------------------------------------


def test_torch_cuda_ops_drive_the_chunk_ring_over_the_emulated_runtime(tmp_path, monkeypatch):
    """TorchCudaOps on CPU tensors through the native ring, the CUDA runtime emulated: the
    torch side (device addresses from ``data_ptr``, the ring's entry points) lands every byte."""
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    import numpy as np
    from emucudart import Emulator

    from engine.gpu import device_ring
    from engine.loading import pipeline
    from engine.planning.plan import plan_reads
    from engine.sinks import torch as torch_sink

    emu = Emulator()
    emu.reset()
    stream = emu.new_stream()

    class Ops(torch_sink.TorchCudaOps):
        device_index = 0  # a CPU device has no CUDA index

        def runtime_path(self):
            return emu.path

        def ring_stream(self):
            return stream, None

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
        device_ring.release_rings()
        emu.destroy_stream(stream)
    st = emu.stats()
    assert st["copies"] > 0 and st["pageable"] == 0 and st["registered"] == 0 and st["events"] == 0
