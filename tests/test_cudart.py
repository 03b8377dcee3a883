"""engine.sinks._cudart on a machine without CUDA: the runtime is found at run time or not
at all, errors are cleared, and engine-locked blocks are unlocked when released."""

from __future__ import annotations

import mmap
import os

import pytest
from conftest import run_python

from engine.sinks import _cudart


class FakeRuntime:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.locked: dict[int, tuple[int, int]] = {}
        self.cleared = 0
        self.flags_seen: set[int] = set()

    def register(self, addr, nbytes, flags):
        if self.fail:
            return 1  # cudaErrorInvalidValue
        if any(a < addr + nbytes and addr < a + n for a, (n, _) in self.locked.items()):
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.flags_seen.add(flags)
        self.locked[addr] = (nbytes, flags)
        return 0

    def unregister(self, addr):
        return 0 if self.locked.pop(addr, None) else 712  # cudaErrorHostMemoryNotRegistered

    def clear(self):
        self.cleared += 1
        return 0


def _runtime(fake):
    return _cudart.Runtime(fake.register, fake.unregister, fake.clear, "fake")


def test_failures_are_returned_and_cleared():
    fake = FakeRuntime(fail=True)
    rt = _runtime(fake)
    assert rt.host_register(4096, 4096, _cudart.HOST_REGISTER_DEFAULT) == 1
    assert fake.cleared == 1
    assert rt.host_unregister(4096) == 712 and fake.cleared == 2

    def boom(*args):
        raise RuntimeError("cupy raises instead")

    assert _cudart.Runtime(boom, boom, fake.clear, "raising").host_register(0, 1, 0) == -1


def test_pinned_block_is_locked_once_and_unlocked_on_release(monkeypatch):
    fake = FakeRuntime()
    monkeypatch.setattr(_cudart, "runtime", lambda: _runtime(fake))
    block = _cudart.PinnedBlock(3 * mmap.PAGESIZE)
    assert block.locked and list(fake.locked) == [block.addr]
    assert fake.locked[block.addr] == (3 * mmap.PAGESIZE, _cudart.HOST_REGISTER_DEFAULT)
    assert len(block.view) == 3 * mmap.PAGESIZE and not block.view.readonly
    block.view[:5] = b"hello"
    block.release()
    block.release()  # twice is harmless
    assert not fake.locked and not block.locked


def test_refused_block_still_works_unlocked(monkeypatch):
    monkeypatch.setattr(_cudart, "runtime", lambda: _runtime(FakeRuntime(fail=True)))
    block = _cudart.PinnedBlock(100)
    assert not block.locked and len(block.view) == 100
    block.release()


def test_staging_slots_are_locked_portable_and_writable():
    assert _cudart.HOST_REGISTER_DEFAULT & _cudart.HOST_REGISTER_PORTABLE
    assert not _cudart.HOST_REGISTER_DEFAULT & 0x08  # not cudaHostRegisterReadOnly: the process writes slots


def test_address_of_a_read_only_mapping(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x" * 10_000)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        a = _cudart.address_of(view)
        assert a % mmap.PAGESIZE == 0 and _cudart.address_of(view[100:]) == a + 100
        view.release()
    assert _cudart.address_of(memoryview(b"")) == 0


def test_no_runtime_without_cuda():
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    if torch.cuda.is_available():  # pragma: no cover - depends on hardware
        pytest.skip("a CUDA runtime is present")
    # in a fresh process: other tests (Numba's CUDA compiler) may have mapped a libcudart here

    code = (
        "import torch\n"
        "from engine.sinks import _cudart\n"
        "print(_cudart._loaded_cudart_path(), _cudart.runtime())\n"
    )
    assert run_python(code, timeout=120).split() == ["None", "None"]


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
    from engine.sinks import _torch_fill as torch_fill

    emu = Emulator()
    emu.reset()
    stream = emu.new_stream()

    class Ops(torch_fill.TorchCudaOps):
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
