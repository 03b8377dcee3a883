"""Array plumbing shared by the CPU kernels' callers (:mod:`engine.numerics.statistics`,
:mod:`engine.numerics.quantize`) and the device kernels (:mod:`engine.numerics.cuda_kernels`).

The one table of float bit layouts (:data:`FLOAT_FORMATS`) that every kernel's constants come
from, the default tunables, zero-copy adapters from numpy/torch inputs, the cutting of
non-contiguous inputs into contiguous pieces, and the pool switch of the parallel kernels.
Imports neither Numba nor torch at module level.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ml_dtypes
import numpy as np

from engine.base import dtypes as _dt
from engine.errors import DeviceError, SerializationError

try:  # numpy >= 2
    from numpy.lib.array_utils import normalize_axis_index
except ImportError:  # pragma: no cover - numpy 1.26
    from numpy.core.multiarray import normalize_axis_index  # type: ignore[no-redef]  # noqa: F401

#: Default tunables (arguments of the public functions, not read by the kernels).
BLOCK = 1 << 16  # elements per parallel task
TILE = 1 << 12  # elements per L1-resident tile (16 KiB of float32)
CHUNK = 1 << 22  # elements per contiguous copy of a non-contiguous input

#: ``fmt`` codes of the two 16-bit float formats read as ``uint16`` (and ``FLOAT``: the
#: values are float32/float64 themselves), shared by the CPU and the device kernels.
F16 = 0
BF16 = 1
FLOAT = -1



def from_torch(t) -> np.ndarray:
    import torch  # only reached for a torch tensor: the caller already imported torch

    if t.device.type != "cpu":
        raise DeviceError(f"expected a CPU tensor, got one on {t.device}; call .cpu() first")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        # numpy has no bfloat16 of its own: reinterpret the same memory (zero-copy)
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()  # zero-copy; TypeError for dtypes numpy lacks (FP8, ...)


def as_numpy(x: Any) -> tuple[np.ndarray, bool]:
    """Zero-copy numpy view of ``x`` and whether ``x`` was a torch tensor."""
    if isinstance(x, np.ndarray):
        return x, False
    mod = type(x).__module__
    if mod == "torch" or mod.startswith("torch."):
        return from_torch(x), True
    return np.asarray(x), False


def kind_of(dtype: np.dtype, supported: tuple[str, ...], what: str) -> str:
    """Safetensors name of a numpy dtype, checked against ``supported``."""
    try:
        name = _dt.NAMES[_dt.from_numpy(dtype)]
    except SerializationError:
        name = None
    if name not in supported:
        raise TypeError(f"{what} supports {', '.join(supported)} data, not {dtype}")
    return name


def native(dtype: np.dtype) -> np.dtype:
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def pieces(x: np.ndarray, chunk: int, any_order: bool) -> Iterator[tuple[tuple, np.ndarray]]:
    """Cut ``x`` into C-contiguous, native-byte-order pieces of about ``chunk`` elements.

    Yields ``(key, piece)`` with ``piece`` equal to ``x[key]`` (``key`` is a tuple of
    integers, possibly ending in one slice).  A C-contiguous input is one piece with key
    ``()`` (no copy).  With ``any_order`` an F-contiguous input is also one piece, its
    memory-order ravel (``key`` then means nothing; fine for order-free reductions).
    Otherwise pieces are copies: slabs of whole rows along the first axis, descending into
    a row only when one row alone exceeds ``chunk``.
    """
    if x.dtype.isnative and (x.flags.c_contiguous or (any_order and x.flags.f_contiguous)):
        yield (), (x if x.flags.c_contiguous else x.ravel(order="K"))
        return
    if x.ndim == 0:
        yield (), np.ascontiguousarray(x, dtype=native(x.dtype))
        return
    yield from slabs(x, (), chunk)


def slabs(x: np.ndarray, key: tuple, chunk: int) -> Iterator[tuple[tuple, np.ndarray]]:
    n0 = x.shape[0]
    row = math.prod(x.shape[1:])
    if row > chunk and x.ndim > 1:
        for i in range(n0):
            sub = x[i]
            if sub.dtype.isnative and sub.flags.c_contiguous:
                yield key + (i,), sub
            else:
                yield from slabs(sub, key + (i,), chunk)
        return
    step = max(1, chunk // max(row, 1))
    for i in range(0, n0, step):
        j = min(i + step, n0)
        yield key + (slice(i, j),), np.ascontiguousarray(x[i:j], dtype=native(x.dtype))


def readonly(a: np.ndarray) -> np.ndarray:
    """Read-only view: kernels then compile once per dtype and provably never write."""
    v = a.view()
    v.flags.writeable = False
    return v


PARALLEL_LOCK = threading.Lock()


@contextmanager
def pool(threads: int | None, n: int, block: int):
    """Decide whether a kernel uses Numba's thread pool, and size it.

    Yields the kernel's ``parallel`` flag.  Parallel launches are serialized by a lock:
    Numba's fallback ``workqueue`` threading layer aborts the process on concurrent
    launches, and on a shared machine two pools would only fight over the cores.  Callers
    that run kernels from their own worker threads pass ``threads=1``: serial kernels take
    no lock and release the GIL.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if threads == 1 or n <= block:
        yield False
        return
    import numba

    with PARALLEL_LOCK:
        old = numba.get_num_threads()
        want = old if threads is None else min(threads, numba.config.NUMBA_NUM_THREADS)
        if want <= 1:
            yield False
            return
        numba.set_num_threads(want)
        try:
            yield True
        finally:
            numba.set_num_threads(old)


def check_tunables(block: int, tile: int, chunk: int) -> None:
    for name, v in (("block", block), ("tile", tile), ("chunk", chunk)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


# --------------------------------------------------------------------------- float keys


#: Bit layout of each float format: (signed view, unsigned view, +Inf bit pattern, float type).
#: The one source of every kernel's constants, on the CPU and on the device.
FLOAT_FORMATS = {
    "F32": (np.int32, np.uint32, 0x7F800000, np.float32),
    "F64": (np.int64, np.uint64, 0x7FF0000000000000, np.float64),
    "F16": (np.int16, np.uint16, 0x7C00, np.float16),
    "BF16": (np.int16, np.uint16, 0x7F80, ml_dtypes.bfloat16),
}


def float_consts(kind: str):
    """Integer views and typed constants for the float kernels (see engine.numerics.kernels)."""
    it, ut, lim, _ = FLOAT_FORMATS[kind]
    info = np.iinfo(it)  # type: ignore[type-var]  # it is an integer type
    sign = 1 << (info.bits - 1)
    sc = np.array([lim, info.min, info.max], dtype=it)
    uc = np.array([sign - 1, lim, sign | lim, 0], dtype=ut)
    return it, ut, sc, uc


def pool_threads(threads: int | None) -> int:
    """Threads a parallel kernel will use: ``threads``, or all of Numba's pool."""
    import numba

    return numba.get_num_threads() if threads is None else threads
