"""Fused one-pass statistics of a tensor: ``engine.stats(x)`` -> :class:`Stats`.

(The module is named ``statistics``, not ``stats``, so that ``engine.stats`` stays the function;
its public path is :mod:`engine.statistics`.)

Importing this module imports Numba (the kernels live in :mod:`engine.numerics.kernels`); torch is
imported only when a torch tensor is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.base import dtypes as _dt
from engine.numerics import kernels as _k
from engine.numerics._arrays import (
    BLOCK,
    CHUNK,
    FLOAT_FORMATS,
    TILE,
    as_numpy,
    check_tunables,
    float_consts,
    kind_of,
    pieces,
    pool,
    readonly,
)

__all__ = ["Accumulator", "Stats", "stats", "stats_from_partials"]

_FLOAT = ("F32", "F64")
_HALF = ("F16", "BF16")
_INT = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")

Number = int | float  # min/max/absmax: exact ints for integer tensors


@dataclass(frozen=True)
class Stats:
    """Statistics of a tensor, as returned by :func:`engine.stats`.

    Attributes
    ----------
    count : int
        Number of elements, including NaN and infinities.
    min, max : float or int
        Smallest and largest *finite* value; ``int`` for integer and bool tensors (exact
        even for 64-bit values), ``float`` otherwise.  NaN when there is no finite value
        (empty tensor, or only NaN/Inf).
    mean : float
        Mean of the finite values (float64 accumulation); NaN when there are none.
    std : float
        Population standard deviation (``ddof=0``) of the finite values; 0.0 for a single
        finite value, NaN when there are none.
    absmax : float or int
        ``max(abs(min), abs(max))``: largest magnitude among the finite values.
    nan_count, posinf_count, neginf_count : int
        NaN, +Inf and -Inf elements; they are counted, never mixed into the moments.
    zero_count : int
        Elements equal to zero; ``-0.0`` counts as zero.
    """

    count: int
    min: Number
    max: Number
    mean: float
    std: float
    absmax: Number
    nan_count: int
    posinf_count: int
    neginf_count: int
    zero_count: int

    @property
    def finite_count(self) -> int:
        """Elements that are neither NaN nor infinite (those the moments are taken over)."""
        return self.count - self.nan_count - self.posinf_count - self.neginf_count

    @classmethod
    def empty(cls) -> Stats:
        """Statistics of an empty tensor: the identity of :meth:`merge`."""
        nan = math.nan
        return cls(0, nan, nan, nan, nan, nan, 0, 0, 0, 0)

    def merge(self, other: Stats) -> Stats:
        """Statistics of the union of the two (disjoint) sets of elements.

        Lets statistics be computed chunk by chunk while a tensor streams in.  Counts, min,
        max and absmax merge exactly; mean and std with the pairwise update of Chan, Golub
        and LeVeque (M2 recovered as ``std**2 * n``, which costs about one ulp).
        """
        na, nb = self.finite_count, other.finite_count
        if nb == 0:
            mean, std, mn, mx = self.mean, self.std, self.min, self.max
        elif na == 0:
            mean, std, mn, mx = other.mean, other.std, other.min, other.max
        else:
            # the kernels' own merge (with its guard for means near the overflow threshold)
            n, mean, m2 = _k.chan(na, self.mean, self.std**2 * na, nb, other.mean, other.std**2 * nb)
            std = math.sqrt(m2 / n)
            mn = min(self.min, other.min)
            mx = max(self.max, other.max)
        absmax = max(abs(mn), abs(mx)) if na + nb else math.nan
        return Stats(
            self.count + other.count,
            mn,
            mx,
            mean,
            std,
            absmax,
            self.nan_count + other.nan_count,
            self.posinf_count + other.posinf_count,
            self.neginf_count + other.neginf_count,
            self.zero_count + other.zero_count,
        )


# --------------------------------------------------------------------------- float keys


_FLOAT_DTYPE = {kind: np.dtype(fmt[3]) for kind, fmt in FLOAT_FORMATS.items()}


def _kernel_format(kind: str) -> tuple[int, np.dtype]:
    """``fmt`` and the dtype of the values array that :func:`engine.numerics.kernels.fold_block`
    takes for float data of ``kind``: F16/BF16 as their ``uint16`` bit patterns."""
    if kind in _HALF:
        return (_k.F16 if kind == "F16" else _k.BF16), np.dtype(np.uint16)
    return _k.FLOAT, _FLOAT_DTYPE[kind]


def _decode_minmax(kind: str, max_i: int, min_i: int, max_u: int) -> tuple[float, float]:
    """Min and max float from the kernels' ordering keys.

    On the signed view of IEEE bit patterns, non-negative floats sort as their values and
    negative floats in reverse; on the unsigned view, every negative sorts above every
    non-negative, the most negative highest.  Hence max = the signed max if it is
    non-negative, else (all negative) the signed min; min = the unsigned max if it has the
    sign bit (some negative), else (all non-negative) the signed min.
    """
    it, ut, _, uc = float_consts(kind)
    sign = int(uc[2]) & ~int(uc[1])
    fdt = _FLOAT_DTYPE[kind]
    max_bits = np.array(max_i if max_i >= 0 else min_i, dtype=it)
    min_bits = np.array(max_u if max_u >= sign else min_i, dtype=ut)
    return float(min_bits.view(fdt)), float(max_bits.view(fdt))


# --------------------------------------------------------------------------- core


def _int_result(n, nzero, mean, m2, mn, mx) -> Stats:
    if n == 0:
        return Stats.empty()
    mn, mx = int(mn), int(mx)
    return Stats(int(n), mn, mx, float(mean), math.sqrt(m2 / n), max(abs(mn), abs(mx)), 0, 0, 0, int(nzero))


def _float_result(kind, nfin, nnan, npos, nneg, nzero, mean, m2, max_i, min_i, max_u) -> Stats:
    n = int(nfin) + int(nnan) + int(npos) + int(nneg)
    if n == 0:
        return Stats.empty()
    if nfin == 0:
        mn = mx = absmax = mean = std = math.nan
    else:
        mn, mx = _decode_minmax(kind, int(max_i), int(min_i), int(max_u))
        absmax = max(abs(mn), abs(mx))
        std = math.sqrt(m2 / nfin)
    return Stats(n, mn, mx, float(mean), std, absmax, int(nnan), int(npos), int(nneg), int(nzero))


def _stats_flat(flat: np.ndarray, kind: str, parallel: bool, block: int, tile: int) -> Stats:
    """Statistics of one C-contiguous 1-D array of safetensors dtype ``kind``."""
    if flat.size == 0:
        return Stats.empty()
    flat = readonly(flat)
    if kind in _INT:
        if kind == "BOOL":
            flat = flat.view(np.uint8)
        return _int_result(*_k.stats_int(flat, block, tile, parallel))
    it, ut, sc, uc = float_consts(kind)
    fmt, values = _kernel_format(kind)
    res = _k.stats_values(fmt, flat.view(values), flat.view(it), flat.view(ut), sc, uc, block, tile, parallel)
    return _float_result(kind, *res)


def stats_from_partials(kind: str, cnt, mom, skey, ukey) -> Stats:
    """:class:`Stats` of float data of format ``kind`` from partial-result rows (numpy
    arrays laid out as for :func:`engine.numerics.kernels.fold_block`, one row per block), such as
    the device kernels return."""
    return _float_result(kind, *_k.merge_float_blocks(cnt, mom, skey, ukey))


class Accumulator:
    """Statistics of one tensor fed piece by piece, as its bytes arrive.

    Parameters
    ----------
    kind : str
        The tensor's format dtype name, one of :data:`SUPPORTED_NAMES`.
    tile : int, optional
        Elements per cache-resident tile, as for :func:`stats`.

    Notes
    -----
    Pieces may come in any order (statistics do not depend on it) but must be whole
    elements.  One accumulator must not be fed from two threads at once: give each thread
    its own and combine their :meth:`result` with :meth:`Stats.merge`.  The kernels run
    without the GIL.  Copies of tensor bytes: :meth:`add` 0; :meth:`read` 1 (page cache to
    ``dest``, the same copy a plain read makes).
    """

    def __init__(self, kind: str, *, tile: int = TILE) -> None:
        if kind not in SUPPORTED_NAMES:
            raise TypeError(f"statistics support {', '.join(_SUPPORTED)} data, not {kind}")
        check_tunables(BLOCK, tile, CHUNK)
        self.kind = kind
        self.tile = tile
        self._mom = np.zeros(2)
        if kind in _INT:
            self._cnt = np.zeros(2, np.int64)
            self._ext = np.zeros(2, np.uint8 if kind == "BOOL" else _dt.numpy_dtype(_dt.code_of(kind)))
            self._itemsize = self._ext.itemsize
            return
        it, ut, self._sc, self._uc = float_consts(kind)
        self._itemsize = np.dtype(it).itemsize
        self._cnt = np.zeros(5, np.int64)
        self._skey = np.empty(2, it)
        self._ukey = np.empty(1, ut)
        _k.init_keys(self._sc, self._uc, self._skey, self._ukey)
        self._acc = _k.Acc(self._cnt, self._mom, self._skey, self._ukey)
        self._fmt, values = _kernel_format(kind)
        self._like = np.empty(0, values)  # carries the values' dtype into read_fold

    def add(self, data) -> None:
        """Fold a piece already in memory: a 1-D C-contiguous array of the tensor's dtype, or
        its raw bytes (any buffer)."""
        flat = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
        if flat.size == 0:
            return
        if self.kind in _INT:
            x = flat.view(self._ext.dtype)
            _k.int_block(x, 0, x.size, self.tile, self._cnt, self._mom, self._ext)
            return
        f = flat.view(self._like.dtype)
        _k.fold_block(self._fmt, f, flat.view(self._sc.dtype), flat.view(self._uc.dtype), self._sc, self._uc, 0,
                      f.size, self.tile, self._acc)

    def read(self, fd: int, offset: int, dest: np.ndarray, window: int) -> int:
        """Read ``dest.size`` bytes of the file ``fd`` at ``offset`` into the byte array
        ``dest``, folding every ``window`` bytes as soon as they land, while they are still
        in the CPU cache.

        Returns the number of bytes read and folded: ``dest.size``, or fewer when a read
        came up short or failed; the caller then reads the rest itself (to raise the
        error with its reason) and passes it to :meth:`add`.  ``window`` must be a
        multiple of 64.
        """
        if window <= 0 or window % 64:
            raise ValueError(f"window must be a positive multiple of 64, got {window}")
        if not (isinstance(dest, np.ndarray) and dest.dtype == np.uint8 and dest.ndim == 1
                and dest.flags.c_contiguous and dest.flags.writeable):
            raise TypeError("dest must be a writable, C-contiguous 1-D uint8 numpy array")
        if dest.size % self._itemsize:
            raise ValueError(f"dest holds {dest.size} bytes, not a whole number of {self.kind} elements")
        if self.kind in _INT:
            return _k.read_fold_int(fd, offset, dest, window, self.tile, self._cnt, self._mom, self._ext)
        return _k.read_fold(fd, offset, dest, window, self._fmt, self._like, self._sc, self._uc, self.tile, self._acc)

    def result(self) -> Stats:
        """Statistics of everything folded so far."""
        if self.kind in _INT:
            return _int_result(self._cnt[0], self._cnt[1], self._mom[0], self._mom[1], self._ext[0], self._ext[1])
        c = self._cnt
        return _float_result(self.kind, c[0], c[1], c[2], c[3], c[4], self._mom[0], self._mom[1], self._skey[0],
                             self._skey[1], self._ukey[0])


_SUPPORTED = _FLOAT + _HALF + _INT
#: Format dtype names (``"BF16"``, ``"I64"``, ...) that :func:`stats` summarises.
SUPPORTED_NAMES = frozenset(_SUPPORTED)


def stats(
    x: Any,
    *,
    threads: int | None = None,
    block: int = BLOCK,
    tile: int = TILE,
    chunk: int = CHUNK,
) -> Stats:
    """Count, min, max, mean, std, absmax, NaN/Inf and zero counts of a tensor, in one pass.

    Parameters
    ----------
    x : numpy.ndarray, torch.Tensor or array-like
        F64, F32, F16 or BF16 (``ml_dtypes.bfloat16`` or ``torch.bfloat16``) values, any
        integer dtype, or bool.  Any shape, including 0-d and empty; any strides; read-only
        arrays are fine.  A torch tensor must be on the CPU; torch is imported only when a
        tensor is passed.
    threads : int, optional
        Threads of Numba's pool to use; default all of them.  ``threads=1`` runs on the
        calling thread only (with the GIL released): use it when calling from several
        threads of your own.
    block : int, optional
        Elements per parallel task.
    tile : int, optional
        Elements per cache-resident tile (the unit of the two sweeps described in Notes).
    chunk : int, optional
        Elements per contiguous copy of a non-contiguous input.

    Returns
    -------
    Stats
        ``min``/``max``/``absmax`` are ``int`` for integer and bool inputs, ``float``
        otherwise; see :class:`Stats` for what each field means for empty tensors and
        tensors without finite values.

    Raises
    ------
    TypeError
        Unsupported dtype (complex, FP8, sub-byte, object...).
    DeviceError
        A torch tensor that is not on the CPU.
    ValueError
        A tunable that is not a positive integer.

    Notes
    -----
    NaN, +Inf and -Inf are counted, not mixed into the moments: ``min``, ``max``,
    ``absmax``, ``mean`` and ``std`` are over the finite values only.  ``std`` is the
    population standard deviation (``ddof=0``).

    Each tile is swept twice while it sits in L1: once on the integer bit patterns (min,
    max, zeros, and detection of NaN/Inf, all vectorized without fast-math), once on the
    values for the float64 sums.  Data near zero (weights) is summed without a shift and
    each block checks that ``sum(x**2) <= 256 * M2``, i.e. that the subtraction in
    ``M2 = sum(x**2) - n * mean**2`` loses at most 8 bits; a block that fails the check, and
    later blocks of data like it, are summed tile by tile around each tile's first value,
    which bounds the loss by ``log2(2 * tile)`` bits.  Tiles and blocks merge with Chan's
    pairwise update, so the result is accurate for any size (relative error of mean and std
    about 1e-12 or better for float32 data).

    To summarise a tensor that arrives in pieces (from a file, a socket...), feed an
    :class:`Accumulator`.

    Memory and copies: none for C- or F-contiguous inputs (numpy, ml_dtypes and torch
    inputs are read in place through zero-copy views; F16/BF16 are widened a tile at a time
    into a per-thread float32 scratch buffer of ``tile`` elements).  Other layouts, and
    non-native byte order, are copied piece by piece: about ``chunk`` elements at a time,
    whole rows of the first axis where they fit.

    Statistics of several chunks of one tensor merge with :meth:`Stats.merge`.

    Float64 data whose spread exceeds the float64 range (values near +-1.8e308 of both
    signs) gets ``std = inf``, as with NumPy: the variance itself overflows.
    """
    check_tunables(block, tile, chunk)
    a, _ = as_numpy(x)
    kind = kind_of(a.dtype, _SUPPORTED, "stats()")
    result = Stats.empty()
    with pool(threads, a.size, block) as parallel:
        for _, piece in pieces(a, chunk, any_order=True):
            result = result.merge(_stats_flat(piece.reshape(-1), kind, parallel, block, tile))
    return result
