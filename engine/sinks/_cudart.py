"""The few CUDA runtime calls the engine makes itself: page-locking host memory it did not
allocate (``cudaHostRegister`` / ``cudaHostUnregister``).

Nothing here is linked at build time (CI and most hosts have no CUDA).  The runtime is
found at run time, in this order:

1. the ``libcudart`` that torch or CuPy has already loaded into the process (read from
   ``/proc/self/maps``), called through :mod:`ctypes`, which releases the GIL for the call,
   so a thread page-locking a range does not stall the threads that copy;
2. ``torch.cuda.cudart()``, the runtime bindings torch ships;
3. ``cupy.cuda.runtime``.

Registering the same CUDA context's memory through any of them is the same driver call, so
copies that torch or CuPy issue see the pages as page-locked.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

__all__ = [
    "HOST_REGISTER_DEFAULT",
    "HOST_REGISTER_PORTABLE",
    "PinnedBlock",
    "Runtime",
    "address_of",
    "runtime",
    "runtime_path",
]

#: ``cudaHostRegisterPortable``: the pages count as page-locked in every CUDA context, so
#: copies issued through another runtime instance (or to another device) are DMA too.
HOST_REGISTER_PORTABLE = 0x01
#: Staging slots: memory the process writes and the device reads.
HOST_REGISTER_DEFAULT = HOST_REGISTER_PORTABLE


class Runtime:
    """``host_register`` / ``host_unregister`` over one of the bindings; 0 means success,
    anything else is the CUDA error code (the error is also cleared, so it cannot surface
    later in an unrelated torch or CuPy call)."""

    def __init__(self, register, unregister, clear, name: str) -> None:
        self._register = register
        self._unregister = unregister
        self._clear = clear
        self.name = name

    def host_register(self, addr: int, nbytes: int, flags: int) -> int:
        try:
            err = int(self._register(addr, nbytes, flags))
        except Exception:  # CuPy raises where the others return a code
            err = -1
        if err:
            self._clear()
        return err

    def host_unregister(self, addr: int) -> int:
        try:
            err = int(self._unregister(addr))
        except Exception:
            err = -1
        if err:
            self._clear()
        return err


def _loaded_cudart_path() -> str | None:
    from engine.gpu.device_ring import _loaded_cudart_path as loaded

    return loaded()


def _ctypes_runtime(path: str) -> Runtime:
    lib = ctypes.CDLL(path)  # already mapped: the same library instance torch/CuPy use
    reg = lib.cudaHostRegister
    reg.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    reg.restype = ctypes.c_int
    unreg = lib.cudaHostUnregister
    unreg.argtypes = [ctypes.c_void_p]
    unreg.restype = ctypes.c_int
    last = lib.cudaGetLastError
    last.restype = ctypes.c_int
    return Runtime(reg, unreg, last, f"ctypes:{os.path.basename(path)}")


def runtime_path() -> str | None:
    """The ``libcudart`` the engine's chunk ring opens (:func:`engine.gpu.device_ring.cuda_runtime_path`)."""
    from engine.gpu.device_ring import cuda_runtime_path

    return cuda_runtime_path()


@functools.cache
def runtime() -> Runtime | None:
    """The process's CUDA runtime, or ``None`` when none can be reached (then every
    registration is refused and loads use the copy path alone)."""
    path = _loaded_cudart_path()
    if path is not None:
        try:
            return _ctypes_runtime(path)
        except (OSError, AttributeError):
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            rt = torch.cuda.cudart()
            clear = getattr(rt, "cudaGetLastError", lambda: 0)
            return Runtime(rt.cudaHostRegister, rt.cudaHostUnregister, clear, "torch.cuda.cudart")
        except Exception:
            pass
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        rt = cupy.cuda.runtime
        clear = getattr(rt, "getLastError", lambda: 0)
        return Runtime(lambda a, n, f: rt.hostRegister(a, n, f) or 0, lambda a: rt.hostUnregister(a) or 0,
                       clear, "cupy.cuda.runtime")
    return None


def address_of(view: memoryview) -> int:
    """Address of the first byte of a (possibly read-only) contiguous buffer."""
    import numpy as np

    return int(np.frombuffer(view, np.uint8).ctypes.data) if len(view) else 0


class PinnedBlock:
    """Anonymous host memory page-locked by the engine for one load, unlocked by
    :meth:`release`.

    Not ``cudaHostAlloc`` through torch or CuPy: their caching allocators keep freed pinned
    blocks locked for the rest of the process, and a load must leave nothing page-locked.
    ``locked`` is false when the runtime refused (the memory still works as a copy source,
    at pageable speed).
    """

    def __init__(self, nbytes: int) -> None:
        import mmap

        # not populated first: page-locking faults the pages in itself, in one pass
        self.block = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self.block)[:nbytes]
        self.addr = address_of(memoryview(self.block))
        rt = runtime()
        flags = HOST_REGISTER_DEFAULT
        self.locked = rt is not None and rt.host_register(self.addr, max(1, nbytes), flags) == 0

    def release(self) -> None:
        if self.locked:
            rt = runtime()
            if rt is not None:
                rt.host_unregister(self.addr)
            self.locked = False
