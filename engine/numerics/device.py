"""Statistics and int8 quantization of arrays in device memory, with the CUDA kernels.

``device_stats(x)`` and ``quantize_int8_device(x, axis)`` take a CUDA array (a torch CUDA
tensor, a CuPy array or a Numba device array) and give the results of :func:`engine.stats`
and :func:`engine.quantize_int8` on the same values: counts, min, max, absmax and every
int8 value and scale exactly equal; mean and std within the tolerance stated in
:func:`device_stats`.  :class:`DeviceAccumulator` folds a tensor that arrives in pieces
(a load's host-to-device copies), on the copies' stream.

Importing this module imports ``numba.cuda`` (:mod:`engine.numerics.cuda_kernels`).  Under Numba's
CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set before Numba is imported) the same code
runs on numpy arrays standing for device memory; the test suite runs it that way.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import numpy as np
from numba import config as _numba_config
from numba import cuda

from engine.errors import DeviceError
from engine.numerics import cuda_kernels as _ck
from engine.numerics._arrays import BF16, F16, FLOAT, FLOAT_FORMATS, float_consts, normalize_axis_index
from engine.numerics.quantize import INPUTS, QuantizedTensor, raise_if_nonfinite
from engine.numerics.statistics import Stats, stats_from_partials

__all__ = [
    "AccumulatorBlock",
    "DeviceAccumulator",
    "DeviceQuantizer",
    "LaunchConfig",
    "MAX_BLOCK_THREADS",
    "MAX_GRID",
    "absmax_grid",
    "check_launch",
    "device_stats",
    "default_empty",
    "empty_like_framework",
    "on_gpu",
    "probe",
    "quantize_int8_device",
    "synchronize",
    "to_host",
    "SUPPORTED_NAMES",
]

#: Format dtypes the device statistics summarise.
SUPPORTED_NAMES = frozenset(("F64", "F32", "F16", "BF16"))

#: Mantissa bits and exponent bias of the formats quantization reads (for the scales).
_MANTISSA = {"F32": (23, 127), "F16": (10, 15), "BF16": (7, 127)}

SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)

#: A CUDA grid's size limits (blocks along x, y, z; every device of compute capability 3.0
#: and later) and the most threads in a block: a launch beyond them fails on a GPU, and
#: :func:`_launch` refuses it everywhere, the simulator included.
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK_THREADS = 1024


class LaunchConfig:
    """Launch sizes of the device kernels (tunables, never module globals).

    Parameters
    ----------
    threads : int, default 256
        Threads per block: a power of two, at most :data:`engine.numerics.cuda_kernels.MAX_THREADS`.
    blocks : int, default 264
        Blocks of a statistics launch, which is also the number of accumulator rows a
        tensor keeps on the device (two per SM of an H100); and the most blocks a
        quantization launch uses per pass.
    """

    __slots__ = ("threads", "blocks")

    def __init__(self, threads: int = 256, blocks: int = 264) -> None:
        if not (1 <= threads <= _ck.MAX_THREADS and threads & (threads - 1) == 0):
            raise ValueError(f"threads must be a power of two from 1 to {_ck.MAX_THREADS}, got {threads!r}")
        if int(blocks) != blocks or not 1 <= blocks <= MAX_GRID[1]:
            # the statistics keep a row per block; the quantization's 2-D grids take up to
            # ``blocks`` along y
            raise ValueError(f"blocks must be an integer from 1 to {MAX_GRID[1]}, got {blocks!r}")
        self.threads = int(threads)
        self.blocks = int(blocks)


DEFAULT_LAUNCH = LaunchConfig()


# --------------------------------------------------------------------------- framework adapters


def _framework(x: Any) -> str:
    mod = type(x).__module__
    if mod == "torch" or mod.startswith("torch."):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    if isinstance(x, np.ndarray):
        return "numpy"
    return "numba"


def as_device_array(x: Any):
    """A Numba device array over the memory of ``x`` (no copy, no synchronisation).

    torch CUDA tensors and CuPy arrays go through ``__cuda_array_interface__``; Numba device
    arrays pass through.  A numpy array is accepted only under the simulator, where it
    stands for device memory.
    """
    kind = _framework(x)
    if kind == "numpy":
        if not SIMULATOR:
            raise DeviceError("expected a CUDA array (torch CUDA tensor, CuPy or Numba device array), got numpy")
        return x
    if kind == "torch":
        import torch

        if x.device.type != "cuda":
            raise DeviceError(f"expected a CUDA tensor, got one on {x.device}")
        if x.dtype == torch.bfloat16:  # no array-interface type for bfloat16: its bits as int16
            x = x.view(torch.int16)
    if _is_numba_array(x):
        return x
    if not cuda.is_cuda_array(x):
        raise DeviceError(f"expected a CUDA array, got {type(x).__name__}")
    # sync=False: the caller orders the work with streams; importing must not wait on them
    return cuda.as_cuda_array(x, sync=False)


def _is_numba_array(x) -> bool:
    if SIMULATOR:
        return cuda.is_cuda_array(x) and not isinstance(x, np.ndarray)
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return isinstance(x, DeviceNDArray)


def numba_stream(stream: Any):
    """The Numba stream for a framework's stream (torch, CuPy, Numba) or None (default)."""
    if stream is None or SIMULATOR:
        return 0  # the simulator runs each launch to completion: one stream is as good as any
    handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream
    if handle is None:
        handle = getattr(stream, "ptr", None)  # cupy.cuda.Stream
    if handle is None:
        return stream  # a Numba stream already
    s = _EXTERNAL.get(handle)
    if s is None:  # a load's reader threads keep their streams: wrap each once
        s = _EXTERNAL[handle] = cuda.external_stream(handle)
    return s


_EXTERNAL: dict[int, Any] = {}


def on_gpu(index: int | None):
    """Context that makes GPU ``index`` current for Numba in this thread (a reader thread
    starts on GPU 0); nothing under the simulator or for ``None``."""
    from contextlib import nullcontext

    if SIMULATOR or index is None:
        return nullcontext()
    return cuda.gpus[index]


#: The simulator runs one kernel at a time (it asserts so); loads launch from several
#: reader threads, so simulated launches take turns.  Real launches need no lock.
_SIM_LOCK = threading.Lock()


def check_launch(grid, threads) -> None:
    """Raise :class:`~engine.errors.DeviceError` where a GPU would refuse the launch sizes
    ``grid`` (an int or a tuple of up to 3) and ``threads`` (per block)."""
    if type(grid) is int and 1 <= grid <= MAX_GRID[0] and type(threads) is int and 1 <= threads <= MAX_BLOCK_THREADS:
        return  # the common case, asked per launch: one comparison each
    dims = tuple(grid) if isinstance(grid, tuple) else (grid,)
    if not (1 <= len(dims) <= 3 and all(1 <= int(g) <= m for g, m in zip(dims, MAX_GRID, strict=False))):
        raise DeviceError(f"grid {dims} is outside the device's limits {MAX_GRID[:len(dims)]}")
    if not 1 <= int(threads) <= MAX_BLOCK_THREADS:
        raise DeviceError(f"{threads} threads per block; a GPU runs 1 to {MAX_BLOCK_THREADS}")


def _launch(kernel, config: tuple, *args) -> None:
    """``kernel[config](*args)``: an asynchronous launch on the stream named in ``config``,
    after :func:`check_launch`."""
    check_launch(config[0], config[1])
    if SIMULATOR:
        with _SIM_LOCK:
            kernel[config](*args)
    else:
        kernel[config](*args)


def _sync(stream) -> None:
    if stream == 0:
        cuda.synchronize()
    else:
        stream.synchronize()


def _views(buf, kind: str):
    """(values, signed, unsigned) views of a 1-D byte device array of format ``kind``:
    values are float32/float64, or the ``uint16`` patterns again for F16/BF16."""
    it, ut, _, ft = FLOAT_FORMATS[kind]
    ku = buf.view(np.dtype(ut))
    ki = buf.view(np.dtype(it))
    f = ku if kind in ("F16", "BF16") else buf.view(np.dtype(ft))
    return f, ki, ku


def _fmt(kind: str) -> int:
    return F16 if kind == "F16" else BF16 if kind == "BF16" else FLOAT


def _as_bytes(x):
    """The 1-D ``uint8`` view of a C-contiguous device array (no copy)."""
    d = as_device_array(x)
    if not _contiguous(d):
        raise DeviceError("device kernels need a C-contiguous array")
    return d.reshape(d.size).view(np.uint8) if d.size else None


def _contiguous(d) -> bool:
    if isinstance(d, np.ndarray):
        return d.flags.c_contiguous
    return d.is_c_contiguous()


def _flat(d):
    return d if len(d.shape) == 1 else d.reshape(d.size)


def default_empty(shape: tuple, dtype) -> Any:
    """Device memory from Numba's own allocator (numpy arrays under the simulator).  Loads
    pass their framework's allocator instead (torch's caching allocator, CuPy's pool), which
    neither calls cudaMalloc per array nor synchronises to free it."""
    return np.empty(shape, dtype) if SIMULATOR else cuda.device_array(shape, dtype)


def _zeros(empty, shape, dtype, stream):
    """A zeroed device array from ``empty`` (the fill is a launch on ``stream``)."""
    a = as_device_array(empty(shape, dtype))
    zero(_flat(a), stream)
    return a


def zero(a, stream: Any = None) -> None:
    """``a[:] = 0`` for a 1-D Numba device array (one launch on ``stream``)."""
    if a.size:
        _launch(_ck.fill_zero, (-(-a.size // 128), 128, numba_stream(stream)), a)


def probe(index: int | None = None) -> None:
    """Compile and run one small kernel now, on GPU ``index`` (None: the current device).

    Raises whatever keeps Numba's CUDA target from working in this process (no NVVM or
    libdevice, a driver Numba does not know, no device): the loaders ask once, before any
    byte of a load is read, and take their CPU paths where it raises.  On the load's own
    device: a thread with no current device would otherwise make a context on GPU 0.
    """
    with on_gpu(index):
        a = default_empty((1,), np.uint8)
        _launch(_ck.fill_zero, (1, 1, 0), a)
        _sync(0)


def _to_host(d, stream):
    return d if SIMULATOR else d.copy_to_host(stream=stream)


def to_host(d, stream: Any = None):
    """A small device array's copy on the host, queued on ``stream`` (valid once it is
    waited for: :func:`synchronize`); the array itself under the simulator."""
    return _to_host(d, numba_stream(stream))


def synchronize(stream: Any = None) -> None:
    """Wait for the work queued on ``stream`` (nothing to wait for under the simulator)."""
    if not SIMULATOR:
        _sync(numba_stream(stream))


# --------------------------------------------------------------------------- statistics


class DeviceAccumulator:
    """Statistics of one float tensor fed piece by piece in device memory.

    Parameters
    ----------
    kind : {"F64", "F32", "F16", "BF16"}
    launch : LaunchConfig, optional
    stream : torch/CuPy/Numba stream, optional
        Where the accumulator rows are set up (default: the default stream).
    empty : callable, optional
        ``empty(shape, numpy dtype)`` making device arrays: a framework's allocator (loads
        pass torch's or CuPy's); default :func:`default_empty`.

    Notes
    -----
    Keeps ``launch.blocks`` partial-result rows on the device (80 bytes each).  Every
    :meth:`add` is one kernel launch on the given stream, reading the piece where it lies:
    no copy.  Calls that share an accumulator must be ordered (the same stream, or streams
    ordered by events); give each stream its own accumulator and merge the results, as the
    loads do.  :meth:`result` copies the rows to the host (a few KiB) and merges them with
    the CPU kernels' code.
    """

    def __init__(self, kind: str, launch: LaunchConfig = DEFAULT_LAUNCH, stream: Any = None,
                 empty: Any = None, *, rows: tuple | None = None, ready: bool = False) -> None:
        if kind not in SUPPORTED_NAMES:
            raise TypeError(f"device statistics support {', '.join(sorted(SUPPORTED_NAMES))} data, not {kind}")
        self.kind = kind
        self.launch = launch
        self._sc, self._uc = _stats_consts(kind)  # kernel arguments by value: no device copy
        s = numba_stream(stream)
        g = launch.blocks
        if rows is None:
            empty = empty or default_empty
            self._keep = [empty((g, 5), np.int64), empty((g, 2), np.float64), empty((g, 2), np.int64),
                          empty((g,), np.int64)]  # the framework's arrays own the memory
            rows = tuple(as_device_array(a) for a in self._keep)
        self.cnt, self.mom, self.skey, ukey = rows
        self.ukey = ukey.view(np.uint64)
        if not ready:  # else ``rows`` are set up already (an AccumulatorBlock's, all at once)
            _launch(_ck.init_stats, (-(-g // 128), 128, s), self._sc, self._uc, self.cnt, self.mom, self.skey,
                    self.ukey)
        self._fmt = _fmt(kind)

    def add(self, buf, stream: Any = None) -> None:
        """Fold the bytes ``buf`` (a 1-D ``uint8`` device array of whole elements, or any
        C-contiguous device array of the tensor's dtype) on ``stream``."""
        d = as_device_array(buf)
        if d.dtype != np.uint8:
            d = _as_bytes(d)
            if d is None:
                return
        if d.size == 0:
            return
        f, ki, ku = _views(d, self.kind)
        lc = self.launch
        _launch(_ck.stats_fold, (lc.blocks, lc.threads, numba_stream(stream)),
            self._fmt, f, ki, ku, self._sc, self._uc, self.cnt, self.mom, self.skey, self.ukey
        )

    def result(self, stream: Any = None) -> Stats:
        """Statistics of everything added (waits for the work queued on ``stream``)."""
        s = numba_stream(stream)
        rows = self.queue_rows(stream)
        if not SIMULATOR:
            _sync(s)
        return self.merge_rows(rows)

    def queue_rows(self, stream: Any = None) -> list:
        """The partial-result rows' copies to the host, queued on ``stream`` (usable once it
        is waited for: :meth:`merge_rows`).  Several accumulators' rows queued, then one
        wait, gather a batch of tensors' statistics."""
        s = numba_stream(stream)
        return [_to_host(a, s) for a in (self.cnt, self.mom, self.skey, self.ukey)]

    def merge_rows(self, rows: list) -> Stats:
        return stats_from_partials(self.kind, *rows)


@functools.cache
def _stats_consts(kind: str) -> tuple[tuple, tuple]:
    """The statistics kernels' constants of ``kind`` as tuples (asked once per tensor)."""
    _, _, sc, uc = float_consts(kind)
    return tuple(sc), tuple(uc)


class AccumulatorBlock:
    """The partial-result rows of up to ``count`` accumulators of format ``kind`` in four
    device allocations, set up by one launch and brought to the host with four copies for
    any number of them: a load's statistics of many tensors allocate, launch and copy per
    block, not per tensor.

    Parameters
    ----------
    count : int
        Accumulators the block holds.
    kind : {"F64", "F32", "F16", "BF16"}
    launch : LaunchConfig, optional
    empty : callable, optional
        As for :class:`DeviceAccumulator`.
    stream : optional
        Where the rows are set up.
    """

    def __init__(self, count: int, kind: str, launch: LaunchConfig = DEFAULT_LAUNCH, empty: Any = None,
                 stream: Any = None) -> None:
        if kind not in SUPPORTED_NAMES:
            raise TypeError(f"device statistics support {', '.join(sorted(SUPPORTED_NAMES))} data, not {kind}")
        g = launch.blocks
        empty = empty or default_empty
        self.count, self.used, self.kind, self.launch, self._g = count, 0, kind, launch, g
        self._keep = [empty((count * g, 5), np.int64), empty((count * g, 2), np.float64),
                      empty((count * g, 2), np.int64), empty((count * g,), np.int64)]
        self._arrays = [as_device_array(a) for a in self._keep]
        self._arrays[3] = self._arrays[3].view(np.uint64)  # the unsigned keys, compared as such on the host too
        sc, uc = _stats_consts(kind)
        _launch(_ck.init_stats, (-(-count * g // 128), 128, numba_stream(stream)), sc, uc, *self._arrays)

    def full(self) -> bool:
        return self.used == self.count

    def take(self) -> tuple[DeviceAccumulator, int]:
        """The next free accumulator and its index."""
        if self.full():
            raise ValueError("the block's accumulators are all taken")
        i, g = self.used, self._g
        self.used += 1
        acc = DeviceAccumulator(self.kind, self.launch, rows=tuple(a[i * g : (i + 1) * g] for a in self._arrays),
                                ready=True)
        return acc, i

    def queue_rows(self, lo: int, hi: int, stream: Any = None) -> list:
        """The rows of accumulators ``lo`` to ``hi - 1``, their copies to the host queued
        on ``stream`` (usable once it is waited for: :meth:`merge_rows`)."""
        s, g = numba_stream(stream), self._g
        return [_to_host(a[lo * g : hi * g], s) for a in self._arrays]

    def merge_rows(self, index: int, lo: int, rows: list) -> Stats:
        """Statistics of accumulator ``index`` from :meth:`queue_rows` ``(lo, ...)``."""
        g = self._g
        at = (index - lo) * g
        return stats_from_partials(self.kind, *(r[at : at + g] for r in rows))


def device_stats(x: Any, *, launch: LaunchConfig = DEFAULT_LAUNCH, stream: Any = None) -> Stats:
    """:func:`engine.stats` of a CUDA array, computed on the device.

    Parameters
    ----------
    x : torch CUDA tensor, CuPy array or Numba device array
        F64, F32, F16 or BF16 (torch ``bfloat16``; for CuPy, which has no bfloat16, use
        :class:`DeviceAccumulator` with ``kind="BF16"`` on the ``uint16`` array), C-contiguous.
    launch : LaunchConfig, optional
    stream : optional
        The stream to run on (torch, CuPy or Numba); default: the default stream.

    Returns
    -------
    Stats
        Counts, min, max and absmax equal to :func:`engine.stats`'s; mean and std within a
        relative ``1e-9`` of it (both sum in float64, in different orders: each GPU thread
        sums around the first finite value it sees and the partial sums merge pairwise).

    Raises
    ------
    TypeError
        Another dtype.
    DeviceError
        Not a C-contiguous CUDA array.

    Notes
    -----
    One kernel launch reading ``x`` once, plus the merge of ``launch.blocks`` partial rows
    on the host.  Copies of tensor bytes: 0.
    """
    kind = _kind_of_device(x)
    acc = DeviceAccumulator(kind, launch, stream)
    acc.add(x, stream)
    return acc.result(stream)


def _kind_of_device(x) -> str:
    from engine.base import dtypes as _dt

    if _framework(x) == "torch":
        code = _dt.from_torch(x.dtype)
    else:
        code = _dt.from_numpy(np.dtype(x.dtype))
    return _dt.NAMES[code]


# --------------------------------------------------------------------------- quantization


class DeviceQuantizer:
    """int8 quantization of whole tensors in device memory, bit-identical to
    :func:`engine.quantize_int8`.

    Parameters
    ----------
    launch : LaunchConfig, optional
    empty : callable, optional
        Allocator of the scratch arrays (keys, counts), as for :class:`DeviceAccumulator`.

    Notes
    -----
    Two passes over the tensor, each one launch: the per-channel maxima of the magnitudes
    (on the bit patterns, with atomic max per block or per thread), then the int8 values;
    a third, tiny launch turns the maxima into scales.  Device memory: the int8 output, the
    float32 scales, and ``4 * C`` bytes of keys.
    """

    def __init__(self, launch: LaunchConfig = DEFAULT_LAUNCH, empty: Any = None) -> None:
        self.launch = launch
        self.empty = empty or default_empty

    def quantize(self, src, kind: str, shape: tuple, axis: int | None, q, scale, stream: Any = None):
        """Quantize ``src`` (C-contiguous device array of format ``kind``, any view dtype,
        or its bytes) of ``shape`` along ``axis`` (None: per tensor, else normalized) into
        the device arrays ``q`` (int8, ``prod(shape)`` elements) and ``scale`` (float32,
        ``C`` elements); returns the (NaN, +Inf, -Inf) counts as an int64 numpy array
        (waits for the work on ``stream``)."""
        s = numba_stream(stream)
        out = _to_host(self.launch_quantize(src, kind, shape, axis, q, scale, stream), s)
        if not SIMULATOR:
            _sync(s)
        return np.asarray(out, np.int64).copy()

    def launch_quantize(self, src, kind: str, shape: tuple, axis: int | None, q, scale, stream: Any = None, *,
                        counts=None, keys=None):
        """:meth:`quantize` without waiting: the kernels are queued on ``stream`` and the
        (NaN, +Inf, -Inf) counts come back as a device array of 3 int64 (bring it over with
        :func:`to_host` once the stream is waited for; ``src`` must live until then).

        ``counts`` (3 int64) and ``keys`` (``max(C, 1)`` uint32), Numba device arrays already
        zeroed on ``stream``, spare the two allocations and zeroing launches of each call (a
        load zeroes one block for a window's tensors)."""
        if kind not in INPUTS:
            raise TypeError(f"quantize_int8 supports {', '.join(INPUTS)} data, not {kind}")
        s = numba_stream(stream)
        n = math.prod(shape)
        outer, C, inner = (1, 1, n) if axis is None else (
            math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :]))
        if (counts is None) != (keys is None):
            raise ValueError("counts and keys come together")
        if counts is None:
            bad = _zeros(self.empty, (3,), np.int64, s)
            keys = _zeros(self.empty, (max(C, 1),), np.int32, s).view(np.uint32)
        else:
            bad = counts
            if len(bad) != 3 or len(keys) != max(C, 1):
                raise ValueError(f"counts of 3 and keys of {max(C, 1)} elements, not {len(bad)} and {len(keys)}")
        lc = self.launch
        nt = lc.threads
        _, ut, lim, _ = FLOAT_FORMATS[kind]
        absmask = ut((1 << (8 * np.dtype(ut).itemsize - 1)) - 1)
        lim = ut(lim)  # type: ignore[assignment]  # the limit as the kernels' unsigned type
        if n:
            d = as_device_array(src)
            d = d.reshape(d.size).view(np.uint8) if d.dtype != np.uint8 else d
            f, _, ku = _views(d, kind)
            kernel, grid, step = absmax_grid(outer, C, inner, lc)
            if kernel == "runs":  # long runs: blocks stride each run, one atomic max per block
                _launch(_ck.absmax_runs, (grid, nt, s), ku, absmask, lim, C, inner, step, keys, bad)
            else:  # short runs: a thread per element of an outer row, down a slab of rows
                _launch(_ck.absmax_columns, (grid, nt, s), ku, absmask, lim, outer, C, inner, step, keys, bad)
        mbits, bias = _MANTISSA[kind]
        sd = _flat(as_device_array(scale))
        if C:
            _launch(_ck.scales_from_keys, (-(-C // nt), nt, s), keys[:C], mbits, bias, sd)
        if n:
            blocks = max(1, min(lc.blocks * 4, -(-n // nt)))  # grid-stride: within MAX_GRID[0]
            _launch(_ck.quantize_elements, (blocks, nt, s), _fmt(kind), f, ku, absmask, lim, C, inner, sd, _flat(as_device_array(q)))
        return bad


def absmax_grid(outer: int, C: int, inner: int, launch: LaunchConfig) -> tuple[str, Any, int]:
    """``(kernel, grid, step)`` of the channel-maxima pass over (outer, C, inner) elements:
    ``("runs", blocks, per_run)`` for :func:`~engine.numerics.cuda_kernels.absmax_runs`, or
    ``("columns", (bx, by), rows_per_block)`` for
    :func:`~engine.numerics.cuda_kernels.absmax_columns`; within :data:`MAX_GRID` wherever
    one of the two fits (``outer * C`` or ``C * inner / threads`` below ``2**31``)."""
    nt = launch.threads
    if (inner >= nt or C == 1) and outer * C <= MAX_GRID[0]:  # else more runs than a grid has blocks
        runs = outer * C
        per_run = max(1, min(-(-inner // nt), launch.blocks // runs))
        return "runs", runs * per_run, per_run
    width = C * inner
    bx = -(-width // nt)
    rows = max(1, -(-outer // max(1, launch.blocks // bx)))
    rows = max(rows, -(-outer // MAX_GRID[1]))  # y stays within the grid's limit
    return "columns", (bx, -(-outer // rows)), rows


def quantize_int8_device(
    x: Any, axis: int | None = None, *, on_nonfinite: str = "raise", name: str | None = None,
    launch: LaunchConfig = DEFAULT_LAUNCH, stream: Any = None,
):
    """:func:`engine.quantize_int8` of a CUDA array, on the device.

    Parameters
    ----------
    x : torch CUDA tensor, CuPy array or Numba device array
        F32, F16 or BF16, C-contiguous.
    axis : int, optional
        As for :func:`engine.quantize_int8`.
    on_nonfinite : {"raise", "clamp"}
        As for :func:`engine.quantize_int8` (``"clamp"`` issues no warning here).
    name : str, optional
        Tensor name for the error.
    launch, stream : optional
        Launch sizes; the stream to run on.

    Returns
    -------
    QuantizedTensor
        ``q`` and ``scale`` in the framework and on the device of ``x``, bit-identical to
        ``engine.quantize_int8`` of the same values.

    Raises
    ------
    NonFiniteError
        NaN or Inf in ``x`` with ``on_nonfinite="raise"`` (after the work is done).
    """
    kind = _kind_of_device(x)
    shape = tuple(x.shape)
    if axis is not None:
        axis = normalize_axis_index(axis, len(shape))
    C = 1 if axis is None else shape[axis]
    q = empty_like_framework(x, shape, np.int8)
    scale = empty_like_framework(x, (C,), np.float32)
    bad = DeviceQuantizer(launch).quantize(x, kind, shape, axis, q, scale, stream)
    if on_nonfinite == "raise":
        raise_if_nonfinite(bad, name)
    return QuantizedTensor(q, scale.reshape(()) if axis is None else scale, axis, kind)


def empty_like_framework(like: Any, shape: tuple, dtype) -> Any:
    """An empty array of ``shape`` and numpy ``dtype`` in the framework and on the device
    of ``like``."""
    dtype = np.dtype(dtype)
    kind = _framework(like)
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype.name), device=like.device)
    if kind == "cupy":
        import cupy

        with like.device:
            return cupy.empty(shape, dtype)
    if kind == "numpy":
        return np.empty(shape, dtype)
    return cuda.device_array(shape, dtype)

