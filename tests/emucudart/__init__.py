"""The emulated CUDA runtime (``emucudart.c`` beside this file): built with the machine's C
compiler on first use, loaded by path, so that the engine's native ring calls it exactly as it
calls a real ``libcudart`` (see the C file for what it emulates and the controls it adds).

Used by the tests, ``scripts/bench_host.py`` and ``scripts/gpu_check.py``'s dry mode.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import weakref
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("emucudart.c")
_STATS = ("copies", "bytes", "pageable", "wrong_device", "registered", "streams", "events",
          "max_queued", "records", "registrations")


def build() -> str:
    """Path of the compiled library (built once per source version, in ``build/emucudart``
    of the checkout, or a temporary folder where that is not writable)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    for base in (Path(__file__).resolve().parents[2] / "build" / "emucudart",
                 Path(tempfile.gettempdir()) / "engine-emucudart"):
        lib = base / f"libemucudart-{digest}.so"
        if lib.exists():
            return str(lib)
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("no C compiler to build the emulated CUDA runtime")
        tmp = base / f".{lib.name}.{os.getpid()}"
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(tmp), str(SOURCE)], check=True,
                       capture_output=True)
        os.replace(tmp, lib)
        return str(lib)
    raise RuntimeError("nowhere to build the emulated CUDA runtime")


class Emulator:
    """The library loaded by path (the same instance the ring opens), with its controls."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or build()
        self.lib = ctypes.CDLL(self.path)
        for name in ("emu_set_copy_delay_ns",):
            getattr(self.lib, name).argtypes = [ctypes.c_int64]
        self.lib.emu_fail_copy.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        self.lib.emu_fail_event_record_after.argtypes = [ctypes.c_int64]
        self.lib.emu_set_register_cost.argtypes = [ctypes.c_int64]
        self.lib.emu_contexts.restype = ctypes.c_int64
        self.lib.emu_primary_refs.restype = ctypes.c_int64
        self.lib.emu_bad_releases.restype = ctypes.c_int64
        self.lib.emu_launch_fill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t,
                                             ctypes.c_int64]
        self.lib.emu_launch_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                             ctypes.c_int64]
        self.lib.emu_launch_wait_flag.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib.emu_alloc.argtypes = [ctypes.c_size_t, ctypes.c_void_p]
        self.lib.emu_alloc.restype = ctypes.c_void_p
        self.lib.emu_free.argtypes = [ctypes.c_void_p]
        self.lib.emu_pool_reused.restype = ctypes.c_int64
        self.lib.cudaStreamDestroy.argtypes = [ctypes.c_void_p]
        self.lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        self.lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        self.lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        self.lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib.cudaEventDestroy.argtypes = [ctypes.c_void_p]

    def reset(self) -> None:
        self.lib.emu_reset()

    def delay(self, seconds: float) -> None:
        """Each copy sleeps this long when its stream runs it."""
        self.lib.emu_set_copy_delay_ns(int(seconds * 1e9))

    def noop(self, on: bool = True) -> None:
        """Copies move no bytes (to time the ring alone)."""
        self.lib.emu_set_noop(int(on))

    def fail_copy(self, nth: int, code: int = 700, asynchronous: bool = False) -> None:
        """Copy number ``nth`` since the last reset fails with ``code``: at issue, or when it runs."""
        self.lib.emu_fail_copy(nth, code, int(asynchronous))

    def fail_register(self, code: int) -> None:
        self.lib.emu_fail_register(code)

    def fail_set_device(self, code: int) -> None:
        """``cudaSetDevice`` returns ``code`` (0: succeeds again)."""
        self.lib.emu_fail_set_device(code)

    def register_cost(self, seconds_per_mib: float) -> None:
        """Each ``cudaHostRegister`` takes this long per MiB it page-locks."""
        self.lib.emu_set_register_cost(int(seconds_per_mib * 1e9))

    def contexts(self, device: int) -> int:
        """Primary contexts made on ``device`` since the last reset (by any thread)."""
        return int(self.lib.emu_contexts(device))

    def primary_refs(self, device: int) -> int:
        """References to ``device``'s primary context retained and not released (since the last reset)."""
        return int(self.lib.emu_primary_refs(device))

    def bad_releases(self) -> int:
        """Releases of a primary context with no reference left (refused, as a driver refuses them)."""
        return int(self.lib.emu_bad_releases())

    def set_device(self, device: int) -> None:
        """``cudaSetDevice`` on the calling thread (its context made current, as CUDA 12 does)."""
        assert self.lib.cudaSetDevice(device) == 0

    def current_device(self) -> int:
        """``cudaGetDevice`` on the calling thread."""
        out = ctypes.c_int(-1)
        self.lib.cudaGetDevice(ctypes.byref(out))
        return out.value

    def current_context(self) -> int | None:
        """``cuCtxGetCurrent`` on the calling thread (None: no context current)."""
        out = ctypes.c_void_p()
        self.lib.cuCtxGetCurrent(ctypes.byref(out))
        return out.value

    def last_error(self) -> int:
        """``cudaGetLastError`` on the calling thread (which clears it)."""
        return int(self.lib.cudaGetLastError())

    def launch_fill(self, stream: int, target, value: int, seconds: float) -> None:
        """A kernel stand-in queued on ``stream`` (0: the current device's default stream): after
        ``seconds``, every byte of ``target`` (a numpy array, "device memory") set to ``value``."""
        arr = np.frombuffer(target, np.uint8)
        assert self.lib.emu_launch_fill(stream or None, arr.ctypes.data, value, arr.nbytes, int(seconds * 1e9)) == 0

    def launch_copy(self, stream: int, target, source: int, seconds: float) -> None:
        """A kernel stand-in that reads, queued on ``stream``: after ``seconds``, the bytes at
        device address ``source`` copied into ``target`` (a numpy array or CPU tensor), read
        when the stream runs it, as a framework's queued operation reads its operands."""
        arr = np.frombuffer(target, np.uint8) if not hasattr(target, "data_ptr") else None
        dst = arr.ctypes.data if arr is not None else target.data_ptr()
        n = arr.nbytes if arr is not None else target.numel() * target.element_size()
        assert self.lib.emu_launch_copy(stream or None, dst, source, n, int(seconds * 1e9)) == 0

    def wait_flag(self, stream: int, flag: np.ndarray) -> None:
        """A kernel stand-in queued on ``stream`` that spins until ``flag[0]`` (an int32 array)
        is set by the host: whatever is queued after it on that stream waits as long."""
        assert flag.dtype == np.int32
        assert self.lib.emu_launch_wait_flag(stream or None, flag.ctypes.data) == 0

    def pool_empty(self, nbytes: int, stream: int = 0) -> np.ndarray:
        """``nbytes`` of "device memory" from the emulated caching allocator, for ``stream``
        (0: the default stream), as a uint8 array: when the array and every view of it are
        gone the block goes back to the stream's pool at once, and the next allocation of its
        size for that stream gets it, whatever work queued elsewhere still uses it."""
        p = self.lib.emu_alloc(nbytes, stream or None)
        if not p:
            raise MemoryError(f"the emulated allocator cannot give {nbytes} bytes")
        memory = (ctypes.c_uint8 * max(nbytes, 1)).from_address(p)
        weakref.finalize(memory, self.lib.emu_free, p)  # every view of the array keeps it alive
        return np.frombuffer(memory, np.uint8)[:nbytes]

    def pool_reused(self) -> int:
        """Allocations the caching allocator served from a freed block since the last reset."""
        return int(self.lib.emu_pool_reused())

    def synchronize(self, stream: int) -> int:
        return int(self.lib.cudaStreamSynchronize(stream or None))

    def fail_event_record_after(self, n: int) -> None:
        self.lib.emu_fail_event_record_after(n)

    def devices(self, n: int) -> None:
        self.lib.emu_set_devices(n)

    #: the consumers' fences alive, per library (every Emulator of a path drives the one
    #: library): ``stats()``'s ``events`` counts the others, the engine's
    fences: dict[str, int] = {}

    def stats(self) -> dict[str, int]:
        out = (ctypes.c_int64 * len(_STATS))()
        self.lib.emu_stats(out)
        st = dict(zip(_STATS, out, strict=True))
        st["fences"] = Emulator.fences.get(self.path, 0)
        st["events"] -= st["fences"]
        return st

    def assert_clean(self) -> None:
        """Nothing left behind by the loads so far: every ring closed (lingering ones now),
        every chunk unlocked, every event destroyed, every copy from page-locked memory."""
        from engine.gpu import rings

        rings.release_rings()
        st = self.stats()
        assert st["registered"] == 0 and st["events"] == 0, st
        assert st["pageable"] == 0 and st["wrong_device"] == 0, st

    def new_stream(self, device: int | None = None) -> int:
        """A stream of ``device`` (None: the calling thread's), made as a framework makes one:
        on that device, the thread's own context put back after."""
        with self.on_device(device):
            handle = ctypes.c_void_p()
            assert self.lib.cudaStreamCreate(ctypes.byref(handle)) == 0
        return int(handle.value or 0)

    def destroy_stream(self, handle: int, device: int | None = None) -> None:
        with self.on_device(device):
            self.lib.cudaStreamDestroy(handle)

    @contextlib.contextmanager
    def on_device(self, device: int | None):
        """``device``'s primary context pushed on this thread for the block and popped after,
        as a framework's device guard does it: the thread's own context (or none) and device
        are as they were."""
        if device is None:
            yield
            return
        ctx = ctypes.c_void_p()
        assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) == 0
        assert self.lib.cuCtxPushCurrent_v2(ctx) == 0
        try:
            yield
        finally:
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
            self.lib.cuDevicePrimaryCtxRelease_v2(device)

    def fence(self, stream: int, device: int) -> int:
        """An event of ``device`` recorded now on ``stream`` (0: the default stream; 2: the
        calling thread's own) from the calling thread, as a framework records a fence."""
        event = ctypes.c_void_p()
        with self.on_device(device):
            assert self.lib.cudaEventCreateWithFlags(ctypes.byref(event), 2) == 0
            assert self.lib.cudaEventRecord(event, stream or None) == 0
        Emulator.fences[self.path] = Emulator.fences.get(self.path, 0) + 1
        return int(event.value or 0)

    def destroy_event(self, event: int) -> None:
        self.lib.cudaEventDestroy(event)
        Emulator.fences[self.path] -= 1


class EmulatedRingOps:
    """Device operations for the engine's chunk ring over the emulated runtime: "device"
    buffers are numpy arrays in this process, a stream is one the emulator made."""

    def __init__(self, emulator: Emulator, device: int = 0, consumer: int | None = 0) -> None:
        self.emulator = emulator
        self.device_index = device
        self.streams: list[int] = []
        # the consumer's fence, on its stream (0: the device's default stream; 2: this
        # thread's own; None: none), recorded here on the thread that makes the ops, as the
        # framework's ops record theirs
        self.consumer = consumer
        self.fence = emulator.fence(consumer, device) if consumer is not None else None

    def runtime_path(self) -> str:
        return self.emulator.path

    def ring_stream(self):
        handle = self.emulator.new_stream(self.device_index)
        self.streams.append(handle)
        return handle, None

    def consumer_fence(self) -> int | None:
        return self.fence

    def fence_again(self) -> None:
        """The fence recorded again on the consumer's stream, now, from the calling thread."""
        if self.fence is not None:
            with self.emulator.on_device(self.device_index):
                assert self.emulator.lib.cudaEventRecord(self.fence, self.consumer or None) == 0

    def address(self, target) -> int:
        return int(np.frombuffer(target, np.uint8).ctypes.data) if len(target) else 0

    def close(self) -> None:
        for handle in self.streams:
            self.emulator.destroy_stream(handle, self.device_index)
        self.streams = []
        if self.fence is not None:
            with self.emulator.on_device(self.device_index):
                self.emulator.destroy_event(self.fence)
            self.fence = None


class EmulatedSink:
    """A device sink over the emulated runtime, for driving the engine's public loaders (a
    ``safe_open`` handle's ``get_tensor`` loop) down to the ring: "device" tensors are numpy
    arrays, allocated in one block per load whatever ``per_tensor`` asks; ``allocations``
    records each load's number of tensors and ``per_tensor`` what each asked."""

    name = "numpy"
    on_device = True
    moves = False

    def __init__(self, ops: EmulatedRingOps) -> None:
        from engine.sinks.numpy import NumpySink

        self.ops = ops
        self.host = NumpySink()
        self.allocations: list[int] = []
        self.per_tensor: list[bool] = []

    def ring_ops(self) -> EmulatedRingOps:
        return self.ops

    def allocate_device(self, specs, per_tensor: bool = True):
        self.allocations.append(len(specs))
        self.per_tensor.append(per_tensor)
        total = sum(n for _, _, _, n in specs)
        block = np.empty(max(total, 1), np.uint8)
        tensors, targets, off = {}, {}, 0
        for row, code, shape, nbytes in specs:
            targets[row] = block[off : off + nbytes]
            tensors[row] = self.host.view(block, code, shape, off, nbytes)
            off += nbytes
        return tensors, targets, self.ops

    def to_device(self, arr):
        return arr
